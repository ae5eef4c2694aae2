"""Bounded in-flight requests and bytes: a FIFO-fair limit for one event loop, and one such limit
per event loop a storage is read from.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque

__all__ = ["InflightLimit", "PerLoop"]


class InflightLimit:
    """A FIFO-fair limit on requests and bytes in flight, for one event loop.

    A single acquisition larger than the byte budget is admitted when nothing else is in flight,
    so an oversized request waits its turn instead of deadlocking.
    """

    def __init__(self, max_requests: int, max_bytes: int, peak: list[int] | None = None) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = 0
        self.nbytes = 0
        self.peak_bytes = 0
        #: Where the peak is also kept, beyond this loop's life (:class:`PerLoop`).
        self._peak = [0] if peak is None else peak
        self._waiters: deque[tuple[int, int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int, b: int) -> bool:
        if self.requests == 0:
            return True
        return self.requests + n <= self.max_requests and self.nbytes + b <= self.max_bytes

    def _take(self, n: int, b: int) -> None:
        self.requests += n
        self.nbytes += b
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self._peak[0] = max(self._peak[0], self.nbytes)

    async def acquire(self, n: int, b: int) -> None:
        if not self._waiters and self._fits(n, b):
            self._take(n, b)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, b, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n, b)  # granted, then cancelled before we could use it
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._wake()
            raise

    def release(self, n: int, b: int) -> None:
        self.requests -= n
        self.nbytes -= b
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, b, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n, b):
                return
            self._waiters.popleft()
            self._take(n, b)
            fut.set_result(None)


class PerLoop:
    """One :class:`InflightLimit` per event loop (a storage may be read from several loops)."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self._args = (max_requests, max_bytes)
        self._peak = [0]  # the peak over every loop, those closed since included
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, InflightLimit] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> tuple[int, int]:
        return self._args  # the limits of each loop stay with that loop's process

    def __setstate__(self, args: tuple[int, int]) -> None:
        self.__init__(*args)  # type: ignore[misc]

    def get(self) -> InflightLimit:
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = InflightLimit(*self._args, peak=self._peak)
        return limit

    def peak_bytes(self) -> int:
        return self._peak[0]
