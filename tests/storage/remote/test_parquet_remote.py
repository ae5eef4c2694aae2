"""Parquet files on object stores (S3 on moto, HTTP on nginx): the same rows as the local files,
read by ranges (the footer, then each row group's column chunks); process workers; an object
replaced after opening is refused; a damaged object is named."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import guideloom as gl
from tests.support.loader import take
from tests.support.remote import BUCKET, unique
from tests.support.servers import FaultProxy, MotoS3, Nginx


def write(folder: Path, files: int = 3, rows: int = 300) -> list[list[int]]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(5)
    ids = [[i, *rng.integers(0, 1000, int(rng.integers(0, 40))).tolist()] for i in range(rows)]
    for f, part in enumerate(np.array_split(np.arange(rows), files)):
        table = pa.table(
            {
                "input_ids": pa.array([ids[i] for i in part], pa.list_(pa.int32())),
                "text": [f"row {i}" for i in part],
                "other": np.arange(len(part)),
            }
        )
        pq.write_table(table, folder / f"train-{f:05d}.parquet", row_group_size=32, compression="zstd")
    return ids


def first_ids(samples: Sequence[np.ndarray]) -> list[int]:
    return [int(s[0]) for s in samples]


def test_rows_from_s3_and_http_equal_the_local_files(
    tmp_path: Path, s3: MotoS3, nginx: Nginx, www: Path
) -> None:
    ids = write(tmp_path / "pq")
    prefix = unique("parquet")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    shutil.copytree(tmp_path / "pq", www / prefix)
    idx = np.random.default_rng(1).permutation(300).astype(np.int64)
    http_files = [f"{nginx.url}/{prefix}/train-{f:05d}.parquet" for f in range(3)]
    for storage in (
        gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options()),
        gl.open_parquet(f"s3://{BUCKET}/{prefix}/train-*.parquet", "input_ids", **s3.options()),
        gl.open_parquet(http_files, "input_ids"),
    ):
        assert len(storage) == 300 and storage.num_row_groups == 12
        got = storage.read_many_sync(idx)
        assert [g.tolist() for g in got] == [ids[i] for i in idx.tolist()]
    texts = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "text", **s3.options())
    assert texts.read_many_sync(np.asarray([299], np.int64)) == ["row 299"]


def test_process_workers_read_s3_with_the_row_group_order(tmp_path: Path, s3: MotoS3) -> None:
    write(tmp_path / "pq")
    prefix = unique("parquet-workers")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    storage = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options())
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        first_ids,
        local_batch_size=10,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
        shuffle=True,
        shuffle_block_size="auto",
        device=torch.device("cpu"),
    )
    with loader:
        got = [i for batch in take(loader) for i in batch]
    assert sorted(got) == list(range(300))


def test_an_object_replaced_after_opening_is_refused(tmp_path: Path, s3: MotoS3) -> None:
    write(tmp_path / "pq")
    prefix = unique("parquet-changed")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    storage = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options())
    storage.read_many_sync(np.asarray([0], np.int64))
    write(tmp_path / "other", files=1, rows=100)
    s3.client().upload_file(
        str(tmp_path / "other" / "train-00000.parquet"), BUCKET, f"{prefix}/train-00002.parquet"
    )
    with pytest.raises(gl.DatasetIntegrityError, match=r"train-00002\.parquet"):
        storage.read_many_sync(np.asarray([299], np.int64))


def test_a_truncated_object_is_named(tmp_path: Path, s3: MotoS3) -> None:
    write(tmp_path / "pq")
    victim = tmp_path / "pq" / "train-00001.parquet"
    victim.write_bytes(victim.read_bytes()[:500])
    prefix = unique("parquet-truncated")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    with pytest.raises(
        gl.DatasetFormatError, match=r"train-00001\.parquet: the file does not end with Parquet's magic"
    ):
        gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options())


def test_concurrent_reads_of_one_row_group_fetch_it_once(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    """Reads that ask for the same row group at once (a loader's concurrent reads of a window)
    share one ranged GET; the footers fetched when opening are not fetched again."""
    ids = write(tmp_path / "pq")
    prefix = unique("parquet-shared")
    shutil.copytree(tmp_path / "pq", www / prefix)
    proxy = FaultProxy(nginx.port, delay=0.05, lifetime=60).start()  # each GET takes 100 ms or more
    proxy_for.append(proxy)
    storage = gl.open_parquet([f"{proxy.url}/{prefix}/train-{f:05d}.parquet" for f in range(3)], "input_ids")
    opened = proxy.stats.requests
    start = threading.Barrier(4)
    rows = [np.arange(k, 32, 4, dtype=np.int64) for k in range(4)]  # row group 0, in 4 parts

    def read(idx: np.ndarray) -> list[list[int]]:
        start.wait()
        return [r.tolist() for r in storage.read_many_sync(idx)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(read, rows))
    assert got == [[ids[i] for i in idx.tolist()] for idx in rows]
    assert proxy.stats.requests - opened == 1


def test_a_failed_shared_read_fails_every_reader(tmp_path: Path, s3: MotoS3) -> None:
    """A reader waiting on another's fetch of the same row group gets its error, not rows."""
    write(tmp_path / "pq")
    prefix = unique("parquet-shared-error")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    storage = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options())
    write(tmp_path / "other", files=1, rows=100)
    s3.client().upload_file(
        str(tmp_path / "other" / "train-00000.parquet"), BUCKET, f"{prefix}/train-00002.parquet"
    )
    start = threading.Barrier(3)

    def read(k: int) -> str:
        start.wait()
        try:
            storage.read_many_sync(np.asarray([200 + k], np.int64))
        except gl.DatasetIntegrityError as exc:
            return str(exc)
        return "read"

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(read, range(3)))
    assert all("train-00002.parquet" in g for g in got), got
