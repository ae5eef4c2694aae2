"""A row group's column decoded out of arrow into numpy, and the null policy's checks."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._parquet._files import _pa

I64 = npt.NDArray[np.int64]
OnNull = Literal["error", "empty"]
#: Bytes a kept token array costs beside its elements (the numpy object and its slot).
_ROW_OVERHEAD = 120


# -- decoded row groups ------------------------------------------------------------------------------
class _Decoded:
    """One row group's column, decoded and copied out of arrow into numpy arrays of its exact
    size: the rows' offsets, and the values (token ids) or the UTF-8 bytes (texts). What is kept
    is then exactly what ``nbytes`` counts (arrow's buffers grow in steps, and its allocator keeps
    freed pages a while), and reading rows needs no arrow kernel."""

    __slots__ = (
        "ahead_done", "bounds", "claimed", "dropped", "nbytes", "nulls", "offsets", "scan", "text",
        "token_bytes", "tokens", "values",
    )  # fmt: skip

    def __init__(self, array: Any, kind: str) -> None:
        pa = _pa()
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        self.text = kind == "text"
        self.nulls = _null_mask(array)
        # read from the buffers themselves: arrow's to_numpy() would import pandas
        large = pa.types.is_large_string(array.type) or pa.types.is_large_list(array.type)
        offsets = _buffer(array.buffers()[1], np.int64 if large else np.int32)
        offsets = offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)
        if not len(offsets):  # no rows: arrow may leave the offsets buffer out
            offsets = np.zeros(1, np.int64)
        start, stop = int(offsets[0]), int(offsets[-1])
        if self.text:  # buffers: validity, offsets, UTF-8 bytes
            whole = _buffer(array.buffers()[2], np.uint8)
        else:  # the child array's buffers: validity, values
            child = array.values
            _refuse_null_elements(child, offsets)
            whole = _buffer(child.buffers()[1], np.dtype(kind.split(":", 1)[1]))[child.offset :]
        #: The values, or a text's UTF-8 bytes (``None`` once every row is tokenized: its
        #: tokens are what is read then).
        self.values: npt.NDArray[Any] | None = whole[start:stop].copy()
        self.offsets: I64 = offsets - start
        #: The offsets read as plain ints (a view, no copy): a row cut by them costs a slice.
        self.bounds = self.offsets.data
        #: A text column's rows tokenized so far (``None`` where not yet): kept with the row
        #: group, so that a row read again (a document that several sequences hold, or read
        #: again while its row group is kept) is tokenized once.
        self.tokens: list[npt.NDArray[Any] | None] | None = [None] * len(array) if self.text else None
        #: Rows a thread is tokenizing now; where tokenizing ahead has looked up to; whether
        #: every row is tokenized (all under the storage's lock).
        self.claimed: set[int] = set()
        #: Rows whose tokens were let go once no read of the epoch needed them (tokenizing ahead
        #: leaves them; a read that needs one tokenizes it again); the bytes the kept tokens hold.
        self.dropped: set[int] = set()
        self.token_bytes = 0
        self.scan = 0
        self.ahead_done = False
        self.nbytes = self._size()

    def _size(self) -> int:
        assert self.values is not None
        return int(self.values.nbytes + self.offsets.nbytes) + (
            0 if self.nulls is None else int(self.nulls.nbytes)
        )

    @classmethod
    def joined(cls, parts: list[_Decoded]) -> _Decoded:
        """Consecutive slices of one text row group's column, decoded each on its own, as one
        (the first, its arrays replaced by the slices' together)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls(_pa().array([], _pa().string()), "text")
        first = parts[0]
        sizes = [len(p.offsets) - 1 for p in parts]
        offsets = np.zeros(sum(sizes) + 1, dtype=np.int64)
        np.cumsum(np.concatenate([np.diff(p.offsets) for p in parts]), out=offsets[1:])
        values = np.concatenate([p.values for p in parts if p.values is not None])
        if all(p.nulls is None for p in parts):
            first.nulls = None
        else:
            blank = [
                np.zeros(n, bool) if p.nulls is None else p.nulls for p, n in zip(parts, sizes, strict=True)
            ]
            first.nulls = np.concatenate(blank)
        first.values, first.offsets, first.bounds = values, offsets, offsets.data
        first.tokens = [None] * sum(sizes)
        first.nbytes = first._size()
        return first

    def rows(self, local: I64) -> list[Any]:
        off, values = self.offsets, self.values
        if values is None:  # never a wrong row: a tokenized group's text is not read again
            raise RuntimeError("the text of a row group whose rows are all tokenized was let go")
        starts, ends = off[local].tolist(), off[local + 1].tolist()
        if self.nulls is not None:  # a null slot's extent is not defined: read as empty
            blank = self.nulls[local]
            starts = np.where(blank, 0, off[local]).tolist()
            ends = np.where(blank, 0, off[local + 1]).tolist()
        if self.text:
            raw = values.data
            return [str(raw[a:b], "utf-8") for a, b in zip(starts, ends, strict=True)]
        return [values[a:b] for a, b in zip(starts, ends, strict=True)]

    def lengths(self) -> I64:
        return np.diff(self.offsets)


def check_values(decoded: _Decoded, group: Any, leaves: list[int], rows: int, where: str) -> None:
    """Refuse a row group whose footer's row count is not what its column chunk holds: the
    chunk's own count of values (``num_values``: one a row for a text column, one a list
    element or empty list for a list column) against the rows decoded. A footer that says
    fewer rows than the pages hold would otherwise drop the rest silently. ``group``: the row
    group's footer metadata; ``rows``: its rows by the footer; ``where``: its place, named."""
    if decoded.text:
        values = len(decoded.offsets) - 1
    else:
        lengths = np.maximum(decoded.lengths(), 1)
        if decoded.nulls is not None:
            lengths[decoded.nulls] = 1
        values = int(lengths.sum())
    for j in leaves:
        chunk = int(group.column(j).num_values)
        if chunk != values:
            raise DatasetIntegrityError(
                f"{where}: the footer says {plural(rows, 'row')}, "
                f"which hold {plural(values, 'value')}, but the column chunk holds "
                f"{plural(chunk, 'value')}: the file's footer does not match its pages (damaged, "
                "edited or written by a faulty writer); write the file again"
            )


def _buffer(buffer: Any, dtype: Any) -> npt.NDArray[Any]:
    """An arrow buffer's bytes as a numpy array of ``dtype`` (no copy; empty for no buffer)."""
    return np.zeros(0, dtype) if buffer is None else np.frombuffer(buffer, dtype=dtype)


def _null_mask(array: Any) -> npt.NDArray[np.bool_] | None:
    """Which of ``array``'s slots are null (from its validity bitmap; ``None`` where none is)."""
    if array.null_count == 0:
        return None
    bitmap = array.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    mask: npt.NDArray[np.bool_] = bits[array.offset : array.offset + len(array)] == 0
    return mask


def _refuse_null_elements(values: Any, offsets: I64) -> None:
    """A list row with a null element has no token id there: refused, not read as a float NaN.
    ``values``: the lists' child array; ``offsets``: the rows' offsets into it."""
    nulls = _null_mask(values)
    if nulls is None:
        return
    inside = np.flatnonzero(nulls[int(offsets[0]) : int(offsets[-1])]) + int(offsets[0])
    if not len(inside):
        return  # null slots outside every row (a sliced array's)
    first = int(inside[0])
    row = int(np.searchsorted(offsets, first, side="right")) - 1
    raise DatasetFormatError(
        f"row {row} holds a null element (at {first - int(offsets[row])}): token ids cannot be "
        "null; fill or drop them in the files"
    )
