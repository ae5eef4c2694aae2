"""The loader's iterators: one class per way of running the pipeline, chosen when one starts.

``for batch in loader`` gets one of three sync iterators, picked by :func:`sync_iterator` once
the loader is open (as torchdata picks its iterator class):

- :class:`InlineIterator`: ``num_workers=0`` and ``prefetch=0`` over a storage that
  ``reads_inline()`` (memory, local files): the pipeline as a plain loop in the caller's thread
  (:class:`~guideloom._runtime.pipeline.InlinePipeline`), no event loop at all, as PyTorch loads batches
  in the main process at ``num_workers=0``; an event loop's turns would cost about a batch's
  whole work.
- :class:`CallerLoopIterator`: ``num_workers=0`` and ``prefetch=0`` over any other storage: the
  pipeline on a private asyncio loop that ``next()`` drives in the caller's thread (its reads
  stay in flight between batches; plain asyncio, whose ``run_until_complete`` costs half of
  uvloop's). It hands over to the plain loop at the next batch once the storage reads inline
  (a remote dataset's ``cache_dir`` copy is complete).
- :class:`LoopThreadIterator`: workers or prefetch (or a caller's thread that already runs an
  event loop, such as a notebook): the pipeline on a loop thread of its own, which the iterator
  stops when it ends (a loader holds no thread between iterators); batches come through the
  :class:`~guideloom._runtime.channel.Channel` as soon as they are ready.

- :class:`ProcessWorkerIterator`: ``parallel_method="process"`` workers: the caller's thread sends
  groups to the workers and takes their batches off the pipes itself, no event loop
  (:class:`~guideloom._runtime.processes.SyncRun`).
- :class:`ThreadWorkerIterator`: ``parallel_method="thread"`` workers over a storage that
  ``reads_inline()``: no event loop; the caller's thread reads and hands groups of batches to
  the worker threads, or collates inline while that is cheaper
  (:mod:`guideloom._runtime.threads`).

``async for`` gets :class:`AsyncIterator`, which runs the pipeline on the caller's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import pickle
import threading
import time
import weakref
from collections.abc import AsyncIterator as AsyncIteratorABC
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from guideloom._core.delivery import for_the_consumer
from guideloom._core.plan import EpochPlan
from guideloom._loader.lifecycle import wait_through_cancellation
from guideloom._loader.state import epoch_order
from guideloom._loop import LoopThread
from guideloom._runtime.channel import Channel, EndOfStream
from guideloom._runtime.pipeline import (
    Delivery,
    InlinePipeline,
    PipelineConfig,
    group_size,
    make_executor,
    reading_name,
    run_pipeline,
)
from guideloom._runtime.process_choice import ProcessChoiceRun
from guideloom._runtime.processes import ProcessWorkers, SyncRun
from guideloom._runtime.threads import ThreadWorkerPipeline, _Chooser

if TYPE_CHECKING:
    from guideloom._loader.host import Loader

__all__ = [
    "AsyncIterator",
    "CallerLoopIterator",
    "InlineIterator",
    "LoopThreadIterator",
    "ProcessWorkerIterator",
    "SyncIterator",
    "ThreadWorkerIterator",
    "pipeline_config",
    "sync_iterator",
]

BatchT = TypeVar("BatchT")


def pipeline_config(loader: Loader[Any]) -> PipelineConfig:
    """The pipeline of the loader's next epoch, from its parameters and position."""
    if loader.parallel_method == "process" and loader.num_workers > 0:
        try:
            pickle.dumps(loader.collate_fn)
        except Exception as exc:
            raise TypeError(
                "parallel_method='process' needs a picklable collate_fn (a module-level "
                f"function or a picklable object), got {loader.collate_fn!r}: {exc}. Use "
                "parallel_method='thread' for closures and lambdas"
            ) from exc
    n = len(loader.dataset)
    loader._figures.mark_epoch_reads(loader.dataset, loader._ckpt.epoch)
    order = epoch_order(loader, loader._ckpt.epoch)
    return PipelineConfig(
        dataset=loader.dataset,
        plan=EpochPlan(
            num_observations=n,
            local_batch_size=loader.local_batch_size,
            world_size=loader.world_size,
            rank=loader.rank,
            drop_last=loader.drop_last,
            start_offset=loader._ckpt.offset,
            order=order,
        ),
        order=order,
        collate_fn=loader.collate_fn,
        device=loader.device,
        pin_memory=loader.pin_memory,
        num_workers=loader.num_workers,
        parallel_method=loader.parallel_method,
        prefetch=loader.prefetch,
        worker_pool=functools.partial(loader._life.worker_pool, loader)
        if loader.persistent_workers
        else None,
    )


