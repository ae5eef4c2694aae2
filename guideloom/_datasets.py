"""Datasets: observation ``i`` to sample, over a storage.

A dataset is what the loader plans over: it has a number of observations and reads any set of
them in one batched call. ``StreamDataset`` cuts a stream into fixed-length samples;
``DocumentDataset`` serves one document per sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from ._checks import check_int
from ._storage.base import DocumentStorageAbstract, StorageAbstract, StreamStorageAbstract

__all__ = ["DatasetAbstract", "DocumentDataset", "SourceT", "StreamDataset", "dataset_for"]

SourceT = TypeVar("SourceT")


class DatasetAbstract(ABC, Generic[SourceT]):
    """A finite, random-access collection of samples read in batches."""

    @property
    @abstractmethod
    def storage(self) -> StorageAbstract[Any, SourceT]:
        """The storage this dataset reads from."""

    async def open(self) -> None:
        """Open the storage; the loader calls this on ``open()`` / entering ``with``, before
        ``len()`` is asked (a storage may learn its length only once open)."""
        await self.storage.open()

    async def close(self) -> None:
        """Close the storage; the loader calls this on ``close()``, after its last read."""
        await self.storage.close()

    @abstractmethod
    def __len__(self) -> int:
        """Number of observations (samples)."""

    @abstractmethod
    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        """Samples ``indices`` (each in ``[0, len(self))``), in that order."""

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        """``read_many`` in the caller's thread (only where ``reads_inline``)."""
        raise NotImplementedError(f"{type(self).__name__} has no blocking reads")

    @property
    def reads_inline(self) -> bool:
        """Whether ``read_many_sync`` can stand in for ``read_many`` now (see
        :meth:`StorageAbstract.reads_inline <guideloom.StreamStorageAbstract.reads_inline>`).

        guideloom's datasets answer for themselves and their storage; not where a subclass
        overrides ``read_many`` (to add a check, an augmentation or a fault): its own
        ``read_many`` is then the read, and the loader calls that. A dataset of your own is
        read through its ``read_many``.
        """
        return False

    @property
    def max_concurrent_reads(self) -> int:
        """How many read windows the loader keeps in flight at once: the storage's figure (1 for
        memory and local files, more for object stores, where a read is bound by round trips)."""
        return max(1, int(self.storage.max_concurrent_reads))

    @property
    def read_window_bytes(self) -> int:
        """Bytes the loader asks for in one ``read_many`` call at most (the storage's figure): the
        read-ahead window that batched reads and range coalescing work over."""
        return max(1, int(self.storage.read_window_bytes))

    def sample_nbytes_hint(self) -> int:
        """A typical sample's size in bytes (0 if unknown), for sizing read-ahead windows."""
        return 0

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """A hint: the ``read_many(indices)`` calls the loader will make next, in order (see
        :meth:`StreamStorageAbstract.will_read <guideloom.StreamStorageAbstract.will_read>`).
        The default ignores it."""


class StreamDataset(DatasetAbstract[SourceT]):
    """Samples of ``sequence_length`` consecutive stream elements; sample ``i`` starts at ``i * L``.

    Trailing elements that do not fill a whole sample are not a sample.
    """

    def __init__(self, storage: StreamStorageAbstract[Any, SourceT], sequence_length: int) -> None:
        if not isinstance(storage, StreamStorageAbstract):
            raise TypeError(f"StreamDataset needs a StreamStorageAbstract, got {type(storage).__name__}")
        self._storage = storage
        self.sequence_length = check_int("sequence_length", sequence_length, 1)

    def __repr__(self) -> str:
        return f"StreamDataset({self._storage!r}, sequence_length={self.sequence_length})"

    @property
    def storage(self) -> StreamStorageAbstract[Any, SourceT]:
        return self._storage

    def __len__(self) -> int:
        return len(self._storage) // self.sequence_length

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return await self._storage.read_many(indices * self.sequence_length, self.sequence_length)

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return self._storage.read_many_sync(indices * self.sequence_length, self.sequence_length)

    @property
    def reads_inline(self) -> bool:
        return type(self).read_many is StreamDataset.read_many and self._storage.reads_inline()

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        if type(self).read_many is StreamDataset.read_many:  # reads map to the storage's 1:1
            length = self.sequence_length
            self._storage.will_read((np.asarray(w, dtype=np.int64) * length for w in windows), length)

    def sample_nbytes_hint(self) -> int:
        return self.sequence_length * max(
            1, self._storage.sample_nbytes_hint() or self._storage.dtype.itemsize
        )


class DocumentDataset(DatasetAbstract[SourceT]):
    """One document per sample, as written."""

    def __init__(self, storage: DocumentStorageAbstract[Any, SourceT]) -> None:
        if not isinstance(storage, DocumentStorageAbstract):
            raise TypeError(f"DocumentDataset needs a DocumentStorageAbstract, got {type(storage).__name__}")
        self._storage = storage

    def __repr__(self) -> str:
        return f"DocumentDataset({self._storage!r})"

    @property
    def storage(self) -> DocumentStorageAbstract[Any, SourceT]:
        return self._storage

    def __len__(self) -> int:
        return len(self._storage)

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return await self._storage.read_many(indices)

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return self._storage.read_many_sync(indices)

    @property
    def reads_inline(self) -> bool:
        return type(self).read_many is DocumentDataset.read_many and self._storage.reads_inline()

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        if type(self).read_many is DocumentDataset.read_many:  # reads map to the storage's 1:1
            self._storage.will_read(windows)

    def sample_nbytes_hint(self) -> int:
        return self._storage.sample_nbytes_hint()


def dataset_for(storage: Any, sequence_length: int | None) -> DatasetAbstract[Any]:
    """The dataset that wraps ``storage``: a :class:`StreamDataset` of ``sequence_length``
    samples for stream storage (which needs one), a :class:`DocumentDataset` for document
    storage (which takes none)."""
    if isinstance(storage, StreamStorageAbstract):
        if sequence_length is None:
            raise ValueError(
                "stream storage needs sequence_length: pass sequence_length=<elements per sample>"
            )
        return StreamDataset(storage, sequence_length)
    if isinstance(storage, DocumentStorageAbstract):
        if sequence_length is not None:
            raise ValueError(
                "document storage yields one whole document per sample and takes no "
                f"sequence_length (got {sequence_length}); drop the argument"
            )
        return DocumentDataset(storage)
    raise TypeError(
        "storage must be a StreamStorageAbstract or DocumentStorageAbstract (for example "
        f"MemoryStreamStorage, or what open_stream() returns), got {type(storage).__name__}"
    )
