"""Range planning that spends bytes to save requests (``Limits.max_read_amplification``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom.storage._remote._ranges import Job, Layout, Limits, bridged_gap, fill, plan_windows


def fetch(jobs: list[Job], objects: dict[str, bytes]) -> None:
    for job in jobs:
        fill(job, [objects[job.path][s:e] for s, e in zip(job.starts, job.ends, strict=True)])


def layout_of(sizes: list[int], seed: int = 0) -> tuple[Layout, dict[str, bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    paths = [f"shard-{i}.bin" for i in range(len(sizes))]
    bounds = np.cumsum([0, *sizes])
    objects = {p: data[bounds[i] : bounds[i + 1]].tobytes() for i, p in enumerate(paths)}
    return Layout.of_sizes(np.uint8, paths, sizes), objects, data


def byte_masks(
    layout: Layout, starts: np.ndarray, length: int, jobs: list[Job]
) -> tuple[np.ndarray, np.ndarray]:
    """Which bytes of the array were asked for (``[s, s + length)`` for each start) and which
    were fetched by ``jobs``' ranges."""
    asked = np.zeros(layout.nbytes, dtype=bool)
    for s in starts.tolist():
        asked[s : s + length] = True
    fetched = np.zeros(layout.nbytes, dtype=bool)
    for job in jobs:
        base = int(layout.bounds[layout.paths.index(job.path)])
        for a, b in zip(job.starts, job.ends, strict=True):
            fetched[base + a : base + b] = True
    return asked, fetched


def range_bytes(jobs: list[Job]) -> int:
    return sum(job.nbytes for job in jobs)


def requests(jobs: list[Job]) -> int:
    return sum(len(job.starts) for job in jobs)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    length=st.integers(1, 16),
    picks=st.lists(st.integers(0, 10**6), max_size=60),
    amplification=st.floats(1.0, 8.0),
    cap=st.integers(16, 500),
    seed=st.integers(0, 100),
)
def test_bytes_stay_exact_and_within_the_amplification_budget(
    sizes: list[int], length: int, picks: list[int], amplification: float, cap: int, seed: int
) -> None:
    layout, objects, data = layout_of(sizes, seed)
    if layout.nbytes < length:
        return
    starts = np.asarray([p % (layout.nbytes - length + 1) for p in picks], dtype=np.int64)
    limits = Limits(
        coalesce_gap=0, max_request_bytes=cap, job_bytes=10 * cap, max_read_amplification=amplification
    )
    jobs, outs = plan_windows({"x": layout}, starts, length, limits)
    fetch(jobs, objects)
    for i, s in enumerate(starts.tolist()):
        assert outs["x"][i].tobytes() == data[s : s + length].tobytes()
    # bridged bytes (read but not asked for) stay within the budget of the distinct bytes asked
    # for, even where samples overlap or repeat (a gap runs from the furthest end so far); bytes
    # read twice where max_request_bytes cuts overlapping samples apart are not bridged bytes
    asked, fetched = byte_masks(layout, starts, length, jobs)
    assert int((fetched & ~asked).sum()) <= (amplification - 1) * int(asked.sum()) + 1e-6
    assert range_bytes(jobs) <= amplification * len(starts) * length + 1e-6
    plain, _ = plan_windows({"x": layout}, starts, length, Limits(0, cap, 10 * cap))
    assert requests(jobs) <= requests(plain), "bridging never adds requests"


def test_a_dense_sorted_window_becomes_a_few_large_requests() -> None:
    sample, n = 4096, 3000
    layout, _, _ = layout_of([sample * n])
    rng = np.random.default_rng(1)
    chosen = np.sort(rng.choice(n, n // 3, replace=False)) * sample  # a third of the samples
    limits = Limits(coalesce_gap=8192, max_request_bytes=4 * 2**20, job_bytes=16 * 2**20)
    plain, _ = plan_windows({"x": layout}, chosen // 1, sample, limits)
    assert requests(plain) > 150, "the fixed 8 KiB gap leaves most of them apart"
    economical = Limits(8192, 4 * 2**20, 16 * 2**20, max_read_amplification=4.0)
    jobs, _ = plan_windows({"x": layout}, chosen, sample, economical)
    assert requests(jobs) <= 4, "the whole span, cut at max_request_bytes"
    assert range_bytes(jobs) <= 4 * len(chosen) * sample


@pytest.mark.slow
def test_a_sparse_read_stays_one_request_per_sample() -> None:
    sample, n = 4096, 100_000
    layout, _, _ = layout_of([sample * n])
    chosen = np.arange(0, n, 1000, dtype=np.int64) * sample  # 100 samples, 4 MB apart
    jobs, _ = plan_windows({"x": layout}, chosen, sample, Limits(8192, 4 * 2**20, 16 * 2**20, 10, 4.0))
    assert requests(jobs) == len(chosen)
    assert range_bytes(jobs) == len(chosen) * sample


def test_the_bridged_gap_takes_the_smallest_gaps_first() -> None:
    k = np.zeros(4, dtype=np.int64)
    lo = np.asarray([0, 20, 140, 1140], dtype=np.int64)  # gaps of 10, 110, 990 after 10-byte pieces
    n = np.full(4, 10, dtype=np.int64)
    limits = Limits(coalesce_gap=0, max_read_amplification=4.0)  # budget: 3 * 40 = 120 bytes
    assert bridged_gap(k, lo, n, limits) == 110
    assert bridged_gap(k, lo, n, Limits(coalesce_gap=0, max_read_amplification=1.2)) == 0
    assert bridged_gap(k, lo, n, Limits(coalesce_gap=500)) == 500, "without a budget: the fixed gap"
    apart = np.arange(4, dtype=np.int64)  # no gap is bridged across objects
    assert bridged_gap(apart, lo, n, limits) == 0
