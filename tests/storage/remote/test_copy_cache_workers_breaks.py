"""The whole-copy cache (``cache_dir``) damaged on disk between epochs, read without workers and
through worker threads and processes: the damaged copy is never read, and the intact store serves
the batches, or a refusal names the cache copy and says how to fix it (not the dataset)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import DatasetIntegrityError, StatefulDataLoader
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, collate


def _wait_for_copy(cache: Path) -> None:
    deadline = time.monotonic() + 60
    while not list(cache.glob("*/manifest.json")):
        assert time.monotonic() < deadline, "the copy was not completed"
        time.sleep(0.1)


def _flip_copy(cache: Path) -> Path:
    """One bit of the complete copy's data file flipped in place, its times kept."""
    _wait_for_copy(cache)
    (path,) = cache.glob("*/tokens-*.bin")
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(100_000)
        byte = fh.read(1)
        fh.seek(100_000)
        fh.write(bytes([byte[0] ^ 4]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return path


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:guideloom's copy of .* is damaged:RuntimeWarning")  # said, then rebuilt
@pytest.mark.parametrize(
    "workers",
    [{}, {"num_workers": 2}, {"num_workers": 2, "parallel_method": "process"}],
    ids=["main", "threads", "processes"],
)
def test_a_copy_damaged_once_read_from_is_copied_again_or_refused_naming_the_cache(
    s3: MotoS3, tmp_path: Path, workers: dict[str, Any]
) -> None:
    data = (np.arange(3 * 2**20) % 50_000).astype(np.uint16)  # 6 MiB: its block digests in a sidecar
    guideloom.write_stream(tmp_path / "ds", data)
    prefix = f"copyworkers-{uuid.uuid4().hex[:8]}"
    s3.upload_folder(tmp_path / "ds", BUCKET, prefix)
    kw: dict[str, Any] = dict(
        sequence_length=4096, local_batch_size=4, shuffle=True, shuffle_seed=5, device=torch.device("cpu")
    )
    with StatefulDataLoader.from_storage(guideloom.open_stream(tmp_path / "ds"), collate, **kw) as loader:
        expected = [list(loader) for _ in range(3)]
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", cache_dir=tmp_path / "cache", **s3.options())
    got_epochs: list[list[Any]] = []
    try:
        with StatefulDataLoader.from_storage(storage, collate, **kw, **workers) as loader:
            for epoch in range(3):
                got_epochs.append(list(loader))
                if epoch == 0:
                    _wait_for_copy(tmp_path / "cache")  # complete: the next epoch reads from it
                if epoch == 1:  # the copy checked and read from in the epoch before
                    _flip_copy(tmp_path / "cache")
    except DatasetIntegrityError as exc:
        # a refusal is allowed, but it must say the cache copy is damaged and how to fix that:
        # the dataset in the store is intact, "write or copy the dataset again" is the wrong advice
        message = str(exc)
        assert "write or copy the dataset again" not in message, message
        assert str(tmp_path / "cache") in message, message
    for want, got in zip(expected, got_epochs, strict=False):
        assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:guideloom's copy of .* is damaged:RuntimeWarning")  # said, then rebuilt
def test_process_workers_read_an_object_with_a_sidecar_from_the_store_when_the_copy_is_damaged(
    s3: MotoS3, tmp_path: Path
) -> None:
    """The copy damaged as soon as it is complete: a process worker's reads go to the store, and
    an object of more than 64 blocks has its digests in a sidecar, which the worker must be able
    to fetch (not ``RemoteReadError: ... no reader for the block digests``)."""
    data = (np.arange(3 * 2**20) % 50_000).astype(np.uint16)
    guideloom.write_stream(tmp_path / "ds", data)
    prefix = f"copysidecar-{uuid.uuid4().hex[:8]}"
    s3.upload_folder(tmp_path / "ds", BUCKET, prefix)
    kw: dict[str, Any] = dict(
        sequence_length=4096, local_batch_size=4, shuffle=True, shuffle_seed=5, device=torch.device("cpu")
    )
    with StatefulDataLoader.from_storage(guideloom.open_stream(tmp_path / "ds"), collate, **kw) as loader:
        expected = [list(loader) for _ in range(2)]
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", cache_dir=tmp_path / "cache", **s3.options())
    with StatefulDataLoader.from_storage(
        storage, collate, num_workers=2, parallel_method="process", **kw
    ) as loader:
        first = list(loader)
        _flip_copy(tmp_path / "cache")
        second = list(loader)
    for want, got in zip(expected, [first, second], strict=True):
        assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
