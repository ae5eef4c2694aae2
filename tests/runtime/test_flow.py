"""The epoch's flow started again between two batches from another plan (another offset, rank,
world size, batch size): it goes on exactly as a fresh epoch from that plan would, the batches
handed out after the new offset made again, and its executors (process workers included) stay
up."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.delivery import Delivery
from guideloom._core.plan import EpochPlan, Permutation
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.drive import AsyncDriver, SyncDriver
from guideloom._runtime.executors import Here, Threads
from guideloom._runtime.flow import EpochFlow

N = 240


def ids_and_pid(samples: Any) -> tuple[list[int], int]:
    """The batch's samples, and the process that collated it (picklable: process workers)."""
    return [int(s[0]) for s in samples], os.getpid()


def plan(batch: int, world: int, rank: int, offset: int) -> EpochPlan:
    return EpochPlan(N, batch, world, rank, drop_last=False, start_offset=offset, order=ORDER)


ORDER = Permutation(N, shuffle=True, seed=9, epoch=0)


def config(p: EpochPlan, nw: int = 0, prefetch: int = 0, method: str = "thread") -> PipelineConfig:
    return PipelineConfig(
        dataset=gl.StreamDataset(gl.MemoryStreamStorage(np.arange(N)), 1),
        plan=p,
        order=ORDER,
        collate_fn=ids_and_pid,
        device=torch.device("cpu"),
        pin_memory=False,
        num_workers=nw,
        parallel_method=method,  # type: ignore[arg-type]
        prefetch=prefetch,
    )


def drain(driver: SyncDriver) -> list[list[int]]:
    out = []
    while (d := driver.next()) is not None:
        assert d.error is None
        out.append(d.value[0])
    driver.close()
    return out


def fresh(p: EpochPlan) -> list[list[int]]:
    return drain(SyncDriver(config(p), None))


geometry = st.tuples(st.integers(1, 5), st.integers(1, 3)).flatmap(
    lambda bw: st.tuples(st.just(bw[0]), st.just(bw[1]), st.integers(0, bw[1] - 1))
)


@settings(max_examples=40, deadline=None)
@given(
    before=geometry,
    after=geometry,
    taken=st.integers(0, 12),
    back=st.integers(0, 4),
    how=st.sampled_from([(0, 0), (0, 3), (2, 0), (2, 5)]),
)
def test_a_replanned_flow_goes_on_as_a_fresh_epoch_from_the_new_plan(
    before: tuple[int, int, int], after: tuple[int, int, int], taken: int, back: int, how: tuple[int, int]
) -> None:
    """``taken`` batches handed out, the last ``back`` of them not committed (taken back); the
    flow, with its read-ahead and groups in flight for the old geometry, goes on from the
    committed global offset in the new one."""
    nw, prefetch = how
    first = plan(*before, offset=0)
    driver = SyncDriver(config(first, nw, prefetch), None)
    got = []
    for _ in range(min(taken, len(first))):
        d = driver.next()
        assert d is not None
        got.append(d.value[0])
    committed = max(0, len(got) - back)
    offset = committed * first.global_batch_size
    new = plan(*after, offset=offset)
    assert got[:committed] == fresh(first)[:committed]
    driver.replan(new)
    assert drain(driver) == fresh(new)


@pytest.mark.slow
@pytest.mark.usefixtures("no_thread_leak")
@pytest.mark.parametrize("how", ["for", "async for"])
def test_process_workers_are_not_restarted_by_a_new_plan(how: str) -> None:
    first = plan(3, 2, 0, 0)
    new = plan(2, 3, 2, 4 * first.global_batch_size)
    driver: SyncDriver | AsyncDriver
    if how == "for":
        driver = SyncDriver(config(first, 2, 2, "process"), None)
        before = [driver.next() for _ in range(6)]
        while driver.procs.pool.starting():  # type: ignore[union-attr]  # (the first ready serves at once)
            time.sleep(0.005)
        pids = [p.proc.pid for p in driver.procs.pool.procs if p is not None]  # type: ignore[union-attr]
        driver.replan(new)
        after = []
        while (d := driver.next()) is not None:
            after.append(d)
        still = [p.proc.pid for p in driver.procs.pool.procs if p is not None]  # type: ignore[union-attr]
        driver.close()
    else:
        adriver = driver = AsyncDriver(config(first, 2, 2, "process"), pinned=True)

        async def run() -> tuple[list[Any], list[Any], list[int], list[int]]:
            try:
                before = [await adriver.next() for _ in range(6)]
                while adriver.procs.pool.starting():  # type: ignore[union-attr]  # (the first ready serves at once)
                    await asyncio.sleep(0.005)
                pids = [p.proc.pid for p in adriver.procs.pool.procs if p is not None]  # type: ignore[union-attr]
                adriver.replan(new)
                after = []
                while (d := await adriver.next()) is not None:
                    after.append(d)
                still = [p.proc.pid for p in adriver.procs.pool.procs if p is not None]  # type: ignore[union-attr]
                return before, after, pids, still
            finally:
                for t in adriver.stop():
                    await asyncio.gather(t, return_exceptions=True)
                await asyncio.to_thread(adriver.shutdown)

        before, after, pids, still = asyncio.run(run())
    assert all(d is not None and d.error is None for d in before)
    assert [d.value[0] for d in after] == fresh(new)
    assert {d.value[1] for d in before + after} <= set(pids) and len(pids) == 2  # all made by the workers
    assert still == pids  # the same processes: none restarted


