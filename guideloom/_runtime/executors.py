"""What makes an epoch's groups of batches, for :class:`~guideloom._runtime.flow.EpochFlow`:
inline (:class:`Here`), on threads (:class:`Threads`) or on process workers (:class:`Processes`);
and, in :func:`executors_for`, the one place that decides which of them an epoch runs on.

An executor starts a group and returns a :class:`Job` whose batches the flow takes in order; how
a driver waits for a job is the executor's too (a future's result, a selector over the workers'
pipes, a loop reader). Nothing else differs between them: the flow decides what is made where and when.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import selectors
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from guideloom._core.delivery import Delivery, Results, apply_group, through
from guideloom._core.plan import BatchSpec
from guideloom._runtime import chooser as choosing
from guideloom._runtime.config import PipelineConfig, making_steps
from guideloom._runtime.processes.pool import Group, Proc, WorkerPool
from guideloom._runtime.processes.session import detach
from guideloom._runtime.processes.wire import Epoch, EpochMessages
from guideloom._runtime.threadpool import CollateThreads

if TYPE_CHECKING:
    from guideloom._runtime.chooser import Chooser, Choosers

__all__ = [
    "UNMEASURED",
    "Chosen",
    "FutureJob",
    "GroupJob",
    "Here",
    "Job",
    "Made",
    "Processes",
    "Threads",
    "executors_for",
]


class Job:
    """Consecutive batches one executor makes as one group; their deliveries, oldest first,
    are taken as their results arrive. ``place``: where they are collated (``stats()``)."""

    __slots__ = ("place", "transfer")

    def __init__(self, place: str, transfer: bool) -> None:
        self.place = place
        #: Whether the copy to the device is still to be made when a batch is taken.
        self.transfer = transfer

    def ready(self) -> bool:
        """Whether a batch can be taken now."""
        raise NotImplementedError

    def take(self) -> Delivery:
        """The next batch (:meth:`ready` holds)."""
        raise NotImplementedError

    def empty(self) -> bool:
        """Whether nothing more will be taken from this job."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Nobody will take what is left."""


class Made(Job):
    """Batches already made (collated inline, or a read's failure)."""

    __slots__ = ("_ds",)

    def __init__(self, ds: list[Delivery], place: str, transfer: bool = False) -> None:
        super().__init__(place, transfer)
        self._ds = deque(ds)

    @classmethod
    def of(cls, specs: list[BatchSpec], results: Results, place: str) -> Made:
        """A group made at once: its batches' results (stopping at a failure), by spec."""
        return cls([Delivery(s, v, e) for s, (v, e) in zip(specs, results, strict=False)], place)

    def ready(self) -> bool:
        return bool(self._ds)

    def take(self) -> Delivery:
        return self._ds.popleft()

    def empty(self) -> bool:
        return not self._ds

    def cancel(self) -> None:
        self._ds.clear()


class FutureJob(Job):
    """A group collated by a call that a ``concurrent.futures.Future`` stands for (threads)."""

    __slots__ = ("_ds", "future")

    def __init__(
        self, ds: list[Delivery], future: concurrent.futures.Future[Results], place: str, transfer: bool
    ) -> None:
        super().__init__(place, transfer)
        self._ds = deque(ds)
        self.future: concurrent.futures.Future[Results] | None = future

    def _resolve(self) -> None:
        fut = self.future
        assert fut is not None
        try:
            results = fut.result()
        except Exception as exc:  # the call's own failure (a collate's comes per batch)
            results = [(None, exc)]
        self.future = None
        ds = self._ds
        while len(ds) > len(results):  # a group that stopped at a failure: nothing after it
            ds.pop()
        for d, (value, error) in zip(ds, results, strict=False):
            d.value, d.error = value, error

    def ready(self) -> bool:
        if self.future is not None:
            if not self.future.done():
                return False
            self._resolve()
        return bool(self._ds)

    def take(self) -> Delivery:
        return self._ds.popleft()

    def empty(self) -> bool:
        return self.future is None and not self._ds

    def cancel(self) -> None:
        fut, self.future = self.future, None
        if fut is not None:
            fut.cancel()
            fut.add_done_callback(_retrieve)
        self._ds.clear()


