"""Parquet files on object stores (S3 on moto, HTTP on nginx): the same rows as the local files,
read by ranges (the footer, then each row group's column chunks); process workers; an object
replaced after opening is refused; a damaged object is named."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import guideloom as gl
from guideloom.storage._parquet._rowgroups import _RowGroups
from guideloom_dev.servers import FaultProxy, MotoS3, Nginx
from tests.support.loader import take
from tests.support.remote import BUCKET, unique


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
    with pytest.raises(gl.DatasetIntegrityError, match=r"train-00002\.parquet: the file changed") as err:
        storage.read_many_sync(np.asarray([299], np.int64))
    assert "manifest" not in str(err.value) and "ETag" in str(err.value)
    with pytest.raises(gl.DatasetIntegrityError, match=r"train-00002\.parquet: the file changed"):
        storage.read_many_sync(np.asarray([250], np.int64))  # every later read of it is refused
    assert first_ids(storage.read_many_sync(np.asarray([150], np.int64))) == [150]  # another file


def test_an_object_replaced_between_epochs_is_refused_not_mixed(tmp_path: Path, s3: MotoS3) -> None:
    """An epoch reads every row group; the object is replaced by another of the same size before
    the next epoch, whose reads (no row group kept decoded) are refused, not mixed."""
    write(tmp_path / "pq")
    prefix = unique("parquet-epochs")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    storage = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", max_decoded_bytes=1, **s3.options())
    loader = gl.StatefulDataLoader.from_storage(
        storage, first_ids, local_batch_size=10, device=torch.device("cpu")
    )
    with loader:
        assert sorted(i for batch in take(loader) for i in batch) == list(range(300))
        victim = tmp_path / "pq" / "train-00001.parquet"
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF  # other bytes, the same size
        s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/train-00001.parquet", Body=bytes(data))
        with pytest.raises(gl.DatasetIntegrityError, match=r"train-00001\.parquet: the file changed"):
            take(loader)


def test_persistent_short_answers_are_a_remote_read_error_not_a_damaged_file(tmp_path: Path) -> None:
    """A server that answers every range with fewer bytes than asked for, when opening and when
    reading: refused as a RemoteReadError naming the object and the range, after its retries."""
    from tests.storage.remote.test_short_answers import FAST, ShortServer

    write(tmp_path / "pq")
    server = ShortServer(tmp_path)
    try:
        urls = [f"{server.url}/pq/train-{f:05d}.parquet" for f in range(3)]
        for mode in ("body", "range"):
            server.mode = mode
            with pytest.raises(gl.RemoteReadError, match=r"pq/train-00000\.parquet bytes \d+-\d+ failed"):
                gl.open_parquet(urls, "input_ids", **FAST)
        server.mode = "none"
        storage = gl.open_parquet(urls, "input_ids", fetch_ahead=0, **FAST)
        server.mode = "body"
        with pytest.raises(
            gl.RemoteReadError, match=r"pq/train-00001\.parquet bytes \d+-\d+ failed after its retries"
        ):
            storage.read_many_sync(np.asarray([150], np.int64))
    finally:
        server.stop()


def test_objects_whose_names_start_with_an_underscore_or_a_dot_are_skipped(
    tmp_path: Path, s3: MotoS3
) -> None:
    write(tmp_path / "pq")
    extra = tmp_path / "pq" / "_temporary" / "0" / "part-00000.parquet"
    extra.parent.mkdir(parents=True)
    shutil.copy(tmp_path / "pq" / "train-00000.parquet", extra)
    shutil.copy(tmp_path / "pq" / "train-00000.parquet", tmp_path / "pq" / ".hidden.parquet")
    prefix = unique("parquet-hidden")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    for source in (f"s3://{BUCKET}/{prefix}", f"s3://{BUCKET}/{prefix}/**.parquet"):
        assert len(gl.open_parquet(source, "input_ids", **s3.options())) == 300


def test_a_truncated_object_is_named(tmp_path: Path, s3: MotoS3) -> None:
    write(tmp_path / "pq")
    victim = tmp_path / "pq" / "train-00001.parquet"
    victim.write_bytes(victim.read_bytes()[:500])
    prefix = unique("parquet-truncated")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    with pytest.raises(
        gl.DatasetFormatError, match=r"train-00001\.parquet: damaged or not a Parquet file: the file does"
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


# -- fetching ahead: the loader's hint of its upcoming reads -------------------------------------------
ROW_TOKENS = 16  # every row of write_even() holds this many int32 token ids


def write_even(folder: Path, files: int = 3, rows: int = 384) -> list[list[int]]:
    """Rows of equal length, 32 to a row group: every decoded row group holds the same bytes."""
    folder.mkdir(parents=True)
    ids = [[i, *range(ROW_TOKENS - 1)] for i in range(rows)]
    for f, part in enumerate(np.array_split(np.arange(rows), files)):
        table = pa.table({"input_ids": pa.array([ids[i] for i in part], pa.list_(pa.int32()))})
        pq.write_table(table, folder / f"train-{f:05d}.parquet", row_group_size=32, use_dictionary=False)
    return ids


GROUP_BYTES = 32 * ROW_TOKENS * 4 + 33 * 8  # one decoded row group: values and offsets


def served(
    tmp_path: Path, nginx: Nginx, www: Path, proxies: list[FaultProxy], name: str
) -> tuple[FaultProxy, list[str]]:
    write_even(tmp_path / "pq")
    prefix = unique(name)
    shutil.copytree(tmp_path / "pq", www / prefix)
    proxy = FaultProxy(nginx.port, delay=0.01, lifetime=60).start()
    proxies.append(proxy)
    return proxy, [f"{proxy.url}/{prefix}/train-{f:05d}.parquet" for f in range(3)]


def ahead_threads() -> list[str]:
    """The threads fetching ahead (the shared I/O pool's threads, started by any read, stay)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("guideloom-parquet-ahead")]


def settle(storage: gl.ParquetStorage, proxy: FaultProxy) -> int:
    """The requests made once the fetches ahead have stopped making more (for 0.5 s)."""
    seen, since = proxy.stats.requests, time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.05)
        if proxy.stats.requests != seen:
            seen, since = proxy.stats.requests, time.monotonic()
    return seen


