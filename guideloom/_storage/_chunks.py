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
go to the object store. Warnings are issued from the reading thread, never from a background
thread.
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ._objstore import io_executor
from ._ranges import Job, Layout, _pieces, fill
from .manifest import Manifest

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


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


# The filesystem boundary: the tests inject faults (ENOSPC, EROFS) here.
def _create(path: Path, size: int) -> None:
    """Create ``path`` at its full ``size`` (the reservation that the folder's size shows)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
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
        n = len(starts)
        parts = [
            self.of_spans(layout, starts * layout.dtype.itemsize, np.full(n, length * layout.dtype.itemsize))
            for layout in layouts.values()
        ]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def of_spans(self, layout: Layout, starts: I64, lengths: I64) -> I64:
        """Sorted distinct chunks that bytes ``[s, s + n)`` of ``layout``'s array touch."""
        lengths = np.asarray(lengths, dtype=np.int64)
        k, lo, n, _d = _pieces(
            layout, np.asarray(starts, dtype=np.int64), lengths, np.zeros(len(lengths), np.int64)
        )
        if not len(k):
            return np.zeros(0, np.int64)
        fidx = np.asarray([self.index[p] for p in layout.paths], dtype=np.int64)[k]
        first = self.base[fidx] + lo // self.chunk
        last = self.base[fidx] + (lo + n - 1) // self.chunk
        out = [first, last]
        for i in np.flatnonzero(last - first > 1).tolist():  # a span longer than a chunk
            out.append(np.arange(int(first[i]) + 1, int(last[i]), dtype=np.int64))
        return np.unique(np.concatenate(out))


