"""Which of two ways to collate a sync ``for`` uses: on the workers, or inline in ``next()``.

Threads share one GIL and process workers pay a transport per batch: workers pay off only when
the collate (or the consumer's own step) leaves room for them. So the loader measures instead of
guessing: it times the consumer's cycle in each mode, keeps the cheaper, and probes the other
again from time to time. A :class:`Chooser` holds those measurements and the verdict; the
loader's lifecycle keeps one per kind of worker, so what one epoch learnt holds for the next.

The workers are what the user asked for (``num_workers > 0``), so they are the default: the
collate goes inline only when inline's mean cycle is at least 5% shorter, not when the two
cannot be told apart. On a machine that other processes load, one chunk of calls can cost
several times its neighbour in the same mode; a rule that needed the workers to win clearly
(their dearest chunk against inline's cheapest) then kept inline a collate that the workers ran
half again as fast.

``async for`` at ``num_workers=0, prefetch=0`` has a choice of its own (:class:`LoopChoice`):
whether a collate is cheap enough to run on the caller's loop, where nothing is made ahead to
hide the hop to a thread and back.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from guideloom._compat import NoRunningLoop

__all__ = [
    "CHUNK_SECONDS",
    "CLEAR",
    "DECISIVE",
    "FIRST_REPROBE_SECONDS",
    "INLINE_MARGIN",
    "LONGEST_HOLD_SECONDS",
    "PAUSE_SHARE",
    "PROBE_CHUNKS",
    "PROBE_SHARE",
    "QUIET_CALLS",
    "REPROBE_SECONDS",
    "STRETCH",
    "WARMUP_CALLS",
    "CPU_SAMPLE",
    "PROCESS_DECISIVE",
    "Chooser",
    "Choosers",
    "LOOP_CHEAP_CALLS",
    "LOOP_COLLATE_S",
    "LOOP_MOST_CALLS",
    "LoopChoice",
    "PinnedChooser",
    "Verdict",
    "process_chooser",
    "thread_chooser",
]

T = TypeVar("T")

#: The longest a choice between workers and inline collation stands before the other is probed again.
REPROBE_SECONDS = 3.0
#: How long the first choice stands (eight times that when :data:`CLEAR`); each later one stands twice
#: as long as the one before (four times when it repeats the last verdict; times eight when clear), up
#: to :data:`REPROBE_SECONDS`: a busy machine may have misled an early one.
FIRST_REPROBE_SECONDS = 0.02
#: Calls not timed at the start of a loader's first iterator (a chooser lasts from one epoch to
#: the next), in the workers (as asked for: a slow collate is spread from its first batch, and a
#: short epoch still runs on the workers): the threads start and the first batches' queue fills.
#: (The reads, whose windows grow over the first 127 batches and fault pages in, are not timed.)
WARMUP_CALLS = 16
#: The least time one chunk of calls in one mode is timed over.
CHUNK_SECONDS = 0.001
#: The collate goes inline only when the consumer's mean cycle with it takes at most this fraction
#: of the workers' (within it the two are as good as equal, and the workers were asked for).
INLINE_MARGIN = 0.95
#: A probe ends early once every chunk of one mode costs this many times every chunk of the other,
#: the costlier mode timed twice (one chunk may be one burst of another process's load).
DECISIVE = 2.0
#: Chunks of each mode a probe takes at most: one whose A B B A chunks overlap goes on, the modes
#: alternating, until every chunk of one mode is cheaper than the other's or this many are in hand.
PROBE_CHUNKS = 3
#: Chunks of a probe whose A B B A chunks overlap are this many times longer, in calls and in
#: seconds: more of each mode's calls, and fewer switches, for the mean that decides.
STRETCH = 4
#: A choice stands at least this many times as long as the probe that made it took (beyond
#: :data:`REPROBE_SECONDS` if need be, up to :data:`LONGEST_HOLD_SECONDS`): probes, half of whose
#: chunks run the worse mode, then take a tenth of the time at most, however slow each call is
#: (a loaded machine, a slow step).
PROBE_SHARE = 0.1
#: The longest a choice stands, however long its probe took.
LONGEST_HOLD_SECONDS = 30.0
#: While a choice of inline stands, ``next()`` looks at the clock once in this many calls.
QUIET_CALLS = 32
#: A chunk one of whose cycles took more than this share of its time is dropped, not compared
#: (one in a row at most): the consumer paused, and one long cycle would decide for either mode.
PAUSE_SHARE = 0.5
#: The share of the process workers' batches whose taking is timed in CPU time: reading a
#: thread's CPU clock is a system call, at which a loaded machine may switch to another thread
#: (measured: a 13% slower loop when every batch was timed), where the wall clock is read without one.
CPU_SAMPLE = 1 / 16
#: A probe of process workers ends after one chunk of each mode once one costs this many times the
#: other. Lower than the threads' :data:`DECISIVE`: process workers either clearly pay (a GIL-bound
#: collate: ~1.7x) or clearly cost (a cheap one: ~3x), and each chunk of the worse mode is dear (a
#: refill of the workers' pipeline, or milliseconds of collate inline).
PROCESS_DECISIVE = 1.4
#: A choice whose other mode costs this many times the chosen one's stands eight times longer:
#: a busy machine does not turn a 25% gap round, and each probe of the worse mode costs.
CLEAR = 1.25


class Verdict(NamedTuple):
    """A chooser's last choice and the figures it was made on (what ``loader.stats()`` reports)."""

    workers: bool
    """Whether the workers were chosen (else the collate runs inline)."""
    workers_seconds: float
    """What a batch cost with the workers: the consumer's cycle (request to request, reads left
    out), the mean of the probe's chunks; for a :meth:`Chooser.settle`, the CPU time ``next()``
    spent taking a batch off them."""
    inline_seconds: float
    """What a batch cost with the collate inline: the consumer's cycle, the mean of the probe's
    chunks; for a :meth:`Chooser.settle`, the batch's read and collate as the workers timed it."""
    made: int
    """Choices made so far, this one included."""


