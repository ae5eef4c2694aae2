"""The two storage interfaces every backend implements.

Storage is async-first: ``open``/``close`` and batched reads are coroutines, so a backend can
overlap requests (object stores) or move blocking work off the event loop (local files). Reads
are *batched*: the loader asks for every sample of a read-ahead window in one call, which lets a
backend coalesce ranges and keeps per-sample Python work off the hot path.

``InT`` is what the storage holds (the element arrays it was built from), ``OutT`` the sample a
read yields (a 1-D array, or a dict of 1-D arrays for a stream with metadata).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "DocumentStorageAbstract",
    "SampleList",
    "InT",
    "OutT",
    "StorageAbstract",
    "StreamStorageAbstract",
    "blocking_reads_allowed",
]

InT = TypeVar("InT")
OutT = TypeVar("OutT")

#: True while a read runs on an event loop that guideloom owns (the sync facade's loop thread).
#: Such a loop serves nothing else, so a storage may read page-cached data inline instead of
#: hopping to a worker thread: measured here, the hop (and the batch changing CPU cores between
#: the read and the collate) cost more than the read itself. On a caller's loop it is False, and
#: storages keep blocking work off the loop.
blocking_reads_allowed: ContextVar[bool] = ContextVar("guideloom_blocking_reads_allowed", default=False)


class SampleList(list[npt.NDArray[Any]]):
    """A list of equal-length samples that are rows of one contiguous block.

    It is an ordinary list (what ``collate_fn`` receives), and ``np.asarray(samples)`` returns
    the block itself, without a copy, where ``np.stack(samples)`` would copy every row again. A
    stream collate such as ``torch.from_numpy(np.asarray(samples).astype(np.int64))`` thus makes
    one pass over the data. Changing the list's contents drops the shortcut.
    """

    __slots__ = ("_block", "_ends")

    def __init__(self, block: npt.NDArray[Any]) -> None:
        super().__init__(block)
        self._block: npt.NDArray[Any] | None = block
        self._ends: tuple[npt.NDArray[Any], ...] = (self[0], self[-1]) if len(self) else ()

    def slice(self, start: int, stop: int) -> SampleList:
        """Rows ``[start, stop)``, still backed by (a view of) the block."""
        assert self._block is not None
        return SampleList(self._block[start:stop])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        block = self._block
        intact = (
            block is not None
            and len(self) == len(block)
            and (not len(self) or (self[0] is self._ends[0] and self[-1] is self._ends[1]))
        )
        out = block if intact and block is not None else np.stack(list(self)) if len(self) else np.empty(0)
        if dtype is not None and out.dtype != dtype:
            return out.astype(dtype)
        return out.copy() if copy else out


class StorageAbstract(ABC, Generic[InT, OutT]):
    """What both storage kinds share: lifecycle and a read-concurrency hint."""

    #: How many ``read_many`` calls the loader may keep in flight at once. Local and memory
    #: storages gain nothing from more than one; object stores override it.
    max_concurrent_reads: int = 1
    #: Raw bytes the loader asks for in one ``read_many`` call (a read-ahead window). 1 MiB keeps
    #: a local window in the CPU's L2 cache until it is collated; object stores want more.
    read_window_bytes: int = 2**20

    async def open(self) -> None:
        """Acquire what reading needs (file maps, clients). Idempotent."""

    async def close(self) -> None:
        """Release what ``open`` acquired. Idempotent; the storage may be opened again."""

    async def __aenter__(self) -> StorageAbstract[InT, OutT]:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    @abstractmethod
    def dtype(self) -> np.dtype[Any]:
        """The element dtype of the token data."""

    def sample_nbytes_hint(self) -> int:
        """A typical sample's size in bytes, for sizing read-ahead windows (0 if unknown)."""
        return 0


class StreamStorageAbstract(StorageAbstract[InT, OutT]):
    """One long stream of elements (tokens), optionally with per-element metadata fields."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of elements in the stream."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Metadata field names; empty for a plain token stream (samples are arrays then)."""
        return ()

    @abstractmethod
    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[OutT]:
        """Return the ``length``-element windows that begin at each of ``starts``, in order.

        Every window lies inside ``[0, len(self))``. Plain streams return 1-D arrays; streams
        with metadata return ``{"tokens": ..., field: ...}`` dicts of 1-D arrays.
        """


class DocumentStorageAbstract(StorageAbstract[InT, OutT]):
    """A sequence of variable-length documents, each a 1-D array."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of documents."""

    @abstractmethod
    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[OutT]:
        """Return documents ``indices`` (each in ``[0, len(self))``), in that order."""
