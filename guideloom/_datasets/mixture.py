"""Weighted mixtures of datasets: ``mix({"web": a, "code": b}, weights={"web": 0.7, "code": 0.3})``.

A mixture is a dataset whose epoch order is a pure function of ``(shuffle, seed, epoch,
position)``, computed in O(1) per position from a table of at most 2^15 entries, or in O(log S)
for S sources (O(S) for skewed weights, see below) where no table fits, with no blend index of
the epoch: opening a mixture of a thousand sources, or resuming it
at position 10^9, costs what a lookup costs.

The order is made in three steps:

1. **The schedule**: which source serves mixture position ``p``, one of two kinds.

   - **A quota table**, where one fits in :data:`_PERIOD_MAX` positions: weights that print as
     short decimals or integers (``0.7``, ``0.15``, ``3``) are exact ratios ``q_s / P`` and the
     table holds one period ``P`` of a schedule that repeats; other weights get a table of the
     whole epoch where the epoch is that short. The table is built once by earliest deadline
     first over the windows that Tijdeman's chairman-assignment bound allows each sample, so
     every prefix holds each source within ``1 - 1/(2S - 2)`` of ``w_s n`` (S sources),
     whatever the weights and however many sources. A lookup is ``p mod P`` into the table,
     and ``k_s(p)`` is ``(p // P) * q_s`` plus the sample's rank in the period.
   - **A tree** otherwise (ragged floats, or the sources' lengths as default weights, in an
     epoch longer than a table), and wherever its bound is already as good: the sources are
     the leaves of a binary tree chosen for the least worst bound below: for up to six sources
     every tree shape is tried, for more the Huffman code's tree (the two lightest subtrees
     merged first) or a top-down halving into near-equal weights, the Huffman tree on a tie.
     Each inner node splits the positions that reach it between its two children by a two-way
     low-discrepancy (Sturmian) rule: the node's ``j``-th position goes left iff ``r(j + 1) >
     r(j)``, with ``r(j) = round(j * f)`` and ``f`` the left child's share of the node's
     weight, so the left child holds exactly ``r(j)`` of the node's first ``j`` positions. A
     lookup walks from the root to a leaf, carrying the index among each node's positions; at
     the leaf it is ``k_s(p)``, how many earlier positions the source served.

   The schedule is the same every epoch and does not depend on the seed.
2. **Each source's own stream**: the source's ``c``-th sample of the whole run, ``c = epoch *
   k_s(M) + k_s(p)`` (``M`` the mixture epoch's length, ``k_s(M)`` the source's samples per
   mixture epoch), is sample ``c mod len(source)`` of the source's own epoch ``c //
   len(source)``, through the source's permutation of that epoch: the Feistel network of the
   loader's :class:`~guideloom._core.plan.Permutation`, its round keys derived from the loader's
   seed, the source's name and the source epoch (splitmix64 of a per-source hash, so a window
   touching thousands of source epochs costs a few numpy operations, not a hash each), or the
   source's own ``order()`` where it makes one. A source smaller than its share thus repeats,
   each pass in a fresh order, and no sample repeats within one of its own epochs.
3. **Keys**: position ``p`` maps to ``offset(s) + index``, ``offset(s)`` the sum of the earlier
   sources' lengths; :meth:`Mixture.read_many` decodes keys and reads each source once, with one
   batched call, concurrently.

Under a tree, every prefix of ``n`` positions holds ``k_s(n)`` samples of source ``s`` with
``|k_s(n) - w_s n| <= 1/2 (1 + sum over inner nodes a between the root and the leaf of w_s /
W_a)`` (each split's rounding error is at most 1/2 and is scaled by the share of the node the
leaf holds). That is 1/2 for two sources and within 1 for even weights (up to 1,000 sources) and
for most mixtures of a few sources, but it can pass 1 for ragged weights from four sources on
(up to about 1.5 over many): where it does, a quota table is used if one fits, and +-1 is not
guaranteed for ragged float weights in epochs longer than a table.
:attr:`Mixture.discrepancy_bounds` gives the bound of each source of a mixture (under a quota
table, the largest deviation the table reaches, computed when it is built).

The split fractions are held as exact 62-bit fixed-point integers and ``r(j)`` is computed with
128-bit integer arithmetic (four 32-bit limbs): the schedule is the same on every platform and
exact for any position below 2^62, where a float rounding near ``f = 1`` could step ``r`` by two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_bool, check_int
from guideloom._core.keys import GOLDEN, MIX1, MIX2, ROUNDS, hash64, splitmix
from guideloom._core.permutation import IndexArray, Permutation
from guideloom._datasets.base import DatasetAbstract
from guideloom._datasets.documents import DocumentDataset
from guideloom._datasets.stream import StreamDataset
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract
from guideloom.types import DatasetFingerprint

if TYPE_CHECKING:
    from guideloom._core.order import Order

__all__ = ["Mixture", "MixtureOrder", "mix"]

_FIX: Final = 62  # bits of the fixed-point split fractions
_ONE_FIX: Final = 1 << _FIX
_HALF_FIX: Final = 1 << (_FIX - 1)
_M32: Final = np.uint64(0xFFFFFFFF)
_S32: Final = np.uint64(32)
_S62: Final = np.uint64(_FIX)
_U2: Final = np.uint64(2)
_HALF_U: Final = np.uint64(_HALF_FIX)
_MASK62: Final = np.uint64(_ONE_FIX - 1)
_ONE_U: Final = np.uint64(_ONE_FIX)
_MIX1: Final = np.uint64(MIX1)
_MIX2: Final = np.uint64(MIX2)
_GOLDEN: Final = np.uint64(GOLDEN)
_S31, _S29 = np.uint64(31), np.uint64(29)
_ROUND_OFFSETS: Final = np.asarray(
    [((r + 1) * GOLDEN) & ((1 << 64) - 1) for r in range(ROUNDS)], dtype=np.uint64
)
_ORDER_CACHE: Final = 4096  # (source, source epoch) orders a MixtureOrder keeps


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


def _round_fix(j: npt.NDArray[np.uint64], a: npt.NDArray[np.uint64]) -> IndexArray:
    """``floor((j * a + 2^61) / 2^62)`` exactly (see :func:`_split`)."""
    return _split(j, a)[0]


def _epoch_keys(
    source_keys: npt.NDArray[np.uint64], epochs: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint64]:
    """The Feistel round keys of source epochs, shape ``(rounds, len)``: splitmix64 of the
    source's key and the epoch, then of that and the round (independent keys per source epoch
    without a hash call each: a thousand sources' epochs cost a few numpy operations)."""
    base = splitmix(source_keys ^ splitmix(epochs * _GOLDEN + _GOLDEN, inplace=True), inplace=True)
    return splitmix(base[None, :] + _ROUND_OFFSETS[:, None], inplace=True)


