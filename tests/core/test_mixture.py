"""A mixture's schedule (``guideloom._core.mixture``), with no dataset: exact fixed-point
rounding, and every prefix of an epoch holding each source within its bound of ``w_s n``, for
the tree and the quota schedules alike."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.mixture import Layout, round_fix


@settings(max_examples=300, deadline=None)
@given(
    j=st.lists(st.integers(0, 2**62 - 1), min_size=1, max_size=20),
    a=st.lists(st.integers(1, 2**62 - 1), min_size=1, max_size=20),
)
def test_fixed_point_rounding_is_exact(j: list[int], a: list[int]) -> None:
    k = min(len(j), len(a))
    got = round_fix(np.asarray(j[:k], dtype=np.uint64), np.asarray(a[:k], dtype=np.uint64))
    assert got.tolist() == [(x * y + 2**61) >> 62 for x, y in zip(j[:k], a[:k], strict=True)]


weights_st = st.lists(
    st.one_of(st.integers(1, 1000).map(float), st.floats(1e-3, 1.0)), min_size=1, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, n=st.integers(1, 3000))
def test_every_prefix_within_the_bound_of_weight_times_n(weights: list[float], n: int) -> None:
    lay = Layout.build([10] * len(weights), weights, n)
    src, local = lay.locate(np.arange(n, dtype=np.int64))
    prefix = np.arange(1, n + 1)
    w = np.asarray(weights) / sum(weights)
    for s in range(len(weights)):
        mine = src == s
        counts = np.cumsum(mine)
        assert np.abs(counts - w[s] * prefix).max() <= lay.bounds[s] + 1e-9, (s, weights)
        # the index carried to the leaf is the source's number of earlier positions
        assert local[mine].tolist() == list(range(int(mine.sum())))
    assert lay.counts(n).tolist() == np.bincount(src, minlength=len(weights)).tolist()
    assert lay.per_epoch.tolist() == lay.counts(n).tolist()


def max_prefix_error(weights: Sequence[float], n: int) -> float:
    lay = Layout.build([10] * len(weights), weights, n)
    src, _ = lay.locate(np.arange(n, dtype=np.int64))
    w = np.asarray(weights) / sum(weights)
    prefix = np.arange(1, n + 1)
    return max(float(np.abs(np.cumsum(src == s) - w[s] * prefix).max()) for s in range(len(weights)))


@settings(max_examples=100, deadline=None)
@given(a=st.floats(1e-6, 1.0), b=st.floats(1e-6, 1.0), n=st.integers(1, 5000))
def test_two_sources_stay_within_a_half(a: float, b: float, n: int) -> None:
    assert max(Layout.build([1, 1], [a, b], n).bounds.tolist()) <= 0.5
    assert max_prefix_error([a, b], n) <= 0.5 + 1e-9


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(
        st.one_of(st.integers(1, 1000).map(float), st.floats(1e-4, 1.0)), min_size=1, max_size=5
    ),
    n=st.integers(1, 4000),
)
def test_up_to_five_sources_stay_within_one_for_any_weights(weights: list[float], n: int) -> None:
    """Every tree shape is tried for a few sources, and one whose proven bound is at most 1 is
    found for any weights of up to five (the Huffman tree alone misses for about half of random
    four-source weightings)."""
    lay = Layout.build([10] * len(weights), weights, n)
    assert lay.bounds.max() <= 1.0 + 1e-12, weights
    assert max_prefix_error(weights, n) <= 1.0 + 1e-9


def test_a_huffman_shaped_schedule_is_kept_and_another_shape_is_named() -> None:
    """Mixtures whose best tree is the Huffman tree (all of them before other shapes were tried)
    keep their order and their checkpoints' digest; another shape is named (in the digest too).
    (Weights divided by 3 print as long decimals, so the tree schedule serves them.)"""
    assert Layout.build([10, 10], [0.7 / 3, 0.3 / 3], 100).shape == ""
    long_epoch = 10**9  # rounded weights would drift too far for a quota schedule
    assert Layout.build([10] * 4, [x / 3 for x in (0.35, 0.3, 0.25, 0.1)], long_epoch).shape == ""
    # Huffman: 0 beside ((3, 2), 1), whose leaves 3 and 2 have a bound of 1.08; two pairs: 0.9.
    ragged = [x / 3 for x in (0.45, 0.3, 0.2, 0.05)]
    lay = Layout.build([10] * 4, ragged, long_epoch)
    assert lay.shape == "((0, 1), (2, 3))"
    assert lay.bounds.max() <= 0.9 + 1e-12
    assert max_prefix_error(ragged, 20_000) <= 0.9 + 1e-9
    short = Layout.build([10] * 4, ragged, 1000)  # a short epoch: a quota table of it
    assert short.shape == "quota-epoch:1000" and short.bounds.max() <= 1 - 1 / 6 + 1e-9


def test_weights_of_small_ratios_get_the_quota_schedule() -> None:
    """Weights that print as short decimals or integers are exact ratios: a periodic quota
    schedule serves them, named in the digest, its bounds the exact deviations it reaches."""
    lay = Layout.build([10] * 4, [0.45, 0.3, 0.2, 0.05], 100)
    assert lay.shape == "quota:20" and lay.quota is not None
    assert lay.quota.tolist() == [9, 6, 4, 1]
    assert lay.bounds.max() <= 1 - 1 / 6 + 1e-12
    assert max_prefix_error([0.45, 0.3, 0.2, 0.05], 20_000) <= lay.bounds.max() + 1e-9
    assert Layout.build([1] * 3, [1e-9, 1.0, 1.0], 10).period is None  # a period of 2e9 + 1: the tree


quota_weights_st = st.one_of(
    st.lists(st.integers(1, 400).map(float), min_size=2, max_size=40),  # ratios: 1:4:...
    st.lists(st.integers(1, 99).map(lambda x: x / 100), min_size=2, max_size=40),  # percents
    st.lists(st.floats(1e-4, 1.0), min_size=2, max_size=40),  # ragged: a table of the epoch
)


@settings(max_examples=150, deadline=None)
@given(weights=quota_weights_st, n=st.integers(1, 6000))
def test_the_quota_schedule_holds_every_source_within_one_for_any_count_of_sources(
    weights: list[float], n: int
) -> None:
    """Tijdeman's bound, 1 - 1/(2S - 2) for S sources, on every prefix, whatever the weights:
    a period's table for exact ratios, a table of the epoch for an epoch of at most 2^15
    positions; the bounds reported are what the prefixes reach."""
    lay = Layout.build([10] * len(weights), weights, n)
    assert lay.bounds.max() <= 1 - 1 / (2 * len(weights) - 2) + 1e-9  # quota, or a tree as good
    src, local = lay.locate(np.arange(n, dtype=np.int64))
    w = np.asarray(weights) / sum(weights)
    prefix = np.arange(1, n + 1)
    for s in range(len(weights)):
        mine = src == s
        assert np.abs(np.cumsum(mine) - w[s] * prefix).max() <= lay.bounds[s] + 1e-9, (s, weights)
        assert local[mine].tolist() == list(range(int(mine.sum())))
    assert lay.counts(n).tolist() == np.bincount(src, minlength=len(weights)).tolist()
    assert lay.per_epoch.tolist() == lay.counts(n).tolist()


def test_the_quota_schedule_far_into_an_epoch_matches_the_counts() -> None:
    lay = Layout.build([10] * 7, [0.3, 0.2, 0.15, 0.15, 0.1, 0.07, 0.03], 10**12)
    assert lay.period is not None  # the best tree's bound is 1.09
    start = 10**12 - 5000
    src, local = lay.locate(np.arange(start, start + 5000, dtype=np.int64))
    before = lay.counts(start)
    for s in range(7):
        mine = src == s
        assert local[mine].tolist() == list(range(before[s], before[s] + int(mine.sum())))
        assert abs(before[s] - lay.weights[s] * start) <= lay.bounds[s] + 1e-3


@settings(max_examples=30, deadline=None)
@given(sources=st.integers(1, 64), n=st.integers(1, 4000))
def test_even_weights_stay_within_one(sources: int, n: int) -> None:
    assert max_prefix_error([1.0] * sources, n) <= 1.0


@pytest.mark.parametrize(
    "weights",
    [
        [0.7, 0.3],
        [1.0, 1e-6],
        [0.7, 0.2, 0.1],
        [1, 2, 3, 4, 5, 6, 7],
        [0.5, 0.25, 0.125, 0.125],
        [0.4, 0.3, 0.2, 0.1],
        [1.0] * 1000,
    ],
)
def test_within_one_on_every_prefix_for_common_mixtures(weights: list[float]) -> None:
    assert max_prefix_error(weights, 20_000) <= 1.0


def test_the_schedule_far_into_an_epoch_matches_the_counts() -> None:
    lay = Layout.build([10, 20, 30], [0.5, 0.3, 0.2], 10**12)
    start = 10**12 - 5000
    src, local = lay.locate(np.arange(start, start + 5000, dtype=np.int64))
    before = lay.counts(start)
    for s in range(3):
        mine = src == s
        assert local[mine].tolist() == list(range(before[s], before[s] + int(mine.sum())))
        assert abs(before[s] - lay.weights[s] * start) <= lay.bounds[s]
