"""The two storage interfaces every backend implements.

Storage is async-first: ``open``/``close`` and batched reads are coroutines, so a backend can
overlap requests (object stores) or move blocking work off the event loop. Reads are *batched*:
the loader asks for every sample of a read-ahead window in one call, which lets a backend
coalesce ranges and keeps per-sample Python work off the hot path.

A backend whose work is blocking (memory, local files) implements it once, as ``open_sync`` and
``read_many_sync``: the async ``open`` and ``read_many`` of these base classes run it, inline
where it only touches memory and on a worker thread otherwise, so a caller's event loop never
waits for a disk. Only a backend with truly asynchronous I/O (an object store) overrides
``read_many`` itself.

``InT`` is what the storage holds (the element arrays it was built from), ``OutT`` the sample a
read yields (a 1-D array, or a dict of 1-D arrays for a stream with metadata).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import anyio.to_thread
import numpy as np
import numpy.typing as npt

from guideloom._core.rows import Rows, Spans

if TYPE_CHECKING:
    from guideloom.storage._format._manifest import Manifest

__all__ = [
    "BlockCounter",
    "DocumentStorageAbstract",
    "InT",
    "Rows",
    "Spans",
    "OutT",
    "StorageAbstract",
    "StreamStorageAbstract",
    "mark_own_reads",
]

InT = TypeVar("InT")
OutT = TypeVar("OutT")

R = TypeVar("R")


def mark_own_reads(cls: type) -> None:
    """A class that defines ``read_many`` without declaring ``_plain_reads`` again is read
    through its own ``read_many`` (storages and datasets alike; run at class creation)."""
    if "read_many" in cls.__dict__ and "_plain_reads" not in cls.__dict__:
        cls._plain_reads = False  # type: ignore[attr-defined]


class StorageAbstract(ABC, Generic[InT, OutT]):
    """What both storage kinds share: lifecycle and a read-concurrency hint."""

    #: How many ``read_many`` calls the loader may keep in flight at once. Local and memory
    #: storages gain nothing from more than one; object stores override it.
    max_concurrent_reads: int = 1
    #: Raw bytes the loader asks for in one ``read_many`` call (a read-ahead window), up to 64
    #: batches. Larger windows spread each call's fixed cost over more batches: 4 MiB was 6%
    #: faster than 1 MiB for local files here, and object stores keep several in flight.
    read_window_bytes: int = 4 * 2**20
    #: At most this many batches per read-ahead window (object stores allow more, so that a
    #: window can hold a whole mixing window of a block shuffle).
    read_window_batches: int = 64
    #: Bytes per shuffle block that the loader's ``shuffle_block_size="auto"`` aims at: ``None``
    #: (memory, local files) asks for the global row shuffle, as a read costs the same wherever
    #: it lands; object stores name a few MiB, so a block is a few large range requests.
    shuffle_block_bytes: int | None = None
    #: Whether ``open_sync`` and ``read_many_sync`` only touch memory: the async ``open`` and
    #: ``read_many`` then run them inline on any loop, as a worker thread would cost more.
    blocking_calls_are_cheap: ClassVar[bool] = False
    #: Whether this class's ``read_many`` is the base class's, which runs ``read_many_sync``. A
    #: class that defines ``read_many`` (an object store, or a subclass that checks, changes or
    #: fails the async read) is read through it, unless it declares this again.
    _plain_reads: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mark_own_reads(cls)

    async def _blocking(self, call: Callable[..., R], *args: Any) -> R:
        """Run a blocking call of this storage from a coroutine: inline where it is cheap, else on
        a worker thread, so the caller's loop never waits for a disk."""
        if self.blocking_calls_are_cheap:
            return call(*args)
        return await anyio.to_thread.run_sync(call, *args)

    def open_sync(self) -> None:
        """Acquire what reading needs (file maps), blocking. Idempotent. What ``open`` runs."""

    async def open(self) -> None:
        """Acquire what reading needs (file maps, clients). Idempotent.

        The default runs ``open_sync`` (on a worker thread unless ``blocking_calls_are_cheap``).
        """
        await self._blocking(self.open_sync)

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

    def read_counts(self) -> tuple[int, int] | None:
        """Requests and bytes read so far, where the storage counts them (object stores: range
        GETs, retries included, and the bytes they returned); ``None`` elsewhere."""
        return None

    def add_read_counts(self, requests: int, nbytes: int) -> None:
        """Count reads made for this storage by a copy of it elsewhere (a process worker's), so
        that :meth:`read_counts` holds every read the loader made. Ignored where nothing is
        counted."""

    def content_digest(self) -> str:
        """A short digest of the stored content, which a checkpoint's dataset fingerprint
        records: ``""`` where there is none to take (in memory), the manifest's for a written
        dataset."""
        return ""

    def locate(self, start: int, stop: int) -> list[list[Any]]:
        """Where elements ``[start, stop)`` of the token data are stored: ``[file, first byte,
        end byte]`` for each file holding some of them, in order (what ``loader.explain()``
        reports). ``[]`` for a storage without files (in memory)."""
        return []

    def _written_manifest(self) -> Manifest | None:
        """The manifest of a dataset guideloom wrote, which its storages hold (``guideloom
        inspect`` shows it); ``None`` for any other storage (memory, Parquet, one of your own)."""
        return None

    def figures(self) -> dict[str, float]:
        """Counts of this storage's own that ``loader.stats()`` reports (none by default; a
        Parquet storage reports its files, row groups, decodes and null rows)."""
        return {}

    def read_by_workers(self) -> bool:
        """Whether process workers read this storage themselves, where it reads inline (the
        default: each reads its own batches, and nothing crosses a pipe but the batch).

        ``False`` asks the main process to read, and to send each group's samples to a worker
        to collate: for a storage whose reads keep state in every process that reads (a window
        of decoded Parquet row groups), when its samples are cheap to send (texts that the
        workers tokenize)."""
        return True

    def reads_inline(self) -> bool:
        """Whether ``read_many_sync`` can serve reads now, in the caller's thread (memory,
        memory-mapped local files, a remote dataset once its local copy is complete).

        Where nothing can overlap a read (``num_workers=0`` and ``prefetch=0``) the sync
        iterator then reads, collates and yields in a plain loop, with no event loop in between,
        as PyTorch loads batches at ``num_workers=0``. The base classes answer whether
        ``read_many`` is still theirs (which runs ``read_many_sync``): a class that overrides it
        (an object store, or a subclass that checks, changes or fails the async read) is read
        through its own ``read_many``.
        """
        return False


