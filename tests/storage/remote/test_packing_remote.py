"""Packing over object stores: the same sequences as from local files, with only the offsets and
the element ranges read (S3 on moto, with and without the offsets held in memory; HTTP)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from guideloom_dev.servers import MotoS3, Nginx
from tests.support.remote import BUCKET, unique


async def read_all(dataset: gl.PackedDataset, order: np.ndarray) -> list[Any]:
    await dataset.open()
    try:
        return list(await dataset.read_many(order))
    finally:
        await dataset.close()


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_packed_sequences_from_s3_and_http_equal_the_local_ones(
    mode: str, tmp_path: Path, s3: MotoS3, nginx: Nginx, www: Path
) -> None:
    rng = np.random.default_rng(21)
    docs = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in rng.integers(0, 700, 150)]
    folder = tmp_path / "docs"
    gl.write_documents(folder, docs, shard_bytes=25_000)
    prefix = unique("packed-docs")
    s3.upload_folder(folder, BUCKET, prefix)
    shutil.copytree(folder, www / prefix)
    local = gl.pack(gl.open_documents(folder), 200, mode)  # type: ignore[arg-type]
    asyncio.run(local.open())
    order = rng.permutation(len(local)).astype(np.int64)
    expected = local.read_many_sync(order)
    for storage in (
        gl.open_documents(f"s3://{BUCKET}/{prefix}", **s3.options()),
        gl.open_documents(f"s3://{BUCKET}/{prefix}", offsets_cache_bytes=0, **s3.options()),
        gl.open_documents(f"{nginx.url}/{prefix}", offsets_cache_bytes=0),
    ):
        remote = gl.pack(storage, 200, mode)  # type: ignore[arg-type]
        got = asyncio.run(read_all(remote, order))
        assert len(remote) == len(local)
        for a, b in zip(got, expected, strict=True):
            assert all(np.array_equal(a[k], b[k]) for k in b)
