"""Document packing: the documents of a document storage cut or fitted into fixed-length
sequences, with what document-masked attention needs to keep them apart.

``pack(storage, sequence_length, mode)`` returns a :class:`PackedDataset`: observation ``i`` is
packed sequence ``i``, a read-only mapping of 1-D arrays of
``sequence_length`` elements:

- ``"tokens"``: the elements, of the storage's dtype (``pad_id`` after the last piece in
  ``"best_fit"`` mode);
- ``"doc_ids"`` (int64): the index of the document each element comes from, ``-1`` on padding;
- ``"segment_ids"`` (int32): ``1, 2, ...`` for the sequence's pieces in order, ``0`` on padding
  (Grain's ``*_segment_ids``): elements attend to each other only where these are equal;
- ``"position_ids"`` (int32): the position inside the piece, from 0 at each piece's start
  (Megatron's ``reset_position_ids``, Grain's ``*_positions``); a document continued from the
  previous sequence starts at 0 again, as it does in Megatron.

A read returns :class:`PackedRows`, the sequences of one read window: ``collate_fn`` gets a
batch's rows, and ``rows.block(key)`` is one key's ``(batch, sequence_length)`` array without a
copy. The index arrays are computed for the whole window the first time one is asked for.

The layout is a pure function of the documents' lengths, built once when the dataset is first
opened and kept: the loader's own shuffle then permutes packed sequences, ``len()`` is the same
every epoch, and resuming at any position reads only that position's sequences (no replay).

- ``"concat"``: documents in stored order, concatenated and cut every ``sequence_length``
  elements; a document may span two (or more) sequences, and the elements after the last
  whole sequence are not a sequence (as for a stream). The layout keeps one integer per
  sequence (the document holding its first element): O(N/L) memory for N elements, built in
  one pass over the document offsets.
- ``"best_fit"``: best-fit-decreasing bin packing. A document longer than ``sequence_length`` is
  split into ``sequence_length`` pieces, each a sequence of its own, and its remainder is
  packed like a document; every remaining piece goes, longest first (ties: lower document
  index first), into the fullest sequence that still has room for it, or opens a new one.
  Documents are never cut otherwise, so sequences end in padding. The layout keeps three
  integers per piece and one per sequence: O(D) memory for D documents. Over a storage with
  natural blocks (Parquet row groups), best fit packs ranges of consecutive blocks, each on
  its own (the fewest blocks holding ``fit_group`` sequences' worth of elements), so that a
  sequence reads one range's blocks; ``fit_group=None`` packs the whole dataset at once, as
  over any other storage.

Over a storage with natural blocks, :meth:`PackedDataset.natural_blocks` names the runs of
sequences read from the same blocks (concat: by the block of a sequence's first element; best
fit: by range), and a loader's ``shuffle_block_size="auto"`` keeps them together, as it keeps
row groups together for the documents themselves.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, get_args, overload

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._datasets.base import Call, DatasetAbstract, ReadPlan, read_async, read_sync
from guideloom._loop import LoopThread
from guideloom.storage.base import DocumentStorageAbstract, Rows, Spans, StreamStorageAbstract

__all__ = ["PackMode", "PackedDataset", "PackedRows", "pack"]

PackMode = Literal["concat", "best_fit"]
I64 = npt.NDArray[np.int64]
Sample = Mapping[str, npt.NDArray[Any]]
_KEYS = ("tokens", "doc_ids", "segment_ids", "position_ids")
A = TypeVar("A")
B = TypeVar("B")

_MODES: tuple[str, ...] = get_args(PackMode)
#: ``fit_group``'s default: best fit over a storage with natural blocks packs ranges of blocks
#: holding at least this many sequences' worth of elements, each on its own. About one sequence
#: of padding is lost per range (+0.3% sequences for row groups of 1,000 documents of ~500
#: tokens at length 2048, +0.9% for row groups of 100: see docs/packing.md).
DEFAULT_FIT_GROUP = 64
#: Document offsets read per call while building a layout: bounds the build's memory beyond
#: the layout itself.
_CHUNK = 1 << 20


def _ranges(starts: I64, counts: I64) -> I64:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class _Pieces:
    """The pieces of a window of sequences, in the window's element order (padding is a piece of
    its own, and a piece may be empty): length, document (``-1``: padding), segment id (``0``:
    padding) and where the piece's first element lies in the window's flat ``(n * L)`` block.
    ``doc_ids`` and ``segment_ids`` are one ``np.repeat`` of these by ``length``, and
    ``position_ids`` each element's index less its piece's ``start``."""

    length: I64
    doc: I64
    segment: npt.NDArray[np.int32]
    start: I64


@dataclass(frozen=True, slots=True)
class _ConcatLayout:
    """``first[k]``: the document holding element ``min(k * L, total - 1)``, ``k`` in ``[0, S]``."""

    length: int
    total: int
    first: I64

    def __len__(self) -> int:
        return len(self.first) - 1

    @property
    def nbytes(self) -> int:
        return int(self.first.nbytes)


@dataclass(frozen=True, slots=True)
class _BestFitLayout:
    """Sequence ``i`` holds pieces ``ptr[i]:ptr[i + 1]``, back to back from column 0."""

    length: int
    ptr: I64
    doc: I64
    start: I64  # absolute element position of the piece's first element
    size: npt.NDArray[np.int32]
    groups: I64  # sequences of each range of documents packed on its own, in order

    def __len__(self) -> int:
        return len(self.ptr) - 1

    @property
    def nbytes(self) -> int:
        arrays = (self.ptr, self.doc, self.start, self.size, self.groups)
        return int(sum(a.nbytes for a in arrays))


def _check_storage(storage: Any) -> DocumentStorageAbstract[Any, Any]:
    if isinstance(storage, StreamStorageAbstract):
        raise TypeError(
            "pack() packs documents, and a stream storage has none: it is one token sequence "
            "already. Use StatefulDataLoader.from_storage(stream, collate_fn, sequence_length=...) "
            "for fixed-length samples, or open the data with open_documents()"
        )
    if not isinstance(storage, DocumentStorageAbstract):
        raise TypeError(
            "pack() needs a DocumentStorageAbstract (what open_documents() returns, or "
            f"MemoryDocumentStorage), got {type(storage).__name__}"
        )
    return storage


def _fit_rows(spans: Sequence[Any], used: I64, length: int, dtype: Any, pad_id: int) -> npt.NDArray[Any]:
    """Best fit's rows: the pieces' elements back to back in their rows, each row (holding
    ``used`` elements) padded with ``pad_id``."""
    n = len(used)
    if isinstance(spans, Rows):
        flat = spans.block.reshape(-1)
    elif isinstance(spans, Spans):
        flat = spans.buffer
    else:
        flat = np.concatenate(list(spans)) if len(spans) else np.empty(0, dtype)
    if len(flat) == n * length:
        return flat.reshape(n, length)
    out = np.full((n, length), pad_id, dtype=dtype)
    ends = np.cumsum(used).tolist()
    for r, (end, u) in enumerate(zip(ends, used.tolist(), strict=True)):  # a copy per row
        out[r, :u] = flat[end - u : end]
    return out


class PackedDataset(DatasetAbstract[Sample]):
    """Documents packed into sequences of ``sequence_length`` elements (see :func:`pack`).

    Each sample is a read-only mapping of 1-D arrays: ``"tokens"``, ``"doc_ids"``,
    ``"segment_ids"`` and ``"position_ids"`` (computed for a read window on first use).
    ``len()`` and reads need the layout, which :meth:`open` builds the first time (the loader
    opens its dataset); it stays built after :meth:`close`.
    """

    _plain_reads: ClassVar[bool] = True

    def __init__(
        self,
        storage: DocumentStorageAbstract[Any, Any],
        sequence_length: int,
        mode: PackMode = "concat",
        *,
        pad_id: int = 0,
        fit_group: int | None = DEFAULT_FIT_GROUP,
    ) -> None:
        self._storage = _check_storage(storage)
        self.sequence_length = check_int("sequence_length", sequence_length, 1)
        if mode not in _MODES:
            raise ValueError(f"unknown packing mode {mode!r}; pass mode='concat' or mode='best_fit'")
        self.mode: PackMode = mode
        self.pad_id = check_int("pad_id", pad_id, -(2**63))
        dtype = storage.dtype
        if dtype.kind in "iu" and not np.iinfo(dtype).min <= self.pad_id <= np.iinfo(dtype).max:
            raise ValueError(
                f"pad_id={self.pad_id} does not fit the documents' dtype {dtype}; pass a pad_id in "
                f"[{np.iinfo(dtype).min}, {np.iinfo(dtype).max}]"
            )
        if len(storage) == 0:
            raise ValueError(f"{storage!r} holds no documents: there is nothing to pack")
        self.fit_group = None if fit_group is None else check_int("fit_group", fit_group, 1)
        self._layout: _ConcatLayout | _BestFitLayout | None = None
        self._blocks: I64 | None = None
        self._arange: dict[type[np.signedinteger[Any]], npt.NDArray[Any]] = {}

    def __repr__(self) -> str:
        return (
            f"PackedDataset({self._storage!r}, sequence_length={self.sequence_length}, "
            f"mode={self.mode!r}, pad_id={self.pad_id}, fit_group={self.fit_group})"
        )

    @property
    def storage(self) -> DocumentStorageAbstract[Any, Any]:
        """The document storage the sequences are packed from."""
        return self._storage

    async def open(self) -> None:
        """Open the storage and, the first time, build the pack layout (one pass over the
        document offsets)."""
        await self._storage.open()
        if self._layout is None:
            self._layout = await self._build()

    def __len__(self) -> int:
        """Number of packed sequences. Before the dataset was ever opened (a loader's
        ``load_state_dict`` in a fresh process), this builds the layout first, blocking: it
        opens the storage, reads the offsets and closes it again."""
        return len(self._built_layout())

    def layout_nbytes(self) -> int:
        """Memory the pack layout holds, in bytes (what :meth:`open` keeps)."""
        return self._built_layout().nbytes

    def _built_layout(self) -> _ConcatLayout | _BestFitLayout:
        if self._layout is None:
            loop = LoopThread(name=f"guideloom-pack-{id(self):x}")  # works inside a running loop too
            try:
                loop.run(self._build_closed())
            finally:
                loop.stop()
        return self._require_layout()

    async def _build_closed(self) -> None:
        await self.open()
        await self.close()

    def _require_layout(self) -> _ConcatLayout | _BestFitLayout:
        if self._layout is None:
            raise RuntimeError(
                f"{self!r} has no layout yet: open it first (the loader does, on open() or in "
                "its with block; or `await dataset.open()`)"
            )
        return self._layout

    # -- layout ---------------------------------------------------------------------------------
    async def _offsets_in_chunks(self) -> AsyncIterator[tuple[int, I64]]:
        n = len(self._storage)
        for p0 in range(0, n, _CHUNK):
            p1 = min(n, p0 + _CHUNK)
            yield p0, await self._storage.document_offsets(np.arange(p0, p1 + 1, dtype=np.int64))

    async def _build(self) -> _ConcatLayout | _BestFitLayout:
        n, length = len(self._storage), self.sequence_length
        total = int((await self._storage.document_offsets(np.asarray([n], dtype=np.int64)))[0])
        if total == 0:
            raise ValueError(f"{self._storage!r}: its {n} documents are all empty; there is nothing to pack")
        if self.mode == "concat":
            count = total // length
            if count == 0:
                raise ValueError(
                    f"{self._storage!r} holds {total} elements, fewer than one sequence of "
                    f"sequence_length={length}; pass a smaller sequence_length (or use mode='best_fit')"
                )
            targets = np.minimum(np.arange(count + 1, dtype=np.int64) * length, total - 1)
            first = np.empty(count + 1, dtype=np.int64)
            async for p0, off in self._offsets_in_chunks():
                lo, hi = np.searchsorted(targets, [off[0], off[-1]], side="left").tolist()
                first[lo:hi] = p0 + np.searchsorted(off, targets[lo:hi], side="right") - 1
            return _ConcatLayout(length, total, first)
        lengths = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        async for p0, off in self._offsets_in_chunks():
            lengths[p0 : p0 + len(off) - 1] = np.diff(off)
            starts[p0 : p0 + len(off) - 1] = off[:-1]
        return best_fit_layout(lengths, starts, length, self._fit_bounds(starts, total))

    def _storage_blocks(self) -> I64 | None:
        """The storage's natural blocks (documents per block, the empty ones left out), checked
        against its length; ``None`` where it has none."""
        blocks = self._storage.natural_blocks()
        if blocks is None:
            return None
        blocks = np.asarray(blocks, dtype=np.int64)
        if blocks.ndim != 1 or (blocks < 0).any() or int(blocks.sum()) != len(self._storage):
            raise ValueError(
                f"{self._storage!r}.natural_blocks() must be counts >= 0 of its documents, summing "
                f"to its {len(self._storage)} documents; got {blocks.size} values summing to "
                f"{int(blocks.sum())}"
            )
        return blocks[blocks > 0]

    def _fit_bounds(self, starts: I64, total: int) -> I64 | None:
        """Where best fit's ranges of documents begin and end: consecutive storage blocks, each
        range the fewest that hold ``fit_group`` sequences' worth of elements (a short last
        range joins the one before); ``None`` (one range: the whole dataset) for a storage
        without natural blocks or ``fit_group=None``."""
        blocks = self._storage_blocks()
        if blocks is None or self.fit_group is None:
            return None
        ends = np.cumsum(blocks)
        offsets = np.append(starts, total)  # element offset of each document
        need = self.fit_group * self.sequence_length
        bounds, since = [0], 0
        for end, elements in zip(ends.tolist(), offsets[ends].tolist(), strict=True):
            if elements - since >= need:
                bounds.append(end)
                since = elements
        if bounds[-1] != len(starts):
            if len(bounds) > 1:
                bounds[-1] = len(starts)  # the short rest joins the last range
            else:
                bounds.append(len(starts))
        return np.asarray(bounds, dtype=np.int64)

    # -- reads ----------------------------------------------------------------------------------
    def _concat_queries(self, indices: I64) -> I64:
        """The document offsets to look up for ``indices``: an ``(n, w)`` grid, row ``i`` the
        documents from the one holding the row's first element to the one after its last
        (repeating the last where a row has fewer: those pieces come out empty)."""
        layout = self._layout
        assert isinstance(layout, _ConcatLayout)
        a, c = layout.first[indices], layout.first[indices + 1]
        width = int((c - a).max()) + 2 if len(indices) else 2
        grid: I64 = np.minimum(a[:, None] + self._flat_range(width, np.int64), (c + 1)[:, None])
        return grid

    def _concat_pieces(self, indices: I64, positions: I64, offsets: I64) -> _Pieces:
        """The pieces of full rows ``indices`` from the grid of document ``positions`` and their
        ``offsets``: a few whole-grid operations, O(rows x documents a row) whatever the row's
        length (the elements are never looked at)."""
        length, n = self.sequence_length, len(indices)
        rel = offsets.reshape(positions.shape) - (indices * length)[:, None]
        np.minimum(np.maximum(rel, 0, out=rel), length, out=rel)  # np.clip costs more on small arrays
        sizes = rel[:, 1:] - rel[:, :-1]
        starts = rel[:, :-1] + (self._flat_range(n, np.int64) * length)[:, None]
        segments = np.cumsum(sizes > 0, axis=1, dtype=np.int32)  # empty documents get no id
        return _Pieces(sizes.ravel(), positions[:, :-1].ravel(), segments.ravel(), starts.ravel())

    def _best_fit_pieces(self, indices: I64) -> tuple[_Pieces, I64, I64, I64]:
        """The pieces of rows ``indices``, each row's padding a piece after its last (empty in
        a full row); where each real piece's elements start in the storage, their position in
        the pieces, and how many elements each row holds."""
        layout = self._layout
        assert isinstance(layout, _BestFitLayout)
        n, length = len(indices), self.sequence_length
        counts = layout.ptr[indices + 1] - layout.ptr[indices]
        at = _ranges(layout.ptr[indices], counts)
        size = layout.size[at].astype(np.int64)
        ends = np.cumsum(size)
        last = np.cumsum(counts) - 1  # each row's last piece
        used = np.diff(ends[last], prepend=0) if n else np.zeros(0, np.int64)
        rows = np.repeat(self._flat_range(n, np.int64), counts)
        real = self._flat_range(len(at), np.int64) + rows  # where the real pieces go
        pad = last + self._flat_range(n, np.int64) + 1  # where each row's padding goes
        row_first = np.repeat(ends[last] - used, counts)
        total = len(at) + n
        sizes = np.empty(total, np.int64)
        sizes[real], sizes[pad] = size, length - used
        docs = np.full(total, -1, np.int64)
        docs[real] = layout.doc[at]
        segments = np.zeros(total, np.int32)
        segments[real] = real - np.repeat(pad - counts - 1, counts)
        starts = np.empty(total, np.int64)
        starts[real] = rows * length + (ends - size - row_first)
        starts[pad] = self._flat_range(n, np.int64) * length + used
        return _Pieces(sizes, docs, segments, starts), layout.start[at], size, used

    def _flat_range(self, size: int, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
        """``arange(size)``, cut from a cached one per dtype (windows repeat their sizes)."""
        cached = self._arange.get(dtype)
        if cached is None or len(cached) < size:
            cached = self._arange[dtype] = np.arange(size, dtype=dtype)
        return cached[:size]

    def _assemble(
        self, tokens: npt.NDArray[Any], pieces: _Pieces | Callable[[], _Pieces], used: I64 | None = None
    ) -> PackedRows:
        """The samples of a window: rows of ``tokens`` (``(n, L)``), the index arrays from its
        ``pieces`` (or what computes them, on first use), and ``used``, the elements each row
        holds before its padding (``None``: every row is full)."""
        padded = np.flatnonzero(used < self.sequence_length) if used is not None else None
        pad_from = used[padded] if used is not None and padded is not None else None
        return PackedRows(_Window(tokens, pieces, padded, pad_from, self._flat_range), 0, len(tokens))

    def _concat_tokens(self, spans: Sequence[Any], n: int) -> npt.NDArray[Any]:
        if isinstance(spans, Rows):
            return spans.block
        return np.stack(spans) if n else np.empty((0, self.sequence_length), self._storage.dtype)

    def _read(self, indices: I64) -> ReadPlan:
        """Packed sequences ``indices``: one batched span read of the storage (concat mode also
        looks up, at the same time, the offsets of the documents the sequences hold)."""
        self._require_layout()
        indices = np.asarray(indices, dtype=np.int64)
        length = self.sequence_length
        storage = self._storage
        if self.mode == "concat":
            grid = self._concat_queries(indices)
            positions = grid.ravel()  # the offsets; the elements do not depend on them
            starts, stops = indices * length, indices * length + length
            offsets, spans = yield [
                Call(
                    functools.partial(storage.document_offsets_sync, positions),
                    functools.partial(storage.document_offsets, positions),
                ),
                Call(
                    functools.partial(storage.read_spans_sync, starts, stops),
                    functools.partial(storage.read_spans, starts, stops),
                ),
            ]
            return self._assemble(
                self._concat_tokens(spans, len(indices)),
                functools.partial(self._concat_pieces, indices, grid, offsets),
            )
        pieces, starts, sizes, used = self._best_fit_pieces(indices)
        (rows,) = yield [
            Call(
                functools.partial(self._fit_rows_sync, pieces, starts, sizes, len(indices)),
                functools.partial(self._fit_rows_async, starts, sizes, used),
            )
        ]
        return self._assemble(rows, pieces, used)

    def _fit_rows_sync(self, pieces: _Pieces, starts: I64, sizes: I64, n: int) -> npt.NDArray[Any]:
        """Best-fit rows in the caller's thread: each piece read straight into its place in its
        row (one copy, no buffer of pieces)."""
        rows = np.full((n, self.sequence_length), self.pad_id, dtype=self._storage.dtype)
        self._storage.read_spans_into_sync(starts, starts + sizes, rows, pieces.start[pieces.doc >= 0])
        return rows

    async def _fit_rows_async(self, starts: I64, sizes: I64, used: I64) -> npt.NDArray[Any]:
        spans = await self._storage.read_spans(starts, starts + sizes)
        return _fit_rows(spans, used, self.sequence_length, self._storage.dtype, self.pad_id)

    async def read_many(self, indices: I64) -> Sequence[Sample]:
        return await read_async(self._read(indices))

    def read_many_sync(self, indices: I64) -> Sequence[Sample]:
        """``read_many`` in the caller's thread (where ``reads_inline``)."""
        return read_sync(self._read(indices))

    def describe(self, index: int) -> dict[str, Any]:
        """The pieces of packed sequence ``index``: each one's document and element range in it
        (``documents``), in the storage (``elements``), and the files holding them. A few lookups
        in the layout and one of the documents' offsets."""
        layout = self._require_layout()
        length, storage = self.sequence_length, self._storage
        if isinstance(layout, _ConcatLayout):
            a, c = int(layout.first[index]), int(layout.first[index + 1])
            docs = np.arange(a, c + 1, dtype=np.int64)
            offsets = storage.document_offsets_sync(np.arange(a, c + 2, dtype=np.int64))
            lo = np.maximum(offsets[:-1], index * length)
            hi = np.minimum(offsets[1:], (index + 1) * length)
            keep = hi > lo
            docs, lo, hi, begin = docs[keep], lo[keep], hi[keep], offsets[:-1][keep]
        else:
            at = np.arange(layout.ptr[index], layout.ptr[index + 1], dtype=np.int64)
            docs = layout.doc[at]
            lo = layout.start[at]
            hi = lo + layout.size[at].astype(np.int64)
            begin = storage.document_offsets_sync(docs)
        pieces = list(zip(docs.tolist(), lo.tolist(), hi.tolist(), begin.tolist(), strict=True))
        return {
            "documents": [[d, x - b, y - b] for d, x, y, b in pieces],
            "elements": [[x, y] for _, x, y, _ in pieces],
            "files": [storage.locate(x, y) for _, x, y, _ in pieces],
        }

    def natural_blocks(self) -> I64 | None:
        """The runs of consecutive sequences read from the same storage blocks (Parquet row
        groups), which ``shuffle_block_size="auto"`` keeps together; ``None`` where the storage
        has no natural blocks (or best fit packs the whole dataset at once, ``fit_group=None``).

        ``"concat"``: the sequences grouped by the block their first element lies in (a sequence
        that runs into the next block belongs to the one it starts in; blocks where no sequence
        starts have none). ``"best_fit"``: the sequences of each range best fit packed on its
        own (see ``fit_group``), which read that range's blocks only.
        """
        if self._blocks is None:
            layout = self._built_layout()
            if isinstance(layout, _BestFitLayout):
                if self._storage_blocks() is None or self.fit_group is None:
                    return None
                sizes = layout.groups
            else:
                blocks = self._storage_blocks()
                if blocks is None:
                    return None
                block_of = np.searchsorted(np.cumsum(blocks), layout.first[:-1], side="right")
                sizes = np.bincount(block_of, minlength=len(blocks)).astype(np.int64)
            self._blocks = sizes[sizes > 0]
        return self._blocks

    def position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """The storage's figures (Parquet: row groups decoded), as ``loader.stats()`` reports them
        for the documents themselves."""
        return self._storage.figures()

    def _fingerprint_kind(self) -> str:
        """Another packing counts other sequences: the kind names the mode (and, for best fit
        packed by ranges of storage blocks, the range's size)."""
        if self.mode == "best_fit" and self.fit_group is not None and self._storage_blocks() is not None:
            return f"packed-best_fit-group{self.fit_group}"
        return f"packed-{self.mode}"

    @property
    def reads_inline(self) -> bool:
        """Whether reads can run in the caller's thread: the storage's say, unless a subclass
        overrides ``read_many``."""
        return self._plain_reads and self._storage.reads_inline()

    def sample_nbytes_hint(self) -> int:
        """A sequence's bytes: its elements and its three index arrays."""
        return self.sequence_length * (self._storage.dtype.itemsize + 16)


