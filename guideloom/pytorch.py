"""The PyTorch-facing loader: :class:`StatefulDataLoader`.

The loader is a thin, stateful facade. It validates its parameters, owns what changes as it
runs (the checkpoint state ``(epoch, observation_offset)``, the lifecycle, the figures) as one
object, :class:`~guideloom._loader.state.LoaderState`, that it hands to its parts, and starts an
iterator of :mod:`guideloom._loader.iterators`, which drives the epoch's flow
(:mod:`guideloom._runtime.flow`) from the caller's thread (``for batch in loader``) or on the
caller's loop (``async for``). The position advances only when a batch is handed to the
consumer, so ``state_dict()`` never counts prefetched batches.

What the facade delegates lives in :mod:`guideloom._loader`: argument checks (``arguments``), the
state object, the epoch's plan and order, and the checkpoint (``state``, over the pure checks of
:mod:`guideloom._core.checkpoint`), opening, closing and the worker pool (``lifecycle``), and
``stats()`` (``figures``).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, Unpack, cast, overload

from guideloom._core.audit import AuditReport
from guideloom._core.checkpoint import restore_history, restore_position
from guideloom._core.checks import check_block_size, check_bool, check_int, check_optional_int
from guideloom._core.order import DEFAULT_WINDOW
from guideloom._core.plan import Counting, num_batches
from guideloom._datasets import DatasetAbstract, SourceT, StreamDataset, dataset_for
from guideloom._loader.arguments import check_device, resolve_collate_mode
from guideloom._loader.figures import verdict_figures
from guideloom._loader.iterators import AsyncIterator, SyncIterator, _IteratorBase, open_for_iteration
from guideloom._loader.provenance import audit_ranks, explain_step
from guideloom._loader.state import (
    LoaderState,
    block_size,
    epoch_order,
    identity_to_restore,
    save_state,
    window,
)
from guideloom._runtime.config import PipelineConfig
from guideloom.storage.base import DocumentStorageAbstract, InT, OutT, StreamStorageAbstract
from guideloom.types import LoaderOptions, StatefulDataLoaderStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["StatefulDataLoader"]

#: What ``collate_mode`` takes: measured, pinned to the workers, pinned inline.
_COLLATE_MODES = ("auto", "workers", "inline")

BatchT = TypeVar("BatchT")
cBatchT = TypeVar("cBatchT")  # noqa: N816 - the name from_storage's documented signature shows


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
    collate_mode: Literal["auto", "workers", "inline"] | None = None
    track_deliveries: bool = True

    #: What the loader changes as it runs (position, lifecycle, figures): the one object its
    #: parts are handed.
    _state: LoaderState = field(default_factory=LoaderState, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_arguments()
        ckpt = self._state.ckpt
        # shuffle_seed=None: one random seed for this loader's lifetime (not reproducible).
        ckpt.order_seed = self.shuffle_seed if self.shuffle_seed is not None else secrets.randbits(63)
        ckpt.tally.reset(0, 0)

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
        return num_batches(len(self.dataset), self.global_batch_size, self.drop_last, self._state.ckpt.offset)

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the dataset reader. Persistent process workers (``parallel_method="process"``)
        begin to start here, while the dataset opens, rather than at the first iterator.

        Raises:
            ValueError: If the dataset contains fewer observations than ``world_size *
                local_batch_size``.
        """
        state = self._state
        state.life.open(self.dataset, self._check_opened, functools.partial(state.begin_workers, self))

    def close(self) -> None:
        """Close the dataset reader; an active iterator ends and its threads/processes stop.

        Persistent process workers stop too: each finishes its batch within 5 seconds or is
        terminated, then killed. Returns within 10 seconds whatever ``collate_fn``, a worker or
        its fork server does (a collate that never returns is left running on its daemon
        thread, with a warning). A ``next()`` (or ``async for``) blocked in another thread or
        task ends with ``StopIteration`` (``StopAsyncIteration``); the position stays at the last
        batch it handed out.
        """
        self._state.life.close(self.dataset, keep_workers=False)

    async def aopen(self) -> None:
        """Open the dataset reader on the running event loop (what ``async with`` calls)."""
        await self._state.life.aopen(self.dataset, self._check_opened)

    async def aclose(self) -> None:
        """Close from async code: ends an active iterator, closes the dataset reader, stops
        persistent process workers (see :meth:`close`)."""
        await self._state.life.aclose(self.dataset, keep_workers=False)

    def _observations_to(self, g: int) -> int:
        """The dataset's observations, or at least ``g`` of them: a dataset counted as it is
        read (packed text) counts the current epoch's first windows until they hold ``g`` (what
        its first batch reads anyway), not the whole corpus."""
        if self.dataset._is_counted():
            return len(self.dataset)
        ckpt = self._state.ckpt
        order = epoch_order(self, ckpt, ckpt.epoch)
        if not isinstance(order, Counting):
            return len(self.dataset)
        while order.total is None and order.known < g:
            order.count_sync()
        return order.known if order.total is None else order.total

    def _check_opened(self) -> None:
        """What is checked once the dataset is open: its read hints (a dataset of your own may
        compute them from what it opened), then that it holds at least one global batch."""
        self.dataset._check_contract()
        self._check_size()

    def _check_size(self) -> None:
        g = self.global_batch_size
        n = self._observations_to(g)
        if n >= g:
            return
        what = f"the dataset has {n} observations"
        fix = "use a smaller local_batch_size or a larger dataset"
        if isinstance(self.dataset, StreamDataset):  # the sequence length may be what is too large
            elements, length = len(self.dataset.storage), self.dataset.sequence_length
            what += f" (samples of sequence_length={length} from a stream of {elements} elements)"
            if n == 0:
                fix = f"use a sequence_length of at most {elements}"
            else:
                fix = "use a smaller local_batch_size or sequence_length, or a larger dataset"
        raise ValueError(
            f"{what}, fewer than one global batch of world_size * local_batch_size = "
            f"{self.world_size} * {self.local_batch_size} = {g}; {fix}"
        )

    def _check_arguments(self) -> None:
        """Refuse constructor arguments of the wrong type or range; a device given as a str or
        an int becomes a ``torch.device``."""
        if not isinstance(self.dataset, DatasetAbstract):
            raise TypeError(
                f"dataset must be a DatasetAbstract (StreamDataset or DocumentDataset), got "
                f"{type(self.dataset).__name__}; StatefulDataLoader.from_storage wraps a storage for you"
            )
        if not callable(self.collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(self.collate_fn).__name__}")
        self.device = check_device(self.device)
        for name, minimum in (
            ("local_batch_size", 1),
            ("world_size", 1),
            ("rank", 0),
            ("num_workers", 0),
            ("prefetch", 0),
        ):
            setattr(self, name, check_int(name, getattr(self, name), minimum))
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.parallel_method not in ("thread", "process"):
            raise ValueError(f"parallel_method must be 'thread' or 'process', got {self.parallel_method!r}")
        self.collate_mode = resolve_collate_mode(self.collate_mode, self.parallel_method, self.num_workers)
        if self.collate_mode not in _COLLATE_MODES:
            raise ValueError(f"collate_mode must be 'auto', 'workers' or 'inline', got {self.collate_mode!r}")
        if self.collate_mode == "workers" and self.num_workers == 0:
            raise ValueError(
                "collate_mode='workers' needs num_workers > 0 (at num_workers=0 there are no "
                "workers to collate on)"
            )
        for name in ("shuffle", "pin_memory", "drop_last", "persistent_workers", "track_deliveries"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        self.shuffle_seed = check_optional_int("shuffle_seed", self.shuffle_seed)
        self.shuffle_block_size = check_block_size(self.shuffle_block_size)
        self.shuffle_window = check_int("shuffle_window", self.shuffle_window, 1)

    def _epoch(self) -> PipelineConfig:
        """The pipeline of the next epoch, from the parameters and the position: what a sync
        ``for``'s iterator is handed (the loader's state plans it)."""
        return self._state.plan_epoch(self)

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
        state = self._state
        owns_open = open_for_iteration(self, state.life)
        try:
            return SyncIterator(self, state, self._epoch(), owns_open)
        except BaseException:
            if owns_open:
                self.close()  # idempotent: a started iterator that failed has closed it already
            raise

    def __aiter__(self) -> AsyncIterator[BatchT]:
        # planned at its first batch, once open (an async open), by the state it is handed
        return AsyncIterator(self, self._state)

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

        Where the delivered batches were collated: ``collated_inline`` (by the loader itself: in
        your thread, or on its pipeline's loop at ``num_workers=0``), ``collated_threads`` (on
        worker threads, and ``async for``'s collate thread at ``num_workers=0``) and
        ``collated_processes``; they add up to ``batches``. Once the workers chooser of a sync
        ``for`` (``collate_mode="auto"``) has chosen, its last verdict: ``chooser_workers`` (1 the
        workers, 0 inline), the seconds a batch cost with the workers and inline as it measured
        them (``chooser_workers_seconds``, ``chooser_inline_seconds``: your loop's cycle, reads
        left out; NaN where not measured) and ``chooser_verdicts``, the choices made so far.
        """
        state = self._state
        out = state.figures.report(self.dataset, epoch=state.ckpt.epoch, offset=state.ckpt.offset)
        out["shuffle_block_size"] = block_size(self)
        out["shuffle_window"] = window(self)
        kind = "threads" if self.parallel_method == "thread" else "processes"
        out.update(verdict_figures(state.life.verdict(kind)))
        return out

    # -- geometry between steps, commits ------------------------------------------------------------
    def set_geometry(self, *, rank: int, world_size: int) -> None:
        """Cut the batches from the next one on for ``rank`` of ``world_size``: an elastic job
        (a quorum of replicas that changes from step to step) follows its data-parallel group.

        The global position stays where it is; the next global batch is cut for the new number
        of ranks, so the ranks of the new geometry together go on with exactly the samples the
        old one had not handed out. An active iterator drops what it read ahead or is making for
        the old geometry and re-plans from the position on the executors it has (workers are not
        restarted); without one, the next iterator starts with it. The change joins the
        checkpoint's geometry history (``explain()`` names each step's samples through it). The
        same geometry again costs nothing. Call it between two batches, from the code that
        iterates.

        Raises:
            ValueError: For a rank outside ``[0, world_size)``, or a global batch (``world_size
                * local_batch_size``) larger than the open dataset.
        """
        rank = check_int("rank", rank, 0)
        world_size = check_int("world_size", world_size, 1)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if rank == self.rank and world_size == self.world_size:
            return
        life = self._state.life
        with life.lock:
            if (
                life.state != "closed"
                and self.dataset._is_counted()
                and world_size * self.local_batch_size > len(self.dataset)
            ):
                raise ValueError(
                    f"world_size={world_size} with local_batch_size={self.local_batch_size} makes a global "
                    f"batch of {world_size * self.local_batch_size}, more than the dataset's "
                    f"{len(self.dataset)} observations; use fewer ranks or a smaller local_batch_size"
                )
            changed = world_size != self.world_size
            self.rank, self.world_size = rank, world_size
            it = life.active.get()
            if isinstance(it, _IteratorBase) and it.planned():
                ckpt = self._state.ckpt
                if changed:
                    ckpt.history.begin(ckpt.epoch, ckpt.offset, self.local_batch_size, world_size)
                it.replan(ckpt.offset)

    def commit(self) -> None:
        """Commit the batches handed out so far: :meth:`rollback` no longer takes them back.

        With a training step that may fail after its batch was handed out (a replica group lost
        during the step), commit once the step is known to count (the optimizer stepped).
        The end of an epoch commits it.
        """
        with self._state.life.lock:
            self._state.ckpt.commit()

    def rollback(self) -> None:
        """Take back the batches handed out since the last :meth:`commit` (or since the epoch's
        start, or the position a checkpoint resumed it at): they are handed out again, cut for
        the geometry then in force (:meth:`set_geometry` may change it first or after), so
        no sample is lost or repeated.

        The position, the geometry history and the audit's tally return to the committed
        offset; an active iterator drops its read-ahead and re-plans from there without
        restarting its workers. Nothing to take back costs nothing. Call it between two
        batches, from the code that iterates.
        """
        state = self._state
        with state.life.lock:
            ckpt = state.ckpt
            if ckpt.offset == ckpt.committed:
                return
            ckpt.rollback()
            ckpt.history.begin(ckpt.epoch, ckpt.offset, self.local_batch_size, self.world_size)
            it = state.life.active.get()
            if isinstance(it, _IteratorBase) and it.planned():
                it.replan(ckpt.offset)

    @property
    def committed_offset(self) -> int:
        """The epoch's global offset at the last :meth:`commit`: what :meth:`rollback` returns to
        and ``state_dict(committed=True)`` records."""
        return self._state.ckpt.committed

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, *, committed: bool = False) -> StatefulDataLoaderStateDict:
        """Return the checkpoint for batches already delivered to the consumer.

        Prefetched batches that have not been yielded do not advance ``observation_offset``.
        Each yielded batch advances it by ``global_batch_size``, including padding in an
        incomplete final batch. A block shuffle also records its ``shuffle_block_size``,
        ``shuffle_window`` and ``shuffle_block_auto`` (whether it was given ``"auto"``); a global
        shuffle records none of them: it has blocks of one sample.

        ``committed=True``: the checkpoint at the last :meth:`commit` instead (the batches
        handed out since are left out, as a rollback would), what a replica that joins a
        fault-tolerant job receives from a live peer; safe to call from another thread.
        """
        if committed:
            with self._state.life.lock:
                return save_state(self, self._state, committed=True)
        return save_state(self, self._state)

    def load_state_dict(
        self, state_dict: StatefulDataLoaderStateDict, *, allow_dataset_change: bool = False
    ) -> None:
        """Restore ``epoch`` and ``observation_offset`` from a checkpoint.

        Call this before starting an iterator. A warning is emitted when ``shuffle``,
        ``shuffle_seed``, ``drop_last`` or the shuffle blocks (``shuffle_block_size`` as each
        loader was given it, ``"auto"`` or a size, and ``shuffle_window``) differ from this
        loader; those saved values are not
        applied. The offset is global, so a job can resume with another batch size or world size.
        A checkpoint counted over another dataset (its fingerprint differs) is refused:
        ``allow_dataset_change=True`` resumes at its position anyway, for data changed on purpose.

        Raises:
            RuntimeError: If an iterator on this loader is still active.
            ValueError: If the checkpoint is malformed, was counted over another dataset, or its
                offset lies past the end of this dataset (further than the padding of a final
                partial batch can reach; with ``allow_dataset_change``, past it at all).
        """
        state = self._state
        with state.life.lock:
            epoch, offset = restore_position(
                state_dict, identity_to_restore(self, state), allow_dataset_change=allow_dataset_change
            )
            counts = state_dict.get("counts")
            if isinstance(counts, str) and not allow_dataset_change:  # counted over this dataset
                self.dataset._load_count_state(counts)
            state.ckpt.restore(epoch, offset, restore_history(state_dict, epoch, offset))

    # -- provenance -------------------------------------------------------------------------------
    def explain(
        self, step: int, *, rank: int | None = None, epoch: int | None = None
    ) -> list[dict[str, Any]]:
        """What ``rank`` read at ``step`` of ``epoch``: one dict per sample of that batch.

        ``step`` is the epoch's global batch index: how many batches each rank had been handed in
        the epoch before it, counted across resumes (the checkpoint's ``history`` records where
        the batch size or world size changed). ``rank`` defaults to this loader's, ``epoch`` to
        the current one; steps not taken yet are those the loader's present geometry will take.
        Each dict holds ``epoch``, ``step``, ``rank``, ``position`` (in the epoch's order) and
        ``index`` (the dataset's sample), and what the dataset says of that sample: a mixture
        its ``source`` and ``source_index``; packed and document datasets the ``documents``
        (``[document, first element, end]`` in the document); datasets over storage the
        ``elements`` (``[start, stop)`` in the storage, one per piece) and, for written datasets,
        the ``files`` of each piece (``[path, first byte, end byte]`` per file it spans; over
        Parquet ``[path, "row group G", "row R"]`` per row). O(1) per sample: nothing is replayed
        or read but the few offsets that place its documents (over Parquet, the sample's row).

        Raises:
            IndexError: For a step outside the epoch or a rank outside that step's world.
            ValueError: For an epoch whose history the loader no longer keeps (before the
                last one).
        """
        return explain_step(self, self._state, step, rank=rank, epoch=epoch)

    def audit(self) -> AuditReport:
        """Check that the ranks together were handed each position of the epoch so far exactly
        once, against what the plan says the epoch holds at this offset.

        Every rank counts what it delivers (a count and an order-independent digest of the
        positions, a few microseconds a batch). Under ``torch.distributed`` (initialised) this is
        a collective: call it on every rank at the same step; it sums the ranks' tallies with
        ``all_reduce`` and, only where they disagree with the plan, gathers each rank's runs of
        batches to name the first step that went wrong. Without it, the loader checks itself
        (``world_size`` 1). The tally counts from the epoch's start or from the position a
        checkpoint resumed it at.

        Returns:
            An :class:`~guideloom.AuditReport`: ``ok``, and where not, the first disagreeing
            ``step`` and a ``message``.
        """
        return audit_ranks(self, self._state)
