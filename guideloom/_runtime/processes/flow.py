"""One epoch on the process workers: a state machine of its groups, and its two drivers.

:class:`GroupFlow` decides which consecutive batches go to a worker as one group and when, and
hands the batches out in plan order, a failure at its batch and nothing after it. It waits for
nothing itself: :class:`SyncRun` drives it from the consumer's thread (a sync ``for``: a selector
over the workers' pipes, no event loop), :func:`run_on_loop` from an event loop (``async for``,
or a loop thread that overlaps the copy to a device). :class:`ProcessWorkers` is what a pipeline
holds of the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from guideloom._core.delivery import Delivery, Results, apply, apply_group
from guideloom._core.order import Order
from guideloom._core.plan import BatchSpec, EpochPlan
from guideloom._core.schedule import Indexes, read_window, run_sync
from guideloom._runtime.config import PipelineConfig, group_size, reading_name
from guideloom._runtime.inline import InlinePipeline
from guideloom._runtime.pipeline import read_and_collate
from guideloom._runtime.processes.pool import Group, Proc, Session, WorkerPool
from guideloom._runtime.processes.wire import Epoch

if TYPE_CHECKING:
    from guideloom._runtime.channel import Channel
    from guideloom._runtime.pipeline import Production

__all__ = ["GroupFlow", "ProcessWorkers", "SyncRun", "run_on_loop"]


class GroupFlow:
    """The groups of one epoch from ``first_step``: sent while credits allow, at most two in
    flight per worker (one queued behind the one being made), and handed out in plan order."""

    def __init__(
        self,
        session: Session,
        plan: EpochPlan,
        order: Order,
        reading: str,
        first_step: int,
        group: int,
        read: Callable[[list[BatchSpec]], list[Delivery]] | None = None,
    ) -> None:
        self.session = session
        self.plan, self.order, self.reading = plan, order, reading
        self.step = first_step  # the next step to send
        self.total = len(plan)
        self.group = max(1, group)
        self.most = 2 * session.pool.num_workers
        self.pending: deque[Group] = deque()
        self.paused = False  # no new groups are sent (the collate runs inline meanwhile)
        self.closed = False
        #: Where the main process reads (a dataset not read by workers): a group's samples, read
        #: here before it is sent; None where each worker reads its own.
        self.read = read
        self.ended = False  # a read here failed: nothing is sent after its failure

    def start(self) -> list[Proc]:
        """Send the epoch to every live worker (the pool has started); the workers sent to."""
        live = self.session.pool.live()
        for p in live:
            p.send(Epoch(self.session.token, self.plan, self.order, self.reading))
        return live

    def size_now(self, room: int, *, whole: bool) -> int:
        """Batches in the group to send now with ``room`` batches of credit; 0: none now.

        ``whole``: a group waits for a whole group's room unless nothing else is in flight (a
        worker waiting for its next group is a worker lost), so a consumer that takes one batch
        at a time does not shrink the groups to one batch.
        """
        left = self.total - self.step
        if self.paused or self.closed or self.ended or left <= 0 or len(self.pending) >= self.most:
            return 0
        full = min(self.group, left)
        n = min(full, room)
        if n <= 0 or (whole and n < full and self.pending):
            return 0
        return n

    def send(self, n: int) -> None:
        """Send the next ``n`` steps as one group (with their samples, where they are read
        here: the batches before a failed read are sent, the failure is handed out after them,
        and nothing more is sent)."""
        specs = self.plan.batches(self.step, self.step + n)
        self.step += n
        if self.read is None:
            self.pending.append(self.session.submit(specs))
            return
        got = self.read(specs)
        ok = next((i for i, d in enumerate(got) if d.error is not None), len(got))
        if ok:
            self.pending.append(self.session.submit(specs[:ok], [d.value for d in got[:ok]]))
        if ok < len(got):
            error = got[ok].error
            assert error is not None
            failed = Group(0, [got[ok].spec], None)
            failed.fail(error)
            self.pending.append(failed)
            self.ended = True

    def fail(self, exc: BaseException) -> None:
        """A failure outside any group (a bug): delivered at the next step not yet sent."""
        failed = Group(0, self.plan.batches(self.step, self.step + 1), None)
        failed.fail(exc)
        self.pending.append(failed)

    def head(self) -> Group | None:
        """The group whose batches come next."""
        return self.pending[0] if self.pending else None

    def take(self) -> Delivery | None:
        """The next batch in plan order if it has arrived; None if not (or nothing is in flight)."""
        g = self.head()
        if g is None or not g.results:
            return None
        d = g.results.popleft()
        if g.done and not g.results:
            self.pending.popleft()
            self.session.groups.pop(g.gid, None)
        return d

    def close(self) -> None:
        """Send nothing more and tell the workers to drop this epoch's groups. Idempotent."""
        self.closed = True
        for g in self.pending:
            if not g.done and g.proc is not None:
                g.proc.inflight -= 1
        self.pending.clear()
        self.session.groups.clear()
        self.session.end()


