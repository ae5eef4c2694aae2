"""The chunk cache's schedule: what the plan reads next, chunk by chunk, so that downloads
follow the plan and the chunk needed furthest in the future is evicted first (Belady's rule)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["FIRST_READ_GRACE_SECONDS", "INF", "MIN_USE_DENOMINATOR", "ChunkSchedule"]

I64 = npt.NDArray[np.int64]

#: After a new plan, downloads wait for its first read to complete, at most this long: the
#: first batch does not share the link with a chunk's download.
FIRST_READ_GRACE_SECONDS = 1.0


#: A full cache evicts for a chunk only if the planned reads within the horizon use at least
#: 1/this of its bytes: where windows touch far more chunks than the limit holds (a dataset far
#: larger than a read window, shuffled), a download would serve a row or two before it is
#: evicted again, and reading those rows directly costs a fraction of the chunk.
MIN_USE_DENOMINATOR = 4


#: The planner looks ahead until its windows touch this many times the chunks the limit holds.
HORIZON_FACTOR = 2


MAX_HORIZON_WINDOWS = 65536


INF: Final = 1 << 62


class ChunkSchedule:
    """The plan and Belady's rule: which chunk to download next, which to evict, when to wait.

    Bookkeeping only, with no I/O and no lock of its own: the cache's condition guards it and
    every method is called with it held. It is apart from the threads and the folder that carry
    the policy out so that the policy reads on its own.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # chunks the limit holds
        # The plan: hinted windows not yet started, oldest first (position, key, chunks, bytes
        # read from each or None: all), each chunk's uses in them and the bytes those read.
        self.future: deque[tuple[int, tuple[int, int, int], I64, I64 | None]] = deque()
        self.uses: dict[int, deque[int]] = {}
        self.planned: dict[int, int] = {}
        self.hint: Iterator[tuple[Any, ...]] | None = None
        self.next_pos = 0
        self.now = -1
        self.stalled_at: int | None = None  # no room at this position: wait for the reader
        self.grace_until = 0.0  # no download starts before this (monotonic), see reset()
        self.skip: set[int] = set()  # failed to download under this hint: read remotely

    def reset(self, windows: Iterable[tuple[Any, ...]]) -> None:
        """A new plan (see ``ChunkCache.plan``); downloads wait for its first read, a while."""
        self.future.clear()
        self.uses.clear()
        self.planned.clear()
        self.skip.clear()
        self.hint = iter(windows)
        self.next_pos = 0
        self.now = -1
        self.stalled_at = None
        self.grace_until = time.monotonic() + FIRST_READ_GRACE_SECONDS

    def refill(self) -> None:
        """Take windows from the hint until they touch ``HORIZON_FACTOR`` times the capacity."""
        while self.hint is not None and len(self.future) < MAX_HORIZON_WINDOWS:
            if len(self.uses) >= HORIZON_FACTOR * self.capacity:
                return
            item = next(self.hint, None)
            if item is None:
                self.hint = None
                return
            key, gids, *rest = item
            used: I64 | None = rest[0] if rest else None
            pos = self.next_pos
            self.next_pos += 1
            self.future.append((pos, key, gids, used))
            amounts = [INF] * len(gids) if used is None else used.tolist()
            for g, b in zip(gids.tolist(), amounts, strict=True):
                self.uses.setdefault(g, deque()).append(pos)
                self.planned[g] = self.planned.get(g, 0) + b

    def advance(self, key: tuple[int, int, int]) -> bool:
        """A read of the window ``key`` starts: the plan's position moves to it (True if it did)."""
        pos = -1
        for i, (p, k, _g, _u) in enumerate(self.future):
            if i >= 16:
                return False  # not one of the next windows: a read outside the plan
            if k == key:
                pos = p
                break
        if pos < 0:
            return False
        while self.future and self.future[0][0] <= pos:
            p, _k, gids, used = self.future.popleft()
            amounts = [INF] * len(gids) if used is None else used.tolist()
            for g, b in zip(gids.tolist(), amounts, strict=True):
                left = self.planned.get(g, 0) - b
                if left > 0:
                    self.planned[g] = left
                else:
                    self.planned.pop(g, None)
                dq = self.uses.get(g)
                if dq is not None:
                    while dq and dq[0] <= p:
                        dq.popleft()
                    if not dq:
                        del self.uses[g]
        self.now = pos
        return True

    def next_use(self, gid: int) -> int:
        dq = self.uses.get(gid)
        return dq[0] if dq else INF

    def candidate(
        self, local: Container[int], inflight: Container[int], worth: Callable[[int], bool] | None = None
    ) -> tuple[int, int] | None:
        """The chunk the plan needs soonest that is neither on disk nor on its way (nor refused
        by ``worth``), and when."""
        for pos, _key, gids, _used in self.future:
            for g in gids.tolist():
                fetch = g not in local and g not in inflight and g not in self.skip
                if fetch and (worth is None or worth(g)):
                    return g, pos
        return None

    def worth_evicting_for(self, gid: int, nbytes: int) -> bool:
        """Whether the planned reads use enough of chunk ``gid`` (``nbytes`` long) to evict
        another for it (:data:`MIN_USE_DENOMINATOR`)."""
        return self.planned.get(gid, 0) * MIN_USE_DENOMINATOR >= nbytes

    def victim(self, evictable: Iterable[int], when: int) -> int | None:
        """Of ``evictable``, the chunk needed furthest in the future, if later than ``when``."""
        victim, best = -1, -1
        for v in evictable:
            nu = self.next_use(v)
            if nu > best:
                victim, best = v, nu
        return None if victim < 0 or best <= when else victim
