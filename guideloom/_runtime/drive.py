"""The two drivers of :class:`~guideloom._runtime.flow.EpochFlow`: :class:`SyncDriver` for
``for batch in loader``, :class:`AsyncDriver` for ``async for``. What an epoch runs on is
decided by :func:`~guideloom._runtime.executors.executors_for`.

A driver performs what the flow asks for and waits for what it is blocked on; it holds no logic
of the epoch's own. :class:`SyncDriver` runs in the consumer's thread, with no event loop: reads
of a storage that reads inline are made right there (a window when its batches are needed),
others on a loop thread of its own, several windows in flight. With ``collate_mode="auto"`` it
times the consumer's cycle to choose between the workers and inline collation
(:class:`~guideloom._runtime.chooser.Chooser`). :class:`AsyncDriver` runs on the caller's loop,
which never runs ``collate_fn`` (one collate thread at ``num_workers=0``) and is never blocked
by a read (``read_many`` is a coroutine) or a wait.

Both take each batch from the flow in plan order, a failure at its batch and nothing after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from collections.abc import Callable
from typing import Any

from guideloom._core.delivery import DELIVERED_ERRORS, Delivery
from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import future_reads, run_async, run_sync
from guideloom._loop import LoopThread
from guideloom._runtime import chooser as choosing
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.executors import (
    UNMEASURED,
    Choosers,
    FutureJob,
    GroupJob,
    Here,
    Processes,
    executors_for,
)
from guideloom._runtime.flow import EpochFlow, Read

__all__ = ["AsyncDriver", "SyncDriver"]

#: How often a blocked sync wait looks whether the driver was closed in another thread.
POLL_S = 0.1


class SyncDriver:
    """One epoch of a sync ``for``: :meth:`next` hands out the flow's batches one at a time."""

    def __init__(self, cfg: PipelineConfig, choosers: Choosers | None) -> None:
        self.cfg = cfg
        self.ex = ex = executors_for(cfg, choosers, on_loop=False)
        self.procs = ex.workers if isinstance(ex.workers, Processes) else None
        try:
            self.flow = flow = EpochFlow(
                cfg,
                ex.here,
                ex.workers,
                limit=cfg.capacity + 1,
                concurrency=cfg.dataset.read_hints.max_concurrent_reads,
            )
        except BaseException:
            for executor in ex.all():
                executor.shutdown(wait=True)
            raise
        if self.procs is not None:
            self.procs.flow = flow
        #: No worker: every batch is made here when asked for.
        self._lean = ex.workers is None and isinstance(ex.here, Here)
        #: Batches read here are made here even with the workers chosen (they read their own).
        self._here_first = self.procs is not None and self.procs.reads_itself
        self._lt: LoopThread | None = None
        #: Whether the storage, read on a loop thread at first, reads inline now.
        self.reads_inline = False
        self._hinted = False
        self._failed = False  # the workers could not start: their failure is queued
        # The chooser's clock (see :meth:`next`).
        self.chooser = ex.chooser
        self._last: float | None = None  # when the last request came
        self._read_s = 0.0  # spent reading since then
        self._window_read = 0.0  # the last window read here, per batch
        self._quiet = 0  # calls left before the clock is looked at again (inline, held)
        self._settled = False
        self._span = 0  # the batches of a workers' task the chooser was told of
        self._skip = self._chunk = 0
        if self.chooser is not None:
            limit = cfg.capacity + 1
            self._skip, self._chunk = limit, max(8, 2 * limit)
        self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0
        #: What the iterator calls for each batch: :meth:`next`, or where no worker, no chooser and
        #: one collate step leave nothing to decide, :meth:`_next_lean`, which makes a batch read
        #: already without a call in between.
        self.hot: Callable[[], Delivery | None] = self.next
        steps = ex.here.steps if self._lean else ()
        if self._lean and self.chooser is None and len(steps) == 1:
            self._collate = steps[0]
            self.hot = self._next_lean

    @property
    def place(self) -> str:
        """Where the last batch handed out was collated: ``"inline"``, ``"threads"``, ``"processes"``."""
        return self.flow.place

    def _next_lean(self) -> Delivery | None:
        """:meth:`next` with no worker and no chooser: a batch read already, with nothing in
        flight before it, is collated here at once (:meth:`EpochFlow.make_here`, written out);
        anything else takes :meth:`_pull`."""
        flow = self.flow
        raw = flow.raw
        if raw and self._lt is None and not flow.jobs and not flow.closed:
            try:
                d = raw.popleft()
            except IndexError:  # closed in another thread meanwhile
                return self._pull()
            if d.error is None:
                try:
                    d.value = self._collate(d.value)
                    return d
                except DELIVERED_ERRORS as exc:
                    d.value, d.error = None, exc
            flow.end()
            return d
        return self._pull()

    @property
    def workers(self) -> bool:
        """Whether the batches are collated on the workers now."""
        return self.flow.on_workers

    # -- the chooser's clock ----------------------------------------------------------------------
    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end, after a
        failure was handed out, or once :meth:`close` ran.

        With a chooser, the consumer's whole cycle (from one request to the next, its own work
        included: workers that hold the GIL slow it down too) is timed in the mode it ran in,
        the reads left out (the same in both modes), and inline is charged what a batch's read
        costs where the workers read their own. While a choice of inline stands, nothing is
        timed: the clock is looked at once every :data:`~guideloom._runtime.chooser.QUIET_CALLS`.
        """
        chooser = self.chooser
        if chooser is None:
            return self._pull()
        if self._quiet:
            self._quiet -= 1
            return self._pull()
        flow = self.flow
        if flow.per != self._span:  # the workers' tasks grew: the chooser's chunks span them
            self._span = flow.per
            chooser.span(flow.per)
        now = time.perf_counter()
        if self._last is not None:
            chooser.record(now - self._last - self._read_s, self._settled)
        self._last, self._read_s = now, 0.0
        workers = chooser.workers
        procs = self.procs
        reads_itself = procs is not None and procs.reads_itself
        # Settled: the batch comes from the mode it is timed in (not from groups sent before a
        # switch, nor from a window read here before the workers took over again, nor made here
        # while the workers start).
        from_workers = workers and (procs is None or procs.is_up) and not (reads_itself and flow.raw)
        self._settled = from_workers or (not workers and not flow.jobs)
        if not workers:
            self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0
            if reads_itself and not flow.jobs:
                # Inline is charged a batch's read as the workers measure it, where they have: the
                # main process's first reads fault in pages the workers mapped long ago.
                assert procs is not None
                per = procs.session.read_per_batch
                self._read_s -= self._window_read if per is None else per
            until = chooser.held_until()
            if not flow.jobs and until is not None and now < until:
                self._quiet, self._last = choosing.QUIET_CALLS, None  # nothing to time until the probe
            return self._pull()
        self._in_calls += 1
        if (
            procs is not None
            and procs.is_up
            and chooser.measures
            and self._in_calls > self._skip
            and random.random() < choosing.CPU_SAMPLE
        ):
            c0 = time.thread_time()
            d = self._pull()
            self._weigh(time.thread_time() - c0)
            return d
        return self._pull()

    def _weigh(self, seconds: float) -> None:
        """The process workers' mode: ``seconds`` of this thread's CPU time spent taking one of
        their batches. Once that costs as much, per batch, as the workers report a batch's read
        and collate costs them, making it inline cannot cost more: inline is chosen. CPU time,
        not wall time: waiting for workers that a loaded machine slows down is no cost of their
        transport."""
        self._in_sampled += 1
        self._in_total += seconds
        if self._in_sampled < self._chunk or self._in_total < choosing.CHUNK_SECONDS:
            return
        mean = self._in_total / self._in_sampled
        self._in_sampled, self._in_total = 0, 0.0
        assert self.procs is not None and self.chooser is not None
        work = self.procs.session.work_per_batch
        if work is not None and mean >= work:
            self.chooser.settle(False, (mean, work))

    # -- driving the flow -------------------------------------------------------------------------
    def _pull(self) -> Delivery | None:
        flow = self.flow
        lean = self._lean
        if self._lt is not None and not self.reads_inline and self.cfg.dataset._reads_inline:
            # The storage reads inline from now on (a remote dataset's local copy is complete):
            # its reads go on here, the read-ahead from the loop thread dropped.
            self.reads_inline = True
            flow.rewind()
        try:
            while not flow.closed:
                if not lean:
                    self._decide()
                if flow.raw and not flow.jobs and (lean or not flow.on_workers or self._here_first):
                    return flow.make_here()  # read already, nothing in flight before it: made now
                self._pump()
                d = flow.take()
                if d is not None:
                    if d.error is None and flow.on_workers:
                        # The workers need not wait for the next call: the credit of the batch
                        # taken is back. Process workers keep the next request's credit too (a
                        # group's round trip through the pipes would leave a worker idle);
                        # threads are handed nothing beyond the prefetch bound.
                        spare = 0 if self.procs is not None else 1
                        flow.limit -= spare
                        try:
                            flow.fill()
                        finally:
                            flow.limit += spare
                    return d
                if flow.finished():
                    return None
                self._wait()
        except (IndexError, AssertionError):
            if flow.closed:  # close() in another thread meanwhile
                return None
            raise
        return None

    def _decide(self) -> None:
        """Where the next groups are collated: the chooser's mode, here while process workers
        start (unless pinned to them), on them once up."""
        flow, procs = self.flow, self.procs
        workers = True if self.chooser is None else self.chooser.workers
        if procs is not None and not procs.is_up and not self._failed:
            if flow.read_step >= flow.total and flow.reads_here():
                flow.on_workers = False  # every batch is read here already: they owe none
                return
            if procs.starting() and not self.ex.wait_for_workers:
                flow.on_workers = False
                return
            self._read_ahead()  # the first windows are read while the workers start
            try:
                procs.start_sync()
            except Exception as exc:  # at the first batch the workers owe, and so the epoch's end
                if flow.closed:  # closed in another thread: the start was cut short, not failed
                    return
                self._failed = True
                flow.on_workers = True
                flow.fail(exc)
                return
        if not self._failed:
            flow.on_workers = workers and flow.workers is not None

    def _hint(self) -> None:
        flow = self.flow
        if not self._hinted and flow.reads_here():
            # The plan is known: tell the storage what comes (a chunk cache downloads ahead by it).
            self._hinted = True
            self.cfg.dataset._will_read(future_reads(flow.plan, self.cfg.order, flow.future_windows()))

    def _read_ahead(self) -> None:
        """Start the reads the flow asks for on the loop thread, and nothing else (the workers
        the groups are for are not up yet); nothing where the storage reads inline."""
        flow, dataset = self.flow, self.cfg.dataset
        if dataset._reads_inline or not flow.reads_here():
            return
        self._hint()
        while (r := flow.next_read(ahead=True)) is not None:
            r.handle = self._loop_thread().submit(run_async(flow.schedule(r), dataset.read_many))

    def _pump(self) -> None:
        """Start the reads the flow asks for (or make them, where the storage reads inline) and
        the groups its credits allow."""
        flow, dataset = self.flow, self.cfg.dataset
        self._harvest()
        self._hint()
        while True:
            inline = dataset._reads_inline
            r = flow.next_read(ahead=not inline)
            if r is None:
                break
            if inline:
                t0 = time.perf_counter()
                got = run_sync(flow.schedule(r), dataset._read_many_sync)
                seconds = time.perf_counter() - t0
                self._read_s += seconds
                self._window_read = seconds / max(1, len(r.specs))
                flow.read_done(r, got)
            else:
                r.handle = self._loop_thread().submit(run_async(flow.schedule(r), dataset.read_many))
            flow.fill()
        flow.fill()

    def replan(self, plan: EpochPlan) -> None:
        """Go on from ``plan`` (its order, a global offset, a geometry: another rank, world size
        or batch size) from the next batch on: what was read ahead or is being made for the old
        plan is dropped, and batches handed out but not committed are made again where the new
        plan's offset comes before them. The executors stay up: process workers are sent the new
        epoch, none restarts."""
        _replan(self, plan)

    def _loop_thread(self) -> LoopThread:
        lt = self._lt
        if lt is None:
            lt = self._lt = LoopThread(name=f"guideloom-reads-{id(self):x}")
        return lt

    def _harvest(self) -> None:
        """Hand the reads done on the loop thread to the flow, oldest first."""
        flow = self.flow
        while flow.reads:
            r = flow.reads[0]
            fut = r.handle
            if fut is None or not fut.done():
                return
            try:
                got = fut.result()
            except Exception as exc:  # a bug: at the batch it stopped before
                flow.fail(exc)
                return
            flow.read_done(r, got)

    def _wait(self) -> None:
        """Block until what the next batch waits for has moved (or :data:`POLL_S`)."""
        flow = self.flow
        job = flow.head()
        if isinstance(job, GroupJob):
            assert self.procs is not None
            self.procs.wait_sync()
        elif isinstance(job, FutureJob):
            fut = job.future
            if fut is not None:
                concurrent.futures.wait([fut], POLL_S)
        elif job is None and flow.reads:
            fut = flow.reads[0].handle
            if fut is not None:
                concurrent.futures.wait([fut], POLL_S)
        elif job is None and self.procs is not None and not self.procs.is_up:
            time.sleep(0.001)  # nothing read here yet and the workers start: they are waited for
        elif job is None:
            raise RuntimeError("guideloom bug: the epoch's flow waits for nothing")

    def close(self) -> None:
        """Produce nothing more; stop and join what this epoch started. Idempotent."""
        flow = self.flow
        if flow.closed and self._lt is None:
            return
        flow.close()
        try:
            for ex in self.ex.all():
                ex.shutdown(wait=True)
        finally:
            lt, self._lt = self._lt, None
            if lt is not None:
                lt.stop()


class AsyncDriver:
    """One epoch of ``async for`` on the caller's loop: :meth:`next` hands out the flow's
    batches; reads, the workers' results and the collate thread move the flow on between
    calls (each read's end starts the groups it allows)."""

    def __init__(self, cfg: PipelineConfig, pinned: bool) -> None:
        self.cfg = cfg
        self.ex = ex = executors_for(cfg, None if pinned else UNMEASURED, on_loop=True)
        self.procs = ex.workers if isinstance(ex.workers, Processes) else None
        self.flow = flow = EpochFlow(
            cfg,
            ex.here,
            ex.workers,
            limit=cfg.capacity,
            concurrency=cfg.dataset.read_hints.max_concurrent_reads,
        )
        if self.procs is not None:
            self.procs.flow = flow
        self._up: asyncio.Task[None] | None = None
        self._failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._moved: asyncio.Event | None = None
        self._reading: set[asyncio.Task[Any]] = set()  # the reads in flight
        self._waiting: asyncio.Future[Any] | None = None  # a collate's result next() waits for

    @property
    def place(self) -> str:
        return self.flow.place

    def ready(self) -> bool:
        """Whether the next batch is in hand (:meth:`next` would not suspend)."""
        job = self.flow.head()
        return job is not None and job.ready()

    async def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end."""
        flow = self.flow
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._moved = asyncio.Event()
            self.cfg.dataset._will_read(future_reads(flow.plan, self.cfg.order, flow.future_windows()))
        flow.limit = self.cfg.capacity + 1  # the consumer asks for one: one more credit
        try:
            while not flow.closed:
                await self._decide()
                self._pump()
                d = flow.take()
                if d is not None:
                    return d
                if flow.finished():
                    return None
                await self._wait()
            return None
        finally:
            flow.limit = self.cfg.capacity

    def replan(self, plan: EpochPlan) -> None:
        """As :meth:`SyncDriver.replan`, on the loop between two batches."""
        _replan(self, plan)

    async def _decide(self) -> None:
        flow, procs = self.flow, self.procs
        if procs is None or self._failed:
            return
        if procs.is_up:
            flow.on_workers = True
            return
        if self._up is None:
            self._up = up = asyncio.get_running_loop().create_task(
                procs.start_async(), name="guideloom-workers-up"
            )
            up.add_done_callback(self._poke)
        up = self._up
        if not up.done():
            if not self.ex.wait_for_workers and procs.starting():
                flow.on_workers = False  # made here while they start (not while workers that
                return  # are up already take the epoch: a thread's hop, not a start)
            await asyncio.wait([up])
        error = up.exception() if not up.cancelled() else None
        if (error is not None or up.cancelled()) and flow.read_step >= flow.total and not flow.on_workers:
            return  # every batch is read here already: the workers owe none (a failed start
            # comes at the first batch they owe, in a later epoch)
        if error is not None or up.cancelled():
            self._failed = True
            flow.on_workers = True
            flow.fail(error or RuntimeError("the workers' start was cancelled"))
            return
        flow.on_workers = True

    def _poke(self, _: Any = None) -> None:
        moved = self._moved
        if moved is not None:
            moved.set()

    def _pump(self) -> None:
        flow, dataset = self.flow, self.cfg.dataset
        loop = self._loop
        assert loop is not None
        while (r := flow.next_read(ahead=True)) is not None:
            task = loop.create_task(run_async(flow.schedule(r), dataset.read_many), name="guideloom-read")
            r.handle = task
            self._reading.add(task)
            task.add_done_callback(self._read_done)
        flow.fill()

    def _read_done(self, task: asyncio.Task[Any]) -> None:
        """A read ended (on the loop): the flow takes it, and the groups it allows start now."""
        flow = self.flow
        self._reading.discard(task)
        if flow.closed or task.cancelled():
            if not task.cancelled():
                task.exception()
            return
        while flow.reads and flow.reads[0].handle is not None and flow.reads[0].handle.done():
            r: Read = flow.reads[0]
            t = r.handle
            if t.cancelled():
                return
            error = t.exception()
            if error is not None:  # a bug: at the batch it stopped before
                flow.fail(error)
                break
            flow.read_done(r, t.result())
        try:
            self._pump()
        except Exception as exc:  # a bug (samples that cannot be sent): at its batch
            flow.fail(exc)
        self._poke()

    async def _wait(self) -> None:
        flow = self.flow
        job = flow.head()
        moved = self._moved
        assert moved is not None
        moved.clear()
        if isinstance(job, GroupJob):
            await Processes.wait_async(job)
        elif isinstance(job, FutureJob) and job.future is not None:
            self._waiting = waiting = asyncio.wrap_future(job.future)
            try:
                await asyncio.wait([waiting])
            finally:
                self._waiting = None
        elif job is None and (flow.reads or self._up is not None):
            await moved.wait()
        elif job is None:
            raise RuntimeError("guideloom bug: the epoch's flow waits for nothing")

    def stop(self) -> list[asyncio.Task[Any]]:
        """Produce nothing more (on the loop): reads cancelled, the workers' groups dropped;
        the tasks cancelled, to wait for."""
        self.flow.close()
        self._poke()  # a next() waiting in another task looks again, and ends
        waiting = self._waiting
        if waiting is not None:
            waiting.cancel()
        tasks = [t for t in self._reading if not t.done()]
        for t in tasks:
            t.cancel()
        up = self._up
        if up is not None and not up.done():
            up.cancel()  # the start itself goes on in its thread; the pool's close ends it
            tasks.append(up)
        return tasks

    def shutdown(self, wait: bool = True) -> None:
        """Stop the executors (joining their threads unless ``wait`` is false)."""
        for ex in self.ex.all():
            ex.shutdown(wait=wait)

    def stop_threadsafe(self) -> None:
        """:meth:`stop` from any thread (an iterator collected, or closed from sync code)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.flow.closed = True
            return
        try:
            loop.call_soon_threadsafe(self.stop)
        except RuntimeError:  # the loop closed meanwhile
            self.flow.closed = True


def _replan(driver: SyncDriver | AsyncDriver, plan: EpochPlan) -> None:
    """Start ``driver``'s flow again from ``plan`` on the same executors."""
    flow = driver.flow
    flow.start(plan, 0)
    if driver.procs is not None:
        driver.procs.renew()
    if isinstance(driver, SyncDriver):
        driver._hinted = False  # the storage is told the new plan's reads
