"""One epoch, written once: windows -> reads -> groups -> deliveries, free of I/O.

:class:`EpochFlow` is the whole of an epoch's logic: which window to read next, which
consecutive read batches go to an executor as one group and when (within the consumer's
credits), where each group is collated (here, or on the workers: the decision is the flow's,
:meth:`EpochFlow.decide`, which also says when a driver is to wait for process workers' start),
and the batches handed out in plan order, a failure at its batch and nothing after it. It
performs no read and waits for nothing: a driver (:mod:`guideloom._runtime.drive`) reads the
windows it asks for, waits for the job it is blocked on, and asks it again, as httpx drives its
auth flow and torchdata's mapper drives its queue.
The executor is a parameter (:mod:`guideloom._runtime.executors`): inline, threads or
processes differ only in how a group is started and how its results are waited for.

The flow starts from a plan (:meth:`EpochFlow.start`): the epoch's order, a global offset and a
geometry (rank, world size, batch size). It holds nothing that assumes that geometry beyond its
read-ahead, which :meth:`EpochFlow.start` drops: starting it again from another plan at another
offset re-plans the epoch on the same executors, workers included.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from guideloom._core.delivery import DELIVERED_ERRORS, Delivery, apply
from guideloom._core.plan import BatchSpec, EpochPlan
from guideloom._core.schedule import Indexes, ReadWindow, count_window, read_window, windows
from guideloom._runtime import chooser as choosing
from guideloom._runtime.config import (
    PipelineConfig,
    group_size,
    max_window_batches,
    move_to_device,
    reading_name,
    window_bounds,
)
from guideloom._runtime.executors import Made

if TYPE_CHECKING:
    from guideloom._runtime.executors import Job, Processes

__all__ = ["Clock", "EpochFlow", "Executor", "Read"]


class Executor(Protocol):
    """What makes groups of batches: inline, threads or process workers."""

    #: Where it collates (``stats()``): ``"inline"``, ``"threads"`` or ``"processes"``.
    place: str
    #: Whether it reads its own batches (process workers over local files): sent specs only.
    reads_itself: bool
    #: Whether its groups are made ahead of the consumer's requests (inline in the caller's
    #: thread: no, each batch is made when asked for).
    runs_ahead: bool
    #: What makes a read batch a delivered one (the collate, and the copy to a device where it
    #: runs there).
    steps: tuple[Callable[[Any], Any], ...]
    #: Whether it can take groups now (process workers: once their start is over; others: always).
    is_up: bool

    def starting(self) -> bool:
        """Whether it is still starting (process workers): batches may be made here meanwhile."""
        ...

    @property
    def most_jobs(self) -> int:
        """Groups in flight at most."""
        ...

    def submit(self, specs: list[BatchSpec], values: list[Any] | None) -> Job:
        """Start one group: ``values`` the batches read (None: it reads them itself)."""
        ...

    def credit_batches(self, credits: int) -> int:
        """Batches one of the consumer's ``credits`` stands for: 1, or a task of several batches
        where the executor has measured that handing one over costs more than making it."""
        ...

    def makes_now(self) -> bool:
        """Whether a batch read is made at once in the driver's thread when asked for (no job
        between the read and the consumer: :meth:`EpochFlow.make_here`)."""
        ...

    def make(self, value: Any) -> Any:
        """One batch made at once, through :attr:`steps` (:meth:`makes_now` holds)."""
        ...


class Read:
    """One window being read: its batches, and their deliveries once read."""

    __slots__ = ("handle", "result", "specs")

    def __init__(self, specs: list[BatchSpec]) -> None:
        self.specs = specs
        self.result: list[Delivery] | None = None
        #: The driver's handle on the read in flight (a future, a task).
        self.handle: Any = None


class EpochFlow:
    """One epoch's state machine; see the module docstring. ``here`` makes batches in the
    driver's own process (inline, or a collate thread where the driver's thread must not run
    ``collate_fn``); ``workers`` (None: none) is what the user asked for."""

    def __init__(
        self,
        cfg: PipelineConfig,
        here: Executor,
        workers: Executor | None,
        *,
        limit: int,
        concurrency: int = 1,
    ) -> None:
        self.cfg = cfg
        self.here, self.workers = here, workers
        #: The decision: collate on the workers (else here). A driver's chooser changes it.
        self.on_workers = workers is not None
        #: Batches made (or being made) and not yet taken, at most: the consumer's credits.
        self.limit = max(1, limit)
        self.concurrency = max(1, concurrency)
        self.group = group_size(cfg.capacity, cfg.num_workers)
        self.reading = reading_name(cfg)
        self.move: Callable[[Any], Any] | None = None
        if cfg.device.type != "cpu":
            self.move = functools.partial(move_to_device, device=cfg.device, pin_memory=cfg.pin_memory)
        #: Where the last batch taken was collated.
        self.place = workers.place if workers is not None else here.place
        #: The batches read here are made by ``here`` in the driver's thread when asked for, the
        #: workers chosen or not, where those read their own (:meth:`make_here`).
        self._here_first = workers is not None and workers.reads_itself
        #: The workers could not start: their failure is queued (from plan to plan: nothing is
        #: sent to them again).
        self.start_failed = False
        self._wanted = self.on_workers  # the mode the driver asked for at the last decision
        self.closed = False
        self.start(cfg.plan, 0)

    # -- planning -------------------------------------------------------------------------------
    def start(self, plan: EpochPlan, first_step: int = 0) -> None:
        """(Re)start the epoch at ``plan``'s step ``first_step``: the plan carries the order,
        the global offset and the geometry. What was read ahead or is being made is dropped
        (the executors stay up): nothing of an earlier plan is handed out after this."""
        if hasattr(self, "jobs"):
            self._cancel_reads()
            for job in self.jobs:
                job.cancel()
        if plan is not self.cfg.plan:  # window sizes follow the new geometry's batches
            self.cfg = dataclasses.replace(self.cfg, plan=plan)
        self.plan = plan
        self.indexes = Indexes(plan, self.cfg.order)
        self.largest = max_window_batches(self.cfg)
        self._bounds = window_bounds(self.cfg)
        self._windows: Iterator[list[BatchSpec]] = windows(plan, first_step, self.largest, self._bounds)
        self.read_step = first_step  # the next step to read (or to send where workers read)
        self.reads: deque[Read] = deque()  # oldest first
        self.raw: deque[Delivery] = deque()  # read, not yet handed to an executor
        self.jobs: deque[Job] = deque()  # oldest first
        self.ahead = 0  # batches in the jobs not yet taken
        self.ended = False  # a failure is queued: nothing after it is read or made
        self.first_read = True
        #: Whether a batch of this plan has been handed out (or made here to be).
        self.handed_out = False
        #: Batches a credit stands for on the workers (``credit_batches``): it only grows
        #: within a plan, so what is ahead stays within ``limit * per`` at every moment.
        self.per = 1

    @property
    def total(self) -> int:
        """The plan's batches (more than any step while the epoch is counted as it goes)."""
        return self.plan.steps_bound()

    def future_windows(self) -> Iterator[list[BatchSpec]]:
        """The windows :meth:`next_read` will ask for from here (the hint a storage reads ahead
        by; as far as the epoch is counted)."""
        return windows(self.plan, self.read_step, self.largest, self._bounds, counts=False)

    def reads_here(self) -> bool:
        """Whether the windows are read by the driver (not by workers that read their own)."""
        w = self.workers
        return not (self.on_workers and w is not None and w.reads_itself)

    def next_read(self, *, ahead: bool) -> Read | None:
        """The next window to read now, or None. ``ahead``: reads may run ahead of the groups
        (an async read, several in flight); else a window is read once its batches are needed."""
        if self.closed or self.ended or not self.reads_here():
            return None
        if not ahead and self.jobs and not self.handed_out:
            return None  # a fast first batch: no read in this thread holds back its hand-out
        if self.workers is not None and self.workers.reads_itself:
            ahead = False  # read here only until the workers, which read their own, take over
        if ahead:
            if len(self.reads) >= self.concurrency or len(self.raw) > self.largest:
                return None
            if self.reads and self.first_read and self.concurrency > 1:
                return None  # a fast first batch: no read-ahead competes with its read
        elif self.reads or self.raw or not self._room_here():
            return None
        if self.reads and not self.reads[-1].specs:
            return None  # a count in flight: the windows after it follow from it
        specs = next(self._windows, None)
        if specs is None:
            return None
        if specs:  # empty: a count (of an epoch counted as it goes)
            self.read_step = specs[-1].step + 1
        r = Read(specs)
        self.reads.append(r)
        return r

    def _room_here(self) -> bool:
        """Whether a batch would be made now if one were read."""
        ex = self._maker()
        if not ex.runs_ahead:
            return not self.jobs
        return self.ahead < self.limit * self._per(ex) and len(self.jobs) < ex.most_jobs

    def schedule(self, r: Read) -> ReadWindow:
        """The sans-IO read of window ``r`` (:func:`~guideloom._core.schedule.read_window`), or
        the count of an empty one (:func:`~guideloom._core.schedule.count_window`)."""
        if not r.specs:
            return count_window(self.plan, self.read_step)
        return read_window(r.specs, self.indexes, self.reading)

    def read_done(self, r: Read, deliveries: list[Delivery]) -> None:
        """Window ``r`` has been read."""
        r.result = deliveries
        self.first_read = False
        while self.reads and self.reads[0].result is not None:
            done = self.reads.popleft()
            assert done.result is not None
            self.raw.extend(done.result)
            done.result = None

    def rewind(self) -> None:
        """Drop the read-ahead (windows read or being read, not yet handed to an executor) and
        plan the reads again from the first batch not handed to one: what a storage that now
        reads otherwise (a local copy complete), or a plan changed between steps, starts from.
        The batches already handed to an executor are still handed out, in order."""
        step = self._first_unmade()
        self.raw.clear()
        self._cancel_reads()
        self.read_step = step
        self._windows = windows(self.plan, step, self.largest, self._bounds)
        self.first_read = True

    # -- where to make --------------------------------------------------------------------------
    def decide(self, wanted: bool, wait: bool) -> bool:
        """Where the next groups are made: on the workers if ``wanted`` (a chooser's mode, or
        what the user asked for) and they are up; here while they start, or where every batch is
        read here already (they owe none), unless ``wait``: they are pinned and make every batch.
        Returns whether the driver is to wait for their start first (reading ahead meanwhile, as
        it can), then tell :meth:`started` how it ended."""
        w = self.workers
        self._wanted = wanted
        if self.start_failed:
            return False
        if w is None or w.is_up:
            self.on_workers = wanted and w is not None
            return False
        if not wait and self.read_step >= self.total and self.reads_here():
            # every batch is read here already: workers not pinned owe none (pinned ones collate
            # every batch: ``collate_fn`` runs only on them)
            self.on_workers = False
            return False
        if not wait and w.starting():
            self.on_workers = False  # made here while they start
            return False
        return True

    def started(self, error: BaseException | None) -> None:
        """The workers' start that :meth:`decide` asked the driver to wait for is over: they
        take the groups from now on, or their failure comes at the first batch they owe (and
        ends the epoch). A start cut short by a close is no failure."""
        if error is None:
            self.on_workers = self._wanted and self.workers is not None
            return
        if self.closed:
            return
        self.start_failed = True
        self.on_workers = True
        self.fail(error)

    # -- making ---------------------------------------------------------------------------------
    def _maker(self) -> Executor:
        w = self.workers
        return w if self.on_workers and w is not None else self.here

    def _per(self, ex: Executor) -> int:
        if ex is not self.workers:
            return 1
        self.per = max(self.per, ex.credit_batches(self.limit))
        return self.per

    def fill(self) -> None:
        """Start groups while the credits allow, in plan order, on the executor chosen."""
        while not self.closed:
            if not self._fill_one():
                return

    def _fill_one(self) -> bool:
        ex = self._maker()
        raw = self.raw
        if raw and not self.reads_here():
            ex = self.here  # batches read here before the workers took over are made here first
        if not raw and not ex.reads_itself:
            return False  # nothing read to make: most calls, answered before the credits' sums
        # A credit is a batch, or a task of several where they are cheap (``credit_batches``):
        # a group holds one credit's batches at least.
        per = self._per(ex) if ex.runs_ahead else 1
        group = max(self.group, per) if ex.runs_ahead else 1
        room = self.limit * per - self.ahead
        if not ex.runs_ahead:
            if self.jobs or not self.raw:
                return False
            room = 1
        if room <= 0 or len(self.jobs) >= ex.most_jobs:
            return False
        if ex.reads_itself and not self.raw:
            left = self.plan.steps_known() - self.read_step
            if self.ended or left <= 0 or self.reads:  # windows still being read here come first
                return False
            full = min(group, left)
            n = min(full, room)
            if n < full and self.jobs:  # wait for a whole group's room while others are in flight
                return False
            specs = self.plan.batches(self.read_step, self.read_step + n)
            self.read_step += n
            self._windows = windows(self.plan, self.read_step, self.largest, self._bounds)
            self._queue(ex.submit(specs, None), n)
            return True
        n = min(group, room, len(raw))
        if n < group and n < len(raw) and self.jobs:
            return False  # a whole group's room, unless nothing else is in flight
        ds: list[Delivery] = []
        while len(ds) < n and raw:
            d = raw[0]
            if d.error is not None:  # a failed read: after the batches before it, then nothing
                break
            ds.append(raw.popleft())
        if ds:
            values = [d.value for d in ds]
            for d in ds:
                d.value = None
            self._queue(ex.submit([d.spec for d in ds], values), len(ds))
        if raw and raw[0].error is not None and len(ds) < n:
            failed = raw.popleft()
            self._queue(Made([failed], ex.place), 1)
            self.ended = True
            raw.clear()
        return bool(ds)

    def _queue(self, job: Job, n: int) -> None:
        self.jobs.append(job)
        self.ahead += n

    def fail(self, exc: BaseException) -> None:
        """A failure outside any batch (an executor that could not start, a bug): handed out
        at the next step not yet made, after the batches before it; nothing after it."""
        step = self.read_step if not self.reads_here() else self._first_unmade()
        spec = self.plan.batch(step) if step < self.plan.steps_known() else BatchSpec(step, 0, 0, 0)
        self.raw.clear()
        self._cancel_reads()
        self._queue(Made([Delivery(spec, error=exc)], self.place), 1)
        self.ended = True

    def _first_unmade(self) -> int:
        if self.raw:
            return self.raw[0].spec.step
        for r in self.reads:
            if r.specs:  # (a count has none)
                return r.specs[0].step
        return self.read_step

    def make_here(self) -> Delivery | None:
        """The next batch, made at once in the driver's thread, where it is read already,
        nothing is in flight before it and ``here`` makes it inline (the inline path: no job
        between the read and the consumer); None where it is not (the driver then drives the
        flow on). The hot path of ``num_workers=0``: one call per batch."""
        raw = self.raw
        if not raw or self.jobs or self.closed or not self.here.makes_now():
            return None
        if self.on_workers and not self._here_first:
            return None  # the workers make the batches read here
        try:
            d = raw.popleft()
        except IndexError:  # closed in another thread meanwhile
            return None
        self.place = "inline"  # made here, in the driver's thread
        self.handed_out = True
        if d.error is None:
            try:
                d.value = self.here.make(d.value)
                return d
            except DELIVERED_ERRORS as exc:
                d.value, d.error = None, exc
        self.end()
        return d

    def wants_read(self) -> bool:
        """Whether a window may be read ahead now that was not at the last :meth:`next_read`:
        cheap, for a driver's hot path, where batches made at once leave fewer read."""
        return len(self.raw) == self.largest and len(self.reads) < self.concurrency

    # -- handing out ----------------------------------------------------------------------------
    def head(self) -> Job | None:
        """The job whose batch comes next (None: none is in flight)."""
        return self.jobs[0] if self.jobs else None

    def take(self) -> Delivery | None:
        """The next batch in plan order if it is ready; None if not."""
        jobs = self.jobs
        while jobs:
            job = jobs[0]
            if job.ready():
                break
            if not job.empty():
                return None
            jobs.popleft()  # a group that stopped at a failure: its rest is dropped
        else:
            return None
        d = job.take()
        self.handed_out = True
        self.ahead = max(0, self.ahead - 1)
        if job.empty():
            jobs.popleft()
        self.place = job.place
        if job.transfer and self.move is not None:
            apply(d, self.move)
        if d.error is not None:
            self.end()
        return d

    def finished(self) -> bool:
        """Whether every batch has been handed out (or a failure ended the epoch)."""
        if self.jobs or self.raw or self.reads:
            return False
        return self.closed or self.ended or self.read_step >= self.total

    # -- ending ---------------------------------------------------------------------------------
    def _cancel_reads(self) -> None:
        reads, self.reads = self.reads, deque()
        for r in reads:
            cancel = getattr(r.handle, "cancel", None)
            if cancel is not None:
                cancel()

    def end(self) -> None:
        """Nothing after the batch handed out last: drop what is read and made behind it."""
        self.ended = True
        self.raw.clear()
        self._cancel_reads()
        jobs, self.jobs = self.jobs, deque()
        for job in jobs:
            job.cancel()
        self.ahead = 0
        self._windows = iter(())

    def close(self) -> None:
        """Produce nothing more. Idempotent."""
        self.closed = True
        self.end()


