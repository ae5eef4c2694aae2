"""The batched range-read engine of an object-store dataset: planned jobs, fetched with retries.

:mod:`guideloom.storage._remote._ranges` plans the jobs (pure); :class:`RangeFetcher` runs them:
concurrently, under a limit of requests and bytes in flight (per event loop), each with bounded
retries and backoff, every range a conditional GET of the object the dataset was opened with, or
a local read where a copy in progress already holds it (:class:`LocalRanges`: ``cache_dir``'s
whole copy, asked as each range starts, so a range planned before its bytes came down is still
read locally).
It is apart from the connection (:class:`guideloom.storage._remote._client.Remote`), which owns the
store client and the dataset-level calls (manifest, sizes, checksums), so that the hot path's
limits and retry decisions read on their own; it holds no store, the connection hands it one per
:meth:`run`.

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Protocol, TypeVar

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._format._blocks import U64, BlockDigests, BlockMismatch, check_range, widen
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._remote._inflight import PerLoop
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
from guideloom.storage._remote._ranges import U8, Job, Pieces, clip, fill_range

__all__ = [
    "HOLD_BYTES",
    "BlockCheckError",
    "HeldBlocks",
    "Read",
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


#: The most bytes held at once by default (a storage sets its own, its ``read_window_bytes``):
#: one "auto" mixing window, 16 blocks of 4 MiB.
HOLD_BYTES: Final = 64 * 2**20


class _Held(NamedTuple):
    start: int
    end: int
    data: memoryview  # bytes [start, end) of the object, every block checked against its digest
    version: ObjectVersion | None  # the object the GET was conditional on
    owner: Read | None  # the read that fetched it
    used: int  # the count of reads planned when the last read that touches it was


class Read:
    """One read of a reading session, as :class:`HeldBlocks` sees it: the byte ranges of each
    object it touches (whole blocks, before any is cut out as held), and whether it finished;
    ``done`` is set when it finishes, failed or not."""

    __slots__ = ("done", "finished", "touched")

    def __init__(self, touched: dict[str, tuple[list[int], list[int]]]) -> None:
        self.touched = touched  # per object: sorted, disjoint starts and ends
        self.finished = False
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    @staticmethod
    def of(jobs: Sequence[Job]) -> Read:
        spans: dict[str, list[tuple[int, int]]] = {}
        for job in jobs:
            spans.setdefault(job.path, []).extend(zip(job.starts, job.ends, strict=True))
        touched: dict[str, tuple[list[int], list[int]]] = {}
        for path, pairs in spans.items():
            starts: list[int] = []
            ends: list[int] = []
            for s, e in sorted(pairs):
                if ends and s <= ends[-1]:
                    ends[-1] = max(ends[-1], e)
                else:
                    starts.append(s)
                    ends.append(e)
            touched[path] = (starts, ends)
        return Read(touched)

    def touches(self, path: str, start: int, end: int) -> bool:
        """Whether it reads any byte of ``[start, end)`` of ``path``."""
        spans = self.touched.get(path)
        if spans is None:
            return False
        starts, ends = spans
        i = bisect.bisect_right(starts, start) - 1  # the last span that starts at or before start
        if i >= 0 and ends[i] > start:
            return True
        return i + 1 < len(starts) and starts[i + 1] < end

    def overlaps(self, other: Read) -> bool:
        return any(
            self.touches(path, s, e)
            for path, (starts, ends) in other.touched.items()
            if path in self.touched
            for s, e in zip(starts, ends, strict=True)
        )


class HeldBlocks:
    """Verified ranges reads fetched, held by reference (no copy) for the reads planned after
    them that touch them, which copy them out instead of fetching their bytes again.

    A mixing window read in parts (more batches than ``read_window_batches``), and the first
    batch read alone before its window's read, have each part touch nearly every block of the
    window: the first part fetches them, the later parts take them from here. Which reads belong
    together needs no word from the loader: the reads of one mixing window touch the blocks held
    from its earlier reads; a read that touches none of them begins the next one, and what no
    unfinished read touches is then let go. A read planned while an earlier, unfinished one
    touches blocks it touches waits for that one (:meth:`begin_read`), then takes them.

    Memory: at most :attr:`limit` bytes are held at once (the storage's ``read_window_bytes``,
    one mixing window: 64 MiB by default), over the buffers the GETs returned; to hold more,
    the ranges used longest ago that no unfinished read touches are let go first. All of it is
    let go at the end of a mixing window (above), when a reading session begins (``will_read``:
    each epoch, each resumed one) and at close. Only whole blocks of objects with block digests
    are held, each with the object version its conditional GET was answered for; a read takes a
    held range only for that same version, else it is let go.
    """

    def __init__(self, limit: int = HOLD_BYTES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ranges: dict[str, list[_Held]] = {}  # per object: sorted by start, disjoint
        self._nbytes = 0
        self._peak = 0
        self._reads: list[Read] = []  # planned and not finished, in planning order
        self._count = 0  # reads planned
        self._tickets = 0  # reads called: each takes a ticket, in the order the loader reads
        self._unplanned: set[int] = set()  # tickets of reads called and not planned yet
        self._release: int | None = None  # a read that touches nothing held: its ticket

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeldBlocks, (self.limit,))  # a process worker's copy holds nothing

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most bytes held at once so far."""
        return self._peak

    def begin(self) -> None:
        """A reading session begins: what an earlier one held is let go."""
        with self._lock:
            self._let_go_all()
            self._release = None

    def clear(self) -> None:
        """Closing: everything held is let go."""
        self.begin()

    def _let_go_all(self) -> None:
        self._ranges.clear()
        self._nbytes = 0

    def ticket(self) -> int:
        """A read is called (before it is planned, maybe on another thread, maybe after a later
        one): its place in the order of reads; it is given back by :meth:`begin_read` or
        :meth:`skip`."""
        with self._lock:
            t = self._tickets
            self._tickets += 1
            self._unplanned.add(t)
            return t

    def skip(self, ticket: int) -> None:
        """The read with ``ticket`` is not planned after all (its planning failed)."""
        with self._lock:
            self._unplanned.discard(ticket)
            self._maybe_release()

    def begin_read(self, read: Read, ticket: int | None = None) -> list[concurrent.futures.Future[None]]:
        """``read`` (called with ``ticket``) is planned: the held ranges it touches are marked used
        by it; where it touches none, the reads have moved on (the next mixing window): what no
        unfinished read touches is let go, once every read called before it is planned (one
        planned later may still touch them). Returns the ``done`` of each unfinished read
        planned before it that touches blocks it touches (wait for them, then cut)."""
        with self._lock:
            waits = [r.done for r in self._reads if r.overlaps(read)]
            self._reads.append(read)
            self._count += 1
            touched = False
            for path, held in self._ranges.items():
                for i, h in enumerate(held):
                    if read.touches(path, h.start, h.end):
                        held[i] = h._replace(used=self._count)
                        touched = True
            if ticket is not None:
                self._unplanned.discard(ticket)
            if self._ranges and not touched:
                at = self._tickets if ticket is None else ticket
                self._release = at if self._release is None else max(self._release, at)
            self._maybe_release()
            return waits

    def _maybe_release(self) -> None:
        at = self._release
        if at is not None and not any(t < at for t in self._unplanned):
            self._release = None
            self._let_go(self._claimed)

    def end_read(self, read: Read) -> None:
        """``read`` finished (failed or not): the reads that wait for it go on."""
        with self._lock:
            read.finished = True
            if read in self._reads:
                self._reads.remove(read)
        if not read.done.done():
            read.done.set_result(None)

    def _claimed(self, h: _Held, path: str) -> bool:
        """Whether an unfinished read other than the one that fetched ``h`` touches it."""
        return any(r is not h.owner and r.touches(path, h.start, h.end) for r in self._reads)

    def _let_go(self, keep: Callable[[_Held, str], bool]) -> None:
        for path, held in list(self._ranges.items()):
            kept = [h for h in held if keep(h, path)]
            if len(kept) == len(held):
                continue
            self._nbytes -= sum(h.end - h.start for h in held) - sum(h.end - h.start for h in kept)
            if kept:
                self._ranges[path] = kept
            else:
                del self._ranges[path]

    def _make_room(self, nbytes: int) -> None:
        """Let go of the ranges used longest ago that no unfinished read (but their own) touches,
        until ``nbytes`` more fit under the bound."""
        need = self._nbytes + nbytes - self.limit
        if need <= 0:
            return
        free = sorted(
            ((h.used, path, h.start, h.end) for path, held in self._ranges.items() for h in held),
        )
        gone: set[tuple[str, int]] = set()
        for _, path, start, end in free:
            if need <= 0:
                break
            h = next(x for x in self._ranges[path] if x.start == start)
            if self._claimed(h, path):
                continue
            gone.add((path, start))
            need -= end - start
        if need <= 0:
            self._let_go(lambda h, path: (path, h.start) not in gone)

    def add(
        self,
        path: str,
        start: int,
        end: int,
        data: Any,
        version: ObjectVersion | None,
        owner: Read | None = None,
    ) -> None:
        """Hold bytes ``[start, end)`` of ``path`` (whole verified blocks) that ``owner``
        fetched, making room under the bound by letting go of what was used longest ago and
        no unfinished read touches; not where they overlap bytes held already, or no room is
        made."""
        view = memoryview(data).cast("B")
        if view.nbytes != end - start:
            return
        with self._lock:
            self._make_room(end - start)
            if self._nbytes + (end - start) > self.limit:
                return
            held = self._ranges.setdefault(path, [])
            i = bisect.bisect_left(held, start, key=lambda x: x.start)
            if (i > 0 and held[i - 1].end > start) or (i < len(held) and held[i].start < end):
                return
            held.insert(i, _Held(start, end, view, version, owner, self._count))
            self._nbytes += end - start
            self._peak = max(self._peak, self._nbytes)

    def take(
        self, path: str, start: int, end: int, version: ObjectVersion | None
    ) -> list[tuple[int, int, memoryview]]:
        """The held bytes inside ``[start, end)`` of ``path`` for ``version``, in order, as
        ``(start, end, bytes)`` (they stay held for the reads after it); a held range of
        another version is let go."""
        with self._lock:
            held = self._ranges.get(path)
            if not held:
                return []
            i = max(0, bisect.bisect_right(held, start, key=lambda h: h.start) - 1)
            out: list[tuple[int, int, memoryview]] = []
            stale: list[_Held] = []
            for h in held[i:]:
                if h.start >= end:
                    break
                if h.end <= start:
                    continue
                if h.version != version:
                    stale.append(h)
                    continue
                a, b = max(h.start, start), min(h.end, end)
                out.append((a, b, h.data[a - h.start : b - h.start]))
            for h in stale:
                held.remove(h)
                self._nbytes -= h.end - h.start
            if not held:
                del self._ranges[path]
            return out

    def holds(self, path: str) -> bool:
        return bool(self._ranges.get(path))


