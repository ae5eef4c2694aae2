"""The chunk cache never costs more than no cache: a full cache evicts only for a chunk that the
planned reads use enough of (``_chunk_schedule.MIN_USE_DENOMINATOR``), so windows that touch far more
chunks than the limit holds read their rows directly instead of downloading a chunk per row."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom.storage._cache._chunks import ChunkCache
from tests.support.chunks import CHUNK, SEQ, Store, settle

pytestmark = pytest.mark.usefixtures("short_first_read_grace")


def _planned(store: Store, cache: ChunkCache, rows: list[int]) -> tuple[object, ...]:
    starts = np.asarray(rows, dtype=np.int64) * SEQ
    key = (len(starts), int(starts[0]), int(starts[-1]))
    return (key, *cache.table.use_of_rows(store.layouts, starts, SEQ))


@pytest.mark.slow
def test_a_full_cache_does_not_download_a_chunk_per_row(tmp_path: Path, stopped: list[ChunkCache]) -> None:
    """512 rows in 32 chunks of 16 rows, room for 8 chunks, a shuffled epoch read 4 rows at a
    time: every window touches 4 chunks, each used by one row. Evicting by next use alone
    downloaded a chunk for nearly every row read (1,024 rows: 729 chunks, 11x the rows' bytes);
    reading the rows a download would not pay for directly keeps the bytes near the rows' own."""
    store = Store(tmp_path, chunks=512)
    chunk = 16 * CHUNK
    cache = store.cache(tmp_path / "c", max_bytes=8 * chunk, chunk_bytes=chunk)
    stopped.append(cache)
    order = np.random.default_rng(0).permutation(512)
    windows = [sorted(order[i : i + 4].tolist()) for i in range(0, 512, 4)]
    cache.plan(_planned(store, cache, w) for w in windows)
    for w in windows:
        settle(cache)
        assert np.array_equal(store.read(cache, w), store.expected(w))
    downloaded = sum(e - s for _p, s, e in store.fetched)
    rows_bytes = 512 * CHUNK
    stats = cache.stats()
    assert downloaded + store.remote_ranges * CHUNK <= 1.5 * rows_bytes, stats
    assert stats["cache_local_ranges"] >= 0.15 * 512, "the chunks it holds still serve their rows"


@pytest.mark.slow
def test_a_full_cache_still_evicts_for_chunks_the_plan_reads_whole(
    tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    """The same cache, read in order 16 rows (one whole chunk) at a time, twice: every chunk is
    worth its download, so the limit is cycled through and every read is local."""
    store = Store(tmp_path, chunks=512)
    chunk = 16 * CHUNK
    cache = store.cache(tmp_path / "c", max_bytes=8 * chunk, chunk_bytes=chunk)
    stopped.append(cache)
    windows = [list(range(i, i + 16)) for i in range(0, 512, 16)] * 2
    cache.plan(_planned(store, cache, w) for w in windows)
    for w in windows:
        settle(cache)
        assert np.array_equal(store.read(cache, w), store.expected(w))
    stats = cache.stats()
    assert stats["cache_evictions"] >= 56 and store.remote_ranges == 0, stats


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    shard_rows=st.integers(1, 7),
    chunk_blocks=st.integers(1, 5),
    length=st.integers(1, 3 * SEQ),
)
def test_the_bytes_planned_per_chunk_are_those_of_the_rows(
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    shard_rows: int,
    chunk_blocks: int,
    length: int,
) -> None:
    tmp = tmp_path_factory.mktemp("use")
    store = Store(tmp, chunks=12, shard_bytes=shard_rows * CHUNK + 2 * 333)  # odd shard sizes
    cache = store.cache(tmp / "c", max_bytes=1 << 30, chunk_bytes=chunk_blocks * 4096)
    try:
        total = len(store.tokens)
        starts = np.asarray(data.draw(st.lists(st.integers(0, total - length), min_size=1, max_size=20)))
        gids, used = cache.table.use_of_rows(store.layouts, starts, length)
        expected: dict[int, int] = defaultdict(int)
        layout, table = store.layouts["tokens"], cache.table
        base = np.asarray([int(table.base[table.index[p]]) for p in layout.paths])
        for s in starts.tolist():  # brute force: the chunk of every byte
            byte = np.arange(s * 2, (s + length) * 2)
            shard = np.searchsorted(layout.bounds, byte, side="right") - 1
            chunk = base[shard] + (byte - layout.bounds[shard]) // table.chunk
            for g, n in zip(*np.unique(chunk, return_counts=True), strict=True):
                expected[int(g)] += int(n)
        assert gids.tolist() == sorted(expected)
        assert used.tolist() == [expected[g] for g in sorted(expected)]
        assert np.array_equal(cache.table.of_rows(store.layouts, starts, length), gids)
    finally:
        cache.stop()


def test_a_chunk_the_plan_reads_little_of_does_not_hold_up_the_next_ones(
    tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    """In order, windows of 1, 2, 4, ... 64 rows (as the loader grows them), room for 4 chunks of
    16 rows: windows end mid-chunk, so when the reader reaches one, the rest of the plan reads a
    row of the chunk it has just left. That chunk is not worth its download; the chunks after
    it, read whole, still are, and are downloaded ahead of the reader."""
    store = Store(tmp_path, chunks=512)
    chunk = 16 * CHUNK
    cache = store.cache(tmp_path / "c", max_bytes=4 * chunk, chunk_bytes=chunk)
    stopped.append(cache)
    windows, start = [], 0
    for size in [1, 2, 4, 8, 16, 32] + [64] * 8:
        if start < 512:
            windows.append(list(range(start, min(512, start + size))))
            start += size
    cache.plan(_planned(store, cache, w) for w in windows)
    for w in windows:
        settle(cache)
        assert np.array_equal(store.read(cache, w), store.expected(w))
    stats = cache.stats()
    assert stats["cache_downloads"] >= 28, stats
    assert stats["cache_local_ranges"] >= 3 * stats["cache_remote_ranges"], stats