class _Window:
    """The samples of one read: the tokens, and each index array computed for all its rows the
    first time a sample is asked for it (a collate that takes no ``doc_ids`` never pays for
    them).

    Each index array is one or two passes over the window's elements built from per-piece values
    (padding is a piece of its own), whatever the number of pieces. Threads that collate
    batches of one window at once may compute an array twice, never differently.
    """

    __slots__ = ("_arange", "_blocks", "_pad_from", "_padded", "_pieces", "tokens")

    def __init__(
        self,
        tokens: npt.NDArray[Any],
        pieces: _Pieces | Callable[[], _Pieces],
        padded: I64 | None,
        pad_from: I64 | None,
        arange: Callable[[int, type[np.signedinteger[Any]]], npt.NDArray[Any]],
    ) -> None:
        self.tokens, self._pieces, self._padded, self._pad_from = tokens, pieces, padded, pad_from
        self._arange = arange
        self._blocks: dict[str, npt.NDArray[Any]] = {"tokens": tokens}

    @property
    def pieces(self) -> _Pieces:
        """The window's pieces, computed the first time an index array needs them (a collate of
        tokens alone never does)."""
        pieces = self._pieces
        if not isinstance(pieces, _Pieces):
            pieces = self._pieces = pieces()
        return pieces

    def preset(self, blocks: dict[str, npt.NDArray[Any]]) -> None:
        self._blocks.update(blocks)

    def block(self, key: str) -> npt.NDArray[Any]:
        got = self._blocks.get(key)
        if got is None:
            if key not in _KEYS:
                raise KeyError(key)
            got = self._blocks[key] = getattr(self, "_" + key)().reshape(self.tokens.shape)
        return got

    def _doc_ids(self) -> npt.NDArray[np.int64]:
        return np.repeat(self.pieces.doc, self.pieces.length)

    def _segment_ids(self) -> npt.NDArray[np.int32]:
        return np.repeat(self.pieces.segment, self.pieces.length)

    def _position_ids(self) -> npt.NDArray[np.int32]:
        """Each element's index in the window less its piece's first index: one ``np.repeat``
        of the pieces' starts, subtracted in place from a cached ``arange`` (one window-sized
        array allocated, two passes; a running sum over reset steps costs twice as much),
        then zero on padding."""
        p, (n, length) = self.pieces, self.tokens.shape
        size = n * length
        wide = size >= 1 << 31  # int32 indexes would wrap: compute in int64, hand out int32
        dtype: type[np.signedinteger[Any]] = np.int64 if wide else np.int32
        positions: npt.NDArray[Any] = np.repeat(p.start.astype(dtype), p.length)
        np.subtract(self._arange(size, dtype), positions, out=positions)
        if self._padded is not None and self._pad_from is not None:
            for r, start in zip(self._padded.tolist(), self._pad_from.tolist(), strict=True):
                positions[r * length + start : (r + 1) * length] = 0
        return positions.astype(np.int32) if wide else positions