def cut_held(job: Job, held: HeldBlocks, version: ObjectVersion | None) -> None:
    """Cut ``job``'s ranges around the bytes ``held`` holds for its object: those are copied
    out of the held bytes (:attr:`Job.held`), the rest fetched; a part of a range no piece
    needs is not fetched at all."""
    starts: list[int] = []
    ends: list[int] = []
    pieces: list[Pieces] = []
    inhand: dict[int, Any] = {}

    def part(a: int, b: int, table: Pieces, buf: Any) -> None:
        part_pieces = clip(table, a, b)
        if len(part_pieces):
            if buf is not None:
                inhand[len(starts)] = buf
            starts.append(a)
            ends.append(b)
            pieces.append(part_pieces)

    cut = False
    for s, e, table in zip(job.starts, job.ends, job.pieces, strict=True):
        got = held.take(job.path, s, e, version)
        if not got:
            starts.append(s)
            ends.append(e)
            pieces.append(table)
            continue
        cut = True
        at = s
        for a, b, buf in got:
            if at < a:
                part(at, a, table, None)
            part(a, b, table, buf)
            at = b
        if at < e:
            part(at, e, table, None)
    if cut:
        job.starts, job.ends, job.pieces, job.held = starts, ends, pieces, inhand


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
    ) -> None:
        self.loc = loc
        self.policy = opts.policy
        self.secrets = secrets
        self.counters = counters
        #: Each data object as the dataset was opened with it (filled by the connection's open).
        self.versions: Mapping[str, ObjectVersion] = {} if versions is None else versions
        #: Each data object's block digests: every range fetched is checked against them.
        self.blocks = blocks
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
            fill_range(job, i, inhand)
            return _FILLED
        local = self.local
        if local is not None and local.read_into(path, start, end, job.pieces[i], job.dest):
            return _FILLED
        version = self.versions.get(path)
        data = get_verified(store, path, start, end, version, self.blocks)
        fill_range(job, i, data)
        if job.keeper is not None:
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
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        failed: list[BaseException] = []

        async def one(job: Job, nreq: int, nbytes: int) -> None:
            try:
                await self._run_job(store, job)
            except BaseException as exc:
                failed.append(exc)
                raise
            finally:
                limit.release(nreq, nbytes)

        try:
            for job in jobs:
                if failed:
                    break
                # what it fetches: its held ranges are in hand already
                nreq, nbytes = len(job.starts) - len(job.held), job.fetched_nbytes
                await limit.acquire(nreq, nbytes)
                try:
                    tasks.append(loop.create_task(one(job, nreq, nbytes)))
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