class SyncRun:
    """One epoch of a sync ``for`` over process workers, driven from the consumer's thread.

    :meth:`next` sends groups while credits allow (at most ``capacity`` batches ahead of the
    consumer, plus the one asked for, as with the channel's credits), waits on the workers'
    pipes with a selector when the next batch has not arrived, and hands the batch out. One
    message arrives per group, so the main process wakes once per group, not per batch, and no
    batch crosses a thread or an asyncio future on its way.
    """

    #: How often a blocked :meth:`next` looks whether :meth:`close` ran in another thread.
    POLL_S = 0.1

    def __init__(self, flow: GroupFlow, capacity: int) -> None:
        self.session = flow.session
        self.flow = flow
        self.limit = capacity + 1
        self.ahead = 0  # batches sent and not yet handed out
        self.selector: selectors.BaseSelector | None = None
        self.started = False

    @property
    def step(self) -> int:
        """The next step to send."""
        return self.flow.step

    @property
    def pending(self) -> bool:
        """Whether batches sent to the workers are still to be handed out."""
        return bool(self.flow.pending)

    @property
    def paused(self) -> bool:
        return self.flow.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.flow.paused = value

    def resume(self, step: int | None = None) -> None:
        """Send groups again, from ``step`` when given (the batches before it were made inline)."""
        self.flow.paused = False
        if step is not None:
            self.flow.step = step

    def _start(self) -> None:
        self.session.pool.start()
        self.selector = selectors.DefaultSelector()
        for p in self.flow.start():
            self.selector.register(p.fd, selectors.EVENT_READ, p)

    def _fill(self) -> None:
        flow = self.flow
        while n := flow.size_now(self.limit - self.ahead, whole=True):
            flow.send(n)
            self.ahead += n

    def _wait(self) -> None:
        """Block until a worker's pipe has something (or :data:`POLL_S`), and take it in."""
        selector = self.selector
        if selector is None:
            return
        try:
            events = selector.select(self.POLL_S)
        except (OSError, ValueError):  # closed by close() in another thread
            return
        for key, _ in events:
            p: Proc = key.data
            if not self.session.receive(p):
                selector.unregister(p.fd)

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end of the
        epoch, after a failure was handed out, or once :meth:`close` ran."""
        flow = self.flow
        if flow.closed:
            return None
        if not self.started:
            self.started = True
            try:
                self._start()
            except Exception as exc:  # reported at the first batch, as the loop's pipeline does
                flow.closed = True
                step = flow.step
                spec = flow.plan.batch(step) if step < flow.total else BatchSpec(step, 0, 0, 0)
                return Delivery(spec, error=exc)
        self._fill()
        if not flow.pending:
            return None
        while (d := flow.take()) is None:
            if self._closed_meanwhile():
                return None
            self._wait()
        self.ahead -= 1
        if d.error is not None:
            self.close()
        else:
            self._fill()  # the credit is back: the workers need not wait for the next call
        return d

    def _closed_meanwhile(self) -> bool:
        """Whether :meth:`close` ran, in another thread, while this one waited."""
        return self.flow.closed

    def close(self) -> None:
        """Send nothing more and tell the workers to drop this iterator's groups. Idempotent."""
        if self.flow.closed and self.selector is None:
            return
        self.flow.close()
        selector, self.selector = self.selector, None
        if selector is not None:
            selector.close()


