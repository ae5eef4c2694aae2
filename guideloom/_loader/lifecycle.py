"""A loader's lifecycle: opening and closing its dataset reader, its one active iterator and its
persistent process workers.

:class:`Lifecycle` is the part of :class:`~guideloom.pytorch.StatefulDataLoader` that changes
when the loader opens or closes, apart from the facade's parameters and checkpoint position. It
keeps no reference to its loader (each call is given it): a loader collected without
``close()`` is collected at once, and its finalizer stops its workers.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, Protocol

from guideloom._loop import LoopThread
from guideloom._runtime.chooser import Chooser, LoopChoice, Verdict
from guideloom._runtime.processes import WorkerPool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from guideloom._datasets import DatasetAbstract

__all__ = ["ActiveIterator", "Lifecycle", "wait_through_cancellation"]


class _Closable(Protocol):
    """An iterator, as the lifecycle closes it."""

    def close_sync(self) -> None: ...

    async def close_async(self) -> None: ...

    def spent(self) -> bool: ...

    def finish(self) -> None: ...


class _Workers(Protocol):
    """What an iterator closed without waiting leaves to stop: its executors."""

    def shutdown(self, wait: bool = True) -> None: ...


class ActiveIterator:
    """A loader's one active iterator. Held weakly: an abandoned iterator is collected (and
    closes itself), which releases the loader."""

    __slots__ = ("_left", "_lock", "_ref")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ref: weakref.ref[_Closable] | None = None
        # What an async iterator closed without waiting (collected, or closed from sync code)
        # left to finish: its pipeline task and its workers, joined when the loader closes.
        self._left: list[tuple[asyncio.Task[None] | None, threading.Thread | None]] = []

    def get(self) -> _Closable | None:
        ref = self._ref
        return ref() if ref is not None else None

    def end_spent(self) -> None:
        """End the active iterator as exhausted if it has handed out its epoch's last batch and
        was not asked for another (a loop that stops after ``len(loader)`` batches, as Lightning's
        ``Trainer`` does): the epoch advances and a new iterator starts the next one, as a new
        ``iter()`` of a torch ``DataLoader`` does. An iterator with batches left stays active."""
        old = self.get()
        if old is not None and old.spent():
            old.finish()

    def claim(self, it: _Closable) -> None:
        with self._lock:
            if self.get() is not None:
                raise RuntimeError(
                    "an iterator on this loader is still active: exhaust it or close it "
                    "(iterator.close()) before starting another"
                )
            self._ref = weakref.ref(it)

    def release(self, it: _Closable) -> None:
        with self._lock:
            if self._ref is not None and self._ref() in (it, None):
                self._ref = None

    def leave(self, task: asyncio.Task[None] | None, workers: _Workers | None) -> None:
        """Stop what a closed iterator could not wait for (its pipeline ``task`` is cancelled
        already): ``workers`` shut down on a thread of their own, and :meth:`join_left` /
        :meth:`ajoin_left` wait for both."""
        joiner = None
        if workers is not None:
            joiner = threading.Thread(target=workers.shutdown, name="guideloom-join", daemon=True)
            joiner.start()
        with self._lock:  # what has finished meanwhile needs no join
            self._left = [
                (t, j) for t, j in self._left if not (t is None or t.done()) or (j and j.is_alive())
            ]
            if task is not None or joiner is not None:
                self._left.append((task, joiner))

    def _take_left(self) -> list[tuple[asyncio.Task[None] | None, threading.Thread | None]]:
        with self._lock:
            left, self._left = self._left, []
        return left

    def join_left(self) -> None:
        """Join the workers of iterators closed without waiting (sync ``loader.close()``)."""
        for _, joiner in self._take_left():
            if joiner is not None:
                joiner.join()

    async def ajoin_left(self) -> None:
        """As :meth:`join_left`, from the loop: wait for their pipeline tasks, then join their
        workers, through a cancellation of the caller (raised once all is joined)."""
        cancelled = False
        loop = asyncio.get_running_loop()
        for task, joiner in self._take_left():
            if task is not None and task.get_loop() is loop:
                cancelled = await wait_through_cancellation(task) or cancelled
            if joiner is not None:
                joined = loop.run_in_executor(None, joiner.join)
                cancelled = await wait_through_cancellation(joined) or cancelled
        if cancelled:
            raise asyncio.CancelledError


async def wait_through_cancellation(fut: asyncio.Future[Any]) -> bool:
    """Wait until ``fut`` is done, even if the waiting task is cancelled meanwhile (``fut`` is
    not cancelled with it); return whether it was, so the caller re-raises once done."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