class _IteratorBase(Generic[BatchT]):
    """What every iterator shares: claiming the loader and advancing its state."""

    def __init__(self, loader: Loader[BatchT]) -> None:
        self._loader = loader
        self._done = True  # until a subclass has started: __del__ and close() then do nothing
        self._owns_open = False
        self._expected = self._delivered = 0
        self._executor: concurrent.futures.Executor | None = None
        loader._life.active.claim(self)

    def __len__(self) -> int:
        """Batches this iterator still yields: the rest of the epoch from where it stands (after a
        resume, what is left, not the whole epoch), which is what ``tqdm(iter(loader))`` shows."""
        if not hasattr(self, "_cfg"):  # an async iterator plans its epoch at its first batch
            return self._loader.remaining()
        return 0 if self._done else self._expected - self._delivered

    def _configure(self, cfg: PipelineConfig) -> None:
        """This iterator's epoch; planned once the loader is open (a storage may know its length
        only then)."""
        self._cfg = cfg
        self._expected = len(cfg.plan)

    def _start_executor(self, *, off_loop: bool = False) -> concurrent.futures.Executor | None:
        self._executor = make_executor(self._cfg, off_loop=off_loop)
        return self._executor

    def _join_executor(self) -> None:
        """Wait for the collate workers (threads or processes) to exit."""
        ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)

    def _accept(self, d: Delivery, waited: float) -> BatchT:
        stats = self._loader._figures.counts
        stats["wait_seconds"] += waited
        stats["last_wait_seconds"] = waited
        if d.error is not None:
            raise for_the_consumer(d.error)
        self._loader._ckpt.offset = d.spec.offset_after
        self._delivered += 1
        stats["batches"] += 1
        stats["samples"] += d.spec.size
        value: BatchT = d.value
        return value

    def _finish_epoch(self) -> None:
        if self._delivered != self._expected:
            raise RuntimeError(
                f"guideloom bug: the pipeline ended after {self._delivered} of "
                f"{self._expected} batches without an error"
            )
        self._loader._ckpt.epoch += 1
        self._loader._ckpt.offset = 0

    def close_sync(self) -> None:
        raise NotImplementedError

    async def close_async(self) -> None:
        raise NotImplementedError


def _event_loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def sync_iterator(loader: Loader[BatchT]) -> SyncIterator[BatchT]:
    """The iterator ``for batch in loader`` uses, of the class its configuration needs.

    An unopened loader is opened for the iterator's duration first: whether the storage reads
    inline may be known only once it is open (a remote dataset's local copy).
    """
    owns_open = loader._life.state == "closed"
    if owns_open:
        loader.open()
    try:
        cfg = pipeline_config(loader)
        cls: type[SyncIterator[BatchT]]
        if cfg.capacity == 0 and cfg.dataset.reads_inline:
            cls = InlineIterator
        elif cfg.num_workers > 0 and cfg.parallel_method == "thread" and cfg.dataset.reads_inline:
            cls = ThreadWorkerIterator
        elif cfg.num_workers > 0 and cfg.parallel_method == "process" and cfg.device.type == "cpu":
            cls = ProcessWorkerIterator  # to a device, the loop thread overlaps the copy with the next batch
        elif cfg.capacity == 0 and not _event_loop_running_here():
            cls = CallerLoopIterator
        else:
            cls = LoopThreadIterator
        return cls(loader, cfg, owns_open)
    except BaseException:
        if owns_open:
            loader.close()  # idempotent: a started iterator that failed has closed it already
        raise


