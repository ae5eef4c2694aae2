"""What guideloom keeps for the whole process, in one place.

- **Live objects** with background work (downloads, fetches ahead, stores, process workers):
  each kind in a :class:`Live` registry, stopped at interpreter exit (see *Exit order*).
- **Thread pools** shared by every storage (:func:`pool`): created on first use, named, their
  threads started on demand and joined at exit by ``concurrent.futures``; never started by a
  thread that runs an event loop (:func:`aside` starts them).
- **The aside thread** (:func:`aside`): what a thread that runs an event loop hands off because
  it would wait there (a thread's start).
- **The C heap's free pages** given back to the system (:func:`release_malloc`, glibc's
  ``malloc_trim``: a no-op elsewhere).
- **Cores** one read may spread its work over (:func:`cores`): the process's, or one in a
  loader's worker process (:func:`one_core`), which runs beside the others, as torch runs on one
  thread there.
- **Turns** (:class:`Turns`): work of background threads that takes turns, process-wide, and
  starts afresh in a forked child (where the threads that held a turn do not exist).
- **Checks already made** (:func:`remembered`): bounded maps from a file's identity to what a
  check found, so that an unchanged file is hashed once per process.

No other module of guideloom registers an exit hook (``atexit``, or the threads' exit hook of
:mod:`guideloom._compat`) or keeps a registry of objects to stop at exit (a test checks it).
What else lives for the process stays with the code whose logic it is, nothing of it to stop
at exit nor to forget for a test: the standby zygote and the zygotes killed but not yet reaped
(:mod:`~guideloom._runtime.processes.zygote`), the text encoders made here, weakly, by origin
(:mod:`~guideloom.storage._text`: a worker forked from this process finds the tokenizer its
copy's original built), the hooks run before the process's first object store
(:mod:`~guideloom.storage._remote._objstore`: the standby zygote is forked there), and what a
worker process of ``guideloom prepare`` keeps for its tasks (``guideloom._cli._work``: a pool's
process, not yours). Settings are read from the environment where they are used, never
rewritten: ``GUIDELOOM_WORKER_START`` and ``GUIDELOOM_STANDBY_ZYGOTE``
(:mod:`~guideloom._runtime.processes.start`).

Exit order, and why:

1. Before the interpreter joins its non-daemon threads, the registries made without
   ``after_threads``: what stops a thread of guideloom's (a download, a fetch ahead), which the
   join would otherwise wait for.
2. Once the threads are joined, the registries made with ``after_threads``, in the order they
   were made, each followed by its ``then``: what a thread may use until it ends (a store's
   client; a pool of process workers, which a thread of yours may iterate a loader over until
   it ends), then a garbage collection. This runs before ``multiprocessing``'s own exit function
   (imported before the hook is registered, and ``atexit`` runs the last registered first),
   which would terminate the process workers (its daemonic children) with SIGTERM instead of
   the pools' own close: a stop after the batch at hand, within a second.

:func:`reset` forgets the checks made, and nothing else (see its docstring). Memos of pure
functions (``functools.cache``) are not state: they stay where they are used.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread
import ctypes
import gc
import multiprocessing.util  # noqa: F401 - before the exit hook below: see the exit order
import os
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from guideloom._compat import at_threads_exit

__all__ = [
    "Live",
    "Turns",
    "aside",
    "cores",
    "idle_aside",
    "one_core",
    "pool",
    "release_malloc",
    "remembered",
    "reset",
    "run_into",
    "runs_a_loop",
]

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

_LOCK = threading.Lock()
_LIVE: list[Live[object]] = []
_LAST: list[Live[object]] = []
_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_REMEMBERED: list[_Bounded[object, object]] = []
_ONE_CORE = False
_ASIDE: tuple[queue.SimpleQueue[Callable[[], object]], threading.Thread] | None = None  # its calls, itself
_ASIDE_BUSY = False


class Live(Generic[T]):
    """The live objects of one kind, each stopped with ``stop`` at interpreter exit (held weakly:
    an object dropped is forgotten): before the interpreter joins its threads (what stops a
    thread), or with ``after_threads`` once they are joined (what a thread may still use until
    it ends: a store's client, a pool of process workers), followed by a garbage collection.
    ``then``, if given, is called at exit once every object of the kind was stopped (what their
    stops leave to finish: a killed process to reap)."""

    def __init__(
        self,
        stop: Callable[[T], object],
        *,
        after_threads: bool = False,
        then: Callable[[], object] | None = None,
    ) -> None:
        self._objects: weakref.WeakSet[T] = weakref.WeakSet()
        self._stop = stop
        self._then = then
        with _LOCK:
            (_LAST if after_threads else _LIVE).append(self)  # type: ignore[arg-type]

    def add(self, obj: T) -> None:
        self._objects.add(obj)

    def discard(self, obj: T) -> None:
        self._objects.discard(obj)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._objects))

    def stop_all(self) -> None:
        """Stop every object of the kind, then call ``then``."""
        for obj in self:
            self._stop(obj)
        if self._then is not None:
            self._then()


def _stop(registries: list[Live[object]]) -> None:
    """Stop every object of ``registries``, in order; an error is reported (as an uncaught one
    would be) and the next kind is stopped all the same."""
    for live in list(registries):
        try:
            live.stop_all()
        except Exception as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)


def _stop_everything() -> None:
    _stop(_LIVE)


def _stop_the_last() -> None:
    _stop(_LAST)
    gc.collect()


at_threads_exit(_stop_everything)
atexit.register(_stop_the_last)


def runs_a_loop() -> bool:
    """Whether this thread runs an event loop now."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def one_core() -> None:
    """This process is one of a loader's worker processes: :func:`cores` is 1 from now on."""
    global _ONE_CORE  # noqa: PLW0603 - the process's own setting
    _ONE_CORE = True


def cores() -> int:
    """The cores one read of this process may spread its work over: those it may run on, or 1
    in a worker process (:func:`one_core`)."""
    if _ONE_CORE:
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity (macOS)
        return os.cpu_count() or 1


class Turns:
    """A bound on how many threads do one kind of work at once (``with turns:``), for the whole
    process, of ``at_once()`` turns, asked when a turn is first taken: a worker process, forked
    from a process of many cores, is sized by its own (:func:`one_core`). A child forked while a
    thread held a turn starts with every turn free: that thread does not exist there, and would
    never give its turn back."""

    def __init__(self, at_once: Callable[[], int]) -> None:
        self._size = at_once
        self._lock = threading.Lock()
        self._sem: tuple[threading.BoundedSemaphore, int] | None = None  # and its size
        os.register_at_fork(after_in_child=self._afresh)

    def _afresh(self) -> None:
        self._lock = threading.Lock()
        self._sem = None

    @property
    def at_once(self) -> int:
        """How many threads may hold a turn at once in this process."""
        return self._turns()[1]

    def _turns(self) -> tuple[threading.BoundedSemaphore, int]:
        sem = self._sem
        if sem is None:
            with self._lock:
                if self._sem is None:
                    n = max(1, self._size())
                    self._sem = (threading.BoundedSemaphore(n), n)
                sem = self._sem
        return sem

    def __enter__(self) -> None:
        self._turns()[0].acquire()

    def __exit__(self, *exc: object) -> None:
        self._turns()[0].release()


def pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool ``name`` (threads named ``guideloom-<name>``, at most ``threads``)."""
    with _LOCK:
        found = _POOLS.get(name)
        if found is None:
            found = _POOLS[name] = _Pool(threads, f"guideloom-{name}")
        return found


def aside(fn: Callable[[], object]) -> None:
    """Run ``fn()`` on this process's aside thread, in the order asked: what a thread that runs
    an event loop hands off because it would wait for it. Starting a thread waits until the new
    thread runs its first line, which with the GIL busy (I/O threads copying, a collate) is one
    or two of CPython's 5 ms switch intervals: on the loop's thread, a stall of every task on
    it. ``fn`` reports its own outcome; what it raises is reported as an uncaught error is."""
    global _ASIDE  # noqa: PLW0603 - the process's one aside thread
    with _LOCK:
        if _ASIDE is None:
            calls: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
            thread = threading.Thread(target=_run_aside, args=(calls,), name="guideloom-aside", daemon=True)
            thread.start()
            _ASIDE = (calls, thread)
        calls = _ASIDE[0]
    calls.put(fn)


def _run_aside(calls: queue.SimpleQueue[Callable[[], object]]) -> None:
    global _ASIDE_BUSY  # noqa: PLW0603 - this thread's own state
    while True:
        fn = calls.get()
        _ASIDE_BUSY = True
        try:
            fn()
        except BaseException as exc:  # reported, and the next call runs
            sys.excepthook(type(exc), exc, exc.__traceback__)
        del fn
        _ASIDE_BUSY = False


def idle_aside() -> threading.Thread | None:
    """The aside thread, where it waits for work: it then holds no lock (outside the queue it
    waits on, which a forked child does not use), so a fork may leave it behind."""
    if _ASIDE is None or _ASIDE_BUSY:
        return None
    return _ASIDE[1]


def _forget_aside() -> None:
    """In a forked child: the aside thread is the parent's (a child starts its own)."""
    global _ASIDE, _ASIDE_BUSY
    _ASIDE, _ASIDE_BUSY = None, False


os.register_at_fork(after_in_child=_forget_aside)


def run_into(future: concurrent.futures.Future[T], fn: Callable[..., T], args: Any, kwargs: Any) -> None:
    """``fn(*args, **kwargs)``, its outcome set on ``future`` (nothing run where ``future`` was
    cancelled first), as ``concurrent.futures``' own workers run a call."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class _Pool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that never starts a thread on a thread that runs an event loop.

    Where ``concurrent.futures`` would start one there for a call just queued (no thread idle,
    fewer than the most), the start is handed to :func:`aside`, where it may wait; the call
    stays queued in its turn, for the new thread or for one that is idle first. The decision is
    ``concurrent.futures``' own, made under its locks: the count of idle threads is its.
    """

    def _adjust_thread_count(self) -> None:
        if not runs_a_loop():
            super()._adjust_thread_count()
        elif not self._idle_semaphore.acquire(timeout=0) and len(self._threads) < self._max_workers:
            aside(self._grow)

    def _grow(self) -> None:
        """On the aside thread: start a thread for a call queued on a loop's thread (unless an
        idle one takes it first), under the locks that ``submit`` holds for it. A pool shut down
        meanwhile gets it all the same: it runs what was queued before the shutdown, then ends.
        Once the interpreter exits, or where the thread cannot start (a process out of threads),
        the calls queued where no thread would take them are refused with the reason."""
        cf = concurrent.futures.thread
        with self._shutdown_lock, cf._global_shutdown_lock:
            refusal: BaseException = RuntimeError("cannot schedule new futures after interpreter shutdown")
            if not cf._shutdown:
                try:
                    super()._adjust_thread_count()
                    return
                except Exception as exc:
                    refusal = exc
            if not self._threads:
                while True:
                    try:
                        item = self._work_queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None and item.future.set_running_or_notify_cancel():
                        item.future.set_exception(refusal)


class _Bounded(MutableMapping[K, V]):
    """A dict that forgets its oldest entries beyond ``limit`` (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self._data: OrderedDict[K, V] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def __getitem__(self, key: K) -> V:
        with self._lock:
            return self._data[key]

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._limit:
                self._data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        with self._lock:
            del self._data[key]

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def setdefault(self, key: K, default: V) -> V:
        with self._lock:
            found = self._data.setdefault(key, default)
            while len(self._data) > self._limit:
                self._data.popitem(last=False)
            return found


def remembered(limit: int) -> MutableMapping[K, V]:
    """A map of checks made, of at most ``limit`` entries (the oldest forgotten first), which
    :func:`reset` clears."""
    found: _Bounded[K, V] = _Bounded(limit)
    with _LOCK:
        _REMEMBERED.append(found)  # type: ignore[arg-type]
    return found


def reset() -> None:
    """Forget every check made in this process: each file is checked again at its next read.

    It clears every map made with :func:`remembered` (the files whose checksum matched, the
    blocks of each file already checked), for a test that rewrites a file in place within one
    clock tick or a benchmark that measures a first epoch again. Nothing else: the :class:`Live`
    registries (they hold their objects weakly: one leaves its registry when it is closed or
    dropped), the thread pools of :func:`pool` (idle threads, kept for the process's life), the
    pools of process workers (each closed with its loader, those left open at exit), the standby
    zygote (one per process, for its life: a test that needs a process without one runs a fresh
    interpreter) and the memos of pure functions (``functools.cache``: dtype names) stay. No test
    needs the worker pools or the zygote forgotten between tests: each loader's pool goes with
    the loader, and the standby is only used where it serves the pool's ``__main__``."""
    with _LOCK:
        maps = list(_REMEMBERED)
    for m in maps:
        m.clear()


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``None`` elsewhere: another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_malloc() -> None:
    """Give the C heap's free pages back to the system, where glibc's allocator holds them
    (a no-op elsewhere). Tokenizing and remote reads allocate and free much on several threads,
    each on a heap (arena) of its own, which glibc trims only at its top: freed memory between
    kept token arrays would otherwise stay resident for as long as the process lives (hundreds
    of MiB after tokenizing a few hundred MiB of text). Costs about a millisecond."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
