"""Process workers, the main process's side: the pool of ``num_workers`` processes and each worker
as the main process sees it; one iterator's use of the pool, which sends the workers tasks and
takes in their results, is a :class:`~guideloom._runtime.processes.session.Session`.

Workers inherit none of the main process's threads or locks (``fork`` from a main process with
threads would: a lock another thread held at that moment stays held in the worker, and obstore's
runtime, whose threads are gone, hangs). Where the pool is made on the process's only thread, each
start forks the workers from the main process itself, on the caller's thread, as torch's own
workers are forked (:mod:`~guideloom._runtime.processes.zygote`): they share the main process's
pages, torch's included, and the first batch's worker is one fork away. Elsewhere they come from
the standby zygote or multiprocessing's fork server, a process that imports the worker's
modules, numpy and torch once (about a second, with the first pool of a process) and forks a
worker in milliseconds. A pool waits for its workers on a thread of its own
(:meth:`WorkerPool.begin`) so that the first batches can be made meanwhile.

How the workers start is :mod:`~guideloom._runtime.processes.start`'s choice; each worker as the
main process sees it is a :class:`~guideloom._runtime.processes.proc.Proc`.

A dead worker is seen at once (end of file on its pipe) and becomes a
:class:`~guideloom.WorkerError` at the first batch it owed; every segment of a pool (its names
carry the pool's token) is swept from ``/dev/shm`` when a worker dies and when the pool closes.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from guideloom._errors import WorkerError
from guideloom._process import Live
from guideloom._runtime.processes.proc import TERMINATE_S, Group, Proc
from guideloom._runtime.processes.session import Session
from guideloom._runtime.processes.shm import SHM_PREFIX, posix_shm_available, sweep
from guideloom._runtime.processes.start import START_ENV, check_not_bootstrapping, worker_context
from guideloom._runtime.processes.wire import (
    Failed,
    Ready,
    Stop,
    load_exception,
)
from guideloom._runtime.processes.worker import warning_filters
from guideloom._runtime.processes.zygote import (
    HereContext,
    ZygoteContext,
    may_fork_here,
    reap_closed,
    standby_for,
)

if TYPE_CHECKING:
    from guideloom._datasets import DatasetAbstract

__all__ = ["SHUTDOWN_GRACE_S", "Group", "Proc", "Session", "WorkerPool"]

#: How long ``close()`` waits for a worker to finish its batch before terminating it.
SHUTDOWN_GRACE_S = 5.0
#: How long a worker may take from its start to report ready (its imports, the dataset's
#: ``open()``) before the start fails: a worker that never reports (forked with ``fork`` from a
#: process where another thread held a lock at that moment) would hold the loader forever.
READY_S = 300.0
#: How long ``close()`` waits for a start under way to end before it kills the workers' fork
#: server (a stopped zygote never answers the start's fork request), then for the start again.
START_END_S = 1.0


class WorkerPool:
    """``num_workers`` worker processes, started once and used by one iterator at a time."""

    def __init__(
        self, dataset: DatasetAbstract[Any], collate_fn: Callable[[Sequence[Any]], Any], num_workers: int
    ) -> None:
        if (
            not posix_shm_available()
        ):  # pragma: no cover - guideloom's process workers need POSIX shared memory
            raise RuntimeError("parallel_method='process' needs POSIX shared memory; use 'thread'")
        filters = warning_filters()
        try:
            self.spec = pickle.dumps((dataset, collate_fn, filters), protocol=5)
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
        #: The workers :meth:`begin` forked from this process itself, for its starter to wait for.
        self._here: list[Proc] = []
        #: The thread of a start :meth:`begin` made, until :meth:`start` has waited for it.
        self._starter: threading.Thread | None = None
        self._start_error: BaseException | None = None
        #: Notified as each worker of a start is ready, and when the start ends.
        self._readied = threading.Condition()
        self._start_over = True  # no start under way (set, notified, as the starter ends)
        #: What the workers reported last (:class:`Session`'s figures): the next iterator's
        #: session starts from them.
        self.measured: tuple[float | None, float | None, float | None] = (None, None, None)
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
            self._start_over = False
            # A dead worker goes now, not on the starter's thread: until then this start's first
            # ready worker could be taken to be it (:meth:`start_first`) and sent the epoch.
            for k, old in enumerate(self.procs):
                if old is not None and not _running(old):
                    self.procs[k] = None
                    self._discard(old)
            self._fork_here()
            self._starter = threading.Thread(
                target=self._start_missing, name="guideloom-workers-start", daemon=True
            )
            self._starter.start()

    def _fork_here(self) -> None:
        """Where the workers are forked from this process (the pool was made on its only thread):
        fork each that is not running now, on this thread, if this is still the process's only
        one; the starter then waits for them. Else they start from the standby zygote or the
        fork server, from now on."""
        if not isinstance(self.ctx, HereContext):
            return
        if not may_fork_here(standby_for(self.spec)):  # a thread of the process's own since
            self.ctx = worker_context(self.spec, here=False)
            return
        for k in range(self.num_workers):
            if self.procs[k] is None:  # (begin() dropped the dead ones)
                self._gens[k] += 1
                self.procs[k] = p = Proc(self, k, self._gens[k])
                self._here.append(p)

    def starting(self) -> bool:
        """Whether a start begun by :meth:`begin` is still under way."""
        starter = self._starter
        return starter is not None and starter.is_alive()

    def start(self) -> None:
        """Start the workers that are not running and wait until each has opened the storage (or
        wait for the start :meth:`begin` made); raise what made that start fail."""
        self.begin()
        self.join_start()

    def start_first(self, timeout: float | None = None) -> bool:
        """:meth:`start`, returning as soon as one worker is ready: its first tasks need not wait
        for the others' start (each fork from the fork server takes tens of milliseconds, in
        series). The others are ready when :meth:`starting` is false; a failure of the start
        after this returned is :meth:`start_failure` until :meth:`join_start` raises it. With
        ``timeout``: False if no worker is ready by then (call it again), else True."""
        self.begin()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._readied:  # (a loop, not wait_for's predicate: nothing calls back into here)
            while not (self._start_over or self._start_error is not None or self._any_ready()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._readied.wait(left)
        if self._start_over or self._start_error is not None:
            self.join_start()
        return True

    def _any_ready(self) -> bool:
        return any(p.ready for p in self.live())

    def start_failure(self) -> BaseException | None:
        """What made the last start fail, until :meth:`join_start` raises it."""
        return self._start_error

    def join_start(self) -> None:
        """Wait for the start :meth:`begin` made, if any, and raise what made it fail."""
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
        """The starter thread: start each missing worker on a thread of its own, which forks
        it and waits until it is ready (the first ready is seen then, not behind the others'
        forks). On a failure (the first worker's, by index) every worker it started that is not
        ready is stopped and the error kept for :meth:`start`; once the pool closes, what it
        starts is stopped at once."""
        started: list[Proc] = []
        missing: list[tuple[int, int]] = []
        try:
            with self._lock:
                started, self._here = self._here, []  # forked by begin() itself: waited for here
                if self._closed:
                    return
                for k in range(self.num_workers):
                    old = self.procs[k]
                    # (one that begin() forked may have exited already: its thread reads why)
                    if old in started or _running(old):
                        continue
                    if old is not None:
                        self.procs[k] = None
                        self._discard(old)
                    self._gens[k] += 1
                    missing.append((k, self._gens[k]))
            here = list(started)
            errors: list[BaseException | None] = [None] * (len(here) + len(missing))

            def start_one(i: int, k: int, gen: int, p: Proc | None) -> None:
                try:
                    if p is None:
                        p = Proc(self, k, gen)  # blocks while the fork server starts
                        if not self._keep(p):  # the pool closed meanwhile
                            self._stop([p], 0.0)
                            return
                        started.append(p)
                    self._wait_ready(p)
                    with self._readied:
                        self._readied.notify_all()
                except BaseException as exc:
                    errors[i] = exc

            jobs = [(p.index, 0, p) for p in here] + [(k, gen, None) for k, gen in missing]
            threads = [
                threading.Thread(
                    target=start_one, args=(i, *job), name=f"guideloom-worker-{job[0]}-start", daemon=True
                )
                for i, job in enumerate(jobs)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise error
        except BaseException as exc:
            self._start_error = exc
            # Those ready may serve already (:meth:`start_first`): they stay, the others stop.
            unready = [p for p in started if not p.ready]
            with self._lock:
                if self._closed:
                    return  # close() stops and joins them, once this thread is done
                for p in unready:
                    if self.procs[p.index] is p:
                        self.procs[p.index] = None
            self._stop(unready, 0.0)
        finally:
            with self._readied:
                self._start_over = True
                self._readied.notify_all()

    def _keep(self, p: Proc) -> bool:
        """Put a worker just started in its place, unless the pool has closed meanwhile."""
        with self._lock:
            if self._closed:
                return False
            self.procs[p.index] = p
            return True

    def _wait_ready(self, p: Proc) -> None:
        try:
            if not p.results.poll(READY_S):
                raise WorkerError(
                    f"guideloom worker process {p.index} did not report ready within {READY_S:.0f} s of "
                    "its start (its imports and the dataset's open()); it is stopped. A worker forked "
                    f"with {START_ENV}=fork from a process that runs other threads can wait forever "
                    "on a lock one of them held: leave that variable unset"
                )
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


def _wait_gone(procs: list[Proc], seconds: float) -> None:
    """Wait until every worker of ``procs`` has ended, ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while not all(p.gone() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(p: Proc | None) -> bool:
    """Whether ``p`` is a worker that is up (or starting) and has not died."""
    return p is not None and p.alive and p.proc.is_alive()


def _close_at_exit(pool: WorkerPool) -> None:
    """At interpreter exit: stop the pool's workers (a short grace) and remove its segments."""
    pool.close(grace=1.0)


#: The open pools, closed at interpreter exit once the threads are joined (a thread may iterate
#: a loader over one until it ends), and the zygotes their closes killed reaped after them.
_POOLS: Live[WorkerPool] = Live(_close_at_exit, after_threads=True, then=reap_closed)
