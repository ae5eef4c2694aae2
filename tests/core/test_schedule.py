"""The batch schedule (``guideloom._core.schedule``), with no storage: windows, split, count
check, localisation of a failed read, and the rule that a failed store is not re-read batch by
batch; then read windows aligned to a block shuffle's mixing windows (``windows(..., span=S)``).

What the loader tells a storage it will read (``will_read``) is in
``tests/loader/test_read_hints.py``."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from guideloom._core.order import BlockPermutation
from guideloom._core.plan import EpochPlan, Permutation
from guideloom._core.schedule import (
    Delivery,
    Indexes,
    every,
    max_window,
    read_window,
    run_async,
    run_sync,
    windows,
)
from guideloom._errors import RemoteReadError, StorageError
from guideloom.storage.base import Rows

Indices = npt.NDArray[np.int64]


def _plan(n: int, batch: int, *, world: int = 1, rank: int = 0, drop_last: bool = True) -> EpochPlan:
    return EpochPlan(
        num_observations=n,
        local_batch_size=batch,
        world_size=world,
        rank=rank,
        drop_last=drop_last,
        start_offset=0,
    )


def _order(n: int, seed: int = 0) -> Permutation:
    return Permutation(n, shuffle=True, seed=seed, epoch=0)


class Reads:
    """A blocking read over observations ``0..n``: sample ``i`` is the row ``[i, i]``; it records
    every request, and fails (``error``) for a request that contains index ``bad``."""

    def __init__(self, bad: int | None = None, error: Exception | None = None, count_off: int = 0) -> None:
        self.requests: list[list[int]] = []
        self.bad, self.error, self.count_off = bad, error, count_off

    def __call__(self, indices: Indices) -> Sequence[Any]:
        self.requests.append(indices.tolist())
        if self.bad is not None and self.bad in self.requests[-1]:
            raise self.error or OSError(f"bad sample {self.bad}")
        rows = np.repeat(indices[:, None], 2, axis=1)
        return Rows(rows[: len(rows) - self.count_off])

    async def aread(self, indices: Indices) -> Sequence[Any]:
        await asyncio.sleep(0)
        return self(indices)


def _values(deliveries: list[Delivery]) -> list[list[int]]:
    return [[int(r[0]) for r in d.value] for d in deliveries if d.error is None]


def test_windows_grow_from_one_batch_to_the_largest_and_cover_the_plan() -> None:
    plan = _plan(1000, 3)
    sizes = [len(w) for w in windows(plan, 0, 8)]
    assert sizes[:5] == [1, 2, 4, 8, 8] and set(sizes[3:-1]) == {8}
    assert [s.step for w in windows(plan, 5, 8) for s in w] == list(range(5, len(plan)))
    assert list(windows(plan, len(plan), 8)) == []


def test_max_window_holds_the_byte_budget_and_the_batch_cap() -> None:
    plan = _plan(1000, 4)
    assert max_window(plan, sample_nbytes=1024, window_bytes=16 * 1024) == 4
    assert max_window(plan, sample_nbytes=0, window_bytes=2**30) == 64
    assert max_window(plan, sample_nbytes=2**30, window_bytes=1) == 1


def test_a_window_is_one_request_split_into_its_batches_as_rows_of_one_block() -> None:
    plan, order = _plan(40, 4), _order(40)
    specs = plan.batches(0, 5)
    read = Reads()
    out = run_sync(read_window(specs, Indexes(plan, order), "r"), read)
    assert len(read.requests) == 1
    assert read.requests[0] == order.take(np.arange(20)).tolist()
    assert [d.spec for d in out] == specs
    assert _values(out) == [read.requests[0][i : i + 4] for i in range(0, 20, 4)]
    block = out[0].value.block.base
    assert all(isinstance(d.value, Rows) and d.value.block.base is block for d in out)


def test_a_wrong_sample_count_is_an_error_at_the_first_batch() -> None:
    plan, order = _plan(40, 4), _order(40)
    out = run_sync(
        read_window(plan.batches(0, 4), Indexes(plan, order), "Thing.read_many"), Reads(count_off=1)
    )
    assert len(out) == 1 and out[0].spec.step == 0
    assert isinstance(out[0].error, RuntimeError)
    assert "Thing.read_many returned 3 samples for 4 indexes" in str(out[0].error)


def test_a_data_error_is_localised_to_its_batch_and_nothing_after_it_is_read() -> None:
    plan, order = _plan(40, 4), _order(40)
    specs = plan.batches(0, 8)
    bad = int(order.take(np.asarray([13]))[0])  # in batch 3
    read = Reads(bad=bad)
    out = run_sync(read_window(specs, Indexes(plan, order), "r"), read)
    assert [d.spec.step for d in out] == [0, 1, 2, 3]
    assert [d.error is None for d in out] == [True, True, True, False]
    assert isinstance(out[-1].error, OSError) and f"bad sample {bad}" in str(out[-1].error)
    assert len(read.requests) == 1 + 4  # the window, then batches 0..3 one by one


@pytest.mark.parametrize("error", [StorageError("the store failed"), RemoteReadError("3 attempts in 6.8 s")])
def test_a_failed_store_is_not_read_again_batch_by_batch(error: Exception) -> None:
    """A read's retries and time budget hold for the batch that fails, so the
    error of a failed store comes at the window's first batch after one request."""
    plan, order = _plan(40, 4), _order(40)
    read = Reads(bad=int(order.take(np.asarray([13]))[0]), error=error)
    out = run_sync(read_window(plan.batches(2, 8), Indexes(plan, order), "r"), read)
    assert len(read.requests) == 1
    assert len(out) == 1 and out[0].spec.step == 2 and out[0].error is error


