"""The chunk cache's downloader: a planner thread that walks the plan and downloads the chunks
it touches ahead of their reads, a few at a time, each as a few large ranged GETs."""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache._chunk_folder import LOCK_WAIT_SECONDS, ChunkFolder
from guideloom.storage._cache._chunk_schedule import ChunkSchedule
from guideloom.storage._cache._chunk_table import blocks_of
from guideloom.storage._remote._objstore import io_executor

__all__ = ["Downloader", "FETCHES_IN_FLIGHT", "RemoteDamaged"]

I64 = npt.NDArray[np.int64]


#: Chunks downloaded at once by one process, and the ranged GETs each is fetched as.
FETCHES_IN_FLIGHT = 4


PART_BYTES = 4 * 2**20


class Downloader:
    """The background side: the planner thread, and the pool that downloads chunks into the folder.

    The planner takes the chunk the schedule needs soonest, makes room for it under the folder's
    budget lock (evicting by the schedule's rule, never a chunk ``pinned`` by a read) and hands
    its download to the pool; a chunk whose lock another process holds is waited for on the pool.
    The reads only see what it has started (``inflight``, ``fetching``) and finished (the
    folder's index). Its state is guarded by the cache's condition ``cond``.
    """

    def __init__(
        self,
        fetch: Callable[[str, int, int], Any],
        location: str,
        max_bytes: int,
        cond: threading.Condition,
        schedule: ChunkSchedule,
        disk: ChunkFolder,
        pinned: Mapping[int, int],
        fault: Callable[..., None],
    ) -> None:
        self._fetch = fetch
        self._location = location
        self._max_bytes = max_bytes
        self._cond = cond
        self._schedule = schedule
        self._disk = disk
        self._table = disk.table
        self._pinned = pinned
        self._fault = fault
        self.inflight: dict[int, concurrent.futures.Future[None]] = {}
        self.fetching: set[int] = set()  # inflight chunks this process is downloading now
        self.stopped = False
        self.disabled = False
        self._planner: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.downloads = 0
        self.evictions = 0
        self.last_error: str | None = None
        self.damaged: str | None = None  # an object that does not match the manifest: refused

    def start(self) -> None:
        with self._cond:
            if self.disabled or self.stopped or (self._planner is not None and self._planner.is_alive()):
                return
            self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(
                FETCHES_IN_FLIGHT, thread_name_prefix="guideloom-chunks"
            )
            self._planner = threading.Thread(target=self._plan_loop, name="guideloom-chunk-planner")
            self._planner.start()

    def stop(self) -> None:
        """Stop the planner and the downloads (their temporary files are removed), and wait."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()
            planner, pool = self._planner, self._pool
            self._planner = self._pool = None
        if planner is not None and planner is not threading.current_thread():
            planner.join()
        if pool is not None:
            pool.shutdown(wait=True)
        with self._cond:
            self.stopped = False

    def candidate_locked(self) -> tuple[int, int] | None:
        """The chunk the plan needs soonest that is neither on disk nor on its way; once the
        chunks this process knows of fill the limit, only one worth evicting for."""
        schedule, local = self._schedule, self._disk.local
        worth = None
        if len(local) + len(self.inflight) >= schedule.capacity:

            def worth(g: int) -> bool:
                return schedule.worth_evicting_for(g, self._table.nbytes(g))

        return schedule.candidate(local, self.inflight, worth)

    def _plan_loop(self) -> None:
        """The planner: take the chunk the plan needs soonest, reserve its room (here, one at a
        time, so reservations follow the plan's order), and hand its download to the pool."""
        while True:
            with self._cond:
                if self.stopped or self.disabled:
                    return
                self._schedule.refill()
                cand = None
                grace = self._schedule.grace_until - time.monotonic()
                if grace > 0:
                    self._cond.wait(grace)
                    continue
                if len(self.inflight) < FETCHES_IN_FLIGHT and self._schedule.stalled_at != self._schedule.now:
                    cand = self.candidate_locked()
                if cand is None:
                    self._cond.wait(0.5)
                    continue
                gid, when = cand
                fut: concurrent.futures.Future[None] = concurrent.futures.Future()
                self.inflight[gid] = fut
                pool = self._pool
            assert pool is not None
            lock = None
            try:
                lock = self._try_lock(gid)
                if lock is None:  # another process downloads it: wait for that on the pool
                    pool.submit(self._guard, gid, fut, self._after_other, gid, when)
                    continue
                tmp = self._prepare(gid, when)
            except BaseException as exc:
                if lock is not None:
                    os.close(lock)
                self._finish(gid, fut, exc)
                continue
            if tmp is None:
                os.close(lock)
                self._finish(gid, fut, None)
                continue
            pool.submit(self._guard, gid, fut, self._fetch_into, gid, tmp, lock)

    def _try_lock(self, gid: int, *, wait: bool = False) -> int | None:
        return self._disk.try_lock(gid, lambda: self.stopped, wait=wait)

    def _prepare(self, gid: int, when: int) -> Path | None:
        """Under the budget lock: the folder as it is now, then room reserved for ``gid`` (its
        temporary file), or None (it is complete already, or there is no room yet)."""
        with self._disk.budget():
            used = self._disk.scan(own=gid)
            if gid in self._disk.local:
                return None  # another process completed it
            return self._reserve(gid, when, used)

    def _reserve(self, gid: int, when: int, used: int) -> Path | None:
        """Make room for chunk ``gid`` (needed at ``when``) and reserve it, under the budget lock.

        Evicts the chunks needed furthest in the future, never one needed before ``when`` or in
        use; None if that does not make room."""
        need = blocks_of(self._table.nbytes(gid))
        if need > self._max_bytes:
            with self._cond:
                self._schedule.skip.add(gid)
            return None
        while used + need > self._max_bytes:
            with self._cond:
                local = self._disk.local
                evictable = (v for v in local if not self._pinned.get(v) and v not in self.fetching)
                victim = self._schedule.victim(evictable, when)
                if victim is None:
                    # No room before the reader moves on (decided at this position, under the
                    # lock that moves it, so a read that moved it meanwhile is not missed).
                    self._schedule.stalled_at = self._schedule.now
                    return None
                name = local.pop(victim)
                self._disk.verified.discard(victim)
                self._disk.blocks.pop(victim, None)
            self._disk.remove(name)
            self.evictions += 1
            used -= blocks_of(self._table.nbytes(victim))
        return self._disk.reserve(gid)

    def _after_other(self, gid: int, when: int) -> None:
        """Another process held the chunk's lock: wait for it, then use its chunk or take over
        (a holder that died released the lock and left only a temporary file)."""
        lock = self._try_lock(gid, wait=True)
        if lock is None:
            raise TimeoutError(f"another process held chunk {gid}'s lock for {LOCK_WAIT_SECONDS:.0f}s")
        try:
            tmp = self._prepare(gid, when)
        except BaseException:
            os.close(lock)
            raise
        if tmp is None:
            os.close(lock)
            return
        self._fetch_into(gid, tmp, lock)

    def _fetch_into(self, gid: int, tmp: Path, lock: int) -> None:
        """On the pool: download chunk ``gid`` into its reserved ``tmp``, fsync, rename it into
        place, and release its ``lock``."""
        try:
            with self._cond:
                self.fetching.add(gid)
            f, start, end = self._table.span(gid)
            try:
                data = _fetch_parts(self._fetch, self._table.paths[f], start, end)
                digest = hashlib.sha256(data).hexdigest()
                if start == 0 and end == self._table.sizes[f] and digest != self._table.sha256[f]:
                    raise RemoteDamaged(
                        f"{self._location}: object {self._table.paths[f]!r} does not match its "
                        "checksum in the manifest (downloaded whole to the chunk cache, none of it "
                        "is read): write or copy the dataset again"
                    )
                if self.stopped:
                    raise InterruptedError("the cache was stopped")
                final = self._disk.complete(gid, tmp, data)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            with self._cond:
                self._disk.local[gid] = final
                self._disk.verified.add(gid)
                self.downloads += 1
        finally:
            os.close(lock)  # releases it

    def _guard(self, gid: int, fut: concurrent.futures.Future[None], fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            self._finish(gid, fut, exc)
        else:
            self._finish(gid, fut, None)

    def _finish(self, gid: int, fut: concurrent.futures.Future[None], exc: BaseException | None) -> None:
        """A download ended (``exc``: how it failed): record it, wake the planner and readers."""
        if isinstance(exc, OSError) and not isinstance(exc, InterruptedError | TimeoutError):
            self._fault(  # the folder: full, read-only, a file-size limit
                f"guideloom cannot write its chunk cache {self._disk.path} ({exc}); reading "
                f"{self._location} from the object store instead, nothing is lost",
                disable=True,
            )
        elif isinstance(exc, DatasetIntegrityError):  # refused from now on, by every read
            with self._cond:
                if self.damaged is None:
                    self.damaged = str(exc)
        elif exc is not None:  # the object store after its retries, or a stop: reads go remote
            self.last_error = f"chunk {gid} of {self._location} was not cached: {exc}"
        with self._cond:
            self.inflight.pop(gid, None)
            self.fetching.discard(gid)
            if exc is not None:
                self._schedule.skip.add(gid)
            self._cond.notify_all()
        fut.set_result(None)


def _fetch_parts(fetch: Callable[[str, int, int], Any], path: str, start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of ``path`` as ``PART_BYTES`` ranges fetched concurrently on
    the I/O pool: one connection's bandwidth is often far below the link's."""
    bounds = [*range(start, end, PART_BYTES), end]
    spans = list(itertools.pairwise(bounds))

    def one(span: tuple[int, int]) -> memoryview:
        try:
            got = memoryview(fetch(path, *span))
        except DatasetIntegrityError:
            raise  # the object changed on the store: the dataset is refused
        except Exception as exc:
            raise FetchFailed(str(exc)) from None  # not the folder's fault
        if got.nbytes != span[1] - span[0]:
            raise FetchFailed(f"short read: {got.nbytes} of {span[1] - span[0]} bytes")
        return got

    if len(spans) == 1:
        return one(spans[0])
    parts = list(io_executor().map(one, spans))
    return memoryview(b"".join(parts))


class FetchFailed(Exception):
    """The object store failed a chunk's download (after its retries): the reads go remote."""


class RemoteDamaged(DatasetIntegrityError):
    """A whole object, downloaded as one chunk, does not match the manifest's checksum."""
