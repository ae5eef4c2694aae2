"""The messages between the main process and its workers, each a typed tuple.

To a worker: :class:`Epoch` (an iterator's plan and order, once), :class:`Replan` (the last
epoch's order again, from another offset and geometry: a re-plan), :class:`Task` (a group of
consecutive steps to read and collate, or to collate from the samples sent with it),
:class:`End` (drop what is left of an iterator's groups) and :class:`Stop`. From a worker:
:class:`Ready` or :class:`Failed` once, at its start, then a :class:`GroupDone` per task, whose
entries describe each batch: an array or tensor in the group's slot (:class:`ArrayEntry`), a
tuple or list of them (:class:`TupleEntry`), a pickle whose large arrays are in the slot or that
holds them itself (:class:`PickleEntry`), or the exception that replaced the batch
(:class:`ErrorEntry`). Each entry turns itself back into a delivery.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from guideloom._core.delivery import Delivery
from guideloom._core.order import Order
from guideloom._core.plan import BatchSpec, EpochPlan
from guideloom._runtime.processes.shm import Rebuilder, SharedArray, SharedArrayFull, view

__all__ = [
    "ArrayEntry",
    "End",
    "Entry",
    "Epoch",
    "ErrorEntry",
    "FlatLayout",
    "Failed",
    "GroupDone",
    "PickleEntry",
    "Ready",
    "RemoteTraceback",
    "Replan",
    "Samples",
    "Stop",
    "Task",
    "TupleEntry",
    "exception_message",
    "load_exception",
    "send_message",
]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (set as its ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


# -- to a worker ----------------------------------------------------------------------------------
class Epoch(NamedTuple):
    """An iterator's epoch: the tasks that carry its ``token`` read by this plan and order."""

    token: int
    plan: EpochPlan
    order: Order
    reading: str


class Replan(NamedTuple):
    """The worker's last :class:`Epoch` started again as the epoch of ``token``, from another
    offset and geometry: the plan's fields but its order, which has not changed (a re-plan at a
    change of quorum sends a few ints, not the order)."""

    token: int
    local_batch_size: int
    world_size: int
    rank: int
    drop_last: bool
    start_offset: int


class EpochMessages:
    """An epoch as the workers are sent it, each form pickled once for all of them: the whole
    :class:`Epoch`, or a :class:`Replan` of its plan's numbers for a worker whose last epoch had
    the same order and reading."""

    __slots__ = ("_done", "epoch")

    def __init__(self, epoch: Epoch) -> None:
        self.epoch = epoch
        self._done: dict[bool, bytes] = {}

    def pickled(self, replan: bool) -> bytes:
        data = self._done.get(replan)
        if data is None:
            epoch, plan = self.epoch, self.epoch.plan
            if replan:
                msg = Replan(
                    epoch.token, plan.local_batch_size, plan.world_size, plan.rank, plan.drop_last,
                    plan.start_offset,
                )  # fmt: skip
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            else:  # the epoch's order may be anything a dataset gives: pickled as Connection.send does
                data = bytes(ForkingPickler.dumps(epoch))
            self._done[replan] = data
        return data


class FlatLayout(NamedTuple):
    """Samples that are 1-D arrays of one dtype, laid one after the other: each ``length``
    elements (one length for all, or each its own), ``counts`` of them per batch. ``rows``: each
    batch was the :class:`~guideloom._core.rows.Rows` of one block (a stream's read), and is
    rebuilt as one, its rows of one length."""

    dtype: str
    lengths: int | tuple[int, ...]
    counts: tuple[int, ...]
    rows: bool = False


class Samples(NamedTuple):
    """Samples the main process read for a task, in the shared-memory ``segment`` of ``size``
    bytes (None: nothing there): laid flat (``flat``), or pickled (``data``), the pickle naming
    the arrays it left in the segment."""

    segment: str | None
    size: int
    data: bytes | None
    flat: FlatLayout | None


class Task(NamedTuple):
    """Collate steps ``[start, stop)`` of the epoch of ``token``, as group ``gid``: read by the
    worker, or, with ``samples`` (each step's list of samples), read by the main process, which
    reads an object store's windows with its requests coalesced and in flight together."""

    token: int
    gid: int
    start: int
    stop: int
    samples: Samples | None = None


