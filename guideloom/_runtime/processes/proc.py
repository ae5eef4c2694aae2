"""Each worker process as the main process sees it (:class:`Proc`: its pipes, its state
segment, its result slots mapped), and a group of consecutive batches sent to one
(:class:`Group`: its deliveries, in order, as they come back).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import pickle
import select
import signal
import struct
import threading
from collections import deque
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Protocol

import numpy as np

from guideloom._core.delivery import Delivery
from guideloom._core.plan import BatchSpec
from guideloom._runtime.processes.shm import MAX_SLOTS, Inputs, StateSegment, map_segment, unlink
from guideloom._runtime.processes.wire import End, Epoch, EpochMessages, Stop, Task
from guideloom._runtime.processes.worker import worker_main

__all__ = ["TERMINATE_S", "Group", "PoolSide", "Proc"]

#: How long ``close()`` waits for a worker to end after SIGTERM, then after SIGKILL: every wait of
#: a close is bounded, whatever a worker or the fork server does (a stopped process, a deadlock).
TERMINATE_S = 1.0


class PoolSide(Protocol):
    """What a worker takes from its pool when it starts (a
    :class:`~guideloom._runtime.processes.pool.WorkerPool`)."""

    @property
    def token(self) -> str: ...
    @property
    def spec(self) -> bytes: ...
    @property
    def ctx(self) -> ForkServerContext | SpawnContext | ForkContext: ...
    def worker_seed(self, index: int, gen: int) -> int: ...


class Proc:
    """One worker process, as the main process sees it."""

    def __init__(self, pool: PoolSide, index: int, gen: int) -> None:
        """Start the worker (blocking while the fork server starts, once a process)."""
        self.index = index
        self.prefix = f"{pool.token}-{index}.{gen}-"
        self.state_segment = StateSegment(f"{self.prefix}state", MAX_SLOTS)
        self.state = np.frombuffer(self.state_segment.mm, np.uint8)
        ctx = pool.ctx
        tasks_r, self.tasks = ctx.Pipe(duplex=False)
        self.results, results_w = ctx.Pipe(duplex=False)
        self.proc: BaseProcess = ctx.Process(
            target=worker_main,
            args=(
                tasks_r,
                results_w,
                pool.spec,
                self.prefix,
                self.state_segment,
                pool.worker_seed(index, gen),
            ),
            name=f"guideloom-worker-{index}",
            daemon=True,
        )
        try:
            self.proc.start()
        finally:
            tasks_r.close()
            results_w.close()
            self.state_segment.started()
        self.fd = self.results.fileno()
        #: The session whose loop reader is on this pipe now: a session that ends removes the
        #: reader only while it is still its own (a dropped ``async for``'s pipeline may finish
        #: after the next iterator's session has put its reader on the same pipe).
        self.reader: object | None = None
        self.send_lock = threading.Lock()
        self.cache: dict[int, tuple[str, mmap.mmap]] = {}
        self.inputs = Inputs(self.prefix)  # the segments its samples are sent in
        self.buffer = bytearray()
        self.alive = True
        self.ready = False
        self.inflight = 0
        self._watch: select.poll | None = None  # polls the process's sentinel (running())
        #: The last :class:`Epoch` sent to the worker (a
        #: :class:`~guideloom._runtime.processes.wire.Replan` starts again from it).
        self.epoch: Epoch | None = None

    def running(self) -> bool:
        """Whether the worker process has not ended, as ``Process.is_alive`` tells, which builds
        a selector at every call (some ten microseconds a task sent): its sentinel is polled
        first, by a poll object made once, and ``is_alive`` asked only once that is readable."""
        watch = self._watch
        if watch is None:
            try:
                watch = select.poll()
                watch.register(self.proc.sentinel, select.POLLIN)
            except (OSError, ValueError):  # no sentinel to watch: ask every time
                return self.proc.is_alive()
            self._watch = watch
        return not watch.poll(0) or self.proc.is_alive()

    def send(self, msg: Task | End | Stop) -> None:
        """Send a message of plain fields, pickled by ``pickle`` (a ``Connection.send`` pickles
        with multiprocessing's ``ForkingPickler``, whose dispatch table, torch's reducers
        included, is copied for every message: 25 microseconds where ``pickle.dumps`` takes 1)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.tasks.send_bytes(data)

    def send_epoch(self, messages: EpochMessages) -> None:
        """Send the epoch of ``messages``, as a :class:`~guideloom._runtime.processes.wire.Replan`
        where the worker's last epoch had its order and reading (each form pickled once for all
        workers)."""
        epoch = messages.epoch
        with self.send_lock:  # what the worker was sent last is known, in the pipe's order
            last = self.epoch
            replan = (
                last is not None
                and last.order is epoch.order
                and last.plan.order is epoch.plan.order
                and last.reading == epoch.reading
            )
            self.tasks.send_bytes(messages.pickled(replan))
            self.epoch = epoch

    def post(self, msg: End | Stop) -> bool:
        """Send a short message without ever blocking (a close must not wait on the pipe of a
        stopped worker, full, or held by a send that waits on it); False if it could not go.
        A message shorter than ``PIPE_BUF`` is written whole or not at all."""
        if not self.send_lock.acquire(timeout=0.1):
            return False
        try:
            fd = self.tasks.fileno()
            os.set_blocking(fd, False)
            try:
                self.tasks.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            finally:
                os.set_blocking(fd, True)
            return True
        except (OSError, ValueError):  # full (BlockingIOError), the worker gone, or closed
            return False
        finally:
            self.send_lock.release()

    def gone(self) -> bool:
        """Whether the worker has ended: its exit status is known, or it is a zombie or no
        process at all (a stopped fork server neither reaps its workers nor reports them)."""
        if self.proc.exitcode is not None:
            return True
        pid = self.proc.pid
        if pid is None:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except FileNotFoundError:
            return os.path.isdir("/proc/self")  # no such process (where /proc tells)
        except OSError:
            return False
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")

    def describe_exit(self) -> str:
        code = self.proc.exitcode
        if code is None and self.gone():
            self.proc.join(TERMINATE_S)  # ended, its status not collected yet: collect it
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
        mm = map_segment(name, size, create=False)
        unlink(name)  # mapped on both sides: nothing in /dev/shm from here on
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


class Group:
    """Consecutive batches one worker reads and collates; their deliveries arrive in order."""

    __slots__ = ("done", "gid", "proc", "received", "results", "specs", "waiter")

    def __init__(self, gid: int, specs: list[BatchSpec], proc: Proc | None) -> None:
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
