"""Process workers that read and collate their own batches (``parallel_method="process"``).

A :class:`WorkerPool` starts ``num_workers`` processes (the ``spawn`` start method) once per
loader: each unpickles the dataset and ``collate_fn`` once, opens the storage itself and then
serves *groups*: the main process sends a group's plan positions (an epoch's plan and order once
per iterator, then ``(first_step, stop_step)`` per group), the worker reads the group as one
window, collates each batch and sends the group back in one message. Arrays and tensors travel
through shared memory: the worker writes a whole group's into one of its *slots* (a POSIX
shared-memory segment that it reuses), one after the other, and describes each batch in the
message (a batch that is one array or tensor by its dtype, shape and offset; anything else by a
small pickle that names its arrays); the main process maps the slot once and rebuilds the arrays
as views of it, without a copy. A slot is free again when the last array built on it is freed:
the main process marks it in a state byte that the worker reads (no message), so a consumer that
keeps batches never blocks a worker, which makes another slot.

A sync ``for`` reads the results in the consumer's own thread (:class:`SyncRun`, a selector over
the workers' pipes); ``async for`` reads them on the pipeline's event loop (``add_reader``).
Either way a dead worker is seen at once (end of file on its pipe) and becomes a
:class:`~guideloom.WorkerError` at the first batch it owed. Slots are unlinked as soon as the
main process has mapped them, and every segment of a pool (its names carry the pool's token) is
swept from ``/dev/shm`` when a worker dies and when the pool closes, so nothing is left behind
after a close, a death or an exception.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import functools
import importlib
import io
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import selectors
import signal
import struct
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom._core.delivery import Delivery, apply
from guideloom._core.order import Order
from guideloom._core.plan import BatchSpec, EpochPlan
from guideloom._core.schedule import Indexes, read_window, run_async, run_sync
from guideloom._errors import WorkerError

if TYPE_CHECKING:
    from guideloom._datasets.base import DatasetAbstract
    from guideloom._runtime.channel import Channel

__all__ = [
    "SHM_PREFIX",
    "ProcessWorkers",
    "SHUTDOWN_GRACE_S",
    "RemoteTraceback",
    "Session",
    "SyncRun",
    "WorkerPool",
    "check_not_bootstrapping",
    "live_segments",
]

#: Every shared-memory segment guideloom makes starts with this (``/dev/shm/guideloom-...``).
SHM_PREFIX = "guideloom-"
#: How long ``close()`` waits for a worker to finish its batch before terminating it.
SHUTDOWN_GRACE_S = 5.0
#: Arrays smaller than this travel inside the pickle: a slot costs more than copying them.
_MIN_SHARED_BYTES = 4096
#: Slots per worker at most (one state byte each); past that, batches travel pickled.
_MAX_SLOTS = 4096
_ALIGN = 64

_shm: Any = importlib.import_module("_posixshmem") if os.name == "posix" else None


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (set as its ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def check_not_bootstrapping() -> None:
    """Refuse to start workers from a worker that is still importing the main module.

    Under ``spawn`` (and ``forkserver``) each worker imports the main script; one without the
    ``if __name__ == "__main__":`` guard would start the loader again in every worker.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "guideloom: a loader with parallel_method='process' was started while a worker process "
            "was still importing the main module. Worker processes are started with the 'spawn' "
            "method, which re-imports your script: put the code that creates and iterates the "
            'loader under `if __name__ == "__main__":` (or in a function called from there).'
        )


def live_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Names of the shared-memory segments in ``/dev/shm`` that start with ``prefix`` (Linux)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def _unlink(name: str) -> None:
    try:
        _shm.shm_unlink("/" + name)
    except (FileNotFoundError, OSError):
        pass


def _sweep(prefix: str) -> None:
    for name in live_segments(prefix):
        _unlink(name)