class _KeyedPermutation(Permutation):
    """:class:`~guideloom._core.plan.Permutation` with given round keys: one source epoch's order, as
    :class:`MixtureOrder` computes it vectorised (the scalar reference of the tests)."""

    def __init__(self, n: int, keys: Sequence[int]) -> None:
        super().__init__(n, shuffle=True, seed=0, epoch=0)
        self._keys = tuple(int(k) for k in keys)
        self._keys_np = tuple(np.uint64(k) for k in self._keys)


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
class _Layout:
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
    def build(lengths: Sequence[int], weights: Sequence[float], num_samples: int) -> _Layout:
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
            return _Layout._quota(lengths, w, quota[0], quota[1], num_samples)
        lengths_a = np.asarray(lengths, dtype=np.int64)
        return _Layout(
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
    ) -> _Layout:
        """The layout of a quota schedule's table (see :func:`_quota_table`)."""
        table = _quota_table(numerators, horizon)
        quota = np.bincount(table, minlength=len(lengths)).astype(np.int64)
        order = np.argsort(table, kind="stable")
        first = np.concatenate([[0], np.cumsum(quota)[:-1]])
        rank = np.empty(horizon, dtype=np.int64)
        rank[order] = np.arange(horizon, dtype=np.int64) - first[table[order]]
        lengths_a = np.asarray(lengths, dtype=np.int64)
        none = np.zeros(0, dtype=np.int64)
        layout = _Layout(
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


def _feistel(
    x: npt.NDArray[np.uint64],
    h: npt.NDArray[np.uint64],
    mask: npt.NDArray[np.uint64],
    keys: npt.NDArray[np.uint64],
) -> npt.NDArray[np.uint64]:
    """:class:`~guideloom._core.plan.Permutation`'s Feistel rounds with per-element widths and keys,
    so positions of many (source, epoch) permutations go through one vectorised pass."""
    left, right = x >> h, x & mask
    for k in keys:
        z = (right ^ k) * _MIX1
        z ^= z >> _S31
        z *= _MIX2
        z ^= z >> _S29
        left, right = right, left ^ (z & mask)
    return (left << h) | right


class _SourceKeys:
    """Each source's permutation key for a seed, from hashes of the sources' names.

    Part of the order, not of the dataset: it depends on the names and the seed alone, so it is
    kept apart from :class:`Mixture`'s sources and caches (a mixture made with another sequence
    length shares it). The name hashes are made once, the keys of the last seed kept.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._name_keys: npt.NDArray[np.uint64] | None = None
        self._seed_cache: tuple[int, npt.NDArray[np.uint64]] | None = None

    def name_keys(self) -> npt.NDArray[np.uint64]:
        """A stable 64-bit hash of each source's name, made once."""
        if self._name_keys is None:
            hashes = [hash64(f"guideloom-mix-source:{name}") for name in self._names]
            self._name_keys = np.asarray(hashes, dtype=np.uint64)
        return self._name_keys

    def for_seed(self, seed: int) -> npt.NDArray[np.uint64]:
        """Each source's permutation key for ``seed``: splitmix64 of a hash of its name (made once)
        and a hash of the seed, so a new seed costs one hash, not one per source."""
        if self._seed_cache is None or self._seed_cache[0] != seed:
            seed_key = splitmix(
                np.asarray([hash64(f"guideloom-mix-seed:{seed}")], dtype=np.uint64), inplace=True
            )
            self._seed_cache = (seed, splitmix(self.name_keys() ^ seed_key, inplace=True))
        return self._seed_cache[1]


class MixtureOrder:
    """One epoch of a mixture's order: position ``[0, num_samples)`` to a key of the mixture
    (a source's offset + an index in that source), see :mod:`guideloom._datasets.mixture`."""

    def __init__(self, mixture: Mixture, layout: _Layout, *, shuffle: bool, seed: int, epoch: int) -> None:
        self._datasets = mixture._datasets_list()
        self._names = mixture.names
        self._layout = layout
        self._shuffle = shuffle
        self._seed = seed
        self.epoch = epoch
        self._source_keys = mixture._keys.for_seed(seed)
        # a source's own order (a nested mixture, a packed dataset) is seeded by its key
        self._seeds = [int(k) >> 1 for k in self._source_keys.tolist()]
        self._own_order = mixture._own_orders(shuffle)
        self._orders: dict[tuple[int, int], Order] = {}
        n = layout.lengths
        bits = np.maximum(2, _bit_length(n - 1))
        bits += bits & 1
        self._half = (bits // 2).astype(np.uint64)  # Permutation's half width, per source
        self._mask = (np.uint64(1) << self._half) - np.uint64(1)

    lookup_block = 2048
    """Positions the loader looks up at a time (its default is 16k, for plain permutations): a
    mixture position costs a tree walk, so a smaller block keeps the first batch after a resume
    fast, and costs nothing per batch."""

    def __len__(self) -> int:
        return self._layout.num_samples

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} outside [0, {len(self)})")
        return int(self.take(np.asarray([position], dtype=np.int64))[0])

    def range(self, start: int, stop: int) -> IndexArray:
        """Keys at positions ``[start, stop)``."""
        return self.take(np.arange(start, stop, dtype=np.int64))

    def sources(self, positions: npt.ArrayLike) -> tuple[IndexArray, IndexArray, IndexArray]:
        """For each position: its source, the source's epoch and the index in the source."""
        lay = self._layout
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= lay.num_samples):
            raise IndexError(f"positions outside [0, {lay.num_samples})")
        src, local = lay.locate(pos)
        cum = self.epoch * lay.per_epoch[src] + local
        length = lay.lengths[src]
        source_epoch, within = np.divmod(cum, length)
        return src, source_epoch, self._permute(src, source_epoch, within)

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        """Keys at ``positions`` (vectorised)."""
        src, _, index = self.sources(positions)
        return self._layout.offsets[src] + index

    def _permute(self, src: IndexArray, source_epoch: IndexArray, within: IndexArray) -> IndexArray:
        """``within`` through each source's order of its own epoch."""
        own = self._own_order[src]
        out = within.copy()
        if self._shuffle and not own.all():
            sel = np.flatnonzero(~own & (self._layout.lengths[src] > 1))
            if sel.size:
                out[sel] = self._feistel_take(src[sel], source_epoch[sel], within[sel])
        if own.any():
            sel = np.flatnonzero(own)
            group = src[sel] * (int(source_epoch[sel].max()) + 1) + source_epoch[sel]
            for g in np.unique(group):
                idx = sel[group == g]
                out[idx] = self._own(int(src[idx[0]]), int(source_epoch[idx[0]])).take(within[idx])
        return out

    def _own(self, s: int, source_epoch: int) -> Order:
        key = (s, source_epoch)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= _ORDER_CACHE:
                self._orders.clear()
            order = self._datasets[s].order(shuffle=self._shuffle, seed=self._seeds[s], epoch=source_epoch)
            assert order is not None  # checked when the order was made
            self._orders[key] = order
        return order

    def source_permutation(self, s: int, source_epoch: int) -> Permutation:
        """Source ``s``'s order in its epoch ``source_epoch`` (a scalar reference of what
        :meth:`take` computes vectorised; shuffled mixtures only)."""
        keys = _epoch_keys(self._source_keys[[s]], np.asarray([source_epoch], dtype=np.uint64))
        return _KeyedPermutation(int(self._layout.lengths[s]), keys[:, 0].tolist())

    def _feistel_take(self, src: IndexArray, source_epoch: IndexArray, within: IndexArray) -> IndexArray:
        """Every element through its own source epoch's keyed permutation, in one pass."""
        keys = _epoch_keys(self._source_keys[src], source_epoch.astype(np.uint64))
        n = self._layout.lengths[src].astype(np.uint64)
        h, mask = self._half[src], self._mask[src]
        x = _feistel(within.astype(np.uint64), h, mask, keys)
        out = np.flatnonzero(x >= n)
        while out.size:  # cycle-walking, as Permutation does
            walked = _feistel(x[out], h[out], mask[out], keys[:, out])
            x[out] = walked
            out = out[walked >= n[out]]
        return x.astype(np.int64)


