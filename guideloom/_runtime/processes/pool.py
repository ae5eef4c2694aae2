"""Process workers, the main process's side: the pool of ``num_workers`` processes, each worker
as the main process sees it, and a session, one iterator's use of the pool: it sends the workers
tasks and takes in their results.

Workers are forked from a fork server (:func:`worker_context`) and inherit none of the main
process's threads or locks (``fork`` from a main process with threads would: a lock another thread
held at that moment stays held in the worker, and obstore's runtime, whose threads are gone,
hangs). Where the pool is made on the process's only thread, the server is a zygote forked from
the main process then (:mod:`~guideloom._runtime.processes.zygote`): the workers share the main
process's pages, torch's included, as torch's own forked workers do. Elsewhere it is
multiprocessing's fork server, a process that imports the worker's modules, numpy and torch once
(about a second, with the first pool of a process) and forks a worker in milliseconds. A pool
starts its workers on a thread of its own (:meth:`WorkerPool.begin`) so that the first batches
can be made meanwhile.

A dead worker is seen at once (end of file on its pipe) and becomes a
:class:`~guideloom.WorkerError` at the first batch it owed; every segment of a pool (its names
carry the pool's token) is swept from ``/dev/shm`` when a worker dies and when the pool closes.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import signal
import struct
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom._core.delivery import Delivery
from guideloom._core.plan import BatchSpec
from guideloom._errors import WorkerError
from guideloom._runtime.processes.pack import Segment, pack_samples
from guideloom._runtime.processes.shm import (
    MAX_SLOTS,
    SHM_PREFIX,
    Inputs,
    StateSegment,
    map_segment,
    posix_shm_available,
    release,
    sweep,
    unlink,
)
from guideloom._runtime.processes.wire import (
    End,
    Epoch,
    Failed,
    GroupDone,
    Ready,
    Samples,
    Stop,
    Task,
    load_exception,
)
from guideloom._runtime.processes.worker import worker_main
from guideloom._runtime.processes.zygote import (
    ZygoteContext,
    fork_is_safe,
    fork_standby,
    fork_zygote,
    standby_for,
)
from guideloom.storage._remote import _objstore

if TYPE_CHECKING:
    from guideloom._datasets import DatasetAbstract

__all__ = [
    "PRELOAD",
    "SHUTDOWN_GRACE_S",
    "START_METHOD",
    "Group",
    "Proc",
    "Session",
    "WorkerPool",
    "check_not_bootstrapping",
    "worker_context",
]

#: How long ``close()`` waits for a worker to finish its batch before terminating it.
SHUTDOWN_GRACE_S = 5.0
#: How long ``close()`` waits for a worker to end after SIGTERM, then after SIGKILL: every wait of
#: a close is bounded, whatever a worker or the fork server does (a stopped process, a deadlock).
TERMINATE_S = 1.0
#: How long ``close()`` waits for a start under way to end before it kills the workers' fork
#: server (a stopped zygote never answers the start's fork request), then for the start again.
START_END_S = 1.0
#: How workers start: ``"zygote"`` (a fork server forked from this process where that is safe,
#: multiprocessing's fork server elsewhere); ``"spawn"`` where the platform has no fork server.
#: (The benchmark of worker start sets it to compare the methods: also ``"forkserver"``, ``"fork"``.)
START_METHOD = "zygote"
#: What the fork server imports before it forks a worker (torch too, when the main process has
#: imported it): each worker shares them instead of importing them anew.
PRELOAD = ("guideloom._runtime.processes.worker", "numpy")


def _preload() -> list[str]:
    return [*PRELOAD, *(["torch"] if "torch" in sys.modules else [])]


def _standby() -> None:
    """Before this process's first object store: fork the standby zygote, if workers may start
    from one (:func:`~guideloom._runtime.processes.zygote.fork_standby`); not in a process
    multiprocessing started (a worker that opens its storage starts no workers), nor where
    ``GUIDELOOM_STANDBY_ZYGOTE=0`` says the process will not use process workers."""
    if (
        os.environ.get("GUIDELOOM_STANDBY_ZYGOTE", "1") != "0"
        and START_METHOD == "zygote"
        and multiprocessing.parent_process() is None
        and "forkserver" in multiprocessing.get_all_start_methods()
    ):
        fork_standby(_preload())


_objstore.BEFORE_FIRST_STORE.append(_standby)


def worker_context(spec: bytes = b"") -> ForkServerContext | SpawnContext | ForkContext:
    """The multiprocessing context a new pool's workers start in: a zygote forked from this
    process now, if this thread is its only one; else the standby zygote, where the workers'
    ``spec`` (their pickled dataset and collate) finds in it what it names of ``__main__``; else
    the fork server, told what to preload.

    The fork server is one per process, shared with any other user of ``forkserver``: the
    modules are added to its preload list, and take effect when it starts (with the first
    pool's first worker: never here). The list's default, ``["__main__"]``, is replaced: the
    server does not import the main script (each worker does, when it starts).
    """
    if START_METHOD == "fork":
        return multiprocessing.get_context("fork")
    if START_METHOD == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    wanted = _preload()
    if START_METHOD == "zygote":
        standby = standby_for(spec)
        # With a standby to fall back on, threads that may be ending are not waited for.
        if fork_is_safe() if standby is None else fork_is_safe(0.0):
            return ZygoteContext(fork_zygote(wanted))
        if standby is not None:
            return ZygoteContext(standby, shared=True)
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", ()))
    if current == ["__main__"]:
        current = []
    missing = [m for m in wanted if m not in current]
    if missing:
        ctx.set_forkserver_preload(current + missing)
    return ctx


def check_not_bootstrapping() -> None:
    """Refuse to start workers from a worker that is still importing the main module.

    Each worker imports the main script, as multiprocessing's ``spawn`` and ``forkserver`` do;
    one without the ``if __name__ == "__main__":`` guard would start the loader again in every
    worker.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "guideloom: a loader with parallel_method='process' was started while a worker process "
            "was still importing the main module. Each worker process imports your main script "
            "(as multiprocessing's 'spawn' and 'forkserver' start methods do): put the code that "
            'creates and iterates the loader under `if __name__ == "__main__":` (or in a function '
            "called from there)."
        )


