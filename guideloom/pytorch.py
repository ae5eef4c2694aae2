"""The PyTorch-facing loader: :class:`StatefulDataLoader`.

The loader is a thin, stateful facade. It validates its parameters, owns the checkpoint state
``(epoch, observation_offset)``, and starts an iterator of :mod:`guideloom._iterators`, which
runs the pipeline of :mod:`guideloom._pipeline` in the caller's thread, on a loop thread
(``for batch in loader``) or on the caller's loop (``async for``). The
position advances only when a batch is handed to the consumer, so ``state_dict()`` never counts
prefetched batches.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, Unpack, cast, overload

from ._checkpoint import LoaderIdentity, dataset_fingerprint, restore_position
from ._checks import check_block_size, check_bool, check_device, check_int, check_optional_int
from ._datasets import DatasetAbstract, SourceT, dataset_for
from ._iterators import ActiveIterator, AsyncIterator, SyncIterator, sync_iterator
from ._loop import LoopThread
from ._order import DEFAULT_WINDOW, Order, make_order, resolve_block_size
from ._plan import num_batches
from ._procpool import WorkerPool
from ._storage.base import DocumentStorageAbstract, InT, OutT, StreamStorageAbstract
from .types import DatasetFingerprint, LoaderOptions, StatefulDataLoaderStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["StatefulDataLoader"]

BatchT = TypeVar("BatchT")
cBatchT = TypeVar("cBatchT")  # noqa: N816 - the name the reference page uses
_STATS = {"batches": 0, "samples": 0, "wait_seconds": 0.0, "last_wait_seconds": 0.0}  # stats() at first


def _get_default_device() -> torch.device:
    """The current CUDA device when CUDA is available, otherwise CPU."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            'StatefulDataLoader needs PyTorch: install it with pip install "guideloom[torch]"'
        ) from exc
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(eq=False)
class StatefulDataLoader(Generic[SourceT, BatchT]):
    """Stateful iterable loader that partitions a dataset across ranks.

    Use the loader as a context manager so its dataset reader is opened and closed (an iterator
    started on a loader that is not open opens it for its own duration). Exhaust an iterator, or
    close it, before starting another iterator on the same loader.
    """

    dataset: DatasetAbstract[SourceT]
    collate_fn: Callable[[Sequence[SourceT]], BatchT]
    device: torch.device = field(default_factory=_get_default_device)
    local_batch_size: int = 1
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    parallel_method: Literal["thread", "process"] = "thread"
    shuffle: bool = False
    shuffle_seed: int | None = None
    pin_memory: bool = False
    drop_last: bool = True
    prefetch: int = 0
    shuffle_block_size: int | Literal["auto"] | None = None
    shuffle_window: int = DEFAULT_WINDOW
    persistent_workers: bool = True

    _epoch: int = field(default=0, init=False, repr=False)
    _offset: int = field(default=0, init=False, repr=False)
    _order_seed: int = field(default=0, init=False, repr=False)
    _state: Literal["closed", "open", "async-open"] = field(default="closed", init=False, repr=False)
    _active: ActiveIterator = field(default_factory=ActiveIterator, init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _stats: dict[str, float] = field(default_factory=_STATS.copy, init=False, repr=False)
    _dataset_fingerprint: DatasetFingerprint | None = field(default=None, init=False, repr=False)
    _reads_mark: tuple[int, int, int] | None = field(default=None, init=False, repr=False)
    _pool: WorkerPool | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_arguments(self)
        # shuffle_seed=None: one random seed for this loader's lifetime (not reproducible).
        self._order_seed = self.shuffle_seed if self.shuffle_seed is not None else secrets.randbits(63)

    # -- construction from storage (NoReturn: the storage kind and sequence_length do not pair) ---
    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int,
        **options: Unpack[LoaderOptions],
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: None = None,
        **options: Unpack[LoaderOptions],
    ) -> NoReturn: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: None = None,
        **options: Unpack[LoaderOptions],
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int,
        **options: Unpack[LoaderOptions],
    ) -> NoReturn: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT] | DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int | None = None,
        **options: Unpack[LoaderOptions],
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: DatasetAbstract[OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int | None = None,
        **options: Unpack[LoaderOptions],
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT] | DocumentStorageAbstract[InT, OutT] | DatasetAbstract[Any],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int | None = None,
        **options: Unpack[LoaderOptions],
    ) -> StatefulDataLoader[OutT, cBatchT]:
        """Create a loader by wrapping ``storage`` in the matching dataset.

        Stream storage (with or without metadata) becomes a :class:`StreamDataset` and requires
        ``sequence_length``; document storage becomes a :class:`DocumentDataset` and takes none.
        A mixture (:func:`guideloom.mix`) is used as it is, its stream storages without a
        sequence length of their own taking ``sequence_length``.
        The remaining keyword arguments (:class:`~guideloom.types.LoaderOptions`) match the
        constructor's, with the same defaults; ``device=None`` means the default device.
        """
        dataset: DatasetAbstract[OutT] = dataset_for(storage, sequence_length)
        kwargs: dict[str, Any] = dict(options)
        if kwargs.get("device") is None:
            kwargs["device"] = _get_default_device()
        loader = cls(dataset=dataset, collate_fn=collate_fn, **kwargs)  # type: ignore[arg-type]
        return cast("StatefulDataLoader[OutT, cBatchT]", loader)

    @staticmethod
    def get_default_device() -> torch.device:
        """Return the current CUDA device, or CPU when CUDA is unavailable."""
        return _get_default_device()

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """``local_batch_size * world_size``: observations per step across all ranks."""
        return self.local_batch_size * self.world_size

    def __len__(self) -> int:
        """Batches per epoch, counting a final partial global batch when ``drop_last=False``.

        Always the whole epoch, also after a resume: :meth:`remaining` (or ``len`` of an
        iterator) counts the batches left from the current position.
        """
        return num_batches(len(self.dataset), self.global_batch_size, self.drop_last)

    def remaining(self) -> int:
        """Batches left in the current epoch from the current position (``state_dict()``'s
        offset): what a progress bar wants after a resume, e.g. ``tqdm(loader, total=loader.remaining())``."""
        return num_batches(len(self.dataset), self.global_batch_size, self.drop_last, self._offset)

    # -- the epoch order -------------------------------------------------------------------------
    def _block_size(self) -> int:
        """Samples per shuffle block, ``shuffle_block_size`` resolved (``"auto"``: the storage's).

        Without shuffle the order is the identity: 1, whatever was asked.
        """
        if not self.shuffle:
            return 1
        if self.shuffle_block_size != "auto":  # the storage is asked only for "auto"
            return resolve_block_size(self.shuffle_block_size, block_bytes=None, sample_nbytes=0)
        return resolve_block_size(
            "auto",
            block_bytes=getattr(self.dataset.storage, "shuffle_block_bytes", None),
            sample_nbytes=self.dataset.sample_nbytes_hint(),
        )

    def _window(self) -> int:
        """Blocks per mixing window that the order uses (1 where blocks are single samples)."""
        return self.shuffle_window if self._block_size() > 1 else 1

    def _order(self, epoch: int) -> Order:
        """The order of ``epoch``: the dataset's own where it makes one (a mixture), otherwise
        identity, global row shuffle or block shuffle."""
        own = self.dataset.order(shuffle=self.shuffle, seed=self._order_seed, epoch=epoch)
        if own is not None:
            return own
        return make_order(
            len(self.dataset),
            shuffle=self.shuffle,
            seed=self._order_seed,
            epoch=epoch,
            block_size=self._block_size(),
            window=self._window(),
        )

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the dataset reader.

        Raises:
            ValueError: If the dataset contains fewer observations than ``world_size *
                local_batch_size``.
        """
        with self._lock:
            if self._state != "closed":
                return
            _run_blocking(self, self.dataset.open())
            try:
                _check_size(self)  # after opening: a storage may know its length only then
            except BaseException:
                _run_blocking(self, self.dataset.close())
                raise
            self._state = "open"

    def close(self) -> None:
        """Close the dataset reader; an active iterator ends and its threads/processes stop.

        Persistent process workers stop too: each finishes its batch within 5 seconds or is
        terminated.
        """
        self._close(keep_workers=False)

    def _close(self, *, keep_workers: bool) -> None:
        """``close()``; an iterator that opened the loader for itself keeps the workers."""
        with self._lock:
            it = self._active.get()
        if it is not None:
            it.close_sync()
        self._active.join_left()
        with self._lock:
            pool = None if keep_workers else self._pool
            if pool is not None:
                self._pool = None
            if self._state != "closed":
                self._state = "closed"
                _run_blocking(self, self.dataset.close())
        if pool is not None:
            pool.close()

    async def aopen(self) -> None:
        """Open the dataset reader on the running event loop (what ``async with`` calls)."""
        if self._state != "closed":
            return
        await self.dataset.open()
        try:
            _check_size(self)
        except BaseException:
            await self.dataset.close()
            raise
        self._state = "async-open"

    async def aclose(self) -> None:
        """Close from async code: ends an active iterator, closes the dataset reader, stops
        persistent process workers (see :meth:`close`)."""
        await self._aclose(keep_workers=False)

    async def _aclose(self, *, keep_workers: bool) -> None:
        it = self._active.get()
        if it is not None:
            await it.close_async()
        await self._active.ajoin_left()
        if self._state != "closed":
            self._state = "closed"
            await self.dataset.close()
        pool = None if keep_workers else self._pool
        if pool is not None:
            self._pool = None
            await asyncio.to_thread(pool.close)

    def _worker_pool(self) -> WorkerPool:
        """The loader's persistent process workers, made at the first iterator that needs them
        (again if ``dataset``, ``collate_fn`` or ``num_workers`` changed since)."""
        with self._lock:
            pool = self._pool
            if pool is not None and pool.matches(self.dataset, self.collate_fn, self.num_workers):
                return pool
            if pool is not None:
                pool.close()
            self._pool = pool = WorkerPool(self.dataset, self.collate_fn, self.num_workers)
            weakref.finalize(self, pool.close)  # a loader collected without close()
            return pool

    def __enter__(self) -> StatefulDataLoader[SourceT, BatchT]:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> StatefulDataLoader[SourceT, BatchT]:
        await self.aopen()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> SyncIterator[BatchT]:
        return sync_iterator(self)

    def __aiter__(self) -> AsyncIterator[BatchT]:
        return AsyncIterator(self)

    # -- figures --------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Figures to log: batches and samples delivered by this loader, and how long the consumer
        waited for them in total and for the last one (seconds). A training loop whose
        ``wait_seconds`` grows is input-bound: raise ``prefetch`` or ``num_workers``.

        Also the order's ``shuffle_block_size`` (resolved, 1 for a global shuffle) and
        ``shuffle_window``, and over object storage the range GETs sent (retries included) and
        the bytes they returned: ``requests`` and ``bytes_read`` in total, ``epoch_requests``
        and ``epoch_bytes_read`` since the current epoch's first iterator started (read-ahead
        included), which is what an epoch costs. A mixture adds ``source_epoch/<name>``: the
        epoch each of its sources is in at the current position.
        """
        out = dict(self._stats)
        out["shuffle_block_size"] = self._block_size()
        out["shuffle_window"] = self._window()
        reads = _storage_reads(self)
        if reads is not None:
            mark = self._reads_mark if self._reads_mark is not None else (self._epoch, 0, 0)
            out["requests"], out["bytes_read"] = reads
            out["epoch_requests"] = reads[0] - mark[1]
            out["epoch_bytes_read"] = reads[1] - mark[2]
        out.update(self.dataset.position_stats(epoch=self._epoch, offset=self._offset))
        return out

    def _mark_epoch_reads(self) -> None:
        """At an iterator's start: the storage's counters, the first time in this epoch (what
        ``stats()`` counts an epoch's requests and bytes from)."""
        if self._reads_mark is None or self._reads_mark[0] != self._epoch:
            reads = _storage_reads(self)
            if reads is not None:
                self._reads_mark = (self._epoch, *reads)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> StatefulDataLoaderStateDict:
        """Return the checkpoint for batches already delivered to the consumer.

        Prefetched batches that have not been yielded do not advance ``observation_offset``.
        Each yielded batch advances it by ``global_batch_size``, including padding in an
        incomplete final batch. A block shuffle also records its ``shuffle_block_size`` and
        ``shuffle_window`` (a global shuffle records none: it has blocks of one sample).
        """
        state = StatefulDataLoaderStateDict(
            epoch=self._epoch,
            observation_offset=self._offset,
            shuffle=self.shuffle,
            shuffle_seed=self.shuffle_seed,
            drop_last=self.drop_last,
            dataset=self._fingerprint(),
        )
        block = self._block_size()
        if block > 1:  # a global shuffle's checkpoint stays as it was: no key means blocks of 1
            state["shuffle_block_size"] = block
            state["shuffle_window"] = self._window()
        return state

    def load_state_dict(
        self, state_dict: StatefulDataLoaderStateDict, *, allow_dataset_change: bool = False
    ) -> None:
        """Restore ``epoch`` and ``observation_offset`` from a checkpoint.

        Call this before starting an iterator. A warning is emitted when ``shuffle``,
        ``shuffle_seed``, ``drop_last`` or the shuffle blocks (``shuffle_block_size``,
        ``shuffle_window``) differ from this loader; those saved values are not
        applied. The offset is global, so a job can resume with another batch size or world size.
        A checkpoint counted over another dataset (its fingerprint differs) is refused:
        ``allow_dataset_change=True`` resumes at its position anyway, for data changed on purpose.

        Raises:
            RuntimeError: If an iterator on this loader is still active.
            ValueError: If the checkpoint is malformed, was counted over another dataset, or its
                offset lies past the end of this dataset.
        """
        with self._lock:
            if self._active.get() is not None:
                raise RuntimeError(
                    "load_state_dict() was called while an iterator on this loader is active; "
                    "exhaust or close the iterator first, then load the checkpoint"
                )
            identity = LoaderIdentity(
                self.shuffle,
                self.shuffle_seed,
                self.drop_last,
                self._fingerprint(),
                shuffle_block_size=self._block_size(),
                shuffle_window=self._window(),
            )
            self._epoch, self._offset = restore_position(
                state_dict, identity, allow_dataset_change=allow_dataset_change
            )

    def _fingerprint(self) -> DatasetFingerprint:
        """The dataset's fingerprint, computed once while open (a manifest digest walks every
        file entry; a storage may know its length only once open)."""
        if self._dataset_fingerprint is not None:
            return self._dataset_fingerprint
        fp = dataset_fingerprint(self.dataset)
        if self._state != "closed":
            self._dataset_fingerprint = fp
        return fp


