"""The ways of running a sync epoch, behind one protocol: :class:`Runner`.

A runner produces the epoch's deliveries one :meth:`~Runner.next` at a time, in plan order, a
failure at its batch and nothing after it, and ``None`` at the end (or once :meth:`~Runner.close`
ran in another thread); :meth:`~Runner.close` stops everything it started and joins it.
:func:`make_runner` picks one in one place, as torchdata's ``reset`` picks its mapper:

- :class:`~guideloom._runtime.inline.InlinePipeline`: ``num_workers=0`` and ``prefetch=0`` over a
  storage that ``reads_inline()`` (memory, local files): a plain loop in the caller's thread, no
  event loop, as PyTorch loads batches in the main process at ``num_workers=0``; an event loop's
  turns would cost about a batch's whole work.
- :class:`ThreadRunner`: thread workers over a storage that reads inline: the caller's thread
  reads and hands groups of batches to the threads, or collates inline while that is cheaper.
- :class:`ProcessRunner`: process workers over a storage that reads inline, for batches that stay
  on the CPU: the caller's thread sends groups and takes their batches off the pipes itself, or
  collates inline while cheaper, and while the workers start.
- :class:`CallerLoopRunner`: ``num_workers=0`` and ``prefetch=0`` over any other storage: the
  pipeline on a private asyncio loop that ``next()`` drives (reads stay in flight between
  batches); it goes on as a plain loop once the storage reads inline (a complete local copy).
- :class:`LoopThreadRunner`: everything else (prefetch, an object store, or a caller's thread that
  already runs an event loop): the pipeline on a loop thread of its own, batches through the
  channel. Over an object store the loop reads for every kind of worker, threads or processes.

``async for`` runs the same pipeline stages on the caller's loop (:func:`run_pipeline`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Protocol

from guideloom._core.delivery import Delivery
from guideloom._loop import LoopThread
from guideloom._runtime.channel import Channel, EndOfStream
from guideloom._runtime.chooser import Chooser, PinnedChooser
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.inline import InlinePipeline
from guideloom._runtime.pipeline import Workers, run_pipeline
from guideloom._runtime.process_choice import ProcessChoiceRun, process_chooser
from guideloom._runtime.processes import ProcessWorkers, SyncRun
from guideloom._runtime.threadpool import CLOSE_GRACE_S, CollateThreads, warn_left_running
from guideloom._runtime.threads import ThreadWorkerPipeline, thread_chooser
from guideloom._runtime.workers import make_workers, process_workers

__all__ = [
    "CallerLoopRunner",
    "Choosers",
    "LoopThreadRunner",
    "ProcessRunner",
    "Runner",
    "ThreadRunner",
    "make_runner",
    "workers_place",
]


class Runner(Protocol):
    """One epoch run for a sync ``for``: deliveries one at a time, then ``None``."""

    @property
    def place(self) -> str:
        """Where the last delivery was collated: ``"inline"`` (no worker: the caller's thread or
        the pipeline's own loop), ``"threads"`` or ``"processes"``."""
        ...

    def next(self) -> Delivery | None:
        """The next delivery in plan order; ``None`` at the end, or once :meth:`close` ran."""

    def close(self) -> None:
        """Produce nothing more; stop and join what this runner started. Idempotent."""


class Choosers(Protocol):
    """Where a runner finds the chooser that outlives its epoch (the loader's lifecycle)."""

    def chooser(self, kind: str, make: Callable[[], Chooser], *, fresh: bool = False) -> Chooser:
        """The chooser of ``kind``, made by ``make`` the first time (every time if ``fresh``:
        for workers of this iterator's own, measured afresh)."""


def _event_loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def workers_place(cfg: PipelineConfig, *, off_loop: bool = False) -> str:
    """Where the pipeline's workers for ``cfg`` collate (:attr:`Runner.place`): ``"inline"``
    at ``num_workers=0`` (on the pipeline's loop), unless ``off_loop`` (``async for``: one
    collate thread)."""
    if cfg.num_workers == 0:
        return "threads" if off_loop else "inline"
    return "threads" if cfg.parallel_method == "thread" else "processes"


class InlineRunner(InlinePipeline):
    """:class:`~guideloom._runtime.inline.InlinePipeline` as a runner: every batch inline."""

    place = "inline"


def make_runner(cfg: PipelineConfig, choosers: Choosers) -> Runner:
    """The runner for ``cfg``'s epoch (see the module docstring for which and why)."""
    reads_inline = cfg.dataset.reads_inline
    if cfg.capacity == 0 and reads_inline:
        return InlineRunner(cfg)
    if cfg.num_workers > 0 and cfg.parallel_method == "thread" and reads_inline:
        return ThreadRunner(cfg, choosers.chooser("threads", functools.partial(thread_chooser, cfg.capacity)))
    if cfg.num_workers > 0 and cfg.parallel_method == "process" and reads_inline and cfg.device.type == "cpu":
        # To a device, the loop thread overlaps the copy with the next batch instead.
        return ProcessRunner(cfg, choosers)
    if cfg.capacity == 0 and not _event_loop_running_here():
        return CallerLoopRunner(cfg)
    return LoopThreadRunner(cfg)


class ThreadRunner:
    """Thread workers fed from the caller's thread, no event loop
    (:class:`~guideloom._runtime.threads.ThreadWorkerPipeline`)."""

    def __init__(self, cfg: PipelineConfig, chooser: Chooser) -> None:
        self._closed = False
        self._executor = CollateThreads(cfg.num_workers)
        self._pipe = ThreadWorkerPipeline(cfg, self._executor, chooser)

    @property
    def place(self) -> str:
        return self._pipe.place

    def next(self) -> Delivery | None:
        d = self._pipe.next()
        return None if self._closed else d  # None: close() in another thread ended this next()

    def close(self) -> None:
        self._closed = True
        self._pipe.close()
        self._executor.shutdown(wait=True, cancel_futures=True)


class ProcessRunner:
    """Process workers driven from the caller's thread, no event loop (:class:`SyncRun`), over a
    storage that reads inline, for batches that stay on the CPU; the collate runs inline while
    that is cheaper (:class:`ProcessChoiceRun`).

    While the workers start (a fork each, but the fork server's own start, once a process, takes
    about a second), the batches are read and collated inline, from the first; the workers take
    over from the batch after the last one made so, once they are up.
    """

    def __init__(self, cfg: PipelineConfig, choosers: Choosers) -> None:
        self._closed = False
        self._cfg = cfg
        self._workers: ProcessWorkers = process_workers(cfg)
        self._run = SyncRun(self._workers.flow(cfg, 0), cfg.capacity)
        # The loader's persistent workers keep their chooser from epoch to epoch; a pool of this
        # iterator's own starts afresh, as its workers do.
        make = functools.partial(process_chooser, cfg.capacity)
        self._chooser = choosers.chooser("processes", make, fresh=cfg.worker_pool is None)
        self._choice: ProcessChoiceRun | None = None  # once the workers are up
        self._starting: InlinePipeline | None = None  # the batches made while they start
        self._next_step = 0  # the step after the last batch made so
        pool = self._workers.pool
        try:
            pool.begin()  # from iter() on, the workers start while the consumer goes on
        except Exception:
            pass  # raised again by the pool's start in the workers' run, at the first batch
        # Collate pinned to the workers: every batch waits for them, the first ones too.
        if pool.starting() and not isinstance(self._chooser, PinnedChooser):
            self._starting = InlinePipeline(cfg)
        else:
            self._choice = ProcessChoiceRun(cfg, self._run, self._chooser)

    @property
    def place(self) -> str:
        # while the workers start, the batches are collated here
        return "inline" if self._choice is None else self._choice.place

    def next(self) -> Delivery | None:
        choice = self._choice
        if choice is None:
            d = self._while_starting()
            if d is not None or self._choice is None:  # a batch, or the epoch ended before them
                return None if self._closed else d
            choice = self._choice
        d = choice.next()
        return None if self._closed else d  # None: close() in another thread ended this next()

    def _while_starting(self) -> Delivery | None:
        """The next batch made inline while the workers start (the rest of a window read so
        too); None once they are up (:attr:`_choice` is then set) or at the end of the epoch."""
        inline = self._starting
        assert inline is not None
        if inline.buffered() or self._workers.pool.starting() or self._next_step >= len(self._cfg.plan):
            d = inline.next()  # None: the epoch ended before the workers were up (or as they came)
            if d is not None:
                self._next_step = d.spec.step + 1
            return d
        self._starting = None
        self._run.resume(self._next_step)  # the workers go on after the batches made inline
        self._choice = ProcessChoiceRun(self._cfg, self._run, self._chooser)
        return None

    def close(self) -> None:
        self._closed = True
        try:
            if self._starting is not None:
                self._starting.close()
            if self._choice is not None:
                self._choice.close()
            self._run.close()
        finally:
            self._workers.shutdown(wait=True)


class CallerLoopRunner:
    """The pipeline on a private asyncio loop that ``next()`` drives in the caller's thread
    (plain asyncio, whose ``run_until_complete`` costs half of uvloop's)."""

    place = "inline"  # num_workers=0: the collate runs on the loop, in the caller's thread

    def __init__(self, cfg: PipelineConfig) -> None:
        self._cfg = cfg
        self._closed = False
        self._inline: InlinePipeline | None = None
        self._loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        self._channel: Channel[Delivery] = Channel(self._loop, 0)
        self._task: asyncio.Task[None] | None = self._loop.create_task(
            run_pipeline(cfg, self._channel, 0, make_workers(cfg), own_loop=True)
        )

    def next(self) -> Delivery | None:
        if self._inline is not None:
            return self._inline.next()
        assert self._loop is not None
        try:
            d = self._loop.run_until_complete(self._channel.get_future())
        except EndOfStream:
            if self._closed:  # close() in another thread could not close the loop we were running
                self._close_loop()
            return None
        if d.error is None and self._cfg.dataset.reads_inline:
            # Before the batch counts as delivered: a failure here loses nothing.
            self._go_inline(d.spec.step + 1)
        return d

    def _go_inline(self, next_step: int) -> None:
        """The storage can now read inline (a remote dataset's local copy is complete): go on
        with the plain loop from ``next_step``. The event-loop pipeline's read-ahead is dropped;
        it held raw reads only, so nothing delivered changes."""
        self._close_loop()
        self._loop = self._task = None
        self._inline = InlinePipeline(self._cfg, first_step=next_step)

    def _close_loop(self) -> None:
        """Cancel the pipeline task and close the loop (when no ``next()`` is running it)."""
        loop, task = self._loop, self._task
        if loop is None or loop.is_closed():
            return
        if loop.is_running():  # another thread's next() is inside it: it finishes the job
            if task is not None:
                loop.call_soon_threadsafe(task.cancel)
            return
        try:
            if task is not None and not task.done():
                task.cancel()
                loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()

    def close(self) -> None:
        self._closed = True
        if self._inline is not None:
            self._inline.close()
        self._close_loop()


async def _drive(
    cfg: PipelineConfig, channel: Channel[Delivery], workers: Workers, finished: threading.Event
) -> None:
    """The loop thread's pipeline task. It holds no reference to the runner, so an abandoned
    iterator is collected (and closes the pipeline) even while this task waits."""
    try:
        await run_pipeline(cfg, channel, 0, workers, own_loop=True)
    finally:
        finished.set()  # set only once every stage has stopped


class LoopThreadRunner:
    """The pipeline on a loop thread of its own; batches come through the channel as soon as
    they are ready. The runner stops the thread when it closes (a loader holds no thread between
    iterators)."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.place = workers_place(cfg)
        self._finished = threading.Event()
        self._future: concurrent.futures.Future[None] | None = None
        self._workers: Workers | None = None
        self._lt = lt = LoopThread(name=f"guideloom-loop-{id(self):x}")
        try:
            self._channel: Channel[Delivery] = Channel(lt.loop, cfg.capacity)
            self._workers = make_workers(cfg)
            self._future = lt.submit(_drive(cfg, self._channel, self._workers, self._finished))
        except BaseException:
            self.close()
            raise

    def next(self) -> Delivery | None:
        try:
            return self._channel.get()
        except EndOfStream:
            return None

    def close(self) -> None:
        fut, lt, workers = self._future, self._lt, self._workers
        if fut is None:  # the start failed before the pipeline was submitted
            if workers is not None:
                workers.shutdown(wait=True)
            lt.stop()
            return
        if not fut.done():
            fut.cancel()  # cancels the pipeline task on the loop
        if lt.is_current():
            # Collected on our own loop thread (cyclic GC can run anywhere): the task finishes
            # on this loop once we return; do not wait for ourselves.
            if workers is not None:
                workers.shutdown(wait=False)
        else:
            # A cancelled future reports at once; wait for the task's cleanup to finish. A stage
            # that never returns to the loop (a collate_fn that blocks forever on the loop's own
            # thread, at num_workers=0) is left running there, as a collate thread would be.
            if not self._finished.wait(CLOSE_GRACE_S):
                warn_left_running("the pipeline (a collate_fn on its loop thread)", CLOSE_GRACE_S)
                self._channel.close()  # a consumer waiting in next() sees the end
                if workers is not None:
                    workers.shutdown(wait=False)
                lt.stop(timeout=0.0)
                return
            if workers is not None:
                workers.shutdown(wait=True)
        lt.stop()