class StreamStorageAbstract(StorageAbstract[InT, OutT]):
    """One long stream of elements (tokens), optionally with per-element metadata fields."""

    _plain_reads: ClassVar[bool] = True

    @abstractmethod
    def __len__(self) -> int:
        """Number of elements in the stream."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Metadata field names; empty for a plain token stream (samples are arrays then)."""
        return ()

    def read_many_sync(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[OutT]:
        """Return the ``length``-element windows that begin at each of ``starts``, in order,
        blocking (a backend with blocking reads implements this; ``read_many`` runs it).

        Every window lies inside ``[0, len(self))``. Plain streams return 1-D arrays; streams
        with metadata return ``{"tokens": ..., field: ...}`` dicts of 1-D arrays.
        """
        raise NotImplementedError(f"{type(self).__name__} has no blocking reads (reads_inline() is False)")

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[OutT]:
        """``read_many_sync`` from a coroutine: the windows that begin at each of ``starts``.

        The default runs ``read_many_sync`` (on a worker thread unless
        ``blocking_calls_are_cheap``); a backend with asynchronous I/O overrides it.
        """
        return await self._blocking(self.read_many_sync, starts, length)

    def reads_inline(self) -> bool:
        return self._plain_reads

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]], length: int) -> None:
        """A hint: the ``read_many(starts, length)`` calls the loader will make next, as the
        ``starts`` of each, in order (a lazy iterable, the rest of the epoch's plan).

        A storage that can prepare ahead (a chunk cache filling from an object store) consumes
        it as far ahead as it needs, from its own thread; the default ignores it. It replaces
        any earlier hint, and reads need not follow it.
        """


