"""Epoch orders (``guideloom._core.order``), with no loader: the chunk-aware orders' bijection,
block/window structure and determinism, and exactly-once across ranks and resumes with plans.

The order a loader delivers (rank blocks, ``drop_last``, seeds) is in
``tests/loader/test_order.py``; the block shuffle through the loader in
``tests/loader/test_block_shuffle.py``."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core import permutation
from guideloom._core.order import (
    DEFAULT_WINDOW,
    LOCAL_BLOCK_SIZE,
    LOOKUP_BLOCK,
    REMOTE_BLOCK_BYTES,
    BlockPermutation,
    default_block_size,
    make_order,
)
from guideloom._core.plan import EpochPlan, Permutation, num_batches

sizes = st.integers(0, 700)
block_sizes = st.one_of(st.integers(1, 40), st.integers(1, 2000))  # also block > N
windows = st.one_of(st.integers(1, 8), st.integers(1, 200))  # also window > number of blocks
seeds = st.integers(0, 2**40)
epochs = st.integers(0, 1000)


def _order(n: int, seed: int, epoch: int, block: int, window: int) -> np.ndarray:
    return BlockPermutation(n, seed=seed, epoch=epoch, block_size=block, window=window).range(0, n)


@settings(max_examples=400, deadline=None)
@given(n=sizes, block=block_sizes, window=windows, seed=seeds, epoch=epochs)
def test_a_bijection_for_any_n_block_and_window(
    n: int, block: int, window: int, seed: int, epoch: int
) -> None:
    out = _order(n, seed, epoch, block, window)
    assert out.dtype == np.int64
    assert out.shape == (n,)
    assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize(
    ("n", "block", "window"),
    [
        (0, 1, 1),
        (0, 8, 16),
        (1, 1, 1),
        (1, 8, 16),
        (2, 3, 1),
        (48_828, 8, 16),
        (48_828, 128, 16),
        (48_828, 1024, 16),
        (48_828, 1000, 7),
        (48_829, 2**14, 1),
        (2**16, 256, 16),
        (2**16 + 1, 256, 16),
        (100_003, 17, 3),
        (100_003, 100_004, 4),
    ],
)
def test_bijection_at_fixed_sizes(n: int, block: int, window: int) -> None:
    out = _order(n, 99, 2, block, window)
    assert np.array_equal(np.sort(out), np.arange(n))


def _check_block_structure(out: np.ndarray, n: int, block: int, window: int) -> None:
    """Each window of ``window`` consecutive blocks (by first appearance) holds exactly its blocks."""
    num_blocks = -(-n // block)
    block_of = out // block
    first = np.full(num_blocks, n)
    np.minimum.at(first, block_of, np.arange(n))
    in_order = np.argsort(first, kind="stable")
    sizes_in_order = np.minimum(block, n - in_order * block)
    start = 0
    for w0 in range(0, num_blocks, window):
        members = in_order[w0 : w0 + window]
        stop = start + int(sizes_in_order[w0 : w0 + window].sum())
        assert set(block_of[start:stop].tolist()) == set(members.tolist())
        start = stop
    assert start == n


@settings(max_examples=300, deadline=None)
@given(n=sizes, block=block_sizes, window=windows, seed=seeds, epoch=epochs)
def test_each_window_is_exactly_the_union_of_its_blocks(
    n: int, block: int, window: int, seed: int, epoch: int
) -> None:
    _check_block_structure(_order(n, seed, epoch, block, window), n, block, window)


@settings(max_examples=300, deadline=None)
@given(n=sizes, block=block_sizes, window=windows, seed=seeds, epoch=epochs)
def test_window_end_is_where_a_window_of_whole_blocks_ends(
    n: int, block: int, window: int, seed: int, epoch: int
) -> None:
    perm = BlockPermutation(n, seed=seed, epoch=epoch, block_size=block, window=window)
    out = perm.range(0, n)
    start = 0
    while start < n:
        end = perm.window_end(start)
        assert start < end <= n
        assert all(perm.window_end(p) == end for p in range(start, end))
        blocks = np.unique(out[start:end] // block)
        assert int(np.minimum(block, n - blocks * block).sum()) == end - start, "whole blocks only"
        start = end


def test_window_ends_after_the_short_block_are_off_the_span_multiples() -> None:
    n, block, window = 48_828, 1000, 16  # 48 full blocks and one of 828 samples
    for epoch in range(8):
        perm = BlockPermutation(n, seed=5, epoch=epoch, block_size=block, window=window)
        ends, start = [], 0
        while start < n:
            start = perm.window_end(start)
            ends.append(start)
        short = next(i for i, e in enumerate(ends) if e % perm.span)
        assert all(e % perm.span == perm.span - 172 for e in ends[short:-1])
        assert ends[-1] == n


def test_block_structure_at_the_benchmark_size_with_a_short_block() -> None:
    n, block, window = 48_828, 1000, 16  # 48 full blocks and one of 828 samples
    out = _order(n, 5, 0, block, window)
    _check_block_structure(out, n, block, window)


def test_samples_are_mixed_within_a_window_and_blocks_are_permuted() -> None:
    n, block, window = 48_828, 8, 16
    out = _order(n, 1, 0, block, window)
    batches = out[: (n // 16) * 16].reshape(-1, 16) // block
    distinct = np.array([len(set(row.tolist())) for row in batches])
    assert distinct.mean() > 8  # a batch of 16 from a window of 16 blocks: ~10.3 distinct blocks
    aligned = 48_832  # a multiple of the block: window 1 makes every batch exactly two whole blocks
    one_window = _order(aligned, 1, 0, block, 1).reshape(-1, 16) // block
    assert all(len(set(row.tolist())) == 2 for row in one_window)
    # the blocks' order is not the identity, and neighbouring windows are far apart in the data
    firsts = out[:: block * window] // block
    assert not np.array_equal(np.sort(firsts), firsts)
    assert np.mean(np.abs(np.diff(out[:: block * window]))) > n / 10


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), seed=seeds, epoch=epochs)
def test_block_one_window_one_is_exactly_the_global_row_shuffle(n: int, seed: int, epoch: int) -> None:
    expected = Permutation(n, shuffle=True, seed=seed, epoch=epoch).range(0, n)
    assert np.array_equal(_order(n, seed, epoch, 1, 1), expected)


def test_deterministic_and_different_across_epochs_seeds_and_settings() -> None:
    n = 5003
    a = _order(n, 1, 0, 8, 4)
    assert np.array_equal(a, _order(n, 1, 0, 8, 4))
    assert not np.array_equal(a, _order(n, 1, 1, 8, 4))
    assert not np.array_equal(a, _order(n, 2, 0, 8, 4))
    assert not np.array_equal(a, _order(n, 1, 0, 8, 5))
    assert not np.array_equal(a, _order(n, 1, 0, 9, 4))
    assert not np.array_equal(a, np.arange(n))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(50, 2000), block=st.integers(2, 64), window=st.integers(1, 16), seed=seeds)
def test_epochs_give_different_orders(n: int, block: int, window: int, seed: int) -> None:
    assert not np.array_equal(_order(n, seed, 0, block, window), _order(n, seed, 1, block, window))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), block=block_sizes, window=windows, seed=seeds, data=st.data())
def test_take_equals_scalar_lookups(n: int, block: int, window: int, seed: int, data: st.DataObject) -> None:
    perm = BlockPermutation(n, seed=seed, epoch=3, block_size=block, window=window)
    positions = data.draw(st.lists(st.integers(0, n - 1), max_size=60), label="positions")
    assert perm.take(np.array(positions, dtype=np.int64)).tolist() == [perm[p] for p in positions]
    start = data.draw(st.integers(0, n), label="start")
    stop = data.draw(st.integers(start, n), label="stop")
    assert perm.range(start, stop).tolist() == [perm[p] for p in range(start, stop)]


def test_take_of_a_whole_shuffled_epoch_matches_scalar_lookups() -> None:
    n = 20_011
    perm = BlockPermutation(n, seed=8, epoch=1, block_size=37, window=5)
    positions = np.random.default_rng(0).permutation(n)
    assert perm.take(positions).tolist() == [perm[int(p)] for p in positions]
    assert perm.take(positions.reshape(-1, 1)).shape == (n, 1)
    assert perm.take(np.zeros(0, dtype=np.int64)).shape == (0,)
    assert len(perm) == n


@pytest.mark.parametrize("n", [2, 3, 17, 1000, 48_828, 65_537, 5_000_011])
def test_tabulated_rounds_give_the_computed_permutation(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup large enough tabulates each round's function of a half: the same order as the
    rounds computed (and as the scalar lookups)."""
    positions = np.random.default_rng(n).integers(0, n, 3 * 2**13)
    tabulated = Permutation(n, shuffle=True, seed=5, epoch=2)
    got = tabulated.take(positions)
    assert tabulated._tables is not None
    monkeypatch.setattr(permutation, "TABLE_BITS", 0)
    computed = Permutation(n, shuffle=True, seed=5, epoch=2)
    assert np.array_equal(got, computed.take(positions))
    assert computed._tables is None
    assert got[:50].tolist() == [computed[int(p)] for p in positions[:50]]
    sent = pickle.loads(pickle.dumps(tabulated))  # sent without its tables, which it makes again
    assert sent._tables is None and len(pickle.dumps(tabulated)) < 1024
    assert np.array_equal(sent.take(positions), got)