class Clock:
    """A chooser's clock over one epoch of a sync ``for``: what the consumer's cycle cost in the
    mode it ran in, told to the :class:`~guideloom._runtime.chooser.Chooser` that outlives the
    epoch. The driver calls :meth:`tick` at each request, :meth:`read` for each window it reads
    inline, and, where :meth:`tick` asks for it, :meth:`weigh` with the CPU time the request
    took.

    The consumer's whole cycle (from one request to the next, its own work included: workers
    that hold the GIL slow it down too) is timed in the mode it ran in, the reads left out (the
    same in both modes), and inline is charged what a batch's read costs where the workers read
    their own. While a choice of inline stands, nothing is timed: the clock is looked at once
    every ``QUIET_CALLS``. With process workers, a sample (``CPU_SAMPLE``) of their batches is
    timed in CPU time (:meth:`weigh`)."""

    def __init__(
        self, chooser: choosing.Chooser, flow: EpochFlow, procs: Processes | None, capacity: int
    ) -> None:
        self.chooser, self.flow, self.procs = chooser, flow, procs
        self._last: float | None = None  # when the last request came
        self._read_s = 0.0  # spent reading since then
        self._window_read = 0.0  # the last window read here, per batch
        self._quiet = 0  # calls left before the clock is looked at again (inline, held)
        self._settled = False
        self._span = 0  # the batches of a workers' task the chooser was told of
        limit = capacity + 1
        self._skip, self._chunk = limit, max(8, 2 * limit)
        self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0

    def read(self, seconds: float, batches: int) -> None:
        """A window of ``batches`` batches was read inline in ``seconds`` (left out of the cycle)."""
        self._read_s += seconds
        self._window_read = seconds / max(1, batches)

    def tick(self) -> bool:
        """A request: the cycle since the last one is recorded. Returns whether this request's
        CPU time is to be told to :meth:`weigh`."""
        if self._quiet:
            self._quiet -= 1
            return False
        chooser, flow, procs = self.chooser, self.flow, self.procs
        if flow.per != self._span:  # the workers' tasks grew: the chooser's chunks span them
            self._span = flow.per
            chooser.span(flow.per)
        now = time.perf_counter()
        if self._last is not None:
            chooser.record(now - self._last - self._read_s, self._settled)
        self._last, self._read_s = now, 0.0
        workers = chooser.workers
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
            return False
        self._in_calls += 1
        return (
            procs is not None
            and procs.is_up
            and chooser.measures
            and self._in_calls > self._skip
            and random.random() < choosing.CPU_SAMPLE
        )

    def weigh(self, seconds: float) -> None:
        """The process workers' mode: ``seconds`` of the consumer thread's CPU time spent taking
        one of their batches. Once that costs as much, per batch, as the workers report a batch's
        read and collate costs them, making it inline cannot cost more: inline is chosen. CPU
        time, not wall time: waiting for workers that a loaded machine slows down is no cost of
        their transport."""
        self._in_sampled += 1
        self._in_total += seconds
        if self._in_sampled < self._chunk or self._in_total < choosing.CHUNK_SECONDS:
            return
        mean = self._in_total / self._in_sampled
        self._in_sampled, self._in_total = 0, 0.0
        assert self.procs is not None
        work = self.procs.session.work_per_batch
        if work is not None and mean >= work:
            self.chooser.settle(False, (mean, work))
