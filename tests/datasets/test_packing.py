"""Document packing (``guideloom/_datasets/packing.py``): every element once, the attention
indices agree with the boundaries, best-fit keeps documents whole, resume equals the
uninterrupted run; then the vectorised window construction against the straightforward one (a
Python loop over each row's pieces) for random document lengths, random windows, both modes,
over memory and local (memory-mapped, sharded) storages."""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.pack_layout import BestFitLayout, Pieces, best_fit_decreasing, best_fit_layout
from guideloom._datasets.packing import PackMode
from guideloom.storage._local import _sharded
from guideloom.storage.base import Spans
from tests.support import ROOT
from tests.support.loader import roundtrip, take

lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=40)


def numbered(lengths: Sequence[int]) -> list[np.ndarray]:
    """Documents whose elements are their own positions in the concatenation of all of them."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return [np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(offsets.tolist())]


def open_packed(docs: Sequence[np.ndarray], length: int, mode: PackMode, **kw: Any) -> gl.PackedDataset:
    dataset = gl.pack(gl.MemoryDocumentStorage(docs), length, mode, **kw)
    asyncio.run(dataset.open())
    return dataset


def read_all(dataset: gl.PackedDataset) -> list[dict[str, np.ndarray]]:
    return list(dataset.read_many_sync(np.arange(len(dataset), dtype=np.int64)))


def check_indices(sample: dict[str, np.ndarray], doc_of: np.ndarray) -> None:
    """doc_ids name each element's document; segment ids step at each boundary; positions restart."""
    tokens, docs, seg, pos = (sample[k] for k in ("tokens", "doc_ids", "segment_ids", "position_ids"))
    real = seg > 0
    assert np.array_equal(docs[real], doc_of[tokens[real]])
    assert np.all(docs[~real] == -1) and np.all(pos[~real] == 0)
    assert np.all(real[: int(real.sum())]), "padding only at the end"
    k = int(real.sum())
    new = np.r_[True, docs[1:k] != docs[: k - 1]] if k else np.zeros(0, bool)
    assert np.array_equal(seg[:k], np.cumsum(new)), "a segment per piece, numbered from 1"
    expect = np.arange(k) - np.maximum.accumulate(np.where(new, np.arange(k), 0))
    assert np.array_equal(pos[:k], expect), "positions count from 0 at each piece"
    assert seg.dtype == np.int32 and pos.dtype == np.int32 and docs.dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, length=st.integers(1, 17))
def test_concat_holds_every_element_once_in_order(lengths: list[int], length: int) -> None:
    docs = numbered(lengths)
    total = sum(lengths)
    if total < length:
        with pytest.raises(ValueError, match=r"fewer than one sequence|all empty"):
            open_packed(docs, length, "concat")
        return
    dataset = open_packed(docs, length, "concat")
    assert len(dataset) == total // length
    samples = read_all(dataset)
    flat = np.concatenate([s["tokens"] for s in samples])
    assert np.array_equal(flat, np.arange(len(dataset) * length)), "each element once, in order"
    doc_of = np.repeat(np.arange(len(docs)), lengths)
    for s in samples:
        assert all(len(v) == length for v in s.values())
        assert np.all(s["segment_ids"] > 0), "concat has no padding"
        check_indices(s, doc_of)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, length=st.integers(1, 17))
