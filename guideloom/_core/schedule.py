"""The batch schedule, free of I/O: which reads to make, and what each read delivers.

As httpx drives its auth flow, the reader's logic is a plain generator that *yields* a read
request (the int64 observation indexes of a window) and is *sent* the samples, or has the read's
exception *thrown* into it; a driver performs the read. :func:`run_sync` reads with a blocking
call (the inline loop), :func:`run_async` with a coroutine (the event-loop reader), so windows,
index lookup, the count check, the split into batches and the localisation of a failure exist
once, and are tested without any storage (``tests/core/test_schedule.py``).

The schedule comes in two parts so that the async reader can keep several windows in flight:
:func:`windows` plans the epoch's windows ahead (a pure iterator of batch lists), and
:func:`read_window` is the generator for one window's read.

An epoch counted as it goes (:class:`~guideloom._core.plan.Counting`: packed text, whose
sequences are counted block by block as the blocks are first read) has windows only as far as
its count: where the next batch is not counted yet, :func:`windows` yields an empty window, whose
"read" is :func:`count_window`: it yields a :class:`Count` request, which the driver performs as
it performs a read (in its own thread, or awaited), and the windows go on from the new count.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from guideloom._core.delivery import DELIVERED_ERRORS, Delivery
from guideloom._core.order import LOOKUP_BLOCK, Order
from guideloom._core.plan import BatchSpec, Counting, EpochPlan
from guideloom._core.rows import Rows
from guideloom._errors import StorageError

__all__ = [
    "DELIVERED_ERRORS",
    "Count",
    "count_window",
    "WINDOW_BATCHES",
    "Delivery",
    "Indexes",
    "Offload",
    "ReadWindow",
    "future_reads",
    "max_window",
    "read_window",
    "run_async",
    "run_sync",
    "every",
    "windows",
]

#: Read-ahead window: at most this many batches per storage call (and at most the storage's
#: ``read_window_bytes``).
WINDOW_BATCHES = 64

Indices: TypeAlias = npt.NDArray[np.int64]


class Count:
    """A request to count the next window of an epoch counted as it goes: the driver performs it
    as a read (:meth:`Counting.count_sync <guideloom._core.plan.Counting.count_sync>`, or
    awaits :meth:`Counting.count`), and sends ``None`` back."""

    __slots__ = ("counting",)

    def __init__(self, counting: Counting) -> None:
        self.counting = counting


#: One window's read: yields the indexes to read (or a count to make), is sent their samples,
#: returns the deliveries.
ReadWindow: TypeAlias = Generator["Indices | Count", Sequence[Any] | None, "list[Delivery]"]


def _positions(specs: Sequence[BatchSpec]) -> npt.NDArray[np.int64]:
    if len(specs) == 1 or all(a.stop == b.start for a, b in itertools.pairwise(specs)):
        return np.arange(specs[0].start, specs[-1].stop, dtype=np.int64)
    return np.concatenate([np.arange(s.start, s.stop, dtype=np.int64) for s in specs])


class Indexes:
    """This rank's observation indexes, computed for a block of upcoming batches at a time.

    A permutation lookup is a few dozen numpy operations whatever the array's length, so looking
    up ~16k positions at once costs about what 16 do: a block of upcoming batches at a time costs
    a fraction of a microsecond a batch, where one lookup a window would cost microseconds.
    One thread at a time: a driver runs all of a flow's windows in one place.
    """

    #: The most positions a block holds (an order may ask for fewer: :attr:`Order.lookup_block`).
    BLOCK_POSITIONS = LOOKUP_BLOCK
    #: The first block's positions: the consumer waits for the first batch of a plan started
    #: again between steps (a new geometry), which may be replaced before it reads far. A few
    #: positions are looked up one by one (tens of microseconds, where a vectorised lookup's
    #: cycle-walking costs hundreds whatever the count); the blocks grow from this, x8 a fill
    #: (the second covers the first read-ahead of a loader that reads in the consumer's thread),
    #: to the full size.
    FIRST_BLOCK_POSITIONS = 8

    def __init__(self, plan: EpochPlan, order: Order) -> None:
        self._plan = plan
        self._order = order
        self._first = self._stop = 0  # steps held: [first, stop)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._values = np.zeros(0, dtype=np.int64)
        self._block = self.FIRST_BLOCK_POSITIONS

    def _fill(self, step: int) -> None:
        plan = self._plan
        block = min(self._block, self._order.lookup_block, self.BLOCK_POSITIONS)  # a mixture's is smaller
        self._block = min(8 * self._block, self.BLOCK_POSITIONS)
        stop = min(plan.steps_known(), step + max(1, block // plan.local_batch_size))
        positions, sizes = plan.positions(step, stop)
        self._values = self._order.take(positions)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])
        self._first, self._stop = step, stop

    def of(self, specs: Sequence[BatchSpec]) -> Indices:
        """Indexes of consecutive batches ``specs``, in order."""
        first, last = specs[0].step, specs[-1].step
        if not (self._first <= first and last < self._stop):
            self._fill(first)
            if last >= self._stop:  # a window longer than a block: compute it directly
                return self._order.take(_positions(specs))
        a = int(self._offsets[first - self._first])
        b = int(self._offsets[last + 1 - self._first])
        return self._values[a:b]


def max_window(
    plan: EpochPlan, sample_nbytes: int, window_bytes: int, max_batches: int = WINDOW_BATCHES
) -> int:
    """Batches per read-ahead window: up to ``max_batches`` (the storage's
    ``read_window_batches``) and the storage's byte budget."""
    nbytes = max(1, sample_nbytes * plan.local_batch_size)
    return max(1, min(max_batches, window_bytes // nbytes))


def windows(
    plan: EpochPlan,
    first_step: int,
    largest: int,
    window_end: Callable[[int], int] | None = None,
    *,
    counts: bool = True,
) -> Iterator[list[BatchSpec]]:
    """The epoch's read windows from ``first_step``, at most ``largest`` batches each.

    Without ``window_end``: 1, 2, 4, ... batches (a fast first batch), then ``largest`` each.
    With ``window_end`` (order position -> the end of the mixing window holding it, for a block
    shuffle): the first batch alone, then windows that end where a mixing window ends, so that
    one read holds all of a window's samples, which are whole contiguous blocks: a few large
    range requests, and no block fetched by two reads. A batch that straddles two mixing
    windows is read alone: a few samples of each, small ranges, where a large read would
    coalesce them into whole blocks of the next window, which its own read fetches again.
    A window longer than ``largest`` is read in equal parts (:func:`_part`).

    An epoch counted as it goes: where the next batch is not counted yet, an empty window (the
    caller counts, :func:`count_window`, before it asks for the next window); ``counts=False``
    stops there instead (a hint of the reads to come, which counts nothing).
    """
    step = first_step
    size = 1

    def known() -> int | None:
        """Batches known to exist from here; ``None`` at the end of the epoch."""
        total = plan.steps_known()
        if step < total:
            return total
        return None

    while True:
        total = known()
        if total is None:
            if plan.observations is not None or not counts:
                return
            yield []  # count the next window first
            continue
        if window_end is None:
            specs = plan.batches(step, step + size)
            size = min(largest, size * 2)
        elif step == first_step:
            specs = plan.batches(step, step + 1)
        else:
            g, offset = plan.global_batch_size, plan.start_offset
            inside = (window_end(offset + step * g) - offset) // g  # the first batch that ends past it
            specs = plan.batches(step, step + _part(min(max(inside, step + 1), total) - step, largest))
        step += len(specs)
        yield specs


def _part(left: int, largest: int) -> int:
    """The batches of the next read of a window with ``left`` batches to read, at most
    ``largest``: as many as the fewest equal parts of it take (their sizes differ by one at most).
    Each part touches nearly every block of the window, and the storage knows a part from a window
    read whole by the bytes it spans over those its samples take (about the number of parts); a
    part of nearly the whole window, cut by ``largest`` with a few batches left, spans little more
    than its samples, and the blocks it fetches are not held for the last part, which fetches
    the window again."""
    parts = -(-left // largest)
    return -(-left // parts)


def every(span: int) -> Callable[[int], int]:
    """Window ends at every multiple of ``span`` positions (an order without windows of its own)."""
    return lambda position: (position // span + 1) * span


def future_reads(plan: EpochPlan, order: Order, specs: Iterable[list[BatchSpec]]) -> Iterator[Indices]:
    """The indexes :func:`read_window` will read for each of the windows ``specs`` (those of
    :func:`windows`), in order, computed lazily: the hint a storage may prepare ahead by. It has
    its own :class:`Indexes`, so it can be consumed on another thread."""
    indexes = Indexes(plan, order)
    for window in specs:
        if window:
            yield indexes.of(window)


def _split(specs: list[BatchSpec], samples: Sequence[Any]) -> list[Delivery]:
    """One window's samples, cut into its batches (rows of one block stay rows of one block)."""
    if isinstance(samples, Rows):
        # each batch's rows, sliced and wrapped by map (no loop of Python statements: the hot
        # path of a stream epoch); an empty batch's Rows == [] holds
        ends = list(itertools.accumulate(spec.stop - spec.start for spec in specs))
        parts = map(samples.block.__getitem__, map(slice, [0, *ends], ends))
        return list(map(Delivery, specs, map(Rows, parts)))
    deliveries = []
    pos = 0
    for spec in specs:
        end = pos + spec.stop - spec.start
        deliveries.append(Delivery(spec, samples[pos:end]))
        pos = end
    return deliveries


def _is_about_the_data(exc: BaseException) -> bool:
    """Whether re-reading a failed window batch by batch can find the batch that caused ``exc``.

    ``SystemExit`` and ``KeyboardInterrupt`` are not (an exit or a Ctrl-C asked for during the
    read: a re-read would not raise it again, and it would be lost). A
    :class:`~guideloom.StorageError` (a :class:`~guideloom.RemoteReadError` included) says the
    store itself failed, after its own retries and within its own time budget: re-reading would
    only spend that budget again for every batch of the window (a silent server then took the
    window's length times the budget to report). Anything else may depend on the samples asked
    for (a damaged shard, a storage subclass's check, a short read), so it is localised.
    """
    return isinstance(exc, Exception) and not isinstance(exc, StorageError)


def read_window(specs: list[BatchSpec], indexes: Indexes, reader: str = "read_many") -> ReadWindow:
    """The read of one window of consecutive batches; returns their deliveries, in order.

    It yields the window's indexes once and is sent the samples (or the read's exception is
    thrown in). A failure about the data is localised: the window is requested again batch by
    batch, and the first batch that fails carries the error, with nothing after it requested. A
    failure of the store itself is delivered at the window's first batch without re-reading. It
    never raises for a failed read. ``reader`` names the read in the count check's message.
    """
    try:
        wanted = indexes.of(specs)
        samples = yield wanted
        assert samples is not None  # a read is sent its samples
        if len(samples) != len(wanted):
            raise RuntimeError(f"{reader} returned {len(samples)} samples for {len(wanted)} indexes")
    except DELIVERED_ERRORS as exc:
        if len(specs) == 1 or not _is_about_the_data(exc):
            return [Delivery(specs[0], error=exc)]
        out: list[Delivery] = []
        for spec in specs:  # localise the failure: it surfaces at the batch that fails
            out.extend((yield from read_window([spec], indexes, reader)))
            if out[-1].error is not None:
                break
        return out
    return _split(specs, samples)


def count_window(plan: EpochPlan, step: int) -> ReadWindow:
    """The "read" of an empty window (:func:`windows`): count the next window of ``plan``'s
    order; a failure of the count is delivered at batch ``step``, the next to read."""
    assert plan.counting is not None
    try:
        yield Count(plan.counting)
    except DELIVERED_ERRORS as exc:
        g, b = plan.global_batch_size, plan.local_batch_size
        base = plan.start_offset + step * g + plan.rank * b
        return [Delivery(BatchSpec(step, base, base + b, plan.start_offset + (step + 1) * g), error=exc)]
    return []


class _Run:
    """A schedule being driven: its pending request (None once it has ended) and its deliveries."""

    __slots__ = ("_schedule", "deliveries", "request")

    def __init__(self, schedule: ReadWindow) -> None:
        self._schedule = schedule
        self.request: Indices | Count | None = None
        self.deliveries: list[Delivery] = []
        self._step(schedule.send, None)  # send(None) starts a generator, as next() does

    def resume(self, samples: Sequence[Any] | None, error: BaseException | None) -> None:
        """Hand the pending request's outcome to the schedule."""
        if error is not None:
            self._step(self._schedule.throw, error)
        else:
            self._step(self._schedule.send, samples)

    def _step(self, how: Callable[[Any], Indices | Count], value: Any) -> None:
        try:
            self.request = how(value)
        except StopIteration as stop:
            self.request, self.deliveries = None, stop.value


def _call(
    read: Callable[[Indices], Sequence[Any]], request: Indices | Count
) -> tuple[Sequence[Any] | None, BaseException | None]:
    try:
        if isinstance(request, Count):
            request.counting.count_sync()
            return None, None
        return read(request), None
    except DELIVERED_ERRORS as exc:
        return None, exc


async def _acall(
    aread: Callable[[Indices], Awaitable[Sequence[Any]]], request: Indices | Count
) -> tuple[Sequence[Any] | None, BaseException | None]:
    try:
        if isinstance(request, Count):
            await request.counting.count()
            return None, None
        return await aread(request), None
    except DELIVERED_ERRORS as exc:
        return None, exc


def run_sync(schedule: ReadWindow, read: Callable[[Indices], Sequence[Any]]) -> list[Delivery]:
    """Run ``schedule`` to its end, each request read by the blocking ``read``."""
    run = _Run(schedule)
    while run.request is not None:
        run.resume(*_call(read, run.request))
    return run.deliveries


#: Runs a call elsewhere and awaits it: ``await off(fn, *args)`` is ``fn(*args)``.
Offload: TypeAlias = Callable[..., Awaitable[Any]]


async def run_async(
    schedule: ReadWindow,
    aread: Callable[[Indices], Awaitable[Sequence[Any]]],
    off: Offload | None = None,
) -> list[Delivery]:
    """:func:`run_sync` with each request read by the coroutine function ``aread``.

    ``off``: the schedule's own steps (the window's index lookup, its split into batches) run
    through it, not on the awaiting loop: for a window of thousands of batches they are
    milliseconds of Python work that every other task of the loop would wait for. The steps of
    one schedule run one at a time, in order.
    """
    run = _Run(schedule) if off is None else await off(_Run, schedule)
    while run.request is not None:
        outcome = await _acall(aread, run.request)
        if off is None:
            run.resume(*outcome)
        else:
            await off(run.resume, *outcome)
    return run.deliveries