# -- where the batches are made: the flow's decision, the same for both drivers ---------------------
class StartingThreads(Threads):
    """Worker threads whose start the test says is under way, over, or ready (``is_up``): what
    the flow's decision reads of process workers, whose start takes seconds."""

    def __init__(self) -> None:
        super().__init__(2, [ids_and_pid], "threads")
        self.is_up = False  # type: ignore[misc]
        self.busy = True

    def starting(self) -> bool:
        return self.busy


def flow_over(workers: StartingThreads) -> EpochFlow:
    cfg = config(plan(3, 1, 0, 0), nw=2)
    return EpochFlow(cfg, Here([ids_and_pid]), workers, limit=cfg.capacity + 1)


def test_the_batches_are_made_here_while_the_workers_start_then_on_them() -> None:
    workers = StartingThreads()
    flow = flow_over(workers)
    try:
        assert not flow.decide(True, wait=False) and not flow.on_workers  # here while they start
        assert flow.decide(True, wait=True)  # pinned to them: the driver waits for their start
        workers.busy = False
        assert flow.decide(True, wait=False)  # their start is over: waited for, then theirs
        workers.is_up = True  # type: ignore[misc]
        flow.started(None)
        assert flow.on_workers
        assert not flow.decide(False, wait=False) and not flow.on_workers  # a chooser's inline
        assert not flow.decide(True, wait=False) and flow.on_workers
    finally:
        workers.shutdown()


def test_workers_that_owe_no_batch_are_not_waited_for_unless_pinned() -> None:
    workers = StartingThreads()
    flow = flow_over(workers)
    try:
        flow.read_step = flow.total  # every batch is read here already
        assert not flow.decide(True, wait=False) and not flow.on_workers
        # pinned (collate_mode="workers"): collate_fn runs only on them, so they are waited for
        assert flow.decide(True, wait=True)
    finally:
        workers.shutdown()


@pytest.mark.parametrize("closed", [False, True])
def test_a_failed_start_comes_at_the_first_batch_owed_and_ends_the_epoch(closed: bool) -> None:
    workers = StartingThreads()
    flow = flow_over(workers)
    try:
        assert flow.decide(True, wait=True)
        if closed:  # closed in another thread while the start was waited for: no failure
            flow.close()
        flow.started(RuntimeError("no worker started"))
        d = flow.take()
        if closed:
            assert d is None and not flow.start_failed
            return
        assert d is not None and isinstance(d.error, RuntimeError) and d.spec.step == 0
        assert flow.take() is None and flow.finished()
        assert not flow.decide(True, wait=True)  # not waited for again
    finally:
        workers.shutdown()


def test_a_batch_read_here_is_made_here_only_where_here_makes_it() -> None:
    workers = StartingThreads()
    flow = flow_over(workers)
    try:
        r = flow.next_read(ahead=False)
        assert r is not None
        flow.read_done(r, [Delivery(s, [np.array([s.start])]) for s in r.specs])
        flow.on_workers = True
        assert flow.make_here() is None  # the workers make what is read here
        flow.on_workers = False
        d = flow.make_here()
        assert d is not None and d.error is None and d.value[0] == [r.specs[0].start]
        assert flow.place == "inline"
    finally:
        workers.shutdown()


@pytest.mark.parametrize("nw", [0, 2])
def test_a_plan_s_first_batch_read_here_is_handed_out_before_the_reads_after_it(
    nw: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the storage reads in the driver's thread (inline), a plan's first batch is handed
    out once it is made: the reads of the batches after it (up to the prefetch bound) wait for
    the next requests instead of holding it back (a packed text read tokenizes for 0.1 s)."""
    cfg = config(plan(3, 1, 0, 0), nw=nw, prefetch=4)
    dataset, reads = cfg.dataset, []
    assert dataset._reads_inline
    read = dataset._read_many_sync

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(len(args[0]))
        return read(*args, **kwargs)

    monkeypatch.setattr(dataset, "_read_many_sync", counted)
    driver = SyncDriver(cfg, None)
    first = driver.next()
    assert first is not None and first.error is None
    assert len(reads) == 1, reads
    assert [first.value[0], *drain(driver)] == fresh(plan(3, 1, 0, 0))