def test_best_fit_keeps_each_document_whole_or_splits_it_as_documented(
    lengths: list[int], length: int
) -> None:
    docs = numbered(lengths)
    if sum(lengths) == 0:
        with pytest.raises(ValueError, match="all empty"):
            open_packed(docs, length, "best_fit")
        return
    dataset = open_packed(docs, length, "best_fit", pad_id=-7)
    samples = read_all(dataset)
    doc_of = np.repeat(np.arange(len(docs)), lengths)
    pieces: dict[int, list[np.ndarray]] = {}
    for s in samples:
        check_indices(s, doc_of)
        real = s["segment_ids"] > 0
        assert real.any() and np.all(s["tokens"][~real] == -7)
        for seg in np.unique(s["segment_ids"][real]).tolist():
            piece = s["tokens"][s["segment_ids"] == seg]
            pieces.setdefault(int(doc_of[piece[0]]), []).append(piece)
    for d, n in enumerate(lengths):
        got = sorted(pieces.get(d, []), key=lambda p: int(p[0]))
        assert sum(len(p) for p in got) == n, "every element once"
        if n:
            assert np.array_equal(np.concatenate(got), docs[d]), "in order"
        # documented split: whole sequence_length pieces, then one remainder (if any)
        assert [len(p) for p in got] == [length] * (n // length) + ([n % length] if n % length else [])
    # a sequence is opened only when no open one has room: at most one is at most half full
    fill = [int((s["segment_ids"] > 0).sum()) for s in samples]
    assert sum(f * 2 <= length for f in fill) <= 1 or length == 1


def reference_best_fit(sizes: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing the slow way: least room that fits, ties to the latest to reach it."""
    room: list[int] = []
    stamp: list[int] = []
    out = []
    for t, s in enumerate(sizes):
        fits = [b for b in range(len(room)) if room[b] >= s]
        if fits:
            b = min(fits, key=lambda b: (room[b], -stamp[b]))
        else:
            b = len(room)
            room.append(capacity)
            stamp.append(t)
        room[b] -= s
        stamp[b] = t
        out.append(b)
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 70))
def test_best_fit_decreasing_matches_the_reference(data: st.DataObject, capacity: int) -> None:
    sizes = sorted(data.draw(st.lists(st.integers(1, capacity), max_size=60)), reverse=True)
    got = best_fit_decreasing(np.asarray(sizes, dtype=np.int64), capacity).tolist()
    assert got == reference_best_fit(sizes, capacity)


def test_best_fit_layout_is_a_pure_function_of_the_lengths() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 3000, 5000).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    a, b = best_fit_layout(lengths, starts, 1024), best_fit_layout(lengths.copy(), starts.copy(), 1024)
    for name in ("ptr", "doc", "start", "size"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    per_bin = np.add.reduceat(a.size.astype(np.int64), a.ptr[:-1])
    assert per_bin.max() <= 1024 and per_bin.sum() == lengths.sum()
    assert per_bin.mean() > 0.95 * 1024, "best fit packs tightly"


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_async_reads_equal_sync_reads_in_any_order(mode: PackMode) -> None:
    docs = numbered([5, 0, 3, 9, 1, 7, 2, 4, 30, 1])
    dataset = open_packed(docs, 4, mode)
    order = np.random.default_rng(0).permutation(len(dataset)).astype(np.int64)
    sync = dataset.read_many_sync(order)
    got = asyncio.run(dataset.read_many(order))
    for a, b in zip(sync, got, strict=True):
        for k in a:
            assert np.array_equal(a[k], b[k])
    for i, s in zip(order.tolist(), sync, strict=True):
        single = dataset.read_many_sync(np.asarray([i], dtype=np.int64))[0]
        assert all(np.array_equal(single[k], s[k]) for k in s)


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_local_files_read_the_same_sequences_as_memory(tmp_path: Path, mode: PackMode) -> None:
    rng = np.random.default_rng(8)
    docs = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in rng.integers(0, 500, 300)]
    gl.write_documents(tmp_path / "docs", docs, shard_bytes=20_000)  # several shards
    memory = open_packed(docs, 128, mode, pad_id=65_535)
    local = gl.pack(gl.open_documents(tmp_path / "docs"), 128, mode, pad_id=65_535)
    asyncio.run(local.open())
    assert len(local) == len(memory)
    order = rng.permutation(len(local)).astype(np.int64)
    for reader in (local.read_many_sync, lambda i: asyncio.run(local.read_many(i))):
        for a, b in zip(reader(order), memory.read_many_sync(order), strict=True):
            assert a["tokens"].dtype == np.uint16
            assert all(np.array_equal(a[k], b[k]) for k in a)


class SpyStorage(gl.MemoryDocumentStorage):
    """Counts the storage calls a read makes."""

    def __init__(self, docs: Sequence[np.ndarray]) -> None:
        super().__init__(docs)
        self.calls: list[str] = []

    def read_spans_sync(self, starts: np.ndarray, stops: np.ndarray) -> Sequence[Any]:
        self.calls.append(f"spans:{int((stops - starts).sum())}")
        return super().read_spans_sync(starts, stops)


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_read_reads_only_its_sequences_in_one_call(mode: PackMode) -> None:
    storage = SpyStorage(numbered([100, 7, 300, 12, 5, 60]))
    dataset = gl.pack(storage, 16, mode)
    asyncio.run(dataset.open())
    storage.calls.clear()
    got = dataset.read_many_sync(np.asarray([3, 1, 5], dtype=np.int64))
    real = sum(int((s["segment_ids"] > 0).sum()) for s in got)
    assert storage.calls == [f"spans:{real}"]


def packed_loader(dataset: gl.PackedDataset, **kw: Any) -> gl.StatefulDataLoader[Any, list[tuple[int, ...]]]:
    kw.setdefault("device", torch.device("cpu"))
    return gl.StatefulDataLoader(dataset, sample_keys, **kw)


def sample_keys(samples: Sequence[dict[str, np.ndarray]]) -> list[tuple[int, ...]]:
    return [tuple(s["tokens"].tolist()) for s in samples]


def run_ranks(
    dataset: gl.PackedDataset, world: int, state: Any = None, steps: int | None = None, **kw: Any
) -> tuple[list[tuple[int, ...]], Any]:
    """The global order of samples that ``world`` ranks deliver (ranks' batches interleaved by
    step), and the checkpoint after ``steps`` steps."""
    per_rank = []
    saved = None
    for rank in range(world):
        with packed_loader(dataset, rank=rank, world_size=world, **kw) as loader:
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append(take(loader, steps))
            saved = roundtrip(loader.state_dict())
    order = [key for step in zip(*per_rank, strict=True) for batch in step for key in batch]
    return order, saved


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=20, max_size=60),
    mode=st.sampled_from(["concat", "best_fit"]),
    first=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    second=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stop=st.integers(0, 4),
    shuffle=st.booleans(),
)
def test_resume_with_another_batch_and_world_size_equals_the_uninterrupted_run(
    lengths: list[int],
    mode: PackMode,
    first: tuple[int, int],
    second: tuple[int, int],
    stop: int,
    shuffle: bool,
) -> None:
    docs = numbered([n + 1 for n in lengths])
    dataset = open_packed(docs, 8, mode)
    kw = {"shuffle": shuffle, "shuffle_seed": 11, "drop_last": False}
    (b1, w1), (b2, w2) = first, second
    if len(dataset) < max(b1 * w1, b2 * w2):
        return
    stop = min(stop, (len(dataset) - 1) // (b1 * w1))  # stop inside the epoch
    expected, _ = run_ranks(dataset, 1, local_batch_size=1, **kw)
    assert sorted(expected) == sorted(set(expected)), "no sequence twice in an epoch"
    before, state = run_ranks(dataset, w1, steps=stop, local_batch_size=b1, **kw)
    after, _ = run_ranks(dataset, w2, state=state, local_batch_size=b2, **kw)
    # drop_last=False pads the final global batch with empty rank blocks: compare what was delivered
    assert before + after == expected[: len(before) + len(after)] and len(before) + len(after) == len(
        expected
    )


def test_ranks_receive_disjoint_sequences() -> None:
    docs = numbered(list(np.random.default_rng(2).integers(1, 50, 200)))
    dataset = open_packed(docs, 32, "best_fit")
    seen: list[tuple[int, ...]] = []
    for rank in range(3):
        with packed_loader(
            dataset, rank=rank, world_size=3, local_batch_size=4, shuffle=True, shuffle_seed=5
        ) as loader:
            seen += [key for batch in take(loader) for key in batch]
    assert len(seen) == len(set(seen)) == (len(dataset) // 12) * 12


def test_a_checkpoint_over_another_packing_is_refused() -> None:
    docs = numbered([40] * 30)
    concat, best_fit = open_packed(docs, 16, "concat"), open_packed(docs, 16, "best_fit")
    other_length = open_packed(docs, 20, "concat")
    with packed_loader(concat, local_batch_size=2) as loader:
        take(loader, 2)
        state = roundtrip(loader.state_dict())
    assert state["dataset"]["kind"] == "packed-concat" and state["dataset"]["sequence_length"] == 16
    for other in (best_fit, other_length):
        with (
            packed_loader(other, local_batch_size=2) as loader,
            pytest.raises(ValueError, match="another dataset"),
        ):
            loader.load_state_dict(state)
    with packed_loader(open_packed(docs, 16, "concat"), local_batch_size=2) as loader:
        loader.load_state_dict(state)  # the same packing of the same documents: accepted
        assert loader.state_dict()["observation_offset"] == 4


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    docs = gl.MemoryDocumentStorage(numbered([3, 4]))
    with pytest.raises(ValueError, match="sequence_length must be >= 1"):
        gl.pack(docs, 0)
    with pytest.raises(TypeError, match="sequence_length must be an int"):
        gl.pack(docs, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown packing mode 'greedy'"):
        gl.pack(docs, 4, "greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds no documents"):
        gl.pack(gl.MemoryDocumentStorage([]), 4)
    with pytest.raises(TypeError, match="a stream storage has none"):
        gl.pack(gl.MemoryStreamStorage(np.arange(10)), 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a DocumentStorageAbstract"):
        gl.pack([np.arange(3)], 4)  # type: ignore[arg-type]
    small = gl.MemoryDocumentStorage([np.arange(3, dtype=np.uint8)])
    with pytest.raises(ValueError, match="pad_id=300 does not fit"):
        gl.pack(small, 4, "best_fit", pad_id=300)
    with pytest.raises(ValueError, match="all empty"):
        asyncio.run(gl.pack(gl.MemoryDocumentStorage([np.arange(0)] * 3), 4).open())
    with pytest.raises(RuntimeError, match="open it first"):
        gl.pack(docs, 4).read_many_sync(np.zeros(1, dtype=np.int64))
    # document storage with a sequence_length and no packing stays refused by from_storage
    with pytest.raises(ValueError, match="takes no sequence_length"):
        gl.StatefulDataLoader.from_storage(docs, list, sequence_length=4, device=torch.device("cpu"))  # type: ignore[call-overload]


def test_custom_storage_with_only_async_reads_is_packed_through_read_many() -> None:
    class AsyncOnly(gl.DocumentStorageAbstract[Any, np.ndarray]):
        def __init__(self, docs: list[np.ndarray]) -> None:
            self.docs = docs
            self.reads = 0

        def __len__(self) -> int:
            return len(self.docs)

        @property
        def dtype(self) -> np.dtype[Any]:
            return np.dtype(np.int64)

        async def read_many(self, indices: np.ndarray) -> Sequence[np.ndarray]:
            self.reads += 1
            return [self.docs[i] for i in indices.tolist()]

    docs = numbered([9, 2, 14, 1, 6])
    storage = AsyncOnly(docs)
    for mode in ("concat", "best_fit"):
        dataset = gl.pack(storage, 4, mode)  # type: ignore[arg-type]
        asyncio.run(dataset.open())
        assert not dataset._reads_inline
        expect = read_all(open_packed(docs, 4, mode))
        got = asyncio.run(dataset.read_many(np.arange(len(dataset), dtype=np.int64)))
        for a, b in zip(got, expect, strict=True):
            assert all(np.array_equal(a[k], b[k]) for k in a)


def test_samples_are_read_only_mappings_that_pickle_as_dicts() -> None:
    dataset = open_packed(numbered([5, 3, 9]), 4, "best_fit", pad_id=-1)
    sample = dataset.read_many_sync(np.asarray([1], dtype=np.int64))[0]
    assert list(sample) == ["tokens", "doc_ids", "segment_ids", "position_ids"] and len(sample) == 4
    with pytest.raises(KeyError):
        sample["loss_mask"]
    copy = pickle.loads(pickle.dumps(sample))
    assert type(copy) is dict and all(np.array_equal(copy[k], sample[k]) for k in sample)
    assert "tokens" in repr(sample)


def test_process_workers_collate_packed_samples() -> None:
    docs = numbered(list(np.random.default_rng(4).integers(1, 30, 120)))
    dataset = open_packed(docs, 16, "concat")
    expected, _ = run_ranks(dataset, 1, local_batch_size=4, shuffle=True, shuffle_seed=2)
    got, _ = run_ranks(
        dataset, 1, local_batch_size=4, shuffle=True, shuffle_seed=2, num_workers=2, parallel_method="process"
    )
    assert got == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["best_fit", "concat"])
@pytest.mark.slow
def test_the_packing_example_runs(mode: str, tmp_path: Path) -> None:
    root = ROOT
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(root / "examples" / "packing.py"),
            "--mode",
            mode,
            "--steps",
            "10",
            "--corpus-mb",
            "0.3",
            "--data",
            str(tmp_path / "docs"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed run == uninterrupted run" in proc.stdout


def test_a_fresh_process_loads_a_checkpoint_before_opening_the_loader(tmp_path: Path) -> None:
    docs = [np.arange(n, dtype=np.int32) for n in np.random.default_rng(6).integers(1, 90, 100)]
    gl.write_documents(tmp_path / "docs", docs)

    def loader() -> gl.StatefulDataLoader[Any, list[tuple[int, ...]]]:
        return packed_loader(
            gl.pack(gl.open_documents(tmp_path / "docs"), 32, "best_fit"), local_batch_size=3
        )

    with loader() as first:
        before = take(first, 2)
        state = roundtrip(first.state_dict())
    with loader() as whole:
        expected = take(whole)
    resumed = loader()
    resumed.load_state_dict(state)  # not open yet: len() builds the layout
    with resumed:
        after = take(resumed)
    assert before + after == expected


def test_a_batch_is_packed_rows_whose_blocks_are_the_stacked_samples() -> None:
    dataset = open_packed(numbered([5, 3, 9, 30, 2, 7]), 4, "best_fit", pad_id=-1)
    rows = dataset.read_many_sync(np.arange(len(dataset), dtype=np.int64)[::-1].copy())
    assert isinstance(rows, gl.PackedRows)
    batch = rows[2:6]
    assert isinstance(batch, gl.PackedRows) and len(batch) == 4 and len(rows[6:2]) == 0
    for key in ("tokens", "doc_ids", "segment_ids", "position_ids"):
        assert np.array_equal(batch.block(key), np.stack([s[key] for s in batch]))
        assert batch.block(key).shape == (4, 4)
    assert [int(s["tokens"][0]) for s in rows[::3]] == [
        int(rows[i]["tokens"][0]) for i in range(0, len(rows), 3)
    ]
    assert np.array_equal(rows[-1]["tokens"], rows[len(rows) - 1]["tokens"])
    with pytest.raises(IndexError):
        rows[len(rows)]
    copy = pickle.loads(pickle.dumps(batch))
    assert isinstance(copy, gl.PackedRows) and len(copy) == 4
    assert all(np.array_equal(copy.block(k), batch.block(k)) for k in ("tokens", "doc_ids", "position_ids"))


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_pickled_batch_carries_its_tokens_and_computes_the_index_arrays_where_asked(mode: PackMode) -> None:
    dataset = open_packed(numbered([50, 30, 90, 300, 20, 70, 110, 10, 3]), 64, mode, pad_id=-1)
    order = np.arange(len(dataset), dtype=np.int64)[::-1].copy()
    for a, b in [(0, len(order)), (2, 6), (len(order) - 3, len(order)), (1, 2)]:
        batch = dataset.read_many_sync(order)[a:b]
        data = pickle.dumps(batch)
        assert batch._window.computed() == {}  # pickling computed none of them here
        # the message holds the tokens and the pieces, not four arrays of the tokens' size
        assert len(data) < batch.block("tokens").nbytes + 1024 + 128 * (b - a)
        copy = pickle.loads(data)
        assert isinstance(copy, gl.PackedRows) and len(copy) == b - a
        for key in ("tokens", "doc_ids", "segment_ids", "position_ids"):
            assert np.array_equal(copy.block(key), batch.block(key)), key
            assert copy.block(key).dtype == batch.block(key).dtype
        again = pickle.loads(pickle.dumps(copy))  # computed ones travel as they are
        assert all(np.array_equal(again.block(k), batch.block(k)) for k in ("doc_ids", "position_ids"))


@pytest.mark.parametrize("failing", ["document_offsets", "read_spans"])
def test_a_failed_storage_read_reaches_the_caller_with_its_own_type(failing: str) -> None:
    class Failing(gl.MemoryDocumentStorage):
        armed = False

        async def document_offsets(self, positions: np.ndarray) -> np.ndarray:
            if self.armed and failing == "document_offsets":
                raise gl.StorageError("offsets unavailable")
            return await super().document_offsets(positions)

        async def read_spans(self, starts: np.ndarray, stops: np.ndarray) -> Sequence[Any]:
            if self.armed and failing == "read_spans":
                raise gl.StorageError("spans unavailable")
            return await super().read_spans(starts, stops)

    storage = Failing(numbered([30, 4, 17, 9]))
    dataset = gl.pack(storage, 8, "concat")
    asyncio.run(dataset.open())
    storage.armed = True
    with pytest.raises(gl.StorageError, match="unavailable"):
        asyncio.run(dataset.read_many(np.arange(3, dtype=np.int64)))


# -- the vectorised windows against a row-by-row construction -------------------------------------
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


def reference_best_fit_row(
    data: np.ndarray, layout: BestFitLayout, row: int, pad: int
) -> dict[str, np.ndarray]:
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
            if isinstance(layout, BestFitLayout):
                expect = reference_best_fit_row(data, layout, row, dataset.pad_id)
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


some_lengths_st = st.lists(st.integers(0, 70), min_size=1, max_size=30).filter(lambda v: sum(v) > 0)


@settings(max_examples=150, deadline=None)
@given(
    lengths=some_lengths_st,
    length=st.integers(1, 33),
    mode=st.sampled_from(["concat", "best_fit"]),
    seed=st.integers(0, 99),
)
def test_windows_equal_the_per_piece_construction_in_memory(
    lengths: list[int], length: int, mode: PackMode, seed: int
) -> None:
    docs, data, offsets = documents(lengths, seed)
    if mode == "concat" and sum(lengths) < length:
        return  # no sequence at all (an error, checked above)
    check_storage(gl.MemoryDocumentStorage(docs), data, offsets, length, mode, seed)


@settings(max_examples=40, deadline=None)
@given(
    lengths=some_lengths_st,
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
    assert not isinstance(window._pieces, Pieces), "tokens alone computed the pieces"
    rows.block("segment_ids")
    pieces = window._pieces
    assert isinstance(pieces, Pieces)
    rows.block("position_ids")
    assert window._pieces is pieces
    check_window(dataset, data, offsets, np.arange(len(dataset), dtype=np.int64))


@pytest.mark.parametrize("preads", [False, True])
def test_spans_read_into_place_equal_the_spans(monkeypatch: pytest.MonkeyPatch, preads: bool) -> None:
    """``read_spans_into_sync`` writes each span where it is told, from mapped files, through
    ``preadv`` (a dataset over the mapping budget) and through the default (memory storage),
    and touches nothing else of the output."""
    if preads:
        monkeypatch.setattr(_sharded, "MAPPED_BUDGET", 0)
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