def _check_arguments(loader: StatefulDataLoader[Any, Any]) -> None:
    """Refuse constructor arguments of the wrong type or range; a device given as a str or an int
    becomes a ``torch.device``."""

    if not isinstance(loader.dataset, DatasetAbstract):
        raise TypeError(
            f"dataset must be a DatasetAbstract (StreamDataset or DocumentDataset), got "
            f"{type(loader.dataset).__name__}; StatefulDataLoader.from_storage wraps a storage for you"
        )
    if not callable(loader.collate_fn):
        raise TypeError(f"collate_fn must be callable, got {type(loader.collate_fn).__name__}")
    loader.device = check_device(loader.device)
    for name, minimum in (
        ("local_batch_size", 1),
        ("world_size", 1),
        ("rank", 0),
        ("num_workers", 0),
        ("prefetch", 0),
    ):
        setattr(loader, name, check_int(name, getattr(loader, name), minimum))
    if loader.rank >= loader.world_size:
        raise ValueError(f"rank must be in [0, world_size={loader.world_size}), got {loader.rank}")
    if loader.parallel_method not in ("thread", "process"):
        raise ValueError(f"parallel_method must be 'thread' or 'process', got {loader.parallel_method!r}")
    for name in ("shuffle", "pin_memory", "drop_last", "persistent_workers"):
        setattr(loader, name, check_bool(name, getattr(loader, name)))
    loader.shuffle_seed = check_optional_int("shuffle_seed", loader.shuffle_seed)
    loader.shuffle_block_size = check_block_size(loader.shuffle_block_size)
    loader.shuffle_window = check_int("shuffle_window", loader.shuffle_window, 1)


