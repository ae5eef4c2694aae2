"""Any object with ``__len__`` and ``__getitem__`` as a dataset."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._datasets.base import BuiltinDataset, SourceT

__all__ = ["MapDataset"]

_T_co = TypeVar("_T_co", covariant=True)


class _MapStyle(Protocol[_T_co]):
    """What MapDataset needs of a source: ``len(source)`` and ``source[i]``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> _T_co: ...


class MapDataset(BuiltinDataset[SourceT]):
    """Any object with ``__len__`` and ``__getitem__`` (a list, a ``torch.utils.data.Dataset``,
    a Hugging Face dataset) as a dataset: sample ``i`` is ``source[i]``.

    A source with ``__getitems__`` (PyTorch's batched read) is read through it, one call per
    read-ahead window. Reads block: on the loader's own event loop they run inline (a plain
    ``__getitem__`` is CPU work or a local read); from ``async for`` on your loop they run on a
    worker thread, so your loop is not blocked. ``len(source)`` is read once, here.

    Examples:
        >>> import guideloom as gl
        >>> ds = gl.MapDataset(["a", "b", "c"])
        >>> len(ds)
        3
    """

    _plain_reads: ClassVar[bool] = True

    def __init__(self, source: _MapStyle[SourceT]) -> None:
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                "MapDataset needs an object with __len__ and __getitem__ (a list, a "
                f"torch.utils.data.Dataset, ...), got {type(source).__name__}"
            )
        self.source = source
        self._len = check_int("len(source)", len(source), 0)
        self._getitems = getattr(source, "__getitems__", None)

    def __repr__(self) -> str:
        return f"MapDataset({type(self.source).__name__}, len={self._len})"

    def __len__(self) -> int:
        return self._len

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        keys = indices.tolist()
        if self._getitems is not None:
            return list(self._getitems(keys))
        source = self.source
        return [source[i] for i in keys]

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return await asyncio.to_thread(self.read_many_sync, indices)

    @property
    def _reads_inline(self) -> bool:
        return self._plain_reads