def test_a_loader_fetches_each_row_group_once_per_epoch_ahead_of_its_reads(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    """Under the row-group order, with room for a shuffle window and a little more, every row
    is delivered once per epoch and every row group is fetched once per epoch."""
    proxy, urls = served(tmp_path, nginx, www, proxy_for, "parquet-ahead")
    storage = gl.open_parquet(urls, "input_ids", max_decoded_bytes=5 * GROUP_BYTES)
    opened = proxy.stats.requests
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        first_ids,
        local_batch_size=8,
        shuffle=True,
        shuffle_block_size="auto",
        shuffle_window=2,
        device=torch.device("cpu"),
    )
    groups, fetched = storage.num_row_groups, []
    with loader:
        for _epoch in range(2):
            got = [i for batch in take(loader) for i in batch]
            assert sorted(got) == list(range(384))
            fetched.append(proxy.stats.requests - opened - sum(fetched))
    # the first epoch fetches each row group once; the second, those not kept since (5 at most)
    assert fetched[0] == groups and groups - 5 <= fetched[1] <= groups, fetched
    assert storage.figures()["parquet_row_group_decodes"] == sum(fetched)
    assert ahead_threads() == []


def test_fetching_ahead_follows_the_hint_within_max_decoded_bytes(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    """The row groups of the upcoming reads are fetched in order of first need until those not
    yet read fill ``max_decoded_bytes``; each read makes room for the next."""
    proxy, urls = served(tmp_path, nginx, www, proxy_for, "parquet-ahead-budget")
    storage = gl.open_parquet(urls, "input_ids", max_decoded_bytes=GROUP_BYTES * 7 // 2)
    opened = proxy.stats.requests
    order = [7, 2, 11, 0, 5]  # row groups, one read each
    windows = [np.arange(32 * g, 32 * g + 32, dtype=np.int64) for g in order]
    storage.will_read(iter(windows))
    try:
        assert settle(storage, proxy) - opened == 3
        assert sorted(storage._decoded) == sorted(order[:3])
        assert storage._decoded_bytes <= storage.max_decoded_bytes
        for k, window in enumerate(windows):
            got = storage.read_many_sync(window)
            assert first_ids(got) == window.tolist()
            assert settle(storage, proxy) - opened == min(len(order), k + 4)
            assert storage._decoded_bytes <= storage.max_decoded_bytes
        assert storage.figures()["parquet_row_group_decodes"] == len(order)
    finally:
        asyncio.run(storage.close())
    assert ahead_threads() == []


def test_a_failing_object_is_reported_at_the_batch_that_needs_it(tmp_path: Path, s3: MotoS3) -> None:
    """The fetches ahead reach the replaced object long before the reads do: the batches before
    it are delivered, and the first batch of its rows raises (naming it)."""
    write(tmp_path / "pq")
    prefix = unique("parquet-ahead-fails")
    s3.upload_folder(tmp_path / "pq", BUCKET, prefix)
    storage = gl.open_parquet(f"s3://{BUCKET}/{prefix}", "input_ids", **s3.options())
    write(tmp_path / "other", files=1, rows=100)
    s3.client().upload_file(
        str(tmp_path / "other" / "train-00000.parquet"), BUCKET, f"{prefix}/train-00002.parquet"
    )
    loader = gl.StatefulDataLoader.from_storage(
        storage, first_ids, local_batch_size=10, shuffle=False, device=torch.device("cpu")
    )
    got: list[list[int]] = []
    with loader, pytest.raises(gl.DatasetIntegrityError, match=r"train-00002\.parquet"):
        for batch in loader:
            got.append(batch)
    assert [i for batch in got for i in batch] == list(range(200))  # the object holds rows 200-299


def test_closing_mid_epoch_stops_the_fetches_ahead(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    proxy, urls = served(tmp_path, nginx, www, proxy_for, "parquet-ahead-close")
    proxy.delay = 0.05
    storage = gl.open_parquet(urls, "input_ids", max_decoded_bytes=4 * GROUP_BYTES)
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        first_ids,
        local_batch_size=4,
        shuffle=True,
        shuffle_block_size="auto",
        shuffle_window=2,
        device=torch.device("cpu"),
    )
    with loader:
        it = iter(loader)
        next(it)
        next(it)
        # the fetches ahead wait for room (the epoch's other row groups are still to come)
        assert ahead_threads()
    assert ahead_threads() == []


def test_a_storage_fetching_ahead_pickles_without_its_fetches(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    _, urls = served(tmp_path, nginx, www, proxy_for, "parquet-ahead-pickle")
    storage = gl.open_parquet(urls, "input_ids")
    storage.will_read(iter([np.arange(0, 64, dtype=np.int64)]))
    try:
        copy = pickle.loads(pickle.dumps(storage))
        assert copy._fetchers == [] and copy._uses == {} and copy._plan is None
        assert first_ids(copy.read_many_sync(np.asarray([5, 40], np.int64))) == [5, 40]
    finally:
        asyncio.run(storage.close())


def test_room_for_a_row_group_fetched_ahead_is_made_by_dropping_the_one_used_farthest(
    tmp_path: Path, nginx: Nginx, www: Path, proxy_for: list[FaultProxy]
) -> None:
    """Reads of row groups 7, 2, 11, 7, 0, 2 with room for 3 and a half: 0 is fetched once 2
    is read (nothing read before 0 is dropped for it), and 2, used again last, makes room for
    it, not 11 (the least recently used, read next)."""
    proxy, urls = served(tmp_path, nginx, www, proxy_for, "parquet-ahead-farthest")
    storage = gl.open_parquet(urls, "input_ids", max_decoded_bytes=GROUP_BYTES * 7 // 2)
    opened = proxy.stats.requests
    order = [7, 2, 11, 7, 0, 2]
    windows = [np.arange(32 * g, 32 * g + 32, dtype=np.int64) for g in order]
    storage.will_read(iter(windows))
    try:
        held = []
        for window in windows:
            held.append((settle(storage, proxy) - opened, sorted(storage._decoded)))
            assert first_ids(storage.read_many_sync(window)) == window.tolist()
        assert held[:3] == [(3, [2, 7, 11]), (3, [2, 7, 11]), (4, [0, 7, 11])]
        assert proxy.stats.requests - opened == 5  # 2 again, at its last read
    finally:
        asyncio.run(storage.close())
    assert ahead_threads() == []


def test_text_tokenized_as_it_is_read_is_fetched_ahead_on_two_threads(
    tmp_path: Path,
    nginx: Nginx,
    www: Path,
    proxy_for: list[FaultProxy],
    tokenizer_json: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed text over an object store: the tokenizer is the bound, so two threads fetch ahead
    (not ``fetch_ahead``'s 8, which only held more row groups waiting for it); every sequence
    once."""
    write(tmp_path / "pq")
    prefix = unique("parquet-text-ahead")
    shutil.copytree(tmp_path / "pq", www / prefix)
    proxy = FaultProxy(nginx.port, delay=0.01, lifetime=60).start()
    proxy_for.append(proxy)
    urls = [f"{proxy.url}/{prefix}/train-{f:05d}.parquet" for f in range(3)]
    packed = gl.pack(gl.open_parquet(urls, "text", tokenizer=tokenizer_json, eos="</s>"), 8)
    fetchers: set[str] = set()
    fetch_ahead = _RowGroups._fetch_ahead

    def fetching(self: _RowGroups) -> None:
        fetchers.add(threading.current_thread().name)
        fetch_ahead(self)

    monkeypatch.setattr(_RowGroups, "_fetch_ahead", fetching)

    def collate(rows: gl.PackedRows) -> list[tuple[int, ...]]:
        return [tuple(r["tokens"].tolist()) + tuple(r["doc_ids"].tolist()) for r in rows]

    loader = gl.StatefulDataLoader(
        packed, collate, local_batch_size=4, shuffle=True, device=torch.device("cpu")
    )
    with loader:
        got = [s for batch in loader for s in batch]
    assert len(got) == len(set(got)) == len(packed)
    assert fetchers == {"guideloom-parquet-ahead-0", "guideloom-parquet-ahead-1"}, fetchers
    assert ahead_threads() == []
