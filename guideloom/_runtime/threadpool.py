"""The collate threads: a thread pool whose shutdown is bounded in time.

``concurrent.futures.ThreadPoolExecutor`` joins its threads without a limit, at shutdown and at
interpreter exit: a ``collate_fn`` that never returns would hang ``loader.close()`` and then the
process's exit. A thread cannot be killed, so :class:`CollateThreads` runs daemon threads,
waits at most :data:`CLOSE_GRACE_S` for them at shutdown, and then warns which call is left
running (the thread goes on until it returns, or until the process exits).
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from guideloom._process import aside, run_into, runs_a_loop

__all__ = ["CLOSE_GRACE_S", "CollateThreads", "warn_left_running"]

T = TypeVar("T")

#: How long closing waits for a collate call in progress before it leaves the thread running.
CLOSE_GRACE_S = 5.0

_Item = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _describe(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """The call a worker runs, by the name a user knows: the collate inside a group's call."""
    for candidate in (*args, fn):
        steps = candidate if isinstance(candidate, tuple) else (candidate,)
        for step in steps:
            name = getattr(step, "__qualname__", None)
            module = getattr(step, "__module__", None)
            if name and module and not module.startswith("guideloom."):
                return f"{module}.{name}"
    return getattr(fn, "__qualname__", repr(fn))


def warn_left_running(what: str, seconds: float, stacklevel: int = 3) -> None:
    """Warn that ``what`` did not return within ``seconds`` of a close and was left running."""
    warnings.warn(
        f"guideloom closed the loader, but {what} had not returned {seconds:.0f} s after the "
        "close was asked for: its thread is left running until the call returns (it is a "
        "daemon thread: the process can still exit). Look for a collate_fn that blocks forever "
        "(a lock, a queue, a network call without a timeout)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


class CollateThreads(concurrent.futures.Executor):
    """``n`` daemon threads running submitted calls in order of submission. A thread asked for by
    a thread that runs an event loop is started by the aside thread (:func:`~guideloom._process.aside`)."""

    def __init__(self, n: int, name: str = "guideloom-collate") -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # The call each thread runs now, described only if a close has to warn about it.
        self._running: dict[threading.Thread, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        self._most, self._name = max(1, n), name
        self._threads: list[threading.Thread] = []  # started as calls come, up to n
        self._starts: dict[threading.Thread, threading.Event] = {}  # those started aside

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to the collate threads after shutdown")
            self._queue.put((future, fn, args, kwargs))
            # A thread per call until there are ``n`` (a pool this small has no idle ones to
            # reuse first worth a semaphore's acquire and release per call on the hot path)
            if len(self._threads) < self._most:
                t = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                if runs_a_loop():  # a start waits for the thread to run: not on the loop
                    started = self._starts[t] = threading.Event()
                    aside(functools.partial(self._start_aside, t, started))
                else:
                    t.start()
        return future

    def _start_aside(self, t: threading.Thread, started: threading.Event) -> None:
        """On the aside thread: start ``t``, then say so. Where it cannot start (a process out of
        threads) and the pool has no other thread, the calls waiting fail with that error rather
        than wait for ever; a later call tries another thread."""
        try:
            t.start()
        except Exception as exc:
            with self._lock:
                self._threads.remove(t)
                alone = not self._threads
            if alone:
                self._fail_waiting(exc)
        finally:
            started.set()

    def _fail_waiting(self, exc: Exception) -> None:
        """Fail every call waiting in the queue with ``exc`` (a close's end mark stays)."""
        closed = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                closed = True
            elif item[0].set_running_or_notify_cancel():
                item[0].set_exception(exc)
        if closed:
            self._queue.put(None)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.put(None)  # the others stop too
                return
            future, fn, args, kwargs = item
            self._running[me] = (fn, args)
            try:
                run_into(future, fn, args, kwargs)
            finally:
                self._running.pop(me, None)
                # a finished batch is not kept alive here (by a thread that waits for its next)
                del item, future, fn, args, kwargs

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None
    ) -> None:
        """Stop taking calls (cancelling the queued ones with ``cancel_futures``); with ``wait``,
        join the threads for at most ``grace`` seconds (:data:`CLOSE_GRACE_S`) and warn about a
        call still running then."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                self._queue.put(None)
        if not wait:
            return
        deadline = time.monotonic() + (CLOSE_GRACE_S if grace is None else grace)
        for t in list(self._threads):
            started = self._starts.get(t)
            if started is not None:  # started aside: once it is
                started.wait(max(0.0, deadline - time.monotonic()))
            if t is not threading.current_thread() and t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        running = list(self._running.items())
        left = [f"{_describe(fn, args)} (on thread {t.name})" for t, (fn, args) in running if t.is_alive()]
        if left:
            warn_left_running(" and ".join(left), CLOSE_GRACE_S if grace is None else grace, 4)