@contextlib.asynccontextmanager
async def _on_loop(session: Session, flow: GroupFlow) -> AsyncIterator[asyncio.AbstractEventLoop]:
    """The pool started (off the loop), the epoch sent to every worker and their pipes read by
    the running loop until the block ends, when ``flow`` closes."""
    async with _starting_on_loop(session, flow) as (loop, up):
        await up
        yield loop


@contextlib.asynccontextmanager
async def _starting_on_loop(
    session: Session, flow: GroupFlow
) -> AsyncIterator[tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]]:
    """:func:`_on_loop` that does not wait for the start: it yields at once with the task that
    starts the pool (off the loop), then sends the epoch to every worker and reads their pipes;
    the task fails with what made the start fail."""
    loop = asyncio.get_running_loop()
    registered: list[Proc] = []

    async def start() -> None:
        await asyncio.to_thread(session.pool.start)
        for p in flow.start():
            loop.add_reader(p.fd, session._on_readable, p, loop)
            p.reader = session
            registered.append(p)

    up = loop.create_task(start(), name="guideloom-workers-up")
    try:
        yield loop, up
    finally:
        if not up.done():
            up.cancel()  # the start itself goes on in its thread; the pool's close ends it
        await asyncio.gather(up, return_exceptions=True)  # its failure was handed out or is moot
        for p in registered:
            if p.reader is not session:  # a later session reads this pipe now: not ours to remove
                continue
            p.reader = None
            try:
                loop.remove_reader(p.fd)
            except (OSError, ValueError):
                pass
        flow.close()


async def _arrival(g: Group, loop: asyncio.AbstractEventLoop) -> None:
    """Wait until something of ``g`` has arrived (or it failed)."""
    g.waiter = loop.create_future()
    try:
        await g.waiter
    finally:
        g.waiter = None


async def run_on_loop(flow: GroupFlow, emit: Callable[[Delivery], Any], channel: Channel[Delivery]) -> None:
    """Drive ``flow`` on the running loop: emit each batch in plan order, and a failure at its
    batch, after which nothing more is emitted. Groups are sent as soon as the channel grants a
    credit (a worker waiting for its next group is a worker lost), from a task of their own."""
    async with _on_loop(flow.session, flow) as loop:
        sent = asyncio.Event()
        room = asyncio.Event()  # a group was handed out: one more may be in flight

        async def submit() -> None:
            held = 0  # credits reserved and not yet sent
            try:
                while flow.step < flow.total and not flow.closed:
                    if held == 0:
                        await channel.reserve()
                        held = 1
                    while held < flow.group and channel.try_reserve():
                        held += 1
                    n = flow.size_now(held, whole=False)
                    if n == 0:  # the most groups are in flight
                        room.clear()
                        await room.wait()
                        continue
                    flow.send(n)
                    held -= n
                    sent.set()
            except Exception as exc:  # a bug: reported at the batch it stopped before
                flow.fail(exc)
                sent.set()

        submitter = loop.create_task(submit(), name="guideloom-submit")
        try:
            for _ in range(flow.step, flow.total):
                while (d := flow.take()) is None:
                    g = flow.head()
                    if g is None:
                        sent.clear()
                        await sent.wait()
                        continue
                    await _arrival(g, loop)
                room.set()
                failed = d.error is not None
                await emit(d)
                del d
                if failed:
                    return
        finally:
            submitter.cancel()
            await asyncio.gather(submitter, return_exceptions=True)


