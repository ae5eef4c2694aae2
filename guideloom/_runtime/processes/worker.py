"""What runs in a worker process: it unpickles the dataset and ``collate_fn`` once, opens the
storage itself, then serves tasks: reads a group of consecutive batches as one window, collates
each, writes the group's arrays into one slot and describes the batches in one message.
"""

from __future__ import annotations

import asyncio
import functools
import io
import mmap
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom._core.delivery import Delivery, apply
from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import Indexes, read_window, run_async, run_sync
from guideloom._runtime.processes.shm import (
    ALIGN,
    MAX_SLOTS,
    MIN_SHARED_BYTES,
    SharedArray,
    SharedArrayFull,
    Slots,
    map_segment,
)
from guideloom._runtime.processes.wire import (
    ArrayEntry,
    End,
    Entry,
    Epoch,
    ErrorEntry,
    Failed,
    GroupDone,
    PickleEntry,
    ReadAhead,
    Ready,
    Stop,
    Task,
    exception_message,
    send_message,
)

if TYPE_CHECKING:
    from guideloom._datasets import DatasetAbstract

__all__ = ["worker_main"]


@functools.cache
def _pickles(dtype: Any) -> bool:
    """Whether a tensor of ``dtype`` survives a pickle round trip (torch 2.13 cannot load back the
    uint16, uint32 and uint64 tensors it pickles): small tensors of the others travel in the
    pickle, these through a slot whatever their size."""
    import torch

    try:
        pickle.loads(pickle.dumps(torch.zeros(1, dtype=dtype)))
    except Exception:
        return False
    return True


#: What :meth:`GroupPack.add` takes: ``(kind, dtype, shape, bytes, strides, grad, cls)``, the
#: fields of a :class:`SharedArrayFull` with the bytes in place of where they will lie.
Shareable = tuple[str, Any, tuple[int, ...], np.ndarray, tuple[int, ...] | None, bool, type | None]


def _shareable(obj: Any, torch: Any) -> Shareable | None:
    """What :meth:`GroupPack.add` takes for an array or tensor that travels through a slot; None
    for anything else (it is pickled).

    A dense layout (C order, or any permutation of it: transposed, Fortran order, channels_last;
    numpy's reversed axes too) travels as the bytes of its span in memory order with its strides,
    and comes back with them; any other (overlapping, broadcast, a view of a larger
    buffer with gaps) as a contiguous copy. A tensor keeps ``requires_grad`` and its class (the
    ``torch.nn.Parameter`` of a module, a plain subclass); a tensor with attributes set on it or
    a subclass with a ``__torch_dispatch__`` of its own, and an ndarray subclass other than
    ``np.memmap`` (a masked array, a recarray), is left to its own pickling, which keeps them."""
    if type(obj) is np.ndarray or type(obj) is np.memmap:
        return _array(obj)
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor(obj, torch)
    return None


def _array(a: np.ndarray) -> Shareable | None:
    dt = a.dtype
    if dt.hasobject or a.nbytes < MIN_SHARED_BYTES:
        return None
    name = dt.str if dt.names is None else dt  # dtype.str drops a structured dtype's fields
    shape = a.shape
    strides = None
    if a.flags.c_contiguous:
        if 1 in shape and a.strides != _c_strides(shape, dt.itemsize):
            strides = a.strides  # the strides of its axes of length 1, which C order ignores
        raw = a.reshape(-1)
    elif _dense(shape, a.strides, dt.itemsize):
        strides = a.strides
        if min(strides) < 0:  # the same span with every axis forwards: its bytes in memory order
            a = a[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)]
        raw = a.ravel(order="K")  # a view: the elements in memory order
    else:
        raw = np.ascontiguousarray(a).reshape(-1)
    return "n", name, shape, raw.view(np.uint8), strides, False, None