def _bit_length(v: IndexArray) -> IndexArray:
    """``int.bit_length`` element-wise for ``0 <= v < 2^62`` (exact: by comparison, not log2)."""
    bits = np.zeros(v.shape, dtype=np.int64)
    x = v.copy()
    for step in (32, 16, 8, 4, 2, 1):
        big = x >= (1 << step)
        bits[big] += step
        x[big] >>= step
    return bits + (x > 0)


Source = StreamStorageAbstract[Any, Any] | DocumentStorageAbstract[Any, Any] | DatasetAbstract[Any]


# -- the read path: mixture keys to per-source reads and back, pure functions of the offsets ---
# Apart from Mixture, which holds the sources: what a key means is fixed by the layout alone.
_Group = tuple[int, IndexArray | None, IndexArray]
"""One source's read: ``(source, where in the keys or None for all of them, its indexes)``."""


def _groups(offsets: IndexArray, keys: IndexArray) -> list[_Group]:
    """``(source, where in keys or None for all, indexes in the source)`` per source read: the
    keys decoded by the layout's offsets alone, no source needed."""
    keys = np.asarray(keys, dtype=np.int64)
    src = np.searchsorted(offsets, keys, side="right") - 1
    if keys.size and (keys.min() < 0 or keys.max() >= offsets[-1]):
        raise IndexError(f"mixture keys outside [0, {int(offsets[-1])})")
    if keys.size == 0:
        return []
    first = int(src[0])
    if (src == first).all():
        return [(first, None, keys - offsets[first])]
    order = np.argsort(src, kind="stable")
    cuts = np.flatnonzero(np.diff(src[order])) + 1
    out: list[_Group] = []
    for where in np.split(order, cuts):
        s = int(src[where[0]])
        out.append((s, where, keys[where] - offsets[s]))
    return out


