"""The exactly-once audit: an order-independent digest of the positions each rank was handed.

Each rank keeps a :class:`Tally` of the global positions it delivered in the current epoch: how
many, and their digest, the sum of ``x^p`` over the positions ``p`` modulo the Mersenne prime
``2^61 - 1`` (``x`` drawn from the seed and the epoch). The digest of a range ``[a, b)`` is a
geometric series, ``(x^b - x^a) / (x - 1)``: O(1) per batch whatever its size, and O(1) for what
the plan says a whole stretch of the epoch must hold. Sums add across ranks, so the ranks'
tallies together must equal the plan's digest of ``[start, offset)``; two different multisets of
positions below ``2^62`` share a digest with a chance below ``2^-19`` per comparison for the
largest epochs (a polynomial of degree ``< 2^42`` has at most that many roots among ``2^61``
values), far less for ordinary ones.

A rank's deliveries are *runs*: each stretch of consecutive batches as ``(offset, batches,
local_batch_size, world_size, rank)``, one per iterator (merged while one continues the last), so
a handful per epoch and nothing to do per batch: an iterator's count of handed-over batches is the
run's length. The count and digest of a run are closed forms. The digests (three ints summed over
the ranks) say whether the epoch so far is exact; the runs, gathered only when it is not, say
where it stopped being.

Pure: no I/O, no torch (the loader gathers the ranks' tallies, :mod:`guideloom._loader.audit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from guideloom._core.keys import hash64
from guideloom._core.provenance import History
from guideloom._core.text import plural

__all__ = [
    "MODULUS",
    "AuditReport",
    "RankTally",
    "Tally",
    "audit_base",
    "compare",
    "range_digest",
    "run_summary",
]

MODULUS = (1 << 61) - 1


def audit_base(epoch: int) -> int:
    """The digest's ``x`` for an epoch, in ``[2, MODULUS - 2]``: the same on every rank (a
    loader without ``shuffle_seed`` draws its seed per rank, so the seed is no part of it)."""
    return hash64(f"guideloom-audit:{epoch}") % (MODULUS - 3) + 2


def range_digest(x: int, inverse: int, start: int, stop: int) -> int:
    """``sum(x^p for p in [start, stop)) mod MODULUS``, ``inverse`` being ``1 / (x - 1)``."""
    if stop <= start:
        return 0
    return (pow(x, stop, MODULUS) - pow(x, start, MODULUS)) * inverse % MODULUS


#: A run: ``[offset of its first global batch, batches, local_batch_size, world_size, rank]``.
Run = list[int]


def run_summary(run: Sequence[int], n: int, x: int, inverse: int) -> tuple[int, int]:
    """The count and digest of a run's positions, clipped to ``n``, in closed form: its whole
    blocks are a geometric series of geometric series, and at most one block is cut by ``n``."""
    base, batches, b, w, rank = run
    g = b * w
    first = base + rank * b
    if batches <= 0 or first >= n:
        return 0, 0
    whole = max(0, min(batches, (n - first - b) // g + 1)) if first + b <= n else 0
    count, digest = whole * b, 0
    if whole:
        xg = pow(x, g, MODULUS)
        if xg == 1:  # x's order divides g: every block has the same digest
            blocks = whole % MODULUS
        else:
            blocks = (pow(xg, whole, MODULUS) - 1) * pow(xg - 1, MODULUS - 2, MODULUS) % MODULUS
        digest = range_digest(x, inverse, first, first + b) * blocks % MODULUS
    if whole < batches:  # the block cut by the epoch's end, if it starts before it
        cut = first + whole * g
        if cut < n:
            count += n - cut
            digest = (digest + range_digest(x, inverse, cut, n)) % MODULUS
    return count, digest


@dataclass(slots=True)
class Tally:
    """One rank's deliveries in one epoch, from ``start`` (the offset it began counting at: 0, or
    where a checkpoint resumed the epoch), as runs of consecutive batches.

    Nothing is done per batch: an iterator opens a run when it starts (its first offset and
    geometry) and the tally reads how many batches it has handed over (``live``) when asked, and
    once more when it ends. The count and digest are computed from the runs in closed form."""

    epoch: int = 0
    start: int = 0
    runs: list[Run] = field(default_factory=list)
    live: Callable[[], int] | None = None
    owner: int = 0
    """Which iterator ``live`` counts for (``id()``): only it ends its run."""

    def reset(self, epoch: int, start: int) -> None:
        """Count afresh from ``(epoch, start)``."""
        self.epoch, self.start, self.runs, self.live = epoch, start, [], None

    def begin(self, run: Run, delivered: Callable[[], int], owner: int) -> None:
        """Iterator ``owner`` starts handing over the batches of ``run`` (its count 0);
        ``delivered`` says how many it has handed over."""
        self.end(self.owner)
        self.runs.append(run)
        self.live, self.owner = delivered, owner

    def end(self, owner: int) -> None:
        """Iterator ``owner`` stopped: its count is final (a run that continues the one before
        is merged into it; an empty one is dropped). Another iterator's end changes nothing."""
        if self.live is None or owner != self.owner:
            return
        self.runs[-1][1] = self.live()
        self.live = None
        last = self.runs[-1]
        if last[1] == 0:
            self.runs.pop()
        elif len(self.runs) > 1:
            prev = self.runs[-2]
            if prev[2:] == last[2:] and last[0] == prev[0] + prev[1] * last[2] * last[3]:
                prev[1] += last[1]
                self.runs.pop()

    def truncate(self, offset: int) -> None:
        """Take back every batch that starts at ``offset`` or after it (a rollback to a committed
        position): runs are cut in closed form, the running one included, which goes on
        counting from the batches it keeps (its iterator starts a new run after this)."""
        self.end(self.owner)
        kept: list[Run] = []
        for run in self.runs:
            g = run[2] * run[3]
            run[1] = min(run[1], max(0, -(-(offset - run[0]) // g)))
            if run[1] > 0:
                kept.append(run)
        self.runs = kept

    def current(self) -> list[Run]:
        """The runs so far, the running iterator's included."""
        runs = [list(r) for r in self.runs]
        if self.live is not None and runs:
            runs[-1][1] = self.live()
        return [r for r in runs if r[1] > 0]


@dataclass(frozen=True, slots=True)
class RankTally:
    """What one rank reports to an audit: its tally and its position."""

    epoch: int
    start: int
    offset: int
    count: int
    digest: int
    runs: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What an audit of the ranks found (:meth:`StatefulDataLoader.audit
    <guideloom.StatefulDataLoader.audit>`).

    ``ok`` is whether the ranks together were handed every position of ``[start, offset)`` of
    the epoch exactly once, and nothing else. Where not, ``step`` is the first step (the epoch's
    global batch index, see the Provenance page) at which a position was handed out twice, never,
    or out of turn, and ``position`` that position; ``message`` says what happened.
    """

    ok: bool
    epoch: int
    start: int
    offset: int
    delivered: int
    expected: int
    step: int | None = None
    position: int | None = None
    message: str = ""


def _blocks(runs: Sequence[Sequence[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every batch block of ``runs`` as ``[start, stop)`` arrays, clipped to ``n``."""
    starts, stops = [], []
    for base, batches, b, w, rank in runs:
        lo = np.minimum(base + np.arange(batches, dtype=np.int64) * (b * w) + rank * b, n)
        starts.append(lo)
        stops.append(np.minimum(lo + b, n))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts), np.concatenate(stops)


def _first_wrong(tallies: Sequence[RankTally], lo: int, hi: int, n: int) -> tuple[int, int] | None:
    """The first position of ``[lo, hi)`` covered other than once by the runs, or covered
    outside it, with its coverage."""
    starts, stops = _blocks([r for t in tallies for r in t.runs], n)
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    points = np.unique(np.concatenate([starts, stops, [lo, hi]]))
    delta = np.zeros(len(points), np.int64)
    np.add.at(delta, np.searchsorted(points, starts), 1)
    np.add.at(delta, np.searchsorted(points, stops), -1)
    cover = np.cumsum(delta)  # coverage of [points[i], points[i + 1])
    inside = (points >= lo) & (points < hi)
    wrong = np.flatnonzero((inside & (cover != 1)) | (~inside & (cover != 0)))
    wrong = wrong[wrong < len(points) - 1]
    if wrong.size == 0:
        return None
    i = int(wrong[0])
    return int(points[i]), int(cover[i])


def _step_of(history: History, epoch: int, position: int, geometry: tuple[int, int]) -> int:
    """The step whose global batch holds ``position``."""
    mine = [s for s in history.of_epoch(epoch) if s.offset <= position]
    if not mine:
        return position // (geometry[0] * geometry[1])
    seg = mine[-1]
    return seg.step + (position - seg.offset) // seg.global_batch_size


def compare(
    tallies: Sequence[RankTally],
    *,
    num_observations: int,
    x: int,
    history: History,
    geometry: tuple[int, int],
) -> AuditReport:
    """Whether ``tallies`` (every rank's) add up to what the plan says the epoch holds so far."""
    epoch = tallies[0].epoch
    start = min(t.start for t in tallies)
    offset = max(t.offset for t in tallies)
    hi = min(offset, num_observations)
    inverse = pow(x - 1, MODULUS - 2, MODULUS)
    delivered = sum(t.count for t in tallies)
    expected = max(0, hi - start)
    same = all((t.epoch, t.start, t.offset) == (epoch, tallies[0].start, tallies[0].offset) for t in tallies)
    digest = sum(t.digest for t in tallies) % MODULUS
    if same and delivered == expected and digest == range_digest(x, inverse, start, hi):
        return AuditReport(True, epoch, start, offset, delivered, expected)

    def failed(message: str, step: int | None = None, position: int | None = None) -> AuditReport:
        return AuditReport(False, epoch, start, offset, delivered, expected, step, position, message=message)

    if any(t.epoch != epoch for t in tallies):
        epochs = sorted({t.epoch for t in tallies})
        return failed(
            message=f"the ranks are in different epochs {epochs}: they did not all finish the same epochs",
        )
    if not all(t.runs or t.count == 0 for t in tallies):  # a summary alone: no place to name
        return failed(
            message=f"the ranks were handed {plural(delivered, 'position')} of epoch {epoch}, "
            f"the plan holds {expected}",
        )
    found = _first_wrong(tallies, start, hi, num_observations)
    if found is None:
        starts = sorted({t.start for t in tallies})
        offsets = sorted({t.offset for t in tallies})
        return failed(
            message=f"the ranks' tallies disagree (started at offsets {starts}, now at {offsets}) "
            "although every position was handed out once",
        )
    position, cover = found
    step = _step_of(history, epoch, position, geometry)
    what = "never" if cover == 0 else f"{cover} times"
    return failed(
        step=step,
        position=position,
        message=f"epoch {epoch} step {step}: position {position} was handed out {what} "
        f"(ranks started at offsets {sorted({t.start for t in tallies})}, now at "
        f"{sorted({t.offset for t in tallies})}): a rank skipped or repeated a batch, or resumed "
        "from another checkpoint than the others",
    )