class BlockCounter(Protocol):
    """What a storage that counts its documents' lengths block by block (a Parquet text column
    tokenized at read, whose lengths cost a tokenizer pass) gives packing, which then counts a
    block as it first reads it (see :meth:`DocumentStorageAbstract.block_counter`). A block
    here is one of the storage's :meth:`~DocumentStorageAbstract.natural_blocks`."""

    def block_nbytes(self) -> npt.NDArray[np.int64]:
        """Stored bytes of each block (what a count of it costs, about)."""
        ...

    def known_block_lengths(self, group: int) -> npt.NDArray[np.int64] | None:
        """Block ``group``'s documents' lengths where known without counting; ``None`` otherwise."""
        ...

    def block_lengths(self, group: int, lo: int = 0, hi: int | None = None) -> npt.NDArray[np.int64]:
        """The lengths of block ``group``'s documents ``[lo, hi)`` (all by default), counted now
        where not known (the storage keeps what the count decoded for the reads that follow)."""
        ...

    def document_place(self, index: int) -> list[Any]:
        """Where document ``index`` is stored (what ``loader.explain()`` reports of it)."""
        ...

    def let_go(self, indices: npt.NDArray[np.int64]) -> None:
        """Documents ``indices`` are read no more this epoch: what the storage keeps of them (a
        count's tokens) may go. A later read still gets them (made again)."""
        ...


