"""The batched range-read engine of an object-store dataset: planned jobs, fetched with retries.

:mod:`guideloom.storage._remote._ranges` plans the jobs (pure); :class:`RangeFetcher` runs them:
concurrently, under a limit of requests and bytes in flight per event loop (:class:`PerLoop` of
:class:`InflightLimit`), each with bounded retries and backoff, every range a conditional GET of
the object the dataset was opened with, or a local read where a copy in progress already holds
it (:class:`LocalRanges`: ``cache_dir``'s whole copy, asked as each range starts, so a range
planned before its bytes came down is still read locally), or a copy of verified blocks an
earlier read fetched (:mod:`guideloom.storage._remote._held`).
It is apart from the connection (:class:`guideloom.storage._remote._client.Remote`), which owns the
store client and the dataset-level calls (manifest, sizes, checksums), so that the hot path's
limits and retry decisions read on their own; it holds no store, the connection hands it one per
:meth:`run`.

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import math
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from guideloom._errors import DatasetIntegrityError
from guideloom._process import Turns, cores
from guideloom.storage._format._blocks import U64, BlockDigests, BlockMismatch, check_range, widen
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._remote._held import HeldBlocks, Read, cut_held
from guideloom.storage._remote._locations import Location
from guideloom.storage._remote._objstore import (
    ContentMismatchError,
    ObjectChangedError,
    ObjectVersion,
    get_checked,
    io_executor,
    range_executor,
    remote_read_error,
    retryable,
)
from guideloom.storage._remote._options import ReadSettings
from guideloom.storage._remote._ranges import U8, Job, Pieces, fill_range

__all__ = [
    "CPU_TURNS",
    "BlockCheckError",
    "InflightLimit",
    "PerLoop",
    "LocalRanges",
    "RangeFetcher",
    "run_aside",
    "ReadCounters",
    "RemoteBlocks",
    "gather_first_error",
    "get_verified",
    "integrity_error",
]

T = TypeVar("T")


#: The copies of fetched ranges into place on the I/O threads take turns: as many at once as the
#: process has cores less one (one at least). For small samples a copy is numpy calls over
#: thousands of pieces that hold the GIL for milliseconds each; side by side on several I/O
#: threads (up to 14 were seen) they keep the caller's event loop waiting for the GIL for several
#: of its 5 ms switch intervals in a row, where queued here they wait on a lock, without it. The
#: copies are memory-bound: one core copies far faster than ranges arrive. A read's planning
#: does not wait for a turn: a read waiting for another's plan must not wait behind a stream of
#: copies (the turn's lock is not first come, first served).
CPU_TURNS: Final = Turns(lambda: cores() - 1)


@dataclass(slots=True)
class ReadCounters:
    """What a connection's reads cost: range GETs sent and the bytes they returned.

    Its own object because two paths count into it, the connection's blocking reads and the
    fetcher's batched ones, and ``stats()`` reports their sum.
    """

    requests: int = 0  # range GETs sent, retries included (each is billed)
    bytes_read: int = 0  # bytes those GETs returned


class BlockCheckError(ContentMismatchError):
    """Fetched bytes that do not match their block digests (never retried, never delivered)."""


class RemoteBlocks:
    """The block digests of a remote dataset's objects, each sidecar fetched (and checked
    against its sha256) the first time its object is read; one lock guards the loading."""

    def __init__(self) -> None:
        self.specs: dict[str, tuple[BlockDigests, int]] = {}
        self._loaded: dict[str, U64] = {}
        self._lock = threading.Lock()
        #: ``read(path)``: a whole object's bytes (a blocking call with retries), for sidecars.
        self.read: Callable[[str], bytes] | None = None
        self.where = ""

    def __getstate__(self) -> dict[str, Any]:
        return {"specs": self.specs, "where": self.where}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.specs, self.where = state["specs"], state["where"]

    def set(self, manifest: Manifest, where: str) -> None:
        self.specs = {
            f.path: (f.blocks, f.nbytes) for _, _, f in manifest.all_files() if f.blocks is not None
        }
        self.where = where

    def size(self, path: str) -> int:
        """The block size of object ``path`` (0: no block digests)."""
        spec = self.specs.get(path)
        return 0 if spec is None else spec[0].size

    def digests(self, path: str) -> U64:
        blocks, nbytes = self.specs[path]
        with self._lock:
            found = self._loaded.get(path)
            if found is None:
                read = self.read
                if blocks.inline is None and read is None:
                    raise RuntimeError(f"{self.where}: no reader for the block digests of {path!r}")
                found = blocks.load(read or (lambda _p: b""), nbytes, self.where)
                self._loaded[path] = found
        return found


def get_verified(
    store: Any, path: str, start: int, end: int, version: ObjectVersion | None, blocks: RemoteBlocks | None
) -> Any:
    """:func:`~._objstore.get_checked`, and every block of the answer checked against its
    digest before it is returned (:class:`BlockCheckError`); a range not aligned to the blocks is
    fetched widened to them and cut back."""
    size = 0 if blocks is None else blocks.size(path)
    if not size:
        return get_checked(store, path, start, end, version)
    assert blocks is not None
    nbytes = blocks.specs[path][1]
    lo, hi = widen(start, end, size, nbytes)
    data = get_checked(store, path, lo, hi, version)
    try:
        check_range(blocks.digests(path), size, lo, data)
    except BlockMismatch as exc:
        raise BlockCheckError(str(exc)) from None
    if (lo, hi) == (start, end):
        return data
    return memoryview(data)[start - lo : end - lo]


# -- bounded in-flight requests and bytes: FIFO-fair, one limit per event loop -------------------
class InflightLimit:
    """A limit on requests and bytes in flight, for one event loop, that admits the waiting
    acquisitions of the earliest read first (``rank``: its place in the order of reads), each
    read's in the order asked, and those of no rank after the ranked ones, in the order asked.

    Reads of consecutive windows in flight together thus finish one after the other, the first
    after its own bytes rather than after a share of all of theirs: its batches are made while the
    next windows are fetched. A single acquisition larger than the byte budget is admitted when
    nothing else is in flight, so an oversized request waits its turn instead of deadlocking.
    """

    def __init__(self, max_requests: int, max_bytes: int, peak: list[int] | None = None) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = 0
        self.nbytes = 0
        self.peak_bytes = 0
        #: Where the peak is also kept, beyond this loop's life (:class:`PerLoop`).
        self._peak = [0] if peak is None else peak
        #: A heap of ``(rank, arrival, requests, bytes, future)``.
        self._waiters: list[tuple[float, int, int, int, asyncio.Future[None]]] = []
        self._arrivals = 0

    def _fits(self, n: int, b: int) -> bool:
        if self.requests == 0:
            return True
        return self.requests + n <= self.max_requests and self.nbytes + b <= self.max_bytes

    def _take(self, n: int, b: int) -> None:
        self.requests += n
        self.nbytes += b
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self._peak[0] = max(self._peak[0], self.nbytes)

    async def acquire(self, n: int, b: int, rank: int | None = None) -> None:
        """Wait for room for ``n`` requests of ``b`` bytes (``rank``: the read's place in the
        order of reads; None: after every ranked read)."""
        if not self._waiters and self._fits(n, b):
            self._take(n, b)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._arrivals += 1
        entry = (math.inf if rank is None else rank, self._arrivals, n, b, fut)
        heapq.heappush(self._waiters, entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n, b)  # granted, then cancelled before we could use it
            else:
                try:
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
                except ValueError:
                    pass
                self._wake()
            raise

    def release(self, n: int, b: int) -> None:
        self.requests -= n
        self.nbytes -= b
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            _, _, n, b, fut = waiters[0]
            if fut.done():
                heapq.heappop(waiters)
                continue
            if not self._fits(n, b):
                return
            heapq.heappop(waiters)
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


class LocalRanges(Protocol):
    """A local source of some of a dataset's bytes (``cache_dir``'s copy in progress)."""

    def read_into(self, path: str, start: int, end: int, pieces: Pieces, dest: U8) -> bool:
        """Copy the ``pieces`` of range ``[start, end)`` of object ``path`` to ``dest``, as
        :func:`~._ranges.fill` would from the fetched range (blocking, on an I/O thread); False
        where the range is not held locally: it is then fetched from the store."""


class RangeFetcher:
    """Runs range-read jobs: the in-flight limits, the retries with backoff, the final errors.

    Each range of a job is one conditional GET (:func:`~._objstore.get_checked`) on an I/O
    thread, the ranges of a job concurrently, each with its own retries: obstore's multi-range
    call takes no conditions, merges adjacent ranges into one request, and panics on a body
    shorter than asked for.
    """

    def __init__(
        self,
        loc: Location,
        opts: ReadSettings,
        secrets: Sequence[str],
        counters: ReadCounters,
        versions: Mapping[str, ObjectVersion] | None = None,
        blocks: RemoteBlocks | None = None,
        refused: dict[str, str] | None = None,
    ) -> None:
        self.loc = loc
        self.policy = opts.policy
        self.secrets = secrets
        self.counters = counters
        #: Each data object as the dataset was opened with it (filled by the connection's open).
        self.versions: Mapping[str, ObjectVersion] = {} if versions is None else versions
        #: Each data object's block digests: every range fetched is checked against them.
        self.blocks = blocks
        #: Why each object a read found missing or changed is refused (filled here, checked by
        #: the connection before every read of it).
        self.refused: dict[str, str] = {} if refused is None else refused
        #: Where ranges may be read locally before a GET is sent (set by the storage).
        self.local: LocalRanges | None = None
        #: Verified blocks a read fetched, for the reads planned after it that touch them.
        self.held = HeldBlocks()
        self._inflight = PerLoop(opts.max_inflight_requests, opts.max_inflight_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "local": None}  # a process worker's storage sets its own

    def ticket(self) -> int | None:
        """A read is called: its place in the order of reads (:meth:`HeldBlocks.ticket`);
        ``None`` without block digests (nothing is held)."""
        blocks = self.blocks
        if blocks is None or not blocks.specs:
            return None
        return self.held.ticket()

    def skip(self, ticket: int | None) -> None:
        """The read that took ``ticket`` is not planned after all."""
        if ticket is not None:
            self.held.skip(ticket)

    def prepare(
        self, jobs: list[Job], ticket: int | None = None
    ) -> tuple[Read | None, list[concurrent.futures.Future[None]]]:
        """A read's planned ``jobs``, before they run (where they are planned: off the event
        loop for a large read; ``ticket``: its place in the order of reads, :meth:`ticket`): the
        read as :attr:`held` sees it, its verified blocks kept for the reads after it that touch
        them, and the ``done`` of the earlier unfinished reads that fetch blocks it touches.
        With none, its ranges are cut now around the blocks held (:meth:`cut`); else the caller
        waits for those reads, then cuts. ``None`` (nothing to wait for, nothing held): no
        block digests. The caller ends the read (:meth:`end`)."""
        blocks = self.blocks
        if blocks is None or not blocks.specs:
            self.skip(ticket)
            return None, []  # no block digests: nothing verified to hold
        read = Read.of(jobs)
        waits = self.held.begin_read(read, ticket)
        for job in jobs:
            job.keeper = read
        if not waits:
            self.cut(jobs)
        return read, waits

    def cut(self, jobs: list[Job]) -> None:
        """Cut ``jobs``' ranges around the verified blocks held for their objects."""
        held, blocks = self.held, self.blocks
        if blocks is None:
            return
        for job in jobs:
            if held.holds(job.path) and blocks.size(job.path):
                cut_held(job, held, self.versions.get(job.path))
        if jobs and isinstance(jobs[0].keeper, Read):
            held.fetches(jobs[0].keeper, sum(job.fetched_nbytes for job in jobs))

    def waits(self, read: Read | None) -> list[concurrent.futures.Future[None]]:
        """What ``read`` still waits for before it cuts its ranges (:meth:`HeldBlocks.waits`)."""
        return [] if read is None else self.held.waits(read)

    def room(self, read: Read | None) -> list[concurrent.futures.Future[None]]:
        """The earlier reads ``read`` waits for before it fetches, for room to hold its blocks
        (:meth:`HeldBlocks.room`); empty: none."""
        return [] if read is None else self.held.room(read)

    def end(self, read: Read | None) -> None:
        """``read`` finished, failed or not (:meth:`prepare`)."""
        if read is not None:
            self.held.end_read(read)

    def _read(self, store: Any, job: Job, i: int) -> Any:
        """On an I/O thread: ``job``'s range ``i``, its pieces copied out of the verified
        bytes an earlier read kept (:attr:`Job.held`) or by :attr:`local` where they hold them
        (:data:`_FILLED`), else fetched by one checked GET and copied out here (:data:`_FETCHED`;
        raises what the GET raises), and held for the next reads where the job keeps them.
        Copying on this thread keeps the megabytes of a job's copy off the event loop."""
        path, start, end = job.path, job.starts[i], job.ends[i]
        inhand = job.held.get(i) if job.held else None
        if inhand is not None:
            with CPU_TURNS:
                fill_range(job, i, inhand)
            return _FILLED
        local = self.local
        if local is not None and local.read_into(path, start, end, job.pieces[i], job.dest):
            if job.keeper is not None:
                self.held.arrived(job.keeper, end - start)
            return _FILLED
        version = self.versions.get(path)
        data = get_verified(store, path, start, end, version, self.blocks)
        with CPU_TURNS:
            fill_range(job, i, data)
        if job.keeper is not None:
            self.held.arrived(job.keeper, end - start)
            self._hold(path, start, end, data, version, job.keeper)
        return _FETCHED

    def _hold(
        self, path: str, start: int, end: int, data: Any, version: ObjectVersion | None, owner: Read
    ) -> None:
        """Hold the fetched ``data`` (bytes ``[start, end)`` of ``path``) where it is whole blocks,
        each checked against its digest by the GET that fetched it."""
        blocks = self.blocks
        size = 0 if blocks is None else blocks.size(path)
        if not size:
            return
        assert blocks is not None
        nbytes = blocks.specs[path][1]
        if start % size == 0 and (end % size == 0 or end == nbytes):
            self.held.add(path, start, end, data, version, owner)

    def peak_inflight_bytes(self) -> int:
        return self._inflight.peak_bytes()

    def _final_error(
        self, path: str, start: int, end: int, exc: Exception, attempt: int, elapsed: float, delay: float
    ) -> Exception | None:
        """The error a failed attempt ends with, or None when it is to be retried after ``delay``."""
        error = integrity_error(self.loc, path, exc)
        if error is not None:
            self.refused.setdefault(path, str(error))
            return error
        policy = self.policy
        if not retryable(exc) or attempt > policy.retries or elapsed + delay > policy.retry_timeout:
            what = f"{self.loc.object_url(path)} bytes {start}-{end - 1}"
            return remote_read_error(what, exc, attempt, elapsed, self.secrets)
        return None

    async def _get(self, store: Any, job: Job, i: int, t0: float, attempt: int = 0) -> Any:
        """The bytes of ``job``'s range ``i``, checked, with bounded retries, or :data:`_FILLED`
        (``t0``: the job's start, from which ``retry_timeout`` counts; ``attempt``: those
        already made)."""
        loop = asyncio.get_running_loop()
        path, start, end = job.path, job.starts[i], job.ends[i]
        while True:
            attempt += 1
            try:
                got = await loop.run_in_executor(io_executor(), self._read, store, job, i)
                if got is _FETCHED:
                    self.counters.requests += 1
                    self.counters.bytes_read += end - start
                return got
            except Exception as exc:
                self.counters.requests += 1
                delay = self.policy.delay(attempt)
                error = self._final_error(path, start, end, exc, attempt, time.monotonic() - t0, delay)
            if error is not None:
                raise error  # outside the handler: obstore's error is not its __context__
            await asyncio.sleep(delay)

    def _run_job_sync(self, store: Any, job: Job) -> list[Any]:
        """On an I/O thread: one attempt at each of ``job``'s ranges, concurrently (the first
        here, the others on the range pool); each range's bytes, or the exception it failed with.

        One hand-off to the event loop per job, not per range: that is what keeps a read of many
        small ranges as cheap in CPU as obstore's multi-range call, which takes no conditions."""
        pool = range_executor()
        rest = [pool.submit(_attempt, self._read, store, job, i) for i in range(1, len(job.starts))]
        out = [_attempt(self._read, store, job, 0)]
        out.extend(f.result() for f in rest)
        return out

    async def _run_job(self, store: Any, job: Job) -> None:
        """Fetch ``job``'s ranges concurrently, then copy their pieces out; the ranges that
        failed go on to :meth:`_get`'s retries, concurrently."""
        t0 = time.monotonic()
        path, n = job.path, len(job.starts)
        if n == 1:
            await self._get(store, job, 0, t0)
            return
        loop = asyncio.get_running_loop()
        bufs = await loop.run_in_executor(io_executor(), self._run_job_sync, store, job)
        retry: list[int] = []
        error: Exception | None = None
        for i, got in enumerate(bufs):
            if got is _FILLED:
                continue
            self.counters.requests += 1
            if got is _FETCHED:
                self.counters.bytes_read += job.ends[i] - job.starts[i]
                continue
            delay = self.policy.delay(1)
            error = self._final_error(path, job.starts[i], job.ends[i], got, 1, time.monotonic() - t0, delay)
            if error is not None:
                break
            retry.append(i)
        if error is not None:
            raise error  # outside any handler: obstore's error is not its __context__
        if retry:
            await asyncio.sleep(self.policy.delay(1))
            await gather_first_error([self._get(store, job, i, t0, attempt=1) for i in retry])

    async def run(self, store: Any, jobs: list[Job]) -> None:
        """Run ``jobs`` on ``store`` concurrently under the request and byte limits; the first
        failure wins."""
        if not jobs:
            return
        limit = self._inflight.get()
        keeper = jobs[0].keeper
        rank = keeper.order if isinstance(keeper, Read) else None  # the read's ticket
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        failed: list[BaseException] = []

        def ended(nreq: int, nbytes: int) -> Callable[[asyncio.Task[None]], None]:
            def release(task: asyncio.Task[None]) -> None:
                # a callback, not the job's finally: a task cancelled before its start never runs
                limit.release(nreq, nbytes)
                if not task.cancelled() and (exc := task.exception()) is not None:
                    failed.append(exc)

            return release

        try:
            for job in jobs:
                if failed:
                    break
                # what it fetches: its held ranges are in hand already
                nreq, nbytes = len(job.starts) - len(job.held), job.fetched_nbytes
                await limit.acquire(nreq, nbytes, rank)
                try:
                    tasks.append(task := loop.create_task(self._run_job(store, job)))
                    task.add_done_callback(ended(nreq, nbytes))
                except BaseException:
                    limit.release(nreq, nbytes)
                    raise
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)


