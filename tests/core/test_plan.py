"""The pure plan: epoch order, rank blocks, drop_last and resume arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.plan import BatchSpec, EpochPlan, Permutation, num_batches


@pytest.mark.parametrize(
    "n", [0, 1, 2, 3, 7, 8, 255, 256, 1000, 4096, 2**16, 2**16 + 1, 2**18, 2**20, 3 * 2**17 - 5]
)
def test_permutation_is_a_bijection(n: int) -> None:
    perm = Permutation(n, shuffle=True, seed=1234, epoch=3)
    out = perm.range(0, n)
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize("n", [2**16, 2**18, 2**20])
@pytest.mark.slow
def test_even_powers_of_two_are_bijective_for_many_keys(n: int) -> None:
    for seed in range(3):
        for epoch in range(2):
            out = Permutation(n, shuffle=True, seed=seed, epoch=epoch).range(0, n)
            assert len(np.unique(out)) == n


def test_scalar_lookup_matches_vectorised() -> None:
    perm = Permutation(10_007, shuffle=True, seed=5, epoch=1)
    positions = np.arange(0, 10_007, 13)
    assert perm.take(positions).tolist() == [perm[int(p)] for p in positions]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 200_000), seed=st.integers(0, 2**32), data=st.data())
def test_take_of_a_few_positions_matches_scalar_lookups(n: int, seed: int, data: st.DataObject) -> None:
    """Up to a few dozen positions (walked one by one, or their walk's stragglers so), in any
    shape: the same indexes as one lookup each."""
    perm = Permutation(n, shuffle=True, seed=seed, epoch=2)
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=80))
    got = perm.take(positions)
    assert got.dtype == np.int64 and got.tolist() == [perm[p] for p in positions]
    if len(positions) % 2 == 0 and positions:
        grid = np.array(positions).reshape(2, -1)
        assert perm.take(grid).tolist() == [[perm[int(p)] for p in row] for row in grid]


def test_order_changes_with_epoch_and_seed_but_not_otherwise() -> None:
    n = 5000
    a = Permutation(n, shuffle=True, seed=1, epoch=0).range(0, n)
    assert np.array_equal(a, Permutation(n, shuffle=True, seed=1, epoch=0).range(0, n))
    assert not np.array_equal(a, Permutation(n, shuffle=True, seed=1, epoch=1).range(0, n))
    assert not np.array_equal(a, Permutation(n, shuffle=True, seed=2, epoch=0).range(0, n))
    assert not np.array_equal(a, np.arange(n))


def test_no_shuffle_is_identity() -> None:
    perm = Permutation(100, shuffle=False, seed=9, epoch=4)
    assert perm.range(10, 20).tolist() == list(range(10, 20))
    assert perm[42] == 42


def test_shuffle_looks_random() -> None:
    n = 100_000
    out = Permutation(n, shuffle=True, seed=0, epoch=0).range(0, n)
    # fixed points of a random permutation: ~Poisson(1); and neighbours should not stay neighbours
    assert (out == np.arange(n)).sum() < 10
    assert np.mean(np.abs(np.diff(out)) == 1) < 0.001
    # first and second half each cover both halves of the index space roughly evenly
    assert 0.45 < np.mean(out[: n // 2] < n // 2) < 0.55


def test_out_of_range_positions_raise() -> None:
    perm = Permutation(10, shuffle=True, seed=0, epoch=0)
    with pytest.raises(IndexError):
        perm[10]
    with pytest.raises(IndexError):
        perm.take(np.array([3, -1]))


def test_huge_domain_is_o1() -> None:
    perm = Permutation(10**15, shuffle=True, seed=7, epoch=0)
    values = perm.take(np.array([0, 1, 10**15 - 1]))
    assert all(0 <= v < 10**15 for v in values.tolist())
    assert len(set(values.tolist())) == 3


def test_plan_rank_blocks_and_drop_last() -> None:
    plan = EpochPlan(num_observations=10, local_batch_size=2, world_size=2, rank=1, drop_last=False)
    assert len(plan) == 3
    assert [(b.start, b.stop, b.offset_after) for b in plan.batches()] == [(2, 4, 4), (6, 8, 8), (10, 10, 12)]
    plan = EpochPlan(num_observations=10, local_batch_size=2, world_size=2, rank=0, drop_last=False)
    assert [(b.start, b.stop) for b in plan.batches()] == [(0, 2), (4, 6), (8, 10)]
    plan = EpochPlan(num_observations=10, local_batch_size=2, world_size=2, rank=0, drop_last=True)
    assert len(plan) == 2


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="local_batch_size"):
        EpochPlan(10, 0, 1, 0, True)
    with pytest.raises(ValueError, match="rank"):
        EpochPlan(10, 1, 2, 2, True)
    with pytest.raises(ValueError, match="offset"):
        EpochPlan(10, 1, 1, 0, True, start_offset=-1)


def test_num_batches() -> None:
    assert num_batches(10, 4, True) == 2
    assert num_batches(10, 4, False) == 3
    assert num_batches(10, 4, False, offset=9) == 1
    assert num_batches(10, 4, True, offset=9) == 0
    assert num_batches(10, 4, False, offset=12) == 0


def _rank_positions(plan: EpochPlan) -> list[list[int]]:
    return [list(range(b.start, b.stop)) for b in plan.batches()]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 400),
    batch=st.integers(1, 9),
    world=st.integers(1, 5),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
@pytest.mark.slow
def test_every_observation_once_across_ranks_and_resume(
    n: int, batch: int, world: int, drop_last: bool, seed: int, data: st.DataObject
) -> None:
    """Exactly once: before checkpoint + after resume (any batch size / world size), over all ranks."""
    g = batch * world
    if n < g:
        return
    perm = Permutation(n, shuffle=True, seed=seed, epoch=0)
    full_steps = num_batches(n, g, drop_last)
    stop_step = data.draw(st.integers(0, full_steps), label="checkpoint step")
    offset = stop_step * g
    seen: list[int] = []
    for rank in range(world):
        plan = EpochPlan(n, batch, world, rank, drop_last)
        assert len(plan) == full_steps
        for spec in list(plan.batches())[:stop_step]:
            seen += perm.range(spec.start, spec.stop).tolist()
    # resume with another layout
    batch2 = data.draw(st.integers(1, 9), label="resumed batch size")
    world2 = data.draw(st.integers(1, 5), label="resumed world size")
    lengths = set()
    for rank in range(world2):
        plan = EpochPlan(n, batch2, world2, rank, drop_last, start_offset=offset)
        lengths.add(len(plan))
        for spec in plan.batches():
            assert spec.offset_after - spec.size >= offset
            seen += perm.range(spec.start, spec.stop).tolist()
    assert len(lengths) == 1, "every rank takes the same number of steps"
    assert len(seen) == len(set(seen)), "no observation twice"
    if drop_last:
        # what is missing is only the dropped tail of the resumed run
        g2 = batch2 * world2
        expected = offset + ((n - offset) // g2) * g2 if offset < n else offset
        assert len(seen) == min(n, expected)
        assert set(seen) == set(perm.range(0, min(n, expected)).tolist())
    else:
        assert sorted(seen) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 8),
    world=st.integers(1, 6),
    drop_last=st.booleans(),
    offset=st.integers(0, 320),
)
def test_resume_at_any_offset_follows_contract(
    n: int, batch: int, world: int, drop_last: bool, offset: int
) -> None:
    """Resuming at offset o: global batch k holds [o + k*G, o + (k+1)*G), rank blocks in order."""
    g = batch * world
    plans = [EpochPlan(n, batch, world, r, drop_last, start_offset=offset) for r in range(world)]
    steps = {len(p) for p in plans}
    assert len(steps) == 1
    for k in range(steps.pop()):
        blocks = [p.batch(k) for p in plans]
        lo = offset + k * g
        assert [(b.start, b.stop) for b in blocks] == [
            (min(lo + r * batch, n), min(lo + (r + 1) * batch, n)) for r in range(world)
        ]
        assert all(b.offset_after == lo + g for b in blocks)
        if drop_last:
            assert lo + g <= n
        else:
            assert lo < n


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 8),
    world=st.integers(1, 5),
    drop_last=st.booleans(),
    offset=st.integers(0, 100),
    data=st.data(),
)
def test_vectorised_positions_match_the_batches(
    n: int, batch: int, world: int, drop_last: bool, offset: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    plan = EpochPlan(n, batch, world, rank, drop_last, start_offset=offset)
    first = data.draw(st.integers(0, max(0, len(plan))))
    stop = data.draw(st.integers(first, len(plan) + 3))
    positions, sizes = plan.positions(first, stop)
    specs = list(plan.batches(first, stop))
    assert sizes.tolist() == [s.size for s in specs]
    assert positions.tolist() == [p for s in specs for p in range(s.start, s.stop)]
    assert specs == [plan.batch(step) for step in range(first, min(stop, len(plan)))]
    assert all(type(s) is BatchSpec for s in specs)  # (a plain tuple would compare equal)