class PackedRows(Sequence[Mapping[str, npt.NDArray[Any]]]):
    """Packed sequences as a read-only ``Sequence``: what a :class:`PackedDataset` read returns,
    and so what ``collate_fn`` receives (the rows of one read window).

    ``rows[i]`` is sequence ``i``, a read-only mapping of its four arrays; ``rows[a:b]`` is
    ``PackedRows`` again; ``rows.block(key)`` is the ``(len(rows), sequence_length)`` array of
    one key for all of them, a view without a copy, where ``np.stack([s[key] for s in rows])``
    makes a Python call per sample and copies (a collate for short batches spends most of its
    time there). Pickled (for process workers) it carries its own rows only.
    """

    __slots__ = ("_start", "_stop", "_window")

    def __init__(self, window: _Window, start: int, stop: int) -> None:
        self._window, self._start, self._stop = window, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Mapping[str, npt.NDArray[Any]]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Mapping[str, npt.NDArray[Any]]]: ...
    def __getitem__(
        self, index: int | slice
    ) -> Mapping[str, npt.NDArray[Any]] | Sequence[Mapping[str, npt.NDArray[Any]]]:
        n = self._stop - self._start
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return PackedRows(self._window, self._start + start, self._start + max(start, stop))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"row {index} of {n} packed sequences")
        return _PackedSample(self._window, self._start + index)

    def block(self, key: str) -> npt.NDArray[Any]:
        """The 2-D array of ``key`` (``"tokens"``, ``"doc_ids"``, ``"segment_ids"`` or
        ``"position_ids"``) for these rows: a view of the window's array, no copy."""
        view: npt.NDArray[Any] = self._window.block(key)[self._start : self._stop]
        return view

    def __reduce__(self) -> tuple[Any, ...]:
        blocks = {k: np.ascontiguousarray(self.block(k)) for k in _KEYS}
        return (_rows_of_blocks, (blocks,))

    def __repr__(self) -> str:
        return f"PackedRows({len(self)} sequences of {self._window.tokens.shape[1]})"


