"""A mixture's schedule: which source serves each position of its epoch, a pure function of
the position (a quota table, or a tree of two-way low-discrepancy splits), in exact 62-bit fixed
point. Pure arithmetic over the sources' lengths and weights (no dataset, no I/O); see
:mod:`guideloom._datasets.mixture` for the design."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

import numpy as np
import numpy.typing as npt

from guideloom._core.permutation import IndexArray

__all__ = ["MAX_SAMPLES", "Layout", "round_fix"]

_FIX: Final = 62  # bits of the fixed-point split fractions
_ONE_FIX: Final = 1 << _FIX
_HALF_FIX: Final = 1 << (_FIX - 1)
#: A mixture epoch has fewer positions than this (the schedule's fixed-point range).
MAX_SAMPLES: Final = _ONE_FIX
_M32: Final = np.uint64(0xFFFFFFFF)
_S32: Final = np.uint64(32)
_S62: Final = np.uint64(_FIX)
_U2: Final = np.uint64(2)
_HALF_U: Final = np.uint64(_HALF_FIX)
_MASK62: Final = np.uint64(_ONE_FIX - 1)
_ONE_U: Final = np.uint64(_ONE_FIX)


def _split(j: npt.NDArray[np.uint64], a: npt.NDArray[np.uint64]) -> tuple[IndexArray, npt.NDArray[np.bool_]]:
    """``r(j) = floor((j * a + 2^61) / 2^62)`` exactly, element-wise, for ``j, a < 2^62``, and
    whether ``r(j + 1) > r(j)`` (the node's ``j``-th position goes left).

    The product is four 32-bit limb products (each fits 64 bits) carried into a 128-bit
    ``high:low`` pair; ``r`` is its top bits and, with ``R`` its low 62 bits, ``r(j + 1) = r(j) +
    1`` exactly when ``R + a >= 2^62``.
    """
    jl, jh = j & _M32, j >> _S32
    al, ah = a & _M32, a >> _S32
    ll = jl * al
    mid = jl * ah + jh * al  # each < 2^62: the sum fits
    low = ll + ((mid & _M32) << _S32)
    high = jh * ah + (mid >> _S32) + (low < ll)
    low2 = low + _HALF_U
    high += low2 < low
    r: IndexArray = ((high << _U2) | (low2 >> _S62)).astype(np.int64)
    go_left: npt.NDArray[np.bool_] = (low2 & _MASK62) + a >= _ONE_U
    return r, go_left


def round_fix(j: npt.NDArray[np.uint64], a: npt.NDArray[np.uint64]) -> IndexArray:
    """``floor((j * a + 2^61) / 2^62)`` exactly (see :func:`_split`)."""
    return _split(j, a)[0]


#: A tree of sources: a leaf is a source's index, an inner node the pair of its children.
_Tree = int | tuple["_Tree", "_Tree"]
#: Up to this many sources every tree shape is tried (945 for six); above, a few constructions.
_EXHAUSTIVE_SOURCES: Final = 6
#: The longest table of the quota schedule: one period of exact-ratio weights, or a whole epoch
#: for other weights. Longer ones get the tree schedule: building a table costs about 1.2-2 us a
#: position, so 40-70 ms at most, once per mixture.
_PERIOD_MAX: Final = 1 << 15


def _huffman(w: Sequence[float]) -> _Tree:
    """The two lightest subtrees merged first (ties by creation order)."""
    heap: list[tuple[float, int, _Tree]] = [(x, i, i) for i, x in enumerate(w)]
    heapq.heapify(heap)
    tie = len(w)
    while len(heap) > 1:
        wa, _, a = heapq.heappop(heap)
        wb, _, b = heapq.heappop(heap)
        heapq.heappush(heap, (wa + wb, tie, (a, b)))
        tie += 1
    return heap[0][2]


def _halves(items: list[int], w: Sequence[float]) -> tuple[list[int], list[int]]:
    """Two groups of near-equal weight: Karmarkar-Karp differencing (largest first)."""
    heap = [(-w[i], n, [i], list[int]()) for n, i in enumerate(items)]
    heapq.heapify(heap)
    tie = len(items)
    while len(heap) > 1:
        da, _, a1, a2 = heapq.heappop(heap)
        db, _, b1, b2 = heapq.heappop(heap)
        heapq.heappush(heap, (da - db, tie, a1 + b2, a2 + b1))
        tie += 1
    return heap[0][2], heap[0][3]


def _top_down(w: Sequence[float]) -> _Tree:
    """Each set of sources split into two halves of near-equal weight, down to single sources."""
    done: dict[int, _Tree] = {}
    stack: list[tuple[int, list[int], bool]] = [(0, list(range(len(w))), False)]
    parts: dict[int, tuple[int, int]] = {}
    ids = 1
    while stack:  # iterative: a skewed mixture may nest deeply
        key, items, expanded = stack.pop()
        if len(items) == 1:
            done[key] = items[0]
        elif expanded:
            a, b = parts[key]
            done[key] = (done.pop(a), done.pop(b))
        else:
            first, second = _halves(items, w)
            parts[key] = (ids, ids + 1)
            stack += [(key, items, True), (ids, first, False), (ids + 1, second, False)]
            ids += 2
    return done[0]


def _all_trees(items: list[int]) -> Iterator[_Tree]:
    """Every binary tree over ``items`` (children unordered)."""
    if len(items) == 1:
        yield items[0]
        return
    first, rest = items[0], items[1:]
    for mask in range(2 ** len(rest) - 1):  # the first item's side takes the ones in the mask
        a = [first] + [x for k, x in enumerate(rest) if mask >> k & 1]
        b = [x for k, x in enumerate(rest) if not mask >> k & 1]
        for ta in _all_trees(a):
            for tb in _all_trees(b):
                yield (ta, tb)


def _children_first(tree: _Tree, w: Sequence[float]) -> tuple[list[tuple[_Tree, _Tree]], dict[int, float]]:
    """``tree``'s inner nodes, children before parents, and each one's weight (keyed by ``id``).
    Iterative: a skewed mixture may nest deeply."""
    order: list[tuple[_Tree, _Tree]] = []
    stack: list[_Tree] = [tree]
    while stack:
        t = stack.pop()
        if isinstance(t, tuple):
            order.append(t)
            stack += [t[0], t[1]]
    order.reverse()
    weight: dict[int, float] = {}
    for t in order:
        weight[id(t)] = sum(weight[id(c)] if isinstance(c, tuple) else w[c] for c in t)
    return order, weight


def _worst_bound(tree: _Tree, w: Sequence[float]) -> float:
    """The largest of the sources' prefix bounds ``1/2 (1 + w_s * sum of 1/W_a)`` over the inner
    nodes ``a`` between the root and the source (see the module docstring)."""
    _, weight = _children_first(tree, w)
    worst = 0.0
    walk: list[tuple[_Tree, float]] = [(tree, 0.0)]
    while walk:
        t, acc = walk.pop()
        if isinstance(t, int):
            worst = max(worst, 0.5 * (1.0 + w[t] * acc))
            continue
        below = acc if t is tree else acc + 1.0 / weight[id(t)]
        walk += [(t[0], below), (t[1], below)]
    return worst


def _best_tree(w: Sequence[float]) -> tuple[_Tree, bool]:
    """The tree whose worst prefix bound is least, and whether it is the Huffman tree: every
    shape for a few sources, else the better of the Huffman tree and the top-down halving (the
    Huffman tree on a tie, which all mixtures had before any other shape was tried)."""
    huffman = _huffman(w)
    if len(w) == 1:
        return huffman, True
    small = len(w) <= _EXHAUSTIVE_SOURCES
    others: Iterator[_Tree] = _all_trees(list(range(len(w)))) if small else iter([_top_down(w)])
    best, best_bound = huffman, _worst_bound(huffman, w)
    for t in others:
        b = _worst_bound(t, w)
        if b < best_bound - 1e-12:
            best, best_bound = t, b
    return best, best is huffman


def _flatten(
    tree: _Tree,
    w: Sequence[float],
    split: list[int],
    left: list[int],
    right: list[int],
    node_weight: list[float],
) -> int:
    """Append ``tree``'s inner nodes, children first, to the layout's arrays; the root's code
    (``-s - 1`` for a single source ``s``)."""
    if isinstance(tree, int):
        return -(tree + 1)
    code: dict[int, int] = {}
    order, weight = _children_first(tree, w)
    for t in order:
        a, b = t
        ca = code[id(a)] if isinstance(a, tuple) else -(a + 1)
        cb = code[id(b)] if isinstance(b, tuple) else -(b + 1)
        wa = weight[id(a)] if isinstance(a, tuple) else w[a]
        split.append(min(_ONE_FIX - 1, max(1, round(wa / weight[id(t)] * _ONE_FIX))))
        node_weight.append(weight[id(t)])
        left.append(ca)
        right.append(cb)
        code[id(t)] = len(split) - 1
    return code[id(tree)]


def _rational_shares(weights: Sequence[float]) -> list[int] | None:
    """Each weight's share as ``q_s / P`` in lowest terms, reading each weight as the decimal
    it prints as (``0.7`` is 7/10, ``3.0`` is 3), or ``None`` where ``P`` would exceed
    :data:`_PERIOD_MAX`."""
    fractions = [Fraction(repr(float(x))) for x in weights]
    total = sum(fractions, Fraction(0))
    shares = [f / total for f in fractions]
    period = math.lcm(*(s.denominator for s in shares))
    if period > _PERIOD_MAX:
        return None
    return [int(s * period) for s in shares]


def _exact_numerators(w: npt.NDArray[np.float64]) -> list[int]:
    """Integers proportional to the float weights ``w``, exactly (floats are dyadic rationals)."""
    fractions = [Fraction(float(x)) for x in w]
    scale = math.lcm(*(f.denominator for f in fractions))
    return [int(f * scale) for f in fractions]


def _quota_schedule(
    weights: Sequence[float], w: npt.NDArray[np.float64], tree_bound: float, num_samples: int
) -> tuple[list[int], int] | None:
    """Where a quota schedule's bound beats the tree's ``tree_bound``: the integers its weights
    are proportional to, and how many positions its table holds; else ``None``.

    - weights that print as short decimals or integers are exact ratios ``q_s / P``: a table of
      one period ``P`` (at most :data:`_PERIOD_MAX`) serves every epoch's positions;
    - other weights (ragged floats, sources' lengths as default weights), for an epoch of at
      most :data:`_PERIOD_MAX` positions: a table of the whole epoch, of the exact weights;
    - else the tree (a longer table costs more to build than a mixture may take to open).
    """
    k = len(w)
    if k < 2 or tree_bound <= 1.0 - 1.0 / (2 * k - 2) + 1e-12:  # Tijdeman's bound: no better
        return None
    exact = _rational_shares(weights)
    if exact is not None:
        return exact, sum(exact)
    if num_samples <= _PERIOD_MAX:
        return _exact_numerators(w), num_samples
    return None


def _quota_table(numerators: Sequence[int], horizon: int) -> npt.NDArray[np.int32]:
    """The first ``horizon`` positions of a schedule whose every prefix ``n`` holds each source
    ``s`` within ``D = 1 - 1/(2S - 2)`` of ``w_s n`` (Tijdeman's chairman-assignment bound, S
    sources, ``w_s = a_s / sum(a)`` for the integers ``a = numerators``).

    Each source's ``j``-th sample is a unit job that the bound allows at times ``t`` (1-based)
    with ``ceil((j - D) / w) <= t <= floor((j - 1 + D) / w) + 1``; Tijdeman proved a schedule
    meeting every window exists, and earliest deadline first finds one whenever one exists
    (unit jobs, integer windows). All in integers: the windows are exact. Where the weights are
    ``q_s / P`` and ``horizon = P``, every source has served exactly ``q_s`` at ``P`` and the
    table repeats.
    """
    k, total = len(numerators), sum(numerators)
    out = np.zeros(horizon, dtype=np.int32)
    if k == 1:
        return out
    den, num = 2 * k - 2, 2 * k - 3  # D = num / den

    def release(s: int, j: int) -> int:
        return -(-((j * den - num) * total) // (numerators[s] * den))

    def deadline(s: int, j: int) -> int:
        return ((j - 1) * den + num) * total // (numerators[s] * den) + 1

    calendar: list[list[int]] = [[] for _ in range(horizon + 2)]
    for s in range(k):
        if numerators[s] > 0 and (r := release(s, 1)) <= horizon:
            calendar[r].append(s)
    ready: list[tuple[int, int]] = []
    served = [0] * k
    for t in range(1, horizon + 1):
        for s in calendar[t]:
            heapq.heappush(ready, (deadline(s, served[s] + 1), s))
        if not ready or ready[0][0] < t:
            raise AssertionError(f"guideloom bug: no quota schedule found for {list(numerators)}")
        _, s = heapq.heappop(ready)
        out[t - 1] = s
        served[s] += 1
        if (r := max(release(s, served[s] + 1), t + 1)) <= horizon:
            calendar[r].append(s)
    return out


def _table_deviation(table: npt.NDArray[np.int32], w: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Each source's largest ``|k_s(n) - w_s n|`` over the prefixes ``n`` of ``table`` (the
    largest overall for a period's table: its deviation repeats)."""
    h, k = len(table), len(w)
    counts = np.bincount(table, minlength=k)
    order = np.argsort(table, kind="stable")  # each source's times, in order
    times = order.astype(np.float64) + 1
    src = table[order].astype(np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    j = (np.arange(h, dtype=np.int64) - first[src] + 1).astype(np.float64)  # the j-th, at t_j
    worst = np.abs(w * h - counts)  # after the last: k = counts at h
    np.maximum.at(worst, src, np.maximum(j - w[src] * times, w[src] * (times - 1) - (j - 1)))
    return worst


@dataclass(frozen=True, slots=True)
class Layout:
    """What a mixture's order is computed from, fixed once its sources' lengths are known.

    The tree: inner node ``i`` splits by ``split[i] / 2^62`` (the left child's share); a child
    code ``>= 0`` is an inner node, ``< 0`` the leaf of source ``-code - 1``.
    """

    lengths: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]  # len(sources) + 1 entries
    weights: npt.NDArray[np.float64]  # normalised
    num_samples: int
    split: npt.NDArray[np.uint64]
    split_int: tuple[int, ...]
    left: npt.NDArray[np.int64]
    right: npt.NDArray[np.int64]
    root: int
    per_epoch: npt.NDArray[np.int64]  # each source's samples in one mixture epoch
    bounds: npt.NDArray[np.float64]  # each source's proven prefix discrepancy bound
    shape: str  # the schedule where it is not the Huffman tree ("" where it is): part of the digest
    # the quota schedule (``None`` under a tree): each period position's source, its index
    # among that source's positions of the period, and each source's positions a period
    period: npt.NDArray[np.int32] | None = None
    period_rank: npt.NDArray[np.int64] | None = None
    quota: npt.NDArray[np.int64] | None = None

    @staticmethod
    def build(lengths: Sequence[int], weights: Sequence[float], num_samples: int) -> Layout:
        n_src = len(lengths)
        w = np.asarray(weights, dtype=np.float64)
        if not math.isfinite(sum(w.tolist())):  # weights near the float limit: their sum overflows
            w = w / w.max()
        w = w / w.sum()
        split: list[int] = []
        left: list[int] = []
        right: list[int] = []
        node_weight: list[float] = []
        wl = [float(x) for x in w]
        tree, is_huffman = _best_tree(wl)
        root = _flatten(tree, wl, split, left, right, node_weight)
        per_epoch = np.zeros(n_src, dtype=np.int64)
        inverse_weights = np.zeros(n_src, dtype=np.float64)  # sum of 1/W_a, inner a below the root
        stack: list[tuple[int, int, float]] = [(root, num_samples, 0.0)]
        while stack:  # one walk from the root: each source's count of num_samples, and its sum
            code, count, acc = stack.pop()
            if code < 0:
                per_epoch[-code - 1] = count
                inverse_weights[-code - 1] = acc
                continue
            lc = (count * split[code] + _HALF_FIX) >> _FIX
            below = acc if code == root else acc + 1.0 / node_weight[code]
            stack.append((left[code], lc, below))
            stack.append((right[code], count - lc, below))
        bounds = 0.5 * (1.0 + w * inverse_weights)
        quota = _quota_schedule(weights, w, float(bounds.max()), num_samples)
        if quota is not None:
            return Layout._quota(lengths, w, quota[0], quota[1], num_samples)
        lengths_a = np.asarray(lengths, dtype=np.int64)
        return Layout(
            lengths=lengths_a,
            offsets=np.concatenate([[0], np.cumsum(lengths_a)]).astype(np.int64),
            weights=w,
            num_samples=num_samples,
            split=np.asarray(split, dtype=np.uint64),
            split_int=tuple(split),
            left=np.asarray(left, dtype=np.int64),
            right=np.asarray(right, dtype=np.int64),
            root=root,
            per_epoch=per_epoch,
            bounds=bounds,
            shape="" if is_huffman else repr(tree),
        )

    @staticmethod
    def _quota(
        lengths: Sequence[int],
        w: npt.NDArray[np.float64],
        numerators: list[int],
        horizon: int,
        num_samples: int,
    ) -> Layout:
        """The layout of a quota schedule's table (see :func:`_quota_table`)."""
        table = _quota_table(numerators, horizon)
        quota = np.bincount(table, minlength=len(lengths)).astype(np.int64)
        order = np.argsort(table, kind="stable")
        first = np.concatenate([[0], np.cumsum(quota)[:-1]])
        rank = np.empty(horizon, dtype=np.int64)
        rank[order] = np.arange(horizon, dtype=np.int64) - first[table[order]]
        lengths_a = np.asarray(lengths, dtype=np.int64)
        none = np.zeros(0, dtype=np.int64)
        layout = Layout(
            lengths=lengths_a,
            offsets=np.concatenate([[0], np.cumsum(lengths_a)]).astype(np.int64),
            weights=w,
            num_samples=num_samples,
            split=np.zeros(0, dtype=np.uint64),
            split_int=(),
            left=none,
            right=none,
            root=0,
            per_epoch=none,
            bounds=_table_deviation(table, w),
            shape=f"quota:{horizon}" if horizon != num_samples else f"quota-epoch:{horizon}",
            period=table,
            period_rank=rank,
            quota=quota,
        )
        return dataclasses.replace(layout, per_epoch=layout.counts(num_samples))

    def counts(self, n: int) -> npt.NDArray[np.int64]:
        """``k_s(n)`` for every source: its samples among the epoch's first ``n`` positions."""
        if self.period is not None and self.quota is not None:
            whole, part = divmod(n, len(self.period))
            return whole * self.quota + np.bincount(self.period[:part], minlength=len(self.lengths))
        out = np.zeros(len(self.lengths), dtype=np.int64)
        stack = [(self.root, n)]
        while stack:
            code, count = stack.pop()
            if code < 0:
                out[-code - 1] = count
                continue
            lc = (count * self.split_int[code] + _HALF_FIX) >> _FIX
            stack.append((int(self.left[code]), lc))
            stack.append((int(self.right[code]), count - lc))
        return out

    def locate(self, positions: IndexArray) -> tuple[IndexArray, IndexArray]:
        """For each epoch position: its source and ``k_s(p)``, the source's earlier positions."""
        if self.period is not None and self.quota is not None and self.period_rank is not None:
            whole, part = np.divmod(positions.astype(np.int64), len(self.period))
            src = self.period[part].astype(np.int64)
            return src, whole * self.quota[src] + self.period_rank[part]
        if self.root < 0:  # one source
            return np.full(positions.shape, -self.root - 1, dtype=np.int64), positions.astype(np.int64)
        out_src = np.empty(positions.shape, dtype=np.int64)
        out_local = np.empty(positions.shape, dtype=np.int64)
        where = np.arange(positions.size)
        node = np.full(positions.shape, self.root, dtype=np.int64)
        j = positions.astype(np.uint64)
        while where.size:  # one tree level per pass, over the positions not yet at a leaf
            a = self.split[node]
            r, go_left = _split(j, a)
            j = np.where(go_left, r.astype(np.uint64), j - r.astype(np.uint64))
            child = np.where(go_left, self.left[node], self.right[node])
            leaf = child < 0
            if leaf.any():
                done = where[leaf]
                out_src[done] = -child[leaf] - 1
                out_local[done] = j[leaf]
                keep = ~leaf
                where, node, j = where[keep], child[keep], j[keep]
            else:
                node = child
        return out_src, out_local
