"""An epoch counted as it goes (``EpochPlan(counting=...)``): the plan answers for the batches
it has counted, an empty window asks the driver to count the next window, and the batches and
their samples are exactly those of the same epoch with its length known from the start."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.order import Order
from guideloom._core.plan import BatchSpec, EpochPlan, Permutation
from guideloom._core.schedule import (
    Count,
    Delivery,
    Indexes,
    count_window,
    read_window,
    run_async,
    run_sync,
    windows,
)

Indices = npt.NDArray[np.int64]


class Counted(Order):
    """A keyed permutation of ``[0, n)`` whose positions become known ``chunks[k]`` at a time,
    one chunk a count (what a dataset counted block by block is, seen from the plan)."""

    def __init__(self, n: int, chunks: list[int], fail_at: int | None = None) -> None:
        self._perm = Permutation(n, shuffle=True, seed=3, epoch=1)
        self._ends = [min(n, e) for e in np.cumsum(chunks).tolist()] + [n]
        self._counted = 0
        self.counts = 0
        self.fail_at = fail_at
        self.n = n

    @property
    def known(self) -> int:
        return 0 if self._counted == 0 else self._ends[self._counted - 1]

    @property
    def total(self) -> int | None:
        return self.n if self.known >= self.n else None

    def count_sync(self) -> None:
        if self.fail_at is not None and self.counts == self.fail_at:
            raise ValueError("this block does not tokenize")
        self.counts += 1
        self._counted = min(self._counted + 1, len(self._ends))

    async def count(self) -> None:
        self.count_sync()

    def __len__(self) -> int:
        assert self.total is not None
        return self.n

    def __getitem__(self, position: int) -> int:
        return self._perm[position]

    def take(self, positions: npt.ArrayLike) -> Indices:
        pos = np.asarray(positions, dtype=np.int64)
        assert pos.size == 0 or int(pos.max()) < self.known, "looked up a position not counted yet"
        return self._perm.take(pos)

    def range(self, start: int, stop: int) -> Indices:
        return self.take(np.arange(start, stop, dtype=np.int64))


def _plans(
    n: int, chunks: list[int], batch: int, world: int, rank: int, drop_last: bool, offset: int
) -> tuple[EpochPlan, EpochPlan, Counted]:
    counted = Counted(n, chunks)
    geometry = dict(
        local_batch_size=batch, world_size=world, rank=rank, drop_last=drop_last, start_offset=offset
    )
    known = EpochPlan(num_observations=n, order=Permutation(n, shuffle=True, seed=3, epoch=1), **geometry)  # type: ignore[arg-type]
    lazy = EpochPlan(num_observations=-1, order=counted, counting=counted, **geometry)  # type: ignore[arg-type]
    return known, lazy, counted


def counted_plan(
    counted: Counted, batch: int, *, world_size: int = 1, rank: int = 0, drop_last: bool = True
) -> EpochPlan:
    """A plan over ``counted``, its length learned as it counts."""
    return EpochPlan(
        num_observations=-1,
        local_batch_size=batch,
        world_size=world_size,
        rank=rank,
        drop_last=drop_last,
        order=counted,
        counting=counted,
    )


def _read(indices: Indices) -> Sequence[int]:
    return indices.tolist()


def _drive(plan: EpochPlan, largest: int, *, asynchronous: bool = False) -> list[Delivery]:
    """What a driver does: each window read (an empty one counted), in order."""
    indexes = Indexes(plan, plan.epoch_order)
    out: list[Delivery] = []
    step = 0
    for specs in windows(plan, 0, largest):
        schedule = count_window(plan, step) if not specs else read_window(specs, indexes)
        if specs:
            step = specs[-1].step + 1
        if asynchronous:

            async def aread(indices: Indices) -> Sequence[int]:
                return _read(indices)

            got = asyncio.run(run_async(schedule, aread))
        else:
            got = run_sync(schedule, _read)
        out.extend(got)
        if got and got[-1].error is not None:
            break
    return out


geometry = dict(
    n=st.integers(0, 300),
    chunks=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    batch=st.integers(1, 9),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    largest=st.integers(1, 8),
    data=st.data(),
)


@settings(max_examples=300, deadline=None)
@given(**geometry)  # type: ignore[arg-type]
def test_a_counted_epoch_delivers_what_a_known_one_does(
    n: int,
    chunks: list[int],
    batch: int,
    world: int,
    drop_last: bool,
    largest: int,
    data: st.DataObject,
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    offset = data.draw(st.integers(0, n + 2 * batch * world))
    known, lazy, counted = _plans(n, chunks, batch, world, rank, drop_last, offset)
    assert lazy.steps_known() == 0 or lazy.observations is not None
    want = [(d.spec, d.value) for d in _drive(known, largest)]
    got = [(d.spec, d.value) for d in _drive(lazy, largest, asynchronous=data.draw(st.booleans()))]
    assert got == want
    assert lazy.observations == n and len(lazy) == len(known)
    # counted only as far as the batches needed, plus the count that found the end
    assert counted.counts <= len(chunks) + 1


def test_a_counted_plan_answers_for_counted_batches_only() -> None:
    counted = Counted(100, [30, 30, 30])
    plan = counted_plan(counted, 4, world_size=2, rank=1, drop_last=False)
    assert plan.steps_known() == 0 and plan.observations is None
    with pytest.raises(RuntimeError, match="counted as it goes"):
        len(plan)
    counted.count_sync()  # 30 known: 3 full global batches of 8
    assert plan.steps_known() == 3 and plan.batch(2) == BatchSpec(2, 20, 24, 24)
    with pytest.raises(IndexError):
        plan.batch(3)
    assert plan.batches(0) == plan.batches(0, 3)
    while plan.observations is None:
        counted.count_sync()
    assert len(plan) == 13 and plan.batch(12) == BatchSpec(12, 100, 100, 104)  # rank 1's part is empty
    with pytest.raises(ValueError, match="num_observations=-1"):
        EpochPlan(
            num_observations=5,
            local_batch_size=1,
            world_size=1,
            rank=0,
            drop_last=True,
            order=counted,
            counting=counted,
        )


def test_a_failed_count_is_delivered_at_the_next_batch_and_nothing_after_it() -> None:
    counted = Counted(100, [30, 30, 30], fail_at=1)
    plan = counted_plan(counted, 5, world_size=1, rank=0, drop_last=True)
    got = _drive(plan, 4)
    assert [d.spec.step for d in got if d.error is None] == list(range(6))  # the first 30
    assert isinstance(got[-1].error, ValueError) and got[-1].spec.step == 6 and got[-1].spec.size == 5


def test_a_count_is_a_request_of_its_own() -> None:
    counted = Counted(10, [10])
    plan = counted_plan(counted, 5, world_size=1, rank=0, drop_last=True)
    schedule = count_window(plan, 0)
    request = next(schedule)
    assert isinstance(request, Count) and request.counting is counted and counted.known == 0
    assert list(windows(plan, 0, 4, counts=False)) == []  # a hint counts nothing: it stops
