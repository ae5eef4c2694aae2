"""Datasets: observation ``i`` to sample, over a storage or any random-access source.

A dataset is what the loader plans over: it has a number of observations and reads any set of
them in one batched call. ``StreamDataset`` cuts a stream into fixed-length samples;
``DocumentDataset`` serves one document per sample; ``MapDataset`` adapts any object with
``__len__`` and ``__getitem__``. A dataset of your own subclasses ``DatasetAbstract`` and
implements ``__len__`` and ``read_many``; ``storage`` is optional (``None`` by default, and
``open``/``close`` then do nothing).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom.storage.base import DocumentStorageAbstract, StorageAbstract, StreamStorageAbstract

if TYPE_CHECKING:
    from guideloom._core.order import Order

__all__ = ["DatasetAbstract", "DocumentDataset", "MapDataset", "SourceT", "StreamDataset", "dataset_for"]

_DEFAULT_READ_WINDOW_BYTES = 4 * 2**20  # what StorageAbstract.read_window_bytes defaults to

SourceT = TypeVar("SourceT")
_T_co = TypeVar("_T_co", covariant=True)


class _MapStyle(Protocol[_T_co]):
    """What MapDataset needs of a source: ``len(source)`` and ``source[i]``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> _T_co: ...


class DatasetAbstract(ABC, Generic[SourceT]):
    """A finite, random-access collection of samples read in batches.

    Subclass it for a source of your own: implement ``__len__`` and ``read_many`` (and, where
    the source must be opened and closed, ``open`` and ``close``). ``storage`` is optional.
    """

    @property
    def storage(self) -> StorageAbstract[Any, SourceT] | None:
        """The storage this dataset reads from; ``None`` (the default) for a dataset that reads
        a source of its own."""
        return None

    async def open(self) -> None:
        """Open what the dataset reads (its storage, if any); the loader calls this on ``open()``
        / entering ``with``, before ``len()`` is asked (a storage may learn its length only once
        open)."""
        if self.storage is not None:
            await self.storage.open()

    async def close(self) -> None:
        """Close what :meth:`open` opened; the loader calls this on ``close()``, after its last
        read."""
        if self.storage is not None:
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
        memory and local files, more for object stores, where a read is bound by round trips);
        1 for a dataset without a storage."""
        return 1 if self.storage is None else max(1, int(self.storage.max_concurrent_reads))

    @property
    def read_window_bytes(self) -> int:
        """Bytes the loader asks for in one ``read_many`` call at most (the storage's figure, 4 MiB
        without one): the read-ahead window that batched reads and range coalescing work over."""
        if self.storage is None:
            return _DEFAULT_READ_WINDOW_BYTES
        return max(1, int(self.storage.read_window_bytes))

    def sample_nbytes_hint(self) -> int:
        """A typical sample's size in bytes (0 if unknown), for sizing read-ahead windows."""
        return 0

    def order(self, *, shuffle: bool, seed: int, epoch: int) -> Order | None:
        """The epoch order of a dataset that makes its own, or ``None`` (the default): the
        loader then makes its own (the seeded permutation of ``[0, len(self))``, or the block
        shuffle that ``shuffle_block_size`` asks for; a dataset's own order ignores that).

        An order maps each position ``[0, len(self))`` to the index ``read_many`` is given for
        it, and depends on the arguments and the dataset alone (never on batch size or ranks).
        A mixture returns one (its sources' schedule and permutations behind it).
        """
        return None

    def position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """Figures about position ``(epoch, offset)`` for ``loader.stats()`` (none by default; a
        mixture reports each source's own epoch)."""
        return {}

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


class MapDataset(DatasetAbstract[SourceT]):
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
    def reads_inline(self) -> bool:
        return type(self).read_many is MapDataset.read_many


def dataset_for(storage: Any, sequence_length: int | None) -> DatasetAbstract[Any]:
    """The dataset that wraps ``storage``: a :class:`StreamDataset` of ``sequence_length``
    samples for stream storage (which needs one), a :class:`DocumentDataset` for document
    storage (which takes none). A dataset (a mixture) is taken as it is; a mixture's stream
    sources without a sequence length of their own take ``sequence_length``."""
    if isinstance(storage, DatasetAbstract):
        from guideloom._datasets.mixture import Mixture

        if isinstance(storage, Mixture):
            return storage.with_sequence_length(sequence_length)
        if sequence_length is not None:
            raise ValueError(
                f"{type(storage).__name__} is a dataset, which has its own sample rule and takes "
                f"no sequence_length (got {sequence_length}); drop the argument"
            )
        return storage
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
        f"MemoryStreamStorage, or what open_stream() returns) or a mixture from mix(), got "
        f"{type(storage).__name__}"
    )
