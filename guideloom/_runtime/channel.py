"""The bounded hand-off between the pipeline and its consumer.

The pipeline runs on an event loop; the consumer is either a coroutine on that same loop
(``async for``) or another thread (``for``). Both pull whole batches from one buffer.

Demand is counted in *credits*: the producer must ``reserve`` a credit before it starts a batch,
and the consumer grants one each time it asks for a batch. Starting with ``capacity`` credits, at
most ``capacity`` batches are ever prepared ahead of the consumer's requests, which is exactly
the loader's ``prefetch`` (plus one per worker, so workers have something to do).

Cross-thread wake-ups are the expensive part (a futex wake and a GIL hand-over each), so they
only happen when the other side is actually waiting, and a producer that ran out of credits is
woken only once half the capacity is free again, or the buffer is about to run dry.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

__all__ = ["Channel", "EndOfStream"]

T = TypeVar("T")


class EndOfStream(Exception):
    """The channel is closed and drained: the producer's stream has ended.

    guideloom's own signal, so that an ``EOFError`` a storage raises stays that storage's error,
    delivered at its batch, and never reads as the end of the epoch.
    """


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Channel(Generic[T]):
    """A bounded, credit-based buffer from an event loop to a sync or async consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: deque[T] = deque()
        self._credits = capacity
        self._wake_at = max(1, capacity // 2)
        self._producer: asyncio.Future[None] | None = None
        self._sync_waiting = False
        self._closed = False
        self._flush_scheduled = False
        self._pending_get: asyncio.Future[T] | None = None

    # -- producer side: always on the loop -------------------------------------------------------
    async def reserve(self) -> None:
        """Wait for a credit: the consumer's permission to prepare one more batch."""
        while True:
            with self._lock:
                if self._credits > 0:
                    self._credits -= 1
                    return
                fut = self._loop.create_future()
                self._producer = fut
            try:
                await fut
            finally:
                self._producer = None

    def try_reserve(self) -> bool:
        """Take a credit if one is available right now."""
        with self._lock:
            if self._credits > 0:
                self._credits -= 1
                return True
            return False

    def put(self, item: T) -> None:
        """Hand a prepared batch to the consumer; never blocks.

        A waiting consumer is woken at once when half the capacity is ready; otherwise at the end
        of the producer's current burst (the next turn of the loop, when the producer would wait
        anyway), so a producer that prepares several batches in a row wakes the consumer once.
        """
        with self._lock:
            pending, self._pending_get = self._pending_get, None
            if pending is not None and not pending.done() and not self._items:
                pending.set_result(item)  # a consumer on the loop gets it at once
                return
            self._items.append(item)
            if not self._sync_waiting:
                return
            if len(self._items) >= self._wake_at:
                self._notify_consumer()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._lock:
            self._flush_scheduled = False
            if self._items:
                self._notify_consumer()

    def _notify_consumer(self) -> None:
        if self._sync_waiting:
            self._ready.notify()

    def close(self) -> None:
        """Producer finished (or died): wake a waiting consumer so it sees the end."""
        with self._lock:
            self._closed = True
            pending = self._pending_get
            if pending is not None and not pending.done():
                self._pending_get = None
                pending.set_exception(EndOfStream())
            self._notify_consumer()

    # -- consumer side ----------------------------------------------------------------------------
    def _grant(self, *, from_loop: bool) -> None:
        """Give the producer one credit (lock held); wake it if it waits and it is worth it."""
        self._credits += 1
        fut = self._producer
        if fut is not None and (self._credits >= self._wake_at or not self._items):
            self._producer = None
            if from_loop:
                _wake(fut)
            else:
                self._loop.call_soon_threadsafe(_wake, fut)

    def get(self, timeout: float | None = None) -> T:
        """Blocking get for a consumer thread. Raises :class:`EndOfStream` once closed and drained."""
        with self._lock:
            self._grant(from_loop=False)
            while not self._items:
                if self._closed:
                    raise EndOfStream
                self._sync_waiting = True
                try:
                    if not self._ready.wait(timeout):
                        raise TimeoutError
                finally:
                    self._sync_waiting = False
            return self._items.popleft()

    def get_future(self) -> asyncio.Future[T]:
        """For a consumer on the producer's loop: grant a credit and return a future of the next
        item (:class:`EndOfStream` once closed and drained). The producer resolves it directly, so one
        turn of the loop usually delivers the batch; a consumer that drives the loop itself
        runs ``loop.run_until_complete(future)``."""
        fut: asyncio.Future[T] = self._loop.create_future()
        with self._lock:
            self._grant(from_loop=True)
            if self._items:
                fut.set_result(self._items.popleft())
            elif self._closed:
                fut.set_exception(EndOfStream())
            else:
                self._pending_get = fut
        return fut

    async def aget(self) -> T:
        """Get for a consumer coroutine on the producer's loop."""
        return await self.get_future()