def _rows_of_blocks(blocks: dict[str, npt.NDArray[Any]]) -> PackedRows:
    """``PackedRows`` over arrays already made (what a pickled ``PackedRows`` becomes)."""
    tokens = blocks["tokens"]
    none = np.empty(0, dtype=np.int64)
    window = _Window(tokens, _Pieces(none, none, np.empty(0, np.int32), none), None, None, _no_range)
    window.preset(blocks)
    return PackedRows(window, 0, len(tokens))


def _no_range(size: int, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
    raise AssertionError("a window made of blocks computes nothing")


class _PackedSample(Mapping[str, npt.NDArray[Any]]):
    """One packed sequence: a read-only mapping of its four arrays, rows of its window's
    (pickled, as for process workers, it is a plain dict)."""

    __slots__ = ("_row", "_window")

    def __init__(self, window: _Window, row: int) -> None:
        self._window, self._row = window, row

    def __getitem__(self, key: str) -> npt.NDArray[Any]:
        row: npt.NDArray[Any] = self._window.block(key)[self._row]
        return row

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {self[k]!r}" for k in _KEYS) + "}"


def best_fit_layout(lengths: I64, starts: I64, length: int, bounds: I64 | None = None) -> _BestFitLayout:
    """The best-fit-decreasing layout of documents of ``lengths`` starting at ``starts``.

    Whole ``length`` pieces of long documents come first, one sequence each, in document order;
    then the sequences best-fit opened, in the order it opened them. With ``bounds`` (document
    indexes ``0 = b[0] < b[1] < ... = D``), the documents of each range ``[b[k], b[k+1])`` are
    packed so on their own, one range after the other, and the layout's ``groups`` holds each
    range's number of sequences; without, the whole dataset is one range.
    """
    n = len(lengths)
    whole = lengths // length
    rest = lengths - whole * length
    docs = np.arange(n, dtype=np.int64)
    # whole pieces: document d's k-th piece starts at starts[d] + k * length
    whole_doc = np.repeat(docs, whole)
    whole_start = starts[whole_doc] + (_ranges(np.zeros(len(docs), np.int64), whole) * length)
    has_rest = np.flatnonzero(rest > 0)
    if bounds is None:
        order = has_rest[np.lexsort((has_rest, -rest[has_rest]))]
        bins = _best_fit_decreasing(rest[order], length)
    else:  # by range, then as above: each range's pieces are one run, packed on its own
        group = np.repeat(np.arange(len(bounds) - 1, dtype=np.int64), np.diff(bounds))
        order = has_rest[np.lexsort((has_rest, -rest[has_rest], group[has_rest]))]
        first_of_range = np.flatnonzero(np.diff(group[order], prepend=-1))
        bins = _best_fit_decreasing(rest[order], length, first_of_range[1:])
    by_bin = np.argsort(bins, kind="stable")
    nbins = int(bins.max()) + 1 if len(bins) else 0
    rest_doc = order[by_bin]
    nwhole = len(whole_doc)
    counts = np.ones(nwhole + nbins, dtype=np.int64)
    counts[nwhole:] = np.bincount(bins, minlength=nbins)
    doc = np.concatenate([whole_doc, rest_doc])
    start = np.concatenate([whole_start, starts[rest_doc] + whole[rest_doc] * length])
    size = np.concatenate([np.full(nwhole, length, np.int32), rest[rest_doc].astype(np.int32)])
    if bounds is None:
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return _BestFitLayout(length, ptr, doc, start, size, np.asarray([len(counts)], np.int64))
    # each sequence's range (a whole piece's document's; a bin's documents', which share one):
    # the sequences of each range, its whole pieces then its bins, one range after the other
    bin_range = np.empty(nbins, np.int64)
    bin_range[bins] = group[order]
    seq_range = np.concatenate([group[whole_doc], bin_range])
    seq_order = np.argsort(seq_range, kind="stable")
    at = _ranges((np.cumsum(counts) - counts)[seq_order], counts[seq_order])
    ptr = np.concatenate([[0], np.cumsum(counts[seq_order])]).astype(np.int64)
    per_range = np.bincount(seq_range, minlength=len(bounds) - 1).astype(np.int64)
    return _BestFitLayout(length, ptr, doc[at], start[at], size[at], per_range)


