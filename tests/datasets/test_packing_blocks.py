"""Packing over a storage with natural blocks: the packed sequences' own blocks, best fit by
ranges of blocks, and the row-group-aware order they give a loader (``shuffle_block_size="auto"``):
exactly once an epoch, and a resume at any offset with another batch and world size equal to the
uninterrupted run."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.pack_layout import best_fit_decreasing, best_fit_layout
from guideloom._datasets.packing import PackMode
from tests.datasets.test_packing import numbered, reference_best_fit, run_ranks, sample_keys
from tests.support.loader import roundtrip, take

CPU = torch.device("cpu")


class BlockedDocuments(gl.MemoryDocumentStorage):
    """Documents in memory read in runs of ``blocks`` documents (as Parquet row groups are)."""

    def __init__(self, documents: Sequence[np.ndarray], blocks: Sequence[int]) -> None:
        super().__init__(documents)
        self._blocks = np.asarray(blocks, dtype=np.int64)

    def natural_blocks(self) -> npt.NDArray[np.int64]:
        return self._blocks


def blocked(lengths: Sequence[int], blocks: Sequence[int]) -> BlockedDocuments:
    return BlockedDocuments(numbered(lengths), blocks)


def opened(storage: Any, length: int, mode: PackMode, **kw: Any) -> gl.PackedDataset:
    dataset = gl.pack(storage, length, mode, **kw)
    asyncio.run(dataset.open())
    return dataset


@st.composite
def blocked_lengths(draw: st.DrawFn, min_docs: int = 1, max_docs: int = 60) -> tuple[list[int], list[int]]:
    """Document lengths (some empty) and blocks covering them (some empty)."""
    lengths = draw(st.lists(st.integers(0, 30), min_size=min_docs, max_size=max_docs))
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=12)))
    bounds = [0, *cuts, len(lengths)]
    return lengths, [b - a for a, b in itertools.pairwise(bounds)]


def block_of_document(blocks: Sequence[int]) -> np.ndarray:
    return np.repeat(np.arange(len(blocks)), blocks)


@settings(max_examples=200, deadline=None)
@given(data=blocked_lengths(), length=st.integers(1, 17))
def test_concat_blocks_group_sequences_by_the_block_of_their_first_element(
    data: tuple[list[int], list[int]], length: int
) -> None:
    lengths, blocks = data
    if sum(lengths) < length:
        return
    dataset = opened(blocked(lengths, blocks), length, "concat")
    natural = dataset._natural_blocks()
    assert natural is not None and (natural > 0).all() and int(natural.sum()) == len(dataset)
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    block_of = block_of_document(blocks)
    first_blocks = block_of[doc_of[np.arange(len(dataset)) * length]]  # each sequence's first element's
    runs = [len(list(g)) for _, g in itertools.groupby(first_blocks.tolist())]
    assert natural.tolist() == runs
    assert np.array_equal(dataset._natural_blocks(), natural), "kept"


@settings(max_examples=200, deadline=None)
@given(data=blocked_lengths(), length=st.integers(1, 17), fit_group=st.integers(1, 6))
def test_best_fit_by_ranges_of_blocks_keeps_each_sequence_inside_one_range(
    data: tuple[list[int], list[int]], length: int, fit_group: int
) -> None:
    lengths, blocks = data
    if sum(lengths) == 0:
        return
    storage = blocked(lengths, blocks)
    dataset = opened(storage, length, "best_fit", fit_group=fit_group, pad_id=-1)
    natural = dataset._natural_blocks()
    assert natural is not None and (natural > 0).all() and int(natural.sum()) == len(dataset)
    samples = list(dataset.read_many_sync(np.arange(len(dataset), dtype=np.int64)))
    block_of = block_of_document(blocks)
    ends = np.cumsum(natural)
    ranges: list[set[int]] = [set() for _ in natural]  # the blocks each range's sequences read
    elements = np.zeros(len(natural), np.int64)
    for i, s in enumerate(samples):
        docs = s["doc_ids"][s["doc_ids"] >= 0]
        r = int(np.searchsorted(ends, i, side="right"))
        ranges[r] |= set(block_of[docs].tolist())
        elements[r] += len(docs)
    spans = [sorted(r) for r in ranges]
    for a, b in itertools.pairwise(spans):
        assert a[-1] < b[0], "no block read by two ranges; the ranges in block order"
    if len(spans) > 1:  # a short last range joins the one before: short only where it is alone
        assert (elements >= fit_group * length).all(), "a range holds fit_group sequences' worth"
    # every element once, whatever the ranges
    tokens = np.concatenate([s["tokens"][s["doc_ids"] >= 0] for s in samples])
    assert np.array_equal(np.sort(tokens), np.arange(sum(lengths)))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 40))
def test_best_fit_decreasing_closes_every_bin_at_a_cut(data: st.DataObject, capacity: int) -> None:
    ranges = data.draw(st.lists(st.lists(st.integers(1, capacity), max_size=20), min_size=1, max_size=5))
    sizes = [s for r in ranges for s in sorted(r, reverse=True)]
    cuts = np.cumsum([len(r) for r in ranges])[:-1]
    got = best_fit_decreasing(np.asarray(sizes, dtype=np.int64), capacity, cuts).tolist()
    expected, opened_before = [], 0
    for r in ranges:
        own = reference_best_fit(sorted(r, reverse=True), capacity)
        expected += [opened_before + b for b in own]
        opened_before += max(own, default=-1) + 1
    assert got == expected


def test_a_storage_without_blocks_keeps_the_global_layout_and_its_fingerprint() -> None:
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 60, 300).tolist()
    plain = opened(gl.MemoryDocumentStorage(numbered(lengths)), 32, "best_fit")
    assert plain.natural_blocks() is None and plain._fingerprint()["kind"] == "packed-best_fit"
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    whole = best_fit_layout(np.asarray(lengths, np.int64), starts, 32)
    everything = np.arange(len(plain), dtype=np.int64)
    assert len(plain) == len(whole)
    unranged = opened(blocked(lengths, [100, 200]), 32, "best_fit", fit_group=None)
    assert unranged.natural_blocks() is None and unranged._fingerprint()["kind"] == "packed-best_fit"
    assert sample_keys(unranged.read_many_sync(everything)) == sample_keys(plain.read_many_sync(everything))
    assert opened(gl.MemoryDocumentStorage(numbered(lengths)), 32, "concat").natural_blocks() is None


def test_best_fit_by_ranges_costs_little_padding_and_has_its_own_fingerprint() -> None:
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 400, 3000).tolist()
    blocks = [100] * 30
    ranged = opened(blocked(lengths, blocks), 256, "best_fit")
    whole = opened(blocked(lengths, blocks), 256, "best_fit", fit_group=None)
    assert ranged._fingerprint()["kind"] == "packed-best_fit-group64"
    assert whole._fingerprint()["kind"] == "packed-best_fit" and whole.natural_blocks() is None
    assert len(whole) <= len(ranged) <= 1.02 * len(whole)
    with gl.StatefulDataLoader(ranged, sample_keys, local_batch_size=2, device=CPU) as loader:
        take(loader, 1)
        state = roundtrip(loader.state_dict())
    with (
        gl.StatefulDataLoader(whole, sample_keys, local_batch_size=2, device=CPU) as loader,
        pytest.raises(ValueError, match="another dataset"),
    ):
        loader.load_state_dict(state)


def test_fit_group_and_the_storage_blocks_are_checked() -> None:
    with pytest.raises(ValueError, match="fit_group must be >= 1"):
        gl.pack(blocked([3, 4], [2]), 4, "best_fit", fit_group=0)
    with pytest.raises(ValueError, match="summing to its 2 documents"):
        opened(blocked([3, 4], [3]), 4, "best_fit")


@settings(max_examples=25, deadline=None)
@given(
    data=blocked_lengths(min_docs=20),
    mode=st.sampled_from(["concat", "best_fit"]),
    first=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    second=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stop=st.integers(0, 4),
    window=st.integers(1, 3),
)
def test_the_block_order_delivers_each_sequence_once_and_resumes_exactly(
    data: tuple[list[int], list[int]],
    mode: PackMode,
    first: tuple[int, int],
    second: tuple[int, int],
    stop: int,
    window: int,
) -> None:
    lengths, blocks = data
    dataset = opened(blocked([n + 1 for n in lengths], blocks), 8, mode, fit_group=1)
    kw = {
        "shuffle": True,
        "shuffle_seed": 11,
        "drop_last": False,
        "shuffle_block_size": "auto",
        "shuffle_window": window,
    }
    (b1, w1), (b2, w2) = first, second
    if len(dataset) < max(b1 * w1, b2 * w2):
        return
    stop = min(stop, (len(dataset) - 1) // (b1 * w1))
    expected, _ = run_ranks(dataset, 1, local_batch_size=1, **kw)
    read = dataset.read_many_sync(np.arange(len(dataset), dtype=np.int64))
    assert sorted(expected) == sorted(sample_keys(read)), "every sequence once in an epoch"
    before, state = run_ranks(dataset, w1, steps=stop, local_batch_size=b1, **kw)
    after, _ = run_ranks(dataset, w2, state=state, local_batch_size=b2, **kw)
    # drop_last=False pads the final global batch with empty rank blocks: compare what was delivered
    assert before + after == expected[: len(before) + len(after)]
    assert len(before) + len(after) == len(expected)
