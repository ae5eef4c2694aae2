"""Objects replaced on the store after a dataset was opened: refused, never read as data.

Against each server the suite starts (moto S3, nginx), with and without each cache mode, for a
replacement of the same size and of another size, made before the loader opens the storage and
in the middle of an epoch. Every batch delivered is the dataset's; the first read that meets the
changed object raises :class:`DatasetIntegrityError` naming it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache import _copy as _cache
from guideloom.storage._cache._copy import copy_footprint
from guideloom.storage._remote._storage import ObjectStreamStorage
from guideloom_dev.servers import MotoS3, Nginx
from tests.support.remote import BUCKET, collate, unique

CPU = torch.device("cpu")
KW: dict[str, Any] = dict(sequence_length=100, local_batch_size=4, shuffle=True, shuffle_seed=5, prefetch=2)


class Dataset:
    """A small stream of three objects on one server, and a way to replace one of them."""

    def __init__(self, tmp_path: Path, server: str, s3: MotoS3, www: Path, nginx: Nginx) -> None:
        self.local = tmp_path / "ds"
        tokens = np.random.default_rng(3).integers(0, 60_000, 20_000, dtype=np.uint16)
        guideloom.write_stream(self.local, tokens, shard_bytes=16_000)
        self.shard = sorted(p.name for p in self.local.iterdir() if p.suffix == ".bin")[0]
        self.server = server
        name = unique("integrity")
        if server == "s3":
            s3.upload_folder(self.local, BUCKET, name)
            self.url, self.options = f"s3://{BUCKET}/{name}", s3.options()
            self._put: Callable[[bytes], None] = lambda body: s3.client().put_object(
                Bucket=BUCKET, Key=f"{name}/{self.shard}", Body=body
            )
        else:
            shutil.copytree(self.local, www / name)
            self.url, self.options = f"{nginx.url}/{name}", {}
            self._put = lambda body: self._put_file(www / name / self.shard, body)

    @staticmethod
    def _put_file(path: Path, body: bytes) -> None:
        # nginx's ETag is the modification time (in seconds) and the size: a replacement is a
        # new file with a later time, as any copy tool that rewrites it would leave.
        st = path.stat()
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(body)
        os.utime(tmp, (st.st_atime + 10, st.st_mtime + 10))
        os.replace(tmp, path)

    def replace(self, same_size: bool) -> None:
        body = bytearray((self.local / self.shard).read_bytes())
        for i in range(0, len(body), 2):
            body[i] ^= 0x5A  # every token differs
        self._put(bytes(body) if same_size else bytes(body) + b"\0\0")

    def open(self, cache: str, root: Path) -> ObjectStreamStorage:
        opts: dict[str, Any] = dict(self.options)
        if cache != "none":
            opts["cache_dir"] = root
        if cache == "chunks":
            opts["cache_max_bytes"] = copy_footprint(guideloom.open_stream(self.local).manifest) // 4
            opts["cache_chunk_bytes"] = 4096
        storage = guideloom.open_stream(self.url, **opts)
        assert isinstance(storage, ObjectStreamStorage)
        assert (storage._cache is not None) == (cache == "copy")
        assert (storage._chunks is not None) == (cache == "chunks")
        storage.read_window_bytes = 4000  # windows of a few batches: reads go on all epoch
        return storage


def hold_cache_downloads(storage: ObjectStreamStorage) -> threading.Event:
    """Hold the cache's downloads until the returned event is set (the copy would otherwise be
    complete, and read locally, before the object is replaced)."""
    go = threading.Event()
    if storage._cache is not None:
        owner: Any = storage._cache
    elif storage._chunks is not None:
        owner = storage._chunks._downloader
    else:
        go.set()
        return go
    fetch = owner._fetch

    def held(path: str, start: int, end: int) -> Any:
        assert go.wait(30)
        return fetch(path, start, end)

    owner._fetch = held
    return go


@pytest.fixture(params=["s3", "http"])
def server(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("cache", ["none", "copy", "chunks"])
@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
@pytest.mark.parametrize("when", ["before-open", "mid-epoch"])
def test_a_replaced_object_is_refused_never_read(
    server: str,
    cache: str,
    same_size: bool,
    when: str,
    tmp_path: Path,
    s3: MotoS3,
    www: Path,
    request: pytest.FixtureRequest,
) -> None:
    nginx: Nginx = request.getfixturevalue("nginx") if server == "http" else None  # type: ignore[assignment]
    ds = Dataset(tmp_path, server, s3, www, nginx)
    with StatefulDataLoader.from_storage(
        guideloom.open_stream(ds.local), collate, device=CPU, **KW
    ) as loader:
        expected = list(loader)
    storage = ds.open(cache, tmp_path / "cache")
    go = hold_cache_downloads(storage)
    got: list[Any] = []
    with (
        pytest.raises(DatasetIntegrityError, match=ds.shard),
        StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW) as loader,
    ):
        if when == "before-open":
            ds.replace(same_size)
            go.set()
        for batch in loader:
            got.append(batch)
            if len(got) == 2 and when == "mid-epoch":
                ds.replace(same_size)
                go.set()
    go.set()
    assert len(expected) > 0 and len(got) < len(expected)
    for i, batch in enumerate(got):
        assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
    asyncio.run(storage.close())


def test_an_object_replaced_while_the_copy_serves_reads_is_refused_never_read(
    server: str,
    tmp_path: Path,
    s3: MotoS3,
    www: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy in progress serves the parts it has written (the other objects'), while the
    object it has not copied yet is replaced (same size) on the store: the first read that meets
    it is refused, and every batch delivered before is the dataset's."""
    monkeypatch.setattr(_cache, "PART_BYTES", 4096)
    nginx: Nginx = request.getfixturevalue("nginx") if server == "http" else None  # type: ignore[assignment]
    ds = Dataset(tmp_path, server, s3, www, nginx)
    with StatefulDataLoader.from_storage(
        guideloom.open_stream(ds.local), collate, device=CPU, **KW
    ) as loader:
        expected = list(loader)
    storage = ds.open("copy", tmp_path / "cache")
    assert storage._cache is not None
    cache, go = storage._cache, threading.Event()
    fetch = cache._fetch

    def all_but_the_shard(path: str, start: int, end: int) -> Any:
        if path == ds.shard:
            assert go.wait(30)
        return fetch(path, start, end)

    cache._fetch = all_but_the_shard
    others = sum(1 for g in range(cache.table.count) if cache.table.paths[cache.table.span(g)[0]] != ds.shard)
    got: list[Any] = []
    replaced_at = 0
    with (
        pytest.raises(DatasetIntegrityError, match=ds.shard),
        StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW) as loader,
    ):
        for batch in loader:
            got.append(batch)
            if len(got) == 1:
                deadline = time.monotonic() + 30
                while cache.stats()["cache_downloads"] < others:  # the other objects are written
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            if not replaced_at and cache.stats()["cache_local_ranges"] > 0:
                replaced_at = len(got)  # reads were served from the copy: now replace the object
                ds.replace(same_size=True)
                go.set()
    go.set()
    assert replaced_at > 0, "no range was read from the copy in progress"
    assert replaced_at <= len(got) < len(expected)
    for i, batch in enumerate(got):
        assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
    # the refusal is kept: by the copy (its download met the object first), by the connection
    # (the whole dataset), or for that object alone (a read met it first)
    remote = storage._remote
    assert cache.damaged is not None or remote.damaged is not None or ds.shard in remote.refused
    asyncio.run(storage.close())


