"""Concat packing by blocks: each block cut on its own, the tails cut together last."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.pack_layout import block_counts, block_pieces, tails_count


def _sequences(totals: list[int], length: int) -> list[list[tuple[int, int]]]:
    """Every sequence of the layout as its elements ``(block, local element)``, in index order:
    each block's, then the tails run's."""
    arr = np.asarray(totals, dtype=np.int64)
    counts = block_counts(arr, length)
    tails = len(totals)
    blocks = np.repeat(np.arange(tails), counts)
    seqs = np.concatenate([np.arange(c) for c in counts.tolist()] + [np.zeros(0, np.int64)]).astype(np.int64)
    nt = tails_count(arr, length)
    blocks = np.concatenate([blocks, np.full(nt, tails)]).astype(np.int64)
    seqs = np.concatenate([seqs, np.arange(nt)]).astype(np.int64)
    p = block_pieces(blocks, seqs, length, arr, tails)
    out: list[list[tuple[int, int]]] = [[] for _ in range(len(blocks))]
    for row, block, lo, hi, at in zip(p.row, p.block, p.lo, p.hi, p.at, strict=True):
        assert at == len(out[row]), "pieces fill their row from column 0, in order"
        out[row].extend((int(block), e) for e in range(lo, hi))
    return out


@settings(max_examples=300, deadline=None)
@given(totals=st.lists(st.integers(0, 60), min_size=1, max_size=20), length=st.integers(1, 17))
def test_blocks_then_tails_are_lossless(totals: list[int], length: int) -> None:
    seqs = _sequences(totals, length)
    assert all(len(s) == length for s in seqs)
    assert len(seqs) == sum(totals) // length  # as many as the whole concatenation cut
    flat = [e for s in seqs for e in s]
    assert len(set(flat)) == len(flat)  # no element twice
    everything = {(b, e) for b, t in enumerate(totals) for e in range(t)}
    assert set(flat) <= everything
    # only the tails run's last (sum of tails) % length elements are left out
    assert len(everything) - len(flat) == sum(totals) % length
    left = everything - set(flat)
    tails = [(b, e) for b, t in enumerate(totals) for e in range(t - t % length, t)]
    assert left == set(tails[len(tails) - len(left) :])


@settings(max_examples=200, deadline=None)
@given(
    totals=st.lists(st.integers(0, 60), min_size=2, max_size=12),
    length=st.integers(1, 17),
    other=st.integers(0, 60),
    data=st.data(),
)
def test_a_blocks_sequences_depend_on_that_block_alone(
    totals: list[int], length: int, other: int, data: st.DataObject
) -> None:
    b = data.draw(st.integers(0, len(totals) - 1))
    changed = list(totals)
    changed[(b + 1) % len(totals)] = other
    for t in (totals, changed):
        assert int(block_counts(np.asarray(t), length)[b]) == totals[b] // length
    c = totals[b] // length
    if c:
        seqs = np.arange(c, dtype=np.int64)
        blocks = np.full(c, b, dtype=np.int64)
        got = block_pieces(blocks, seqs, length, None, len(totals))
        assert (got.lo == seqs * length).all() and (got.hi == got.lo + length).all()
