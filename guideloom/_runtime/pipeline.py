"""The loading pipeline: reader → collate → device transfer, joined by bounded anyio streams.

The plan is deterministic, so the reader knows every upcoming batch: it reads *windows* of
consecutive batches with one batched storage call each (several in flight for object stores),
growing the window from one batch (fast first batch) up to a byte budget. Collation runs inline
(``num_workers=0``) or on worker threads or processes, always delivered in plan order. The
transfer stage pins and copies to the device. Every buffer is bounded; only the consumer's
requests (credits on the :class:`~guideloom._runtime.channel.Channel`) let collation run ahead.

A failure anywhere becomes a :class:`Delivery` carrying the exception at the position of the batch
that failed; everything before it is still delivered, nothing after it is produced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
import anyio.streams.memory
import numpy as np
import numpy.typing as npt
from anyio.abc import ObjectReceiveStream, ObjectSendStream

try:  # anyio loads its asyncio backend on first use: load it with guideloom, not on a first batch
    import anyio._backends._asyncio
except ImportError:  # pragma: no cover - a future anyio may move it; it then loads lazily
    pass

from guideloom._core.delivery import DELIVERED_ERRORS, apply, apply_group
from guideloom._core.order import Order
from guideloom._core.plan import BatchSpec, EpochPlan
from guideloom._core.schedule import (
    WINDOW_BATCHES,
    Delivery,
    Indexes,
    future_reads,
    max_window,
    read_window,
    run_async,
    run_sync,
    windows,
)
from guideloom._datasets.base import DatasetAbstract
from guideloom._runtime.channel import Channel
from guideloom._runtime.processes import ProcessWorkers, WorkerPool

if TYPE_CHECKING:
    import torch

__all__ = [
    "Delivery",
    "making_steps",
    "InlinePipeline",
    "PipelineConfig",
    "make_executor",
    "move_to_device",
    "reading_name",
    "run_pipeline",
]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    dataset: DatasetAbstract[Any]
    plan: EpochPlan
    order: Order
    collate_fn: Callable[[Sequence[Any]], Any]
    device: torch.device
    pin_memory: bool
    num_workers: int
    parallel_method: Literal["thread", "process"]
    prefetch: int
    #: The loader's persistent process workers (``persistent_workers=True``); None: a pool of
    #: this iterator's own.
    worker_pool: Callable[[], WorkerPool] | None = None

    @property
    def capacity(self) -> int:
        """Batches that may be prepared ahead of the consumer's requests."""
        return self.prefetch + self.num_workers