#: Samples of 51 tokens, batches of 3: a batch's tokens straddle an object's start.
SEQ, BATCH = 51, 3


@pytest.mark.parametrize("change", ["delete", "replace"])
@pytest.mark.parametrize("way", [{}, {"prefetch": 2}], ids=["inline", "prefetch"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_object_gone_after_open_fails_at_the_first_batch_that_needs_it(
    change: str, way: dict[str, Any], mode: str, tmp_path: Path, s3: MotoS3
) -> None:
    """An object deleted (or replaced) after the storage was opened, before the epoch: every
    batch before the first that needs it is delivered, and the error comes at that batch, not
    at the first batch of a read window or read ahead that touches the object."""
    local = tmp_path / "ds"
    tokens = np.random.default_rng(11).integers(0, 60_000, 20_000, dtype=np.uint16)
    guideloom.write_stream(local, tokens, shard_bytes=8_000)  # 4000 tokens an object
    shards = sorted(p.name for p in local.iterdir() if p.suffix == ".bin")
    assert len(shards) == 5
    name = unique("gone")
    s3.upload_folder(local, BUCKET, name)
    kw: dict[str, Any] = dict(sequence_length=SEQ, local_batch_size=BATCH, device=CPU, **way)
    with StatefulDataLoader.from_storage(guideloom.open_stream(local), collate, **kw) as loader:
        expected = list(loader)
    first_need = (3 * 4000 // SEQ) // BATCH  # the first batch holding a token of object 3
    assert 1 < first_need < len(expected) - 1

    storage = guideloom.open_stream(f"s3://{BUCKET}/{name}", **s3.options())
    key = f"{name}/{shards[3]}"
    if change == "delete":
        s3.client().delete_object(Bucket=BUCKET, Key=key)
    else:
        body = (local / shards[3]).read_bytes()
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(b ^ 0x5A for b in body))
    got: list[Any] = []
    loader = StatefulDataLoader.from_storage(storage, collate, **kw)

    async def consume() -> None:
        async with loader:
            async for batch in loader:
                got.append(batch)

    with pytest.raises(DatasetIntegrityError, match=shards[3]):
        if mode == "async":
            asyncio.run(consume())
        else:
            with loader:
                for batch in loader:
                    got.append(batch)
    assert len(got) == first_need
    for i, batch in enumerate(got):
        assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
    asyncio.run(storage.close())


def test_an_object_the_whole_copy_finds_gone_fails_at_the_first_batch_that_needs_it(
    tmp_path: Path, s3: MotoS3
) -> None:
    """With ``cache_dir`` the background copy meets an object deleted after open ahead of the
    reads: the batches before the first that needs it are still delivered (from the store),
    and the error comes at that batch."""
    local = tmp_path / "ds"
    tokens = np.random.default_rng(12).integers(0, 60_000, 20_000, dtype=np.uint16)
    guideloom.write_stream(local, tokens, shard_bytes=8_000)
    shards = sorted(p.name for p in local.iterdir() if p.suffix == ".bin")
    name = unique("gone-copy")
    s3.upload_folder(local, BUCKET, name)
    kw: dict[str, Any] = dict(sequence_length=SEQ, local_batch_size=BATCH, device=CPU)
    with StatefulDataLoader.from_storage(guideloom.open_stream(local), collate, **kw) as loader:
        expected = list(loader)
    first_need = (3 * 4000 // SEQ) // BATCH
    storage = guideloom.open_stream(f"s3://{BUCKET}/{name}", cache_dir=tmp_path / "cache", **s3.options())
    storage.read_window_bytes = 2_000  # windows of a few batches: many reads after the copy's failure
    s3.client().delete_object(Bucket=BUCKET, Key=f"{name}/{shards[3]}")
    cache = storage._cache
    assert cache is not None
    got: list[Any] = []
    with (
        pytest.raises(DatasetIntegrityError, match=shards[3]),
        StatefulDataLoader.from_storage(storage, collate, **kw) as loader,
    ):
        for batch in loader:
            got.append(batch)
            if len(got) == 1:  # the copy has met the missing object before the reads go on
                deadline = time.monotonic() + 30
                while cache.error is None and cache.running():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
    assert len(got) == first_need
    for i, batch in enumerate(got):
        assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
    asyncio.run(storage.close())
