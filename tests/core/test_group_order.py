"""The lazily counted group order: window by window, and exactly the group order once counted."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.group_order import GroupPermutation, LazyGroupPermutation

sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=30)


def _count_lazily(lazy: LazyGroupPermutation, sizes: list[int]) -> list[int]:
    """Learn the sizes as a reader would: the first uncounted window's groups at a time; the
    ``known`` bound after each window."""
    bounds = [lazy.known]
    while not lazy.complete:
        groups = lazy.next_groups()
        assert len(groups)
        for g in groups.tolist():
            lazy.learn(g, sizes[g])
        bounds.append(lazy.known)
    return bounds


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, seed=st.integers(0, 2**32), epoch=st.integers(0, 5), window=st.integers(1, 8))
def test_lazy_order_is_the_group_order_once_counted(
    sizes: list[int], seed: int, epoch: int, window: int
) -> None:
    eager = GroupPermutation(sizes, seed=seed, epoch=epoch, window=window)
    lazy = LazyGroupPermutation(len(sizes), seed=seed, epoch=epoch, window=window)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    bounds = _count_lazily(lazy, sizes)
    assert lazy.complete and len(lazy) == len(eager) == sum(sizes)
    positions = np.arange(len(eager), dtype=np.int64)
    groups, places = lazy.take_keyed(positions)
    assert (starts[groups] + places == eager.take(positions)).all()
    # each window's positions were known as soon as its groups were counted, and end where the
    # group order's windows end
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            assert eager.window_end(lo) == hi == lazy.window_end(lo)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, seed=st.integers(0, 2**32), window=st.integers(1, 8), data=st.data())
def test_a_window_is_looked_up_from_its_own_and_earlier_counts(
    sizes: list[int], seed: int, window: int, data: st.DataObject
) -> None:
    """Counted up to window k, positions of windows <= k map as they do once all is counted,
    whatever the other groups hold."""
    lazy = LazyGroupPermutation(len(sizes), seed=seed, epoch=1, window=window)
    stop = data.draw(st.integers(0, lazy.windows))
    for _ in range(stop):
        for g in lazy.next_groups().tolist():
            lazy.learn(g, sizes[g])
    partial = lazy.known
    got = lazy.take_keyed(np.arange(partial, dtype=np.int64))
    other = [s if lazy.sizes[g] >= 0 else data.draw(st.integers(0, 40)) for g, s in enumerate(sizes)]
    full = LazyGroupPermutation(len(sizes), seed=seed, epoch=1, window=window)
    full.learn_many(other)
    want = full.take_keyed(np.arange(partial, dtype=np.int64))
    assert all((a == b).all() for a, b in zip(got, want, strict=True))
    if partial < sum(sizes) and not lazy.complete:
        with pytest.raises(IndexError):
            lazy.take_keyed([partial])


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, seed=st.integers(0, 2**32), window=st.integers(1, 8))
def test_the_last_group_comes_after_every_window(sizes: list[int], seed: int, window: int) -> None:
    lazy = LazyGroupPermutation(len(sizes), seed=seed, epoch=0, window=window, last=True)
    bounds = _count_lazily(lazy, sizes)
    head = sum(sizes[:-1])
    assert bounds[-2] == head  # the last group's window is counted last
    eager = GroupPermutation(sizes[:-1], seed=seed, epoch=0, window=window)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    groups, places = lazy.take_keyed(np.arange(len(lazy), dtype=np.int64))
    assert (starts[groups[:head]] + places[:head] == eager.take(np.arange(head))).all()
    assert (groups[head:] == len(sizes) - 1).all()
    assert sorted(places[head:].tolist()) == list(range(sizes[-1]))


def test_sizes_told_twice_must_agree_and_lengths_wait_for_the_count() -> None:
    lazy = LazyGroupPermutation(3, seed=0, epoch=0, window=1)
    with pytest.raises(RuntimeError, match="every group is counted"):
        len(lazy)
    g = int(lazy.next_groups()[0])
    lazy.learn(g, 5)
    lazy.learn(g, 5)
    with pytest.raises(ValueError, match="was told 5"):
        lazy.learn(g, 6)
    assert lazy.known == 5 and not lazy.complete