def _best_fit_decreasing(sizes: I64, capacity: int, cuts: I64 | None = None) -> I64:
    """The bin of each item (sizes in ``[1, capacity]``, non-increasing): each goes into the open
    bin with the least room that still holds it (the most recently filled to that room when
    several do), or into a new bin. At each item index in ``cuts`` every open bin is closed:
    the items between two cuts (each range non-increasing) are packed on their own.

    Open bins are kept by their room in ``capacity + 1`` stacks, and a bit mask of the rooms that
    have a bin finds the least room ``>= size`` in a few big-integer operations (O(1) per item
    for practical capacities): one pass, O(D) time.
    """
    out = np.empty(len(sizes), dtype=np.int64)
    stacks: list[list[int]] = [[] for _ in range(capacity + 1)]
    mask = 0
    nbins = 0
    closes = [] if cuts is None else np.asarray(cuts, dtype=np.int64).tolist()
    for k, (lo, hi) in enumerate(itertools.pairwise([0, *closes, len(sizes)])):
        if k:  # close the bins of the range before: clear the stacks that hold any
            while mask:
                room = (mask & -mask).bit_length() - 1
                stacks[room].clear()
                mask ^= 1 << room
        for chunk_start in range(lo, hi, _CHUNK):
            chunk = sizes[chunk_start : min(hi, chunk_start + _CHUNK)].tolist()
            placed: list[int] = []
            append = placed.append
            for s in chunk:
                m = mask >> s
                if m:
                    room = s + (m & -m).bit_length() - 1
                    stack = stacks[room]
                    b = stack.pop()
                    if not stack:
                        mask ^= 1 << room
                else:
                    b, room = nbins, capacity
                    nbins += 1
                append(b)
                left = room - s
                if left:
                    stack = stacks[left]
                    if not stack:
                        mask |= 1 << left
                    stack.append(b)
            out[chunk_start : chunk_start + len(placed)] = placed
    return out


