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
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

from guideloom._core.delivery import DELIVERED_ERRORS, Delivery, Results, apply, apply_group
from guideloom._core.plan import BatchSpec
from guideloom._core.schedule import Indexes, future_reads, read_window, run_async, windows
from guideloom._datasets import DatasetAbstract
from guideloom._runtime.channel import Channel
from guideloom._runtime.config import (
    PipelineConfig,
    group_size,
    max_window_batches,
    move_to_device,
    reading_name,
    window_bounds,
)
from guideloom._runtime.groups import CollateGroups
from guideloom._runtime.threadpool import CollateThreads

__all__ = ["GroupRunner", "Production", "StageWorkers", "Workers", "read_and_collate", "run_pipeline"]


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
    reading = reading_name(cfg)
    # The plan is known: tell the storage what comes (a chunk cache downloads ahead by it).
    # the windows read below
    ahead = windows(cfg.plan, first_step, max_window_batches(cfg), window_bounds(cfg))
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
        for specs in windows(cfg.plan, first_step, max_window_batches(cfg), window_bounds(cfg)):
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
def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: asyncio does not log "Future exception was never retrieved"


def _discard(futures: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel collate groups nobody will wait for, retrieving any error they end with."""
    for fut in futures:
        fut.add_done_callback(_retrieve)
        fut.cancel()


#: Starts a group's collate off the loop: its specs and raw batches in, the future of its results.
GroupRunner = Callable[[list[BatchSpec], list[Any]], "asyncio.Future[Results]"]


async def _collate(
    cfg: PipelineConfig,
    receive: ObjectReceiveStream[list[Delivery]],
    emit: Callable[[Delivery], Any],
    channel: Channel[Delivery],
    run_group: GroupRunner | None,
    workers: int,
    in_flight: int,
) -> None:
    """Collate each batch once the consumer has granted a credit for it; emit in plan order.

    ``run_group`` collates groups of consecutive batches on ``workers`` workers (threads, or
    process workers), at most ``in_flight`` groups at once; None: the loop collates itself."""
    async with receive:
        if run_group is None:
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

        max_group = group_size(cfg.capacity, workers)
        pending: CollateGroups[asyncio.Future[Results]] = CollateGroups()
        group: list[Delivery] = []

        def submit() -> None:
            nonlocal group
            pending.start(group, run_group)
            group = []

        async def flush(keep: int) -> bool:
            """Emit finished groups, oldest first, until at most ``keep`` are in flight."""
            while len(pending) > keep:
                fut = pending.head_future()
                if fut is not None:
                    try:
                        results = await fut
                    except Exception as exc:  # the group's own failure (collate errors come per batch)
                        results = [(None, exc)]
                    pending.resolve_head(results)
                for _ in range(pending.head_size()):  # taken as emitted: not kept alive here
                    d = pending.take()
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
                        if not await flush(in_flight - 1):
                            return
                        while not channel.try_reserve():
                            if not pending:
                                await channel.reserve()
                                break
                            # The consumer's credits may all be held by batches of groups not
                            # yet emitted (more groups in flight than credits): the oldest goes
                            # out before waiting for another.
                            if not await flush(len(pending) - 1):
                                return
                    group.append(d)
                    del d
                    if len(group) >= max_group:
                        submit()
                        if not await flush(in_flight - 1):
                            return
                submit()
                if not await flush(in_flight - 1):
                    return
            submit()
            await flush(0)
        finally:
            _discard(pending.futures())  # after a failure: nothing waits for them


@dataclass(frozen=True, slots=True)
class Production:
    """What a pipeline asks its workers to make: ``cfg``'s epoch from ``first_step``, each batch
    handed to ``emit`` in plan order, a failure at its batch and nothing after it, within the
    ``channel``'s credits. ``own_loop``: the loop is guideloom's private one."""

    cfg: PipelineConfig
    first_step: int
    own_loop: bool
    emit: Callable[[Delivery], Awaitable[None]]
    channel: Channel[Delivery]


class Workers(Protocol):
    """What makes an epoch's batches on the loop: the reader and collate stages (the collate inline,
    or on threads), or process workers that read and collate their own. Each answers for itself."""

    async def produce(self, job: Production) -> None:
        """Make what ``job`` asks for."""

    def shutdown(self, wait: bool = True) -> None:
        """Stop, joining what runs the work unless ``wait`` is false."""


async def read_and_collate(
    job: Production, run_group: GroupRunner | None, workers: int, in_flight: int | None = None
) -> None:
    """The reader and collate stages on the loop for ``job``: windows read here, each group of
    batches collated by ``run_group`` on ``workers`` workers, ``in_flight`` groups at once at
    most (default: one per worker), or by the loop itself (``run_group`` None)."""
    cfg = job.cfg
    to_collate_send, to_collate_recv = anyio.create_memory_object_stream[list[Delivery]](1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_reader, cfg, to_collate_send, job.first_step, _reads_for(cfg.dataset, job.own_loop))
        tg.start_soon(
            _collate, cfg, to_collate_recv, job.emit, job.channel, run_group, workers, in_flight or workers
        )


class StageWorkers:
    """The reader and collate stages on the loop; ``executor`` runs the collate (None: the loop
    itself does, which only guideloom's private loop may)."""

    def __init__(self, executor: CollateThreads | None) -> None:
        self.executor = executor

    async def produce(self, job: Production) -> None:
        executor = self.executor
        if executor is None:
            await read_and_collate(job, None, 1)
            return
        loop = asyncio.get_running_loop()
        steps = (job.cfg.collate_fn,)

        def run_group(specs: list[BatchSpec], batches: list[Any]) -> asyncio.Future[Results]:
            return loop.run_in_executor(executor, apply_group, steps, batches)

        # num_workers=0 with an executor: one collate thread
        await read_and_collate(job, run_group, max(1, job.cfg.num_workers))

    def shutdown(self, wait: bool = True) -> None:
        """Stop the collate threads, waiting for a call in progress at most
        :data:`~guideloom._runtime.threadpool.CLOSE_GRACE_S` (then it is left running)."""
        if self.executor is not None:
            self.executor.shutdown(wait=wait, cancel_futures=True)


# -- the whole pipeline -------------------------------------------------------------------------------
async def run_pipeline(
    cfg: PipelineConfig,
    channel: Channel[Delivery],
    first_step: int,
    workers: Workers,
    *,
    own_loop: bool = False,
) -> None:
    """Run every stage until the epoch's last batch (or the first failure) reaches ``channel``.

    ``workers`` (from :func:`~guideloom._runtime.workers.make_workers`) make the batches; the
    caller owns them and shuts them down once this coroutine has finished, so that a cancelled
    pipeline still joins its workers. ``own_loop`` says the loop is guideloom's private one (see
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
                        await workers.produce(
                            Production(cfg, first_step, own_loop, emit_to_transfer, channel)
                        )

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

                tg.start_soon(workers.produce, Production(cfg, first_step, own_loop, emit_direct, channel))
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
