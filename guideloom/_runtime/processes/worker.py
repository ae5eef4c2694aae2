"""What runs in a worker process: it unpickles the dataset and ``collate_fn`` once, opens the
storage itself, then serves tasks: reads a group of consecutive batches as one window (or takes
the samples the main process read and sent), collates each, writes the group's arrays into one
slot and describes the batches in one message.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import mmap
import multiprocessing.connection
import os
import pickle
import random
import re
import select
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom._core.delivery import Delivery, apply
from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import Indexes, read_window, run_async, run_sync
from guideloom._process import one_core
from guideloom._runtime.processes.pack import GroupPack, unpack_samples
from guideloom._runtime.processes.shm import Slots, StateSegment, attach_state, map_segment, sweep
from guideloom._runtime.processes.wire import (
    End,
    Entry,
    Epoch,
    ErrorEntry,
    Failed,
    GroupDone,
    PickleEntry,
    Ready,
    Replan,
    Samples,
    Stop,
    Task,
    exception_message,
    send_message,
)

if TYPE_CHECKING:
    from guideloom._datasets import DatasetAbstract

__all__ = ["use_warning_filters", "warning_filters", "worker_main"]

#: Input segments a worker keeps mapped; the main process reuses a few per worker.
MAX_INPUTS = 16
#: What a worker's C heap keeps of the memory it freed at its top (glibc's ``M_TRIM_THRESHOLD``)
#: and the size from which an allocation is a mapping of its own (``M_MMAP_THRESHOLD``): a
#: task's batches are collated into the memory the last task's freed, not into pages given back
#: to the system and faulted in again. A worker keeps its task's batches until their slot is
#: written, so glibc's own thresholds (set by the last batch freed) gave back a task's worth each
#: time: measured at more than the collate itself for batches of 280 KB of token ids.
KEEP_FREED_BYTES = 32 << 20
OWN_MAPPING_BYTES = 16 << 20


#: A warning filter as :func:`warnings.filterwarnings` takes it: action, message and module
#: patterns, category, line.
Filter = tuple[str, str, type[Warning] | tuple[type[Warning], ...], str, int]


def warning_filters() -> list[bytes | None]:
    """This process's warning filters, each pickled on its own, to send to its workers (None in
    the place of one that does not pickle: a category defined in a function). A worker started
    from a process forked earlier (the standby zygote, the fork server) would otherwise warn, or
    not, or raise a warning as an error, by the filters of that earlier moment. Each on its own:
    one that a worker cannot use does not take the others with it (:func:`use_warning_filters`)."""
    return [_pickled(_filter(*f)) for f in warnings.filters]


def _filter(action: str, message: Any, category: Any, module: Any, lineno: int) -> Filter:
    """An entry of ``warnings.filters`` as ``filterwarnings`` takes it."""
    return (action, _pattern(message), category, _pattern(module), lineno)


def _pickled(one: Filter) -> bytes | None:
    try:
        return pickle.dumps(one, protocol=5)
    except Exception:
        return None


def _pattern(regex: re.Pattern[str] | str | None) -> str:
    """A filter's pattern as ``filterwarnings`` takes it: a plain string in a filter (the
    interpreter's own defaults) matches itself only."""
    if regex is None:
        return ""
    return re.escape(regex) + r"\Z" if isinstance(regex, str) else regex.pattern


def use_warning_filters(filters: list[bytes | None]) -> None:
    """In a worker: the filters of the process that started it (:func:`warning_filters`).

    One whose category cannot be imported here (a class under the main guard of the script that
    made the pool, or of a module made at run time) is left out: it matches no warning raised
    here, and it must not stop the worker. The filters that did not pickle take the places of
    this process's own that do not either, in order, where there are as many (a worker forked
    from the pool's process has the same); else they are left out too (a class defined in a
    function of another process is not one of this process's)."""
    own = [one for one in (_filter(*f) for f in warnings.filters) if _pickled(one) is None]
    mine = iter(own if len(own) == filters.count(None) else [])
    loaded: list[Filter] = []
    for pickled in filters:
        try:
            loaded.append(next(mine) if pickled is None else pickle.loads(pickled))
        except Exception:  # StopIteration included: an unpicklable one not kept
            continue
    warnings.resetwarnings()
    for action, message, category, module, lineno in loaded:
        warnings.filterwarnings(action, message, category, module, lineno, append=True)  # type: ignore[arg-type]