def _tensor(t: Any, torch: Any) -> Shareable | None:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    if t.nbytes < MIN_SHARED_BYTES and _pickles(t.dtype):
        return None
    cls: Any = type(t)
    plain = cls is torch.Tensor
    own = t.__dict__ or (not plain and cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__)
    if own and _pickles(t.dtype):
        return None  # its own pickling keeps what it is: its attributes, its dispatch
    if plain:
        cls = None
    else:
        t = t.as_subclass(torch.Tensor)  # the same tensor, plain
    grad = t.requires_grad
    if grad or t.is_conj() or t.is_neg():  # each op costs: only when needed
        t = t.detach().resolve_conj().resolve_neg()
    shape = tuple(t.shape)
    strides = None
    if t.is_contiguous():
        if 1 in shape and t.stride() != _c_strides(shape, 1):
            strides = t.stride()  # the strides of its axes of length 1, which C order ignores
        raw = t.reshape(-1)
    elif _dense(shape, t.stride(), 1):
        strides = t.stride()
        raw = t.as_strided((t.numel(),), (1,))  # its span, in memory order (strides are >= 0)
    else:
        raw = t.contiguous().view(-1)  # a copy: reshape(-1) may be a view with a step
    dtype = _TORCH_NAMES.get(t.dtype)
    if dtype is None:
        dtype = _TORCH_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    return "t", dtype, shape, raw.view(torch.uint8).numpy(), strides, grad, cls


#: The name of each torch dtype seen (``"float32"``), as the main process looks it up.
_TORCH_NAMES: dict[Any, str] = {}


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-contiguous array of ``shape`` (in units of ``itemsize``)."""
    out = []
    step = itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _dense(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether ``strides`` lay the elements of ``shape`` out without gaps or overlaps: a
    permutation of C order, each axis forwards or backwards (axes of length 1 ignored)."""
    step = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n != 1):
        if n == 0:
            return True  # no elements
        if stride != step:
            return False
        step *= n
    return True


class GroupPack:
    """A group's batches as they go into one slot: their arrays' bytes, laid out one after the
    other, and each batch's entry (a description of its arrays, or a pickle that names them)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []  # byte views of what goes into the slot, in order
        self.size = 0
        self.torch = sys.modules.get("torch")

    def add(
        self,
        kind: str,
        dtype: Any,
        shape: tuple[int, ...],
        raw: np.ndarray,
        strides: tuple[int, ...] | None,
        grad: bool,
        cls: type | None,
    ) -> SharedArray | SharedArrayFull:
        offset = self.size
        self.size = offset + (raw.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.arrays.append(raw)
        if strides is None and not grad and cls is None:
            return SharedArray(kind, dtype, shape, offset, raw.nbytes)
        return SharedArrayFull(kind, dtype, shape, offset, raw.nbytes, strides, grad, cls)

    def entry(self, step: int, value: Any) -> Entry:
        """One batch's entry: an :class:`ArrayEntry` for a batch that is one array or tensor (no
        pickle either way), a :class:`PickleEntry` that names its arrays in the slot otherwise."""
        torch = self.torch
        if type(value) is np.ndarray or (torch is not None and type(value) is torch.Tensor):
            shared = _shareable(value, torch)
            if shared is not None:
                return ArrayEntry(step, self.add(*shared))
        mark = len(self.arrays), self.size
        buf = io.BytesIO()
        try:
            _SharedPickler(buf, self).dump(value)
        except Exception as exc:
            del self.arrays[mark[0] :]
            self.size = mark[1]
            return ErrorEntry(step, *exception_message(exc))
        return PickleEntry(step, buf.getvalue(), in_slot=True)


class _SharedPickler(pickle.Pickler):
    """Pickles a batch with its large arrays and tensors left out, recorded in the group's pack."""

    def __init__(self, file: io.BytesIO, pack: GroupPack) -> None:
        super().__init__(file, protocol=5)
        self.pack = pack
        self._seen: dict[int, SharedArray | SharedArrayFull] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:  # the pids' own parts, and most of what a batch holds
            return None
        pid = self._seen.get(id(obj))
        if pid is not None:
            return pid
        shared = _shareable(obj, self.pack.torch)
        if shared is None:
            return None
        pid = self._seen[id(obj)] = self.pack.add(*shared)
        return pid