class ProcessWorkers:
    """A pipeline's hold on process workers: its session of the pool, and the pool itself when it
    is the iterator's own (``persistent_workers=False``), closed with the iterator."""

    def __init__(self, pool: WorkerPool, owned: bool) -> None:
        self.pool = pool
        self.owned = owned
        self.session = pool.session()

    def flow(self, cfg: PipelineConfig, first_step: int) -> GroupFlow:
        """The epoch of ``cfg`` from ``first_step`` on these workers (each group read by its
        worker, or here where the dataset is not read by workers)."""
        group = group_size(cfg.capacity, cfg.num_workers)
        reading = reading_name(cfg)
        read = None
        if cfg.dataset.reads_inline and not cfg.dataset.read_by_workers:
            indexes = Indexes(cfg.plan, cfg.order)
            read_many = cfg.dataset.read_many_sync

            def read(specs: list[BatchSpec]) -> list[Delivery]:
                return run_sync(read_window(specs, indexes, reading), read_many)

        return GroupFlow(self.session, cfg.plan, cfg.order, reading, first_step, group, read)

    async def produce(self, job: Production) -> None:
        """The workers read and collate their own batches over a storage that reads inline
        (local files, memory), once they are up. Over any other (an object store), or one they
        do not read, the main process reads, as it does for thread workers: its windows'
        requests coalesce and stay in flight together, and each group's samples go to a worker,
        which collates them. Either way the batches before the workers are up are made here."""
        cfg = job.cfg
        if cfg.dataset.reads_inline and cfg.dataset.read_by_workers:
            first = await self._while_starting(job)
            if first is not None:
                await run_on_loop(self.flow(cfg, first), job.emit, job.channel)
            return
        flow = self.flow(cfg, job.first_step)
        steps = (cfg.collate_fn,)
        pool = self.pool
        try:
            pool.begin()
        except Exception:
            pass  # raised again by the pool's start, at the batches the workers owe
        async with _starting_on_loop(self.session, flow) as (loop, up):
            if not pool.starting():  # nothing to start (persistent workers): they take every group
                await asyncio.wait([up])

            def run_group(specs: list[BatchSpec], batches: list[Any]) -> asyncio.Future[Results]:
                if not up.done():
                    # The workers are starting: this group is collated here, on a thread (as
                    # the first batches over local files are), and the epoch does not wait.
                    return loop.run_in_executor(None, apply_group, steps, batches)
                failed = up.exception()
                if failed is not None:  # at this group's first batch, and so the epoch's end
                    lost: asyncio.Future[Results] = loop.create_future()
                    lost.set_exception(failed)
                    return lost
                return loop.create_task(self._collate(specs, batches, loop))

            # Two groups per worker: one queued behind the one it makes, as a group's round trip
            # through the pipes would leave the worker idle.
            await read_and_collate(job, run_group, cfg.num_workers, 2 * cfg.num_workers)

    async def _while_starting(self, job: Production) -> int | None:
        """Batches read and collated in this process, in plan order from ``job.first_step``,
        while the workers start (on the loop where it is guideloom's own, else on a thread: a
        caller's loop never runs ``collate_fn``); the step the workers go on from, or None when
        the epoch, or a failure, ended first."""
        pool = self.pool
        try:
            pool.begin()
        except Exception:
            return job.first_step  # raised again by the pool's start, at the first batch
        if not pool.starting():
            return job.first_step
        inline = InlinePipeline(job.cfg, first_step=job.first_step)
        step = job.first_step
        while inline.buffered() or pool.starting():
            await job.channel.reserve()
            if job.own_loop:
                d = _made_inline(inline, job.cfg.collate_fn)
            else:
                d = await asyncio.to_thread(_made_inline, inline, job.cfg.collate_fn)
            if d is None:
                return None
            step = d.spec.step + 1
            failed = d.error is not None
            await job.emit(d)
            del d
            if failed:
                return None
        return step if step < len(job.cfg.plan) else None  # None: the epoch ended as they came

    async def _collate(
        self, specs: list[BatchSpec], batches: list[Any], loop: asyncio.AbstractEventLoop
    ) -> Results:
        """One group collated by a worker from the samples read here: its results, in order."""
        session = self.session
        g = session.submit(specs, batches)
        del batches  # in the worker's segment now
        try:
            while not g.done:
                await _arrival(g, loop)
            return [(d.value, d.error) for d in g.results]
        finally:
            session.groups.pop(g.gid, None)
            if not g.done and g.proc is not None:  # cancelled: its worker's result is dropped
                g.proc.inflight -= 1

    def shutdown(self, wait: bool = True) -> None:
        """End the session; an owned pool closes too (on a thread of its own unless ``wait``: on
        the pipeline's own loop thread, nothing waits there for the workers)."""
        self.session.end()
        if self.owned:
            if wait:
                self.pool.close()
            else:
                threading.Thread(target=self.pool.close, name="guideloom-workers-close", daemon=True).start()


def _made_inline(inline: InlinePipeline, collate_fn: Callable[[Any], Any]) -> Delivery | None:
    """The next batch read by ``inline`` and collated (the copy to a device is the transfer
    stage's); None at the end of the epoch."""
    d = inline.next_raw()
    if d is not None and apply(d, collate_fn):
        inline.close()
    return d
