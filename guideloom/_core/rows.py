"""Samples as views of one block: the rows of a 2-D array (fixed-length stream samples) or the
spans of one buffer (documents), each a ``Sequence`` whose elements are views, not copies.

A batch's samples reach ``collate_fn`` as one of these, so ``np.asarray(samples)`` of a stream
batch is the block itself. Pure containers: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = ["Rows", "Spans"]


class Rows(Sequence[npt.NDArray[Any]]):
    """Equal-length samples that are the rows of one 2-D block: a read-only ``Sequence``.

    What plain stream storages return from a read, and what ``collate_fn`` receives for a plain
    stream: ``rows[i]`` is a view of row ``i`` (a 1-D sample), ``rows[a:b]`` is ``Rows`` again,
    and ``np.asarray(rows)`` is the block itself, without a copy, where ``np.stack`` of a list
    of rows copies every row again. A collate such as
    ``torch.from_numpy(np.asarray(samples).astype(np.int64))`` thus makes one pass over the data,
    and no per-row object is made unless the collate asks for one (a list of 16 row views costs
    about what a batch's int64 conversion does).
    """

    __slots__ = ("block",)

    def __init__(self, block: npt.NDArray[Any]) -> None:
        self.block = block

    def __len__(self) -> int:
        return len(self.block)

    @overload
    def __getitem__(self, index: int) -> npt.NDArray[Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Rows: ...
    def __getitem__(self, index: int | slice) -> npt.NDArray[Any] | Rows:
        if isinstance(index, slice):
            return Rows(self.block[index])
        return self.block[index]  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        if dtype is None or self.block.dtype == dtype:
            return self.block.copy() if copy else self.block
        if copy is False:
            raise ValueError(
                f"Rows of {self.block.dtype} cannot be viewed as {np.dtype(dtype)} without a copy"
            )
        return self.block.astype(dtype)

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same samples (``Rows`` of an empty batch ``== []``)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        if len(other) != len(self):
            return False
        return all(np.array_equal(a, b) for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({self.block!r})"


class Spans(Sequence[npt.NDArray[Any]]):
    """Spans of elements back to back in one buffer: a read-only ``Sequence`` whose item ``i``
    is a view of span ``i``. What a local ``read_spans`` returns, so that a caller that wants
    the elements contiguous (document packing) takes ``buffer`` as it is instead of
    concatenating the spans again, and no per-span array is made unless one is asked for."""

    __slots__ = ("bounds", "buffer")

    def __init__(self, buffer: npt.NDArray[Any], bounds: npt.NDArray[np.int64]) -> None:
        self.buffer, self.bounds = buffer, bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, index: int) -> npt.NDArray[Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[npt.NDArray[Any]]: ...
    def __getitem__(self, index: int | slice) -> npt.NDArray[Any] | Sequence[npt.NDArray[Any]]:
        n = len(self)
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(n))]
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"span {index} of {n}")
        view: npt.NDArray[Any] = self.buffer[int(self.bounds[index]) : int(self.bounds[index + 1])]
        return view

    def __repr__(self) -> str:
        return f"Spans({len(self)} spans, {len(self.buffer)} elements)"