class Chooser:
    """Which mode ``next()`` runs in: probes of each mode, then the cheaper for a while.

    A mode is timed over *chunks* of at least ``chunk`` calls and :data:`CHUNK_SECONDS` (so a
    chunk of cheap batches is not all timer noise), the calls that fill (or drain) the workers'
    queue after a switch not counted, nor the time spent reading (the same in both modes). Each
    choice compares chunks in the order A, B, B, A (workers, inline, inline, workers at first,
    after :data:`WARMUP_CALLS`; later the chosen mode's last chunk, two of the other, one
    more of the chosen), so a steady drift in speed weighs on both alike. When every chunk of
    one mode is cheaper than every chunk of the other, the probe ends; when they overlap (a busy
    machine, or two modes as good as equal) it goes on, the modes alternating, in chunks
    :data:`STRETCH` times as long, up to :data:`PROBE_CHUNKS` of each. Then inline is chosen if
    its mean cycle over the probe's calls costs at most :data:`INLINE_MARGIN` of the workers';
    else the workers. A probe ends early once both
    chunks of one mode cost :data:`DECISIVE` times every chunk of the other. A chunk that
    one long cycle dominates (:data:`PAUSE_SHARE`: the consumer paused) is dropped, once. A first
    choice stands :data:`FIRST_REPROBE_SECONDS` (eight times that when clear: the other mode :data:`CLEAR`
    times as costly), each later one twice as long as the one before (four times when it
    repeats the verdict before it; times eight when clear), up to :data:`REPROBE_SECONDS`, so
    that probes of the worse mode cost a few percent at most.
    """

    def __init__(
        self,
        skip: int,
        chunk: int,
        inline_chunk: int | None = None,
        inline_skip: int | None = None,
        decisive: float = DECISIVE,
    ) -> None:
        self._skip, self._chunk = skip, chunk
        self._decisive = decisive
        self._skips = {True: skip, False: skip if inline_skip is None else inline_skip}
        # Inline has no queue to settle: its chunks may be shorter (a probe of a costlier inline
        # then costs less), where the workers' must span their queue.
        self._chunks_of = {True: chunk, False: chunk if inline_chunk is None else inline_chunk}
        self.workers = True
        self._plan = [False, False, True]  # after a first chunk of the workers, as asked for
        self._chunks: dict[bool, list[float]] = {True: [], False: []}  # mean seconds per call
        self._pool = {True: (0.0, 0), False: (0.0, 0)}  # the probe's seconds and calls per mode
        self._stretch = 1  # chunks of a probe gone on past A B B A are this many times longer
        self._last = 0.0  # the chosen mode's latest chunk
        self._probing = True
        self._n = -(skip + WARMUP_CALLS)
        self._total = 0.0
        self._longest = 0.0  # the chunk's longest cycle
        self._dropped = False  # the last chunk was dropped as a pause
        self._until = 0.0
        self._interval = FIRST_REPROBE_SECONDS
        self._chosen: bool | None = None  # the last probe's verdict
        self._probe_started: float | None = None  # when the probe under way began
        self.verdict: Verdict | None = None  # the last choice and its figures
        #: Whether the caller should time anything for it (a pinned mode needs nothing).
        self.measures = True

    def span(self, batches: int) -> None:
        """The workers' tasks hold ``batches`` batches each (cheap batches go several a task):
        the calls not timed after a switch to them are that many times more (the tasks sent at
        the switch arrive together, their batches then in hand), and their chunks are whole
        tasks, two at least (within one, every batch but the first is in hand)."""
        skipped = self._skips[True]
        self._skips[True] = self._skip * batches
        self._chunks_of[True] = batches * max(2, math.ceil(self._chunk / batches))
        if self.workers and self._n <= 0:  # the calls after a switch to them: skipped over a task
            self._n -= self._skips[True] - skipped

    def record(self, seconds: float, settled: bool) -> None:
        """One cycle of ``seconds`` in the current mode; ``settled``: the queue held only this
        mode's work (inline, the workers' queue has drained)."""
        if not settled:
            return
        self._n += 1
        if self._n <= 0:
            return
        self._total += seconds
        self._longest = max(self._longest, seconds)
        stretch = self._stretch
        if self._n < stretch * self._chunks_of[self.workers] or self._total < stretch * CHUNK_SECONDS:
            return
        mode, calls, total, longest = self.workers, self._n, self._total, self._longest
        mean = total / calls
        paused = self._n > 2 and longest > PAUSE_SHARE * total and not self._dropped
        self._n, self._total, self._longest = 0, 0.0, 0.0
        self._dropped = paused
        now = time.perf_counter()
        if paused:  # the consumer paused (an evaluation, a checkpoint): that says nothing of the mode
            # nor does it use up the choice's time, or count as the probe's
            if not self._probing:
                self._until += longest
            elif self._probe_started is not None:
                self._probe_started += longest
            return
        if not self._probing:
            self._last = mean
            if now >= self._until:  # probe the other: chosen, other, other, chosen
                self._probing = True
                self._probe_started = now
                self._chunks = {mode: [mean], not mode: []}
                self._pool = {mode: (total, calls), not mode: (0.0, 0)}
                self._plan = [not mode, mode]
                self._switch(not mode)
            return
        if self._probe_started is None:  # the first probe: from its first chunk
            self._probe_started = now - total
        self._chunks[mode].append(mean)
        pooled = self._pool[mode]
        self._pool[mode] = (pooled[0] + total, pooled[1] + calls)
        verdict = self._weigh()
        if verdict is None:
            if not self._plan:  # past A B B A: the chunks overlap, so time longer ones
                self._stretch = STRETCH
            self._switch(self._plan.pop(0) if self._plan else not mode)
            return
        self._choose(verdict[0], clear=verdict[1], costs=(self._mean(True), self._mean(False)))

    def _mean(self, workers: bool) -> float:
        """The mean cycle of the probe's calls in one mode (its chunks weighed by their calls)."""
        seconds, calls = self._pool[workers]
        return seconds / calls if calls else math.nan

    def _weigh(self) -> tuple[bool, bool] | None:
        """The probe's verdict so far, ``(workers, clear)``, or None to go on probing."""
        w, i = self._chunks[True], self._chunks[False]
        if not (w and i):
            return None
        if self._plan:  # the A B B A order under way: only a decisive gap ends it early
            if len(i) > 1 and min(i) > self._decisive * max(w):
                return True, True
            if len(w) > 1 and min(w) > self._decisive * max(i):
                return False, True
            return None
        # Compared by the mean cycle of all the probe's calls in each mode: a loaded machine
        # preempts the consumer now and then, for milliseconds, and more often with the workers'
        # threads running; a median would pick the chunks no preemption hit and miss that cost.
        mw, mi = self._mean(True), self._mean(False)
        separated = max(i) < min(w) or max(w) < min(i)
        if not separated and (len(w) < PROBE_CHUNKS or len(i) < PROBE_CHUNKS):
            return None  # chunks that overlap: time more of each
        return mi > INLINE_MARGIN * mw, separated and max(mw, mi) > CLEAR * min(mw, mi)

    def settle(self, workers: bool, costs: tuple[float, float] = (math.nan, math.nan)) -> None:
        """Choose ``workers`` now, a probe or not, and hold it as a clear choice: a measurement
        beside the chunks (its ``costs``: the workers', inline's) showed the other mode cannot
        be the cheaper."""
        self._choose(workers, clear=True, costs=costs)

    def _choose(self, workers: bool, clear: bool, costs: tuple[float, float] = (math.nan, math.nan)) -> None:
        """End the probe with ``workers``. A clear choice stands eight times longer; a close one,
        which a busy machine may have decided, is probed again soon. The next choice stands
        twice as long, or four times when this one confirmed the last: a verdict that probes
        keep repeating need not be bought again as often (each probe of a GIL-bound collate's
        workers costs a pipeline refill, ~2% of a fresh loader's first second)."""
        confirmed = self._chosen is workers
        self._chosen = workers
        self._stretch = 1
        self.verdict = Verdict(workers, *costs, 1 if self.verdict is None else self.verdict.made + 1)
        self._probing = False
        self._switch(workers)
        now = time.perf_counter()
        hold = min(REPROBE_SECONDS, (8 if clear else 1) * self._interval)
        self._interval = min(REPROBE_SECONDS, (4 if confirmed else 2) * hold)
        if self._probe_started is not None:  # a tenth of the time in probes at most
            hold = max(hold, min(LONGEST_HOLD_SECONDS, (now - self._probe_started) / PROBE_SHARE))
            self._probe_started = None
        self._until = now + hold

    def held_until(self) -> float | None:
        """Until when the current choice stands (no chunk need be timed before), or None while
        probing."""
        return None if self._probing else self._until

    def _switch(self, workers: bool) -> None:
        if workers != self.workers:
            self.workers = workers
            self._n, self._total, self._longest = -self._skips[workers], 0.0, 0.0