def _assemble(
    names: tuple[str, ...],
    with_source: bool,
    n: int,
    groups: list[_Group],
    results: Sequence[Sequence[Any]],
) -> Sequence[Any]:
    """Each source's results back at their keys' places (as ``(name, sample)`` pairs for
    ``with_source``)."""
    if len(groups) == 1 and groups[0][1] is None:
        res = results[0]
        return [(names[groups[0][0]], x) for x in res] if with_source else res
    out: list[Any] = [None] * n
    for (s, where, _), res in zip(groups, results, strict=True):
        assert where is not None
        if with_source:
            name = names[s]
            for i, x in zip(where.tolist(), res, strict=True):
                out[i] = (name, x)
        else:
            for i, x in zip(where.tolist(), res, strict=True):
                out[i] = x
    return out


def _digest(names: tuple[str, ...], datasets: Sequence[DatasetAbstract[Any]], layout: _Layout) -> str:
    """What :meth:`Mixture.fingerprint_digest` returns, computed from the names, the sources and
    the layout alone (the mixture only caches it): each source's checkpoint fingerprint, with its
    name and weight."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"mixture:{layout.num_samples}".encode())
    if layout.shape:  # a schedule other than the Huffman tree's, which digests made before did not name
        h.update(f"\ntree:{layout.shape}".encode())
    for name, ds, w in zip(names, datasets, layout.weights.tolist(), strict=True):
        f = ds.fingerprint()
        fp = f"{f['kind']}:{f['observations']}:{f['sequence_length']}:{f['digest']}"
        h.update(f"\n{name}:{w!r}:{fp}".encode())
    return h.hexdigest()


class Mixture(DatasetAbstract[Any]):
    """A weighted mixture of datasets, made by :func:`mix`: one dataset whose epoch interleaves
    its sources by weight, each source in its own seeded order (see :func:`mix`)."""

    _plain_reads: ClassVar[bool] = True
    makes_own_order: ClassVar[bool] = True

    def __init__(
        self,
        sources: Mapping[str, Source],
        weights: Mapping[str, float] | None = None,
        *,
        sequence_length: int | Mapping[str, int] | None = None,
        num_samples: int | None = None,
        with_source: bool = False,
    ) -> None:
        self.names: tuple[str, ...] = _check_names(sources)
        """The sources' names, in the order given."""
        self.with_source = check_bool("with_source", with_source)
        """Whether each sample is a ``(source name, sample)`` pair."""
        self._num_samples = None if num_samples is None else check_int("num_samples", num_samples, 1)
        if self._num_samples is not None and self._num_samples >= _ONE_FIX:
            raise ValueError(f"num_samples must be below 2**62 (the schedule's range), got {num_samples}")
        self._weights = _check_weights(self.names, weights)
        self._datasets, self._pending = _resolve_sources(self.names, sources, sequence_length)
        self._layout_cache: _Layout | None = None
        self._list_cache: list[DatasetAbstract[Any]] | None = None
        self._own_cache: dict[bool, npt.NDArray[np.bool_]] = {}
        self._inline = False  # all sources read inline: once true, it stays (a cache completes)
        self._read_figures: tuple[int, int, int] | None = None
        self._digest_cache: str | None = None
        self._keys = _SourceKeys(self.names)

    def __repr__(self) -> str:
        return f"Mixture({list(self.names)}, num_samples={self._num_samples})"

    # -- the sources ------------------------------------------------------------------------------
    def with_sequence_length(self, sequence_length: int | None) -> Mixture:
        """This mixture with ``sequence_length`` for its stream storages that have none
        (``from_storage(mixture, sequence_length=...)`` calls it); ``None`` leaves it as it is."""
        if sequence_length is None:
            return self
        if not self._needs_length():
            raise ValueError(
                "every source of this mixture already has its sample rule (a sequence_length "
                "given to mix(), document storage, or a dataset), so sequence_length="
                f"{sequence_length} would apply to none: drop the argument"
            )
        out = Mixture.__new__(Mixture)
        out.__dict__.update(self.__dict__)
        out._datasets = {
            name: _with_length(self._datasets[name], sequence_length)
            if name in self._datasets
            else StreamDataset(self._pending[name], sequence_length)
            for name in self.names
        }
        out._pending = {}
        out._layout_cache = None
        out._list_cache = None
        out._own_cache = {}
        out._read_figures = None
        out._digest_cache = None
        return out

    def _needs_length(self) -> bool:
        """Whether a stream source here, or in a mixture among the sources, has no
        ``sequence_length`` yet."""
        return bool(self._pending) or any(
            isinstance(ds, Mixture) and ds._needs_length() for ds in self._datasets.values()
        )

    @property
    def sources(self) -> dict[str, DatasetAbstract[Any]]:
        """Each source's dataset, by name."""
        self._require_resolved()
        return dict(self._datasets)

    def _datasets_list(self) -> list[DatasetAbstract[Any]]:
        """The sources' datasets in order (kept: the read path asks for it every window)."""
        if self._list_cache is None:
            self._require_resolved()
            self._list_cache = [self._datasets[name] for name in self.names]
        return self._list_cache

    def _own_orders(self, shuffle: bool) -> npt.NDArray[np.bool_]:
        """Which sources make their own order (``order()`` is not None), kept per ``shuffle``."""
        flags = self._own_cache.get(shuffle)
        if flags is None:
            own = [ds.order(shuffle=shuffle, seed=0, epoch=0) is not None for ds in self._datasets_list()]
            flags = self._own_cache[shuffle] = np.asarray(own, dtype=bool)
        return flags

    def _require_resolved(self) -> None:
        for ds in self._datasets.values():
            if isinstance(ds, Mixture):
                ds._require_resolved()  # an inner mixture's stream sources name themselves
        if self._pending:
            names = ", ".join(repr(n) for n in self._pending)
            raise ValueError(
                f"stream source(s) {names} need a sequence_length: pass sequence_length=<elements "
                "per sample> to mix() (an int for every stream source, or a dict by name) or to "
                "StatefulDataLoader.from_storage(mixture, ...)"
            )

    # -- the layout -------------------------------------------------------------------------------
    def _layout(self) -> _Layout:
        if self._layout_cache is None:
            datasets = self._datasets_list()
            lengths = [len(ds) for ds in datasets]
            for name, n in zip(self.names, lengths, strict=True):
                if n < 1:
                    raise ValueError(f"mixture source {name!r} has no samples: remove it from the mixture")
            weights = self._weights if self._weights is not None else [float(n) for n in lengths]
            m = self._num_samples if self._num_samples is not None else sum(lengths)
            self._layout_cache = _Layout.build(lengths, weights, m)
        return self._layout_cache

    @property
    def weights(self) -> dict[str, float]:
        """Each source's share of the mixture (normalised to sum to 1)."""
        return dict(zip(self.names, self._layout().weights.tolist(), strict=True))

    @property
    def samples_per_epoch(self) -> dict[str, int]:
        """How many samples each source serves in one mixture epoch (its weight times
        ``len(mixture)``, rounded by the schedule)."""
        return dict(zip(self.names, self._layout().per_epoch.tolist(), strict=True))

    @property
    def discrepancy_bounds(self) -> dict[str, float]:
        """For each source, the bound on ``|samples of it among the first n positions - weight *
        n|`` that holds for every prefix ``n`` of every epoch (see :func:`mix`)."""
        return dict(zip(self.names, self._layout().bounds.tolist(), strict=True))

    def fingerprint_digest(self) -> str:
        """A digest of what fixes the order: the names, weights, epoch length and each source's
        checkpoint fingerprint (a checkpoint is refused over a mixture with another digest)."""
        if self._digest_cache is None:
            self._digest_cache = _digest(self.names, self._datasets_list(), self._layout())
        return self._digest_cache

    # -- DatasetAbstract ------------------------------------------------------------------------
    def fingerprint(self) -> DatasetFingerprint:
        """Its sources' fingerprints, names and weights in one digest."""
        return DatasetFingerprint(
            kind="mixture", observations=len(self), sequence_length=0, digest=self.fingerprint_digest()
        )

    def __len__(self) -> int:
        """The mixture epoch's length: ``num_samples``, by default the sum of the sources' lengths."""
        return self._layout().num_samples

    def order(self, *, shuffle: bool, seed: int, epoch: int) -> MixtureOrder:
        return MixtureOrder(self, self._layout(), shuffle=shuffle, seed=seed, epoch=epoch)

    def position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """``source_epoch/<name>``: the epoch of its own that each source is in at this position
        (how many times it has been read whole; a source smaller than its share exceeds the
        mixture's epoch). Empty until the mixture is open."""
        lay = self._layout_cache
        if lay is None:  # not open yet (a remote source may not know its length): nothing to say
            return {}
        cum = epoch * lay.per_epoch + lay.counts(min(max(offset, 0), lay.num_samples))
        epochs = cum // lay.lengths
        return {f"source_epoch/{name}": float(e) for name, e in zip(self.names, epochs.tolist(), strict=True)}

    async def open(self) -> None:
        datasets = self._datasets_list()
        opened: list[DatasetAbstract[Any]] = []
        try:
            for ds in datasets:
                await ds.open()
                opened.append(ds)
            self._layout_cache = None  # a storage may know its length only once open
            self._read_figures = None
            self._digest_cache = None
            self._inline = False
            # What a resume needs, made here once: the schedule, the fingerprint, the name keys.
            self._layout()
            self.fingerprint_digest()
            self._figures()
            self._keys.name_keys()
        except BaseException:
            for ds in reversed(opened):
                await ds.close()
            raise

    async def close(self) -> None:
        errors: list[BaseException] = []
        for ds in reversed(self._datasets_list()):
            try:
                await ds.close()
            except Exception as exc:  # close them all, then raise the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Any]:
        """Samples at mixture keys ``indices``: each source read once, concurrently."""
        datasets = self._datasets_list()
        groups = _groups(self._layout().offsets, indices)
        results = await asyncio.gather(*(datasets[s].read_many(idx) for s, _, idx in groups))
        return _assemble(self.names, self.with_source, len(indices), groups, results)

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Any]:
        datasets = self._datasets_list()
        groups = _groups(self._layout().offsets, indices)
        results = [datasets[s].read_many_sync(idx) for s, _, idx in groups]
        return _assemble(self.names, self.with_source, len(indices), groups, results)

    @property
    def reads_inline(self) -> bool:
        if not self._plain_reads or self._pending:
            return False
        if not self._inline:  # asked every window: kept once true (local files stay local)
            self._inline = all(ds.reads_inline for ds in self._datasets_list())
        return self._inline

    def _figures(self) -> tuple[int, int, int]:
        """(max concurrent reads, read window bytes, sample bytes hint), kept once computed."""
        if self._read_figures is None:
            datasets = self._datasets_list()
            hints = np.asarray([ds.sample_nbytes_hint() for ds in datasets], dtype=np.float64)
            self._read_figures = (
                max(ds.max_concurrent_reads for ds in datasets),
                max(ds.read_window_bytes for ds in datasets),
                round(float((hints * self._layout().weights).sum())),
            )
        return self._read_figures

    @property
    def max_concurrent_reads(self) -> int:
        return self._figures()[0]

    @property
    def read_window_bytes(self) -> int:
        return self._figures()[1]

    def sample_nbytes_hint(self) -> int:
        return self._figures()[2]


