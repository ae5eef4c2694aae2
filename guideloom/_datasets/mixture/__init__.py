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
   loader's :class:`~guideloom._core.permutation.Permutation`, its round keys derived from the loader's
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

Weights may also change with training progress (:class:`WeightSchedule`: piecewise constant or
linear over the mixture's global position); :mod:`guideloom._core.weight_schedule` serves them
from the constant schedules above.

The schedules are pure arithmetic and live with the other plans: :mod:`guideloom._core.mixture`
(the schedule and its layout), :mod:`guideloom._core.weight_schedule` (weights that change with
progress). The package: :mod:`.order` (the order of one epoch: the schedule, then each source's
seeded permutation), :mod:`.dataset` (the mixture as a dataset, its reads, and :func:`mix`).
"""

from __future__ import annotations

from guideloom._core.weight_schedule import WeightSchedule
from guideloom._datasets.mixture.dataset import Mixture, Source, mix
from guideloom._datasets.mixture.order import MixtureOrder

__all__ = ["Mixture", "MixtureOrder", "Source", "WeightSchedule", "mix"]
