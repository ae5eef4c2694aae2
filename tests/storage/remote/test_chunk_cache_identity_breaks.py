"""The chunk cache (``cache_dir`` with ``cache_max_bytes``): a chunk file is the bytes of one range
of one object, and must be checked as that range, not only as a file that matches its own name."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

import numpy as np
import torch

import guideloom
from guideloom import DatasetIntegrityError, StatefulDataLoader
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET

CHUNK = 65536


def _tokens(storage: object) -> np.ndarray:
    with StatefulDataLoader.from_storage(
        storage,  # type: ignore[arg-type]
        np.stack,
        sequence_length=4096,
        local_batch_size=4,
        shuffle=False,
        device=torch.device("cpu"),
    ) as loader:
        return np.concatenate([np.asarray(b).reshape(-1) for b in loader])


def test_a_chunk_file_of_another_range_is_not_served_for_this_one(s3: MotoS3, tmp_path: Path) -> None:
    """Chunk 0's bytes under the names of chunks 1-7 (a file copied or renamed within the cache,
    or from another dataset's cache: each name's digest is its content's): every delivered token
    is the dataset's, or the read is refused."""
    data = (np.arange(2**19) % 50_000).astype(np.uint16)  # 1 MiB: 16 chunks
    guideloom.write_stream(tmp_path / "ds", data)
    prefix = f"chunkswap-{uuid.uuid4().hex[:8]}"
    s3.upload_folder(tmp_path / "ds", BUCKET, prefix)
    opts = dict(cache_dir=tmp_path / "cache", cache_max_bytes=2**19, cache_chunk_bytes=CHUNK, **s3.options())
    url = f"s3://{BUCKET}/{prefix}"
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "cache").glob("*.chunks/c000000000.*"))) != 1:  # chunk 0 downloaded
        assert np.array_equal(_tokens(guideloom.open_stream(url, **opts)), data)
        assert time.monotonic() < deadline, "the chunk cache downloaded no chunk 0"
    (folder,) = (tmp_path / "cache").glob("*.chunks")
    first = data.view(np.uint8)[:CHUNK].tobytes()
    name = hashlib.sha256(first).hexdigest()[:32]
    for gid in range(1, 8):
        for old in folder.glob(f"c{gid:09d}.*"):
            old.unlink()
        (folder / f"c{gid:09d}.{name}").write_bytes(first)
    try:
        got = _tokens(guideloom.open_stream(url, **opts))
    except DatasetIntegrityError:
        return
    assert np.array_equal(got, data), (
        f"{int((got != data).sum())} of {len(data)} tokens delivered from chunk files of another range"
    )