class Choosers(Protocol):
    """Where a driver finds the chooser that outlives its epoch (the loader's lifecycle)."""

    def chooser(self, kind: str, make: Callable[[], Chooser], *, fresh: bool = False) -> Chooser:
        """The chooser of ``kind``, made by ``make`` the first time (every time if ``fresh``)."""
        ...


class PinnedChooser(Chooser):
    """A mode the user pinned (``collate_mode="workers"``): nothing is timed, nothing probed, no
    verdict made."""

    def __init__(self, workers: bool = True) -> None:
        super().__init__(skip=0, chunk=1)
        self.workers = workers
        self.measures = False
        self._probing = False
        self._until = math.inf

    def record(self, seconds: float, settled: bool) -> None:
        """Nothing to measure."""

    def settle(self, workers: bool, costs: tuple[float, float] = (math.nan, math.nan)) -> None:
        """The pinned mode stands."""


def thread_chooser(capacity: int) -> Chooser:
    """A new chooser between worker threads and inline collation for an epoch of ``capacity``
    batches ahead (the loader keeps one from epoch to epoch)."""
    limit = capacity + 1
    return Chooser(skip=limit, chunk=max(8, 2 * limit))


def process_chooser(capacity: int) -> Chooser:
    """A new chooser between process workers and inline collation for an epoch of ``capacity``
    batches ahead. The loader's lifecycle keeps it with its persistent workers: what one epoch
    learnt holds for the next, which starts in the mode the last one ended in. Inline has no
    queue to refill: its chunks are shorter and it skips no call."""
    limit = capacity + 1
    return Chooser(
        skip=limit, chunk=max(8, 2 * limit), inline_chunk=8, inline_skip=0, decisive=PROCESS_DECISIVE
    )