class ChunkCache:
    """One dataset's chunk cache under ``root``: the planner, the downloads and the local reads.

    ``fetch(path, start, end)`` returns bytes ``[start, end)`` of object ``path`` (blocking, with
    its own retries); it runs on the download threads.
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
        digest = hashlib.sha256(
            location.encode() + b"\0" + manifest.to_json_bytes() + b"\0" + str(chunk).encode()
        ).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in location.rstrip("/").split("/")[-1])
        self.folder = self.root / f"{name or 'dataset'}-{digest}.chunks"
        self.location = location
        self.table = _Table(manifest, chunk)
        self._fetch = fetch
        self._cond = threading.Condition()
        self._local: dict[int, str] = {}  # chunk -> file name: complete on disk, as last seen
        self._verified: set[int] = set()
        self._pinned: dict[int, int] = {}  # chunk -> reads using it now (not evicted)
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        self._fetching: set[int] = set()  # inflight chunks this process is downloading now
        self._skip: set[int] = set()  # failed to download under this hint: read remotely
        # The plan: hinted windows not yet started, oldest first, and each chunk's uses in them.
        self._future: deque[tuple[int, tuple[int, int, int], I64]] = deque()
        self._uses: dict[int, deque[int]] = {}
        self._hint: Iterator[tuple[tuple[int, int, int], I64]] | None = None
        self._next_pos = 0
        self._now = -1
        self._stalled_at: int | None = None  # no room at this position: wait for the reader
        self._grace_until = 0.0  # no download starts before this (monotonic), see plan()
        self._stopped = False
        self._disabled = False
        self._faults: list[str] = []  # warnings to issue from the reading thread
        self._warned: set[str] = set()
        self._planner: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.downloads = 0
        self.evictions = 0
        self.local_reads = 0
        self.remote_reads = 0
        _LIVE.add(self)
        self._rescan_folder()

    # -- the plan ----------------------------------------------------------------------------------
    def plan(self, windows: Iterable[tuple[tuple[int, int, int], I64]]) -> None:
        """The windows the reader will read next, in order: a key per read and its chunks.

        Replaces the previous plan (a new epoch, or an iterator resumed elsewhere). Consumed
        lazily, as far ahead as the horizon reaches.
        """
        with self._cond:
            self._future.clear()
            self._uses.clear()
            self._skip.clear()
            self._hint = iter(windows)
            self._next_pos = 0
            self._now = -1
            self._stalled_at = None
            self._grace_until = time.monotonic() + FIRST_READ_GRACE_SECONDS
            self._cond.notify_all()
        self._start()

    def _refill_locked(self) -> None:
        capacity = max(1, self.max_bytes // max(1, self.chunk_bytes))
        while self._hint is not None and len(self._future) < MAX_HORIZON_WINDOWS:
            if len(self._uses) >= HORIZON_FACTOR * capacity:
                return
            item = next(self._hint, None)
            if item is None:
                self._hint = None
                return
            key, gids = item
            pos = self._next_pos
            self._next_pos += 1
            self._future.append((pos, key, gids))
            for g in gids.tolist():
                self._uses.setdefault(g, deque()).append(pos)

    def _advance_locked(self, key: tuple[int, int, int]) -> None:
        """A read of the window ``key`` starts: the plan's position moves to it."""
        pos = -1
        for i, (p, k, _g) in enumerate(self._future):
            if i >= 16:
                return  # not one of the next windows: a read outside the plan
            if k == key:
                pos = p
                break
        if pos < 0:
            return
        while self._future and self._future[0][0] <= pos:
            p, _k, gids = self._future.popleft()
            for g in gids.tolist():
                dq = self._uses.get(g)
                if dq is not None:
                    while dq and dq[0] <= p:
                        dq.popleft()
                    if not dq:
                        del self._uses[g]
        self._now = pos
        self._cond.notify_all()

    def _next_use(self, gid: int) -> int:
        dq = self._uses.get(gid)
        return dq[0] if dq else INF

    # -- the planner and the downloads --------------------------------------------------------------
    def _start(self) -> None:
        with self._cond:
            if self._disabled or self._stopped or (self._planner is not None and self._planner.is_alive()):
                return
            self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(
                FETCHES_IN_FLIGHT, thread_name_prefix="guideloom-chunks"
            )
            self._planner = threading.Thread(target=self._plan_loop, name="guideloom-chunk-planner")
            self._planner.start()

    def stop(self) -> None:
        """Stop the planner and the downloads (their temporary files are removed), and wait."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            planner, pool = self._planner, self._pool
            self._planner = self._pool = None
        if planner is not None and planner is not threading.current_thread():
            planner.join()
        if pool is not None:
            pool.shutdown(wait=True)
        with self._cond:
            self._stopped = False

    def _candidate_locked(self) -> tuple[int, int] | None:
        """The chunk the plan needs soonest that is neither on disk nor on its way."""
        for pos, _key, gids in self._future:
            for g in gids.tolist():
                if g not in self._local and g not in self._inflight and g not in self._skip:
                    return g, pos
        return None

    def _plan_loop(self) -> None:
        """The planner: take the chunk the plan needs soonest, reserve its room (here, one at a
        time, so reservations follow the plan's order), and hand its download to the pool."""
        while True:
            with self._cond:
                if self._stopped or self._disabled:
                    return
                self._refill_locked()
                cand = None
                grace = self._grace_until - time.monotonic()
                if grace > 0:
                    self._cond.wait(grace)
                    continue
                if len(self._inflight) < FETCHES_IN_FLIGHT and self._stalled_at != self._now:
                    cand = self._candidate_locked()
                if cand is None:
                    self._cond.wait(0.5)
                    continue
                gid, when = cand
                fut: concurrent.futures.Future[None] = concurrent.futures.Future()
                self._inflight[gid] = fut
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
        """Chunk ``gid``'s lock (an open descriptor holding ``flock``), or None: another process
        holds it (after ``LOCK_WAIT_SECONDS`` with ``wait``)."""
        locks = self.folder / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (LOCK_WAIT_SECONDS if wait else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if self._stopped or time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.02)

    def _prepare(self, gid: int, when: int) -> Path | None:
        """Under the budget lock: the folder as it is now, then room reserved for ``gid`` (its
        temporary file), or None (it is complete already, or there is no room yet)."""
        with self._budget():
            used = self._scan(own=gid)
            if gid in self._local:
                return None  # another process completed it
            return self._reserve(gid, when, used)

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
                self._fetching.add(gid)
            f, start, end = self.table.span(gid)
            try:
                data = self._fetch_parts(self.table.paths[f], start, end)
                digest = hashlib.sha256(data).hexdigest()
                if start == 0 and end == self.table.sizes[f] and digest != self.table.sha256[f]:
                    raise _RemoteDamaged(
                        f"the object {self.table.paths[f]!r} of {self.location} does not match its "
                        "checksum in the manifest; it is not cached (reads go to the object store, "
                        "as without a cache): write or copy the dataset again"
                    )
                if self._stopped:
                    raise InterruptedError("the cache was stopped")
                _write(tmp, data)
                final = f"c{gid:09d}.{digest[:32]}"
                os.rename(tmp, self.folder / final)  # complete, or not there at all
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            with self._cond:
                self._local[gid] = final
                self._verified.add(gid)
                self.downloads += 1
        finally:
            os.close(lock)  # releases it

    def _fetch_parts(self, path: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of ``path`` as ``PART_BYTES`` ranges fetched concurrently on
        the I/O pool: one connection's bandwidth is often far below the link's."""
        bounds = [*range(start, end, PART_BYTES), end]
        spans = list(itertools.pairwise(bounds))

        def one(span: tuple[int, int]) -> memoryview:
            try:
                got = memoryview(self._fetch(path, *span))
            except Exception as exc:
                raise _FetchFailed(str(exc)) from None  # not the folder's fault
            if got.nbytes != span[1] - span[0]:
                raise _FetchFailed(f"short read: {got.nbytes} of {span[1] - span[0]} bytes")
            return got

        if len(spans) == 1:
            return one(spans[0])
        parts = list(io_executor().map(one, spans))
        return memoryview(b"".join(parts))

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
                f"guideloom cannot write its chunk cache {self.folder} ({exc}); reading "
                f"{self.location} from the object store instead, nothing is lost",
                disable=True,
            )
        elif isinstance(exc, _RemoteDamaged):
            self._fault(str(exc))
        elif exc is not None:  # the object store after its retries, or a stop: reads go remote
            self.last_error = f"chunk {gid} of {self.location} was not cached: {exc}"
        with self._cond:
            self._inflight.pop(gid, None)
            self._fetching.discard(gid)
            if exc is not None:
                self._skip.add(gid)
            self._cond.notify_all()
        fut.set_result(None)

    def _budget(self) -> Any:
        return _FileLock(self.folder / "budget.lock")

    def _rescan_folder(self) -> None:
        try:
            self._scan()
        except OSError:
            pass  # no folder yet (or unreadable): nothing is on disk

    def _scan(self, own: int = -1) -> int:
        """Learn the folder's complete chunks (others' too); drop temporary files of dead
        downloads. Returns the bytes the folder holds (in blocks). ``own``: a chunk whose lock
        this process holds (any temporary file of it is a dead one)."""
        used = 0
        found: dict[int, str] = {}
        with self._cond:
            before = dict(self._local)  # what completes during the listing is not dropped
        try:
            entries = list(os.scandir(self.folder))
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
                used += _blocks(self.table.nbytes(gid))
            else:
                if gid in found:  # two copies of one chunk: keep one
                    Path(e.path).unlink(missing_ok=True)
                    continue
                found[gid] = name
                used += _blocks(self.table.nbytes(gid))
        with self._cond:
            for g, name in before.items():
                if g not in found and self._local.get(g) == name:
                    del self._local[g]
                    self._verified.discard(g)
            for g, name in found.items():
                if self._local.get(g) != name:
                    self._local[g] = name
                    self._verified.discard(g)
        return used

    def _dead(self, gid: int) -> bool:
        """Whether nobody holds chunk ``gid``'s lock (its temporary file is a crashed download's)."""
        try:
            fd = os.open(self.folder / "locks" / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def _reserve(self, gid: int, when: int, used: int) -> Path | None:
        """Make room for chunk ``gid`` (needed at ``when``) and reserve it, under the budget lock.

        Evicts the chunks needed furthest in the future, never one needed before ``when`` or in
        use; None if that does not make room."""
        need = _blocks(self.table.nbytes(gid))
        if need > self.max_bytes:
            with self._cond:
                self._skip.add(gid)
            return None
        while used + need > self.max_bytes:
            with self._cond:
                victim, best = -1, -1
                for v in self._local:
                    if self._pinned.get(v) or v in self._fetching:
                        continue
                    nu = self._next_use(v)
                    if nu > best:
                        victim, best = v, nu
                if victim < 0 or best <= when:
                    # No room before the reader moves on (decided at this position, under the
                    # lock that moves it, so a read that moved it meanwhile is not missed).
                    self._stalled_at = self._now
                    return None
                name = self._local.pop(victim)
                self._verified.discard(victim)
            (self.folder / name).unlink(missing_ok=True)
            self.evictions += 1
            used -= _blocks(self.table.nbytes(victim))
        tmp = self.folder / f"c{gid:09d}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _create(tmp, self.table.nbytes(gid))
        return tmp

    # -- faults ------------------------------------------------------------------------------------
    def _fault(self, message: str, *, disable: bool = False) -> None:
        with self._cond:
            if disable:
                self._disabled = True
                self._cond.notify_all()
            if message not in self._warned:
                self._warned.add(message)
                self._faults.append(message)

    #: The last download that failed without a fault of the folder (the reads went remote).
    last_error: str | None = None

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
                    missed = await loop.run_in_executor(io_executor(), self._serve, local)
                    if missed:
                        await remote_run(missed)

            from ._client import gather_first_error

            await gather_first_error([nearby(), remote_run(far)] if far else [nearby()])
            done = True
        finally:
            with self._cond:
                if done and self._grace_until:
                    self._grace_until = 0.0  # a read is in: downloads may start
                    self._cond.notify_all()
                for g in pins:
                    n = self._pinned[g] - 1
                    if n:
                        self._pinned[g] = n
                    else:
                        del self._pinned[g]
                        self._stalled_at = None  # it may be evicted now: the planner looks again
                if pins:
                    self._cond.notify_all()
        self.warn_pending()

    def _split(
        self, jobs: list[Job], key: tuple[int, int, int] | None
    ) -> tuple[list[Job], list[concurrent.futures.Future[None]], list[Job], list[int]]:
        local: list[Job] = []
        waits: dict[int, concurrent.futures.Future[None]] = {}
        far: list[Job] = []
        pins: list[int] = []
        with self._cond:
            if key is not None:
                self._advance_locked(key)
            for job in jobs:
                rest = Job(job.path, job.dest)
                for s, e, p in zip(job.starts, job.ends, job.pieces, strict=True):
                    gids = self.table.gids(job.path, s, e)
                    # A range is cut at chunk boundaries: each chunk's part is read where that
                    # chunk is; consecutive parts of absent chunks stay one remote range.
                    parts = [(s, e, p)] if len(gids) == 1 else self._cut(gids, s, e, p)
                    run: tuple[int, int, list[tuple[int, int, int]]] | None = None
                    for g, (ps, pe, pp) in zip(gids, parts, strict=True):
                        if g in self._local or g in self._fetching:
                            local.append(Job(job.path, job.dest, [ps], [pe], [pp]))
                            self._pinned[g] = self._pinned.get(g, 0) + 1
                            pins.append(g)
                            if g not in self._local:
                                waits[g] = self._inflight[g]
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
            self.local_reads += len(local)
            self.remote_reads += sum(len(j.starts) for j in far)
        return local, list(waits.values()), far, pins

    def _cut(
        self, gids: range, s: int, e: int, pieces: list[tuple[int, int, int]]
    ) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """Range ``[s, e)`` and its pieces (object offset, length, destination offset), cut into
        one part per chunk of ``gids``."""
        out = []
        for g in gids:
            _f, cs, ce = self.table.span(g)
            lo, hi = max(s, cs), min(e, ce)
            mine = []
            for ps, pl, pd in pieces:
                a, b = max(ps, lo), min(ps + pl, hi)
                if a < b:
                    mine.append((a, b - a, pd + a - ps))
            out.append((lo, hi, mine))
        return out

    def _serve(self, jobs: list[Job]) -> list[Job]:
        """On an I/O thread: fill ``jobs`` (one range each) from the chunk files; return those
        that could not be (evicted meanwhile, damaged, unreadable) for a remote read."""
        missed: list[Job] = []
        for job in jobs:
            s, e = job.starts[0], job.ends[0]
            buf = bytearray(e - s)
            ok = True
            for g in self.table.gids(job.path, s, e):
                with self._cond:
                    name = self._local.get(g)
                    checked = g in self._verified
                if name is None or (not checked and not self._verify(g, name)):
                    ok = False
                    break
                _f, cs, ce = self.table.span(g)
                lo, hi = max(s, cs), min(e, ce)
                try:
                    fd = os.open(self.folder / name, os.O_RDONLY)
                except FileNotFoundError:  # evicted by another process
                    with self._cond:
                        if self._local.get(g) == name:
                            del self._local[g]
                    ok = False
                    break
                except OSError as exc:
                    self._fault(
                        f"guideloom cannot read its chunk cache {self.folder} ({exc}); reading remotely"
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
            data = (self.folder / name).read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fault(f"guideloom cannot read its chunk cache {self.folder} ({exc}); reading remotely")
            return False
        digest = hashlib.sha256(data).hexdigest()[:32]
        good = len(data) == self.table.nbytes(gid) and digest == name.split(".")[1]
        with self._cond:
            if good:
                self._verified.add(gid)
                return True
            if self._local.get(gid) == name:
                del self._local[gid]
        (self.folder / name).unlink(missing_ok=True)
        self._fault(
            f"guideloom's chunk cache {self.folder} held a damaged chunk ({name}); it was deleted "
            f"and {self.location} is read from the object store instead, nothing is lost"
        )
        return False

    def stats(self) -> dict[str, int]:
        """Chunks downloaded and evicted, and ranges read from disk and remotely."""
        return {
            "cache_downloads": self.downloads,
            "cache_evictions": self.evictions,
            "cache_local_ranges": self.local_reads,
            "cache_remote_ranges": self.remote_reads,
        }


class _FetchFailed(Exception):
    """The object store failed a chunk's download (after its retries): the reads go remote."""


class _RemoteDamaged(ValueError):
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