def test_the_async_driver_delivers_what_the_sync_driver_does() -> None:
    plan, order = _plan(60, 4), _order(60, seed=3)
    bad = int(order.take(np.asarray([30]))[0])
    for failing in (None, bad):
        specs = plan.batches(1, 12)
        sync_read, async_read = Reads(bad=failing), Reads(bad=failing)
        a = run_sync(read_window(specs, Indexes(plan, order), "r"), sync_read)
        b = asyncio.run(run_async(read_window(specs, Indexes(plan, order), "r"), async_read.aread))
        assert [(d.spec, type(d.error)) for d in a] == [(d.spec, type(d.error)) for d in b]
        assert _values(a) == _values(b) and sync_read.requests == async_read.requests


def test_an_offload_runs_every_step_of_the_schedule_and_changes_no_delivery() -> None:
    """``run_async(..., off)``: the index lookup and the split run inside ``off``, never in the
    awaiting coroutine, one at a time; the deliveries are those of the steps run in place, a
    failed window localised batch by batch included."""
    plan, order = _plan(60, 4), _order(60, seed=5)
    inside: list[bool] = [False]

    class Watched(Indexes):
        def of(self, specs: Any) -> Indices:
            assert inside[0], "a lookup outside the offload"
            return super().of(specs)

    steps: list[str] = []

    async def off(fn: Any, *args: Any) -> Any:
        assert not inside[0], "two steps at once"
        inside[0] = True
        try:
            await asyncio.sleep(0)
            steps.append(getattr(fn, "__name__", type(fn).__name__))
            return fn(*args)
        finally:
            inside[0] = False

    bad = int(order.take(np.asarray([30]))[0])
    for failing in (None, bad):
        specs = plan.batches(1, 12)
        plain, moved = Reads(bad=failing), Reads(bad=failing)
        a = asyncio.run(run_async(read_window(specs, Indexes(plan, order), "r"), plain.aread))
        steps.clear()
        b = asyncio.run(run_async(read_window(specs, Watched(plan, order), "r"), moved.aread, off))
        assert [(d.spec, type(d.error)) for d in a] == [(d.spec, type(d.error)) for d in b]
        assert _values(a) == _values(b) and plain.requests == moved.requests
        assert steps == ["_Run", *["resume"] * len(moved.requests)]


def test_an_index_lookup_failure_is_delivered_not_raised() -> None:
    class Broken(Indexes):
        def of(self, specs: Any) -> Indices:
            raise IndexError("lookup")

    plan = _plan(8, 2)
    out = run_sync(read_window(plan.batches(0, 1), Broken(plan, _order(8)), "r"), Reads())
    assert len(out) == 1 and isinstance(out[0].error, IndexError)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    batch=st.integers(1, 7),
    world=st.integers(1, 3),
    largest=st.integers(1, 9),
    drop_last=st.booleans(),
    fail_at=st.none() | st.integers(0, 199),
    store_error=st.booleans(),
)
def test_every_batch_is_delivered_once_in_order_up_to_the_failure(
    n: int, batch: int, world: int, largest: int, drop_last: bool, fail_at: int | None, store_error: bool
) -> None:
    assume(n >= batch * world)  # fewer is no batch at all (the loader refuses it earlier)
    plan, order = _plan(n, batch, world=world, rank=world - 1, drop_last=drop_last), _order(n)
    positions, _ = plan.positions(0, len(plan))
    taken = order.take(positions).tolist()
    bad = taken[fail_at] if fail_at is not None and fail_at < len(taken) else None
    read = Reads(bad=bad, error=StorageError("down") if store_error else None)
    indexes = Indexes(plan, order)
    delivered: list[Delivery] = []
    for specs in windows(plan, 0, largest):
        out = run_sync(read_window(specs, indexes, "r"), read)
        delivered.extend(out)
        if out[-1].error is not None:
            break
    steps = [d.spec.step for d in delivered]
    assert steps == list(range(len(steps)))  # in order, each once
    failed = [d for d in delivered if d.error is not None]
    if bad is None:
        assert not failed and len(delivered) == len(plan)
        assert [i for v in _values(delivered) for i in v] == taken
        return
    assert len(failed) == 1 and failed[0] is delivered[-1]
    rows_before = [i for v in _values(delivered) for i in v]
    assert rows_before == taken[: len(rows_before)] and bad not in rows_before
    if not store_error:  # localised: the failing batch is the one that holds the bad sample
        last = delivered[-1].spec
        own = taken[len(rows_before) : len(rows_before) + last.size]
        assert bad in own


