"""The two drivers of :class:`~guideloom._runtime.flow.EpochFlow`: :class:`SyncDriver` for
``for batch in loader``, :class:`AsyncDriver` for ``async for``. What an epoch runs on is
decided by :func:`~guideloom._runtime.executors.executors_for`.

A driver performs what the flow asks for and waits for what it is blocked on; it holds no logic
of the epoch's own. :class:`SyncDriver` runs in the consumer's thread, with no event loop: reads
of a storage that reads inline are made right there (a window when its batches are needed),
others on a loop thread of its own, several windows in flight. With ``collate_mode="auto"`` it
drives a clock that times the consumer's cycle to choose between the workers and inline
collation (:class:`~guideloom._runtime.flow.Clock`). :class:`AsyncDriver` runs on the caller's loop,
which runs ``collate_fn`` only where it is measured cheaper than the hop to the collate thread
(``num_workers=0, prefetch=0``: :class:`~guideloom._runtime.chooser.LoopChoice`) and is never
blocked by a read (``read_many`` is a coroutine) or a wait.

Both take each batch from the flow in plan order, a failure at its batch and nothing after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any

from guideloom._core.delivery import Delivery
from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import WINDOW_BATCHES, Offload, future_reads, run_async, run_sync
from guideloom._loop import LoopThread
from guideloom._process import aside, run_into
from guideloom._runtime.chooser import Choosers, LoopChoice
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.executors import (
    UNMEASURED,
    FutureJob,
    GroupJob,
    Here,
    Processes,
    executors_for,
)
from guideloom._runtime.flow import Clock, EpochFlow, Read

__all__ = ["AsyncDriver", "SyncDriver"]

#: How often a blocked sync wait looks whether the driver was closed in another thread.
POLL_S = 0.1
#: How often the wait for the process workers' start takes in the reads done meanwhile and
#: starts the next ones.
START_POLL_S = 0.002


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
        self._lt: LoopThread | None = None
        #: Whether the storage, read on a loop thread at first, reads inline now.
        self.reads_inline = False
        self._hinted = False
        #: The measured choice (``collate_mode="auto"``), and its clock over this epoch.
        self.chooser = ex.chooser
        self._clock: Clock | None = None
        if ex.chooser is not None:
            self._clock = Clock(ex.chooser, flow, self.procs, cfg.capacity)
        #: What the iterator calls for each batch: :meth:`next`, or where no worker leaves nothing
        #: to decide, :meth:`_next_lean`.
        self.hot: Callable[[], Delivery | None] = self._next_lean if self._lean else self.next

    @property
    def place(self) -> str:
        """Where the last batch handed out was collated: ``"inline"``, ``"threads"``, ``"processes"``."""
        return self.flow.place

    def _next_lean(self) -> Delivery | None:
        """:meth:`next` with no worker: a batch read already is made at once
        (:meth:`EpochFlow.make_here`); anything else (a read, one on the loop thread ahead)
        takes :meth:`_pull`."""
        if self._lt is None:
            d = self.flow.make_here()
            if d is not None:
                return d
        return self._pull()

    @property
    def workers(self) -> bool:
        """Whether the batches are collated on the workers now."""
        return self.flow.on_workers

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end, after a
        failure was handed out, or once :meth:`close` ran. With a chooser, each request is told
        to its clock (:class:`~guideloom._runtime.flow.Clock`), and the CPU time of those it
        asks for."""
        clock = self._clock
        if clock is None or not clock.tick():
            return self._pull()
        c0 = time.thread_time()
        d = self._pull()
        clock.weigh(time.thread_time() - c0)
        return d

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
                d = flow.make_here()  # read already, nothing in flight before it: made now
                if d is not None:
                    return d
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
        """The flow's decision of where the next groups are made (:meth:`EpochFlow.decide`), in
        the chooser's mode; where it waits for the process workers' start, the first windows are
        read meanwhile and the start waited for here."""
        flow = self.flow
        if not flow.decide(True if self.chooser is None else self.chooser.workers, self.ex.wait_for_workers):
            return
        assert self.procs is not None
        try:
            # the first windows are read while the workers start: the first batch's alone, then,
            # once it is in, the windows after it (they do not compete with the first's read)
            self._read_ahead()
            while not self.procs.start_sync(timeout=START_POLL_S):
                self._harvest()
                self._read_ahead()
        except Exception as exc:  # at the first batch the workers owe, and so the epoch's end
            flow.started(exc)
        else:
            flow.started(None)

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
                if self._clock is not None:
                    self._clock.read(time.perf_counter() - t0, len(r.specs))
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

    def __init__(self, cfg: PipelineConfig, pinned: bool, loop_choice: LoopChoice | None = None) -> None:
        self.cfg = cfg
        choosers = None if pinned else UNMEASURED
        self.ex = ex = executors_for(cfg, choosers, on_loop=True, loop_choice=loop_choice)
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
        #: Where the reads' own steps run: windows of thousands of batches (an object store's)
        #: cost milliseconds to look up and split, off the loop; a few dozen batches' cost less
        #: than the hop. Every window of the flow in one place: they share its index lookup.
        self._off: Offload | None = on_aside if flow.largest > WINDOW_BATCHES else None
        self._up: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._moved: asyncio.Event | None = None
        self._reading: set[asyncio.Task[Any]] = set()  # the reads in flight
        self._waiting: asyncio.Future[Any] | None = None  # a collate's result next() waits for

    @property
    def place(self) -> str:
        return self.flow.place

    def ready(self) -> bool:
        """Whether the next batch is in hand, or is made at once (:meth:`next` would not suspend)."""
        flow = self.flow
        job = flow.head()
        if job is None:
            return bool(flow.raw) and flow.here.makes_now()
        return job.ready()

    async def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end."""
        flow = self.flow
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._moved = asyncio.Event()
            self.cfg.dataset._will_read(future_reads(flow.plan, self.cfg.order, flow.future_windows()))
        d = flow.make_here()  # read already, nothing in flight before it: made now, on the loop
        if d is not None:
            if flow.wants_read():  # fewer read than a window: the next is read ahead
                self._read_ahead()
            return d
        flow.limit = self.cfg.capacity + 1  # the consumer asks for one: one more credit
        try:
            while not flow.closed:
                if self.procs is not None:  # (else nothing changes: the flow's first decision stands)
                    await self._decide()
                self._pump()
                d = flow.take()
                if d is not None:
                    if d.error is None:
                        # As the sync driver: the collate need not wait for the next request, the
                        # credit of the batch taken is back (process workers keep the request's).
                        flow.limit = self.cfg.capacity + (self.procs is not None)
                        flow.fill()
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
        """The flow's decision (:meth:`EpochFlow.decide`): the workers' start runs as a task from
        the first batch on; where the flow waits for it, it is awaited."""
        flow, procs = self.flow, self.procs
        if procs is not None and not procs.is_up and self._up is None and not flow.start_failed:
            self._up = asyncio.get_running_loop().create_task(
                procs.start_async(), name="guideloom-workers-up"
            )
            self._up.add_done_callback(self._poke)
        if not flow.decide(True, self.ex.wait_for_workers):
            return
        up = self._up
        assert up is not None
        if not up.done():
            await asyncio.wait([up])
        if up.cancelled():
            flow.started(RuntimeError("the workers' start was cancelled"))
        else:
            flow.started(up.exception())

    def _poke(self, done: Any = None) -> None:
        if isinstance(done, asyncio.Task) and not done.cancelled():
            done.exception()  # the start's failure is the flow's to hand out: retrieved here
        moved = self._moved
        if moved is not None:
            moved.set()

    def _pump(self) -> None:
        self._read_ahead()
        self.flow.fill()

    def _read_ahead(self) -> None:
        """Start the reads the flow asks for, each a task of the loop."""
        flow, dataset = self.flow, self.cfg.dataset
        loop = self._loop
        assert loop is not None
        while (r := flow.next_read(ahead=True)) is not None:
            read = run_async(flow.schedule(r), dataset.read_many, self._off)
            task = loop.create_task(read, name="guideloom-read")
            r.handle = task
            self._reading.add(task)
            task.add_done_callback(self._read_done)

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
            if job.future.done():  # ended meanwhile: the loop's other tasks run, then it is taken
                await asyncio.sleep(0)
                return
            # One loop future, set from the collate thread's end of the call: a single wake-up
            # of the loop (asyncio.wrap_future then asyncio.wait chain three futures).
            loop = self._loop
            assert loop is not None
            self._waiting = waiting = loop.create_future()
            job.future.add_done_callback(functools.partial(_wake_from_thread, loop, waiting))
            try:
                await waiting
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
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
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


async def on_aside(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run on the process's aside thread (:func:`~guideloom._process.aside`), one
    call after another in the order asked, and awaited: work the loop's other tasks would wait
    for. Cancelled before it runs, it does not run."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    aside(functools.partial(run_into, done, fn, args, {}))
    return await asyncio.wrap_future(done)


def _wake_from_thread(loop: asyncio.AbstractEventLoop, waiting: asyncio.Future[Any], _: object) -> None:
    """A collate thread's call ended: the driver waiting for it on ``loop`` looks again."""
    try:
        loop.call_soon_threadsafe(_set_done, waiting)
    except RuntimeError:  # the loop closed meanwhile: nobody waits
        pass


def _set_done(waiting: asyncio.Future[Any]) -> None:
    if not waiting.done():
        waiting.set_result(None)


def _replan(driver: SyncDriver | AsyncDriver, plan: EpochPlan) -> None:
    """Start ``driver``'s flow again from ``plan`` on the same executors."""
    flow = driver.flow
    flow.start(plan, 0)
    if driver.procs is not None:
        driver.procs.renew()
    if isinstance(driver, SyncDriver):
        driver._hinted = False  # the storage is told the new plan's reads