def test_huge_domain_is_o1() -> None:
    n = 10**15 + 7  # a short last block
    perm = BlockPermutation(n, seed=7, epoch=0, block_size=4096, window=16)
    positions = np.array([0, 1, 4095, 4096, n // 2, n - 4097, n - 2, n - 1], dtype=np.int64)
    values = perm.take(positions)
    assert values.tolist() == [perm[int(p)] for p in positions]
    assert all(0 <= v < n for v in values.tolist())
    assert len(set(values.tolist())) == len(positions)


def test_out_of_range_positions_raise() -> None:
    perm = BlockPermutation(10, seed=0, epoch=0, block_size=3, window=2)
    for bad in (10, -1):
        with pytest.raises(IndexError):
            perm[bad]
    with pytest.raises(IndexError):
        perm.take(np.array([3, -1]))
    with pytest.raises(IndexError):
        perm.take(np.array([10]))
    with pytest.raises(IndexError):
        BlockPermutation(0, seed=0, epoch=0, block_size=3, window=2)[0]


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="n >= 0"):
        BlockPermutation(-1, seed=0, epoch=0, block_size=2, window=2)
    with pytest.raises(ValueError, match="shuffle_block_size"):
        BlockPermutation(5, seed=0, epoch=0, block_size=0, window=2)
    with pytest.raises(ValueError, match="shuffle_window"):
        BlockPermutation(5, seed=0, epoch=0, block_size=2, window=0)
    with pytest.raises(ValueError, match="shuffle_block_size"):
        make_order(5, shuffle=True, seed=0, epoch=0, block_size=0)
    with pytest.raises(ValueError, match="shuffle_window"):
        make_order(5, shuffle=False, seed=0, epoch=0, window=0)


def test_make_order_picks_identity_global_or_blocks() -> None:
    n = 1000
    ident = make_order(n, shuffle=False, seed=3, epoch=1, block_size=64, window=4)
    assert ident.range(0, n).tolist() == list(range(n))
    glob = make_order(n, shuffle=True, seed=3, epoch=1, block_size=1, window=4)
    assert isinstance(glob, Permutation)
    assert np.array_equal(glob.range(0, n), Permutation(n, shuffle=True, seed=3, epoch=1).range(0, n))
    blocks = make_order(n, shuffle=True, seed=3, epoch=1, block_size=64, window=4)
    assert isinstance(blocks, BlockPermutation)
    assert np.array_equal(blocks.range(0, n), _order(n, 3, 1, 64, 4))
    default = make_order(n, shuffle=True, seed=3, epoch=1, block_size=64)
    assert np.array_equal(default.range(0, n), _order(n, 3, 1, 64, DEFAULT_WINDOW))


def test_default_block_size() -> None:
    assert REMOTE_BLOCK_BYTES == 4 * 1024 * 1024
    assert LOCAL_BLOCK_SIZE == 1
    assert default_block_size(4096) == 1024  # 2048 uint16 tokens per sample
    assert default_block_size(3000) == 1398
    assert default_block_size(8 * 1024 * 1024) == 1  # a sample larger than the target
    assert default_block_size(100, target_bytes=1000) == 10
    with pytest.raises(ValueError, match="sample_nbytes"):
        default_block_size(0)
    with pytest.raises(ValueError, match="target_bytes"):
        default_block_size(10, target_bytes=0)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 400),
    block=st.integers(1, 30),
    window=st.integers(1, 8),
    batch=st.integers(1, 9),
    world=st.integers(1, 5),
    drop_last=st.booleans(),
    seed=seeds,
    data=st.data(),
)
def test_ranks_disjoint_and_resume_with_another_layout_sees_every_sample_once(
    n: int,
    block: int,
    window: int,
    batch: int,
    world: int,
    drop_last: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    """Exactly once across ranks, before a checkpoint at any offset and after resuming elsewhere."""
    order = make_order(n, shuffle=True, seed=seed, epoch=2, block_size=block, window=window)
    offset = data.draw(st.integers(0, n), label="checkpoint offset")
    # before the checkpoint: the ranks of the first layout, up to `offset` (any offset: the loader
    # may have been resumed there already), each rank's batches disjoint from the others'
    seen: list[int] = []
    per_rank: list[set[int]] = []
    for rank in range(world):
        plan = EpochPlan(n, batch, world, rank, drop_last=False)
        mine = [
            i
            for spec in plan.batches()
            for i in order.range(min(spec.start, offset), min(spec.stop, offset)).tolist()
        ]
        per_rank.append(set(mine))
        seen += mine
    assert sum(len(s) for s in per_rank) == len(set().union(*per_rank)), "ranks overlap"
    assert sorted(seen) == sorted(order.range(0, offset).tolist())
    # resume with another batch size and world size
    batch2 = data.draw(st.integers(1, 9), label="resumed batch size")
    world2 = data.draw(st.integers(1, 5), label="resumed world size")
    resumed: list[int] = []
    lengths = set()
    for rank in range(world2):
        plan = EpochPlan(n, batch2, world2, rank, drop_last, start_offset=offset)
        lengths.add(len(plan))
        positions, _ = plan.positions(0, len(plan))
        resumed += order.take(positions).tolist()
    assert len(lengths) == 1
    total = seen + resumed
    assert len(total) == len(set(total)), "no sample twice"
    g2 = batch2 * world2
    end = offset + ((n - offset) // g2) * g2 if drop_last else n
    assert sorted(total) == sorted(order.range(0, end).tolist())
    if not drop_last:
        assert sorted(total) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 300),
    block=st.integers(2, 20),
    window=st.integers(1, 6),
    batch=st.integers(1, 8),
    world=st.integers(1, 4),
    seed=seeds,
    data=st.data(),
)
def test_resume_equals_the_uninterrupted_order(
    n: int, block: int, window: int, batch: int, world: int, seed: int, data: st.DataObject
) -> None:
    """Global batches after resuming at offset o, with a new layout, are the order's own slices."""
    order = make_order(n, shuffle=True, seed=seed, epoch=0, block_size=block, window=window)
    uninterrupted = order.range(0, n).tolist()
    offset = data.draw(st.integers(0, n), label="offset")
    g = batch * world
    plans = [EpochPlan(n, batch, world, r, drop_last=False, start_offset=offset) for r in range(world)]
    for step in range(num_batches(n, g, False, offset)):
        got = [i for p in plans for i in order.range(p.batch(step).start, p.batch(step).stop).tolist()]
        assert got == uninterrupted[offset + step * g : offset + (step + 1) * g]


