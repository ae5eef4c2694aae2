"""Datasets: observation ``i`` to sample, over a storage or any random-access source.

A dataset is what the loader plans over: it has a number of observations and reads any set of
them in one batched call. ``StreamDataset`` cuts a stream into fixed-length samples;
``DocumentDataset`` serves one document per sample; ``MapDataset`` adapts any object with
``__len__`` and ``__getitem__``. A dataset of your own subclasses ``DatasetAbstract`` and
implements ``__len__`` and ``read_many``; ``storage`` is optional (``None`` by default, and
``open``/``close`` then do nothing).

The public contract is those, ``order``, ``describe``, ``sequence_length`` and ``read_hints``
(one frozen :class:`ReadHints`). What else the loader asks a dataset (blocking reads, counting,
checkpoint fingerprints, a step that finishes samples where the loader collates) are internal
hooks, underscore-prefixed: guideloom's own datasets override them, and their defaults are what
a dataset of your own needs.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, TypeVar

import anyio
import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._core.schedule import WINDOW_BATCHES
from guideloom.storage.base import StorageAbstract, mark_own_reads
from guideloom.types import DatasetFingerprint

if TYPE_CHECKING:
    from guideloom._core.order import Order

__all__ = [
    "BuiltinDataset",
    "Call",
    "DatasetAbstract",
    "FinishThenCollate",
    "ReadHints",
    "ReadPlan",
    "SourceT",
    "close_shared",
    "open_shared",
    "read_async",
    "read_sync",
]

_DEFAULT_READ_WINDOW_BYTES: Final = 4 * 2**20  # what StorageAbstract.read_window_bytes defaults to

#: The names of the read hints as members of a dataset, which :attr:`DatasetAbstract.read_hints`
#: holds: a subclass that defines one of them would be ignored, so it is refused.
_HINT_MEMBERS: Final = frozenset(
    {
        "max_concurrent_reads",
        "read_window_bytes",
        "read_window_batches",
        "shuffle_block_bytes",
        "sample_nbytes",
        "sample_nbytes_hint",
    }
)

#: The loader's hooks that only guideloom's own datasets answer, by their names as public members
#: (each is an underscore-prefixed member now): a dataset of your own that defines one would be
#: ignored, so it is refused (guideloom's own datasets keep a public ``read_many_sync`` and the
#: like beside the hooks).
_HOOK_MEMBERS: Final = frozenset(
    {
        "collate_with",
        "count_state",
        "is_counted",
        "finish_step",
        "fingerprint",
        "load_count_state",
        "loader_order",
        "natural_blocks",
        "own_order",
        "position_stats",
        "read_by_workers",
        "read_many_sync",
        "reads_inline",
        "will_read",
    }
)

SourceT = TypeVar("SourceT")


#: How many open datasets read each storage (two loaders, a train and an eval one, may share a
#: storage object): the storage is closed with the last of them, not under the others' reads.
_OPENS: weakref.WeakKeyDictionary[StorageAbstract[Any, Any], int] = weakref.WeakKeyDictionary()
_OPENS_LOCK = threading.Lock()  # the loaders of one storage may run on different threads


async def open_shared(storage: StorageAbstract[Any, Any]) -> None:
    """Open ``storage`` for one more dataset (it is idempotent: a storage opened already stays so)."""
    await storage.open()
    try:
        with _OPENS_LOCK:
            _OPENS[storage] = _OPENS.get(storage, 0) + 1
    except TypeError:  # a storage that cannot be counted (unhashable): each close closes it
        pass


async def close_shared(storage: StorageAbstract[Any, Any]) -> None:
    """Close ``storage`` for one dataset: only once no other open dataset reads it."""
    try:
        with _OPENS_LOCK:
            left = _OPENS.pop(storage, 1) - 1
            if left > 0:
                _OPENS[storage] = left
                return
    except TypeError:
        pass
    await storage.close()


@dataclass(frozen=True, slots=True)
class ReadHints:
    """How the loader reads a dataset: its read-ahead windows and how many it keeps in flight.

    A dataset over a storage takes its storage's figures; a dataset of your own gets the
    defaults (one window of 4 MiB, at most 64 batches, in flight at a time: right for memory and
    local sources) unless its ``read_hints`` returns others, for example more concurrent reads
    for a source whose reads are round trips.

    Examples:
        >>> import guideloom as gl
        >>> class Remote(gl.DatasetAbstract[bytes]):
        ...     read_hints = gl.ReadHints(max_concurrent_reads=8)
        ...
        ...     def __len__(self) -> int:
        ...         return 100
        ...
        ...     async def read_many(self, indices):
        ...         return [b"%d" % i for i in indices]
        >>> Remote().read_hints.max_concurrent_reads
        8
    """

    max_concurrent_reads: int = 1
    """Read windows (``read_many`` calls) the loader keeps in flight at once."""
    read_window_bytes: int = _DEFAULT_READ_WINDOW_BYTES
    """Bytes the loader asks for in one ``read_many`` call at most: the read-ahead window that
    batched reads and range coalescing work over."""
    read_window_batches: int = WINDOW_BATCHES
    """Batches the loader asks for in one ``read_many`` call at most."""
    shuffle_block_bytes: int | None = None
    """Bytes per shuffle block that ``shuffle_block_size="auto"`` aims at; ``None`` asks for the
    global row shuffle, and read windows that are not cut at block ends."""
    sample_nbytes: int = 0
    """A typical sample's size in bytes (0 if unknown), for sizing read-ahead windows."""

    def __post_init__(self) -> None:
        check_int("max_concurrent_reads", self.max_concurrent_reads, 1)
        check_int("read_window_bytes", self.read_window_bytes, 1)
        check_int("read_window_batches", self.read_window_batches, 1)
        if self.shuffle_block_bytes is not None:
            check_int("shuffle_block_bytes", self.shuffle_block_bytes, 1)
        check_int("sample_nbytes", self.sample_nbytes, 0)

    @classmethod
    def of_storage(cls, storage: StorageAbstract[Any, Any], *, sample_nbytes: int | None = None) -> ReadHints:
        """A storage's figures (``sample_nbytes``: the storage's own hint unless given)."""
        return cls(
            max_concurrent_reads=max(1, int(storage.max_concurrent_reads)),
            read_window_bytes=max(1, int(storage.read_window_bytes)),
            read_window_batches=max(1, int(storage.read_window_batches)),
            shuffle_block_bytes=storage.shuffle_block_bytes,
            sample_nbytes=max(
                0, int(storage.sample_nbytes_hint() if sample_nbytes is None else sample_nbytes)
            ),
        )


