"""Mixture weights that change with training progress: :class:`WeightSchedule` and the layout
that serves it, still O(1) per position (O(log pieces) to find a position's piece).

Progress is the mixture's *global position* ``P = epoch * len(mixture) + position``: the samples
the mixture has served since the run began, whatever the batch size or world size (so a resume on
another geometry draws exactly what the run would have). The schedule is a list of knots
``(P_i, weights_i)``, the first at 0:

- ``interpolation="constant"``: ``weights_i`` holds on ``[P_i, P_{i+1})``, the last knot's from it
  on. Each piece is served by the constant schedule of :mod:`guideloom._core.mixture` over its own positions
  ``q = P - P_i``, so within a piece every prefix holds each source within that schedule's bound
  of ``w_s q``.
- ``interpolation="linear"``: the weights move linearly from ``weights_i`` at ``P_i`` to
  ``weights_{i+1}`` at ``P_{i+1}`` (a *ramp*), and hold the last knot's from it on. A ramp of
  ``L`` positions is a two-way mixture of the constant schedules ``A`` (``weights_i``) and ``B``
  (``weights_{i+1}``) whose share of ``B`` grows as ``q / L``: position ``q`` is ``B``'s when
  ``round(F(q + 1)) > round(F(q))``, ``F(q) = q^2 / (2L)`` (exact integers), so ``B`` has served
  ``round(F(q))`` of the first ``q``, within 1/2 of its integral. ``A`` and ``B`` then pick the
  source as constant schedules do. Source ``s``'s count is off the integral of its weight by at
  most ``D_A + D_B + |w_B - w_A| / 2`` (each schedule's bound, plus the rounding of the split,
  scaled by how much the source's weight differs between them).

Why these two: a piecewise constant schedule is what curricula and annealing phases state, and a
linear ramp between them is what avoids a jump in the loss; both keep an exact integer count of
each source at any position in O(1), which any other curve would need a numeric inverse for.

At a piece's end the counts are off the integral by an exact amount (0 where the piece's length
is a multiple of its quota table's period); the next piece starts from there, so the bound of a
piece is its own plus the sum of the earlier pieces' end deviations, each source's computed when
the layout is built (:attr:`ScheduledLayout.bounds`).

Pure arithmetic, like :mod:`guideloom._core.mixture`: no dataset, no I/O.

A source whose weight is 0 in a piece (at both ends of a ramp) draws nothing there: each
constant schedule is that of the sources of positive weight (:class:`_Subset`), and a source's
bound in it is 0, so the bounds above hold as they are.

Each source still reads its own samples in its own seeded order: a piece's (and a ramp's ``A``
and ``B``'s) draws of a source take the next consecutive counts of the source's stream, so no
sample repeats within one of the source's own epochs; within a ramp, ``B``'s draws of a source
come after ``A``'s in that stream.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from guideloom._core.mixture import _PERIOD_MAX, MAX_SAMPLES, Layout
from guideloom._core.permutation import IndexArray

__all__ = ["ScheduledLayout", "WeightSchedule", "check_schedule_names"]

Interpolation = Literal["constant", "linear"]
_INTERPOLATIONS = ("constant", "linear")


class WeightSchedule:
    """Mixture weights as a function of training progress, for :func:`guideloom.mix`'s
    ``weights``.

    Args:
        knots: ``(position, weights)`` pairs: the mixture's global position (samples it served
            since the run began, across epochs) and the weights from there, each a dict of
            source name to weight (normalised, as :func:`~guideloom.mix`'s). The first knot is
            at position 0; positions increase. A weight may be 0 (the source draws nothing
            where its weight is 0); every knot gives some source a weight above 0.
        interpolation: ``"constant"`` (each knot's weights hold until the next) or
            ``"linear"`` (the weights move linearly between knots); after the last knot its
            weights hold.

    Examples:
        >>> import guideloom as gl
        >>> warmup = gl.WeightSchedule(
        ...     [(0, {"web": 0.9, "code": 0.1}), (10_000, {"web": 0.6, "code": 0.4})],
        ...     interpolation="linear",
        ... )
        >>> warmup.weights_at(5_000)
        {'web': 0.75, 'code': 0.25}
    """

    def __init__(
        self, knots: Sequence[tuple[int, Mapping[str, float]]], *, interpolation: Interpolation = "constant"
    ) -> None:
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation must be 'constant' or 'linear', got {interpolation!r}")
        if not isinstance(knots, Sequence) or not knots:
            raise TypeError("knots must be a non-empty list of (position, {source: weight}) pairs")
        positions: list[int] = []
        weights: list[dict[str, float]] = []
        for knot in knots:
            if not isinstance(knot, tuple | list) or len(knot) != 2:
                raise TypeError(f"each knot must be a (position, {{source: weight}}) pair, got {knot!r}")
            p, w = knot
            if isinstance(p, bool) or not isinstance(p, int | np.integer) or not 0 <= p < MAX_SAMPLES:
                raise ValueError(f"a knot's position must be an int in [0, 2**62), got {p!r}")
            if not isinstance(w, Mapping):
                raise TypeError(f"a knot's weights must be a dict of source name to weight, got {w!r}")
            positions.append(int(p))
            weights.append({name: _weight(name, x, int(p)) for name, x in w.items()})
        if positions[0] != 0:
            raise ValueError(f"the first knot must be at position 0, got {positions[0]}")
        if any(b <= a for a, b in itertools.pairwise(positions)):
            raise ValueError(f"knot positions must increase, got {positions}")
        for p, w in zip(positions, weights, strict=True):
            if not any(x > 0 for x in w.values()):
                raise ValueError(
                    f"the knot at position {p} gives every source a weight of 0: at least one source "
                    "must have a weight > 0 at every position"
                )
        names = set(weights[0])
        for w in weights[1:]:
            if set(w) != names:
                raise ValueError(f"every knot must weight the same sources: {sorted(names)} vs {sorted(w)}")
        self.positions: tuple[int, ...] = tuple(positions)
        self.weights: tuple[dict[str, float], ...] = tuple(weights)
        self.interpolation: Interpolation = interpolation

    def _key(self) -> tuple[object, ...]:
        return (self.interpolation, self.positions, tuple(tuple(w.items()) for w in self.weights))

    def __eq__(self, other: object) -> bool:
        """Two schedules of the same knots (positions, weights by name in the same order) and
        interpolation are equal: they draw the same samples."""
        if not isinstance(other, WeightSchedule):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        knots = ", ".join(f"({p}, {w!r})" for p, w in zip(self.positions, self.weights, strict=True))
        return f"WeightSchedule([{knots}], interpolation={self.interpolation!r})"

    def weights_at(self, position: int) -> dict[str, float]:
        """The weights in force at global ``position`` (as given: not normalised)."""
        i = bisect.bisect_right(self.positions, position) - 1
        if self.interpolation == "constant" or i == len(self.positions) - 1:
            return dict(self.weights[i])
        a, b = self.positions[i], self.positions[i + 1]
        t = (position - a) / (b - a)
        return {k: (1 - t) * v + t * self.weights[i + 1][k] for k, v in self.weights[i].items()}


def _weight(name: object, x: object, position: int) -> float:
    """A knot's weight of source ``name``: a finite number >= 0 (0: the source draws nothing)."""
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(
            f"the weight of {name!r} at position {position} must be a number, got {type(x).__name__}"
        )
    value = float(x)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"the weight of {name!r} at position {position} must be finite and >= 0 (0: the source "
            f"draws nothing there), got {x!r}"
        )
    return value


def _ramp_split(q: IndexArray, length: int) -> IndexArray:
    """``round(q^2 / (2 length))`` exactly: ``B``'s share of a ramp's first ``q`` positions."""
    if len(q) == 0 or int(q.max()) < (1 << 31):
        return (q * q + length) // (2 * length)
    return np.asarray([(int(x) * int(x) + length) // (2 * length) for x in q.tolist()], dtype=np.int64)


class _Constant(Protocol):
    """A constant schedule over a piece's positions (:class:`Layout`, or :class:`_Subset`)."""

    @property
    def bounds(self) -> npt.NDArray[np.float64]: ...

    def counts(self, n: int) -> npt.NDArray[np.int64]: ...

    def locate(self, positions: IndexArray) -> tuple[IndexArray, IndexArray]: ...


@dataclass(frozen=True, slots=True)
class _Subset:
    """The constant schedule of weights some of which are 0: the schedule of the sources of
    positive weight, whose indices ``index`` maps back; a source of weight 0 draws nothing, so
    its count is exactly its integral (0) and its bound 0."""

    layout: Layout
    index: IndexArray
    n_src: int

    @property
    def bounds(self) -> npt.NDArray[np.float64]:
        out = np.zeros(self.n_src, dtype=np.float64)
        out[self.index] = self.layout.bounds
        return out

    def counts(self, n: int) -> npt.NDArray[np.int64]:
        out = np.zeros(self.n_src, dtype=np.int64)
        out[self.index] = self.layout.counts(n)
        return out

    def locate(self, positions: IndexArray) -> tuple[IndexArray, IndexArray]:
        src, local = self.layout.locate(positions)
        return self.index[src], local


def _constant(lengths: Sequence[int], weights: Sequence[float], horizon: int) -> _Constant:
    """The constant schedule of ``weights``: a :class:`Layout`, or where some are 0 the
    :class:`Layout` of the others."""
    if all(w > 0 for w in weights):
        return Layout.build(lengths, weights, horizon)
    index = np.flatnonzero(np.asarray(weights) > 0).astype(np.int64)
    kept = index.tolist()
    sub = Layout.build([lengths[i] for i in kept], [weights[i] for i in kept], horizon)
    return _Subset(sub, index, len(weights))


@dataclass(frozen=True, slots=True)
class _Piece:
    start: int
    length: int  # MAX_SAMPLES for the last piece
    a: _Constant
    b: _Constant | None  # a ramp's target schedule
    base: npt.NDArray[np.int64]  # each source's count before the piece
    a_total: npt.NDArray[np.int64]  # a ramp: each source's draws by ``a`` over the whole ramp


@dataclass(frozen=True, slots=True)
class ScheduledLayout:
    """What a scheduled mixture's order is computed from (see the module docstring)."""

    pieces: tuple[_Piece, ...]
    starts: tuple[int, ...]
    bounds: npt.NDArray[np.float64]
    """Each source's bound on ``|count among the first P positions - integral of its weight|``,
    over every ``P``."""
    knot_weights: tuple[npt.NDArray[np.float64], ...]
    schedule: WeightSchedule

    @staticmethod
    def build(lengths: Sequence[int], schedule: WeightSchedule, names: Sequence[str]) -> ScheduledLayout:
        n_src = len(lengths)
        vectors = [np.asarray([w[n] for n in names], dtype=np.float64) for w in schedule.weights]
        vectors = [v / v.sum() for v in vectors]
        layouts: dict[tuple[float, ...], _Constant] = {}

        def layout(i: int, span: int) -> _Constant:
            # a table of a whole piece (ragged weights, a piece of at most 2^15 positions) is
            # that piece's alone: repeated, its end deviation would add up
            horizon = span if span <= _PERIOD_MAX else MAX_SAMPLES - 1
            key = (*vectors[i].tolist(), float(horizon if span <= _PERIOD_MAX else 0))
            if key not in layouts:
                raw = [schedule.weights[i][n] for n in names]
                layouts[key] = _constant(lengths, raw, horizon)
            return layouts[key]

        pieces: list[_Piece] = []
        base = np.zeros(n_src, dtype=np.int64)
        drift = np.zeros(n_src, dtype=np.float64)  # counts less the integral, at the piece's start
        bounds = np.zeros(n_src, dtype=np.float64)
        knots = schedule.positions
        linear = schedule.interpolation == "linear"
        for i, start in enumerate(knots):
            last = i == len(knots) - 1
            length = MAX_SAMPLES - start if last else knots[i + 1] - start
            a = layout(i, length)
            ramp = linear and not last and not np.array_equal(vectors[i], vectors[i + 1])
            b = layout(i + 1, length) if ramp else None
            own = a.bounds.copy()
            a_total = np.zeros(n_src, dtype=np.int64)
            if b is not None:
                kb = int(_ramp_split(np.asarray([length], dtype=np.int64), length)[0])
                a_total = a.counts(length - kb)
                own = a.bounds + b.bounds + np.abs(vectors[i + 1] - vectors[i]) / 2
            bounds = np.maximum(bounds, own + np.abs(drift))
            pieces.append(_Piece(start, length, a, b, base.copy(), a_total))
            if not last:
                end = a_total + b.counts(kb) if b is not None else a.counts(length)
                integral = (
                    (vectors[i] + vectors[i + 1]) / 2 * length if b is not None else vectors[i] * length
                )
                drift = drift + (end - integral)
                base = base + end
        return ScheduledLayout(tuple(pieces), tuple(knots), bounds, tuple(vectors), schedule)

    def _piece(self, position: int) -> _Piece:
        return self.pieces[bisect.bisect_right(self.starts, position) - 1]

    def locate(self, positions: IndexArray) -> tuple[IndexArray, IndexArray]:
        """For each global position: its source and the source's count before it (where in the
        source's stream of samples it reads)."""
        positions = np.asarray(positions, dtype=np.int64)
        src = np.empty(positions.shape, dtype=np.int64)
        cum = np.empty(positions.shape, dtype=np.int64)
        which = np.searchsorted(np.asarray(self.starts, dtype=np.int64), positions, side="right") - 1
        for j in np.unique(which).tolist():
            sel = np.flatnonzero(which == j)
            piece = self.pieces[j]
            q = positions[sel] - piece.start
            if piece.b is None:
                s, local = piece.a.locate(q)
                src[sel], cum[sel] = s, piece.base[s] + local
                continue
            kb = _ramp_split(q, piece.length)
            is_b = _ramp_split(q + 1, piece.length) > kb
            ia, ib = sel[~is_b], sel[is_b]
            s, local = piece.a.locate((q - kb)[~is_b])
            src[ia], cum[ia] = s, piece.base[s] + local
            s, local = piece.b.locate(kb[is_b])
            src[ib], cum[ib] = s, piece.base[s] + piece.a_total[s] + local
        return src, cum

    def counts(self, position: int) -> npt.NDArray[np.int64]:
        """Each source's samples among the first ``position`` global positions."""
        piece = self._piece(position)
        q = position - piece.start
        if piece.b is None:
            return piece.base + piece.a.counts(q)
        kb = int(_ramp_split(np.asarray([q], dtype=np.int64), piece.length)[0])
        return piece.base + piece.a.counts(q - kb) + piece.b.counts(kb)

    def integral(self, position: int) -> npt.NDArray[np.float64]:
        """Each source's weight integrated over the first ``position`` global positions."""
        total = np.zeros(len(self.knot_weights[0]), dtype=np.float64)
        linear = self.schedule.interpolation == "linear"
        for i, piece in enumerate(self.pieces):
            if position <= piece.start:
                break
            span = min(position, piece.start + piece.length) - piece.start
            w = self.knot_weights[i]
            if linear and piece.b is not None:
                slope = (self.knot_weights[i + 1] - w) / piece.length
                total += w * span + slope * span * span / 2
            else:
                total += w * span
        return total

    def weights_at(self, position: int) -> npt.NDArray[np.float64]:
        """The normalised weights in force at global ``position``."""
        i = bisect.bisect_right(self.starts, position) - 1
        w = self.knot_weights[i]
        piece = self.pieces[i]
        if piece.b is None:
            return w
        t = (position - piece.start) / piece.length
        return (1 - t) * w + t * self.knot_weights[i + 1]

    def describe(self) -> str:
        """The schedule as the mixture's digest records it."""
        knots = ";".join(
            f"{p}:" + ",".join(repr(x) for x in w.tolist())
            for p, w in zip(self.starts, self.knot_weights, strict=True)
        )
        return f"schedule:{self.schedule.interpolation}:{knots}"


def check_schedule_names(schedule: WeightSchedule, names: Sequence[str]) -> None:
    """Refuse a schedule that does not weight exactly the mixture's sources, or a weight that is
    not finite and >= 0 (the schedule checks its weights when made; this holds for one whose
    knots were changed since)."""
    for w in schedule.weights:
        if set(w) != set(names):
            missing, extra = set(names) - set(w), set(w) - set(names)
            raise ValueError(
                f"the schedule's weights must name every source once: missing {sorted(missing)}, "
                f"unknown {sorted(extra)}"
            )
        for name, x in w.items():
            if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
                raise TypeError(f"weight of {name!r} must be a number, got {type(x).__name__}")
            if not math.isfinite(float(x)) or float(x) < 0:
                raise ValueError(f"weight of {name!r} must be finite and >= 0, got {x!r}")
        if not any(float(x) > 0 for x in w.values()):
            raise ValueError("at least one source must have a weight > 0 at every knot")
