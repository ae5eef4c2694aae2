"""Provenance: which global positions a ``(epoch, step, rank)`` read, after any resumes.

A loader's position is global (``observation_offset``), so a job may resume with another batch
size or world size. What one rank's ``step`` read then depends on the batch geometry of every
stretch of the epoch before it. The checkpoint keeps that as a short *history*: one
:class:`Segment` per change of geometry within an epoch (where the offset was when a
``(local_batch_size, world_size)`` started, and how many steps the epoch had taken by then).
From it, ``(epoch, step, rank)`` maps to its positions in O(log segments), with nothing to replay.

**Step.** ``step`` is the epoch's global batch index: the number of batches each rank had been
handed in the epoch before this one, counted from the epoch's start across resumes (a resume
carries the count on: the steps before a segment are ``(offset - previous segment's offset) /
previous global batch size``). Every rank has taken the same number of steps at the same
offset, so ``step`` names one global batch, and ``rank`` one block of it.

Pure: no I/O, no torch. The loader's side is :mod:`guideloom._loader.state`.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["History", "Segment", "block", "check_history", "parse_history"]

#: Segments a history keeps: the current epoch's and the one before it. Each is a few ints; a job
#: changes its geometry a handful of times an epoch, so this never binds in practice, and the
#: oldest epoch is dropped first when it does.
MAX_SEGMENTS = 256
#: Bounds on what one entry may hold: no run has more ranks or larger batches, and an offset of
#: 2**62 observations is past any dataset (ints stay exact and cheap to compute with).
MAX_WORLD_SIZE = 1 << 24
MAX_LOCAL_BATCH_SIZE = 1 << 40
MAX_POSITION = 1 << 62
#: Characters a saved history can take (five fields of at most 19 digits per entry, with their
#: separators): a longer string is refused before it is split.
MAX_HISTORY_CHARS = MAX_SEGMENTS * 5 * 20
_ENTRY = re.compile(r"[0-9]{1,19}(?::[0-9]{1,19}){4}", re.ASCII)
_FIX = (
    "pass a dict returned by StatefulDataLoader.state_dict(), or remove its 'history' key to resume "
    "at its position without one"
)


class Segment(NamedTuple):
    """A stretch of an epoch read with one batch geometry."""

    epoch: int
    offset: int
    """``observation_offset`` where the stretch began."""
    step: int
    """Steps the epoch had taken before it."""
    local_batch_size: int
    world_size: int

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.world_size


class History:
    """The segments of the current epoch (and the last finished one), in order."""

    __slots__ = ("dropped", "segments")

    def __init__(self, segments: Sequence[Segment] = (), *, dropped: bool = False) -> None:
        self.segments: list[Segment] = list(segments)
        #: Whether entries before the first were dropped to keep it within ``MAX_SEGMENTS``.
        self.dropped = dropped

    def __repr__(self) -> str:
        return f"History({self.segments!r}, dropped={self.dropped})"

    def of_epoch(self, epoch: int) -> list[Segment]:
        return [s for s in self.segments if s.epoch == epoch]

    def steps_at(self, epoch: int, offset: int, geometry: tuple[int, int]) -> int:
        """Steps the epoch has taken at ``offset``: counted through its last segment, or, for an
        epoch without one, as if it was all read with ``geometry`` (a checkpoint of a loader
        that kept no history)."""
        mine = self.of_epoch(epoch)
        if not mine:
            b, w = geometry
            return -(-offset // (b * w))
        last = mine[-1]
        return last.step + -(-(offset - last.offset) // last.global_batch_size)

    def begin(self, epoch: int, offset: int, local_batch_size: int, world_size: int) -> None:
        """A run of ``(local_batch_size, world_size)`` starts at ``(epoch, offset)``: a new
        segment unless it continues the last one. Drops epochs before ``epoch - 1``."""
        self.segments = [s for s in self.segments if s.epoch >= epoch - 1]

        def goes_on(mine: list[Segment]) -> bool:
            if not mine or (mine[-1].local_batch_size, mine[-1].world_size) != (local_batch_size, world_size):
                return False
            last = mine[-1]
            return offset >= last.offset and (offset - last.offset) % last.global_batch_size == 0

        if goes_on(self.of_epoch(epoch)):
            return
        # a segment that begins where a later one began replaces the ones from there on (a
        # checkpoint loaded again, a rollback); where the run before them had this geometry,
        # it goes on (steps taken back under another geometry leave no segment)
        self.segments = [s for s in self.segments if s.epoch != epoch or s.offset < offset]
        if goes_on(self.of_epoch(epoch)):
            return
        step = self.steps_at(epoch, offset, (local_batch_size, world_size))
        self.segments.append(Segment(epoch, offset, step, local_batch_size, world_size))
        while len(self.segments) > MAX_SEGMENTS:
            self.segments.pop(0)
            self.dropped = True

    def truncate(self, epoch: int, offset: int) -> None:
        """Forget the segments of ``epoch`` that begin past ``offset`` (a rollback to it: no
        batch of theirs was committed)."""
        self.segments = [s for s in self.segments if s.epoch != epoch or s.offset <= offset]

    def segment(self, epoch: int, step: int) -> Segment | None:
        """The segment that ``step`` of ``epoch`` falls in; ``None`` where the history has
        none for the epoch or the step lies before its first."""
        mine = self.of_epoch(epoch)
        if not mine or step < mine[0].step:
            return None
        return mine[bisect.bisect_right([s.step for s in mine], step) - 1]

    def encode(self) -> str:
        """The history as one string for the checkpoint: ``epoch:offset:step:B:W`` per segment,
        ``;`` between them (a string is one value to ``torch.distributed.checkpoint``, whatever
        its length, where a list would take the shape of the loading side's); it starts with
        ``+`` where earlier entries were dropped (:attr:`dropped`)."""
        body = ";".join(":".join(str(v) for v in s) for s in self.segments)
        return f"+{body}" if self.dropped and body else body


def parse_history(text: object) -> History:
    """A history from :meth:`History.encode`'s string; ``ValueError`` naming what is wrong.

    Checks each entry on its own (ints, in bounds) and their order; :func:`check_history`
    checks that they add up. A string longer than any saved history is refused before it is
    split, so that a damaged one costs no more than a saved one.
    """
    if not isinstance(text, str):
        raise ValueError(
            f"checkpoint 'history' must be a str, got {type(text).__name__}; pass a dict returned by "
            "StatefulDataLoader.state_dict()"
        )
    if len(text) > MAX_HISTORY_CHARS:
        raise ValueError(
            f"checkpoint 'history' is {len(text):,} characters long, more than the {MAX_SEGMENTS} "
            f"entries a loader saves can take ({MAX_HISTORY_CHARS:,}): it is damaged; {_FIX}"
        )
    dropped = text.startswith("+")
    body = text[1:] if dropped else text
    parts = body.split(";") if body else []
    if len(parts) > MAX_SEGMENTS:
        raise ValueError(
            f"checkpoint 'history' holds {len(parts):,} entries, a loader saves at most {MAX_SEGMENTS}: "
            f"it is damaged; {_FIX}"
        )
    segments: list[Segment] = []
    for i, part in enumerate(parts):
        if not _ENTRY.fullmatch(part):
            raise ValueError(
                f"checkpoint history[{i}] is {part[:40]!r}, not 'epoch:offset:step:batch:world' "
                f"(five ints >= 0); {_FIX}"
            )
        seg = Segment(*(int(v) for v in part.split(":")))
        for name, lo, hi in (
            ("epoch", 0, MAX_POSITION),
            ("offset", 0, MAX_POSITION),
            ("step", 0, MAX_POSITION),
            ("local_batch_size", 1, MAX_LOCAL_BATCH_SIZE),
            ("world_size", 1, MAX_WORLD_SIZE),
        ):
            value = getattr(seg, name)
            if not lo <= value <= hi:
                raise ValueError(
                    f"checkpoint history[{i}].{name} is {value}, expected an int in [{lo}, {hi}]; {_FIX}"
                )
        if segments and (seg.epoch, seg.offset) <= (segments[-1].epoch, segments[-1].offset):
            raise ValueError(
                f"checkpoint history[{i}] (epoch {seg.epoch}, offset {seg.offset}) does not come after "
                f"history[{i - 1}] (epoch {segments[-1].epoch}, offset {segments[-1].offset}): the "
                f"entries must be in increasing order of (epoch, offset); {_FIX}"
            )
        segments.append(seg)
    # a full history saved before the mark was written had dropped entries too
    return History(segments, dropped=dropped or len(segments) == MAX_SEGMENTS)


def check_history(history: History, epoch: int, offset: int) -> History:
    """``history`` checked as arithmetic against the position ``(epoch, offset)`` it was saved
    at, less the epochs before ``epoch - 1`` (which no step of this position maps through).

    Within an epoch, each entry's ``step`` follows from the entry before it (its step plus the
    global batches between their offsets, which must be a whole number); the epoch's first
    entry counts the batches of its own geometry before its offset (a resume from a checkpoint
    without a history), except the very first entry of a full history, whose earlier entries
    were dropped for size; and the position lies on a batch boundary of its epoch's last entry.
    No entry lies past the position. ``ValueError`` names the entry and field, and what was
    expected.
    """
    segs = history.segments
    for i, s in enumerate(segs):
        where = f"checkpoint history[{i}]"
        if s.epoch > epoch or (s.epoch == epoch and s.offset > offset):
            field = "epoch" if s.epoch > epoch else "offset"
            raise ValueError(
                f"{where}.{field} is {getattr(s, field)}: the entry (epoch {s.epoch}, offset {s.offset}) "
                f"lies past the checkpoint's position (epoch {epoch}, observation_offset {offset}), "
                f"where no run has been; {_FIX}"
            )
        g = s.global_batch_size
        if i and segs[i - 1].epoch == s.epoch:
            prev = segs[i - 1]
            gap, pg = s.offset - prev.offset, prev.global_batch_size
            if gap % pg:
                raise ValueError(
                    f"{where}.offset is {s.offset}, not on a batch boundary of history[{i - 1}]: "
                    f"expected {prev.offset} plus a multiple of its global batch size {pg}; {_FIX}"
                )
            expected = prev.step + gap // pg
            if s.step != expected:
                raise ValueError(
                    f"{where}.step is {s.step}, expected {expected} (history[{i - 1}].step {prev.step} plus "
                    f"{gap // pg} global batches of {pg} from offset {prev.offset} to {s.offset}); {_FIX}"
                )
        elif i == 0 and history.dropped:  # earlier entries dropped: a step per observation at most
            if s.step > s.offset or (s.step == 0) != (s.offset == 0):
                raise ValueError(
                    f"{where}.step is {s.step}, expected {'0' if s.offset == 0 else f'1 to {s.offset}'} "
                    f"(a step reads at least one observation, offset {s.offset}); {_FIX}"
                )
        elif s.step != -(-s.offset // g):
            raise ValueError(
                f"{where}.step is {s.step}, expected {-(-s.offset // g)}: the first entry of epoch "
                f"{s.epoch} counts the batches of {g} before its offset {s.offset}; {_FIX}"
            )
    mine = [i for i, s in enumerate(segs) if s.epoch == epoch]
    if mine:
        last = segs[mine[-1]]
        if (offset - last.offset) % last.global_batch_size:
            raise ValueError(
                f"checkpoint observation_offset {offset} is not on a batch boundary of history[{mine[-1]}]: "
                f"expected {last.offset} plus a multiple of its global batch size "
                f"{last.global_batch_size}; {_FIX}"
            )
    kept = [s for s in segs if s.epoch >= epoch - 1]
    return History(kept, dropped=history.dropped and len(kept) == len(segs))


def block(segment: Segment, step: int, rank: int, num_observations: int) -> tuple[int, int]:
    """The positions ``[start, stop)`` that ``rank`` read at ``step`` (within ``segment``),
    clipped to the epoch (a rank past the end of a final partial batch reads none)."""
    b = segment.local_batch_size
    base = segment.offset + (step - segment.step) * segment.global_batch_size + rank * b
    return min(base, num_observations), min(base + b, num_observations)