# -- device transfer ------------------------------------------------------------------------------
def move_to_device(obj: Any, device: torch.device, pin_memory: bool) -> Any:
    """Move every tensor in a nested dict/list/tuple to ``device`` (pinned first for CUDA)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if device.type == "cuda":
            if pin_memory and obj.device.type == "cpu" and not obj.is_pinned():
                obj = obj.pin_memory()
            return obj.to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, Mapping):
        moved = {k: move_to_device(v, device, pin_memory) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(obj, tuple):
        items = [move_to_device(v, device, pin_memory) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items)
    if isinstance(obj, list):
        return [move_to_device(v, device, pin_memory) for v in obj]
    return obj


def making_steps(cfg: PipelineConfig) -> tuple[Callable[[Any], Any], ...]:
    """What makes a read batch into a delivered one: ``collate_fn``, then the copy to the device
    where there is one to make (on CPU a batch stays where it is)."""
    if cfg.device.type == "cpu":
        return (cfg.collate_fn,)
    return (cfg.collate_fn, functools.partial(move_to_device, device=cfg.device, pin_memory=cfg.pin_memory))


# -- reader ------------------------------------------------------------------------------------------
def _max_window(cfg: PipelineConfig) -> int:
    storage = cfg.dataset.storage
    most = max(1, int(getattr(storage, "read_window_batches", WINDOW_BATCHES)))
    return max_window(cfg.plan, cfg.dataset.sample_nbytes_hint(), cfg.dataset.read_window_bytes, most)


def _span(cfg: PipelineConfig) -> int:
    """Order positions per aligned read window, where the storage asks for blocks (object
    stores); 0 elsewhere (windows of 1, 2, 4, ... batches, as before).

    A block shuffle's mixing window: one read is a few large requests. Any other order: the
    largest window, with no ramp of small windows in between, since a small window of a
    shuffled epoch is scattered samples, one request each, where the largest one coalesces.
    """
    if getattr(cfg.dataset.storage, "shuffle_block_bytes", None) is None:
        return 0
    span = int(getattr(cfg.order, "span", 0))
    return span if span > 0 else _max_window(cfg) * cfg.plan.global_batch_size


def _reading(cfg: PipelineConfig) -> str:
    storage = cfg.dataset.storage  # None for a dataset reading a source of its own
    return f"{type(cfg.dataset if storage is None else storage).__name__}.read_many"


#: What a read's failure names (public for the process workers' sync iterator).
reading_name = _reading


def _reads_for(
    dataset: DatasetAbstract[Any], own_loop: bool
) -> Callable[[npt.NDArray[np.int64]], Awaitable[Sequence[Any]]]:
    """The async read the reader uses. On a caller's loop, the dataset's ``read_many`` (whose
    blocking work runs on a worker thread). On guideloom's private loop, which serves nothing
    else, a dataset that reads inline (page-cached local files) is read by its blocking read
    right there: measured here, the hop to a worker thread (and the batch changing CPU cores
    between the read and the collate) cost more than the read itself."""
    if not own_loop:
        return dataset.read_many

    async def read(indices: npt.NDArray[np.int64]) -> Sequence[Any]:
        if dataset.reads_inline:  # asked per window: a remote dataset's local copy may complete
            return dataset.read_many_sync(indices)
        return await dataset.read_many(indices)

    return read


async def _reader(
    cfg: PipelineConfig,
    send: ObjectSendStream[list[Delivery]],
    first_step: int,
    aread: Callable[[npt.NDArray[np.int64]], Awaitable[Sequence[Any]]],
) -> None:
    """Read the schedule's windows ahead, up to ``max_concurrent_reads`` at once, with ``aread``,
    and send them in order."""
    concurrency = cfg.dataset.max_concurrent_reads
    indexes = Indexes(cfg.plan, cfg.order)
    reading = _reading(cfg)
    # The plan is known: tell the storage what comes (a chunk cache downloads ahead by it).
    ahead = windows(cfg.plan, first_step, _max_window(cfg), _span(cfg))  # the windows read below
    cfg.dataset.will_read(future_reads(cfg.plan, cfg.order, ahead))
    async with send, anyio.create_task_group() as tg:
        results: deque[tuple[anyio.Event, list[list[Delivery] | BaseException]]] = deque()
        limit = anyio.Semaphore(concurrency)

        async def run(specs: list[BatchSpec], done: anyio.Event, slot: list[Any]) -> None:
            try:
                slot.append(await run_async(read_window(specs, indexes, reading), aread))
            except DELIVERED_ERRORS as exc:
                slot.append([Delivery(specs[0], error=exc)])
            finally:
                limit.release()
                done.set()

        async def drain(until: int) -> bool:
            while len(results) > until:
                event, slot = results.popleft()
                await event.wait()
                window = slot[0]
                assert isinstance(window, list)
                try:
                    await send.send(window)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return False  # downstream stopped at an earlier failure
                if window and window[-1].error is not None:
                    return False
            return True

        first = True
        for specs in windows(cfg.plan, first_step, _max_window(cfg), _span(cfg)):
            await limit.acquire()
            event = anyio.Event()
            slot: list[Any] = []
            results.append((event, slot))
            tg.start_soon(run, specs, event, slot)
            if first and concurrency > 1:
                # A fast first batch: no read-ahead competes with its read for connections,
                # bandwidth or CPU (measured over a 20 ms link: 2.3 s to the first batch with a
                # 64 MiB read-ahead window in flight beside it).
                first = False
                await event.wait()
                if not await drain(0):  # deliver it before the read-ahead starts
                    tg.cancel_scope.cancel()
                    return
            if not await drain(concurrency - 1):
                tg.cancel_scope.cancel()
                return
        await drain(0)


# -- collate -----------------------------------------------------------------------------------------
def make_executor(cfg: PipelineConfig, *, off_loop: bool = False) -> concurrent.futures.Executor | None:
    """The collate workers for ``cfg``: none at ``num_workers=0`` unless ``off_loop`` (a caller's
    event loop must never run ``collate_fn``: then one thread collates)."""
    if cfg.num_workers == 0:
        if off_loop:
            return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guideloom-collate")
        return None
    if cfg.parallel_method == "thread":
        return concurrent.futures.ThreadPoolExecutor(cfg.num_workers, thread_name_prefix="guideloom-collate")
    if cfg.worker_pool is not None:
        return ProcessWorkers(cfg.worker_pool(), owned=False)
    return ProcessWorkers(WorkerPool(cfg.dataset, cfg.collate_fn, cfg.num_workers), owned=True)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: asyncio does not log "Future exception was never retrieved"


def _discard(futures: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel collate groups nobody will wait for, retrieving any error they end with."""
    for fut in futures:
        fut.add_done_callback(_retrieve)
        fut.cancel()