class DatasetAbstract(ABC, Generic[SourceT]):
    """A finite, random-access collection of samples read in batches.

    Subclass it for a source of your own: implement ``__len__`` and ``read_many`` (and, where
    the source must be opened and closed, ``open`` and ``close``). ``storage`` is optional;
    ``order``, ``describe``, ``sequence_length`` and ``read_hints`` have defaults that a dataset
    of your own may override.
    """

    #: Whether this class's ``read_many`` is the one guideloom wrote, so that ``_read_many_sync``
    #: and ``_will_read`` stand for it. A subclass that defines ``read_many`` without declaring
    #: this again is read through its own ``read_many`` (a check, an augmentation, a fault).
    _plain_reads: ClassVar[bool] = False
    #: Whether :meth:`order` makes the epoch order (a class that defines ``order`` does, unless it
    #: declares otherwise); shuffle blocks are then neither used nor recorded.
    _makes_own_order: ClassVar[bool] = False

    sequence_length: int = 0
    """Elements per sample where every sample has that many (a stream's windows, packed rows);
    0 (the default) where samples have no fixed length. A checkpoint's fingerprint records it."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mark_own_reads(cls)
        if "order" in cls.__dict__ and "_makes_own_order" not in cls.__dict__:
            cls._makes_own_order = True
        hints = _HINT_MEMBERS.intersection(cls.__dict__)
        if hints:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(sorted(hints))}, which a dataset declares in "
                "one value: define read_hints = ReadHints(...) (or a read_hints property) instead"
            )
        # guideloom's own datasets keep public names beside the hooks; a subclass of one of yours
        # may define read_many_sync (its blocking read), nothing else of the hooks
        own = cls.__module__.startswith("guideloom.")
        builtin = any(getattr(c, "_builtin", False) for c in cls.__mro__[1:])
        hooks = (
            set()
            if own
            else _HOOK_MEMBERS.intersection(cls.__dict__) - ({"read_many_sync"} if builtin else set())
        )
        if hooks:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(sorted(hooks))}, which the loader does not ask a "
                "dataset of your own: implement __len__ and read_many (and open/close, order, "
                "describe, read_hints where needed); see DatasetAbstract"
            )
        declared = cls.__dict__.get("read_hints")
        if declared is not None and not isinstance(declared, (ReadHints, property)):
            raise TypeError(
                f"{cls.__name__}.read_hints is a {type(declared).__name__}, not a ReadHints: "
                "define read_hints = ReadHints(max_concurrent_reads=..., ...)"
            )

    # -- the contract ---------------------------------------------------------------------------
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
            await open_shared(self.storage)

    async def close(self) -> None:
        """Close what :meth:`open` opened; the loader calls this on ``close()``, after its last
        read. A storage that another open dataset reads too (two loaders over one storage)
        stays open until the last of them closes."""
        if self.storage is not None:
            await close_shared(self.storage)

    @abstractmethod
    def __len__(self) -> int:
        """Number of observations (samples)."""

    @abstractmethod
    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        """Samples ``indices`` (each in ``[0, len(self))``), in that order."""

    def order(self, *, shuffle: bool, seed: int, epoch: int) -> Order | None:
        """The epoch order of a dataset that makes its own, or ``None`` (the default): the
        loader then makes its own (the seeded permutation of ``[0, len(self))``, or the block
        shuffle that ``shuffle_block_size`` asks for; a dataset's own order ignores that).

        An order maps each position ``[0, len(self))`` to the index ``read_many`` is given for
        it, and depends on the arguments and the dataset alone (never on batch size or ranks).
        A mixture returns one (its sources' schedule and permutations behind it).
        """
        return None

    def describe(self, index: int) -> dict[str, Any]:
        """What sample ``index`` is made of, for ``loader.explain()``: JSON-like values under
        the keys a kind of dataset knows (``source``, ``source_index``, ``documents``,
        ``elements``, ``files``; see :meth:`StatefulDataLoader.explain
        <guideloom.StatefulDataLoader.explain>`). O(1): a few lookups, never a sample's data.
        Empty by default (a dataset of your own may say what it knows)."""
        return {}

    @property
    def read_hints(self) -> ReadHints:
        """How the loader reads this dataset (:class:`ReadHints`): its storage's figures, the
        defaults without a storage; or what was set (``self.read_hints = ReadHints(...)``, as a
        class attribute or in ``__init__``)."""
        own = self.__dict__.get("_read_hints_set")
        if own is not None:
            return own  # type: ignore[no-any-return]
        return self._hints()

    @read_hints.setter
    def read_hints(self, hints: ReadHints) -> None:
        if not isinstance(hints, ReadHints):
            raise TypeError(
                f"read_hints is a {type(hints).__name__}, not a ReadHints: set "
                "read_hints = ReadHints(max_concurrent_reads=..., ...)"
            )
        self.__dict__["_read_hints_set"] = hints

    def _hints(self) -> ReadHints:
        """:attr:`read_hints` where none was set: guideloom's own datasets answer for their
        storage here."""
        return ReadHints() if self.storage is None else ReadHints.of_storage(self.storage)

    def _check_contract(self) -> None:
        """Refuse what the loader would silently ignore: read hints set as separate members of
        the dataset object, and hints that are not a :class:`ReadHints` (from a property)."""
        hints = _HINT_MEMBERS.intersection(vars(self)) if hasattr(self, "__dict__") else set()
        if hints:
            raise TypeError(
                f"{type(self).__name__} sets {', '.join(sorted(hints))} on the dataset, which the "
                "loader does not read: set read_hints = ReadHints(...) instead"
            )
        got = self.read_hints
        if not isinstance(got, ReadHints):
            raise TypeError(
                f"{type(self).__name__}.read_hints gave a {type(got).__name__}, not a ReadHints: "
                "return ReadHints(max_concurrent_reads=..., ...)"
            )

    # -- internal hooks: what guideloom's own datasets answer otherwise ----------------------------
    def _read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        """``read_many`` in the caller's thread (only where :attr:`_reads_inline`)."""
        raise NotImplementedError(f"{type(self).__name__} has no blocking reads")

    @property
    def _reads_inline(self) -> bool:
        """Whether ``_read_many_sync`` can stand in for ``read_many`` now (see
        :meth:`StorageAbstract.reads_inline <guideloom.StreamStorageAbstract.reads_inline>`).

        guideloom's datasets answer for themselves and their storage; not where a subclass
        overrides ``read_many`` (to add a check, an augmentation or a fault): its own
        ``read_many`` is then the read, and the loader calls that. A dataset of your own is
        read through its ``read_many``.
        """
        return False

    @property
    def _read_by_workers(self) -> bool:
        """Whether process workers read their own batches where the dataset reads inline (its
        storage's answer, :meth:`StorageAbstract.read_by_workers
        <guideloom.DocumentStorageAbstract.read_by_workers>`); otherwise the main process reads
        and sends them the samples."""
        return self.storage is None or self.storage.read_by_workers()

    def _will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """A hint: the ``read_many(indices)`` calls the loader will make next, in order (see
        :meth:`StreamStorageAbstract.will_read <guideloom.StreamStorageAbstract.will_read>`).
        The default ignores it."""

    def _loader_order(self, *, shuffle: bool, seed: int, epoch: int) -> Order | None:
        """The order a loader that reads this dataset itself uses: :meth:`order` (the default),
        or one whose indexes name samples otherwise than ``[0, len)`` (packing counted by
        blocks, whose length is known only once every block is read). A mixture uses
        :meth:`order`."""
        return self.order(shuffle=shuffle, seed=seed, epoch=epoch)

    def _own_order(self) -> bool:
        """Whether :meth:`_loader_order` gives this dataset's epoch order (``_makes_own_order``,
        or a dataset whose own order depends on how it was made: packing counted by blocks);
        the loader's shuffle blocks do not apply then."""
        return self._makes_own_order

    def _count_state(self) -> str | None:
        """What a checkpoint carries of what this dataset counted as it read (``None``: nothing,
        its length is known without counting)."""
        return None

    def _load_count_state(self, state: str) -> None:
        """Take a checkpoint's :meth:`_count_state` (nothing to take by default)."""

    def _is_counted(self) -> bool:
        """Whether ``len()`` is known without counting: a dataset counted as it is read (packed
        text) knows it once every block is read, and ``len()`` before that counts them all."""
        return True

    def _fingerprint(self) -> DatasetFingerprint:
        """What identifies this dataset for a checkpoint: its kind, number of observations,
        sequence length (0 where samples have none) and the digest of its storage's content
        (``""`` where the storage has no manifest). A checkpoint counted over another
        fingerprint is refused on load."""
        storage = self.storage
        return DatasetFingerprint(
            kind=self._fingerprint_kind(),
            observations=len(self),
            sequence_length=int(self.sequence_length or 0),
            digest="" if storage is None else storage.content_digest(),
        )

    def _fingerprint_kind(self) -> str:
        """The kind a checkpoint records (a dataset of your own: its class's name)."""
        return type(self).__name__

    def _natural_blocks(self) -> npt.NDArray[np.int64] | None:
        """The sizes of the runs of consecutive observations its storage reads together (Parquet
        row groups), which ``shuffle_block_size="auto"`` keeps together; ``None`` (the default)
        for uniform blocks."""
        return None

    def _collate_with(self, collate_fn: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
        """What the loader runs where it collates: ``collate_fn`` itself (the default), or a
        step of this dataset's reads first (tokenizing texts), so that it runs in the workers.
        The same ``collate_fn`` gives the same object each time."""
        return collate_fn

    def _finish_step(self) -> Callable[[Sequence[Any]], Sequence[Any]] | None:
        """The step that finishes this dataset's samples after a read (tokenizing texts) where
        the loader runs it with ``collate_fn`` (:meth:`_collate_with`); ``None`` where a read's
        samples are finished. A dataset that reads another (a mixture) runs it after the read."""
        return None

    def _position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """Figures about position ``(epoch, offset)`` for ``loader.stats()`` (none by default; a
        mixture reports each source's own epoch)."""
        return {}


class BuiltinDataset(DatasetAbstract[SourceT]):
    """What guideloom's own datasets add to the contract: a blocking read, which the loader
    uses where the dataset reads inline."""

    _builtin: ClassVar[bool] = True

    @abstractmethod
    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        """``read_many`` in the caller's thread, blocking."""

    def _read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return self.read_many_sync(indices)


class FinishThenCollate:
    """A batch's samples finished by a dataset's step (tokenized), then collated: one callable
    where ``collate_fn`` ran, picklable where both are (process workers)."""

    __slots__ = ("collate_fn", "finish")

    def __init__(
        self, finish: Callable[[Sequence[Any]], Sequence[Any]], collate_fn: Callable[[Sequence[Any]], Any]
    ) -> None:
        self.finish, self.collate_fn = finish, collate_fn

    def __call__(self, samples: Sequence[Any]) -> Any:
        return self.collate_fn(self.finish(samples))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FinishThenCollate, (self.finish, self.collate_fn))

    def __repr__(self) -> str:
        return f"FinishThenCollate({self.finish!r}, {self.collate_fn!r})"


@dataclass(frozen=True, slots=True)
class Call:
    """One storage call of a read, in both its forms: ``blocking()`` (in the caller's thread, for
    a dataset that reads inline) and ``coroutine()``; both return the same value."""

    blocking: Callable[[], Any]
    coroutine: Callable[[], Awaitable[Any]]


#: A dataset's read written once, as a generator (the httpx auth-flow shape): it yields the
#: storage calls it needs next, all at once (they may run concurrently), is sent their results in
#: order, and returns the samples. :func:`read_sync` and :func:`read_async` drive it.
ReadPlan = Generator[list[Call], list[Any], Sequence[Any]]


def read_sync(plan: ReadPlan) -> Sequence[Any]:
    """Run ``plan`` with each call's blocking form, in the caller's thread."""
    try:
        calls = next(plan)
        while True:
            calls = plan.send([call.blocking() for call in calls])
    except StopIteration as done:
        samples: Sequence[Any] = done.value
        return samples


async def read_async(plan: ReadPlan) -> Sequence[Any]:
    """Run ``plan`` with each call's coroutine, the calls of one step concurrently."""
    try:
        calls = next(plan)
        while True:
            calls = plan.send(await _gather(calls))
    except StopIteration as done:
        samples: Sequence[Any] = done.value
        return samples


async def _gather(calls: list[Call]) -> list[Any]:
    """Await the calls at once; the first failure is raised as it is (not in an exception group:
    the loader reports a storage's error with its own type, at its batch)."""
    if len(calls) == 1:
        return [await calls[0].coroutine()]
    got: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    async def run(i: int, call: Call) -> None:
        try:
            got[i] = await call.coroutine()
        except Exception as exc:
            errors.append(exc)

    # Each call's coroutine is made here and closed once the group is over: a task cancelled
    # before its first step (a read cancelled at the loader's close) never awaits the coroutine
    # it was handed (anyio runs it inside a wrapper), which would be left "never awaited".
    # Closing one that ran is a no-op; every task has ended when the group exits.
    runs = [run(i, call) for i, call in enumerate(calls)]
    try:
        async with anyio.create_task_group() as tg:
            for coro in runs:
                tg.start_soon(_given, coro)
    finally:
        for coro in runs:
            coro.close()
    if errors:
        raise errors[0]
    return got


def _given(coro: Coroutine[Any, Any, None]) -> Coroutine[Any, Any, None]:
    """``coro`` itself: what a task group's ``start_soon`` calls for a coroutine made already."""
    return coro