def test_orders_are_the_same_in_every_release() -> None:
    """A checkpoint resumes the order it was written in: the seeded orders never change from one
    release to the next (the digest of a few of them, as this release computes them)."""
    h = hashlib.sha256()
    for n in (1, 2, 3, 17, 1000, 123457):
        for seed in (0, 7):
            h.update(Permutation(n, shuffle=True, seed=seed, epoch=3).take(np.arange(n)).tobytes())
    for n, b in ((1000, 7), (100000, 64), (5, 2)):
        h.update(BlockPermutation(n, block_size=b, seed=3, epoch=1, window=4).take(np.arange(n)).tobytes())
    assert h.hexdigest() == "56bf6732aa8508fd0f03cbad39b524ac379658fdf1339e35ce4f948fa8c125d5"


def test_orders_declare_what_reads_follow() -> None:
    """Every order answers ``span``, ``window_end`` and ``lookup_block``: the loader reads the
    attributes, never probes for them."""
    perm = make_order(1000, shuffle=True, seed=1, epoch=0)
    assert isinstance(perm, Permutation)
    assert (perm.span, perm.window_end(5), perm.lookup_block) == (0, 1000, LOOKUP_BLOCK)
    block = make_order(1000, shuffle=True, seed=1, epoch=0, block_size=10, window=4)
    assert isinstance(block, BlockPermutation)
    assert block.span == 40 and block.window_end(5) == 40 and block.lookup_block == LOOKUP_BLOCK
