"""``cache_dir``: a remote dataset copied to a local folder in the background, then read locally."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache import _copy as _cache
from guideloom.storage._cache import _copy_download
from guideloom.storage._remote._storage import ObjectStreamStorage
from guideloom_dev.servers import MotoS3, Nginx
from tests.support.loader import assert_same
from tests.support.remote import BUCKET, Copies, all_batches, collate, loader_over, unique

CPU = torch.device("cpu")


def wait_for_copy(storage: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not storage.reads_inline():
        assert time.monotonic() < deadline, "the local copy did not complete"
        time.sleep(0.02)


def test_a_cached_dataset_is_copied_then_read_locally(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    expected = all_batches(guideloom.open_stream(plain_copies.local))
    storage = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    assert isinstance(storage, ObjectStreamStorage) and not storage.reads_inline()
    asyncio.run(storage.open())
    wait_for_copy(storage)
    folder = Path(storage.cache_folder or "")
    assert folder.parent == tmp_path and (folder / "manifest.json").is_file()
    assert guideloom.verify_dataset(folder) == storage.manifest  # every checksum matches
    before = storage.stats()["requests"]
    got = all_batches(storage)
    assert storage.stats()["requests"] == before, "a complete copy is read locally: no request"
    assert_same(expected, got)
    assert not list(tmp_path.glob("*.partial"))
    # Opened again (another job on the node): the copy is found at once.
    again = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    asyncio.run(again.open())
    assert again.reads_inline()
    asyncio.run(again.close())


def test_the_loader_switches_to_the_copy_mid_epoch_without_changing_the_batches(
    plain_copies: Copies, nginx: Nginx, tmp_path: Path
) -> None:
    url = f"{nginx.url}/{plain_copies.http_path}"
    kw: dict[str, Any] = dict(sequence_length=50, local_batch_size=2, shuffle=True, shuffle_seed=3)
    expected = all_batches(guideloom.open_stream(plain_copies.local), **kw)
    storage = guideloom.open_stream(url, cache_dir=tmp_path)
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    go = threading.Event()
    fetch = storage._cache._fetch

    def held_back(path: str, start: int, end: int) -> Any:
        assert go.wait(30)
        return fetch(path, start, end)

    storage._cache._fetch = held_back  # the copy completes only once three batches are in
    loader = StatefulDataLoader.from_storage(storage, collate, device=CPU, **kw)
    got, modes = [], []
    with loader:
        it = iter(loader)
        for b in it:
            got.append(b)
            modes.append(it._driver.reads_inline)  # type: ignore[union-attr]
            if len(got) == 3:
                go.set()
                wait_for_copy(storage)
    assert_same(expected, got)
    assert modes[:3] == [False] * 3 and all(modes[3:]), "remote until the copy is complete, then inline"
    assert loader.state_dict()["epoch"] == 1


def hold_before_complete(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold the whole copy once every part is written and checked, before its manifest is (the
    folder would appear, and reads switch to it): returns (every part written, go on)."""
    written, go = threading.Event(), threading.Event()
    real = _copy_download.write_synced

    def held(path: Any, data: bytes) -> None:
        written.set()
        assert go.wait(30)
        real(path, data)

    monkeypatch.setattr(_copy_download, "write_synced", held)
    return written, go


