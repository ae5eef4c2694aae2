"""Block digests over object stores: an object replaced before the dataset is opened by other
bytes of the same size is refused before any of its samples is delivered, whatever the cache;
a damaged complete copy (``cache_dir``) is never read."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache._copy import copy_footprint
from guideloom.storage._format._blocks import BLOCK_BYTES
from guideloom.storage._format._manifest import MANIFEST_NAME
from guideloom.storage._remote._ranges import Layout, plan_windows
from guideloom.storage._remote._storage import ObjectStreamStorage
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, collate, unique

CPU = torch.device("cpu")
KW: dict[str, Any] = dict(sequence_length=100, local_batch_size=16, shuffle=True, shuffle_seed=5, prefetch=2)


def _upload(tmp_path: Path, s3: MotoS3, *, legacy: bool = False) -> tuple[Path, str, str]:
    """A stream of four objects of sixteen blocks each, uploaded: its folder, URL and second shard."""
    local = tmp_path / "ds"
    tokens = np.random.default_rng(3).integers(0, 60_000, 4 * 2**20 // 2, dtype=np.uint16)
    guideloom.write_stream(local, tokens, shard_bytes=16 * BLOCK_BYTES)
    if legacy:
        doc = json.loads((local / MANIFEST_NAME).read_text())
        for f in doc["fields"]["tokens"]["files"]:
            del f["blocks"]
        (local / MANIFEST_NAME).write_text(json.dumps(doc))
    name = unique("blocks")
    s3.upload_folder(local, BUCKET, name)
    shard = sorted(p.name for p in local.iterdir() if p.suffix == ".bin")[1]
    return local, f"s3://{BUCKET}/{name}", shard


def _replace_same_size(local: Path, s3: MotoS3, url: str, shard: str) -> None:
    body = bytearray((local / shard).read_bytes())
    for i in range(0, len(body), 2):
        body[i] ^= 0x5A  # every token differs
    s3.client().put_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/{shard}", Body=bytes(body))


def _options(s3: MotoS3, local: Path, cache: str, root: Path) -> dict[str, Any]:
    opts: dict[str, Any] = dict(s3.options())
    if cache != "none":
        opts["cache_dir"] = root
    if cache == "chunks":
        opts["cache_max_bytes"] = copy_footprint(guideloom.open_stream(local).manifest) // 4
        opts["cache_chunk_bytes"] = 2 * BLOCK_BYTES
    return opts


@pytest.mark.parametrize("cache", ["none", "copy", "chunks"])
def test_an_object_replaced_before_open_by_same_size_bytes_is_refused_before_any_sample(
    cache: str, tmp_path: Path, s3: MotoS3
) -> None:
    local, url, shard = _upload(tmp_path, s3)
    with StatefulDataLoader.from_storage(guideloom.open_stream(local), collate, device=CPU, **KW) as loader:
        expected = [b for _ in range(2) for b in loader]
    _replace_same_size(local, s3, url, shard)
    storage = guideloom.open_stream(url, **_options(s3, local, cache, tmp_path / "cache"))  # sizes match
    assert isinstance(storage, ObjectStreamStorage)
    storage.read_window_bytes = 4000  # sparse reads: no object is read whole (no sha256 check)
    got: list[Any] = []
    with (
        pytest.raises(DatasetIntegrityError, match=rf"{shard}.*does not match"),
        StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW) as loader,
    ):
        for _epoch in range(2):
            for batch in loader:
                got.append(batch)
    assert len(got) < len(expected)
    for i, batch in enumerate(got):
        assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
    asyncio.run(storage.close())


def test_an_object_replaced_before_open_and_read_whole_is_named_as_not_matching(
    tmp_path: Path, s3: MotoS3
) -> None:
    """Read whole (its sha256 checked) or by blocks, a replacement made before the open is
    said to be what it is: bytes that do not match the manifest, not a change since the open."""
    local, url, shard = _upload(tmp_path, s3)
    _replace_same_size(local, s3, url, shard)
    storage = guideloom.open_stream(url, **s3.options())
    storage.read_window_bytes = 1 << 30  # every object read whole
    with (
        pytest.raises(DatasetIntegrityError, match=rf"{shard}.*does not match") as caught,
        StatefulDataLoader.from_storage(storage, collate, device=CPU, **{**KW, "shuffle": False}) as loader,
    ):
        list(loader)
    assert "after the dataset was opened" not in str(caught.value)


def test_remote_ranges_are_widened_to_whole_blocks(tmp_path: Path, s3: MotoS3) -> None:
    local, _url, _shard = _upload(tmp_path, s3)
    spec = guideloom.open_stream(local).manifest.tokens
    layout = Layout.of(spec)
    starts = np.asarray([10, 3 * BLOCK_BYTES // 2 + 7, 9 * BLOCK_BYTES // 2 - 3], dtype=np.int64)
    jobs, _ = plan_windows({"tokens": layout}, starts, 50, guideloom.storage._remote._ranges.Limits())
    sizes = dict(zip(layout.paths, np.diff(layout.bounds).tolist(), strict=True))
    for job in jobs:
        for s, e in zip(job.starts, job.ends, strict=True):
            assert s % BLOCK_BYTES == 0 and (e % BLOCK_BYTES == 0 or e == sizes[job.path])


def test_a_damaged_complete_copy_is_never_read(tmp_path: Path, s3: MotoS3) -> None:
    """A byte of the complete local copy flipped on disk (same size): no epoch delivers it; the
    copy is rebuilt from the store, with a warning naming the file."""
    local, url, shard = _upload(tmp_path, s3)
    with StatefulDataLoader.from_storage(guideloom.open_stream(local), collate, device=CPU, **KW) as loader:
        expected = list(loader)
    opts = _options(s3, local, "copy", tmp_path / "cache")
    first = guideloom.open_stream(url, **opts)
    assert isinstance(first, ObjectStreamStorage) and first._cache is not None
    with StatefulDataLoader.from_storage(first, collate, device=CPU, **KW) as loader:
        assert all(torch.equal(a, b) for a, b in zip(loader, expected, strict=True))
    owner = first
    for _ in range(2):  # damaged, rebuilt, damaged again: never read
        assert owner._cache is not None
        deadline = time.monotonic() + 30
        while not owner._cache.complete():
            assert time.monotonic() < deadline, "the copy was not (re)built"
            time.sleep(0.05)
        copied = Path(owner.cache_folder or "") / shard
        body = bytearray(copied.read_bytes())
        body[BLOCK_BYTES + 5] ^= 0x01
        copied.write_bytes(bytes(body))
        storage = guideloom.open_stream(url, **opts)
        assert isinstance(storage, ObjectStreamStorage)
        with (
            pytest.warns(RuntimeWarning, match=rf"is damaged .*{shard}"),
            StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW) as loader,
        ):
            got = list(loader)
        assert len(got) == len(expected)
        for i, batch in enumerate(got):
            assert torch.equal(batch, expected[i]), f"batch {i} is not the dataset's"
        owner = storage
    assert owner._cache is not None
    owner._cache.abort()
    asyncio.run(owner.close())


def test_verify_adds_block_digests_to_a_remote_dataset_written_without_them(
    tmp_path: Path, s3: MotoS3
) -> None:
    local, url, shard = _upload(tmp_path, s3, legacy=True)
    assert not guideloom.open_stream(url, **s3.options()).manifest.has_blocks
    manifest = guideloom.verify_dataset(url, add_block_digests=True, **s3.options())
    assert manifest.has_blocks
    assert guideloom.open_stream(url, **s3.options()).manifest.has_blocks
    _replace_same_size(local, s3, url, shard)
    storage = guideloom.open_stream(url, **s3.options())
    with (
        pytest.raises(DatasetIntegrityError, match=rf"{shard}.*does not match"),
        StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW) as loader,
    ):
        list(loader)
    asyncio.run(storage.close())