def _check_names(sources: Mapping[str, Source]) -> tuple[str, ...]:
    """The names of mix()'s ``sources``, checked: a non-empty mapping keyed by non-empty strings
    (one of the argument checks kept here, out of :class:`Mixture`'s constructor)."""
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError(
            "mix() needs a non-empty mapping of source names to storages or datasets, e.g. "
            f'mix({{"web": web, "code": code}}), got {sources!r}'
        )
    for name in sources:
        if not isinstance(name, str) or not name:
            raise TypeError(f"source names must be non-empty strings, got {name!r}")
    return tuple(sources)


def _resolve_sources(
    names: tuple[str, ...], sources: Mapping[str, Source], sequence_length: int | Mapping[str, int] | None
) -> tuple[dict[str, DatasetAbstract[Any]], dict[str, StreamStorageAbstract[Any, Any]]]:
    """``(each source's dataset, the stream storages still without a sequence length)``.

    The sample rule of each kind of source in one place, apart from :class:`Mixture`, which only
    keeps the result: a dataset as it is, document storage one document per sample, stream
    storage cut by its ``sequence_length`` (or pending until ``from_storage`` gives one).
    """
    per_source, shared = _split_lengths(names, sequence_length)
    datasets: dict[str, DatasetAbstract[Any]] = {}
    pending: dict[str, StreamStorageAbstract[Any, Any]] = {}
    for name, src in sources.items():
        length = per_source.get(name, shared)
        if isinstance(src, DatasetAbstract):
            if name in per_source:
                raise ValueError(
                    f"source {name!r} is a dataset, which has its own sample rule: drop it "
                    "from sequence_length"
                )
            datasets[name] = src
        elif isinstance(src, StreamStorageAbstract):
            if length is None:
                pending[name] = src
            else:
                datasets[name] = StreamDataset(src, length)
        elif isinstance(src, DocumentStorageAbstract):
            if name in per_source:
                raise ValueError(
                    f"source {name!r} is document storage (one document per sample) and takes "
                    "no sequence_length: drop it from the sequence_length mapping"
                )
            datasets[name] = DocumentDataset(src)
        else:
            raise TypeError(
                f"source {name!r} must be stream or document storage (open_stream(), "
                "MemoryStreamStorage, ...) or a DatasetAbstract (StreamDataset, MapDataset, a "
                f"mixture, ...), got {type(src).__name__}"
            )
    return datasets, pending


