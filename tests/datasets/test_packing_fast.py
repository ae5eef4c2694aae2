"""The vectorised window construction of document packing (guideloom/_datasets/packing.py) against the
straightforward one: a Python loop over each row's pieces, for random document lengths, random
windows, both modes, over memory and local (memory-mapped, sharded) storages."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._datasets.packing import PackMode, _BestFitLayout, _Pieces
from guideloom.storage import _local as local
from guideloom.storage.base import Spans

KEYS = ("tokens", "doc_ids", "segment_ids", "position_ids")


def reference_concat(data: np.ndarray, offsets: np.ndarray, row: int, length: int) -> dict[str, np.ndarray]:
    """Row ``row`` of concat mode, one document piece at a time."""
    lo, hi = row * length, (row + 1) * length
    out: dict[str, list[int]] = {k: [] for k in KEYS}
    segment = 0
    for doc, (a, b) in enumerate(itertools.pairwise(offsets.tolist())):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        segment += 1
        out["tokens"] += data[a:b].tolist()
        out["doc_ids"] += [doc] * (b - a)
        out["segment_ids"] += [segment] * (b - a)
        out["position_ids"] += list(range(b - a))
    return {k: np.asarray(v) for k, v in out.items()}


def reference_best_fit(data: np.ndarray, layout: _BestFitLayout, row: int, pad: int) -> dict[str, np.ndarray]:
    """Row ``row`` of best-fit mode from its layout, one piece at a time, then the padding."""
    out: dict[str, list[int]] = {k: [] for k in KEYS}
    for k, p in enumerate(range(int(layout.ptr[row]), int(layout.ptr[row + 1]))):
        start, size = int(layout.start[p]), int(layout.size[p])
        out["tokens"] += data[start : start + size].tolist()
        out["doc_ids"] += [int(layout.doc[p])] * size
        out["segment_ids"] += [k + 1] * size
        out["position_ids"] += list(range(size))
    rest = layout.length - len(out["tokens"])
    for key, value in zip(KEYS, (pad, -1, 0, 0), strict=True):
        out[key] += [value] * rest
    return {k: np.asarray(v) for k, v in out.items()}


def check_window(dataset: gl.PackedDataset, data: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
    got = dataset.read_many_sync(rows)
    assert isinstance(got, gl.PackedRows) and len(got) == len(rows)
    layout = dataset._layout
    for key in KEYS:
        block = got.block(key)
        assert block.shape == (len(rows), dataset.sequence_length)
        for i, row in enumerate(rows.tolist()):
            if isinstance(layout, _BestFitLayout):
                expect = reference_best_fit(data, layout, row, dataset.pad_id)
            else:
                expect = reference_concat(data, offsets, row, dataset.sequence_length)
            assert np.array_equal(block[i], expect[key]), (key, row)
            assert np.array_equal(got[i][key], expect[key]), (key, row)
    assert got.block("segment_ids").dtype == np.int32 and got.block("position_ids").dtype == np.int32


def documents(lengths: Sequence[int], seed: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    data = np.random.default_rng(seed).integers(1, 60_000, sum(lengths), dtype=np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return [data[a:b] for a, b in itertools.pairwise(offsets.tolist())], data, offsets


def check_storage(
    storage: Any, data: np.ndarray, offsets: np.ndarray, length: int, mode: PackMode, seed: int
) -> None:
    dataset = gl.pack(storage, length, mode, pad_id=7)
    asyncio.run(dataset.open())
    rng = np.random.default_rng(seed)
    windows = [np.arange(len(dataset), dtype=np.int64)]
    windows += [rng.integers(0, len(dataset), rng.integers(1, 9)).astype(np.int64) for _ in range(3)]
    for rows in windows:
        check_window(dataset, data, offsets, rows)
    asyncio.run(dataset.close())


lengths_st = st.lists(st.integers(0, 70), min_size=1, max_size=30).filter(lambda v: sum(v) > 0)


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_st,
    length=st.integers(1, 33),
    mode=st.sampled_from(["concat", "best_fit"]),
    seed=st.integers(0, 99),
)
def test_windows_equal_the_per_piece_construction_in_memory(
    lengths: list[int], length: int, mode: PackMode, seed: int
) -> None:
    docs, data, offsets = documents(lengths, seed)
    if mode == "concat" and sum(lengths) < length:
        return  # no sequence at all (test_packing.py checks the error)
    check_storage(gl.MemoryDocumentStorage(docs), data, offsets, length, mode, seed)


@settings(max_examples=40, deadline=None)
@given(
    lengths=lengths_st,
    length=st.integers(1, 33),
    mode=st.sampled_from(["concat", "best_fit"]),
    seed=st.integers(0, 99),
)
def test_windows_equal_the_per_piece_construction_from_local_shards(
    lengths: list[int], length: int, mode: PackMode, seed: int
) -> None:
    """Small shards: spans and rows across shard boundaries take the slow paths too."""
    docs, data, offsets = documents(lengths, seed)
    if mode == "concat" and sum(lengths) < length:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "docs"
        gl.write_documents(path, docs, dtype=np.uint16, shard_bytes=64 if seed % 2 else 1 << 20)
        check_storage(gl.open_documents(path), data, offsets, length, mode, seed)


def test_local_spans_are_one_buffer() -> None:
    """A local span read returns its elements back to back in one buffer, each span a view."""
    docs, data, _ = documents([5, 0, 9, 3, 12], 0)
    with tempfile.TemporaryDirectory() as tmp:
        gl.write_documents(Path(tmp) / "d", docs, dtype=np.uint16)
        storage = gl.open_documents(Path(tmp) / "d")
        asyncio.run(storage.open())
        starts, stops = np.array([20, 0, 7, 7]), np.array([29, 4, 7, 12])
        spans = storage.read_spans_sync(starts, stops)
        assert isinstance(spans, Spans) and len(spans) == 4
        assert np.array_equal(
            spans.buffer, np.concatenate([data[a:b] for a, b in zip(starts, stops, strict=True)])
        )
        for got, a, b in zip(spans, starts.tolist(), stops.tolist(), strict=True):
            assert np.array_equal(got, data[a:b])
        assert np.array_equal(spans[-1], data[7:12]) and len(spans[1:3]) == 2
        spans.buffer[0] = 0  # a copy: writable, and the file is untouched
        assert storage.read_spans_sync(starts[:1], stops[:1])[0][0] == data[20]


def test_concat_pieces_wait_for_the_first_index_array() -> None:
    """A collate of tokens alone never pays for the window's pieces; the first index array
    computes them once, and every later one reuses them."""
    docs, data, offsets = documents([30, 5, 0, 44, 9, 17], 1)
    dataset = gl.pack(gl.MemoryDocumentStorage(docs), 8, "concat")
    asyncio.run(dataset.open())
    rows = dataset.read_many_sync(np.arange(len(dataset), dtype=np.int64))
    assert isinstance(rows, gl.PackedRows)
    window = rows._window
    assert np.array_equal(rows.block("tokens").reshape(-1), data[: len(dataset) * 8])
    assert not isinstance(window._pieces, _Pieces), "tokens alone computed the pieces"
    rows.block("segment_ids")
    pieces = window._pieces
    assert isinstance(pieces, _Pieces)
    rows.block("position_ids")
    assert window._pieces is pieces
    check_window(dataset, data, offsets, np.arange(len(dataset), dtype=np.int64))


@pytest.mark.parametrize("preads", [False, True])
def test_spans_read_into_place_equal_the_spans(monkeypatch: pytest.MonkeyPatch, preads: bool) -> None:
    """``read_spans_into_sync`` writes each span where it is told, from mapped files, through
    ``preadv`` (a dataset over the mapping budget) and through the default (memory storage),
    and touches nothing else of the output."""
    if preads:
        monkeypatch.setattr(local, "MAPPED_BUDGET", 0)
    docs, data, _ = documents([5, 0, 9, 3, 12, 40], 2)
    starts, stops = np.array([20, 0, 7, 7, 29], np.int64), np.array([29, 4, 7, 12, 69], np.int64)
    at = np.array([3, 60, 0, 12, 18], np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        gl.write_documents(Path(tmp) / "d", docs, dtype=np.uint16, shard_bytes=32)
        for storage in (gl.open_documents(Path(tmp) / "d"), gl.MemoryDocumentStorage(docs)):
            asyncio.run(storage.open())
            out = np.full((2, 40), 7, np.uint16)
            storage.read_spans_into_sync(starts, stops, out, at)
            want = np.full(80, 7, np.uint16)
            for a, b, to in zip(starts.tolist(), stops.tolist(), at.tolist(), strict=True):
                want[to : to + b - a] = data[a:b]
            assert np.array_equal(out.reshape(-1), want), type(storage).__name__
