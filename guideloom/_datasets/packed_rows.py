"""Packed sequences as samples: the rows of one read window and their index arrays.

A :class:`~guideloom._datasets.packing.PackedDataset` read returns :class:`PackedRows`, the
window's tokens with ``doc_ids``, ``segment_ids`` and ``position_ids`` computed from its
:class:`~guideloom._core.pack_layout.Pieces` the first time a collate asks for them, each for all
the window's rows at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from guideloom._core.pack_layout import Aranges, Pieces

__all__ = ["KEYS", "PackedRows", "Window"]

I64 = npt.NDArray[np.int64]
KEYS = ("tokens", "doc_ids", "segment_ids", "position_ids")


class Window:
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
        pieces: Pieces | Callable[[], Pieces],
        padded: I64 | None,
        pad_from: I64 | None,
        arange: Callable[[int, type[np.signedinteger[Any]]], npt.NDArray[Any]],
    ) -> None:
        self.tokens, self._pieces, self._padded, self._pad_from = tokens, pieces, padded, pad_from
        self._arange = arange
        self._blocks: dict[str, npt.NDArray[Any]] = {"tokens": tokens}

    @property
    def pieces(self) -> Pieces:
        """The window's pieces, computed the first time an index array needs them (a collate of
        tokens alone never does)."""
        pieces = self._pieces
        if not isinstance(pieces, Pieces):
            pieces = self._pieces = pieces()
        return pieces

    def preset(self, blocks: dict[str, npt.NDArray[Any]]) -> None:
        self._blocks.update(blocks)

    def computed(self) -> dict[str, npt.NDArray[Any]]:
        """The index arrays computed so far (not the tokens)."""
        return {k: v for k, v in self._blocks.items() if k != "tokens"}

    def cut(self, start: int, stop: int) -> tuple[Pieces, I64 | None, I64 | None] | None:
        """The pieces, padded rows and padding starts of rows ``[start, stop)`` alone, as a
        window of those rows has them; ``None`` where a piece runs over a row's end (none of
        ``pack``'s does: each row's pieces are cut at its ends)."""
        p, length = self.pieces, self.tokens.shape[1]
        lo, hi = start * length, stop * length
        keep = (p.start >= lo) & (p.start < hi)
        lengths = p.length[keep]
        if int(lengths.sum()) != hi - lo or (len(lengths) and int(p.start[keep][-1] + lengths[-1]) > hi):
            return None
        pieces = Pieces(lengths, p.doc[keep], p.segment[keep], p.start[keep] - lo)
        padded, pad_from = self._padded, self._pad_from
        if padded is not None and pad_from is not None:
            rows = (padded >= start) & (padded < stop)
            padded, pad_from = padded[rows] - start, pad_from[rows]
        return pieces, padded, pad_from

    def block(self, key: str) -> npt.NDArray[Any]:
        got = self._blocks.get(key)
        if got is None:
            if key not in KEYS:
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

    def __init__(self, window: Window, start: int, stop: int) -> None:
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
        """Pickled (for a process worker) as its tokens, the index arrays already computed, and
        the pieces of its rows for the others, which the receiver computes if its collate asks:
        a collate of tokens alone (the usual one) costs neither process those arrays, and the
        message holds its tokens' bytes, not four arrays' (an int64 ``doc_ids`` alone is four
        times ``uint16`` tokens)."""
        window, start, stop = self._window, self._start, self._stop
        tokens = np.ascontiguousarray(window.tokens[start:stop])
        done = {k: np.ascontiguousarray(v[start:stop]) for k, v in window.computed().items()}
        if len(done) < len(KEYS) - 1:
            cut = window.cut(start, stop)
            if cut is not None:
                return (_rows_of_pieces, (tokens, *cut, done))
        blocks = {k: np.ascontiguousarray(self.block(k)) for k in KEYS}
        return (_rows_of_blocks, (blocks,))

    def __repr__(self) -> str:
        return f"PackedRows({len(self)} sequences of {self._window.tokens.shape[1]})"


#: ``arange`` cut from a cached one, for the windows a process unpickles (one per process).
_ARANGES = Aranges()


def _rows_of_pieces(
    tokens: npt.NDArray[Any],
    pieces: Pieces,
    padded: I64 | None,
    pad_from: I64 | None,
    done: dict[str, npt.NDArray[Any]],
) -> PackedRows:
    """``PackedRows`` over tokens whose index arrays are computed from ``pieces`` on first use
    (those in ``done`` were computed already: what a pickled ``PackedRows`` becomes)."""
    window = Window(tokens, pieces, padded, pad_from, _ARANGES)
    window.preset(done)
    return PackedRows(window, 0, len(tokens))


def _rows_of_blocks(blocks: dict[str, npt.NDArray[Any]]) -> PackedRows:
    """``PackedRows`` over arrays already made (what a pickled ``PackedRows`` becomes)."""
    tokens = blocks["tokens"]
    none = np.empty(0, dtype=np.int64)
    window = Window(tokens, Pieces(none, none, np.empty(0, np.int32), none), None, None, _no_range)
    window.preset(blocks)
    return PackedRows(window, 0, len(tokens))


def _no_range(size: int, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
    raise AssertionError("a window made of blocks computes nothing")


class _PackedSample(Mapping[str, npt.NDArray[Any]]):
    """One packed sequence: a read-only mapping of its four arrays, rows of its window's
    (pickled, as for process workers, it is a plain dict)."""

    __slots__ = ("_row", "_window")

    def __init__(self, window: Window, row: int) -> None:
        self._window, self._row = window, row

    def __getitem__(self, key: str) -> npt.NDArray[Any]:
        row: npt.NDArray[Any] = self._window.block(key)[self._row]
        return row

    def __iter__(self) -> Iterator[str]:
        return iter(KEYS)

    def __len__(self) -> int:
        return len(KEYS)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {self[k]!r}" for k in KEYS) + "}"
