"""Which of two ways to collate a sync ``for`` uses: on the workers, or inline in ``next()``.

Threads share one GIL and process workers pay a transport per batch: workers pay off only when
the collate (or the consumer's own step) leaves room for them. So the loader measures instead of
guessing: it times the consumer's cycle in each mode, keeps the cheaper, and probes the other
again from time to time. A :class:`Chooser` holds those measurements and the verdict; the
loader's lifecycle keeps one per kind of worker, so what one epoch learnt holds for the next.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

__all__ = [
    "CHUNK_SECONDS",
    "CLEAR",
    "DECISIVE",
    "FIRST_REPROBE_SECONDS",
    "PAUSE_SHARE",
    "QUIET_CALLS",
    "REPROBE_SECONDS",
    "WARMUP_CALLS",
    "WORKERS_MARGIN",
    "Chooser",
    "PinnedChooser",
    "Verdict",
]

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
#: Workers are used only when the consumer's cycle takes at most this fraction of inline's.
WORKERS_MARGIN = 0.9
#: A probe ends early once one mode's chunk costs this many times the other's.
DECISIVE = 2.0
#: While a choice of inline stands, ``next()`` looks at the clock once in this many calls.
QUIET_CALLS = 32
#: A chunk one of whose cycles took more than this share of its time is dropped, not compared
#: (one in a row at most): the consumer paused, and one long cycle would decide for either mode.
PAUSE_SHARE = 0.5
#: A choice whose other mode costs this many times the chosen one's stands eight times longer:
#: a busy machine does not turn a 25% gap round, and each probe of the worse mode costs.
CLEAR = 1.25


def _ratio(chunks: dict[bool, list[float]]) -> float:
    """The costlier mode's cheapest chunk over the other's."""
    cost = [min(c) for c in chunks.values()]
    return max(cost) / max(min(cost), 1e-12)


class Verdict(NamedTuple):
    """A chooser's last choice and the figures it was made on (what ``loader.stats()`` reports)."""

    workers: bool
    """Whether the workers were chosen (else the collate runs inline)."""
    workers_seconds: float
    """What a batch cost with the workers: the consumer's cycle (request to request, reads left
    out); for a :meth:`Chooser.settle`, the time ``next()`` spent taking a batch off them."""
    inline_seconds: float
    """What a batch cost with the collate inline: the consumer's cycle; for a
    :meth:`Chooser.settle`, the batch's read and collate as the workers timed it."""
    made: int
    """Choices made so far, this one included."""


class Chooser:
    """Which mode ``next()`` runs in: probes of each mode, then the cheaper for a while.

    A mode is timed over *chunks* of at least ``chunk`` calls and :data:`CHUNK_SECONDS` (so a
    chunk of cheap batches is not all timer noise), the calls that fill (or drain) the workers'
    queue after a switch not counted, nor the time spent reading (the same in both modes). Each
    choice compares chunks in the order A, B, B, A (workers, inline, inline, workers at first,
    after :data:`WARMUP_CALLS`; later the chosen mode's last chunk, two of the other, one
    more of the chosen), so a steady drift in speed weighs on both alike; inline costs its
    cheaper chunk, so one preempted chunk does not decide, and the workers their dearer one (a
    hand-off varies more from chunk to chunk, and the cheaper of two noisy chunks would flatter
    it); a probe ends early once one mode costs :data:`DECISIVE` times the other. A chunk that
    one long cycle dominates (:data:`PAUSE_SHARE`: the consumer paused) is dropped, once. The workers
    are kept only if they cost at most :data:`WORKERS_MARGIN` of inline: a hand-off that brings
    nothing measurable is not worth its threads. A first choice stands
    :data:`FIRST_REPROBE_SECONDS` (eight times that when clear: the other mode :data:`CLEAR`
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
        self._last = 0.0  # the chosen mode's latest chunk
        self._probing = True
        self._n = -(skip + WARMUP_CALLS)
        self._total = 0.0
        self._longest = 0.0  # the chunk's longest cycle
        self._dropped = False  # the last chunk was dropped as a pause
        self._until = 0.0
        self._interval = FIRST_REPROBE_SECONDS
        self._chosen: bool | None = None  # the last probe's verdict
        self.verdict: Verdict | None = None  # the last choice and its figures

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
        if self._n < self._chunks_of[self.workers] or self._total < CHUNK_SECONDS:
            return
        mode, mean = self.workers, self._total / self._n
        paused = self._n > 2 and self._longest > PAUSE_SHARE * self._total and not self._dropped
        self._n, self._total, self._longest = 0, 0.0, 0.0
        self._dropped = paused
        if paused:  # the consumer paused (an evaluation, a checkpoint): that says nothing of the mode
            return
        if not self._probing:
            self._last = mean
            if time.perf_counter() >= self._until:  # probe the other: chosen, other, other, chosen
                self._probing = True
                self._chunks = {mode: [mean], not mode: []}
                self._plan = [not mode, mode]
                self._switch(not mode)
            return
        self._chunks[mode].append(mean)
        # Every chunk of the worse mode costs: once one mode is twice the costlier, no drift
        # the rest of the A B B A order guards against could turn the choice round.
        if self._plan and not (all(self._chunks.values()) and _ratio(self._chunks) > self._decisive):
            self._switch(self._plan.pop(0))
            return
        # Inline costs its cheaper chunk, the workers their dearer one (see the class docstring).
        costs = (max(self._chunks[True]), min(self._chunks[False]))
        workers = costs[0] <= WORKERS_MARGIN * costs[1]
        self._choose(workers, clear=_ratio(self._chunks) > CLEAR, costs=costs)

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
        self.verdict = Verdict(workers, *costs, 1 if self.verdict is None else self.verdict.made + 1)
        self._probing = False
        self._switch(workers)
        hold = min(REPROBE_SECONDS, (8 if clear else 1) * self._interval)
        self._until = time.perf_counter() + hold
        self._interval = min(REPROBE_SECONDS, (4 if confirmed else 2) * hold)

    def held_until(self) -> float | None:
        """Until when the current choice stands (no chunk need be timed before), or None while
        probing."""
        return None if self._probing else self._until

    def _switch(self, workers: bool) -> None:
        if workers != self.workers:
            self.workers = workers
            self._n, self._total, self._longest = -self._skips[workers], 0.0, 0.0


class PinnedChooser(Chooser):
    """A mode the user pinned (``collate_mode="workers"``): nothing is timed, nothing probed, no
    verdict made."""

    def __init__(self, workers: bool = True) -> None:
        super().__init__(skip=0, chunk=1)
        self.workers = workers
        self._probing = False
        self._until = math.inf

    def record(self, seconds: float, settled: bool) -> None:
        """Nothing to measure."""

    def settle(self, workers: bool, costs: tuple[float, float] = (math.nan, math.nan)) -> None:
        """The pinned mode stands."""