class End(NamedTuple):
    """The iterator of ``token`` has ended: drop its tasks."""

    token: int


class Stop(NamedTuple):
    """Finish the batch at hand and exit."""


# -- from a worker --------------------------------------------------------------------------------
class Ready(NamedTuple):
    """The worker has opened the dataset."""

    pid: int


class Failed(NamedTuple):
    """The worker could not start: the dataset's ``open()`` raised (``at_open``), or something
    before it (unpickling the dataset or the collate)."""

    error: bytes
    tb: str
    at_open: bool


class ArrayEntry(NamedTuple):
    """A batch that is one array or tensor, in the group's slot."""

    step: int
    array: SharedArray | SharedArrayFull

    def delivery(self, spec: BatchSpec, holder: Any) -> Delivery:
        return Delivery(spec, view(holder, *self.array))


class TupleEntry(NamedTuple):
    """A batch that is a plain tuple (``as_list``: a list) of distinct arrays or tensors, each in
    the group's slot: rebuilt as views without a pickle of its own (a collate's ``(tokens,
    lengths)``), where unpickling it cost the main process more than the views."""

    step: int
    arrays: tuple[SharedArray | SharedArrayFull, ...]
    as_list: bool

    def delivery(self, spec: BatchSpec, holder: Any) -> Delivery:
        parts = [view(holder, *a) for a in self.arrays]
        return Delivery(spec, parts if self.as_list else tuple(parts))


class PickleEntry(NamedTuple):
    """A batch as a pickle; ``in_slot``: its large arrays are in the group's slot, named by it."""

    step: int
    data: bytes
    in_slot: bool

    def delivery(self, spec: BatchSpec, holder: Any) -> Delivery:
        if self.in_slot:
            return Delivery(spec, Rebuilder(self.data, holder).load())
        return Delivery(spec, pickle.loads(self.data))


class ErrorEntry(NamedTuple):
    """The exception that replaced a batch (the group ends with it)."""

    step: int
    error: bytes
    tb: str

    def delivery(self, spec: BatchSpec, holder: Any) -> Delivery:
        return Delivery(spec, error=load_exception(self.error, self.tb))


Entry = ArrayEntry | TupleEntry | PickleEntry | ErrorEntry


class GroupDone(NamedTuple):
    """A task's batches: their entries, the slot their arrays are in (``(index, name, size)``, or
    None), what a batch's read and its read and collate took in the worker (seconds), the
    requests and bytes the worker's storage read since its last message (object stores), and the
    bytes the batches' arrays take in the slot."""

    token: int
    gid: int
    entries: list[Entry]
    slot: tuple[int, str, int] | None
    read_s: float
    work_s: float
    reads: tuple[int, int] = (0, 0)
    slot_bytes: int = 0


def send_message(conn: multiprocessing.connection.Connection, msg: tuple[Any, ...]) -> None:
    """Send one message from a worker (pickled once, protocol 5)."""
    conn.send_bytes(pickle.dumps(msg, protocol=5))


def exception_message(exc: BaseException) -> tuple[bytes, str]:
    """``exc`` pickled, with its traceback as text; an exception that does not survive a pickle
    round trip travels as a ``RuntimeError`` that names it."""
    tb = "".join(traceback.format_exception(exc))
    try:
        data = pickle.dumps(exc, protocol=5)
        pickle.loads(data)  # an exception that pickles but does not unpickle is sent as text
    except Exception:
        data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"), protocol=5)
    return data, tb


def load_exception(data: bytes, tb: str) -> BaseException:
    """A worker's exception, its traceback in a :class:`RemoteTraceback` as its ``__cause__``."""
    exc: BaseException
    try:
        loaded = pickle.loads(data)
    except Exception as err:
        loaded = RuntimeError(f"an exception from a worker process could not be unpickled ({err})")
    exc = loaded if isinstance(loaded, BaseException) else RuntimeError(repr(loaded))
    exc.__cause__ = RemoteTraceback(tb)
    return exc
