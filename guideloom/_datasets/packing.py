"""Document packing: the documents of a document storage cut or fitted into fixed-length
sequences, with what document-masked attention needs to keep them apart.

``pack(storage, sequence_length, mode)`` returns a :class:`PackedDataset`: observation ``i`` is
packed sequence ``i``, a read-only mapping of 1-D arrays of ``sequence_length`` elements:

- ``"tokens"``: the elements, of the storage's dtype (``pad_id`` after the last piece in
  ``"best_fit"`` mode);
- ``"doc_ids"`` (int64): the index of the document each element comes from, ``-1`` on padding;
- ``"segment_ids"`` (int32): ``1, 2, ...`` for the sequence's pieces in order, ``0`` on padding
  (Grain's ``*_segment_ids``): elements attend to each other only where these are equal;
- ``"position_ids"`` (int32): the position inside the piece, from 0 at each piece's start
  (Megatron's ``reset_position_ids``, Grain's ``*_positions``); a document continued from the
  previous sequence starts at 0 again, as it does in Megatron.

A read returns :class:`PackedRows`, the sequences of one read window: ``collate_fn`` gets a
batch's rows, ``rows.block(key)`` one key's ``(batch, sequence_length)`` array without a copy.

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

Concat over a storage that counts by blocks (Parquet text with a tokenizer: lengths cost a
tokenizer pass) is counted as it is read instead, in an order of its own a window of
:attr:`PackedDataset.count_window` blocks at a time (:mod:`guideloom._datasets.packed_blocks`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._core.pack_layout import (
    CHUNK,
    Aranges,
    BestFitLayout,
    ConcatLayout,
    Pieces,
    best_fit_layout,
    best_fit_pieces,
    concat_first,
    concat_pieces,
    concat_queries,
    fit_bounds,
    flat_ranges,
)
from guideloom._datasets.base import (
    BuiltinDataset,
    Call,
    ReadHints,
    ReadPlan,
    open_shared,
    read_async,
    read_sync,
)
from guideloom._datasets.counted import BlockOrder
from guideloom._datasets.packed_blocks import COUNT_WINDOW_BYTES, PART_BYTES, PackedBlocks
from guideloom._datasets.packed_rows import PackedRows, Window
from guideloom._loop import LoopThread
from guideloom.storage.base import DocumentStorageAbstract, Rows, Spans, StreamStorageAbstract
from guideloom.types import DatasetFingerprint

__all__ = ["PackMode", "PackedDataset", "PackedRows", "pack"]

PackMode = Literal["concat", "best_fit"]
I64 = npt.NDArray[np.int64]
Sample = Mapping[str, npt.NDArray[Any]]

_MODES: tuple[str, ...] = get_args(PackMode)
#: ``fit_group``'s default: best fit over a storage with natural blocks packs ranges of blocks
#: holding at least this many sequences' worth of elements, each on its own. About one sequence
#: of padding is lost per range (+0.3% sequences for row groups of 1,000 documents of ~500
#: tokens at length 2048, +0.9% for row groups of 100: see docs/packing.md).
DEFAULT_FIT_GROUP = 64


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


class PackedDataset(BuiltinDataset[Sample]):
    """Documents packed into sequences of ``sequence_length`` elements (see :func:`pack`).

    Each sample is a read-only mapping of 1-D arrays: ``"tokens"``, ``"doc_ids"``,
    ``"segment_ids"`` and ``"position_ids"`` (computed for a read window on first use).
    ``len()`` and reads need the layout, which :meth:`open` builds the first time (the loader
    opens its dataset); it stays built after :meth:`close`. Counted by blocks (concat over
    Parquet text), blocks are counted as the loader's order reaches them, and
    ``count_window`` (blocks per window of that order: the fewest holding
    :data:`COUNT_WINDOW_BYTES` of stored text, at least one) may be set before a loader plans.
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
        self._layout: ConcatLayout | BestFitLayout | None = None
        self._blocks: I64 | None = None
        self._aranges = Aranges()
        #: Concat over a storage that counts by blocks (Parquet text): each block cut on its own,
        #: counted as it is first read (see :mod:`guideloom._datasets.packed_blocks`).
        self._counted = (
            PackedBlocks.over(storage, self.sequence_length, PART_BYTES, COUNT_WINDOW_BYTES)
            if mode == "concat"
            else None
        )

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
        await open_shared(self._storage)
        if self._counted is not None:  # counted as read: only what cache_dir holds is known now
            await asyncio.to_thread(self._counted.learn_known)
        elif self._layout is None:
            self._layout = await self._build()

    def __len__(self) -> int:
        """Number of packed sequences. Never opened (a loader's ``load_state_dict`` in a fresh
        process): the layout is built first, blocking. Counted by blocks (Parquet text): the
        blocks not counted yet are counted first, blocking (about a length index's pass)."""
        if self._counted is not None:
            return len(self._counted)
        return len(self._built_layout())

    def layout_nbytes(self) -> int:
        """Memory the pack layout holds, in bytes (what :meth:`open` keeps; counted by blocks:
        the documents' offsets in each block counted so far)."""
        if self._counted is not None:
            return self._counted.nbytes()
        return self._built_layout().nbytes

    # -- counted by blocks: what PackedBlocks answers --------------------------------------------
    def _blocks_for(self, name: str) -> PackedBlocks:
        if self._counted is None:
            raise AttributeError(f"{name} is for concat counted by blocks (Parquet text); {self!r} is not")
        return self._counted

    @property
    def count_window(self) -> int:
        """Blocks per window of the order by blocks (``COUNT_WINDOW_BYTES`` of text); set before a plan."""
        return self._blocks_for("count_window").window

    @count_window.setter
    def count_window(self, blocks: int) -> None:
        self._blocks_for("count_window").window = check_int("count_window", blocks, 1)

    def block_totals(self) -> I64:
        """Each block's elements (``-1``: not counted yet)."""
        return self._blocks_for("block_totals()").block_totals()

    def count_blocks_sync(self, blocks: I64) -> None:
        """Count ``blocks`` (decoding and tokenizing them), in the caller's thread."""
        self._blocks_for("count_blocks_sync()").count_blocks_sync(blocks)

    def _is_counted(self) -> bool:
        """Whether every block is counted (always, for a layout built at open)."""
        return self._counted is None or self._counted.counted()

    def _count_state(self) -> str | None:
        """Counted by blocks: the blocks' totals (``PackedBlocks.state``); ``None`` otherwise."""
        return None if self._counted is None else self._counted.state()

    def _load_count_state(self, state: str) -> None:
        if self._counted is not None:
            self._counted.load_state(state)

    def _own_order(self) -> bool:
        """Counted by blocks, the loader reads it in its own order (:meth:`_loader_order`)."""
        return self._counted is not None

    def _loader_order(self, *, shuffle: bool, seed: int, epoch: int) -> BlockOrder | None:
        """Counted by blocks: the group order over the blocks (windows of ``count_window``),
        then the tails run, counted a window at a time (the loader's ``shuffle_block_size`` and
        ``shuffle_window`` do not apply); otherwise ``None``, the loader's. A mixture orders
        its packed sources over ``[0, len)`` (counting every block when it is laid out)."""
        if self._counted is None:
            return None
        return self._counted.order(shuffle=shuffle, seed=seed, epoch=epoch)

    def _fingerprint(self) -> DatasetFingerprint:
        """Counted by blocks and not counted yet: ``observations`` is ``-1`` (the storage's
        digest, the tokenizer and ``sequence_length`` pin the sequences; their number is counted
        as they are read)."""
        if self._is_counted():
            return super()._fingerprint()
        return DatasetFingerprint(
            kind=self._fingerprint_kind(),
            observations=-1,
            sequence_length=self.sequence_length,
            digest=self._storage.content_digest(),
        )

    def _built_layout(self) -> ConcatLayout | BestFitLayout:
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

    def _require_layout(self) -> ConcatLayout | BestFitLayout:
        if self._layout is None:
            raise RuntimeError(
                f"{self!r} has no layout yet: open it first (the loader does, on open() or in "
                "its with block; or `await dataset.open()`)"
            )
        return self._layout

    # -- layout ---------------------------------------------------------------------------------
    async def _offsets_in_chunks(self) -> AsyncIterator[tuple[int, I64]]:
        n = len(self._storage)
        for p0 in range(0, n, CHUNK):
            p1 = min(n, p0 + CHUNK)
            yield p0, await self._storage.document_offsets(np.arange(p0, p1 + 1, dtype=np.int64))

    async def _build(self) -> ConcatLayout | BestFitLayout:
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
                concat_first(targets, first, p0, off)
            return ConcatLayout(length, total, first)
        lengths = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        async for p0, off in self._offsets_in_chunks():
            lengths[p0 : p0 + len(off) - 1] = np.diff(off)
            starts[p0 : p0 + len(off) - 1] = off[:-1]
        blocks, group = self._storage_blocks(), self.fit_group
        if blocks is None or group is None:  # one range: the whole dataset
            return best_fit_layout(lengths, starts, length)
        # ranges of consecutive storage blocks, each the fewest holding fit_group sequences' worth
        return best_fit_layout(lengths, starts, length, fit_bounds(blocks, starts, total, group * length))

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

    # -- reads ----------------------------------------------------------------------------------
    def _assemble(
        self, tokens: npt.NDArray[Any], pieces: Pieces | Callable[[], Pieces], used: I64 | None = None
    ) -> PackedRows:
        """The samples of a window: rows of ``tokens`` (``(n, L)``), the index arrays from its
        ``pieces`` (or what computes them, on first use), and ``used``, the elements each row
        holds before its padding (``None``: every row is full)."""
        padded = np.flatnonzero(used < self.sequence_length) if used is not None else None
        pad_from = used[padded] if used is not None and padded is not None else None
        return PackedRows(Window(tokens, pieces, padded, pad_from, self._aranges), 0, len(tokens))

    def _concat_tokens(self, spans: Sequence[Any], n: int) -> npt.NDArray[Any]:
        if isinstance(spans, Rows):
            return spans.block
        return np.stack(spans) if n else np.empty((0, self.sequence_length), self._storage.dtype)

    def _read(self, indices: I64) -> ReadPlan:
        """Packed sequences ``indices``: one batched span read of the storage (concat mode also
        looks up, at the same time, the offsets of the documents the sequences hold)."""
        if self._counted is not None:
            tokens, pieces = yield from self._counted.read(indices)
            return self._assemble(tokens, pieces)
        self._require_layout()
        indices = np.asarray(indices, dtype=np.int64)
        length = self.sequence_length
        storage, layout, aranges = self._storage, self._layout, self._aranges
        if isinstance(layout, ConcatLayout):
            grid = concat_queries(layout, indices, aranges)
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
                functools.partial(concat_pieces, indices, grid, offsets, length, aranges),
            )
        assert isinstance(layout, BestFitLayout)
        pieces, starts, sizes, used = best_fit_pieces(layout, indices, length, aranges)
        (rows,) = yield [
            Call(
                functools.partial(self._fit_rows_sync, pieces, starts, sizes, len(indices)),
                functools.partial(self._fit_rows_async, starts, sizes, used),
            )
        ]
        return self._assemble(rows, pieces, used)

    def _fit_rows_sync(self, pieces: Pieces, starts: I64, sizes: I64, n: int) -> npt.NDArray[Any]:
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
        """``read_many`` in the caller's thread (the loader's, where the storage reads inline)."""
        return read_sync(self._read(indices))

    def describe(self, index: int) -> dict[str, Any]:
        """The pieces of packed sequence ``index``: each one's document and element range in it
        (``documents``), in the storage (``elements``), and the files holding them. A few lookups
        in the layout and one of the documents' offsets (counted by blocks: the pieces'
        documents and files, and ``block`` and ``sequence``, its place in the block)."""
        if self._counted is not None:
            return self._counted.describe(index)
        layout = self._require_layout()
        length, storage = self.sequence_length, self._storage
        if isinstance(layout, ConcatLayout):
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

    def _will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """The loader's upcoming reads as the storage's: the documents of each window's sequences
        (and, counted by blocks, of the windows past the count), for it to prepare ahead."""
        if self._counted is None and self._layout is None:
            return
        docs = (self._documents_of(np.asarray(w, dtype=np.int64)) for w in windows)
        ahead = () if self._counted is None else self._counted.documents_ahead()
        self._storage.will_read(itertools.chain(docs, ahead))

    def _documents_of(self, indices: I64) -> I64:
        """The documents sequences ``indices`` hold (concat: from the one holding a sequence's
        first element to the one holding the next one's; by blocks: those it holds a piece of)."""
        if self._counted is not None:
            return self._counted.documents_of(indices)
        layout = self._require_layout()
        if isinstance(layout, ConcatLayout):
            first = layout.first[indices]
            return flat_ranges(first, layout.first[indices + 1] - first + 1)
        counts = layout.ptr[indices + 1] - layout.ptr[indices]
        return layout.doc[flat_ranges(layout.ptr[indices], counts)]

    def natural_blocks(self) -> I64 | None:
        """The runs of consecutive sequences read from the same storage blocks (Parquet row
        groups), which ``shuffle_block_size="auto"`` keeps together; ``None`` where the storage
        has no natural blocks (or best fit packs the whole dataset at once, ``fit_group=None``).

        ``"concat"``: the sequences grouped by the block their first element lies in (blocks
        where no sequence starts have none). ``"best_fit"``: the sequences of each range best fit
        packed on its own (see ``fit_group``), which read that range's blocks only.
        """
        if self._counted is not None:
            return None  # its own order keeps the blocks together (see order())
        if self._blocks is None:
            layout = self._built_layout()
            if isinstance(layout, BestFitLayout):
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

    def _natural_blocks(self) -> I64 | None:
        return self.natural_blocks()

    def _position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """The storage's figures (Parquet: row groups decoded), as ``loader.stats()`` reports them
        for the documents themselves."""
        return self._storage.figures()

    def _fingerprint_kind(self) -> str:
        """Another packing counts other sequences: the kind names the mode (and, for best fit
        packed by ranges of storage blocks, the range's size; counted by blocks, the blocks'
        bytes and the window of its order, which a resume must keep)."""
        if self.mode == "best_fit" and self.fit_group is not None and self._storage_blocks() is not None:
            return f"packed-best_fit-group{self.fit_group}"
        if self._counted is not None:  # the blocks and the order's windows make the sequences' order
            return f"packed-concat-blocks{self._counted.part_bytes}-window{self._counted.window}"
        return f"packed-{self.mode}"

    @property
    def _reads_inline(self) -> bool:
        """Whether reads can run in the caller's thread: the storage's say, unless a subclass
        overrides ``read_many``."""
        return self._plain_reads and self._storage.reads_inline()

    def _hints(self) -> ReadHints:
        """The storage's figures; a sample's bytes are a sequence's: its elements and its three
        index arrays."""
        nbytes = self.sequence_length * (self._storage.dtype.itemsize + 16)
        return ReadHints.of_storage(self._storage, sample_nbytes=nbytes)


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
    from anywhere). Over a Parquet text column (a tokenizer), concat is counted as it is read:
    each row group (or run of at most 1 MiB of its rows) is cut on its own and the tails
    together last, and the loader's first batch waits for one window of them to be tokenized,
    not the whole column (see :class:`PackedDataset`). Use the result as a loader's dataset:
    ``StatefulDataLoader(pack(storage, 2048), collate_fn, ...)``; each sample is a read-only
    mapping of ``"tokens"``, ``"doc_ids"``, ``"segment_ids"`` and ``"position_ids"`` (see
    :class:`PackedDataset`). Nothing is read until the loader opens it.
    """
    return PackedDataset(storage, sequence_length, mode, pad_id=pad_id, fit_group=fit_group)