#: A range whose pieces were copied out locally (no GET was sent: nothing to count).
_FILLED: Final = object()
#: A range fetched by one GET, its pieces copied out on the I/O thread.
_FETCHED: Final = object()


def _attempt(read: Callable[[Any, Job, int], Any], store: Any, job: Job, i: int) -> Any:
    """One ``read`` (:meth:`RangeFetcher._read`): its result, or the exception it failed with
    (returned)."""
    try:
        return read(store, job, i)
    except Exception as exc:
        return exc


async def gather_first_error(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently and return their results; on the first failure cancel the
    rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def integrity_error(loc: Location, path: str, exc: BaseException) -> DatasetIntegrityError | None:
    """The error a read of ``path`` that failed with ``exc`` ends with when the object is missing
    or is not the one the dataset was opened with (never retried); None for other failures."""
    import obstore.exceptions as oe

    url = loc.object_url(path)
    if isinstance(exc, ContentMismatchError):
        return DatasetIntegrityError(
            f"{url}, named by the manifest, does not match it: {exc}; none of its bytes are "
            "delivered: the object was replaced or damaged, write or copy the dataset again"
        )
    if isinstance(exc, FileNotFoundError | oe.NotFoundError):
        return DatasetIntegrityError(
            f"{url}, named by the manifest, is missing: the dataset changed or was deleted after it "
            "was opened"
        )
    if isinstance(exc, ObjectChangedError):
        why = str(exc)
    elif isinstance(exc, oe.PreconditionError):
        why = "the store refused the read: the object is no longer the one the dataset was opened with"
    else:
        return None
    return DatasetIntegrityError(
        f"{url}, named by the manifest, changed on the object store after the dataset was opened "
        f"({why}); none of its bytes are read: open the dataset again once it is whole, or write "
        "or copy it again"
    )


def run_aside(read: Coroutine[Any, Any, T]) -> T:
    """``read`` run to its end on an event loop of its own, on a thread of its own: a blocking
    read that falls back to the store (its local copy found damaged) from any thread, one that
    runs an event loop included."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guideloom-fallback") as pool:
        return pool.submit(asyncio.run, read).result()
