"""Verified blocks an object-store read fetched, held for the reads after it that touch them
(:class:`HeldBlocks`): the first batch read alone before its mixing window's read, and a mixing
window read in parts, share what one of them fetched. :func:`cut_held` cuts a planned job's
ranges around what is held, where that saves more than the request it costs
(:data:`MIN_CUT_BYTES`); :meth:`HeldBlocks.room` says which earlier reads a part of the next
mixing window waits for, so that the blocks it fetches for its later parts can be held.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

from guideloom._process import pool
from guideloom.storage._remote._objstore import ObjectVersion
from guideloom.storage._remote._ranges import Job, Pieces, clip

__all__ = ["HOLD_BYTES", "MIN_CUT_BYTES", "PART_SPAN", "HeldBlocks", "Read", "cut_held", "free"]


#: The most bytes held at once by default (a storage sets its own, its ``read_window_bytes``):
#: one "auto" mixing window, 16 blocks of 4 MiB.
HOLD_BYTES: Final = 64 * 2**20

#: A read whose ranges span at least this many times the bytes its samples take is one part of
#: a mixing window read in parts: the later parts take most of the blocks it fetches, so it
#: waits for room to hold them (:meth:`HeldBlocks.room`). A window read whole spans about its
#: samples' bytes (its blocks are full of them); a part of one read in two spans about twice.
PART_SPAN: Final = 1.5


class _Held(NamedTuple):
    start: int
    end: int
    data: memoryview  # bytes [start, end) of the object, every block checked against its digest
    version: ObjectVersion | None  # the object the GET was conditional on
    owner: Read | None  # the read that fetched it
    used: int  # the count of reads planned when the last read that touches it was


class Read:
    """One read of a reading session, as :class:`HeldBlocks` sees it: the byte ranges of each
    object it touches (whole blocks, before any is cut out as held), their bytes (``span``),
    the bytes its samples take (``wanted``; not given: its span), the bytes it fetches
    (``fetching``: its span until its ranges are cut around held blocks) and those of them that
    arrived so far, its place in the order of reads, whether it started fetching (``asked``) and
    whether it finished; ``done`` is set when it finishes, failed or not."""

    __slots__ = ("arrived", "asked", "done", "fetching", "finished", "order", "span", "touched", "wanted")

    def __init__(self, touched: dict[str, tuple[list[int], list[int]]], wanted: int | None = None) -> None:
        self.touched = touched  # per object: sorted, disjoint starts and ends
        self.span = sum(e - s for starts, ends in touched.values() for s, e in zip(starts, ends, strict=True))
        self.wanted = self.span if wanted is None else wanted
        self.fetching = self.span
        self.arrived = 0
        self.order = 0  # its ticket (HeldBlocks.begin_read)
        self.asked = False
        self.finished = False
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    @staticmethod
    def of(jobs: Sequence[Job]) -> Read:
        spans: dict[str, list[tuple[int, int]]] = {}
        wanted = 0
        for job in jobs:
            spans.setdefault(job.path, []).extend(zip(job.starts, job.ends, strict=True))
            wanted += sum(int(table[:, 1].sum()) for table in job.pieces)
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
        return Read(touched, wanted)

    @property
    def pending(self) -> int:
        """The bytes it still fetches (and would hold)."""
        return 0 if self.finished else max(0, self.fetching - self.arrived)

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

    Room: the first part of the next mixing window read in parts is planned while the reads of
    the last one still hold its blocks for each other; what it fetched then would not fit, and
    its later parts would fetch it again. It waits for those reads instead (:meth:`room`), where
    its blocks fit under the bound once they are let go.
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
        #: set (and replaced) each time a read called is planned or skipped
        self._plans: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: set (and replaced) each time a read called is planned, skipped, asks or finishes
        self._moved: concurrent.futures.Future[None] = concurrent.futures.Future()
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
        """A reading session begins: what an earlier one held is let go, and its reads count as
        finished (one abandoned mid-plan, by an iterator closed or a loop that ended, never says
        so itself: no read of the new session waits for it)."""
        with self._lock:
            gone = self._let_go_all()
            self._release = None
            stale, self._reads = self._reads, []
            self._unplanned.clear()
            plans = self._planned_one()
        free(gone)
        _set(plans)
        for r in stale:
            r.finished = True
            if not r.done.done():
                r.done.set_result(None)

    def clear(self) -> None:
        """Closing: everything held is let go."""
        self.begin()

    def _let_go_all(self) -> list[_Held]:
        gone = [h for held in self._ranges.values() for h in held]
        self._ranges.clear()
        self._nbytes = 0
        return gone

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
            gone = self._maybe_release()
            plans = self._planned_one()
        free(gone)
        _set(plans)

    def begin_read(self, read: Read, ticket: int | None = None) -> list[concurrent.futures.Future[None]]:
        """``read`` (called with ``ticket``) is planned: the held ranges it touches are marked used
        by it; where it touches none, the reads have moved on (the next mixing window): what no
        unfinished read touches is let go, once every read called before it is planned (one
        planned later may still touch them). Returns what it waits for before it cuts its ranges
        (:meth:`waits`)."""
        with self._lock:
            self._reads.append(read)
            read.order = self._tickets if ticket is None else ticket
            self._count += 1
            touched = False
            for path, held in self._ranges.items():
                for i, h in enumerate(held):
                    if read.touches(path, h.start, h.end):
                        held[i] = h._replace(used=self._count)
                        touched = True
            plans = None
            if ticket is not None:
                self._unplanned.discard(ticket)
                plans = self._planned_one()
            if self._ranges and not touched:
                at = self._tickets if ticket is None else ticket
                self._release = at if self._release is None else max(self._release, at)
            gone = self._maybe_release()
            waits = self._waits(read)
        free(gone)
        if plans is not None:
            _set(plans)
        return waits

    def waits(self, read: Read) -> list[concurrent.futures.Future[None]]:
        """What ``read`` waits for before it cuts its ranges and fetches (empty: nothing; ask
        again after each wait): while a read called before it is not planned yet, the next read
        planned (it may touch the same blocks); then the ``done`` of each unfinished read called
        before it that touches blocks it touches, whose blocks it then takes. The order of the
        calls decides, not that of the plans: a small read called after a large one is planned
        first, and would fetch their shared blocks in its own many small ranges (a straddling
        read of 1,582 samples would fetch a mixing window's 45 MiB in 145 requests, where the
        read called before it takes 15) while the earlier read waited for it."""
        with self._lock:
            return self._waits(read)

    def _waits(self, read: Read) -> list[concurrent.futures.Future[None]]:
        if self._unplanned_before(read.order):
            return [self._plans]
        out, after = [], False
        for r in self._reads:  # in planning order: of reads without a ticket, that decides
            if r is read:
                after = True
                continue
            earlier = r.order < read.order or (r.order == read.order and not after)
            if earlier and not r.done.done() and r.overlaps(read):
                out.append(r.done)
        return out

    def _unplanned_before(self, order: int) -> bool:
        """Whether a read called before ticket ``order`` is not planned yet (under the lock)."""
        return any(t < order for t in self._unplanned)

    def _planned_one(self) -> list[concurrent.futures.Future[None]]:
        """A read called was planned or skipped (under the lock): the futures to set (outside it)
        for the reads waiting to see every read called before them planned (:meth:`room`) or
        fetching (:meth:`turn`)."""
        plans, self._plans = self._plans, concurrent.futures.Future()
        return [plans, *self._moved_one()]

    def _moved_one(self) -> list[concurrent.futures.Future[None]]:
        """A read called was planned, skipped, asked or finished (under the lock): the future to
        set (outside it) for the reads waiting for their turn to fetch (:meth:`turn`)."""
        moved, self._moved = self._moved, concurrent.futures.Future()
        return [moved]

    def turn(self, read: Read) -> list[concurrent.futures.Future[None]]:
        """What ``read`` waits for before it asks for room in flight (empty: nothing; ask again
        after each wait): while a read called before it is not planned yet, or is planned and
        has not started fetching (it waits for reads before it, or for its thread), the next
        move of the reads. The in-flight limit admits the waiting requests of the earliest read
        first, but a later read ready first would take the whole budget before the earlier one
        asks: the next window's bytes, then the one called first, whose batches come next."""
        with self._lock:
            if self._unplanned_before(read.order) or any(
                r.order < read.order and not r.asked for r in self._reads if r is not read
            ):
                return [self._moved]
            return []

    def asks(self, read: Read) -> None:
        """``read`` starts fetching: the reads called after it that wait for their turn go on."""
        with self._lock:
            read.asked = True
            moved = self._moved_one()
        _set(moved)

    def room(self, read: Read) -> list[concurrent.futures.Future[None]]:
        """The ``done`` of the earlier unfinished reads ``read`` waits for before it fetches (its
        ranges cut around held blocks): those called before it that touch none of its blocks
        (the last mixing window's), where it is one part of a window read in parts
        (:data:`PART_SPAN`), its blocks would fit under the bound alone, and not beside what is
        held and what those reads still fetch. Once they end, what they held is let go for its
        blocks. Empty: it fetches now (call again after waiting: a read called before it may
        have been planned meanwhile). While a read called before it is not planned yet (reads
        are planned concurrently), it waits for the next read planned, then asks again."""
        with self._lock:
            need = read.pending
            if not 0 < need <= self.limit or read.span < PART_SPAN * read.wanted:
                return []
            if self._unplanned_before(read.order):
                return [self._plans]
            earlier = [
                r for r in self._reads if r is not read and r.order < read.order and not r.overlaps(read)
            ]
            if not earlier or self._nbytes + need + sum(r.pending for r in earlier) <= self.limit:
                return []
            return [r.done for r in earlier]

    def fetches(self, read: Read, nbytes: int) -> None:
        """``read``'s ranges were cut around held blocks: it fetches ``nbytes``."""
        with self._lock:
            read.fetching = nbytes

    def arrived(self, read: Read, nbytes: int) -> None:
        """``nbytes`` of what ``read`` fetches arrived (or were read from a local copy)."""
        with self._lock:
            read.arrived += nbytes

    def _maybe_release(self) -> list[_Held]:
        at = self._release
        if at is not None and not self._unplanned_before(at):
            self._release = None
            return self._let_go(self._claimed)
        return []

    def end_read(self, read: Read) -> None:
        """``read`` finished (failed or not): the reads that wait for it go on."""
        with self._lock:
            read.finished = True
            if read in self._reads:
                self._reads.remove(read)
            moved = self._moved_one()
        if not read.done.done():
            read.done.set_result(None)
        _set(moved)

    def _claimed(self, h: _Held, path: str) -> bool:
        """Whether an unfinished read other than the one that fetched ``h`` touches it."""
        return any(r is not h.owner and r.touches(path, h.start, h.end) for r in self._reads)

    def _let_go(self, keep: Callable[[_Held, str], bool]) -> list[_Held]:
        """Let go of the ranges ``keep`` refuses; returns them, for :func:`free`."""
        gone: list[_Held] = []
        for path, held in list(self._ranges.items()):
            kept: list[_Held] = []
            dropped: list[_Held] = []
            for h in held:
                (kept if keep(h, path) else dropped).append(h)
            if not dropped:
                continue
            gone += dropped
            self._nbytes -= sum(h.end - h.start for h in dropped)
            if kept:
                self._ranges[path] = kept
            else:
                del self._ranges[path]
        return gone

    def _make_room(self, nbytes: int) -> list[_Held]:
        """Let go of the ranges used longest ago that no unfinished read (but their own) touches,
        until ``nbytes`` more fit under the bound; of those last used alike, the ranges of the
        read called first go first. Reads are planned ahead, so the last window's blocks and
        those the next window's first part fetches often share the clock, and its later part,
        not planned yet, claims none of them: by the objects' names, the part would let go of
        its own blocks and its later part fetch them again."""
        need = self._nbytes + nbytes - self.limit
        if need <= 0:
            return []
        oldest = sorted(
            (h.used, -1 if h.owner is None else h.owner.order, path, h.start, h.end)
            for path, held in self._ranges.items()
            for h in held
        )
        gone: set[tuple[str, int]] = set()
        for _, _, path, start, end in oldest:
            if need <= 0:
                break
            h = next(x for x in self._ranges[path] if x.start == start)
            if self._claimed(h, path):
                continue
            gone.add((path, start))
            need -= end - start
        if need <= 0:
            return self._let_go(lambda h, path: (path, h.start) not in gone)
        return []

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
        no unfinished read touches; where bytes of it are held already, only the parts around
        them (held ranges start and end at block bounds, so those parts are whole blocks too:
        a range that also fetched a held block, which a later read would otherwise fetch again
        whole); nothing where no room is made."""
        view = memoryview(data).cast("B")
        if view.nbytes != end - start:
            return
        with self._lock:
            parts = self._unheld(path, start, end)
            gone = self._make_room(sum(b - a for a, b in parts))
            for a, b in parts:
                self._hold(path, a, b, view[a - start : b - start], version, owner)
        free(gone)

    def _unheld(self, path: str, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` of ``path`` that no held range covers."""
        held = self._ranges.get(path, [])
        i = max(0, bisect.bisect_right(held, start, key=lambda h: h.start) - 1)
        parts: list[tuple[int, int]] = []
        at = start
        for h in held[i:]:
            if h.start >= end:
                break
            if h.end <= at:
                continue
            if at < h.start:
                parts.append((at, h.start))
            at = max(at, h.end)
        if at < end:
            parts.append((at, end))
        return parts

    def _hold(
        self,
        path: str,
        start: int,
        end: int,
        view: memoryview,
        version: ObjectVersion | None,
        owner: Read | None,
    ) -> None:
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
        free(stale)
        return out

    def holds(self, path: str) -> bool:
        return bool(self._ranges.get(path))