def group_size(capacity: int, num_workers: int) -> int:
    """Batches per worker call: enough to amortise the hand-off, small enough to keep all busy."""
    return max(1, min(8, capacity // (2 * max(1, num_workers))))


async def _collate(
    cfg: PipelineConfig,
    receive: ObjectReceiveStream[list[Delivery]],
    emit: Callable[[Delivery], Any],
    channel: Channel[Delivery],
    executor: concurrent.futures.Executor | None,
) -> None:
    """Collate each batch once the consumer has granted a credit for it; emit in plan order."""
    async with receive:
        if executor is None:
            async for window in receive:
                # Hand each batch on without keeping a reference: a delivered batch must be
                # freed when the consumer drops it, not when the window is done (memory, and
                # the allocator reuses the freed block for the next batch instead of faulting
                # in fresh pages).
                window.reverse()
                while window:
                    d = window.pop()
                    await channel.reserve()
                    failed = apply(d, cfg.collate_fn)
                    await emit(d)
                    del d
                    if failed:
                        return
            return

        loop = asyncio.get_running_loop()
        workers = max(1, cfg.num_workers)  # num_workers=0 with an executor: one collate thread
        max_group = group_size(cfg.capacity, workers)
        pending: deque[tuple[list[Delivery], asyncio.Future[list[tuple[Any, BaseException | None]]]]] = (
            deque()
        )
        group: list[Delivery] = []

        def submit() -> None:
            if group:
                batches = [d.value for d in group]
                fut = loop.run_in_executor(executor, apply_group, (cfg.collate_fn,), batches)
                pending.append((list(group), fut))
                group.clear()

        async def flush(keep: int) -> bool:
            """Emit finished groups, oldest first, until at most ``keep`` are in flight."""
            while len(pending) > keep:
                ds, fut = pending.popleft()
                try:
                    results = await fut
                except Exception as exc:  # the group's own failure (collate errors come per batch)
                    results = [(None, exc)]
                ds.reverse()
                results.reverse()
                while ds and results:  # pop as we go: emitted batches are not kept alive here
                    d = ds.pop()
                    d.value, d.error = results.pop()
                    failed = d.error is not None
                    await emit(d)
                    del d
                    if failed:
                        return False
            return True

        try:
            async for window in receive:
                window.reverse()
                while window:
                    d = window.pop()
                    if d.error is not None:
                        submit()
                        if await flush(0):
                            await channel.reserve()
                            await emit(d)
                        return
                    if not channel.try_reserve():
                        submit()  # no credit now: start what we have before waiting
                        if not await flush(workers - 1):
                            return
                        await channel.reserve()
                    group.append(d)
                    del d
                    if len(group) >= max_group:
                        submit()
                        if not await flush(workers - 1):
                            return
                submit()
                if not await flush(workers - 1):
                    return
            submit()
            await flush(0)
        finally:
            _discard(f for _, f in pending)  # after a failure: nothing waits for them


async def _produce(
    cfg: PipelineConfig,
    first_step: int,
    own_loop: bool,
    emit: Callable[[Delivery], Any],
    channel: Channel[Delivery],
    executor: concurrent.futures.Executor | None,
) -> None:
    """Read and collate from ``first_step``, emitting in plan order: the reader and collate
    stages here, or process workers that read and collate their own batches."""
    if isinstance(executor, ProcessWorkers):
        group = group_size(cfg.capacity, cfg.num_workers)
        await executor.session.run(cfg.plan, cfg.order, _reading(cfg), first_step, group, emit, channel)
        return
    to_collate_send, to_collate_recv = anyio.create_memory_object_stream[list[Delivery]](1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_reader, cfg, to_collate_send, first_step, _reads_for(cfg.dataset, own_loop))
        tg.start_soon(_collate, cfg, to_collate_recv, emit, channel, executor)


# -- no concurrency: the caller's thread ------------------------------------------------------------
class InlinePipeline:
    """The whole pipeline as a plain loop in the caller's thread: one batch per :meth:`next`.

    For ``num_workers=0`` and ``prefetch=0`` over a storage that ``reads_inline``: nothing may be
    prepared ahead of a request, so an event loop would only add its own turns to every batch
    (about as much as a whole batch's work, measured here). The stages are :func:`run_pipeline`'s:
    windowed reads, collate, transfer, and a failure delivered at the batch that failed, after
    which nothing is produced. It keeps no reference to a batch it has returned.
    """

    def __init__(self, cfg: PipelineConfig, first_step: int = 0) -> None:
        self._cfg = cfg
        self._indexes = Indexes(cfg.plan, cfg.order)
        self._windows = windows(cfg.plan, first_step, _max_window(cfg), _span(cfg))
        self._read = cfg.dataset.read_many_sync
        self._reading = _reading(cfg)
        self._steps = making_steps(cfg)
        self._pending: list[Delivery] = []  # the window's uncollated batches, last first

    def buffered(self) -> int:
        """Batches of the current window read and not yet returned."""
        return len(self._pending)

    def next_raw(self) -> Delivery | None:
        """The next batch as read, not collated (or the read's error in its place); ``None`` at the
        end of the epoch. Thread workers collate what this returns."""
        pending = self._pending
        if not pending:
            specs = next(self._windows, None)
            if specs is None:
                return None
            pending.extend(reversed(run_sync(read_window(specs, self._indexes, self._reading), self._read)))
        try:
            return pending.pop()
        except IndexError:  # close() from another thread meanwhile
            return None

    def next(self) -> Delivery | None:
        """The next batch (or the error in its place); ``None`` once the epoch or a failure ended it."""
        d = self.next_raw()
        if d is None:
            return None
        for step in self._steps:
            if apply(d, step):
                self.close()
                break
        return d

    def close(self) -> None:
        """Produce nothing more."""
        self._pending.clear()
        self._windows = iter(())


# -- the whole pipeline -------------------------------------------------------------------------------
async def run_pipeline(
    cfg: PipelineConfig,
    channel: Channel[Delivery],
    first_step: int,
    executor: concurrent.futures.Executor | None,
    *,
    own_loop: bool = False,
) -> None:
    """Run every stage until the epoch's last batch (or the first failure) reaches ``channel``.

    ``executor`` (from :func:`make_executor`) runs collation (when None, it runs on this loop); the caller
    owns it and shuts it down once this coroutine has finished, so that a cancelled pipeline
    still joins its workers. ``own_loop`` says the loop is guideloom's private one (see
    :func:`_reads_for`).
    """
    try:
        transfer = cfg.device.type != "cpu"
        async with anyio.create_task_group() as tg:
            if transfer:
                to_move_send, to_move_recv = anyio.create_memory_object_stream[Delivery](max(1, cfg.capacity))

                async def emit_to_transfer(d: Delivery) -> None:
                    await to_move_send.send(d)

                async def collate_then_close() -> None:
                    async with to_move_send:
                        await _produce(cfg, first_step, own_loop, emit_to_transfer, channel, executor)

                async def mover() -> None:
                    async with to_move_recv:
                        move = functools.partial(move_to_device, device=cfg.device, pin_memory=cfg.pin_memory)
                        async for d in to_move_recv:
                            failed = apply(d, move)
                            channel.put(d)
                            del d
                            if failed:
                                tg.cancel_scope.cancel()  # nothing after a failure is delivered
                                return

                tg.start_soon(collate_then_close)
                tg.start_soon(mover)
            else:
                # On CPU there is nothing to transfer: collated batches go straight to the consumer.
                async def emit_direct(d: Delivery) -> None:
                    channel.put(d)

                tg.start_soon(_produce, cfg, first_step, own_loop, emit_direct, channel, executor)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise  # cancellation: the consumer closed the iterator
        # A failure outside any batch (a bug, or the executor could not start): report it at the
        # next batch, unwrapped from the task group's ExceptionGroup when it is a single error.
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        spec = cfg.plan.batch(first_step) if first_step < len(cfg.plan) else BatchSpec(first_step, 0, 0, 0)
        channel.put(Delivery(spec, error=exc))
    finally:
        channel.close()  # the owner of ``executor`` shuts it down and joins its workers