def _retrieve(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved"


class GroupJob(Job):
    """A group sent to a process worker (:class:`~guideloom._runtime.processes.pool.Group`):
    its batches arrive one message per group, through the worker's pipe."""

    __slots__ = ("group", "session")

    def __init__(self, group: Group, session: Any, place: str) -> None:
        super().__init__(place, True)
        self.group = group
        self.session = session

    def ready(self) -> bool:
        return bool(self.group.results)

    def take(self) -> Delivery:
        g = self.group
        d = g.results.popleft()
        if g.done and not g.results:
            self.session.groups.pop(g.gid, None)
        return d

    def empty(self) -> bool:
        return self.group.done and not self.group.results

    def cancel(self) -> None:
        g = self.group
        self.session.groups.pop(g.gid, None)
        if not g.done and g.proc is not None:  # its worker's result is dropped
            g.proc.inflight -= 1
            g.done = True
        g.results.clear()
        g.wake()  # a driver waiting for it looks again (and finds the flow closed)


class Here:
    """Batches made in the driver's thread, one when it is asked for (no event loop, nothing
    ahead: as PyTorch loads at ``num_workers=0``)."""

    reads_itself = False
    runs_ahead = False
    most_jobs = 1
    is_up = True

    def starting(self) -> bool:
        return False

    def __init__(self, steps: Sequence[Callable[[Any], Any]], place: str = "inline") -> None:
        self.steps = tuple(steps)
        self.place = place

    def credit_batches(self, credits: int) -> int:
        return 1

    def makes_now(self) -> bool:
        return True

    def make(self, value: Any) -> Any:
        return through(self.steps, value)

    def submit(self, specs: list[BatchSpec], values: list[Any] | None) -> Job:
        assert values is not None
        results = apply_group(self.steps, values)
        return Made.of(specs, results, self.place)

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs."""


class Threads:
    """Groups collated on ``n`` daemon threads (:class:`~guideloom._runtime.threadpool.CollateThreads`);
    ``steps`` include the copy to the device where there is one. With ``choice``, a group runs where
    it says: on the thread, or at once in the caller (the loop of ``async for``, hidden from it)."""

    reads_itself = False
    runs_ahead = True
    is_up = True

    def starting(self) -> bool:
        return False

    def __init__(
        self,
        n: int,
        steps: Sequence[Callable[[Any], Any]],
        place: str,
        most_jobs: int | None = None,
        choice: choosing.LoopChoice | None = None,
    ) -> None:
        self.pool = CollateThreads(n)
        self.steps = tuple(steps)
        self.place = place
        self.transfer = False
        self.most_jobs = most_jobs or 1 << 30
        self.choice = choice
        #: The context variables of this epoch's collate calls, wherever they run (one at a time):
        #: on the loop, a collate that sets one does not set the consumer's.
        self.context = contextvars.Context()

    def credit_batches(self, credits: int) -> int:
        return 1

    def makes_now(self) -> bool:
        return self.choice is not None and self.choice.on_loop

    def make(self, value: Any) -> Any:
        assert self.choice is not None
        return self.choice.run(self.context, through, self.steps, value)

    def submit(self, specs: list[BatchSpec], values: list[Any] | None) -> Job:
        assert values is not None
        choice = self.choice
        if choice is None:
            call = self.pool.submit(apply_group, self.steps, values)
        elif choice.on_loop:
            results = choice.run(self.context, apply_group, self.steps, values)
            return Made.of(specs, results, "inline")
        else:
            call = self.pool.submit(choice.run, self.context, apply_group, self.steps, values)
        return FutureJob([Delivery(s) for s in specs], call, self.place, False)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads, waiting for a call in progress at most
        :data:`~guideloom._runtime.threadpool.CLOSE_GRACE_S` (then it is left running)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


class Processes:
    """Process workers (a session of ``pool``): each group read by its worker (``reads_itself``:
    a storage read inline and by workers), or sent with the samples read here."""

    place = "processes"
    runs_ahead = True
    steps: tuple[Callable[[Any], Any], ...] = ()  # the collate runs in the worker

    #: How often a blocked sync wait looks whether the flow was closed in another thread.
    POLL_S = 0.1

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Processes:
        """The loader's persistent pool where it keeps one, else a pool of the iterator's own."""
        reads_itself = cfg.dataset._reads_inline and cfg.dataset._read_by_workers
        if cfg.worker_pool is not None:
            return cls(cfg.worker_pool(), owned=False, reads_itself=reads_itself)
        pool = WorkerPool(cfg.dataset, cfg.collate_fn, cfg.num_workers)
        return cls(pool, owned=True, reads_itself=reads_itself)

    def __init__(self, pool: WorkerPool, owned: bool, reads_itself: bool) -> None:
        self.pool = pool
        self.owned = owned
        self.reads_itself = reads_itself
        self.session = pool.session()
        #: After a re-plan: the new plan's first group (None once it is back, or before it is sent).
        self._lead: Group | None = None
        self._leading = False  # the next group sent is a re-plan's first
        self.is_up = False
        self.error: BaseException | None = None
        self._selector: selectors.BaseSelector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registered: list[Proc] = []
        #: Whether workers of the start are still to join (each sent the epoch once ready).
        self._joining = False
        try:
            pool.begin()  # the workers start while the first batches are made here
        except Exception as exc:
            self.error = exc

    def starting(self) -> bool:
        """Whether the workers are still starting (the batches are then made here)."""
        return self.error is None and self.pool.starting()

    def start_sync(self, timeout: float | None = None) -> bool:
        """Wait until a worker is up and send it the epoch (raises what made the start fail);
        the others get it as each is ready (:meth:`_join`). Their pipes are then watched by
        :meth:`wait_sync`. With ``timeout``: False if none is up by then (call it again)."""
        if self.is_up:
            return True
        if self.error is not None:
            raise self.error
        if not self.pool.start_first(timeout):
            return False
        self._selector = selectors.DefaultSelector()
        self._joining = True
        self.is_up = True
        self._join()
        return True

    async def start_async(self) -> None:
        """:meth:`start_sync` from the running loop: the start waited for off the loop, the
        pipes read by the loop."""
        if self.is_up:
            return
        if self.error is not None:
            raise self.error
        await asyncio.to_thread(self.pool.start_first)
        self._loop = asyncio.get_running_loop()
        self._joining = True
        self.is_up = True
        self._join()

    def _watch(self, procs: list[Proc]) -> None:
        """Take in what ``procs`` send: by the loop's readers, or by :meth:`wait_sync`'s selector."""
        loop = self._loop
        for p in procs:
            if loop is not None:
                loop.add_reader(p.fd, self.session._on_readable, p, loop)
                p.reader = self.session
                self._registered.append(p)
            elif self._selector is not None:
                key = self._selector.get_map().get(p.fd)
                if key is None:
                    self._selector.register(p.fd, selectors.EVENT_READ, p)
                elif key.data is not p:  # a worker started again on the number of a dead one's pipe
                    self._selector.modify(p.fd, selectors.EVENT_READ, p)

    def _join(self) -> None:
        """While the start is under way: send the epoch to the workers ready since, and watch
        them. Once it has failed, the failure is the error of the groups sent from then on
        (those sent before are made by the workers that were ready); where none is, the next
        start raises it."""
        if not self._joining:
            return
        pool = self.pool
        over = not pool.starting()  # (before the failure is looked at: it is set before the end)
        self.error = pool.start_failure()
        if self.error is not None:
            self._joining = False
            return
        token = self.session.token
        ready = [p for p in pool.live() if p.ready and (p.epoch is None or p.epoch.token != token)]
        if ready:
            self._watch(self._send_epoch(ready))
        if not over:
            return
        self._joining = False
        pool.join_start()

    @property
    def most_jobs(self) -> int:
        """Groups in flight at most: one queued behind the one each worker makes. After a
        re-plan the new plan's first group goes alone until it is back: the consumer waits for
        it (the read-ahead was dropped), and the groups after it would take the cores from its
        worker and from the consumer's wake-up where cores are few and busy; they start when
        the consumer takes it, while it trains."""
        lead = self._lead
        if lead is not None:
            if not lead.done:
                return 1
            self._lead = None
        if self._joining:  # the workers still starting take the groups after theirs
            return 2 * max(1, len(self.session.members()))
        return 2 * self.pool.num_workers

    def renew(self) -> None:
        """A new session on the same workers, for a flow started again from another plan: the
        workers drop what is left of the old session's groups and are sent the new epoch; none
        restarts."""
        old, self.session = self.session, self.pool.session()
        old.end(tell=not self.is_up)  # the new epoch, sent to every live worker, drops the old one
        self._lead, self._leading = None, True
        if not self.is_up:
            return
        procs = self._send_epoch([p for p in self.pool.live() if p.ready])
        loop = self._loop
        if loop is not None:  # read by the loop: the readers now serve the new session
            for p in procs:
                if p.reader is old:
                    loop.remove_reader(p.fd)
                loop.add_reader(p.fd, self.session._on_readable, p, loop)
                p.reader = self.session
            self._registered = procs
        else:
            self._watch(procs)  # those ready since the last epoch went out

    def _send_epoch(self, live: list[Proc]) -> list[Proc]:
        """Send the flow's epoch to the workers ``live``: a :class:`Replan` (a few ints) to one
        whose last epoch had the same order and reading, else the whole :class:`Epoch`; each kind
        pickled once."""
        flow = self.flow
        plan = flow.plan
        messages = EpochMessages(Epoch(self.session.token, plan, flow.cfg.order, flow.reading))
        for p in live:
            p.send_epoch(messages)
        return live

    #: The flow whose epoch the workers are sent (set by the driver).
    flow: Any = None

    def makes_now(self) -> bool:
        return False  # made by the workers

    def make(self, value: Any) -> Any:
        raise AssertionError("process workers make no batch in the driver's thread")

    def credit_batches(self, credits: int) -> int:
        """Batches a credit stands for (the session's ``credit_batches``: tasks of cheap batches)."""
        return self.session.credit_batches(credits)

    def submit(self, specs: list[BatchSpec], values: list[Any] | None) -> Job:
        self._join()
        if self.error is not None:  # the start failed after its first workers took groups
            failed = Group(0, specs, None)
            failed.fail(self.error)
            try:
                self.pool.join_start()  # raised here: not again by the next start
            except Exception:
                pass
            return GroupJob(failed, self.session, self.place)
        group = self.session.submit(specs, values)
        if self._leading:
            self._lead, self._leading = group, False
        return GroupJob(group, self.session, self.place)

    def wait_sync(self) -> None:
        """Block until a worker's pipe has something (or :data:`POLL_S`), and take it in."""
        selector = self._selector
        if selector is None:
            return
        try:
            events = selector.select(self.POLL_S)
        except (OSError, ValueError):  # closed by a close in another thread
            return
        self._join()
        for key, _ in events:
            p: Proc = key.data
            if not self.session.receive(p):
                selector.unregister(p.fd)

    @staticmethod
    async def wait_async(job: GroupJob) -> None:
        """Wait until something of ``job`` has arrived (or it failed)."""
        g = job.group
        g.waiter = asyncio.get_running_loop().create_future()
        try:
            await g.waiter
        finally:
            g.waiter = None

    def shutdown(self, wait: bool = True) -> None:
        """End the session (the workers drop its groups); a pool of the iterator's own closes
        too (on a thread of its own unless ``wait``)."""
        self.session.end()
        selector, self._selector = self._selector, None
        if selector is not None:
            selector.close()
        loop, registered, self._registered = self._loop, self._registered, []
        if loop is not None and registered and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                detach(loop, registered, self.session)
            else:
                try:
                    loop.call_soon_threadsafe(detach, loop, registered, self.session)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        if self.owned:
            if wait:
                self.pool.close()
            else:
                threading.Thread(target=self.pool.close, name="guideloom-workers-close", daemon=True).start()


# -- what an epoch runs on ----------------------------------------------------------------------
class Chosen:
    """What :func:`executors_for` decided: the executors, and how the choice between them is made."""

    def __init__(
        self, here: Here | Threads, workers: Threads | Processes | None, chooser: Chooser | None, wait: bool
    ) -> None:
        self.here, self.workers, self.chooser = here, workers, chooser
        #: Whether the batches wait for the process workers to start (else made here meanwhile).
        self.wait_for_workers = wait

    def all(self) -> list[Any]:
        seen: list[Any] = []
        for ex in (self.here, self.workers):
            if ex is not None and all(ex is not s for s in seen):
                seen.append(ex)
        return seen


def executors_for(
    cfg: PipelineConfig,
    choosers: Choosers | None,
    *,
    on_loop: bool,
    loop_choice: choosing.LoopChoice | None = None,
) -> Chosen:
    """What ``cfg``'s epoch runs on, decided in one place.

    - ``num_workers=0``: inline, one batch when it is asked for; with ``prefetch`` a thread
      makes them ahead. ``on_loop`` (``async for``): one collate thread; at ``prefetch=0``, the
      loop itself once the collate is measured cheaper than the hop (``chooser.LoopChoice``).
    - Worker threads, or process workers: what the user asked for. A sync ``for`` measures
      (``choosers``: ``collate_mode="auto"``; None: pinned to the workers) whether they cost
      more than the collate inline, and collates where it is cheaper: over a storage that reads
      inline, or with process workers over any storage (thread workers over a storage read on
      a loop thread are not measured). The batches while process workers start are made here,
      unless they are pinned (their first windows are read meanwhile).
    """
    steps = making_steps(cfg)
    here: Here | Threads = Here(steps)
    if on_loop:  # at prefetch=0 nothing hides the hop: a collate cheaper than it runs on the loop
        solo = cfg.num_workers == 0 and cfg.prefetch == 0
        choice = (loop_choice or choosing.LoopChoice()) if solo else None  # the loader's, kept
        here = Threads(1, steps, "threads", choice=choice)
    if cfg.num_workers == 0:
        if on_loop or cfg.prefetch == 0:
            return Chosen(here, None, None, False)
        return Chosen(here, Threads(1, steps, "inline"), None, False)
    measured = choosers is not None and not on_loop and cfg.dataset._reads_inline
    if cfg.parallel_method == "thread":
        threads = Threads(cfg.num_workers, steps, "threads")
        chooser = None
        if measured and choosers is not None:
            # the chooser's own factory (a partial, not a lambda of this module): the lifecycle that
            # keeps the choosers calls nothing of the driver's
            chooser = choosers.chooser("threads", functools.partial(choosing.thread_chooser, cfg.capacity))
        return Chosen(threads if on_loop else here, threads, chooser, False)
    procs = Processes.of(cfg)
    chooser = None
    # Process workers over a storage read on a loop thread (object storage) measure too: the
    # reads go on there in either mode, and what differs is the collate's hand-off.
    measured = choosers is not None and not on_loop
    if measured and choosers is not None and cfg.device.type == "cpu":
        # The loader's persistent workers keep their chooser from epoch to epoch; a pool of this
        # iterator's own starts afresh, as its workers do.
        make = functools.partial(choosing.process_chooser, cfg.capacity)
        chooser = choosers.chooser("processes", make, fresh=cfg.worker_pool is None)
    return Chosen(here, procs, chooser, choosers is None)


class _Unmeasured:
    """``collate_mode="auto"`` on a loop (:data:`UNMEASURED`): nothing is measured there, the
    workers are not pinned."""

    def chooser(self, kind: str, make: Callable[[], Chooser], *, fresh: bool = False) -> Chooser:
        raise AssertionError("an async epoch measures nothing")


UNMEASURED = _Unmeasured()