def _with_length(dataset: DatasetAbstract[Any], sequence_length: int) -> DatasetAbstract[Any]:
    """A source with ``sequence_length`` given to the mixtures in it that still need one."""
    if isinstance(dataset, Mixture) and dataset._needs_length():
        return dataset.with_sequence_length(sequence_length)
    return dataset


def _check_weights(names: tuple[str, ...], weights: Mapping[str, float] | None) -> list[float] | None:
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of source name to weight, got {type(weights).__name__}")
    if set(weights) != set(names):
        missing, extra = set(names) - set(weights), set(weights) - set(names)
        raise ValueError(
            f"weights must name every source once: missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    out = []
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise TypeError(f"weight of {name!r} must be a number, got {type(w).__name__}")
        if not math.isfinite(float(w)) or float(w) <= 0:
            raise ValueError(
                f"weight of {name!r} must be finite and > 0, got {w!r} (drop a source to give it none)"
            )
        out.append(float(w))
    return out


def _split_lengths(
    names: tuple[str, ...], sequence_length: int | Mapping[str, int] | None
) -> tuple[dict[str, int], int | None]:
    """``(per-source lengths, the shared one)`` from mix()'s ``sequence_length``."""
    if sequence_length is None:
        return {}, None
    if isinstance(sequence_length, Mapping):
        unknown = set(sequence_length) - set(names)
        if unknown:
            raise ValueError(
                f"sequence_length names unknown sources {sorted(unknown)}; sources: {list(names)}"
            )
        return {k: check_int(f"sequence_length[{k!r}]", v, 1) for k, v in sequence_length.items()}, None
    return {}, check_int("sequence_length", sequence_length, 1)


def mix(
    sources: Mapping[str, Source],
    weights: Mapping[str, float] | None = None,
    *,
    sequence_length: int | Mapping[str, int] | None = None,
    num_samples: int | None = None,
    with_source: bool = False,
) -> Mixture:
    """A weighted mixture of storages and datasets, usable wherever a storage or a dataset is.

    ``StatefulDataLoader.from_storage(mix(...), collate_fn, ...)`` and
    ``StatefulDataLoader(mix(...), collate_fn, ...)`` both take it; it shuffles, shards across
    ranks and resumes exactly like a single dataset.

    Args:
        sources: Name to source: stream storage (cut into ``sequence_length`` samples), document
            storage (one document per sample), or any ``DatasetAbstract`` (a ``StreamDataset``
            with its own length, a ``MapDataset``, a packed dataset, another mixture).
        weights: Name to weight (any positive numbers; they are normalised). Default: each
            source's number of samples, so an epoch reads every source about once.
        sequence_length: Elements per sample of the stream storages: one int for all, or a dict
            by name. Stream storages left without one take ``from_storage``'s
            ``sequence_length``.
        num_samples: Samples in one mixture epoch (``len(mixture)``). Default: the sum of the
            sources' lengths.
        with_source: Make each sample a ``(source name, sample)`` pair, for a collate that needs
            to know where a sample came from (a per-source loss or metric).

    Position ``p`` of an epoch is served by source ``s`` by a deterministic low-discrepancy
    schedule: among the first ``n`` positions, source ``s`` serves ``weight_s * n`` samples up to
    a bound (:attr:`Mixture.discrepancy_bounds`), whatever ``n``: below 1 (at most ``1 - 1/(2S
    - 2)`` for S sources) for weights that print as short decimals or integers (``0.7``,
    ``0.15``, ``3``; a period of at most 2^15 positions), and for any weights in an epoch of at
    most 2^15 positions; 1/2 for two sources and within 1 for even weights otherwise, up to
    about 1.5 for ragged float weights over many sources in a longer epoch. Behind the schedule
    each source reads its own samples in its own seeded order; a source with fewer samples than
    its share of the epoch starts over in a fresh order (its own epoch, which ``loader.stats()``
    reports as ``source_epoch/<name>``), and one with more carries on where it stopped at the next mixture
    epoch. The order depends on ``(shuffle, shuffle_seed, epoch)``, the sources' lengths, names
    and weights and ``num_samples`` alone; a checkpoint records a fingerprint of all of them.

    Raises:
        TypeError: For a source that is neither storage nor a dataset, or weights that are not
            numbers.
        ValueError: For weights that do not name every source once or are not finite and
            positive, and (when the mixture is used) a stream storage without a sequence length
            or a source without samples.

    Examples:
        >>> import numpy as np
        >>> import guideloom as gl
        >>> web = gl.MemoryStreamStorage(np.arange(1000, dtype=np.uint16))
        >>> code = gl.MemoryDocumentStorage([np.arange(n, dtype=np.uint16) for n in (3, 5, 7)])
        >>> m = gl.mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, sequence_length=10)
        >>> len(m), m.samples_per_epoch
        (103, {'web': 72, 'code': 31})
    """
    return Mixture(
        sources, weights, sequence_length=sequence_length, num_samples=num_samples, with_source=with_source
    )
