"""A bounded local cache of an object-store dataset's chunks, filled in plan order.

``open_stream(url, cache_dir=..., cache_max_bytes=...)`` with a limit smaller than the dataset.
Every data object is cut into aligned *chunks* (``cache_chunk_bytes``, 16 MiB by default: one
GET per chunk costs a round trip per 16 MiB, so the request rate is no longer what bounds a
read, and a limit of a few GiB still holds hundreds of them). The loader tells the storage the
windows it will read (``will_read``, from the epoch plan); a planner thread walks them in order
and downloads each chunk they touch before it is needed, a few chunks at a time, each as a few
large ranged GETs in parallel (one connection's bandwidth is often far below the link's). A
chunk is usable as soon as it is complete. When the folder is full, the chunk needed furthest
in the future by the plan is evicted (Belady's rule), and only if it is needed later than the
chunk that would replace it; otherwise the planner waits for the reader to move on. Reads that
find their chunks on disk read them there; a read whose chunk is being downloaded by this
process waits for it (a short while: ``CHUNK_WAIT_SECONDS``); any other read goes to the object
store as without a cache. Downloads under a new plan wait for its first read (at most
``FIRST_READ_GRACE_SECONDS``), so a cold cache costs no first-batch latency.

The folder, ``<cache_dir>/<name>-<digest>.chunks``, is shared by every process of a node (ranks,
other jobs): chunk ``g`` is ``c<g>.<sha256 prefix>``, written under a temporary name, fsynced
and renamed into place, so a name without ``.tmp`` is complete. One process downloads a chunk
while holding ``locks/c<g>.lock`` (``flock``); a process killed mid-download leaves only a
temporary file, which the next process that takes the lock (the kernel released it) removes.
The byte limit holds for the folder as a whole: space is reserved under ``budget.lock`` by
creating the temporary file at its full size, so the sum of the folder's file sizes (counted in
4 KiB blocks) never exceeds ``cache_max_bytes``.

Faults never change what is read: a chunk is checked against the digest in its name the first
time this process uses it, and a damaged one is deleted and read remotely; a folder that cannot
be written (read-only, full, a file-size limit) stops the downloads with one warning and reads
go to the object store. An object that does not match the manifest (a chunk that is the whole
object fails its checksum, or the object changed on the store since it was opened) is refused:
every read after it raises :class:`DatasetIntegrityError` (:attr:`ChunkCache.damaged`).
Warnings are issued from the reading thread, never from a background thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import hashlib
import itertools
import os
import secrets
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._manifest import Manifest
from guideloom.storage._objstore import io_executor
from guideloom.storage._ranges import Job, Layout, fill, pieces_of

__all__ = ["CHUNK_BYTES", "ChunkCache"]

I64 = npt.NDArray[np.int64]

#: Default chunk size (``cache_chunk_bytes``).
CHUNK_BYTES: Final = 16 * 2**20
#: Chunks downloaded at once by one process, and the ranged GETs each is fetched as.
FETCHES_IN_FLIGHT = 4
PART_BYTES = 4 * 2**20
#: How long a read waits for a chunk this process is downloading before reading remotely.
CHUNK_WAIT_SECONDS = 0.25
#: After a new plan, downloads wait for its first read to complete, at most this long: the
#: first batch does not share the link with a chunk's download.
FIRST_READ_GRACE_SECONDS = 1.0
#: Space is counted in blocks of this many bytes (a file takes whole blocks on disk).
BLOCK: Final = 4096
#: How long a download waits for another process that holds the chunk's lock.
LOCK_WAIT_SECONDS = 60.0
#: A full cache evicts for a chunk only if the planned reads within the horizon use at least
#: 1/this of its bytes: where windows touch far more chunks than the limit holds (a dataset far
#: larger than a read window, shuffled), a download would serve a row or two before it is
#: evicted again, and reading those rows directly costs a fraction of the chunk.
MIN_USE_DENOMINATOR = 4
#: The planner looks ahead until its windows touch this many times the chunks the limit holds.
HORIZON_FACTOR = 2
MAX_HORIZON_WINDOWS = 65536
INF: Final = 1 << 62

_LIVE: weakref.WeakSet[ChunkCache] = weakref.WeakSet()


def _stop_all() -> None:
    for cache in list(_LIVE):
        cache.stop()


# As for the whole copy (_cache.py): stop downloads before the interpreter joins its threads.
threading._register_atexit(_stop_all)  # type: ignore[attr-defined]


def blocks_of(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


# The filesystem boundary: the tests inject faults (ENOSPC, EROFS) here.
def _create(path: Path, size: int) -> None:
    """Create ``path`` at its full ``size`` (the reservation that the folder's size shows)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)  # nothing of a reservation that failed (EFBIG, ENOSPC)
        raise
    os.close(fd)


def _write(path: Path, data: memoryview) -> None:
    """Write ``data`` to ``path`` from its start and fsync it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)


class _Table:
    """Every data object cut into aligned chunks; chunk ids are global across objects."""

    def __init__(self, manifest: Manifest, chunk_bytes: int) -> None:
        files: dict[str, tuple[int, str]] = {}
        for _name, _spec, f in manifest.all_files():
            files[f.path] = (f.nbytes, f.sha256)
        self.chunk = chunk_bytes
        self.paths = sorted(files)
        self.index = {p: i for i, p in enumerate(self.paths)}
        self.sizes = [files[p][0] for p in self.paths]
        self.sha256 = [files[p][1] for p in self.paths]
        counts = [-(-s // chunk_bytes) for s in self.sizes]
        self.base = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.count = int(self.base[-1])

    def span(self, gid: int) -> tuple[int, int, int]:
        """(object index, first byte, end byte) of chunk ``gid``."""
        f = int(np.searchsorted(self.base, gid, side="right")) - 1
        start = (gid - int(self.base[f])) * self.chunk
        return f, start, min(self.sizes[f], start + self.chunk)

    def nbytes(self, gid: int) -> int:
        _f, s, e = self.span(gid)
        return e - s

    def gids(self, path: str, start: int, end: int) -> range:
        """Chunks that bytes ``[start, end)`` of object ``path`` touch."""
        b = int(self.base[self.index[path]])
        return range(b + start // self.chunk, b + (end - 1) // self.chunk + 1)

    def of_rows(self, layouts: Mapping[str, Layout], starts: I64, length: int) -> I64:
        """Sorted distinct chunks that stream windows ``[s, s + length)`` (elements) touch."""
        return self.use_of_rows(layouts, starts, length)[0]

    def use_of_rows(self, layouts: Mapping[str, Layout], starts: I64, length: int) -> tuple[I64, I64]:
        """:meth:`of_rows` and the bytes the windows read from each of those chunks."""
        n = len(starts)
        parts = [
            self.use_of_spans(
                layout, starts * layout.dtype.itemsize, np.full(n, length * layout.dtype.itemsize)
            )
            for layout in layouts.values()
        ]
        return _merge([g for g, _b in parts], [b for _g, b in parts])

    def of_spans(self, layout: Layout, starts: I64, lengths: I64) -> I64:
        """Sorted distinct chunks that bytes ``[s, s + n)`` of ``layout``'s array touch."""
        return self.use_of_spans(layout, starts, lengths)[0]

    def use_of_spans(self, layout: Layout, starts: I64, lengths: I64) -> tuple[I64, I64]:
        """:meth:`of_spans` and the bytes of the spans that lie in each of those chunks."""
        lengths = np.asarray(lengths, dtype=np.int64)
        k, lo, n, _d = pieces_of(
            layout, np.asarray(starts, dtype=np.int64), lengths, np.zeros(len(lengths), np.int64)
        )
        if not len(k):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        fidx = np.asarray([self.index[p] for p in layout.paths], dtype=np.int64)[k]
        base = self.base[fidx]
        first = base + lo // self.chunk
        last = base + (lo + n - 1) // self.chunk
        one = first == last
        extra_g: list[int] = []
        extra_b: list[int] = []
        for i in np.flatnonzero(~one).tolist():  # a span across chunks: each chunk its part
            s, e = int(lo[i]), int(lo[i] + n[i])
            for g in range(int(first[i]), int(last[i]) + 1):
                cs = (g - int(base[i])) * self.chunk
                extra_g.append(g)
                extra_b.append(min(e, cs + self.chunk) - max(s, cs))
        gids = [first[one], np.asarray(extra_g, dtype=np.int64)]
        return _merge(gids, [n[one], np.asarray(extra_b, dtype=np.int64)])


def _merge(gids: list[I64], nbytes: list[I64]) -> tuple[I64, I64]:
    """Sorted distinct chunks of ``gids`` and the sum of ``nbytes`` for each."""
    if not gids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    out, inverse = np.unique(np.concatenate(gids), return_inverse=True)
    used = np.bincount(inverse.reshape(-1), weights=np.concatenate(nbytes), minlength=len(out))
    return out.astype(np.int64), used.astype(np.int64)


class ChunkCache:
    """One dataset's chunk cache under ``root``: the planner, the downloads and the local reads.

    ``fetch(path, start, end)`` returns bytes ``[start, end)`` of object ``path`` (blocking, with
    its own retries); it runs on the download threads.

    This class is the reading side and the faults it warns of; its parts are the plan and
    Belady's rule (``_Schedule``), the shared folder (``_Folder``) and the background downloads
    (``_Downloader``). One condition, ``_cond``, guards the state of all of them.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        location: str,
        manifest: Manifest,
        fetch: Callable[[str, int, int], Any],
        *,
        max_bytes: int,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        # A quarter of the limit at most, so that the cache always holds a few chunks.
        chunk = max(BLOCK, min(chunk_bytes, max_bytes // 4 // BLOCK * BLOCK))
        self.chunk_bytes = chunk
        self.max_bytes = max_bytes
        self.root = Path(root).expanduser()
        # The limit is part of the folder's identity: each process enforces its own limit on the
        # folder it shares, so processes with different limits must not share one.
        digest = hashlib.sha256(
            location.encode()
            + b"\0"
            + manifest.to_json_bytes()
            + b"\0"
            + str(chunk).encode()
            + b"\0"
            + str(max_bytes).encode()
        ).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in location.rstrip("/").split("/")[-1])
        self.folder = self.root / f"{name or 'dataset'}-{digest}.chunks"
        self.location = location
        self.table = _Table(manifest, chunk)
        self._cond = threading.Condition()
        self._pinned: dict[int, int] = {}  # chunk -> reads using it now (not evicted)
        self._faults: list[str] = []  # warnings to issue from the reading thread
        self._warned: set[str] = set()
        self.local_reads = 0
        self.remote_reads = 0
        self._schedule = _Schedule(max(1, max_bytes // max(1, chunk)))
        self._disk = _Folder(self.folder, self.table, location, self._cond, self._fault)
        self._downloader = _Downloader(
            fetch, location, max_bytes, self._cond, self._schedule, self._disk, self._pinned, self._fault
        )
        _LIVE.add(self)
        self._disk.rescan()

    def plan(self, windows: Iterable[tuple[Any, ...]]) -> None:
        """The windows the reader will read next, in order: a key per read, its chunks and
        (optionally) the bytes it reads from each (``_Table.use_of_rows``); without them every
        chunk counts as fully used.

        Replaces the previous plan (a new epoch, or an iterator resumed elsewhere). Consumed
        lazily, as far ahead as the horizon reaches.
        """
        with self._cond:
            self._schedule.reset(windows)
            self._cond.notify_all()
        self._downloader.start()

    def stop(self) -> None:
        """Stop the planner and the downloads (their temporary files are removed), and wait."""
        self._downloader.stop()

    # -- state kept by the parts, read here by callers and the tests -----------------------------
    @property
    def last_error(self) -> str | None:
        """The last download that failed without a fault of the folder (the reads went remote)."""
        return self._downloader.last_error

    @property
    def downloads(self) -> int:
        return self._downloader.downloads

    @property
    def evictions(self) -> int:
        return self._downloader.evictions

    @property
    def _local(self) -> dict[int, str]:
        return self._disk.local

    @property
    def _inflight(self) -> dict[int, concurrent.futures.Future[None]]:
        return self._downloader.inflight

    @property
    def _fetching(self) -> set[int]:
        return self._downloader.fetching

    @property
    def _disabled(self) -> bool:
        return self._downloader.disabled

    @property
    def _now(self) -> int:
        return self._schedule.now

    @property
    def _stalled_at(self) -> int | None:
        return self._schedule.stalled_at

    def _refill_locked(self) -> None:
        self._schedule.refill()

    def _candidate_locked(self) -> tuple[int, int] | None:
        return self._downloader.candidate_locked()

    # -- faults ------------------------------------------------------------------------------------
    def _fault(self, message: str, *, disable: bool = False) -> None:
        with self._cond:
            if disable:
                self._downloader.disabled = True
                self._cond.notify_all()
            if message not in self._warned:
                self._warned.add(message)
                self._faults.append(message)

    def warn_pending(self) -> None:
        """Issue the warnings recorded by background threads (from the reading thread)."""
        if not self._faults:
            return
        with self._cond:
            faults, self._faults = self._faults, []
        for message in faults:
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # -- reads ---------------------------------------------------------------------------------------
    async def run(self, jobs: list[Job], key: tuple[int, int, int] | None, remote_run: Any) -> None:
        """Serve ``jobs``: ranges whose chunks are on disk locally, the rest with ``remote_run``.

        ``key`` identifies the read among the planned windows (None: not a planned read).
        """
        self.warn_pending()
        self.check_intact()
        local, waits, far, pins = self._split(jobs, key)
        done = False
        try:
            loop = asyncio.get_running_loop()

            async def nearby() -> None:
                if waits:
                    # A chunk on its way is waited for (no second GET of its bytes), up to
                    # CHUNK_WAIT_SECONDS: a read then goes remote (a first batch stays fast).
                    await asyncio.wait([asyncio.wrap_future(f) for f in waits], timeout=CHUNK_WAIT_SECONDS)
                if local:
                    missed = await loop.run_in_executor(io_executor(), self._disk.serve, local)
                    if missed:
                        await remote_run(missed)

            from guideloom.storage._client import gather_first_error

            await gather_first_error([nearby(), remote_run(far)] if far else [nearby()])
            done = True
        finally:
            with self._cond:
                if done and self._schedule.grace_until:
                    self._schedule.grace_until = 0.0  # a read is in: downloads may start
                    self._cond.notify_all()
                for g in pins:
                    n = self._pinned[g] - 1
                    if n:
                        self._pinned[g] = n
                    else:
                        del self._pinned[g]
                        self._schedule.stalled_at = None  # it may be evicted now: the planner looks again
                if pins:
                    self._cond.notify_all()
        self.warn_pending()

    @property
    def damaged(self) -> str | None:
        """Why the dataset is refused, once a download found an object that does not match the
        manifest; None otherwise."""
        return self._downloader.damaged

    def check_intact(self) -> None:
        if self._downloader.damaged is not None:
            raise DatasetIntegrityError(self._downloader.damaged)

    def _split(
        self, jobs: list[Job], key: tuple[int, int, int] | None
    ) -> tuple[list[Job], list[concurrent.futures.Future[None]], list[Job], list[int]]:
        """Under the lock: move the plan to ``key``, route ``jobs`` (``_route``) and pin the chunks
        read locally; the downloads of those still on their way are returned to wait for."""
        waits: dict[int, concurrent.futures.Future[None]] = {}
        with self._cond:
            if key is not None and self._schedule.advance(key):
                self._cond.notify_all()
            disk, downloader = self._disk, self._downloader
            local, pins, far = _route(self.table, jobs, lambda g: g in disk.local or g in downloader.fetching)
            for g in pins:
                self._pinned[g] = self._pinned.get(g, 0) + 1
                if g not in disk.local:
                    waits[g] = downloader.inflight[g]
            self.local_reads += len(local)
            self.remote_reads += sum(len(j.starts) for j in far)
        return local, list(waits.values()), far, pins

    def stats(self) -> dict[str, int]:
        """Chunks downloaded and evicted, and ranges read from disk and remotely."""
        return {
            "cache_downloads": self.downloads,
            "cache_evictions": self.evictions,
            "cache_local_ranges": self.local_reads,
            "cache_remote_ranges": self.remote_reads,
        }


class _Schedule:
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


def _route(
    table: _Table, jobs: list[Job], here: Callable[[int], bool]
) -> tuple[list[Job], list[int], list[Job]]:
    """Where a read's ranges are served: each part of a chunk that is ``here`` as a one-range local
    job (listed with its chunk, to pin), the rest as remote ranges. No state of its own: apart
    from ``ChunkCache._split``, which only adds the lock and the pins around it."""
    local: list[Job] = []
    pins: list[int] = []
    far: list[Job] = []
    for job in jobs:
        rest = Job(job.path, job.dest)
        for s, e, p in zip(job.starts, job.ends, job.pieces, strict=True):
            gids = table.gids(job.path, s, e)
            # A range is cut at chunk boundaries: each chunk's part is read where that
            # chunk is; consecutive parts of absent chunks stay one remote range.
            parts = [(s, e, p)] if len(gids) == 1 else _cut(table, gids, s, e, p)
            run: tuple[int, int, list[tuple[int, int, int]]] | None = None
            for g, (ps, pe, pp) in zip(gids, parts, strict=True):
                if here(g):
                    local.append(Job(job.path, job.dest, [ps], [pe], [pp]))
                    pins.append(g)
                    continue
                if run is not None and run[1] == ps:
                    run = (run[0], pe, run[2] + pp)
                    continue
                if run is not None:
                    rest.starts.append(run[0])
                    rest.ends.append(run[1])
                    rest.pieces.append(run[2])
                run = (ps, pe, list(pp))
            if run is not None:
                rest.starts.append(run[0])
                rest.ends.append(run[1])
                rest.pieces.append(run[2])
        if rest.starts:
            far.append(rest)
    return local, pins, far


def _cut(
    table: _Table, gids: range, s: int, e: int, pieces: list[tuple[int, int, int]]
) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Range ``[s, e)`` and its pieces (object offset, length, destination offset), cut into
    one part per chunk of ``gids``."""
    out = []
    for g in gids:
        _f, cs, ce = table.span(g)
        lo, hi = max(s, cs), min(e, ce)
        mine = []
        for ps, pl, pd in pieces:
            a, b = max(ps, lo), min(ps + pl, hi)
            if a < b:
                mine.append((a, b - a, pd + a - ps))
        out.append((lo, hi, mine))
    return out


class _Folder:
    """The folder shared by the node's processes, and this process's index of its chunks.

    The cache's disk protocol, in one place: per-chunk ``flock`` locks and their dead holders,
    the scan, the space budget's lock and reservations, completing a download, and the local
    reads with their once-per-process checksum. The index (``local``, ``verified``) is guarded
    by the cache's condition ``cond``; faults are reported to ``fault``.
    """

    def __init__(
        self,
        path: Path,
        table: _Table,
        location: str,
        cond: threading.Condition,
        fault: Callable[[str], None],
    ) -> None:
        self.path = path
        self.table = table
        self.location = location
        self._cond = cond
        self._fault = fault
        self.local: dict[int, str] = {}  # chunk -> file name: complete on disk, as last seen
        self.verified: set[int] = set()

    # -- locks -------------------------------------------------------------------------------------
    def try_lock(self, gid: int, stopped: Callable[[], bool], *, wait: bool = False) -> int | None:
        """Chunk ``gid``'s lock (an open descriptor holding ``flock``), or None: another process
        holds it (after ``LOCK_WAIT_SECONDS`` with ``wait``, or once ``stopped()``)."""
        locks = self.path / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (LOCK_WAIT_SECONDS if wait else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if stopped() or time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.02)

    def _dead(self, gid: int) -> bool:
        """Whether nobody holds chunk ``gid``'s lock (its temporary file is a crashed download's)."""
        try:
            fd = os.open(self.path / "locks" / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def budget(self) -> Any:
        """The folder's space budget lock (across processes), for a ``with`` block."""
        return _FileLock(self.path / "budget.lock")

    # -- the scan and the space --------------------------------------------------------------------
    def rescan(self) -> None:
        try:
            self.scan()
        except OSError:
            pass  # no folder yet (or unreadable): nothing is on disk

    def scan(self, own: int = -1) -> int:
        """Learn the folder's complete chunks (others' too); drop temporary files of dead
        downloads. Returns the bytes the folder holds (in blocks). ``own``: a chunk whose lock
        this process holds (any temporary file of it is a dead one)."""
        used = 0
        found: dict[int, str] = {}
        with self._cond:
            before = dict(self.local)  # what completes during the listing is not dropped
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            entries = []
        for e in entries:
            name = e.name
            if not name.startswith("c") or "." not in name:
                continue
            head, _, tail = name.partition(".")
            try:
                gid = int(head[1:])
            except ValueError:
                continue
            if gid >= self.table.count:
                continue
            if tail.startswith("tmp-"):
                if gid == own or self._dead(gid):
                    try:
                        os.unlink(e.path)
                        continue
                    except FileNotFoundError:
                        pass  # renamed since the listing: complete now, and counted as such
                used += blocks_of(self.table.nbytes(gid))
            else:
                if gid in found:  # two copies of one chunk: keep one
                    Path(e.path).unlink(missing_ok=True)
                    continue
                found[gid] = name
                used += blocks_of(self.table.nbytes(gid))
        with self._cond:
            for g, name in before.items():
                if g not in found and self.local.get(g) == name:
                    del self.local[g]
                    self.verified.discard(g)
            for g, name in found.items():
                if self.local.get(g) != name:
                    self.local[g] = name
                    self.verified.discard(g)
        return used

    def reserve(self, gid: int) -> Path:
        """Chunk ``gid``'s temporary file, created at its full size (under ``budget()``)."""
        tmp = self.path / f"c{gid:09d}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _create(tmp, self.table.nbytes(gid))
        return tmp

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def complete(self, gid: int, tmp: Path, data: memoryview, digest: str) -> str:
        """Write chunk ``gid``'s bytes into its reserved ``tmp``, fsync it and rename it into
        place (complete, or not there at all); returns its file name."""
        _write(tmp, data)
        final = f"c{gid:09d}.{digest[:32]}"
        os.rename(tmp, self.path / final)
        return final

    # -- local reads -------------------------------------------------------------------------------
    def serve(self, jobs: list[Job]) -> list[Job]:
        """On an I/O thread: fill ``jobs`` (one range each) from the chunk files; return those
        that could not be (evicted meanwhile, damaged, unreadable) for a remote read."""
        missed: list[Job] = []
        for job in jobs:
            s, e = job.starts[0], job.ends[0]
            buf = bytearray(e - s)
            ok = True
            for g in self.table.gids(job.path, s, e):
                with self._cond:
                    name = self.local.get(g)
                    checked = g in self.verified
                if name is None or (not checked and not self._verify(g, name)):
                    ok = False
                    break
                _f, cs, ce = self.table.span(g)
                lo, hi = max(s, cs), min(e, ce)
                try:
                    fd = os.open(self.path / name, os.O_RDONLY)
                except FileNotFoundError:  # evicted by another process
                    with self._cond:
                        if self.local.get(g) == name:
                            del self.local[g]
                    ok = False
                    break
                except OSError as exc:
                    self._fault(
                        f"guideloom cannot read its chunk cache {self.path} ({exc}); reading remotely"
                    )
                    ok = False
                    break
                try:
                    got = os.preadv(fd, [memoryview(buf)[lo - s : hi - s]], lo - cs)
                finally:
                    os.close(fd)
                if got != hi - lo:
                    ok = False
                    break
            if ok:
                fill(job, [buf])
            else:
                missed.append(job)
        return missed

    def _verify(self, gid: int, name: str) -> bool:
        """Check a chunk found on disk against the digest in its name (once per process)."""
        try:
            data = (self.path / name).read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fault(f"guideloom cannot read its chunk cache {self.path} ({exc}); reading remotely")
            return False
        digest = hashlib.sha256(data).hexdigest()[:32]
        good = len(data) == self.table.nbytes(gid) and digest == name.split(".")[1]
        with self._cond:
            if good:
                self.verified.add(gid)
                return True
            if self.local.get(gid) == name:
                del self.local[gid]
        (self.path / name).unlink(missing_ok=True)
        self._fault(
            f"guideloom's chunk cache {self.path} held a damaged chunk ({name}); it was deleted "
            f"and {self.location} is read from the object store instead, nothing is lost"
        )
        return False


class _Downloader:
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
        schedule: _Schedule,
        disk: _Folder,
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
                    raise _RemoteDamaged(
                        f"{self._location}: object {self._table.paths[f]!r} does not match its "
                        "checksum in the manifest (downloaded whole to the chunk cache, none of it "
                        "is read): write or copy the dataset again"
                    )
                if self.stopped:
                    raise InterruptedError("the cache was stopped")
                final = self._disk.complete(gid, tmp, data, digest)
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
            raise _FetchFailed(str(exc)) from None  # not the folder's fault
        if got.nbytes != span[1] - span[0]:
            raise _FetchFailed(f"short read: {got.nbytes} of {span[1] - span[0]} bytes")
        return got

    if len(spans) == 1:
        return one(spans[0])
    parts = list(io_executor().map(one, spans))
    return memoryview(b"".join(parts))


class _FetchFailed(Exception):
    """The object store failed a chunk's download (after its retries): the reads go remote."""


class _RemoteDamaged(DatasetIntegrityError):
    """A whole object, downloaded as one chunk, does not match the manifest's checksum."""


class _FileLock:
    """``flock`` on ``path`` for the ``with`` block (the folder's space budget)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
