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
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["History", "Segment", "block", "parse_history"]

#: Segments a history keeps: the current epoch's and the one before it. Each is a few ints; a job
#: changes its geometry a handful of times an epoch, so this never binds in practice, and the
#: oldest epoch is dropped first when it does.
MAX_SEGMENTS = 256


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

    __slots__ = ("segments",)

    def __init__(self, segments: Sequence[Segment] = ()) -> None:
        self.segments: list[Segment] = list(segments)

    def __repr__(self) -> str:
        return f"History({self.segments!r})"

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
        mine = self.of_epoch(epoch)
        if mine and (mine[-1].local_batch_size, mine[-1].world_size) == (local_batch_size, world_size):
            last = mine[-1]
            if (offset - last.offset) % last.global_batch_size == 0 and offset >= last.offset:
                return
        # a segment that begins where a later one began replaces the ones from there on (a
        # checkpoint loaded again, a rollback)
        self.segments = [s for s in self.segments if s.epoch != epoch or s.offset < offset]
        step = self.steps_at(epoch, offset, (local_batch_size, world_size))
        self.segments.append(Segment(epoch, offset, step, local_batch_size, world_size))
        while len(self.segments) > MAX_SEGMENTS:
            self.segments.pop(0)

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
        its length, where a list would take the shape of the loading side's)."""
        return ";".join(":".join(str(v) for v in s) for s in self.segments)


def parse_history(text: object) -> History:
    """A history from :meth:`History.encode`'s string; ``ValueError`` naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError(
            f"checkpoint 'history' must be a str, got {type(text).__name__}; pass a dict returned by "
            "StatefulDataLoader.state_dict()"
        )
    segments: list[Segment] = []
    for part in filter(None, text.split(";")):
        fields = part.split(":")
        try:
            values = [int(v) for v in fields]
        except ValueError:
            values = []
        if len(values) != 5 or min(values) < 0 or values[3] < 1 or values[4] < 1:
            raise ValueError(
                f"checkpoint 'history' holds {part[:40]!r}, not 'epoch:offset:step:batch:world' "
                "ints; pass a dict returned by StatefulDataLoader.state_dict()"
            )
        segments.append(Segment(*values))
    keys = [(s.epoch, s.offset) for s in segments]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise ValueError("checkpoint 'history' is not in order of (epoch, offset): it is damaged")
    return History(segments)


def block(segment: Segment, step: int, rank: int, num_observations: int) -> tuple[int, int]:
    """The positions ``[start, stop)`` that ``rank`` read at ``step`` (within ``segment``),
    clipped to the epoch (a rank past the end of a final partial batch reads none)."""
    b = segment.local_batch_size
    base = segment.offset + (step - segment.step) * segment.global_batch_size + rank * b
    return min(base, num_observations), min(base + b, num_observations)