#: A collate that takes less than this runs on the caller's loop (:class:`LoopChoice`): the loop
#: is held no longer than the turn ``async for`` gives its other tasks once a millisecond.
LOOP_COLLATE_S = 0.001
#: Calls in a row under :data:`LOOP_COLLATE_S`, timed on the collate thread, before the collate
#: moves to the loop (a first call may be cheap by chance, or warm a cache the next ones miss).
LOOP_CHEAP_CALLS = 4
#: The most calls in a row a collate sent back from the loop has to earn it again with
#: (:class:`LoopChoice`): twice as many after each call on the loop that took longer.
LOOP_MOST_CALLS = 1024


class LoopChoice:
    """Where ``async for`` collates at ``num_workers=0, prefetch=0``: on its collate thread, or on
    the caller's loop.

    With nothing made ahead, every batch waits for the hop to the thread and back: two wake-ups,
    30-150 µs on two cores, several times a collate of a few small tensors (an epoch of such
    batches ran at a third of the sync loop's rate). So each call is timed by the wall clock (a
    collate that waits, on a lock or a disk, counts as slow), and after :data:`LOOP_CHEAP_CALLS`
    in a row under :data:`LOOP_COLLATE_S` the next ones run on the loop. One that takes longer
    there sends the collate back to its thread, to earn the loop again with twice as many cheap
    calls in a row as the last time (up to :data:`LOOP_MOST_CALLS`): a loop thread that waited
    for a core costs a few batches their hop, a collate slow now and then holds the loop ever
    more rarely."""

    __slots__ = ("cheap", "need", "on_loop")

    def __init__(self) -> None:
        self.cheap = 0  # calls in a row under the limit
        self.need = LOOP_CHEAP_CALLS  # the calls in a row that earn the loop
        #: Whether the next call runs on the loop.
        self.on_loop = False

    def timed(self, seconds: float) -> None:
        """A call took ``seconds`` (on the thread or on the loop, as :attr:`on_loop` said)."""
        if seconds < LOOP_COLLATE_S:
            if not self.on_loop:
                self.cheap += 1
                self.on_loop = self.cheap >= self.need
            return
        self.cheap = 0
        if self.on_loop:
            self.on_loop = False
            self.need = min(LOOP_MOST_CALLS, 2 * self.need)

    def run(self, context: contextvars.Context, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` as on a thread of its own (no running loop, in ``context``: the
        epoch's own, as a new collate thread's), timed for the choice."""
        t0 = time.perf_counter()
        try:
            with NoRunningLoop():
                return context.run(fn, *args)
        finally:
            self.timed(time.perf_counter() - t0)