class DocumentStorageAbstract(StorageAbstract[InT, OutT]):
    """A sequence of variable-length documents, each a 1-D array."""

    _plain_reads: ClassVar[bool] = True

    @abstractmethod
    def __len__(self) -> int:
        """Number of documents."""

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[OutT]:
        """Return documents ``indices`` (each in ``[0, len(self))``), in that order, blocking (a
        backend with blocking reads implements this; ``read_many`` runs it)."""
        raise NotImplementedError(f"{type(self).__name__} has no blocking reads (reads_inline() is False)")

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[OutT]:
        """``read_many_sync`` from a coroutine: documents ``indices``, in that order.

        The default runs ``read_many_sync`` (on a worker thread unless
        ``blocking_calls_are_cheap``); a backend with asynchronous I/O overrides it.
        """
        return await self._blocking(self.read_many_sync, indices)

    def reads_inline(self) -> bool:
        return self._plain_reads

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """A hint: the ``read_many(indices)`` calls the loader will make next, as their
        ``indices``, in order (a lazy iterable). See :meth:`StreamStorageAbstract.will_read
        <guideloom.StreamStorageAbstract.will_read>`; the default ignores it.
        """

    def natural_blocks(self) -> npt.NDArray[np.int64] | None:
        """The sizes of the runs of consecutive documents this storage reads together (a
        Parquet file's row groups, decoded whole), in document order; ``None`` (the default)
        where a document is read on its own. A loader's ``shuffle_block_size="auto"`` keeps
        these runs together in its block shuffle."""
        return None

    def block_counter(self) -> BlockCounter | None:
        """What counts this storage's documents' lengths block by block, where a length costs
        a pass over the data that packing would rather make as it reads (a Parquet text column
        with a tokenizer); ``None`` (the default): the lengths come from
        :meth:`document_offsets`, all at once."""
        return None

    def deferred_step(
        self,
    ) -> tuple[DocumentStorageAbstract[Any, Any], Callable[[Sequence[Any]], Sequence[Any]]] | None:
        """A per-batch step of this storage's reads that may run where batches are collated
        (tokenizing texts), as ``(storage that reads without it, step)``; ``None`` (the
        default): reads are complete. A loader's document dataset reads with the first and runs
        the step before ``collate_fn``, in its workers; ``pack`` and mixtures read complete
        documents."""
        return None

    # -- element-level access, what packing (guideloom.pack) plans and reads over ---------------
    #: Offsets found by reading every document once (the defaults below), kept for the next call.
    _read_offsets_cache: npt.NDArray[np.int64] | None = None

    def _offsets_from(self, docs: Sequence[Any]) -> npt.NDArray[np.int64]:
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in docs], out=offsets[1:])
        self._read_offsets_cache = offsets
        return offsets

    def describe_document(self, index: int) -> dict[str, Any]:
        """Document ``index`` as ``loader.explain()`` reports it: its elements in the
        concatenation of all documents and the files holding them."""
        start, stop = self.document_offsets_sync(np.asarray([index, index + 1], dtype=np.int64)).tolist()
        return {
            "documents": [[index, 0, stop - start]],
            "elements": [[start, stop]],
            "files": [self.locate(start, stop)],
        }

    def document_offsets_sync(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Where documents ``positions`` begin in the concatenation of all documents, blocking
        (position ``len(self)`` gives the total number of elements).

        The default reads every document once and keeps the offsets (a storage with an offsets
        file overrides it and reads only ``positions``).
        """
        offsets = self._read_offsets_cache
        if offsets is None:
            offsets = self._offsets_from(self.read_many_sync(np.arange(len(self), dtype=np.int64)))
        return offsets[positions]

    async def document_offsets(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``document_offsets_sync`` from a coroutine (the default reads every document once, with
        ``read_many``, where the blocking variant is not overridden)."""
        if type(self).document_offsets_sync is not DocumentStorageAbstract.document_offsets_sync:
            return await self._blocking(self.document_offsets_sync, positions)
        offsets = self._read_offsets_cache
        if offsets is None:
            offsets = self._offsets_from(await self.read_many(np.arange(len(self), dtype=np.int64)))
        return offsets[positions]

    def _all_offsets_sync(self) -> npt.NDArray[np.int64]:
        if self._read_offsets_cache is None:
            self._read_offsets_cache = self.document_offsets_sync(np.arange(len(self) + 1, dtype=np.int64))
        return self._read_offsets_cache

    async def _all_offsets(self) -> npt.NDArray[np.int64]:
        if self._read_offsets_cache is None:
            self._read_offsets_cache = await self.document_offsets(np.arange(len(self) + 1, dtype=np.int64))
        return self._read_offsets_cache

    def read_spans_sync(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        """Elements ``[starts[i], stops[i])`` of the concatenation of all documents, each span as
        one new 1-D array, blocking. A span may run over several documents.

        The default reads the documents the spans touch with one ``read_many_sync`` call and cuts
        them; a storage that can read element ranges overrides it and reads only the spans.
        """
        offsets = self._all_offsets_sync()
        ids = _documents_of_spans(offsets, starts, stops)
        return _cut_spans(offsets, ids, self.read_many_sync(ids), starts, stops, self.dtype)

    def read_spans_into_sync(
        self,
        starts: npt.NDArray[np.int64],
        stops: npt.NDArray[np.int64],
        out: npt.NDArray[Any],
        at: npt.NDArray[np.int64],
    ) -> None:
        """``read_spans_sync``, each span ``i`` written into the contiguous array ``out`` (of the
        storage's dtype, taken flat) from element ``at[i]`` on: a reader that places spans
        (document packing's rows) gets them without a second copy where the storage can write
        them in place. The default copies what ``read_spans_sync`` returns."""
        flat = out.reshape(-1)
        for to, span in zip(at.tolist(), self.read_spans_sync(starts, stops), strict=True):
            flat[to : to + len(span)] = span

    async def read_spans(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        """``read_spans_sync`` from a coroutine (the default reads the documents the spans touch
        with one ``read_many`` call where the blocking variant is not overridden)."""
        if type(self).read_spans_sync is not DocumentStorageAbstract.read_spans_sync:
            return await self._blocking(self.read_spans_sync, starts, stops)
        offsets = await self._all_offsets()
        ids = _documents_of_spans(offsets, starts, stops)
        return _cut_spans(offsets, ids, await self.read_many(ids), starts, stops, self.dtype)


def _documents_of_spans(
    offsets: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """The documents (sorted, unique) that hold any element of the non-empty spans."""
    keep = stops > starts
    first = np.searchsorted(offsets, starts[keep], side="right") - 1
    last = np.searchsorted(offsets, stops[keep] - 1, side="right") - 1
    if not len(first):
        return np.empty(0, dtype=np.int64)
    counts = last - first + 1
    ids = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    return np.unique(ids).astype(np.int64)


def _cut_spans(
    offsets: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64],
    docs: Sequence[Any],
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    dtype: np.dtype[Any],
) -> list[Any]:
    """Spans ``[starts[i], stops[i])`` cut out of ``docs`` (documents ``ids``, sorted)."""
    by_id = dict(zip(ids.tolist(), docs, strict=True))
    out = []
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        parts = []
        j = int(np.searchsorted(offsets, a, side="right")) - 1
        while a < b:
            base, end = int(offsets[j]), int(offsets[j + 1])
            if end > a:
                parts.append(np.asarray(by_id[j])[a - base : min(b, end) - base])
                a = min(b, end)
            j += 1
        out.append(np.concatenate(parts) if parts else np.empty(0, dtype))
    return out