def pack(
    storage: DocumentStorageAbstract[Any, Any],
    sequence_length: int,
    mode: PackMode = "concat",
    *,
    pad_id: int = 0,
    fit_group: int | None = DEFAULT_FIT_GROUP,
) -> PackedDataset:
    """Pack the documents of ``storage`` into sequences of ``sequence_length`` elements.

    ``mode="concat"`` concatenates the documents in stored order and cuts every
    ``sequence_length`` elements (no padding; a document may span sequences);
    ``mode="best_fit"`` keeps documents whole where they fit (best-fit-decreasing; longer ones
    are split into ``sequence_length`` pieces and a remainder) and pads with ``pad_id``. Over a
    storage with natural blocks (Parquet row groups) best fit packs ranges of consecutive blocks
    on their own, each the fewest blocks that hold ``fit_group`` sequences' worth of elements
    (``None``: the whole dataset at once, more tightly, but a sequence then reads documents
    from anywhere). Use the result as a loader's dataset:
    ``StatefulDataLoader(pack(storage, 2048), collate_fn, ...)``; each sample is a read-only
    mapping of ``"tokens"``, ``"doc_ids"``, ``"segment_ids"`` and ``"position_ids"`` (see
    :class:`PackedDataset`). Nothing is read until the loader opens it.
    """
    return PackedDataset(storage, sequence_length, mode, pad_id=pad_id, fit_group=fit_group)
