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
from typing import TYPE_CHECKING, Any, Literal

from guideloom._loader.iterators import ActiveIterator
from guideloom._loop import LoopThread
from guideloom._runtime.processes import WorkerPool

if TYPE_CHECKING:
    from guideloom.pytorch import StatefulDataLoader

__all__ = ["Lifecycle"]


class Lifecycle:
    """Whether the loader is open (from sync or async code), its active iterator and its worker
    pool, all changed under one lock."""

    __slots__ = ("active", "lock", "pool", "state")

    def __init__(self) -> None:
        self.state: Literal["closed", "open", "async-open"] = "closed"
        self.active = ActiveIterator()
        self.lock = threading.RLock()
        self.pool: WorkerPool | None = None

    def open(self, loader: StatefulDataLoader[Any, Any]) -> None:
        """``loader.open()``: open the dataset reader, then check there is a global batch."""
        with self.lock:
            if self.state != "closed":
                return
            _run_blocking(loader, loader.dataset.open())
            try:
                _check_size(loader)  # after opening: a storage may know its length only then
            except BaseException:
                _run_blocking(loader, loader.dataset.close())
                raise
            self.state = "open"

    def close(self, loader: StatefulDataLoader[Any, Any], *, keep_workers: bool) -> None:
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
                _run_blocking(loader, loader.dataset.close())
        if pool is not None:
            pool.close()

    async def aopen(self, loader: StatefulDataLoader[Any, Any]) -> None:
        """``loader.aopen()``: as :meth:`open`, on the running event loop."""
        if self.state != "closed":
            return
        await loader.dataset.open()
        try:
            _check_size(loader)
        except BaseException:
            await loader.dataset.close()
            raise
        self.state = "async-open"

    async def aclose(self, loader: StatefulDataLoader[Any, Any], *, keep_workers: bool) -> None:
        """``loader.aclose()``: as :meth:`close`, from async code."""
        it = self.active.get()
        if it is not None:
            await it.close_async()
        await self.active.ajoin_left()
        if self.state != "closed":
            self.state = "closed"
            await loader.dataset.close()
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
        return pool

    def worker_pool(self, loader: StatefulDataLoader[Any, Any]) -> WorkerPool:
        """The loader's persistent process workers, made at the first iterator that needs them
        (again if ``dataset``, ``collate_fn`` or ``num_workers`` changed since)."""
        with self.lock:
            pool = self.pool
            if pool is not None and pool.matches(loader.dataset, loader.collate_fn, loader.num_workers):
                return pool
            if pool is not None:
                pool.close()
            self.pool = pool = WorkerPool(loader.dataset, loader.collate_fn, loader.num_workers)
            weakref.finalize(loader, pool.close)  # a loader collected without close()
            return pool


def _check_size(loader: StatefulDataLoader[Any, Any]) -> None:
    n, g = len(loader.dataset), loader.global_batch_size
    if n < g:
        raise ValueError(
            f"the dataset has {n} observations, fewer than one global batch of "
            f"world_size * local_batch_size = {loader.world_size} * {loader.local_batch_size} = {g}; "
            "use a smaller local_batch_size or a larger dataset"
        )


def _run_blocking(loader: StatefulDataLoader[Any, Any], coro: Coroutine[Any, Any, None]) -> None:
    """Run a storage coroutine (open, close) from sync code, wherever that code runs.

    A short-lived loop thread serves it: the loader holds no thread while no iterator is
    active, and this works even when the caller's own thread runs an event loop.
    """
    lt = LoopThread(name=f"guideloom-loop-{id(loader):x}")
    try:
        lt.run(coro)
    finally:
        lt.stop()