# -- read windows aligned to mixing windows -------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 2000),
    batch=st.integers(1, 16),
    world=st.integers(1, 4),
    offset=st.integers(0, 2000),
    span=st.integers(1, 300),
    largest=st.integers(1, 80),
    first=st.integers(0, 5),
)
def test_span_windows_cover_the_plan_in_order_and_end_at_span_ends(
    n: int, batch: int, world: int, offset: int, span: int, largest: int, first: int
) -> None:
    offset = min(offset, n)
    plan = EpochPlan(n, batch, world, 0, drop_last=False, start_offset=offset)
    got = list(windows(plan, first, largest, every(span)))
    steps = [spec.step for w in got for spec in w]
    assert steps == list(range(first, len(plan)))
    if not got:
        return
    assert len(got[0]) == 1, "the first batch is read alone (a fast first batch)"
    _check_reads_follow_window_ends(plan, got[1:], largest, every(span))


def _check_reads_follow_window_ends(
    plan: EpochPlan, reads: list[list[Any]], largest: int, window_end: Any
) -> None:
    """Each read of several batches lies inside one mixing window and holds the window's whole
    batches from its start on (unless cut at ``largest``); a straddling batch is read alone."""
    g, offset = plan.global_batch_size, plan.start_offset
    runs: list[list[int]] = []  # the sizes of the reads of each window's run of whole batches
    for read, after in itertools.pairwise([*reads, []]):
        assert 1 <= len(read) <= largest
        end = window_end(offset + read[0].step * g)
        if len(read) > 1:
            assert offset + (read[-1].step + 1) * g <= end, "inside one window"
        if runs and runs[-1][0] < 0:
            runs[-1].pop(0)
        else:
            runs.append([])
        runs[-1].append(len(read))
        if after and offset + (after[0].step + 1) * g <= end:
            runs[-1].insert(0, -1)  # the next read goes on in the same window
    for sizes in runs:
        assert len(sizes) == -(-sum(sizes) // largest), "the fewest reads the cap allows"
        assert max(sizes) - min(sizes) <= 1, "a window read in parts is read in equal parts"


def test_without_a_span_windows_double_up_to_the_largest() -> None:
    plan = EpochPlan(1000, 1, 1, 0, drop_last=False)
    sizes = [len(w) for w in windows(plan, 0, 16)]
    assert sizes[:6] == [1, 2, 4, 8, 16, 16]


def test_a_window_longer_than_the_largest_read_is_read_in_equal_parts() -> None:
    """80 batches a window, 64 at most a read: two reads of 40, not 64 and 16 (a part of 64 spans
    the window's 80 batches' blocks, too few more than its own to be told from a window read
    whole, so its blocks would not be kept for the part of 16, which would fetch them again)."""
    plan = EpochPlan(4096, 16, 1, 0, drop_last=False)
    sizes = [len(w) for w in windows(plan, 0, 64, every(1280))]
    assert sizes == [1, 40, 39, 40, 40, 40, 40, 16], "batch 0 alone, then each span in two (the last is 256)"


def test_one_window_per_span_when_batches_tile_it() -> None:
    plan = EpochPlan(4096, 16, 1, 0, drop_last=False)
    sizes = [len(w) for w in windows(plan, 0, 4096, every(1024))]
    assert sizes == [1, 63, 64, 64, 64], "batch 0 alone, then the rest of span 0, then a span each"


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 3000),
    block=st.integers(1, 40),
    window=st.integers(1, 8),
    batch=st.integers(1, 16),
    world=st.integers(1, 3),
    epoch=st.integers(0, 5),
)
def test_reads_end_on_the_real_mixing_window_ends_of_a_block_shuffle(
    n: int, block: int, window: int, batch: int, world: int, epoch: int
) -> None:
    perm = BlockPermutation(n, seed=3, epoch=epoch, block_size=block, window=window)
    plan = EpochPlan(n, batch, world, 0, drop_last=False)
    reads = list(windows(plan, 0, 10**6, perm.window_end))
    assert [s.step for r in reads for s in r] == list(range(len(plan)))
    _check_reads_follow_window_ends(plan, reads[1:], 10**6, perm.window_end)