@pytest.mark.parametrize("server", ["s3", "http"])
def test_the_first_epoch_reads_the_parts_the_copy_has_written_from_it_not_from_the_store(
    server: str,
    plain_copies: Copies,
    s3: MotoS3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    if server == "s3":
        url, opts = plain_copies.s3_url, s3.options()
    else:
        url, opts = f"{request.getfixturevalue('nginx').url}/{plain_copies.http_path}", {}
    kw: dict[str, Any] = dict(
        sequence_length=100, local_batch_size=4, shuffle=True, shuffle_seed=11, prefetch=2
    )
    expected = all_batches(guideloom.open_stream(plain_copies.local), **kw)
    plain = guideloom.open_stream(url, **opts)
    assert isinstance(plain, ObjectStreamStorage)
    plain.read_window_bytes = 4000  # windows of a few batches: the reads go on all epoch
    assert_same(expected, all_batches(plain, **kw))
    without = plain.stats()["bytes_read"]  # an epoch's GETs with no cache
    storage = guideloom.open_stream(url, cache_dir=tmp_path, **opts)
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    storage.read_window_bytes = 4000
    fetch, copied = storage._cache._fetch, [0]

    def counted(path: str, start: int, end: int) -> Any:
        data = fetch(path, start, end)
        copied[0] += end - start
        return data

    storage._cache._fetch = counted
    written, go = hold_before_complete(monkeypatch)
    got: list[Any] = []
    with loader_over(storage, **kw) as loader:
        for batch in loader:
            got.append(batch)
            if len(got) == 1:
                assert written.wait(30)  # the copy is written, not complete: in progress
    assert not storage.reads_inline()
    go.set()
    assert_same(expected, got)
    loader_bytes = storage.stats()["bytes_read"] - copied[0]
    assert loader_bytes < without / 2, (loader_bytes, without)
    assert storage.stats()["cache_local_ranges"] > 0
    assert storage._cache._done.wait(30) and storage._cache.error is None
    assert (Path(storage.cache_folder or "") / "manifest.json").is_file()


def test_a_copy_that_does_not_match_its_checksums_is_refused_not_read_from_the_store(
    tmp_path: Path, s3: MotoS3
) -> None:
    folder = tmp_path / "ds"
    tokens = np.arange(20_000, dtype=np.uint16)
    guideloom.write_stream(folder, tokens, shard_bytes=16_000)
    prefix = unique("corrupt")
    s3.upload_folder(folder, BUCKET, prefix)
    shard = sorted(p for p in folder.iterdir() if p.suffix == ".bin")[0]
    damaged = bytearray(shard.read_bytes())
    damaged[100] ^= 0xFF  # same size: open_stream's size checks pass, the checksum does not
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{shard.name}", Body=bytes(damaged))
    cache = tmp_path / "cache"
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", cache_dir=cache, **s3.options())
    asyncio.run(storage.open())
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    storage._cache._done.wait(30)
    assert not storage.reads_inline()  # no warning: the dataset is refused, not read remotely
    for _ in range(2):  # every read, not only the first
        with pytest.raises(DatasetIntegrityError, match=rf"{shard.name}.*does not match its checksum"):
            asyncio.run(storage.read_many(np.arange(0, 200, 100, dtype=np.int64), 100))
    assert not any(p.name.endswith(".partial") for p in cache.iterdir())
    assert not (Path(storage.cache_folder or "") / "manifest.json").exists()
    asyncio.run(storage.close())


def test_one_process_downloads_while_another_waits_for_the_folder(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cache, "POLL_SECONDS", 0.01)
    first = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    second = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    assert isinstance(first, ObjectStreamStorage) and isinstance(second, ObjectStreamStorage)
    assert first.cache_folder == second.cache_folder
    assert first._cache is not None and second._cache is not None
    with first._cache._lock() as held:  # as if another process were downloading
        assert held
        asyncio.run(second.open())
        second._cache._done.wait(30)
        assert not second.reads_inline() and second._cache.error is None
    asyncio.run(first.open())  # the lock is free now: this one downloads
    wait_for_copy(first)
    wait_for_copy(second)  # and the other one finds the folder
    assert_same(all_batches(first), all_batches(second))


def test_a_copy_goes_on_across_close_and_reopen(
    plain_copies: Copies, nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader outside ``with`` opens and closes its storage each epoch: the copy must not
    start over each time."""
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    storage = guideloom.open_stream(f"{nginx.url}/{plain_copies.http_path}", cache_dir=tmp_path)
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    go = threading.Event()
    fetch = storage._cache._fetch
    calls: list[tuple[str, int]] = []

    def held_back(path: str, start: int, end: int) -> Any:
        calls.append((path, start))
        assert go.wait(30)
        return fetch(path, start, end)

    storage._cache._fetch = held_back
    asyncio.run(storage.open())
    thread = storage._cache._thread
    asyncio.run(storage.close())
    asyncio.run(storage.open())
    assert storage._cache._thread is thread and thread is not None and thread.is_alive()
    go.set()
    wait_for_copy(storage)
    assert len(calls) == len(set(calls)), "no part was fetched twice"
    asyncio.run(storage.close())


def test_interpreter_exit_stops_a_copy_and_leaves_no_partial_folder(
    plain_copies: Copies, nginx: Nginx, tmp_path: Path
) -> None:
    script = f"""
import asyncio, time
import guideloom
from guideloom.storage._cache import _copy as _cache
_cache.PART_BYTES = 1024
s = guideloom.open_stream({f"{nginx.url}/{plain_copies.http_path}"!r}, cache_dir={str(tmp_path)!r})
slow = s._cache._fetch
def fetch(path, start, end):
    time.sleep(0.05)
    return slow(path, start, end)
s._cache._fetch = fetch
asyncio.run(s.open())
time.sleep(0.3)
print("exiting", flush=True)
"""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "exiting" in proc.stdout
    assert time.monotonic() - t0 < 30
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.is_dir()], "an interrupted copy leaves no folder"


def test_a_damaged_complete_copy_warns_and_reads_remotely(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    first = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    asyncio.run(first.open())
    wait_for_copy(first)
    asyncio.run(first.close())
    folder = Path(first.cache_folder or "")
    victim = sorted(p for p in folder.iterdir() if p.suffix == ".bin")[0]
    victim.unlink()  # evicted by something else
    again = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    asyncio.run(again.open())
    with pytest.warns(RuntimeWarning, match="is damaged.*nothing is lost"):
        assert not again.reads_inline()
    asyncio.run(again.close())
    got = all_batches(again)  # no second warning (warnings are errors here), remote reads
    assert_same(all_batches(guideloom.open_stream(plain_copies.local)), got)


def test_cached_documents_read_locally(tmp_path: Path, s3: MotoS3) -> None:
    docs = [np.arange(n, dtype=np.uint32) for n in (5, 0, 17, 3, 9)]
    folder = tmp_path / "docs"
    guideloom.write_documents(folder, docs)
    prefix = unique("cached-docs")
    s3.upload_folder(folder, BUCKET, prefix)
    storage = guideloom.open_documents(f"s3://{BUCKET}/{prefix}", cache_dir=tmp_path / "c", **s3.options())

    async def read() -> list[list[int]]:
        async with storage:
            wait_for_copy(storage)
            return [d.tolist() for d in await storage.read_many(np.asarray([2, 1, 4], dtype=np.int64))]

    assert asyncio.run(read()) == [docs[2].tolist(), [], docs[4].tolist()]


def test_cache_dir_must_be_a_path(plain_copies: Copies, s3: MotoS3) -> None:
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        guideloom.open_stream(plain_copies.s3_url, cache_dir=3, **s3.options())


def test_an_unwritable_cache_dir_warns_and_reads_remotely(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    storage = guideloom.open_stream(plain_copies.s3_url, cache_dir=blocker / "cache", **s3.options())
    asyncio.run(storage.open())
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    storage._cache._done.wait(30)
    with pytest.warns(RuntimeWarning, match="could not copy"):
        storage.reads_inline()
    got = all_batches(storage)  # no second warning (warnings are errors in this suite)
    assert_same(all_batches(guideloom.open_stream(plain_copies.local)), got)


def test_a_cache_dir_without_room_for_the_copy_warns_and_reads_remotely(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shutil.disk_usage

    def little_space(path: Any) -> Any:
        usage = real(path)
        return usage._replace(free=1000)

    monkeypatch.setattr(_cache.shutil, "disk_usage", little_space)
    storage = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    asyncio.run(storage.open())
    assert isinstance(storage, ObjectStreamStorage) and storage._cache is not None
    storage._cache._done.wait(30)
    with pytest.warns(RuntimeWarning, match="1,000 bytes free and the copy needs 80,000"):
        assert not storage.reads_inline()
    assert not any(tmp_path.glob("*.partial")) and not Path(storage.cache_folder or "").exists()
    asyncio.run(storage.close())


def test_a_waiting_process_takes_over_when_the_downloader_gives_up(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cache, "POLL_SECONDS", 0.01)
    holder = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    waiter = guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, **s3.options())
    assert isinstance(holder, ObjectStreamStorage) and isinstance(waiter, ObjectStreamStorage)
    assert holder._cache is not None and waiter._cache is not None
    with holder._cache._lock():  # another process downloads ...
        asyncio.run(waiter.open())
        waiter._cache._done.wait(30)
        assert not waiter.reads_inline()
    # ... and exits without a copy: the waiter downloads it itself
    wait_for_copy(waiter)
    asyncio.run(waiter.close())