_PLAIN = frozenset({int, float, str, bytes, bool, tuple, list, dict, type(None)})


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
        self.queue: deque[Task | ReadAhead] = deque()
        self.stopping = False
        #: Read windows held, by (token, start, stop): each step's delivery, taken out by its group.
        self.windows: dict[tuple[int, int, int], dict[int, Delivery]] = {}
        self.counted = _read_counts(dataset)  # the storage's reads when last reported

    def handle(self, msg: Task | ReadAhead | Epoch | End | Stop) -> None:
        match msg:
            case Task() | ReadAhead():
                self.queue.append(msg)
            case Epoch(token, plan, order, reading):
                self.epochs = {token: (plan, Indexes(plan, order), reading)}  # earlier ones are over
                self.windows.clear()
            case End(token):
                self.epochs.pop(token, None)
                self.windows.clear()
            case Stop():
                self.stopping = True

    def _read(self, token: int, start: int, stop: int) -> list[Delivery]:
        """Steps ``[start, stop)`` as read (the read's failure at its batch, nothing after it)."""
        plan, indexes, reading = self.epochs[token]
        schedule = read_window(plan.batches(start, stop), indexes, reading)
        if self.dataset.reads_inline:
            return run_sync(schedule, self.dataset.read_many_sync)
        return self.loop.run_until_complete(run_async(schedule, self.dataset.read_many))

    def _window(self, token: int, start: int, stop: int) -> dict[int, Delivery]:
        """The window ``[start, stop)``, read whole once; at most two are held (the one being
        served and the one read ahead)."""
        key = (token, start, stop)
        held = self.windows.get(key)
        if held is None:
            while len(self.windows) >= 2:
                del self.windows[next(iter(self.windows))]
            held = self.windows[key] = {d.spec.step: d for d in self._read(token, start, stop)}
        return held

    def _steps(self, task: Task) -> list[Delivery]:
        if task.window is None:
            return self._read(task.token, task.start, task.stop)
        held = self._window(task.token, *task.window)
        out = [held.pop(s) for s in range(task.start, task.stop) if s in held]
        if not held or task.stop >= task.window[1]:
            self.windows.pop((task.token, *task.window), None)
        return out

    def _reads_since(self) -> tuple[int, int]:
        now = _read_counts(self.dataset)
        (r0, b0), self.counted = self.counted, now
        return now[0] - r0, now[1] - b0

    def drain(self, block: bool) -> None:
        if block and not self.queue:
            self.handle(self.tasks.recv())
        while self.tasks.poll():
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
            if isinstance(task, ReadAhead):
                self._window(token, task.start, task.stop)
                continue
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
            del values
            work_s = read_s + collate_s / max(1, len(entries))
            reads = self._reads_since()
            send_message(self.results, GroupDone(token, task.gid, entries, slot, read_s, work_s, reads))

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
        view = np.frombuffer(mm, np.uint8, pack.size)
        offset = 0
        for raw in pack.arrays:
            view[offset : offset + raw.nbytes] = raw
            offset += (raw.nbytes + ALIGN - 1) // ALIGN * ALIGN
        del view
        return i, name, size


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
    state_name: str,
) -> None:
    """A worker process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    state_mm: mmap.mmap | None = None
    slots: Slots | None = None
    worker: _Worker | None = None
    try:
        try:
            state_mm = map_segment(state_name, MAX_SLOTS, create=False)
            slots = Slots(prefix, np.frombuffer(state_mm, np.uint8))
            dataset, collate_fn = pickle.loads(spec)
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
    finally:
        if slots is not None:
            slots.close()