def _map_segment(name: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _shm.shm_open("/" + name, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


# -- the worker side ----------------------------------------------------------------------------------
class _Slots:
    """A worker's slots: shared-memory segments it writes batches into and reuses once free."""

    def __init__(self, prefix: str, state: np.ndarray) -> None:
        self.prefix = prefix
        self.state = state  # 0 free, 1 in use (the main process frees)
        self.slots: list[tuple[str, int, mmap.mmap]] = []
        self.gen = 0

    def take(self, nbytes: int) -> tuple[int, str, int, mmap.mmap] | None:
        n = len(self.slots)
        free = np.flatnonzero(self.state[:n] == 0).tolist()
        fits = [i for i in free if self.slots[i][1] >= nbytes]
        if fits:
            i = min(fits, key=lambda k: self.slots[k][1])
        elif free:
            i = free[0]
            self.slots[i][2].close()
            self.slots[i] = self._new(i, nbytes)
        elif n < _MAX_SLOTS:
            i = n
            self.slots.append(self._new(i, nbytes))
        else:
            return None
        self.state[i] = 1
        name, size, mm = self.slots[i]
        return i, name, size, mm

    def _new(self, i: int, nbytes: int) -> tuple[str, int, mmap.mmap]:
        size = 1 << max(16, (nbytes - 1).bit_length())  # power of two: a reused slot fits more
        self.gen += 1
        name = f"{self.prefix}{i}.{self.gen}"
        return name, size, _map_segment(name, size, create=True)

    def close(self) -> None:
        for name, _, mm in self.slots:
            mm.close()
            _unlink(name)  # the main process unlinks what it mapped; the rest goes here
        self.slots.clear()


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


def _shareable(obj: Any, torch: Any) -> tuple[str, str, tuple[int, ...], np.ndarray] | None:
    """``(kind, dtype, shape, bytes)`` of an array or tensor that travels through a slot; None
    for anything else (it is pickled)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.nbytes < _MIN_SHARED_BYTES:
            return None
        return "n", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            return None
        if t.nbytes < _MIN_SHARED_BYTES and _pickles(t.dtype):
            return None
        if t.requires_grad or t.is_conj() or t.is_neg():  # each op costs: only when needed
            t = t.detach().resolve_conj().resolve_neg()
        raw = t.reshape(-1).view(torch.uint8)  # reshape copies a non-contiguous tensor
        return "t", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw.numpy()
    return None


class _GroupPack:
    """A group's batches as they go into one slot: their arrays' bytes, laid out one after the
    other, and each batch's entry (a description of its arrays, or a pickle that names them)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []  # byte views of what goes into the slot, in order
        self.size = 0
        self.torch = sys.modules.get("torch")

    def add(self, kind: str, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> tuple[Any, ...]:
        offset = self.size
        self.size = offset + (raw.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.arrays.append(raw)
        return (kind, dtype, shape, offset, raw.nbytes)

    def entry(self, step: int, value: Any) -> tuple[Any, ...]:
        """One batch's entry: ``("a", step, pid)`` for a batch that is one array or tensor (no
        pickle either way), ``("b", step, pickle)`` for anything else."""
        torch = self.torch
        if type(value) is np.ndarray or (torch is not None and type(value) is torch.Tensor):
            shared = _shareable(value, torch)
            if shared is not None:
                return ("a", step, self.add(*shared))
        mark = len(self.arrays), self.size
        buf = io.BytesIO()
        try:
            _SharedPickler(buf, self).dump(value)
        except Exception as exc:
            del self.arrays[mark[0] :]
            self.size = mark[1]
            return ("e", step, *_exception_message(exc))
        return ("b", step, buf.getvalue())


class _SharedPickler(pickle.Pickler):
    """Pickles a batch with its large arrays and tensors left out, recorded in the group's pack."""

    def __init__(self, file: io.BytesIO, pack: _GroupPack) -> None:
        super().__init__(file, protocol=5)
        self.pack = pack
        self._seen: dict[int, tuple[Any, ...]] = {}

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


def _send(conn: multiprocessing.connection.Connection, msg: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=5))


def _exception_message(exc: BaseException) -> tuple[Any, ...]:
    tb = "".join(traceback.format_exception(exc))
    try:
        data = pickle.dumps(exc, protocol=5)
        pickle.loads(data)  # an exception that pickles but does not unpickle is sent as text
    except Exception:
        data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"), protocol=5)
    return data, tb


class _Worker:
    """What runs in a worker process: read, collate, write into a slot, send."""

    def __init__(
        self,
        tasks: multiprocessing.connection.Connection,
        results: multiprocessing.connection.Connection,
        dataset: DatasetAbstract[Any],
        collate_fn: Callable[[Sequence[Any]], Any],
        slots: _Slots,
    ) -> None:
        self.tasks, self.results = tasks, results
        self.dataset, self.collate_fn, self.slots = dataset, collate_fn, slots
        self.loop = asyncio.new_event_loop()
        self.epochs: dict[int, tuple[EpochPlan, Indexes, str]] = {}
        self.queue: deque[tuple[int, int, int, int]] = deque()  # token, gid, start, stop
        self.stopping = False

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "task":
            self.queue.append(msg[1:])
        elif kind == "epoch":
            _, token, plan, order, reading = msg
            self.epochs = {token: (plan, Indexes(plan, order), reading)}  # earlier ones are over
        elif kind == "end":
            self.epochs.pop(msg[1], None)
        elif kind == "stop":
            self.stopping = True

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
            token, gid, start, stop = self.queue.popleft()
            if token not in self.epochs:
                continue  # that iterator has ended
            plan, indexes, reading = self.epochs[token]
            specs = plan.batches(start, stop)
            t0 = time.perf_counter()
            if self.dataset.reads_inline:
                deliveries = run_sync(read_window(specs, indexes, reading), self.dataset.read_many_sync)
            else:
                deliveries = self.loop.run_until_complete(
                    run_async(read_window(specs, indexes, reading), self.dataset.read_many)
                )
            read_s = (time.perf_counter() - t0) / max(1, len(specs))  # the main process's estimate
            collate_s = 0.0  # what the group's collates took: their cost inline, with read_s
            # One message and one slot for the group: a wake-up of the main process per group,
            # not per batch, and one slot to find and map.
            entries: list[tuple[Any, ...]] = []
            pack = _GroupPack()
            values: list[Any] = []  # kept until the slot is written: pickled whole without one
            deliveries.reverse()
            while deliveries:
                d = deliveries.pop()
                c0 = time.perf_counter()
                apply(d, self.collate_fn)
                collate_s += time.perf_counter() - c0
                if d.error is not None:
                    entries.append(("e", d.spec.step, *_exception_message(d.error)))
                    break
                entries.append(pack.entry(d.spec.step, d.value))
                values.append(d.value)
                del d
                if entries[-1][0] == "e":
                    break
                if deliveries:
                    self.drain(block=False)
                    if self.stopping or token not in self.epochs:
                        break
            slot = self.place(pack, entries, values)
            del values
            work_s = read_s + collate_s / max(1, len(entries))
            _send(self.results, ("g", token, gid, entries, slot, read_s, work_s))

    def place(
        self, pack: _GroupPack, entries: list[tuple[Any, ...]], values: list[Any]
    ) -> tuple[int, str, int] | None:
        """Write the group's arrays into one free slot; the slot's ``(index, name, size)``, or
        None when nothing needs one (or every slot is held: then each batch is pickled whole)."""
        if not pack.arrays:
            return None
        taken = self.slots.take(pack.size)
        if taken is None:  # every slot held by the consumer: send the batches whole
            for k, v in enumerate(values):
                if entries[k][0] != "e":
                    entries[k] = ("p", entries[k][1], pickle.dumps(v, protocol=5))
            return None
        i, name, size, mm = taken
        view = np.frombuffer(mm, np.uint8, pack.size)
        offset = 0
        for raw in pack.arrays:
            view[offset : offset + raw.nbytes] = raw
            offset += (raw.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        del view
        return i, name, size


def _worker_main(
    tasks: multiprocessing.connection.Connection,
    results: multiprocessing.connection.Connection,
    spec: bytes,
    prefix: str,
    state_name: str,
) -> None:
    """A worker process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    state_mm: mmap.mmap | None = None
    slots: _Slots | None = None
    worker: _Worker | None = None
    try:
        try:
            state_mm = _map_segment(state_name, _MAX_SLOTS, create=False)
            slots = _Slots(prefix, np.frombuffer(state_mm, np.uint8))
            dataset, collate_fn = pickle.loads(spec)
            worker = _Worker(tasks, results, dataset, collate_fn, slots)
        except BaseException as exc:
            _send(results, ("fatal", *_exception_message(exc)))
            return
        try:
            worker.loop.run_until_complete(dataset.open())
        except BaseException as exc:  # the storage's own error: the consumer gets it as it is
            _send(results, ("open-failed", *_exception_message(exc)))
            return
        _send(results, ("ready", os.getpid()))
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


# -- the main process side ---------------------------------------------------------------------------
def _moving(average: float | None, value: float) -> float:
    """An exponential moving average of what the workers report, group by group."""
    return value if average is None else 0.8 * average + 0.2 * value


class _Proc:
    """One worker process, as the main process sees it."""

    def __init__(self, pool: WorkerPool, index: int, gen: int) -> None:
        self.index = index
        self.prefix = f"{pool.token}-{index}.{gen}-"
        state_name = f"{self.prefix}state"
        self.state_mm = _map_segment(state_name, _MAX_SLOTS, create=True)
        self.state = np.frombuffer(self.state_mm, np.uint8)
        ctx = multiprocessing.get_context("spawn")
        tasks_r, self.tasks = ctx.Pipe(duplex=False)
        self.results, results_w = ctx.Pipe(duplex=False)
        self.proc: BaseProcess = ctx.Process(
            target=_worker_main,
            args=(tasks_r, results_w, pool.spec, self.prefix, state_name),
            name=f"guideloom-worker-{index}",
            daemon=True,
        )
        self.state_name = state_name
        try:
            self.proc.start()
        finally:
            tasks_r.close()
            results_w.close()
        self.fd = self.results.fileno()
        #: The session whose loop reader is on this pipe now: a session that ends removes the
        #: reader only while it is still its own (a dropped ``async for``'s pipeline may finish
        #: after the next iterator's session has put its reader on the same pipe).
        self.reader: object | None = None
        self.send_lock = threading.Lock()
        self.cache: dict[int, tuple[str, mmap.mmap]] = {}
        self.buffer = bytearray()
        self.alive = True
        self.ready = False
        self.inflight = 0

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.tasks.send(msg)

    def describe_exit(self) -> str:
        code = self.proc.exitcode
        if code is None:
            return "its pipe closed"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def map_slot(self, i: int, name: str, size: int) -> mmap.mmap:
        cached = self.cache.get(i)
        if cached is not None and cached[0] == name:
            return cached[1]
        mm = _map_segment(name, size, create=False)
        _unlink(name)  # mapped on both sides: nothing in /dev/shm from here on
        self.cache[i] = (name, mm)
        return mm

    def read_frames(self) -> list[bytes] | None:
        """The complete messages available now; None at end of file (the worker is gone)."""
        chunks: list[bytes] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                if not chunks:
                    return None
                break
            chunks.append(data)
            if len(data) < 1 << 20:
                break
        buf = self.buffer
        for c in chunks:
            buf += c
        frames = []
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = struct.unpack_from("!i", buf, pos)
            head = 4
            if n == -1:
                if len(buf) - pos < 12:
                    break
                (n,) = struct.unpack_from("!Q", buf, pos + 4)
                head = 12
            if len(buf) - pos - head < n:
                break
            frames.append(bytes(buf[pos + head : pos + head + n]))
            pos += head + n
        del buf[:pos]
        return frames


def _release(state: np.ndarray, i: int) -> None:
    state[i] = 0


class _Rebuilder(pickle.Unpickler):
    """Unpickles a batch, its arrays and tensors views of the slot's ``holder``."""

    def __init__(self, data: bytes, holder: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.holder = holder
        self._made: dict[Any, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        made = self._made.get(pid)
        if made is None:  # an object the batch holds twice comes back as one object
            made = self._made[pid] = self._make(*pid)
        return made

    def _make(self, kind: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
        return _view(self.holder, kind, dtype, shape, offset, nbytes)


def _view(holder: Any, kind: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
    """The array (``kind`` ``"n"``) or tensor (``"t"``) at ``offset`` in a slot, a view of it."""
    if kind == "n":
        nd = np.dtype(dtype)
        return np.frombuffer(holder, nd, nbytes // nd.itemsize, offset).reshape(shape)
    import torch

    dt: Any = _NUMPY_OF.get(dtype, False)
    if dt is False:
        try:
            dt = _NUMPY_OF[dtype] = torch.empty(0, dtype=getattr(torch, dtype)).numpy().dtype
        except TypeError:  # bfloat16 and others numpy has no dtype for
            dt = _NUMPY_OF[dtype] = None
    if dt is not None:  # one view fewer: measured at half the cost a batch
        return torch.from_numpy(np.frombuffer(holder, dt, nbytes // dt.itemsize, offset).reshape(shape))
    raw = np.frombuffer(holder, np.uint8, nbytes, offset)
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


#: The numpy dtype of each torch dtype seen (None: numpy has none).
_NUMPY_OF: dict[str, Any] = {}


class _Group:
    """Consecutive batches one worker reads and collates; their deliveries arrive in order."""

    __slots__ = ("done", "gid", "proc", "received", "results", "specs", "waiter")

    def __init__(self, gid: int, specs: list[BatchSpec], proc: _Proc | None) -> None:
        self.gid = gid
        self.specs = specs
        self.proc = proc
        self.results: deque[Delivery] = deque()  # received, not yet emitted
        self.received = 0
        self.waiter: asyncio.Future[None] | None = None
        self.done = False  # nothing more will arrive

    def add(self, d: Delivery) -> None:
        self.received += 1
        self.results.append(d)
        if d.error is not None or d.spec.step == self.specs[-1].step:
            self.done = True
        self.wake()

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.add(Delivery(self.specs[self.received], error=exc))

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class WorkerPool:
    """``num_workers`` worker processes, started once and used by one iterator at a time."""

    def __init__(
        self, dataset: DatasetAbstract[Any], collate_fn: Callable[[Sequence[Any]], Any], num_workers: int
    ) -> None:
        if _shm is None:  # pragma: no cover - guideloom's process workers need POSIX shared memory
            raise RuntimeError("parallel_method='process' needs POSIX shared memory; use 'thread'")
        try:
            self.spec = pickle.dumps((dataset, collate_fn), protocol=5)
        except Exception as exc:
            raise TypeError(
                f"parallel_method='process' sends the dataset to each worker process, but "
                f"{dataset!r} could not be pickled: {exc}. Each worker opens the dataset and reads "
                "its own batches: use a storage that pickles (memory, local and object-store "
                "storages do), make your dataset picklable (no locks, open files or connections "
                "as attributes: open them in open()), or use parallel_method='thread'"
            ) from exc
        self.dataset, self.collate_fn, self.num_workers = dataset, collate_fn, num_workers
        self.token = f"{SHM_PREFIX}{secrets.token_hex(4)}"
        self.procs: list[_Proc | None] = [None] * num_workers
        self._gens = [0] * num_workers
        self._lock = threading.Lock()
        self._closed = False
        self._tokens = 0
        _POOLS.add(self)

    def matches(self, dataset: Any, collate_fn: Any, num_workers: int) -> bool:
        """Whether this pool serves that dataset and collate (a loader whose attributes changed
        gets a new pool)."""
        return (
            not self._closed
            and self.dataset is dataset
            and self.collate_fn is collate_fn
            and self.num_workers == num_workers
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start the workers that are not running (all at first, a dead one again) and wait until
        each has opened the storage. Blocking: seconds on a first start (``spawn``)."""
        check_not_bootstrapping()
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader's worker pool was closed")
            starting: list[_Proc] = []
            for k, p in enumerate(self.procs):
                if p is not None and p.alive and p.proc.is_alive():
                    continue
                if p is not None:
                    self._discard(p)
                self._gens[k] += 1
                p = self.procs[k] = _Proc(self, k, self._gens[k])
                starting.append(p)
            try:
                for p in starting:
                    self._wait_ready(p)
            except BaseException:
                for p in starting:
                    self._stop([p], 0.0)
                    self.procs[p.index] = None
                raise

    def _wait_ready(self, p: _Proc) -> None:
        try:
            msg: tuple[Any, ...] = pickle.loads(p.results.recv_bytes())
        except EOFError:
            msg = ("eof",)
        finally:
            _unlink(p.state_name)  # mapped by the worker by now, or it is gone
        if msg[0] == "ready":
            p.ready = True
            os.set_blocking(p.fd, False)
            return
        if msg[0] == "open-failed":  # the dataset's open() raised: its own exception, as inline
            exc = _load_exception(msg[1], msg[2])
            exc.add_note(f"raised by the dataset's open() in guideloom worker process {p.index}")
            raise exc
        if msg[0] == "fatal":
            exc = _load_exception(msg[1], msg[2])
            raise WorkerError(
                f"guideloom worker process {p.index} could not start: {type(exc).__name__}: {exc}"
            ) from exc
        p.proc.join(5.0)
        raise WorkerError(
            f"guideloom worker process {p.index} exited while starting ({p.describe_exit()}); "
            "see its error above. Worker processes are started with the 'spawn' method, which "
            "re-imports your main module: a script that creates and iterates the loader at "
            'module level must do so under `if __name__ == "__main__":`'
        )

    def session(self) -> Session:
        """A handle for one iterator's use of the workers."""
        self._tokens += 1
        return Session(self, self._tokens)

    def live(self) -> list[_Proc]:
        return [p for p in self.procs if p is not None and p.alive]

    def mark_dead(self, p: _Proc) -> None:
        """A worker's pipe closed: reap it and remove its segments (it may have died mid-write)."""
        p.alive = False
        p.proc.join(1.0)
        _sweep(p.prefix)

    def _discard(self, p: _Proc) -> None:
        p.alive = False
        p.proc.join(0.1)
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join()
        for c in (p.tasks, p.results):
            c.close()
        _sweep(p.prefix)

    def _stop(self, procs: list[_Proc], grace: float) -> None:
        for p in procs:
            try:
                p.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace
        for p in procs:
            p.proc.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.proc.is_alive():
                p.proc.terminate()  # a collate that does not return within the grace period
        for p in procs:
            p.proc.join(1.0)
            if p.proc.is_alive():
                p.proc.kill()
                p.proc.join()
        for p in procs:
            p.alive = False
            for c in (p.tasks, p.results):
                c.close()
            _sweep(p.prefix)

    def close(self, grace: float | None = None) -> None:
        """Stop every worker: each finishes its batch within ``grace`` seconds (default
        :data:`SHUTDOWN_GRACE_S`) or is terminated. Idempotent; removes every segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = [p for p in self.procs if p is not None]
            self.procs = [None] * self.num_workers
            try:
                self._stop(procs, SHUTDOWN_GRACE_S if grace is None else grace)
            finally:
                _sweep(self.token + "-")
                _POOLS.discard(self)


def _load_exception(data: bytes, tb: str) -> BaseException:
    exc: BaseException
    try:
        loaded = pickle.loads(data)
    except Exception as err:
        loaded = RuntimeError(f"an exception from a worker process could not be unpickled ({err})")
    exc = loaded if isinstance(loaded, BaseException) else RuntimeError(repr(loaded))
    exc.__cause__ = RemoteTraceback(tb)
    return exc


_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    """At interpreter exit: stop every pool's workers (a short grace) and remove its segments."""
    for pool in list(_POOLS):
        pool.close(grace=1.0)


class Session:
    """One iterator's use of a pool: it sends its epoch, then groups, and reads their batches."""

    def __init__(self, pool: WorkerPool, token: int) -> None:
        self.pool = pool
        self.token = token
        self.groups: dict[int, _Group] = {}
        self._gid = 0
        self._ended = False
        #: Seconds a batch's read takes in the workers (a moving average of what they report), or
        #: None before a group came back: what reading it inline would cost once pages are mapped.
        self.read_per_batch: float | None = None
        #: Seconds a batch's read and collate take in the workers (a moving average), or None
        #: before a group came back: about what making the batch inline would cost.
        self.work_per_batch: float | None = None

    def end(self) -> None:
        """Tell the workers to drop what is left of this iterator's groups. Idempotent."""
        if self._ended:
            return
        self._ended = True
        for p in self.pool.live():
            try:
                p.send(("end", self.token))
            except (OSError, ValueError):
                pass

    # -- reading results (on the loop) -----------------------------------------------------------
    def _on_readable(self, p: _Proc, loop: asyncio.AbstractEventLoop) -> None:
        if not self.receive(p):
            loop.remove_reader(p.fd)

    def receive(self, p: _Proc) -> bool:
        """Take in the messages that ``p``'s pipe holds now; False once the worker is gone (its
        groups then fail with a :class:`~guideloom.WorkerError` at the first batch each owed)."""
        frames = p.read_frames()
        if frames is None:
            self.pool.mark_dead(p)
            for g in self.groups.values():
                if g.proc is p and not g.done:  # a done group has all it owed
                    g.fail(
                        WorkerError(
                            f"guideloom worker process {p.index} (pid {p.proc.pid}) died "
                            f"({p.describe_exit()}) while reading or collating batch "
                            f"{g.specs[g.received].step}"
                        )
                    )
            return False
        for frame in frames:
            self._on_message(p, pickle.loads(frame))
        return True

    def _on_message(self, p: _Proc, msg: tuple[Any, ...]) -> None:
        _, token, gid, entries, slot, read_s, work_s = msg
        self.read_per_batch = _moving(self.read_per_batch, read_s)
        self.work_per_batch = _moving(self.work_per_batch, work_s)
        g = self.groups.get(gid) if token == self.token else None
        holder: Any = None
        if slot is not None:
            i, name, size = slot
            mm = p.map_slot(i, name, size)
            holder = (ctypes.c_char * size).from_buffer(mm)  # the group's arrays are views of it
            weakref.finalize(holder, _release, p.state, i)  # freed with the group's last array
        if g is None or g.done:
            return  # an ended iterator's batches: dropping them frees their slot
        for entry in entries:
            kind, step = entry[0], entry[1]
            spec = g.specs[g.received]
            assert spec.step == step, (spec, step)
            if kind == "e":
                g.add(Delivery(spec, error=_load_exception(entry[2], entry[3])))
                continue
            try:
                if kind == "a":
                    value = _view(holder, *entry[2])
                elif kind == "p":
                    value = pickle.loads(entry[2])
                else:
                    value = _Rebuilder(entry[2], holder).load()
            except Exception as exc:
                g.add(Delivery(spec, error=exc))
            else:
                g.add(Delivery(spec, value))
        if g is not None and not g.done:
            g.fail(RuntimeError(f"guideloom bug: a worker returned {g.received} of {len(g.specs)} batches"))
        if g is not None and g.proc is not None:
            g.proc.inflight -= 1

    # -- the stage ----------------------------------------------------------------------------------
    def _submit(self, specs: list[BatchSpec]) -> _Group:
        self._gid += 1
        live = [p for p in self.pool.live() if p.proc.is_alive()]
        if not live:
            g = _Group(self._gid, specs, None)
            g.fail(WorkerError("every guideloom worker process has died"))
            return g
        p = min(live, key=lambda q: q.inflight)
        g = self.groups[self._gid] = _Group(self._gid, specs, p)
        try:
            p.send(("task", self.token, g.gid, specs[0].step, specs[-1].step + 1))
        except (OSError, ValueError) as exc:
            g.fail(WorkerError(f"guideloom worker process {p.index} died: {exc}"))
            return g
        p.inflight += 1
        return g

    async def run(
        self,
        plan: EpochPlan,
        order: Order,
        reading: str,
        first_step: int,
        group: int,
        emit: Callable[[Delivery], Any],
        channel: Channel[Delivery],
    ) -> None:
        """Run the epoch from ``first_step`` on the workers; emit each batch in plan order, and a
        failure at its batch, after which nothing more is emitted."""
        pool = self.pool
        await asyncio.to_thread(pool.start)
        loop = asyncio.get_running_loop()
        registered: list[_Proc] = []
        pending: deque[_Group] = deque()
        try:
            for p in pool.live():
                p.send(("epoch", self.token, plan, order, reading))
                loop.add_reader(p.fd, self._on_readable, p, loop)
                p.reader = self
                registered.append(p)
            room = asyncio.Semaphore(2 * pool.num_workers)  # groups in flight: one queued per worker
            submitted = asyncio.Event()
            total = len(plan)

            async def submit() -> None:
                """Send a group as soon as credits allow (not only when a result arrives: a
                worker that waits for its next group is a worker lost)."""
                step = first_step
                try:
                    while step < total:
                        await room.acquire()
                        await channel.reserve()
                        got, n = 1, min(group, total - step)
                        while got < n and channel.try_reserve():
                            got += 1
                        pending.append(self._submit(plan.batches(step, step + got)))
                        step += got
                        submitted.set()
                except Exception as exc:  # a bug: reported at the batch it stopped before
                    failed = _Group(0, plan.batches(step, step + 1), None)
                    failed.fail(exc)
                    pending.append(failed)
                    submitted.set()

            submitter = loop.create_task(submit(), name="guideloom-submit")
            try:
                for _ in range(first_step, total):
                    while not pending:
                        submitted.clear()
                        await submitted.wait()
                    g = pending[0]
                    while not g.results:
                        g.waiter = loop.create_future()
                        try:
                            await g.waiter
                        finally:
                            g.waiter = None
                    d = g.results.popleft()
                    failed = d.error is not None
                    await emit(d)
                    del d
                    if failed:
                        return
                    if g.done and not g.results:
                        pending.popleft()
                        self.groups.pop(g.gid, None)
                        room.release()
            finally:
                submitter.cancel()
                await asyncio.gather(submitter, return_exceptions=True)
        finally:
            for p in registered:
                if p.reader is not self:  # a later session reads this pipe now: not ours to remove
                    continue
                p.reader = None
                try:
                    loop.remove_reader(p.fd)
                except (OSError, ValueError):
                    pass
            for g in pending:
                if not g.done and g.proc is not None:
                    g.proc.inflight -= 1
            self.groups.clear()
            self.end()


class ProcessWorkers(concurrent.futures.Executor):
    """An iterator's handle on process workers, joined as the iterators join an executor.

    ``owned`` pools (``persistent_workers=False``) are closed with the iterator; a loader's
    persistent pool only forgets the iterator's groups.
    """

    def __init__(self, pool: WorkerPool, owned: bool) -> None:
        self.pool = pool
        self.owned = owned
        self.session = pool.session()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        raise NotImplementedError("process workers read and collate whole groups; see Session.run")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.session.end()
        if self.owned:
            if wait:
                self.pool.close()
            else:  # on the pipeline's own loop thread: do not wait there for the workers
                threading.Thread(target=self.pool.close, name="guideloom-workers-close", daemon=True).start()


class SyncRun:
    """One epoch of a sync ``for`` over process workers, driven from the consumer's thread.

    No event loop stands in between: :meth:`next` sends groups while credits allow (at most
    ``capacity`` batches ahead of the consumer, plus the one asked for, as with the channel's
    credits), waits on the workers' pipes with a selector when the next batch has not arrived,
    and hands the batch out. One message arrives per group, so the main process wakes once per
    group, not per batch, and no batch crosses a thread or an asyncio future on its way.
    """

    #: How often a blocked :meth:`next` looks whether :meth:`close` ran in another thread.
    POLL_S = 0.1

    def __init__(
        self,
        session: Session,
        plan: EpochPlan,
        order: Order,
        reading: str,
        first_step: int,
        group: int,
        capacity: int,
    ) -> None:
        self.session = session
        self.plan, self.order, self.reading = plan, order, reading
        self.step = first_step  # the next step to send
        self.total = len(plan)
        self.group = max(1, group)
        self.limit = capacity + 1
        self.ahead = 0  # batches sent and not yet handed out
        self.pending: deque[_Group] = deque()
        self.selector: selectors.BaseSelector | None = None
        self.started = False
        self.closed = False
        self.paused = False  # no new groups are sent (the collate runs inline meanwhile)

    def resume(self, step: int | None = None) -> None:
        """Send groups again, from ``step`` when given (the batches before it were made inline)."""
        self.paused = False
        if step is not None:
            self.step = step

    def _start(self) -> None:
        pool = self.session.pool
        pool.start()
        self.selector = selectors.DefaultSelector()
        for p in pool.live():
            p.send(("epoch", self.session.token, self.plan, self.order, self.reading))
            self.selector.register(p.fd, selectors.EVENT_READ, p)

    def _fill(self) -> None:
        """Send groups while credits allow; a group waits for a full group's credits unless
        nothing else is in flight (a worker waiting for its next group is a worker lost)."""
        most = 2 * self.session.pool.num_workers  # groups in flight: one queued per worker
        while not self.paused and self.step < self.total and len(self.pending) < most:
            n = min(self.group, self.total - self.step, self.limit - self.ahead)
            if n <= 0 or (n < self.group and n < self.total - self.step and self.pending):
                return
            self.pending.append(self.session._submit(self.plan.batches(self.step, self.step + n)))
            self.step += n
            self.ahead += n

    def _wait(self) -> None:
        """Block until a worker's pipe has something (or :data:`POLL_S`), and take it in."""
        selector = self.selector
        if selector is None:
            return
        try:
            events = selector.select(self.POLL_S)
        except (OSError, ValueError):  # closed by close() in another thread
            return
        for key, _ in events:
            p: _Proc = key.data
            if not self.session.receive(p):
                selector.unregister(p.fd)

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end of the
        epoch, after a failure was handed out, or once :meth:`close` ran."""
        if self.closed:
            return None
        if not self.started:
            self.started = True
            try:
                self._start()
            except Exception as exc:  # reported at the first batch, as the loop's pipeline does
                self.closed = True
                spec = self.plan.batch(self.step) if self.step < self.total else BatchSpec(self.step, 0, 0, 0)
                return Delivery(spec, error=exc)
        self._fill()
        if not self.pending:
            return None
        g = self.pending[0]
        while not g.results:
            if self._closed_meanwhile():
                return None
            self._wait()
        d = g.results.popleft()
        self.ahead -= 1
        if g.done and not g.results:
            self.pending.popleft()
            self.session.groups.pop(g.gid, None)
        if d.error is not None:
            self.close()
        else:
            self._fill()  # the credit is back: the workers need not wait for the next call
        return d

    def _closed_meanwhile(self) -> bool:
        """Whether :meth:`close` ran, in another thread, while this one waited."""
        return self.closed

    def close(self) -> None:
        """Send nothing more and tell the workers to drop this iterator's groups. Idempotent."""
        if self.closed and self.selector is None:
            return
        self.closed = True
        for g in self.pending:
            if not g.done and g.proc is not None:
                g.proc.inflight -= 1
        self.pending.clear()
        self.session.groups.clear()
        self.session.end()
        selector, self.selector = self.selector, None
        if selector is not None:
            selector.close()