class SyncIterator(_IteratorBase[BatchT], Iterator[BatchT]):
    """What the three sync iterators share: ``next()``'s bookkeeping and closing.

    A subclass starts its pipeline in :meth:`_start`, produces the next delivery in
    :meth:`_next` (``None`` at the end of the stream) and stops everything in :meth:`_stop`,
    which must also undo a :meth:`_start` that failed halfway.
    """

    def __init__(self, loader: Loader[BatchT], cfg: PipelineConfig, owns_open: bool) -> None:
        super().__init__(loader)
        self._owns_open = owns_open
        self._configure(cfg)
        self._done = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        raise NotImplementedError

    def _next(self) -> Delivery | None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def __iter__(self) -> SyncIterator[BatchT]:
        return self

    def __next__(self) -> BatchT:
        if self._done:
            raise StopIteration
        try:
            t0 = time.perf_counter()
            d = self._next()
            waited = time.perf_counter() - t0
        except BaseException as exc:
            if isinstance(exc, Exception) and self._done:
                raise StopIteration from None  # close() in another thread ended this next()
            self._close_after_error()
            raise
        if d is None:
            if not self._done:  # the end of the epoch, not a close() in another thread
                try:
                    self._finish_epoch()
                finally:
                    self.close()
            raise StopIteration
        if d.error is not None:
            self._close_after_error()
        return self._accept(d, waited)

    def _close_after_error(self) -> None:
        """Close, and shut the loader's process workers down too (a failed epoch leaves nothing
        running; the next iterator starts new workers)."""
        try:
            self.close()
        finally:
            pool = self._loader._life.drop_workers()
            if pool is not None:
                pool.close()

    def close(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            self._stop()
        finally:
            self._loader._life.active.release(self)
            if self._owns_open:
                self._loader._life.close(self._loader, keep_workers=True)

    close_sync = close

    async def close_async(self) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close()


class InlineIterator(SyncIterator[BatchT]):
    """The pipeline as a plain loop in the caller's thread (see the module docstring)."""

    def _start(self) -> None:
        self._inline = InlinePipeline(self._cfg)
        self._next = self._inline.next  # type: ignore[method-assign]  # the hot path: no extra frame

    def _stop(self) -> None:
        inline = getattr(self, "_inline", None)
        if inline is not None:
            inline.close()


class CallerLoopIterator(SyncIterator[BatchT]):
    """The pipeline on a private asyncio loop that ``next()`` drives (see the module docstring)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _task: asyncio.Task[None] | None = None
    _inline: InlinePipeline | None = None

    def _start(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        self._channel: Channel[Delivery] = Channel(loop, 0)
        self._task = loop.create_task(run_pipeline(self._cfg, self._channel, 0, None, own_loop=True))

    def _next(self) -> Delivery | None:
        if self._inline is not None:
            return self._inline.next()
        assert self._loop is not None
        try:
            d = self._loop.run_until_complete(self._channel.get_future())
        except EndOfStream:
            if self._done:  # close() in another thread could not close the loop we were running
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

    def _stop(self) -> None:
        if self._inline is not None:
            self._inline.close()
        self._close_loop()


#: Each loader's thread-worker chooser: what one epoch learnt holds for the next, which starts in
#: the mode the last one ended in (not with a fresh probe of both).
_THREAD_CHOOSERS: weakref.WeakKeyDictionary[Any, _Chooser] = weakref.WeakKeyDictionary()


def _thread_chooser(loader: Any, cfg: PipelineConfig) -> _Chooser:
    chooser = _THREAD_CHOOSERS.get(loader)
    if chooser is None:
        limit = cfg.capacity + 1
        chooser = _THREAD_CHOOSERS[loader] = _Chooser(skip=limit, chunk=max(8, 2 * limit))
    return chooser


class ThreadWorkerIterator(SyncIterator[BatchT]):
    """Thread workers fed from the caller's thread, no event loop (see the module docstring)."""

    _pipe: ThreadWorkerPipeline | None = None

    def _start(self) -> None:
        executor = self._start_executor()
        assert executor is not None
        self._pipe = ThreadWorkerPipeline(self._cfg, executor, _thread_chooser(self._loader, self._cfg))

    def _next(self) -> Delivery | None:
        assert self._pipe is not None
        d = self._pipe.next()
        return None if self._done else d  # None: close() in another thread ended this next()

    def _stop(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        self._join_executor()


class ProcessWorkerIterator(SyncIterator[BatchT]):
    """Process workers driven from the caller's thread, no event loop (:class:`SyncRun`), for
    batches that stay on the CPU: a copy to a device would run here, after each batch, where the
    loop thread's mover overlaps it with the next."""

    _run: SyncRun | None = None
    _choice: ProcessChoiceRun | None = None

    def _start(self) -> None:
        executor = self._start_executor()
        assert isinstance(executor, ProcessWorkers)
        cfg = self._cfg
        group = group_size(cfg.capacity, cfg.num_workers)
        self._run = SyncRun(executor.session, cfg.plan, cfg.order, reading_name(cfg), 0, group, cfg.capacity)
        if cfg.dataset.reads_inline:  # the collate may run inline while that is cheaper
            self._choice = ProcessChoiceRun(cfg, self._run)

    def _next(self) -> Delivery | None:
        source = self._choice or self._run
        assert source is not None
        d = source.next()
        if d is None or self._done:
            return None  # the end, or close() in another thread ended this next()
        return d

    def _stop(self) -> None:
        if self._choice is not None:
            self._choice.close()
        if self._run is not None:
            self._run.close()
        self._join_executor()


async def _drive(
    cfg: PipelineConfig,
    channel: Channel[Delivery],
    executor: concurrent.futures.Executor | None,
    finished: threading.Event,
) -> None:
    """The loop thread's pipeline task. It holds no reference to the iterator, so an abandoned
    iterator is collected (and closes the pipeline) even while this task waits."""
    try:
        await run_pipeline(cfg, channel, 0, executor, own_loop=True)
    finally:
        finished.set()  # set only once every stage has stopped


class LoopThreadIterator(SyncIterator[BatchT]):
    """The pipeline on a loop thread of its own (see the module docstring)."""

    _lt: LoopThread | None = None
    _future: concurrent.futures.Future[None] | None = None

    def _start(self) -> None:
        self._finished = threading.Event()
        self._lt = lt = LoopThread(name=f"guideloom-loop-{id(self._loader):x}")
        self._channel: Channel[Delivery] = Channel(lt.loop, self._cfg.capacity)
        self._start_executor()
        self._future = lt.submit(_drive(self._cfg, self._channel, self._executor, self._finished))

    def _next(self) -> Delivery | None:
        try:
            return self._channel.get()
        except EndOfStream:
            return None

    def _stop(self) -> None:
        fut, lt = self._future, self._lt
        if fut is None:  # the start failed before the pipeline was submitted
            self._join_executor()
            if lt is not None:
                lt.stop()
            return
        assert lt is not None
        if not fut.done():
            fut.cancel()  # cancels the pipeline task on the loop
        if lt.is_current():
            # Collected on our own loop thread (cyclic GC can run anywhere): the task finishes
            # on this loop once we return; do not wait for ourselves.
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
        else:
            # A cancelled future reports at once; wait for the task's cleanup to finish.
            self._finished.wait()
            self._join_executor()
        lt.stop()


class AsyncIterator(_IteratorBase[BatchT], AsyncIteratorABC[BatchT]):
    """The iterator ``async for batch in loader`` uses: the pipeline runs on the caller's loop."""

    def __init__(self, loader: Loader[BatchT]) -> None:
        super().__init__(loader)
        self._task: asyncio.Task[None] | None = None
        self._channel: Channel[Delivery] | None = None
        self._done = False

    def __aiter__(self) -> AsyncIterator[BatchT]:
        return self

    async def _start(self) -> Channel[Delivery]:
        loader = self._loader
        # What an earlier iterator, dropped without being closed, left running (its pipeline
        # task and workers) finishes first: it must not touch the workers this one will use.
        await loader._life.active.ajoin_left()
        if loader._life.state == "closed":
            await loader.aopen()
            self._owns_open = True
        self._configure(pipeline_config(loader))
        loop = asyncio.get_running_loop()
        channel: Channel[Delivery] = Channel(loop, self._cfg.capacity)
        # The caller's loop serves other tasks: collate_fn never runs on it (one thread at
        # num_workers=0), however long it takes.
        executor = self._start_executor(off_loop=True)
        self._task = loop.create_task(
            run_pipeline(self._cfg, channel, 0, executor), name="guideloom-pipeline"
        )
        self._channel = channel
        return channel

    async def __anext__(self) -> BatchT:
        if self._done:
            raise StopAsyncIteration
        try:
            channel = self._channel or await self._start()
            t0 = time.perf_counter()
            fut = channel.get_future()
            if fut.done():
                # A buffered batch: awaiting a done future does not suspend, so give the loop
                # its turn here (a checkpoint, anyio's word), once per batch, or a consumer that
                # never waits for a batch would starve every other task on the loop.
                await asyncio.sleep(0)
            d = await fut
            waited = time.perf_counter() - t0
        except EndOfStream:
            if self._done:  # aclose() in another task ended the pipeline while this one waited
                raise StopAsyncIteration from None
            try:
                self._finish_epoch()
            finally:
                await self.aclose()
            raise StopAsyncIteration from None
        except BaseException:
            await self._aclose_after_error()
            raise
        if d.error is not None:
            await self._aclose_after_error()
        return self._accept(d, waited)

    async def _aclose_after_error(self) -> None:
        """As ``SyncIterator._close_after_error``: the process workers are shut down too."""
        try:
            await self.aclose()
        finally:
            pool = self._loader._life.drop_workers()
            if pool is not None:  # joined even if the task is cancelled (again) meanwhile
                closing = asyncio.get_running_loop().run_in_executor(None, pool.close)
                if await wait_through_cancellation(closing):
                    raise asyncio.CancelledError

    async def aclose(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            # Every stage and worker has stopped before this returns, even when the task that
            # closes is cancelled meanwhile (a cancelled ``async for``): its cancellation is
            # raised once the workers are joined, not before, so nothing outlives the loop.
            cancelled = False
            task = self._task
            if task is not None and not task.done():
                task.cancel()
                cancelled = await wait_through_cancellation(task)
            if task is not None and task.done() and not task.cancelled():
                task.exception()  # retrieved: its failures reached the consumer as deliveries
            if self._executor is not None:
                joined = asyncio.get_running_loop().run_in_executor(None, self._join_executor)
                cancelled = await wait_through_cancellation(joined) or cancelled
                joined.result()
            if cancelled:
                raise asyncio.CancelledError
        finally:
            self._loader._life.active.release(self)
            if self._owns_open:
                await self._loader._life.aclose(self._loader, keep_workers=True)

    close_async = aclose

    def close_sync(self) -> None:
        if self._done:
            return
        task = self._task
        self._done = True
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        # Nothing is awaited here (collected, or closed from sync code): closing the loader joins it.
        self._loader._life.active.leave(task, self._executor)
        self._executor = None
        self._loader._life.active.release(self)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close_sync()