def _moving(average: float | None, value: float) -> float:
    """An exponential moving average of what the workers report, group by group."""
    return value if average is None else 0.8 * average + 0.2 * value


class Proc:
    """One worker process, as the main process sees it."""

    def __init__(self, pool: WorkerPool, index: int, gen: int) -> None:
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

    def send(self, msg: Task | Epoch | End | Stop) -> None:
        with self.send_lock:
            self.tasks.send(msg)

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
                self.tasks.send(msg)
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


class WorkerPool:
    """``num_workers`` worker processes, started once and used by one iterator at a time."""

    def __init__(
        self, dataset: DatasetAbstract[Any], collate_fn: Callable[[Sequence[Any]], Any], num_workers: int
    ) -> None:
        if (
            not posix_shm_available()
        ):  # pragma: no cover - guideloom's process workers need POSIX shared memory
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
        self._seed = secrets.randbits(62)
        self.procs: list[Proc | None] = [None] * num_workers
        self._gens = [0] * num_workers
        self._lock = threading.Lock()
        self._closed = False
        self._tokens = 0
        self.ctx = worker_context(self.spec)
        #: The thread of a start :meth:`begin` made, until :meth:`start` has waited for it.
        self._starter: threading.Thread | None = None
        self._start_error: BaseException | None = None
        _POOLS.add(self)

    def worker_seed(self, index: int, gen: int) -> int:
        """The seed of worker ``index``'s random generators (its ``gen``-th start): each worker's
        own, as torch's workers' are, whether it was forked from this process or not."""
        return hash((self._seed, index, gen)) & (2**63 - 1)

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

    def begin(self) -> None:
        """Start the workers that are not running (all at first, a dead one again) on a thread of
        the pool's, which waits until each has opened the storage; :meth:`starting` says whether
        it still runs, :meth:`start` waits for it. Returns at once: the first start of a process
        takes about a second (the fork server imports torch), and the first batches can be made
        meanwhile. Nothing is started while an earlier start is under way or not yet waited for.
        """
        check_not_bootstrapping()
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader's worker pool was closed")
            if self._starter is not None or all(_running(p) for p in self.procs):
                return
            self._start_error = None
            self._starter = threading.Thread(
                target=self._start_missing, name="guideloom-workers-start", daemon=True
            )
            self._starter.start()

    def starting(self) -> bool:
        """Whether a start begun by :meth:`begin` is still under way."""
        starter = self._starter
        return starter is not None and starter.is_alive()

    def start(self) -> None:
        """Start the workers that are not running and wait until each has opened the storage (or
        wait for the start :meth:`begin` made); raise what made that start fail."""
        self.begin()
        starter = self._starter
        if starter is None:
            return
        starter.join()
        with self._lock:
            if self._starter is starter:
                self._starter = None
            error, self._start_error = self._start_error, None
        if error is not None:
            raise error

    def _start_missing(self) -> None:
        """The starter thread: fork each missing worker, then wait until each is ready. On a
        failure every worker it started is stopped and the error kept for :meth:`start`; once
        the pool closes, what it starts is stopped at once."""
        started: list[Proc] = []
        try:
            for k in range(self.num_workers):
                with self._lock:
                    if self._closed:
                        return
                    old = self.procs[k]
                    if _running(old):
                        continue
                    if old is not None:
                        self.procs[k] = None
                        self._discard(old)
                    self._gens[k] += 1
                    gen = self._gens[k]
                p = Proc(self, k, gen)  # blocks while the fork server starts
                if not self._keep(p):  # the pool closed meanwhile
                    self._stop([p], 0.0)
                    return
                started.append(p)
            for p in started:
                self._wait_ready(p)
        except BaseException as exc:
            self._start_error = exc
            with self._lock:
                if self._closed:
                    return  # close() stops and joins them, once this thread is done
                for p in started:
                    if self.procs[p.index] is p:
                        self.procs[p.index] = None
            self._stop(started, 0.0)

    def _keep(self, p: Proc) -> bool:
        """Put a worker just started in its place, unless the pool has closed meanwhile."""
        with self._lock:
            if self._closed:
                return False
            self.procs[p.index] = p
            return True

    def _wait_ready(self, p: Proc) -> None:
        try:
            msg: Ready | Failed | None = pickle.loads(p.results.recv_bytes())
        except (EOFError, OSError):
            msg = None
        finally:
            p.state_segment.unlink()  # mapped by the worker by now, or it is gone
        if isinstance(msg, Ready):
            p.ready = True
            os.set_blocking(p.fd, False)
            return
        if isinstance(msg, Failed):
            exc = load_exception(msg.error, msg.tb)
            if msg.at_open:  # the dataset's open() raised: its own exception, as inline
                exc.add_note(f"raised by the dataset's open() in guideloom worker process {p.index}")
                raise exc
            raise WorkerError(
                f"guideloom worker process {p.index} could not start: {type(exc).__name__}: {exc}"
            ) from exc
        if self._closed:
            raise WorkerError(
                f"guideloom worker process {p.index} was stopped while starting (the loader closed)"
            )
        _wait_gone([p], 5.0)  # its exit status, for the message
        raise WorkerError(
            f"guideloom worker process {p.index} exited while starting ({p.describe_exit()}); "
            "see its error above. Each worker process imports your main script (as "
            "multiprocessing's 'spawn' and 'forkserver' start methods do): a script that creates "
            'and iterates the loader at module level must do so under `if __name__ == "__main__":`'
        )

    def session(self) -> Session:
        """A handle for one iterator's use of the workers."""
        self._tokens += 1
        return Session(self, self._tokens)

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p is not None and p.alive]

    def mark_dead(self, p: Proc) -> None:
        """A worker's pipe closed: reap it and remove its segments (it may have died mid-write)."""
        p.alive = False
        _wait_gone([p], 1.0)
        p.inputs.close()
        sweep(p.prefix)

    def _discard(self, p: Proc) -> None:
        p.alive = False
        _wait_gone([p], 0.1)
        if not p.gone():
            p.proc.kill()
            _wait_gone([p], TERMINATE_S)
        for c in (p.tasks, p.results):
            c.close()
        p.inputs.close()
        sweep(p.prefix)

    def _stop(self, procs: list[Proc], grace: float) -> None:
        """Ask ``procs`` to stop after their batch, terminate those not gone within ``grace``
        seconds, kill those not gone :data:`TERMINATE_S` later; remove their segments. Returns
        within ``grace + 2 * TERMINATE_S`` seconds whatever the workers do (one stopped with
        SIGSTOP, or unkillable, is left: the kernel ends it)."""
        for p in procs:
            p.post(Stop())
        _wait_gone(procs, grace)
        for signal_them in (BaseProcess.terminate, BaseProcess.kill):
            left = [p for p in procs if not p.gone()]
            if not left:
                break
            for p in left:  # a collate that has not returned within the grace period
                try:
                    signal_them(p.proc)
                    if p.proc.pid is not None:
                        os.kill(p.proc.pid, signal.SIGCONT)  # a stopped worker takes its SIGTERM
                except OSError:
                    pass
            _wait_gone(left, TERMINATE_S)
        reap_by = time.monotonic() + TERMINATE_S
        for p in procs:
            if p.gone():  # collect its exit status (a child of this process is then no zombie)
                p.proc.join(max(0.0, reap_by - time.monotonic()))
            p.alive = False
            for c in (p.tasks, p.results):
                c.close()
            p.inputs.close()
            sweep(p.prefix)

    def close(self, grace: float | None = None) -> None:
        """Stop every worker: each finishes its batch within ``grace`` seconds (default
        :data:`SHUTDOWN_GRACE_S`) or is terminated. A start under way ends first: the workers
        still starting are killed (they owe no batch). Idempotent; removes every segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            starter = self._starter
            if starter is not None:
                for p in self.procs:
                    if p is not None and not p.ready and p.proc.is_alive():
                        p.proc.kill()  # its pipe closes: the starter stops waiting for it
        try:
            if starter is not None and starter is not threading.current_thread():
                # (a loader collected on the starter thread itself: not waited for)
                starter.join(START_END_S)
                if starter.is_alive() and isinstance(self.ctx, ZygoteContext):
                    self.ctx.kill()  # a stopped zygote: its end ends the start's fork request
                    starter.join(START_END_S)
            with self._lock:
                procs = [p for p in self.procs if p is not None]
                self.procs = [None] * self.num_workers
                self._starter = None
            self._stop(procs, SHUTDOWN_GRACE_S if grace is None else grace)
        finally:
            sweep(self.token + "-")
            _POOLS.discard(self)
            if isinstance(self.ctx, ZygoteContext):
                self.ctx.close()


def _wait_gone(procs: list[Proc], seconds: float) -> None:
    """Wait until every worker of ``procs`` has ended, ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while not all(p.gone() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(p: Proc | None) -> bool:
    """Whether ``p`` is a worker that is up (or starting) and has not died."""
    return p is not None and p.alive and p.proc.is_alive()


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
        self.groups: dict[int, Group] = {}
        #: The segments of the samples sent with groups, by gid, until the worker answers.
        self.inputs: dict[int, tuple[Proc, Segment]] = {}
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
            p.post(End(self.token))  # never blocks: a stopped worker is stopped by the close
        for gid in list(self.inputs):
            self._free_input(gid)

    def _free_input(self, gid: int) -> None:
        """The segment of the samples sent with group ``gid`` may take the worker's next ones.
        At the end of a session, a group the worker has not answered for yet is one nobody waits
        for: the worker takes its tasks in order, so the next one's samples never reach it
        before it is done with that group."""
        held = self.inputs.pop(gid, None)
        if held is not None:
            held[0].inputs.give_back(held[1])

    # -- reading results (on the loop) -----------------------------------------------------------
    def _on_readable(self, p: Proc, loop: asyncio.AbstractEventLoop) -> None:
        if not self.receive(p):
            loop.remove_reader(p.fd)

    def receive(self, p: Proc) -> bool:
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

    def _on_message(self, p: Proc, msg: GroupDone) -> None:
        token, gid, entries, slot, read_s, work_s, reads = msg
        if token == self.token:
            self._free_input(gid)
        if reads != (0, 0) and (storage := self.pool.dataset.storage) is not None:
            storage.add_read_counts(*reads)  # what stats() reports counts the workers' reads
        self.read_per_batch = _moving(self.read_per_batch, read_s)
        self.work_per_batch = _moving(self.work_per_batch, work_s)
        g = self.groups.get(gid) if token == self.token else None
        holder: Any = None
        if slot is not None:
            i, name, size = slot
            mm = p.map_slot(i, name, size)
            holder = (ctypes.c_char * size).from_buffer(mm)  # the group's arrays are views of it
            weakref.finalize(holder, release, p.state, i)  # freed with the group's last array
        if g is None or g.done:
            return  # an ended iterator's batches: dropping them frees their slot
        for entry in entries:
            spec = g.specs[g.received]
            assert spec.step == entry.step, (spec, entry.step)
            try:
                d = entry.delivery(spec, holder)
            except Exception as exc:
                d = Delivery(spec, error=exc)
            g.add(d)
        if g is not None and not g.done:
            g.fail(RuntimeError(f"guideloom bug: a worker returned {g.received} of {len(g.specs)} batches"))
        if g is not None and g.proc is not None:
            g.proc.inflight -= 1

    def submit(self, specs: list[BatchSpec], samples: list[Any] | None = None) -> Group:
        """Send consecutive batches to the least busy live worker as one group: to read and
        collate, or to collate from ``samples`` (each batch's, read by the main process)."""
        self._gid += 1
        live = [p for p in self.pool.live() if p.proc.is_alive()]
        if not live:
            g = Group(self._gid, specs, None)
            g.fail(WorkerError("every guideloom worker process has died"))
            return g
        p = min(live, key=lambda q: q.inflight)
        g = self.groups[self._gid] = Group(self._gid, specs, p)
        try:
            sent = None if samples is None else self._pack(p, g.gid, samples)
        except Exception as exc:  # samples that do not pickle, or no room in /dev/shm
            self._free_input(g.gid)
            g.fail(exc)
            return g
        try:
            p.send(Task(self.token, g.gid, specs[0].step, specs[-1].step + 1, sent))
        except (OSError, ValueError) as exc:
            self._free_input(g.gid)
            g.fail(WorkerError(f"guideloom worker process {p.index} died: {exc}"))
            return g
        p.inflight += 1
        return g

    def _pack(self, p: Proc, gid: int, samples: list[Any]) -> Samples:
        """``samples`` as they travel to ``p``, in one of its input segments (given back when
        it answers for the group)."""
        sent, seg = pack_samples(samples, p.inputs.take)
        if seg is not None:
            self.inputs[gid] = (p, seg)
        return sent