def keep_freed_heap() -> bool:
    """Set the worker's C heap to keep :data:`KEEP_FREED_BYTES` of freed memory for reuse
    (glibc's ``mallopt``; elsewhere nothing). Whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_trim_threshold, KEEP_FREED_BYTES)) and bool(
        mallopt(m_mmap_threshold, OWN_MAPPING_BYTES)
    )


class _Worker:
    """What runs in a worker process: read, collate, write into a slot, send."""

    def __init__(
        self,
        tasks: multiprocessing.connection.Connection,
        results: multiprocessing.connection.Connection,
        dataset: DatasetAbstract[Any],
        collate_fn: Callable[[Sequence[Any]], Any],
        slots: Slots,
    ) -> None:
        self.tasks, self.results = tasks, results
        self.dataset, self.collate_fn, self.slots = dataset, collate_fn, slots
        self.loop = asyncio.new_event_loop()
        self.epochs: dict[int, tuple[EpochPlan, Indexes, str]] = {}
        self.last: Epoch | None = None  # the last epoch sent: a re-plan starts again from it
        self.queue: deque[Task] = deque()
        self.stopping = False
        self.counted = _read_counts(dataset)
        #: Whether a message waits in the task pipe (checked between a task's batches).
        self.pending = _pending(tasks)
        self.inputs: dict[
            str, mmap.mmap
        ] = {}  # the main process's input segments, mapped  # the storage's reads when last reported

    def handle(self, msg: Task | Epoch | Replan | End | Stop) -> None:
        match msg:
            case Task():
                self.queue.append(msg)
            case Epoch(token, plan, order, reading):
                self.last = msg
                self.epochs = {token: (plan, Indexes(plan, order), reading)}  # earlier ones are over
            case Replan(token, batch, world, rank, drop_last, offset):
                last = self.last
                if last is None:
                    raise RuntimeError("guideloom bug: a re-plan reached a worker sent no epoch")
                plan = dataclasses.replace(
                    last.plan,
                    local_batch_size=batch,
                    world_size=world,
                    rank=rank,
                    drop_last=drop_last,
                    start_offset=offset,
                )
                self.epochs = {token: (plan, Indexes(plan, last.order), last.reading)}
            case End(token):
                self.epochs.pop(token, None)
            case Stop():
                self.stopping = True

    def _read(self, token: int, start: int, stop: int) -> list[Delivery]:
        """Steps ``[start, stop)`` as read (the read's failure at its batch, nothing after it)."""
        plan, indexes, reading = self.epochs[token]
        schedule = read_window(plan.batches(start, stop), indexes, reading)
        if self.dataset._reads_inline:
            return run_sync(schedule, self.dataset._read_many_sync)
        return self.loop.run_until_complete(run_async(schedule, self.dataset.read_many))

    def _steps(self, task: Task) -> list[Delivery]:
        if task.samples is None:
            return self._read(task.token, task.start, task.stop)
        specs = self.epochs[task.token][0].batches(task.start, task.stop)
        try:
            values = self._samples(task.samples)
        except Exception as exc:  # its segment gone (the iterator ended meanwhile): nobody waits
            return [Delivery(specs[0], error=exc)]
        return [Delivery(spec, v) for spec, v in zip(specs, values, strict=True)]

    def _samples(self, samples: Samples) -> list[Any]:
        """The samples the main process read for a group, their arrays views of its segment
        (each of the main process's input segments mapped once, and kept)."""
        if samples.segment is None:
            return unpack_samples(samples, None)
        mm = self.inputs.get(samples.segment)
        if mm is None:
            while len(self.inputs) >= MAX_INPUTS:  # the oldest: replaced by a larger one, or unused
                del self.inputs[next(iter(self.inputs))]
            mm = self.inputs[samples.segment] = map_segment(samples.segment, samples.size, create=False)
        return unpack_samples(samples, (ctypes.c_char * samples.size).from_buffer(mm))

    def _reads_since(self) -> tuple[int, int]:
        now = _read_counts(self.dataset)
        (r0, b0), self.counted = self.counted, now
        return now[0] - r0, now[1] - b0

    def drain(self, block: bool) -> None:
        if block and not self.queue:
            self.handle(self.tasks.recv())
        while self.pending():
            self.handle(self.tasks.recv())

    def serve(self) -> None:
        while True:
            # "stop" may have come in the middle of a group (its drain between batches): checked
            # before waiting for the next message, or the worker waits out the close's grace
            if not self.stopping:
                self.drain(block=True)
            if self.stopping:
                return
            if not self.queue:
                continue
            task = self.queue.popleft()
            token = task.token
            if token not in self.epochs:
                continue  # that iterator has ended
            t0 = time.perf_counter()
            deliveries = self._steps(task)
            read_s = (time.perf_counter() - t0) / max(
                1, task.stop - task.start
            )  # the main process's estimate
            collate_s = 0.0  # what the group's collates took: their cost inline, with read_s
            # One message and one slot for the group: a wake-up of the main process per group,
            # not per batch, and one slot to find and map.
            entries: list[Entry] = []
            pack = GroupPack()
            values: list[Any] = []  # kept until the slot is written: pickled whole without one
            deliveries.reverse()
            while deliveries:
                d = deliveries.pop()
                c0 = time.perf_counter()
                apply(d, self.collate_fn)
                collate_s += time.perf_counter() - c0
                if d.error is not None:
                    entries.append(ErrorEntry(d.spec.step, *exception_message(d.error)))
                    break
                entries.append(pack.entry(d.spec.step, d.value))
                values.append(d.value)
                del d
                if isinstance(entries[-1], ErrorEntry):
                    break
                if deliveries:
                    self.drain(block=False)
                    if self.stopping or token not in self.epochs:
                        break
            slot = self.place(pack, entries, values)
            slot_bytes = pack.size if slot is not None else 0
            del values
            work_s = read_s + collate_s / max(1, len(entries))
            reads = self._reads_since()
            done = GroupDone(token, task.gid, entries, slot, read_s, work_s, reads, slot_bytes)
            send_message(self.results, done)

    def place(self, pack: GroupPack, entries: list[Entry], values: list[Any]) -> tuple[int, str, int] | None:
        """Write the group's arrays into one free slot; the slot's ``(index, name, size)``, or
        None when nothing needs one (or every slot is held: then each batch is pickled whole)."""
        if not pack.arrays:
            return None
        taken = self.slots.take(pack.size)
        if taken is None:  # every slot held by the consumer: send the batches whole
            for k, v in enumerate(values):
                if not isinstance(entries[k], ErrorEntry):
                    entries[k] = PickleEntry(entries[k].step, pickle.dumps(v, protocol=5), in_slot=False)
            return None
        i, name, size, mm = taken
        pack.write(mm)
        return i, name, size


def one_thread_tokenizers() -> None:
    """In a worker, before it unpickles its collate: ``TOKENIZERS_PARALLELISM=false`` unless the
    variable is set (a value of the user's, inherited, is kept). The loader runs its workers side
    by side already, so each encodes its batch on its own thread, as torch's workers run torch on
    one: a thread pool of the tokenizer's own in each worker would put several threads on every
    core. Only here: the user's own processes are left as they are."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pending(conn: multiprocessing.connection.Connection) -> Callable[[], bool]:
    """Whether ``conn`` has a message (or its end) to read now: one ``poll`` object kept for the
    pipe (``Connection.poll`` builds a selector at each call: some 2 microseconds, paid between
    every two batches); ``Connection.poll`` where ``select.poll`` is missing."""
    make = getattr(select, "poll", None)
    if make is None:
        return conn.poll
    poller = make()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda: bool(poller.poll(0))


def _read_counts(dataset: DatasetAbstract[Any]) -> tuple[int, int]:
    """Requests and bytes the dataset's storage has read (zeros where it does not count)."""
    storage = dataset.storage
    counts = None if storage is None else storage.read_counts()
    return (0, 0) if counts is None else counts


def worker_main(
    tasks: multiprocessing.connection.Connection,
    results: multiprocessing.connection.Connection,
    spec: bytes,
    prefix: str,
    state: StateSegment | mmap.mmap,
    seed: int,
) -> None:
    """A worker process's entry point. ``seed`` seeds its ``random``, numpy and torch generators,
    as torch's workers are seeded: a random augmentation in a collate differs between workers
    (forked from one process, they would otherwise draw the same numbers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    keep_freed_heap()
    one_thread_tokenizers()
    one_core()  # beside the other workers: a read's work stays on this worker's core
    state_mm: mmap.mmap | None = None
    slots: Slots | None = None
    worker: _Worker | None = None
    try:
        try:
            state_mm = attach_state(state)
            slots = Slots(prefix, np.frombuffer(state_mm, np.uint8))
            dataset, collate_fn, filters = pickle.loads(spec)
            use_warning_filters(filters)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch = sys.modules.get("torch")
            if torch is not None:  # one thread each, as torch's own workers: no oversubscription,
                torch.set_num_threads(1)  # and no OpenMP pool inherited from a forked parent
                torch.manual_seed(seed)
            worker = _Worker(tasks, results, dataset, collate_fn, slots)
        except BaseException as exc:
            send_message(results, Failed(*exception_message(exc), at_open=False))
            return
        try:
            worker.loop.run_until_complete(dataset.open())
        except BaseException as exc:  # the storage's own error: the consumer gets it as it is
            send_message(results, Failed(*exception_message(exc), at_open=True))
            return
        send_message(results, Ready(os.getpid()))
        try:
            worker.serve()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # the main process went away
        finally:
            try:
                worker.loop.run_until_complete(worker.dataset.close())
            except Exception:
                pass
            worker.loop.close()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process went away while this worker started
    finally:
        if slots is not None:
            slots.close()
        # What the main process had not removed of this worker's segments yet (it removes each
        # once it has mapped it, or at close()): none is left however the main process ended.
        sweep(prefix)
