"""The PyTorch-facing loader: :class:`StatefulDataLoader`.

The loader is a thin, stateful facade. It validates its parameters, owns the checkpoint state
``(epoch, observation_offset)``, and runs the pipeline of :mod:`guideloom._pipeline` either on a
background event loop (``for batch in loader``) or on the caller's loop (``async for``). The
position advances only when a batch is handed to the consumer, so ``state_dict()`` never counts
prefetched batches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, cast, overload

from ._channel import Channel, EndOfStream
from ._datasets import DatasetAbstract, DocumentDataset, SourceT, StreamDataset
from ._loop import LoopThread
from ._pipeline import Delivery, InlinePipeline, PipelineConfig, make_executor, run_pipeline
from ._plan import EpochPlan, Permutation, num_batches
from ._storage.base import DocumentStorageAbstract, InT, OutT, StreamStorageAbstract
from .types import StatefulDataLoaderStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["StatefulDataLoader"]

BatchT = TypeVar("BatchT")
cBatchT = TypeVar("cBatchT")  # noqa: N816 - the name the reference page uses


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


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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

    _epoch: int = field(default=0, init=False, repr=False)
    _offset: int = field(default=0, init=False, repr=False)
    _order_seed: int = field(default=0, init=False, repr=False)
    _state: Literal["closed", "open", "async-open"] = field(default="closed", init=False, repr=False)
    _iterator_ref: weakref.ref[_IteratorBase[Any]] | None = field(default=None, init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _stats: dict[str, float] = field(
        default_factory=lambda: {"batches": 0, "samples": 0, "wait_seconds": 0.0, "last_wait_seconds": 0.0},
        init=False,
        repr=False,
    )

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.dataset, DatasetAbstract):
            raise TypeError(
                f"dataset must be a DatasetAbstract (StreamDataset or DocumentDataset), got "
                f"{type(self.dataset).__name__}; StatefulDataLoader.from_storage wraps a storage for you"
            )
        if not callable(self.collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(self.collate_fn).__name__}")
        if isinstance(self.device, str | int):
            self.device = torch.device(self.device)
        if not isinstance(self.device, torch.device):
            raise TypeError(f"device must be a torch.device, got {type(self.device).__name__}")
        _check_int("local_batch_size", self.local_batch_size, 1)
        _check_int("world_size", self.world_size, 1)
        _check_int("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        _check_int("num_workers", self.num_workers, 0)
        _check_int("prefetch", self.prefetch, 0)
        if self.parallel_method not in ("thread", "process"):
            raise ValueError(f"parallel_method must be 'thread' or 'process', got {self.parallel_method!r}")
        if self.shuffle_seed is not None and (
            isinstance(self.shuffle_seed, bool) or not isinstance(self.shuffle_seed, int)
        ):
            raise TypeError(f"shuffle_seed must be an int or None, got {type(self.shuffle_seed).__name__}")
        # shuffle_seed=None: one random seed for this loader's lifetime (not reproducible).
        self._order_seed = self.shuffle_seed if self.shuffle_seed is not None else secrets.randbits(63)

    # -- construction from storage --------------------------------------------------------------
    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: None = None,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> NoReturn: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: None = None,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> NoReturn: ...

    @overload
    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT] | DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int | None = None,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> StatefulDataLoader[OutT, cBatchT]: ...

    @classmethod
    def from_storage(
        cls,
        storage: StreamStorageAbstract[InT, OutT] | DocumentStorageAbstract[InT, OutT],
        collate_fn: Callable[[Sequence[OutT]], cBatchT],
        *,
        sequence_length: int | None = None,
        device: torch.device | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: Literal["thread", "process"] = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = True,
        prefetch: int = 0,
    ) -> StatefulDataLoader[OutT, cBatchT]:
        """Create a loader by wrapping ``storage`` in the matching dataset.

        Stream storage (with or without metadata) becomes a :class:`StreamDataset` and requires
        ``sequence_length``; document storage becomes a :class:`DocumentDataset` and takes none.
        The remaining arguments match the constructor.
        """
        dataset: DatasetAbstract[OutT]
        if isinstance(storage, StreamStorageAbstract):
            if sequence_length is None:
                raise ValueError(
                    "stream storage needs sequence_length: pass sequence_length=<elements per sample>"
                )
            dataset = StreamDataset(storage, sequence_length)
        elif isinstance(storage, DocumentStorageAbstract):
            if sequence_length is not None:
                raise ValueError(
                    "document storage yields one whole document per sample and takes no "
                    f"sequence_length (got {sequence_length}); drop the argument"
                )
            dataset = DocumentDataset(storage)
        else:
            raise TypeError(
                "storage must be a StreamStorageAbstract or DocumentStorageAbstract (for example "
                f"MemoryStreamStorage, or what open_stream() returns), got {type(storage).__name__}"
            )
        loader = cls(
            dataset=dataset,  # type: ignore[arg-type]
            collate_fn=collate_fn,  # type: ignore[arg-type]
            device=device if device is not None else _get_default_device(),
            local_batch_size=local_batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            parallel_method=parallel_method,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            pin_memory=pin_memory,
            drop_last=drop_last,
            prefetch=prefetch,
        )
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
        """Batches per epoch, counting a final partial global batch when ``drop_last=False``."""
        return num_batches(len(self.dataset), self.global_batch_size, self.drop_last)

    # -- lifecycle --------------------------------------------------------------------------------
    def _check_size(self) -> None:
        n, g = len(self.dataset), self.global_batch_size
        if n < g:
            raise ValueError(
                f"the dataset has {n} observations, fewer than one global batch of "
                f"world_size * local_batch_size = {self.world_size} * {self.local_batch_size} = {g}; "
                "use a smaller local_batch_size or a larger dataset"
            )

    def _run_blocking(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a storage coroutine (open, close) from sync code, wherever that code runs.

        A short-lived loop thread serves it: the loader holds no thread while no iterator is
        active, and this works even when the caller's own thread runs an event loop.
        """
        lt = LoopThread(name=f"guideloom-loop-{id(self):x}")
        try:
            lt.run(coro)
        finally:
            lt.stop()

    def open(self) -> None:
        """Open the dataset reader.

        Raises:
            ValueError: If the dataset contains fewer observations than ``world_size *
                local_batch_size``.
        """
        with self._lock:
            if self._state != "closed":
                return
            self._run_blocking(self.dataset.open())
            try:
                self._check_size()  # after opening: a storage may know its length only then
            except BaseException:
                self._run_blocking(self.dataset.close())
                raise
            self._state = "open"

    def close(self) -> None:
        """Close the dataset reader; an active iterator ends and its threads/processes stop."""
        with self._lock:
            it = self._iterator
        if it is not None:
            it.close_sync()
        with self._lock:
            if self._state != "closed":
                self._state = "closed"
                self._run_blocking(self.dataset.close())

    async def aopen(self) -> None:
        """Open the dataset reader on the running event loop (what ``async with`` calls)."""
        if self._state != "closed":
            return
        await self.dataset.open()
        try:
            self._check_size()
        except BaseException:
            await self.dataset.close()
            raise
        self._state = "async-open"

    async def aclose(self) -> None:
        """Close from async code: ends an active iterator, closes the dataset reader."""
        it = self._iterator
        if it is not None:
            await it.close_async()
        if self._state != "closed":
            self._state = "closed"
            await self.dataset.close()

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
    @property
    def _iterator(self) -> _IteratorBase[Any] | None:
        """The active iterator. Held weakly: an abandoned iterator is collected and closes itself."""
        ref = self._iterator_ref
        return ref() if ref is not None else None

    def _claim(self, it: _IteratorBase[Any]) -> None:
        with self._lock:
            if self._iterator is not None:
                raise RuntimeError(
                    "an iterator on this loader is still active: exhaust it or close it "
                    "(iterator.close()) before starting another"
                )
            self._iterator_ref = weakref.ref(it)

    def _release(self, it: _IteratorBase[Any]) -> None:
        with self._lock:
            if self._iterator_ref is not None and self._iterator_ref() in (it, None):
                self._iterator_ref = None

    def _pipeline_config(self) -> PipelineConfig:
        if self.parallel_method == "process" and self.num_workers > 0:
            try:
                pickle.dumps(self.collate_fn)
            except Exception as exc:
                raise TypeError(
                    "parallel_method='process' needs a picklable collate_fn (a module-level "
                    f"function or a picklable object), got {self.collate_fn!r}: {exc}. Use "
                    "parallel_method='thread' for closures and lambdas"
                ) from exc
        n = len(self.dataset)
        return PipelineConfig(
            dataset=self.dataset,
            plan=EpochPlan(
                num_observations=n,
                local_batch_size=self.local_batch_size,
                world_size=self.world_size,
                rank=self.rank,
                drop_last=self.drop_last,
                start_offset=self._offset,
            ),
            order=Permutation(n, shuffle=self.shuffle, seed=self._order_seed, epoch=self._epoch),
            collate_fn=self.collate_fn,
            device=self.device,
            pin_memory=self.pin_memory,
            num_workers=self.num_workers,
            parallel_method=self.parallel_method,
            prefetch=self.prefetch,
        )

    def __iter__(self) -> _SyncIteratorState[BatchT]:
        return _SyncIteratorState(self)

    def __aiter__(self) -> _AsyncIteratorState[BatchT]:
        return _AsyncIteratorState(self)

    # -- figures --------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Figures to log: batches and samples delivered by this loader, and how long the consumer
        waited for them in total and for the last one (seconds). A training loop whose
        ``wait_seconds`` grows is input-bound: raise ``prefetch`` or ``num_workers``."""
        return dict(self._stats)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> StatefulDataLoaderStateDict:
        """Return the checkpoint for batches already delivered to the consumer.

        Prefetched batches that have not been yielded do not advance ``observation_offset``.
        Each yielded batch advances it by ``global_batch_size``, including padding in an
        incomplete final batch.
        """
        return StatefulDataLoaderStateDict(
            epoch=self._epoch,
            observation_offset=self._offset,
            shuffle=self.shuffle,
            shuffle_seed=self.shuffle_seed,
            drop_last=self.drop_last,
        )

    def load_state_dict(self, state_dict: StatefulDataLoaderStateDict) -> None:
        """Restore ``epoch`` and ``observation_offset`` from a checkpoint.

        Call this before starting an iterator. A warning is emitted when ``shuffle``,
        ``shuffle_seed`` or ``drop_last`` differ from this loader; those saved values are not
        applied. The offset is global, so a job can resume with another batch size or world size.

        Raises:
            RuntimeError: If an iterator on this loader is still active.
        """
        with self._lock:
            if self._iterator is not None:
                raise RuntimeError(
                    "load_state_dict() was called while an iterator on this loader is active; "
                    "exhaust or close the iterator first, then load the checkpoint"
                )
            if not isinstance(state_dict, dict):
                raise TypeError(
                    f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}"
                )
            missing = {"epoch", "observation_offset"} - state_dict.keys()
            if missing:
                raise ValueError(
                    f"checkpoint lacks {sorted(missing)}; pass a dict returned by "
                    "StatefulDataLoader.state_dict()"
                )
            epoch, offset = state_dict["epoch"], state_dict["observation_offset"]
            for name, value in (("epoch", epoch), ("observation_offset", offset)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"checkpoint {name} must be an int >= 0, got {value!r}")
            for key in ("shuffle", "shuffle_seed", "drop_last"):
                if key == "shuffle_seed" and not self.shuffle and not state_dict.get("shuffle", False):
                    continue  # the seed is ignored when neither loader shuffles
                saved = cast(dict[str, Any], state_dict).get(key, getattr(self, key))
                if saved != getattr(self, key):
                    warnings.warn(
                        f"the checkpoint was saved by a loader with {key}={saved!r}, this loader "
                        f"has {key}={getattr(self, key)!r}; the saved value is not applied, so the "
                        f"order after resuming differs from the saved run. Construct the loader "
                        f"with {key}={saved!r} to resume it exactly",
                        UserWarning,
                        stacklevel=2,
                    )
            if self.shuffle and self.shuffle_seed is None:
                warnings.warn(
                    "this loader shuffles with shuffle_seed=None, so its order is not the saved "
                    "run's: the resumed epoch may repeat or skip observations. Pass a shuffle_seed "
                    "to resume exactly",
                    UserWarning,
                    stacklevel=2,
                )
            self._epoch, self._offset = epoch, offset


class _IteratorBase(Generic[BatchT]):
    """What the sync and async iterators share: claiming the loader and advancing its state."""

    def __init__(self, loader: StatefulDataLoader[Any, BatchT]) -> None:
        self._loader = loader
        self._done = True  # until a subclass has started: __del__ and close() then do nothing
        self._owns_open = False
        self._expected = self._delivered = 0
        self._executor: concurrent.futures.Executor | None = None
        loader._claim(self)

    def _configure(self) -> None:
        """Plan this iterator's epoch; called once the loader is open (a storage may know its
        length only then)."""
        self._cfg = self._loader._pipeline_config()
        self._expected = len(self._cfg.plan)

    def _start_executor(self) -> concurrent.futures.Executor | None:
        self._executor = make_executor(self._cfg)
        return self._executor

    def _join_executor(self) -> None:
        """Wait for the collate workers (threads or processes) to exit."""
        ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)

    def _accept(self, d: Delivery, waited: float) -> BatchT:
        stats = self._loader._stats
        stats["wait_seconds"] += waited
        stats["last_wait_seconds"] = waited
        if d.error is not None:
            raise d.error
        self._loader._offset = d.spec.offset_after
        self._delivered += 1
        stats["batches"] += 1
        stats["samples"] += d.spec.size
        value: BatchT = d.value
        return value

    def _finish_epoch(self) -> None:
        if self._delivered != self._expected:
            raise RuntimeError(
                f"guideloom bug: the pipeline ended after {self._delivered} of "
                f"{self._expected} batches without an error"
            )
        self._loader._epoch += 1
        self._loader._offset = 0

    def close_sync(self) -> None:
        raise NotImplementedError

    async def close_async(self) -> None:
        raise NotImplementedError


async def _drive(
    cfg: PipelineConfig,
    channel: Channel[Delivery],
    executor: concurrent.futures.Executor | None,
    finished: threading.Event,
) -> None:
    """The sync iterator's pipeline task. It holds no reference to the iterator, so an abandoned
    iterator is collected (and closes the pipeline) even while this task waits."""
    try:
        await run_pipeline(cfg, channel, 0, executor, own_loop=True)
    finally:
        finished.set()  # set only once every stage has stopped


def _event_loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _SyncIteratorState(_IteratorBase[BatchT], Iterator[BatchT]):
    """The iterator ``for batch in loader`` uses.

    With workers or prefetch, the pipeline runs on a loop thread of its own, which the iterator
    stops when it ends (a loader holds no thread between iterators), and batches come through the
    channel as soon as they are ready.

    With ``num_workers=0`` and ``prefetch=0`` nothing may be loaded ahead of a request, so a
    background thread would only add two cross-thread wake-ups to every batch (measured here:
    ~235 µs a batch, against ~25 µs for the work itself), and the batches are made in the
    caller's own thread, as PyTorch loads them in the main process at ``num_workers=0``:

    - over a storage that ``reads_inline()`` (memory, local files), by :class:`InlinePipeline`,
      a plain loop with no event loop (an event loop's turns cost about a batch's whole work);
    - over any other, by the pipeline on a private asyncio loop that ``next()`` drives (its reads
      stay in flight between batches), which hands over to :class:`InlinePipeline` at the next
      batch once the storage reads inline (a remote dataset's ``cache_dir`` copy is complete).
      (Plain asyncio: its ``run_until_complete`` costs half of uvloop's.) Where the caller's
      thread already runs an event loop (a notebook), the loop thread is used instead.
    """

    def __init__(self, loader: StatefulDataLoader[Any, BatchT]) -> None:
        super().__init__(loader)
        self._lt: LoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self._finished = threading.Event()
        self._inline: InlinePipeline | None = None
        try:
            if loader._state == "closed":
                loader.open()
                self._owns_open = True
            self._configure()
            if self._cfg.capacity == 0 and self._cfg.dataset.reads_inline:
                self._inline = InlinePipeline(self._cfg)
            elif self._cfg.capacity == 0 and not _event_loop_running_here():
                self._loop = loop = asyncio.new_event_loop()
                self._channel: Channel[Delivery] = Channel(loop, 0)
                self._task = loop.create_task(run_pipeline(self._cfg, self._channel, 0, None, own_loop=True))
            else:
                self._lt = lt = LoopThread(name=f"guideloom-loop-{id(loader):x}")
                self._channel = Channel(lt.loop, self._cfg.capacity)
                self._start_executor()
                self._future = lt.submit(_drive(self._cfg, self._channel, self._executor, self._finished))
            self._done = False
        except BaseException:
            self._join_executor()
            if self._lt is not None:
                self._lt.stop()
            self._close_caller_loop()
            self._done = True
            loader._release(self)
            if self._owns_open:
                loader.close()
            raise

    def __iter__(self) -> _SyncIteratorState[BatchT]:
        return self

    def __next__(self) -> BatchT:
        if self._done:
            raise StopIteration
        d: Delivery | None
        try:
            t0 = time.perf_counter()
            if self._inline is not None:
                d = self._inline.next()
            elif self._loop is not None:
                d = self._loop.run_until_complete(self._channel.get_future())
            else:
                d = self._channel.get()
            waited = time.perf_counter() - t0
        except EndOfStream:
            d = None
        except BaseException as exc:
            if isinstance(exc, Exception) and self._closed_meanwhile():
                raise StopIteration from None  # close() in another thread ended this next()
            self.close()
            raise
        if d is None:
            if self._closed_meanwhile():
                self._close_caller_loop()
                raise StopIteration
            try:
                self._finish_epoch()
            finally:
                self.close()
            raise StopIteration
        if d.error is not None:
            self.close()
        elif self._loop is not None:
            try:  # before the batch counts as delivered: a failure here loses nothing
                if self._cfg.dataset.reads_inline:
                    self._go_inline(d.spec.step + 1)
            except BaseException:
                self.close()
                raise
        return self._accept(d, waited)

    def _go_inline(self, next_step: int) -> None:
        """The storage can now read inline (a remote dataset's local copy is complete): go on
        with the plain loop from ``next_step``. The event-loop pipeline's read-ahead is dropped;
        it held raw reads only, so nothing delivered changes."""
        self._close_caller_loop()
        self._loop = self._task = None
        self._inline = InlinePipeline(self._cfg, first_step=next_step)

    def _closed_meanwhile(self) -> bool:
        """Whether ``close()`` ran in another thread while this one waited for a batch."""
        return self._done

    def _close_caller_loop(self) -> None:
        """Cancel the pipeline task on the caller-driven loop and close that loop (when no
        ``next()`` is running it)."""
        loop, task = self._loop, self._task
        if loop is None or loop.is_closed():
            return
        if loop.is_running():  # another thread's next() is inside it: it finishes the job
            if task is not None:
                loop.call_soon_threadsafe(task.cancel)
            return
        try:
            if task is not None and not task.done():
                task.cancel()
                loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()

    def close(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            if self._inline is not None:
                self._inline.close()
            self._close_caller_loop()
            fut, lt = self._future, self._lt
            if fut is not None and lt is not None:
                if not fut.done():
                    fut.cancel()  # cancels the pipeline task on the loop
                if lt.is_current():
                    # Collected on our own loop thread (cyclic GC can run anywhere): the task
                    # finishes on this loop once we return; do not wait for ourselves.
                    if self._executor is not None:
                        self._executor.shutdown(wait=False, cancel_futures=True)
                else:
                    # A cancelled future reports at once; wait for the task's cleanup to finish.
                    self._finished.wait()
                    self._join_executor()
                lt.stop()
        finally:
            self._loader._release(self)
            if self._owns_open:
                self._loader.close()

    close_sync = close

    async def close_async(self) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close()


class _AsyncIteratorState(_IteratorBase[BatchT], AsyncIterator[BatchT]):
    """The iterator ``async for batch in loader`` uses: the pipeline runs on the caller's loop."""

    def __init__(self, loader: StatefulDataLoader[Any, BatchT]) -> None:
        super().__init__(loader)
        self._task: asyncio.Task[None] | None = None
        self._channel_a: Channel[Delivery] | None = None
        self._done = False

    def __aiter__(self) -> _AsyncIteratorState[BatchT]:
        return self

    async def _start(self) -> Channel[Delivery]:
        loader = self._loader
        if loader._state == "closed":
            await loader.aopen()
            self._owns_open = True
        self._configure()
        loop = asyncio.get_running_loop()
        channel: Channel[Delivery] = Channel(loop, self._cfg.capacity)
        executor = self._start_executor()
        self._task = loop.create_task(
            run_pipeline(self._cfg, channel, 0, executor), name="guideloom-pipeline"
        )
        self._channel_a = channel
        return channel

    async def __anext__(self) -> BatchT:
        if self._done:
            raise StopAsyncIteration
        try:
            channel = self._channel_a or await self._start()
            t0 = time.perf_counter()
            d = await channel.aget()
            waited = time.perf_counter() - t0
        except EndOfStream:
            if self._done:  # aclose() in another task ended the pipeline while this one waited
                raise StopAsyncIteration from None
            try:
                self._finish_epoch()
            finally:
                await self.aclose()
            raise StopAsyncIteration from None
        except BaseException:
            await self.aclose()
            raise
        if d.error is not None:
            await self.aclose()
        return self._accept(d, waited)

    async def aclose(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            task = self._task
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise
                except Exception:
                    pass
            if self._executor is not None:
                await asyncio.to_thread(self._join_executor)
        finally:
            self._loader._release(self)
            if self._owns_open:
                await self._loader.aclose()

    close_async = aclose

    def close_sync(self) -> None:
        if self._done:
            return
        task = self._task
        self._done = True
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._loader._release(self)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close_sync()