def _set(futures: list[concurrent.futures.Future[None]]) -> None:
    """Set ``futures`` (taken under the lock, set outside it: their callbacks run here)."""
    for f in futures:
        f.set_result(None)


def free(gone: list[_Held]) -> None:
    """Drop the buffers of ``gone`` (let go of, emptied here) on a thread of their own, one at a
    time with the GIL let go between two: freeing a fetched buffer of a few MiB unmaps its pages
    with the GIL held, and a mixing window's 64 MiB freed at once (the next window's first read,
    planned on the event loop where it is small, or a close) kept an event loop from running
    for tens of milliseconds on a loaded machine."""
    if gone:
        batch = gone[:]
        gone.clear()
        pool("free", 1).submit(_drop_each, batch)


def _drop_each(gone: list[_Held]) -> None:
    while gone:
        gone.pop()
        time.sleep(0)  # lets go of the GIL: a thread waiting for it takes it now


#: The least run of held bytes inside a range that is cut out of it (a run at either end of a
#: range is cut whatever its length: that costs no request). A cut inside a range splits its GET
#: in two: a request costs a round trip and the store's per-request work, more than fetching a
#: few blocks again, so scattered blocks (an epoch's first batch) are fetched again with their
#: range and long runs (a mixing window read in parts) are not.
MIN_CUT_BYTES = 2**20


def _worth_cutting(
    got: list[tuple[int, int, Any]], start: int, end: int, min_cut: int
) -> list[tuple[int, int, Any]]:
    """The held pieces of range ``[start, end)`` worth cutting out: each run of adjacent pieces
    at an end of the range, or at least ``min_cut`` bytes long."""
    runs: list[list[tuple[int, int, Any]]] = []
    for piece in got:
        if runs and runs[-1][-1][1] == piece[0]:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [
        p
        for run in runs
        if run[0][0] == start or run[-1][1] == end or run[-1][1] - run[0][0] >= min_cut
        for p in run
    ]


def cut_held(job: Job, held: HeldBlocks, version: ObjectVersion | None, min_cut: int | None = None) -> None:
    """Cut ``job``'s ranges around the bytes ``held`` holds for its object, where that saves
    more than the request it costs (:data:`MIN_CUT_BYTES`): those are copied out of the held
    bytes (:attr:`Job.held`), the rest fetched; a part of a range no piece needs is not
    fetched at all."""
    least = MIN_CUT_BYTES if min_cut is None else min_cut
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
        got = _worth_cutting(held.take(job.path, s, e, version), s, e, least)
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