class Lifecycle:
    """Whether the loader is open (from sync or async code), its active iterator and its worker
    pool, all changed under one lock."""

    __slots__ = ("_choosers", "_loop_choice", "_loop_collate", "active", "lock", "pool", "state")

    def __init__(self) -> None:
        self.state: Literal["closed", "open", "async-open"] = "closed"
        self.active = ActiveIterator()
        self.lock = threading.RLock()
        self.pool: WorkerPool | None = None
        self._choosers: dict[str, Chooser] = {}
        self._loop_choice: LoopChoice | None = None
        self._loop_collate: object = None  # the collate_fn that choice was learnt of

    def chooser(self, kind: str, make: Callable[[], Chooser], *, fresh: bool = False) -> Chooser:
        """The loader's chooser of ``kind`` (``"threads"``, ``"processes"``): what one epoch
        learnt holds for the next, which starts in the mode the last one ended in. The process
        workers' one goes with the pool it measured; ``fresh``: a new one (workers of the
        iterator's own), kept only for :meth:`verdict`."""
        with self.lock:
            chooser = self._choosers.get(kind)
            if chooser is None or fresh:
                chooser = self._choosers[kind] = make()
            return chooser

    def loop_choice(self, collate: object) -> LoopChoice:
        """The loader's choice of where ``async for`` collates at ``num_workers=0, prefetch=0``:
        what one epoch learnt holds for the next (a collate sent back from the loop earns it
        again with as many cheap calls as it left off at, not afresh each epoch), as long as
        ``collate`` is the collate_fn it was learnt of: another one starts afresh, on its thread."""
        with self.lock:
            if self._loop_choice is None or self._loop_collate is not collate:
                self._loop_choice, self._loop_collate = LoopChoice(), collate
            return self._loop_choice

    def verdict(self, kind: str) -> Verdict | None:
        """The last choice of the loader's chooser of ``kind`` (``stats()``), if it made one."""
        chooser = self._choosers.get(kind)
        return None if chooser is None else chooser.verdict

    def open(
        self,
        dataset: DatasetAbstract[Any],
        check: Callable[[], None],
        before: Callable[[], None] | None = None,
    ) -> None:
        """``loader.open()``: open the dataset reader, then ``check`` it (there is a global
        batch: a storage may know its length only once open). ``before`` runs first, on this
        process's only thread still (the process workers' start begins there: it forks)."""
        with self.lock:
            if self.state != "closed":
                return
            if before is not None:
                before()
            try:
                _run_blocking(dataset.open())
                try:
                    check()
                except BaseException:
                    _run_blocking(dataset.close())
                    raise
            except BaseException:
                pool, self.pool = self.pool, None  # an open that fails leaves no worker running
                if pool is not None:
                    pool.close()
                raise
            self.state = "open"

    def close(self, dataset: DatasetAbstract[Any], *, keep_workers: bool) -> None:
        """``loader.close()``; an iterator that opened the loader for itself keeps the workers."""
        with self.lock:
            it = self.active.get()
        if it is not None:
            it.close_sync()
        self.active.join_left()
        with self.lock:
            pool = None if keep_workers else self.pool
            if pool is not None:
                self.pool = None
            if self.state != "closed":
                self.state = "closed"
                _run_blocking(dataset.close())
        if pool is not None:
            pool.close()

    async def aopen(self, dataset: DatasetAbstract[Any], check: Callable[[], None]) -> None:
        """``loader.aopen()``: as :meth:`open`, on the running event loop."""
        if self.state != "closed":
            return
        await dataset.open()
        try:
            await asyncio.to_thread(check)  # a dataset counted as read counts a window for it
        except BaseException:
            await dataset.close()
            raise
        self.state = "async-open"

    async def aclose(self, dataset: DatasetAbstract[Any], *, keep_workers: bool) -> None:
        """``loader.aclose()``: as :meth:`close`, from async code."""
        it = self.active.get()
        if it is not None:
            await it.close_async()
        await self.active.ajoin_left()
        if self.state != "closed":
            self.state = "closed"
            await dataset.close()
        pool = None if keep_workers else self.pool
        if pool is not None:
            self.pool = None
            await asyncio.to_thread(pool.close)

    def drop_workers(self) -> WorkerPool | None:
        """Forget the process workers, which the caller closes: an iterator that ended in an
        error shuts down the loader's threads and processes (the contract), persistent or not;
        the next iterator starts new ones."""
        with self.lock:
            pool, self.pool = self.pool, None
            if pool is not None:
                self._choosers.pop("processes", None)
        return pool

    def worker_pool(
        self,
        owner: object,
        dataset: DatasetAbstract[Any],
        collate_fn: Callable[[Sequence[Any]], Any],
        num_workers: int,
    ) -> WorkerPool:
        """The loader's persistent process workers, made at the first iterator that needs them
        (again if ``dataset``, ``collate_fn`` or ``num_workers`` changed since)."""
        with self.lock:
            pool = self.pool
            if pool is not None and pool.matches(dataset, collate_fn, num_workers):
                return pool
            if pool is not None:
                pool.close()
            self._choosers.pop("processes", None)
            self.pool = pool = WorkerPool(dataset, collate_fn, num_workers)
            weakref.finalize(owner, pool.close)  # a loader collected without close()
            return pool


def _run_blocking(coro: Coroutine[Any, Any, None]) -> None:
    """Run a storage coroutine (open, close) from sync code, wherever that code runs.

    A short-lived loop thread serves it: the loader holds no thread while no iterator is
    active, and this works even when the caller's own thread runs an event loop.
    """
    lt = LoopThread(name="guideloom-open")
    try:
        lt.run(coro)
    finally:
        lt.stop()
