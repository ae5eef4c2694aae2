"""The whole copy (``guideloom.storage._cache._copy``): what it puts on disk, in what order, and the
reads it serves while in progress.

``cache_dir`` over a real object store, through the loader, is in
``tests/storage/remote/test_cache_remote.py``."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom
from guideloom.storage._cache import _copy as _cache
from guideloom.storage._cache import _copy_download
from guideloom.storage._cache._copy import DatasetCache, copy_footprint


def test_the_copy_is_on_disk_before_the_folder_that_says_complete_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every data file, the manifest and the folder are fsynced before the rename that makes the
    copy look complete (after a crash, sizes alone would pass for data), and the rename after it."""
    manifest = guideloom.write_stream(tmp_path / "ds", np.arange(50_000, dtype=np.uint16), shard_bytes=30_000)
    data = {f.path: (tmp_path / "ds" / f.path).read_bytes() for f in manifest.tokens.files}
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    (tmp_path / "c").mkdir()
    cache = DatasetCache(tmp_path / "c", "s3://bucket/ds", manifest, lambda p, s, e: data[p][s:e])
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache._download()
    monkeypatch.undo()
    assert (cache.folder / "manifest.json").is_file()
    partial = str(cache.folder) + ".partial"
    done = events.index(("replace", str(cache.folder)))
    synced = {path for kind, path in events[:done] if kind == "fsync"}
    want = {f"{partial}/{f.path}" for f in manifest.tokens.files} | {f"{partial}/manifest.json", partial}
    assert want <= synced, sorted(want - synced)
    assert ("fsync", str(cache.root)) in events[done:]
    for f in manifest.tokens.files:
        assert (cache.folder / f.path).read_bytes() == data[f.path]
    assert sum(-(-p.stat().st_size // 4096) * 4096 for p in cache.folder.iterdir()) <= copy_footprint(
        manifest
    )


def _cache_over(
    tmp_path: Path, fetch: Callable[[str, int, int], Any]
) -> tuple[DatasetCache, dict[str, bytes]]:
    """A copy of a three-object stream in parts of 4 KiB (20,000 bytes an object: 5 parts each)."""
    manifest = guideloom.write_stream(tmp_path / "ds", np.arange(30_000, dtype=np.uint16), shard_bytes=20_000)
    data = {f.path: (tmp_path / "ds" / f.path).read_bytes() for f in manifest.tokens.files}
    (tmp_path / "c").mkdir()
    return DatasetCache(tmp_path / "c", "s3://bucket/ds", manifest, fetch), data


def test_the_copy_serves_the_ranges_of_the_parts_it_has_written_and_waits_for_those_on_their_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    monkeypatch.setattr(_copy_download, "PARTS_IN_FLIGHT", 1)
    gates: dict[tuple[str, int], threading.Event] = {}
    fetching: queue.Queue[tuple[str, int]] = queue.Queue()

    def fetch(path: str, start: int, end: int) -> bytes:
        fetching.put((path, start))
        assert gates.setdefault((path, start), threading.Event()).wait(30)
        return data[path][start:end]

    cache, data = _cache_over(tmp_path, fetch)
    first, last = cache.table.paths[0], cache.table.paths[-1]
    assert cache.read(last, 19_000, 19_010) is None, "no copy in progress: nothing to read"
    download = threading.Thread(target=cache._download)
    download.start()
    try:
        assert fetching.get(timeout=30) == (first, 0)
        gates[(first, 0)].set()
        assert fetching.get(timeout=30) == (first, 4096)  # part 0 is written
        got = cache.read(first, 100, 4000)
        assert got is not None and got.tobytes() == data[first][100:4000]
        t0 = time.monotonic()
        assert cache.read(first, 4000, 4200) is None, "part 1 is on its way: waited for, a while"
        assert time.monotonic() - t0 >= _cache.PART_WAIT_SECONDS * 0.9
        assert cache.read(first, 9000, 9100) is None, "part 2 is not on its way: no wait"
        later: list[Any] = []
        reader = threading.Thread(target=lambda: later.append(cache.read(first, 4000, 4200)))
        reader.start()
        time.sleep(0.05)
        gates[(first, 4096)].set()  # the waiting read is served once its part is written
        reader.join(30)
        assert later[0] is not None and later[0].tobytes() == data[first][4000:4200]
        # Part 2 was read remotely (fetched last): part 3 comes next. A dense read of a part not
        # on its way (part 6, the second object's) has it fetched next, and waits for it.
        assert fetching.get(timeout=30) == (first, 3 * 4096)
        second = cache.table.paths[1]
        dense: list[Any] = []
        reader = threading.Thread(target=lambda: dense.append(cache.read(second, 4096, 4096 + 2000)))
        reader.start()
        time.sleep(0.05)
        gates[(first, 3 * 4096)].set()
        assert fetching.get(timeout=30) == (second, 4096)
        gates[(second, 4096)].set()
        reader.join(30)
        assert dense[0] is not None and dense[0].tobytes() == data[second][4096:6096]
        assert cache.stats()["cache_local_ranges"] == 3 and cache.stats()["cache_remote_ranges"] == 3
    finally:
        for path in cache.table.paths:
            for start in range(0, len(data[path]), 4096):
                gates.setdefault((path, start), threading.Event()).set()
        download.join(30)
    assert (cache.folder / "manifest.json").is_file()
    done = cache.read(first, 5000, 9000)  # a read planned before the storage switched to the copy
    assert done is not None and done.tobytes() == data[first][5000:9000]


def test_the_copy_fetches_the_planned_parts_first_and_those_read_remotely_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    monkeypatch.setattr(_copy_download, "PARTS_IN_FLIGHT", 1)
    order: list[int] = []

    def fetch(path: str, start: int, end: int) -> bytes:
        gid = cache.table.gids(path, start, end)[0]
        if not order:  # the loader reads a row of part 3 remotely while the first part comes down
            p3, s3, _e3 = cache.table.span(3)
            assert cache.read(cache.table.paths[p3], s3, s3 + 100) is None
        order.append(gid)
        return data[path][start:end]

    cache, data = _cache_over(tmp_path, fetch)
    assert cache.table.count == 15
    cache.plan(iter([np.asarray([7, 12], np.int64), np.asarray([12, 3, 1], np.int64)]))
    cache._download()
    assert order == [7, 12, 1, 0, 2, 4, 5, 6, 8, 9, 10, 11, 13, 14, 3]
    assert cache.stats()["cache_downloads"] == 15
    assert (cache.folder / "manifest.json").is_file()


def test_an_object_is_checked_as_soon_as_its_last_part_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged object stops the copy (and is refused) when its parts are down, not after the
    whole dataset."""
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    monkeypatch.setattr(_copy_download, "PARTS_IN_FLIGHT", 1)
    fetched: list[str] = []

    def fetch(path: str, start: int, end: int) -> bytes:
        fetched.append(path)
        body = bytearray(data[path][start:end])
        if path == first and start == 0:
            body[7] ^= 0xFF  # the store serves other bytes than the manifest's
        return bytes(body)

    cache, data = _cache_over(tmp_path, fetch)
    first = cache.table.paths[0]
    cache.first_read.set()
    cache._run()
    assert (
        cache.damaged is not None
        and first in cache.damaged
        and "does not match its checksum" in cache.damaged
    )
    assert set(fetched) == {first}, "the other objects were not fetched"
    assert cache.read(first, 4096, 8192) is None and not (cache.folder / "manifest.json").exists()


def _damage(path: Path, at: int) -> None:
    """Flip a byte of ``path`` in place, its modification time kept (bit rot)."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_part_of_the_copy_in_progress_damaged_on_disk_is_read_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    monkeypatch.setattr(_copy_download, "PARTS_IN_FLIGHT", 1)
    gate = threading.Event()
    written = threading.Event()

    def fetch(path: str, start: int, end: int) -> bytes:
        if (path, start) != (first, 0):
            written.set()
            assert gate.wait(30)
        return data[path][start:end]

    cache, data = _cache_over(tmp_path, fetch)
    first = cache.table.paths[0]
    download = threading.Thread(target=cache._download)
    download.start()
    try:
        assert written.wait(30)  # part 0 is written: the download waits on part 1
        got = cache.read(first, 100, 4000)
        assert got is not None and got.tobytes() == data[first][100:4000]
        _damage(Path(str(cache.folder) + ".partial") / first, 200)
        assert cache.read(first, 100, 4000) is None, "the damaged part is read from the store"
    finally:
        gate.set()
        download.join(30)


def test_the_copys_block_digests_are_those_of_the_bytes_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy damaged on disk after its checksums matched, before its manifest is written, is
    found damaged when checked, never used (as a copy too large to hash whole on open is)."""
    from guideloom.storage._local import _check

    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    cache, data = _cache_over(tmp_path, lambda p, s, e: data[p][s:e])
    real = _copy_download._with_blocks

    def damaged_first(manifest: Any, folder: Path, *rest: Any) -> Any:
        _damage(folder / cache.table.paths[1], 5000)
        return real(manifest, folder, *rest)

    monkeypatch.setattr(_copy_download, "_with_blocks", damaged_first)
    cache._download()
    assert (cache.folder / "manifest.json").is_file()
    assert cache.checked_copy() is None
    assert cache.copy_damaged is not None and cache.table.paths[1] in cache.copy_damaged


def test_an_abort_while_the_download_starts_waits_for_it_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``abort()`` from another thread while ``start()`` starts the download thread: it waits for
    the start and then for the thread, never joining a thread not yet started."""
    cache, data = _cache_over(tmp_path, lambda p, s, e: data[p][s:e])
    starting = threading.Event()
    real = threading.Thread

    class SlowStart(real):  # type: ignore[misc, valid-type]
        def start(self) -> None:
            if self.name == "guideloom-cache":  # the download's own thread
                starting.set()
                time.sleep(0.3)  # an abort comes meanwhile
            super().start()

    monkeypatch.setattr(_copy_download.threading, "Thread", SlowStart)
    errors: list[BaseException] = []

    def abort() -> None:
        starting.wait(10)
        try:
            cache.abort()
        except BaseException as exc:
            errors.append(exc)

    aborter = real(target=abort)
    aborter.start()
    cache.start()
    aborter.join(30)
    monkeypatch.undo()
    assert errors == []
    assert not cache.running()