def _storage_reads(loader: StatefulDataLoader[Any, Any]) -> tuple[int, int] | None:
    """Requests and bytes read so far by the dataset's storage, where it counts them (object
    storage); None elsewhere."""
    stats = getattr(loader.dataset.storage, "stats", None)
    if not callable(stats):
        return None
    figures = stats()
    if not isinstance(figures, dict) or "requests" not in figures or "bytes_read" not in figures:
        return None
    return int(figures["requests"]), int(figures["bytes_read"])


def _check_size(loader: StatefulDataLoader[Any, Any]) -> None:
    n, g = len(loader.dataset), loader.global_batch_size
    if n < g:
        raise ValueError(
            f"the dataset has {n} observations, fewer than one global batch of "
            f"world_size * local_batch_size = {loader.world_size} * {loader.local_batch_size} = {g}; "
            "use a smaller local_batch_size or a larger dataset"
        )


def _run_blocking(loader: StatefulDataLoader[Any, Any], coro: Coroutine[Any, Any, None]) -> None:
    """Run a storage coroutine (open, close) from sync code, wherever that code runs.

    A short-lived loop thread serves it: the loader holds no thread while no iterator is
    active, and this works even when the caller's own thread runs an event loop.
    """
    lt = LoopThread(name=f"guideloom-loop-{id(loader):x}")
    try:
        lt.run(coro)
    finally:
        lt.stop()
