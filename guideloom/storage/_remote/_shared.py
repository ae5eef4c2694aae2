"""What the object-store stream and document storages share: the connection, the local copy or
chunk cache, reads from the copy with the store as fallback, and read planning off the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from guideloom._core.order import DEFAULT_WINDOW, REMOTE_BLOCK_BYTES
from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._cache._copy import DatasetCache, copy_footprint
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._local._storage import LocalDocumentStorage, LocalStreamStorage
from guideloom.storage._remote._client import Remote
from guideloom.storage._remote._fetch import run_aside
from guideloom.storage._remote._objstore import io_executor
from guideloom.storage._remote._options import ReadSettings
from guideloom.storage._remote._ranges import Job, lead

__all__ = ["PLAN_INLINE_SAMPLES", "Upcoming"]

Array = npt.NDArray[Any]
I64 = npt.NDArray[np.int64]


_L = TypeVar("_L", LocalStreamStorage, LocalDocumentStorage)
R = TypeVar("R")


class _ObjectStorageMixin:
    #: ``shuffle_block_size="auto"``: blocks of about 4 MiB (a round trip amortised over MiBs).
    shuffle_block_bytes: int | None = REMOTE_BLOCK_BYTES
    #: Read-ahead windows of up to one "auto" mixing window (64 MiB): a window's samples, sorted,
    #: are whole blocks, or for a global shuffle dense enough to coalesce into large requests.
    read_window_bytes: int = REMOTE_BLOCK_BYTES * DEFAULT_WINDOW
    read_window_batches: int = 4096
    _remote: Remote
    manifest: Manifest
    _opened: bool
    _plain_reads: ClassVar[bool]
    _cache: DatasetCache | None = None
    _chunks: ChunkCache | None = None
    _local: LocalStreamStorage | LocalDocumentStorage | None = None
    #: The reads a loader said come next (``will_read``), until its first read is planned.
    _upcoming: Upcoming | None = None

    def _expect(self, windows: Iterable[npt.NDArray[np.int64]]) -> Upcoming:
        """``will_read``'s reads, kept for the session's first read to look at the one after
        it (:meth:`_read_planned`); returned to be iterated in their place."""
        self._upcoming = Upcoming(windows)
        return self._upcoming

    def _next_of(self, first: I64) -> Callable[[], I64 | None] | None:
        """For the session's first read (``first``: its starts or indices, as ``will_read`` said
        them): what returns the read said to come after it (None: no next read, or this read is
        not the one said to come first); None where no session began since the last first read."""
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None:
            return None

        def after() -> I64 | None:
            said = upcoming.get(0)
            if said is None or not np.array_equal(said, first):
                return None
            return upcoming.get(1)

        return after

    def _setup_cache(self) -> None:
        opts = self._remote.opts
        root = opts.cache_dir
        if root is None:
            return
        limit = opts.cache_max_bytes
        if limit is None or limit >= copy_footprint(self.manifest):  # the whole copy fits: no chunks
            loc = self._remote.loc.display
            self._cache = DatasetCache(root, loc, self.manifest, self._remote.fetch_range)
            self._remote.fetcher.local = self._cache  # ranges it has written are read from it
        else:
            self._chunks = ChunkCache(
                root,
                self._remote.loc.display,
                self.manifest,
                self._remote.fetch_range,
                max_bytes=limit,
                chunk_bytes=opts.cache_chunk_bytes,
            )

    def _check_intact(self) -> None:
        """Refuse the read once an object was found not to match the manifest: by a read, by
        the whole copy's checksums or by the chunk cache's (never served from the store). An
        object the store itself answered for as missing or changed (:attr:`Remote.refused`)
        refuses the reads of that object only, whoever fetched it first: the reads before the
        first batch that needs it are delivered."""
        remote = self._remote
        remote.check_intact()
        for cache in (self._cache, self._chunks):
            damaged = None if cache is None else cache.damaged
            if damaged is not None and damaged not in remote.refused.values():
                remote.mark_damaged(damaged)
                raise DatasetIntegrityError(damaged)

    async def _run(self, jobs: list[Any], key: tuple[int, int, int] | None = None) -> None:
        """Fetch ``jobs``: through the chunk cache when there is one, else from the store.

        Checked before and after: what a cache found damaged while the read was in flight is
        refused, not delivered."""
        self._check_intact()
        if self._chunks is None:
            await self._remote.run(jobs)
            if self._cache is not None:
                self._cache.first_read.set()
        else:
            await self._chunks.run(jobs, key, self._remote.run)
        self._check_intact()

    async def _read_planned(
        self,
        n: int,
        key: tuple[int, int, int] | None,
        plan: Callable[..., Any],
        *args: Any,
        after: Callable[[], list[Job]] | None = None,
    ) -> Any:
        """``plan(*args)`` (jobs first), for a read of ``n`` samples, then its jobs fetched
        (:meth:`_run`). Planned where it is cheap to (off the event loop for a large read), and
        prepared there by the fetcher (:meth:`~._fetch.RangeFetcher.prepare`): its ranges cut
        around the verified blocks held for it, its own kept for the reads after it that touch
        them (at most ``read_window_bytes`` held at once); where an earlier read still fetches
        blocks it touches, it waits for that read, then cuts. ``after``: the jobs of the read
        that comes next (a session's first read: its first batch, read alone before the rest of
        its mixing window), planned with it off the event loop: its ranges inside those jobs'
        reach to their ends (:func:`~._ranges.lead`), so the next read takes them off its ranges'
        ends instead of fetching them again. A part of a mixing window read in parts, read ahead
        while the last window's reads hold the bound, waits for them before it fetches, so its
        blocks can be held for its later parts (:meth:`~._held.HeldBlocks.room`). A read asks for room in
        flight once every read called before it has (:meth:`~._held.HeldBlocks.turn`), so the
        windows read ahead together end in the order they were called. Not with a chunk cache,
        which fetches by chunks of its own."""
        if self._chunks is not None:
            out = await _planned(n, plan, *args)
            await self._run(out[0], key)
            return out
        fetcher = self._remote.fetcher
        fetcher.held.limit = max(0, int(self.read_window_bytes))

        ticket = fetcher.ticket()  # the order of reads, before any planning

        def planned() -> tuple[Any, Any]:
            try:
                out = plan(*args)
                then = None if after is None else after()
                if then:
                    out[0][:] = lead(out[0], then, self._remote.limits)
            except BaseException:
                fetcher.skip(ticket)
                raise
            return out, fetcher.prepare(out[0], ticket)

        if n <= PLAN_INLINE_SAMPLES and after is None:
            out, (read, waits) = planned()
        else:
            future = asyncio.get_running_loop().run_in_executor(io_executor(), planned)
            try:
                out, (read, waits) = await asyncio.shield(future)
            except asyncio.CancelledError:  # planned all the same: the read ends, unread
                future.add_done_callback(
                    lambda f: None if f.cancelled() or f.exception() else fetcher.end(f.result()[1][0])
                )
                raise
        try:
            if waits:
                # The reads called before it are planned, then those that touch its blocks hold
                # them as they finish (failed: fetched here).
                await _wait_for(functools.partial(fetcher.waits, read))
                await _planned(n, fetcher.cut, out[0])
            # room to hold its blocks: past the bound on the wait, it fetches what it cannot hold
            await _wait_for(functools.partial(fetcher.room, read))
            # the reads called before it ask first, however fast it got here: the limit admits
            # the waiting requests of the earliest read first, not those already in flight
            if read is not None:
                await _wait_for(functools.partial(fetcher.held.turn, read))
                fetcher.held.asks(read)
            await self._run(out[0], key)
        finally:
            fetcher.end(read)
        return out

    def _let_go(self) -> None:
        """Closing: the verified blocks held for the next reads are let go."""
        self._remote.fetcher.held.clear()

    async def _stop_chunks(self) -> None:
        if self._chunks is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._chunks.stop)

    def _start_cache(self) -> None:
        if self._cache is not None and not self._cache_passive:
            self._cache.start()

    #: A copy in a worker process: it reads the local copy once complete, but the process that
    #: made the storage is the one that downloads it.
    _cache_passive = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled closed, for a process worker that opens its own connection."""
        return {
            **self.__dict__,
            "_cache": None,
            "_chunks": None,  # a worker makes its own: the folder and its limit are shared by lock
            "_local": None,
            "_upcoming": None,  # this process's reading session
            "_opened": False,
            "_cache_passive": True,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_cache()

    def _local_copy(self) -> LocalStreamStorage | LocalDocumentStorage | None:
        """The complete local copy (``cache_dir``), opened once every block of it was checked
        in this process; None until then. A copy found damaged is never read: it is removed and
        copied again, with a warning naming what did not match (reads stay remote meanwhile)."""
        cache = self._cache
        if cache is None:
            return None
        if cache.copy_damaged is not None:
            self._rebuild_copy(cache.copy_damaged)
            return None
        if self._local is None and self._opened:
            copied = cache.checked_copy()
            if copied is not None:
                local: LocalStreamStorage | LocalDocumentStorage
                try:
                    if self.manifest.kind == "stream":
                        local = LocalStreamStorage(cache.folder, copied)
                    else:
                        local = LocalDocumentStorage(cache.folder, copied)
                    local.open_sync()  # checks the copy's manifest and every file's size
                except (OSError, DatasetFormatError, DatasetIntegrityError) as exc:
                    self._rebuild_copy(str(exc))
                    return None
                self._local = local
            elif (damaged := cache.copy_damage()) is not None:  # found by the check just made
                self._rebuild_copy(damaged)
            else:
                cache.warn_if_failed()
        return self._local

    def _rebuild_copy(self, why: str) -> None:
        cache = self._cache
        assert cache is not None
        self._local = None
        warnings.warn(
            f"guideloom's copy of {self._remote.loc.display} in {cache.folder} is damaged ({why}); "
            "none of it is read: it is copied again, and read from the object store meanwhile; "
            "nothing is lost",
            RuntimeWarning,
            stacklevel=4,
        )
        cache.rebuild()

    def _close_cache(self) -> None:
        """Let go of the local copy. A copy in progress goes on (a loader opens and closes its
        storage with each epoch outside a ``with`` block); it stops at interpreter exit."""
        self._local = None

    def reads_inline(self) -> bool:
        # Not for a subclass that overrides read_many: its own read is the one to call.
        return self._plain_reads and self._local_copy() is not None

    def _copy_or_store_sync(
        self, kind: type[_L], read: Callable[[_L], R], from_store: Callable[[], Coroutine[Any, Any, R]]
    ) -> R:
        """``read`` of the complete local copy; where it finds the copy damaged, the copy is
        rebuilt and ``from_store()`` runs instead (on an event loop of its own: a blocking read)."""
        local = self._local_copy()
        if not isinstance(local, kind):
            raise RuntimeError(f"{self!r} has no complete local copy to read from (reads_inline() is False)")
        try:
            return read(local)
        except DatasetIntegrityError as exc:
            self._rebuild_copy(str(exc))
        return run_aside(from_store())

    async def _copy_or_store(
        self,
        kind: type[_L],
        read: Callable[[_L], Coroutine[Any, Any, R]],
        from_store: Callable[[], Coroutine[Any, Any, R]],
    ) -> R:
        """``read`` of the complete local copy where there is one, else (or where it finds the
        copy damaged, which is then rebuilt) ``from_store()``."""
        if not self._opened:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        local = self._local_copy()
        if isinstance(local, kind):
            try:
                return await read(local)
            except DatasetIntegrityError as exc:
                self._rebuild_copy(str(exc))
        return await from_store()

    @property
    def cache_folder(self) -> str | None:
        """The local copy's folder with ``cache_dir`` (it exists once the copy is complete)."""
        return None if self._cache is None else str(self._cache.folder)

    @property
    def url(self) -> str:
        """The location, without credentials or query string."""
        return self._remote.loc.display

    @property
    def location(self) -> str:
        return self._remote.loc.display

    @property
    def options(self) -> ReadSettings:
        return self._remote.opts

    def read_counts(self) -> tuple[int, int]:
        return self._remote.requests, self._remote.bytes_read

    def add_read_counts(self, requests: int, nbytes: int) -> None:
        self._remote.count_reads(requests, nbytes)

    def stats(self) -> dict[str, int]:
        """Range requests (GETs) issued so far, retries included, the bytes they returned, and
        the peak bytes that were in flight at once (with a ``cache_max_bytes`` cache, also its
        chunks downloaded and evicted and the ranges it served locally and remotely; with the
        whole copy, the ranges it served while in progress and those read remotely meanwhile,
        and the parts it fetched and their bytes, which the GETs and bytes include)."""
        out = {
            "requests": self._remote.requests,
            "bytes_read": self._remote.bytes_read,
            "peak_inflight_bytes": self._remote.peak_inflight_bytes(),
        }
        for cache in (self._chunks, self._cache):
            if cache is not None:
                out.update(cache.stats())
        return out


class Upcoming:
    """The reads ``will_read`` said come next, iterated once in their place (a cache plans by
    them) and looked at by the session's first read (:meth:`get`, the first two only, which are
    kept): the iterator is pulled under a lock, from whichever thread asks first."""

    KEPT = 2

    def __init__(self, reads: Iterable[npt.NDArray[np.int64]]) -> None:
        self._reads = iter(reads)
        self._head: list[I64] = []
        self._ended = False
        self._lock = threading.Lock()

    def _pull(self) -> I64 | None:
        try:
            return np.asarray(next(self._reads), dtype=np.int64)
        except StopIteration:
            self._ended = True
            return None

    def get(self, i: int) -> I64 | None:
        """Read ``i`` (< :attr:`KEPT`), or None past the last."""
        with self._lock:
            while len(self._head) <= i and not self._ended:
                got = self._pull()
                if got is not None:
                    self._head.append(got)
            return self._head[i] if i < len(self._head) else None

    def __iter__(self) -> Iterator[I64]:
        i = 0
        while True:
            if i < self.KEPT:
                got = self.get(i)
            else:
                with self._lock:
                    got = None if self._ended else self._pull()
            if got is None:
                return
            yield got
            i += 1


#: The longest a read waits for an earlier one that fetches blocks it touches; past it, it
#: fetches them itself (a safeguard: an earlier read is never behind a later one).
_WAIT_HELD_S = 10.0

#: Reads of more samples than this are planned on an I/O thread: planning costs a few
#: microseconds a sample, so a large window planned on the event loop would stall it.
PLAN_INLINE_SAMPLES = 256


async def _wait_for(ask: Callable[[], list[concurrent.futures.Future[None]]]) -> None:
    """Wait for what ``ask()`` names, asked again after each wait (a read called before may have
    been planned meanwhile) until it names nothing, for :data:`_WAIT_HELD_S` at most."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _WAIT_HELD_S
    while (waits := ask()) and (left := deadline - loop.time()) > 0:
        await asyncio.wait([asyncio.wrap_future(w) for w in waits], timeout=left)


async def _planned(n: int, plan: Callable[..., R], *args: Any) -> R:
    """``plan(*args)``: inline for a small read, on an I/O thread for a large one."""
    if n <= PLAN_INLINE_SAMPLES:
        return plan(*args)
    return await asyncio.get_running_loop().run_in_executor(io_executor(), functools.partial(plan, *args))


def _key(starts: npt.NDArray[np.int64]) -> tuple[int, int, int]:
    """What identifies a read among the planned windows."""
    return len(starts), int(starts[0]), int(starts[-1])
