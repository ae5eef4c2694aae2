"""The pack layout arithmetic: which document pieces make each packed sequence.

Pure functions of the documents' lengths and offsets (no I/O): the concat layout (the document
holding each sequence's first element) and best fit decreasing, over the whole dataset or over
ranges of documents each packed on its own, and the :class:`Pieces` of a window of rows under
either. ``guideloom._datasets.packing`` builds them from a storage's offsets and reads by them.

Concat *by blocks* (a storage's natural blocks, Parquet row groups): each block is cut every
``L`` elements on its own, so that a block's sequences depend on that block alone (they can be
counted block by block, as its documents are first read), and every block's tail (its last
``total % L`` elements) goes to one tails run, concatenated in block order and cut: the same
elements as the whole concatenation cut every ``L`` (the same ``total // L`` sequences; only the
tails run's last ``total % L`` elements are left out), cut elsewhere.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHUNK",
    "Aranges",
    "BestFitLayout",
    "BlockPieces",
    "ConcatLayout",
    "Pieces",
    "best_fit_decreasing",
    "best_fit_layout",
    "best_fit_pieces",
    "block_counts",
    "block_pieces",
    "concat_first",
    "concat_pieces",
    "concat_queries",
    "fit_bounds",
    "flat_ranges",
    "tails_count",
]

I64 = npt.NDArray[np.int64]

#: Document offsets read per call while building a layout: bounds the build's memory beyond
#: the layout itself.
CHUNK = 1 << 20


def flat_ranges(starts: I64, counts: I64) -> I64:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(total, dtype=np.int64)


class Aranges:
    """``arange(size)`` of a dtype, cut from a cached one (read windows repeat their sizes)."""

    __slots__ = ("_cached",)

    def __init__(self) -> None:
        self._cached: dict[type[np.signedinteger[Any]], npt.NDArray[Any]] = {}

    def __call__(self, size: int, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
        cached = self._cached.get(dtype)
        if cached is None or len(cached) < size:
            cached = self._cached[dtype] = np.arange(size, dtype=dtype)
        return cached[:size]


@dataclass(frozen=True, slots=True)
class Pieces:
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
class ConcatLayout:
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
class BestFitLayout:
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


def concat_first(targets: I64, first: I64, start: int, offsets: I64) -> None:
    """Fill ``first`` (a :class:`ConcatLayout`'s, ``targets`` the elements ``min(k * L, total -
    1)``) where a chunk of documents holds them: documents ``start, start + 1, ...`` whose
    offsets are ``offsets`` (one more than the documents, the last the next one's start)."""
    lo, hi = np.searchsorted(targets, [offsets[0], offsets[-1]], side="left").tolist()
    first[lo:hi] = start + np.searchsorted(offsets, targets[lo:hi], side="right") - 1


def concat_queries(layout: ConcatLayout, indices: I64, arange: Aranges) -> I64:
    """The document offsets to look up for rows ``indices``: an ``(n, w)`` grid, row ``i`` the
    documents from the one holding the row's first element to the one after its last
    (repeating the last where a row has fewer: those pieces come out empty)."""
    a, c = layout.first[indices], layout.first[indices + 1]
    width = int((c - a).max()) + 2 if len(indices) else 2
    grid: I64 = np.minimum(a[:, None] + arange(width, np.int64), (c + 1)[:, None])
    return grid


def concat_pieces(indices: I64, positions: I64, offsets: I64, length: int, arange: Aranges) -> Pieces:
    """The pieces of full rows ``indices`` from the grid of document ``positions``
    (:func:`concat_queries`) and their ``offsets``: a few whole-grid operations, O(rows x
    documents a row) whatever the row's length (the elements are never looked at)."""
    n = len(indices)
    rel = offsets.reshape(positions.shape) - (indices * length)[:, None]
    np.minimum(np.maximum(rel, 0, out=rel), length, out=rel)  # np.clip costs more on small arrays
    sizes = rel[:, 1:] - rel[:, :-1]
    starts = rel[:, :-1] + (arange(n, np.int64) * length)[:, None]
    segments = np.cumsum(sizes > 0, axis=1, dtype=np.int32)  # empty documents get no id
    return Pieces(sizes.ravel(), positions[:, :-1].ravel(), segments.ravel(), starts.ravel())


def best_fit_pieces(
    layout: BestFitLayout, indices: I64, length: int, arange: Aranges
) -> tuple[Pieces, I64, I64, I64]:
    """The pieces of best-fit rows ``indices``, each row's padding a piece after its last (empty
    in a full row); where each real piece's elements start in the storage, their position in the
    pieces, and how many elements each row holds."""
    n = len(indices)
    counts = layout.ptr[indices + 1] - layout.ptr[indices]
    at = flat_ranges(layout.ptr[indices], counts)
    size = layout.size[at].astype(np.int64)
    ends = np.cumsum(size)
    last = np.cumsum(counts) - 1  # each row's last piece
    used = np.diff(ends[last], prepend=0) if n else np.zeros(0, np.int64)
    rows = np.repeat(arange(n, np.int64), counts)
    real = arange(len(at), np.int64) + rows  # where the real pieces go
    pad = last + arange(n, np.int64) + 1  # where each row's padding goes
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
    starts[pad] = arange(n, np.int64) * length + used
    return Pieces(sizes, docs, segments, starts), layout.start[at], size, used


def fit_bounds(blocks: I64, starts: I64, total: int, need: int) -> I64:
    """Where best fit's ranges of documents begin and end: runs of consecutive ``blocks`` (each
    its number of documents), each the fewest that hold ``need`` elements (a short last range
    joins the one before); ``starts``: each document's first element, ``total`` in all."""
    ends = np.cumsum(blocks)
    offsets = np.append(starts, total)  # element offset of each document
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


def best_fit_layout(lengths: I64, starts: I64, length: int, bounds: I64 | None = None) -> BestFitLayout:
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
    whole_start = starts[whole_doc] + (flat_ranges(np.zeros(len(docs), np.int64), whole) * length)
    has_rest = np.flatnonzero(rest > 0)
    if bounds is None:
        order = has_rest[np.lexsort((has_rest, -rest[has_rest]))]
        bins = best_fit_decreasing(rest[order], length)
    else:  # by range, then as above: each range's pieces are one run, packed on its own
        group = np.repeat(np.arange(len(bounds) - 1, dtype=np.int64), np.diff(bounds))
        order = has_rest[np.lexsort((has_rest, -rest[has_rest], group[has_rest]))]
        first_of_range = np.flatnonzero(np.diff(group[order], prepend=-1))
        bins = best_fit_decreasing(rest[order], length, first_of_range[1:])
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
        return BestFitLayout(length, ptr, doc, start, size, np.asarray([len(counts)], np.int64))
    # each sequence's range (a whole piece's document's; a bin's documents', which share one):
    # the sequences of each range, its whole pieces then its bins, one range after the other
    bin_range = np.empty(nbins, np.int64)
    bin_range[bins] = group[order]
    seq_range = np.concatenate([group[whole_doc], bin_range])
    seq_order = np.argsort(seq_range, kind="stable")
    at = flat_ranges((np.cumsum(counts) - counts)[seq_order], counts[seq_order])
    ptr = np.concatenate([[0], np.cumsum(counts[seq_order])]).astype(np.int64)
    per_range = np.bincount(seq_range, minlength=len(bounds) - 1).astype(np.int64)
    return BestFitLayout(length, ptr, doc[at], start[at], size[at], per_range)


def best_fit_decreasing(sizes: I64, capacity: int, cuts: I64 | None = None) -> I64:
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
        for chunk_start in range(lo, hi, CHUNK):
            chunk = sizes[chunk_start : min(hi, chunk_start + CHUNK)].tolist()
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


# -- concat by blocks: each block packed on its own, the tails packed together last ------------
def block_counts(totals: I64, length: int) -> I64:
    """Sequences of each block packed on its own: ``totals[b] // length`` (``totals``: the
    elements of each block). A block's count depends on that block alone."""
    return np.asarray(totals, dtype=np.int64) // length


def tails_count(totals: I64, length: int) -> int:
    """Sequences cut from the blocks' tails (each block's ``totals[b] % length`` last elements),
    concatenated in block order: with :func:`block_counts`, ``sum(totals) // length`` in all,
    the number the concatenation of all blocks cut every ``length`` elements has."""
    return int((np.asarray(totals, dtype=np.int64) % length).sum()) // length


@dataclass(frozen=True, slots=True)
class BlockPieces:
    """The pieces of some sequences of a concat-by-blocks layout, in row order: piece ``i``
    holds the block-local elements ``[lo[i], hi[i])`` of block ``block[i]``, and goes into row
    ``row[i]`` from column ``at[i]`` on."""

    row: I64
    block: I64
    lo: I64
    hi: I64
    at: I64


def block_pieces(blocks: I64, seqs: I64, length: int, totals: I64 | None, tails: int) -> BlockPieces:
    """Where sequences ``(blocks[i], seqs[i])`` of a concat-by-blocks layout take their elements.

    Block ``b < tails``'s sequence ``j`` is its local elements ``[j * length, (j + 1) * length)``
    (one piece); block ``tails`` names the tails run: the last ``totals[b] % length`` elements of
    every block ``b``, concatenated in block order and cut every ``length`` elements, so that
    its sequence ``j`` is a piece of each block whose tail it overlaps. ``totals`` (every
    block's elements) is needed only where a tails sequence is asked for.
    """
    blocks = np.asarray(blocks, dtype=np.int64)
    seqs = np.asarray(seqs, dtype=np.int64)
    n = len(blocks)
    rows = np.arange(n, dtype=np.int64)
    plain = blocks != tails
    if plain.all():
        lo = seqs * length
        return BlockPieces(rows, blocks.copy(), lo, lo + length, np.zeros(n, np.int64))
    if totals is None:
        raise ValueError("a tails sequence needs every block's elements (totals)")
    totals = np.asarray(totals, dtype=np.int64)
    rest = totals % length
    begin = totals - rest  # each block's tail: local elements [begin, totals)
    ends = np.cumsum(rest)  # the tails run: block b's tail at [ends[b] - rest[b], ends[b])
    t = np.flatnonzero(~plain)
    a = seqs[t] * length
    if len(t) and int(a.max()) + length > int(ends[-1] if len(ends) else 0):
        raise IndexError(f"tails sequence outside [0, {tails_count(totals, length)})")
    first = np.searchsorted(ends, a, side="right")  # the block holding each row's first element
    last = np.searchsorted(ends, a + length - 1, side="right")
    counts = last - first + 1
    trow = np.repeat(t, counts)
    tblock = flat_ranges(first, counts)
    run_lo = np.maximum(ends[tblock] - rest[tblock], np.repeat(a, counts))
    run_hi = np.minimum(ends[tblock], np.repeat(a + length, counts))
    keep = run_hi > run_lo  # blocks without a tail inside a row's range give no piece
    trow, tblock, run_lo, run_hi = trow[keep], tblock[keep], run_lo[keep], run_hi[keep]
    local = begin[tblock] - (ends[tblock] - rest[tblock])  # run position -> block-local element
    tat = run_lo - seqs[trow] * length
    p = np.flatnonzero(plain)
    row = np.concatenate([p, trow])
    order = np.argsort(row, kind="stable")
    plo = seqs[p] * length
    return BlockPieces(
        row[order],
        np.concatenate([blocks[p], tblock])[order],
        np.concatenate([plo, run_lo + local])[order],
        np.concatenate([plo + length, run_hi + local])[order],
        np.concatenate([np.zeros(len(p), np.int64), tat])[order],
    )
