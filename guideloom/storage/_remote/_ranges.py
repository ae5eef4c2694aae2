"""Range planning for object-store reads: a batched read as byte ranges per object, and back.

A dataset's array is stored as shard objects laid end to end (:class:`Layout`). A batched read
(windows of a stream, the spans of documents, single offsets) becomes *pieces*: bytes of one
object that go to one place of the output block. Pieces of an object are sorted and coalesced
into *ranges* (one HTTP range request each) when they are adjacent or at most ``coalesce_gap``
bytes apart (or, under ``max_read_amplification``, the read's smallest gaps, within a byte
budget: :func:`bridged_gap`), a range never exceeds ``max_request_bytes`` (a longer piece is
cut into parts, which are then fetched in parallel), and ranges of one object are grouped into
*jobs* of at most ``ranges_per_call`` ranges (one blocking call on an I/O thread, its ranges
fetched concurrently). :func:`fill` is the inverse: it copies each fetched range's pieces into the output
block.

Pure: no I/O, no obstore, no asyncio; the property tests in ``tests/storage/test_ranges.py``
check it against direct slices of an in-memory byte array.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom.storage._format._manifest import ArraySpec

__all__ = [
    "FEW_PIECES",
    "Job",
    "LEAD_BYTES",
    "Layout",
    "Limits",
    "Piece",
    "Pieces",
    "bridged_gap",
    "clip",
    "fill",
    "fill_range",
    "lead",
    "pieces_table",
    "plan",
    "plan_spans",
    "plan_windows",
]

Array = npt.NDArray[Any]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
#: One piece of a range: (object offset, length, destination offset), in bytes.
Piece = tuple[int, int, int]
#: A range's pieces, one a row of an ``(n, 3)`` int64 array: (object offset, length, destination
#: offset). An array, not a list of :data:`Piece`: a read window's tens of thousands of pieces
#: would be as many Python objects, made and walked holding the GIL, and the garbage collections
#: they set off would run on the I/O threads that plan them.
Pieces = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Layout:
    """An array stored as shard objects: their dtype, paths and cumulative byte bounds."""

    dtype: np.dtype[Any]
    paths: tuple[str, ...]
    bounds: I64  # len(paths) + 1 cumulative byte offsets, bounds[0] == 0
    #: Each object's block size (0: no block digests): its ranges are widened to whole blocks,
    #: which are checked as they are fetched. Empty: none has block digests.
    blocks: tuple[int, ...] = ()

    @staticmethod
    def of(spec: ArraySpec) -> Layout:
        blocks = [f.blocks.size if f.blocks is not None else 0 for f in spec.files]
        return Layout.of_sizes(
            spec.dtype, [f.path for f in spec.files], [f.nbytes for f in spec.files], blocks
        )

    @staticmethod
    def of_sizes(
        dtype: Any, paths: Sequence[str], sizes: Sequence[int], blocks: Sequence[int] = ()
    ) -> Layout:
        bounds = np.cumsum([0, *sizes], dtype=np.int64)
        return Layout(np.dtype(dtype), tuple(paths), bounds, tuple(blocks) if any(blocks) else ())

    @property
    def nbytes(self) -> int:
        return int(self.bounds[-1])


@dataclass(frozen=True, slots=True)
class Limits:
    """How pieces become requests: coalescing distance, request size, job size.

    ``max_read_amplification`` lets a read spend bytes to save requests: besides gaps of up to
    ``coalesce_gap``, the smallest gaps between a read's pieces are bridged too, as long as all
    bridged bytes stay within ``(max_read_amplification - 1)`` times the bytes asked for. A
    dense read (a large read-ahead window of a shuffled epoch, sorted) then becomes a few large
    requests, while a sparse one (samples far apart) stays one request per piece: the rule
    depends on the read, not on a fixed distance. ``1.0`` bridges nothing beyond the gap.
    """

    coalesce_gap: int = 8 * 1024
    max_request_bytes: int = 4 * 2**20
    job_bytes: int = 16 * 2**20  # a job takes its bytes of the in-flight budget in one go
    ranges_per_call: int = 10
    max_read_amplification: float = 1.0


def bridged_gap(k: I64, lo: I64, n: I64, limits: Limits) -> int:
    """The largest gap to bridge between sorted pieces (``k``: shard, ``lo``: offset, ``n``:
    length), under :attr:`Limits.max_read_amplification`: the smallest gaps first, until
    their sum would pass the budget."""
    gap = limits.coalesce_gap
    if limits.max_read_amplification <= 1.0 or len(k) < 2:
        return gap
    # Pieces may overlap or nest (a sample read twice): a gap runs from the furthest end so far
    # in its shard, and the budget is a share of the distinct bytes asked for.
    ends = lo + n
    span = int(ends.max()) + 1
    reach = np.maximum.accumulate(k * span + ends) - k * span  # the furthest end so far, per shard
    same = k[1:] == k[:-1]
    before = np.where(same, reach[:-1], lo[1:])  # where each piece's shard was read up to
    distinct = int(n[0]) + int(np.maximum(ends[1:] - np.maximum(lo[1:], before), 0).sum())
    budget = (limits.max_read_amplification - 1.0) * float(distinct)
    gaps = lo[1:] - reach[:-1]
    # gaps the fixed rule does not bridge already, and shorter than a request: a range is cut
    # at max_request_bytes, so bridging a longer gap buys bytes without saving a request
    gaps = gaps[same & (gaps > gap) & (gaps < limits.max_request_bytes)]
    if not len(gaps):
        return gap
    gaps.sort()
    spent = np.cumsum(gaps)
    fits = int(np.searchsorted(spent, budget, side="right"))  # gaps[:fits] fit in the budget
    if fits == 0:
        return gap
    if fits < len(gaps) and gaps[fits] == gaps[fits - 1]:
        # equal gaps cannot be told apart by a threshold: bridge none of that size
        fits = int(np.searchsorted(gaps, gaps[fits], side="left"))
        if fits == 0:
            return gap
    return max(gap, int(gaps[fits - 1]))


@dataclass(slots=True)
class Job:
    """Coalesced ranges of one object, fetched by one call, and where their bytes go."""

    path: str
    dest: U8
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    #: per range: every piece it serves
    pieces: list[Pieces] = field(default_factory=list)
    #: range index -> its bytes, already in hand (verified blocks an earlier read kept): copied
    #: out, not fetched
    held: dict[int, Any] = field(default_factory=dict)
    #: the read it belongs to, for which the verified ranges it fetches are held (for the reads
    #: planned after it that touch them); None: not held
    keeper: Any = None

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))

    def takes(self, path: str, dest: U8, nbytes: int, limits: Limits) -> bool:
        """Whether a range of ``nbytes`` of ``path``, copied to ``dest``, joins this job."""
        return (
            self.path == path
            and self.dest is dest
            and len(self.starts) < limits.ranges_per_call
            and self.nbytes + nbytes <= limits.job_bytes
        )

    @property
    def fetched_nbytes(self) -> int:
        """The bytes its ranges fetch (those held are not)."""
        held = self.held
        return sum(
            e - s for i, (s, e) in enumerate(zip(self.starts, self.ends, strict=True)) if i not in held
        )

    def singles(self) -> list[Job]:
        """One job per range (a failed multi-range call is retried range by range)."""
        return [
            Job(self.path, self.dest, [s], [e], [p], {0: self.held[i]} if i in self.held else {}, self.keeper)
            for i, (s, e, p) in enumerate(zip(self.starts, self.ends, self.pieces, strict=True))
        ]


def pieces_of(layout: Layout, starts: I64, lengths: I64, dest_offsets: I64) -> tuple[I64, I64, I64, I64]:
    """Bytes ``[s, s+n)`` of the array as (shard, offset in shard, length, destination) pieces,
    cut at shard boundaries."""
    keep = lengths > 0
    starts, lengths, dest_offsets = starts[keep], lengths[keep], dest_offsets[keep]
    bounds = layout.bounds
    ends = starts + lengths
    if len(starts) and (int(ends.max()) > int(bounds[-1]) or int(starts.min()) < 0):
        raise IndexError(
            f"a read of bytes [{int(starts.min())}, {int(ends.max())}) reaches outside the stored "
            f"{int(bounds[-1])} bytes"
        )
    shard = np.searchsorted(bounds, starts, side="right") - 1
    inside = ends <= bounds[np.minimum(shard + 1, len(bounds) - 1)]
    k, lo, n, d = shard[inside], starts[inside] - bounds[shard[inside]], lengths[inside], dest_offsets[inside]
    extra: list[tuple[int, int, int, int]] = []
    for i in np.flatnonzero(~inside).tolist():  # pieces that cross a shard boundary
        s, e, off = int(starts[i]), int(ends[i]), int(dest_offsets[i])
        while s < e:
            kk = int(np.searchsorted(bounds, s, side="right")) - 1
            stop = min(e, int(bounds[kk + 1]))
            extra.append((kk, s - int(bounds[kk]), stop - s, off))
            off += stop - s
            s = stop
    if extra:
        ex = np.asarray(extra, dtype=np.int64)
        k, lo, n, d = (np.concatenate([a, ex[:, j]]) for j, a in enumerate((k, lo, n, d)))
    return k, lo, n, d


def _units(blocks: Sequence[int], k: I64, cap: int) -> list[int]:
    """For each piece of object ``k``: the largest whole number of its blocks within ``cap`` (one
    block at least), or 0 where the object has no block digests."""
    blk = np.asarray(blocks, dtype=np.int64)[k]
    units: list[int] = np.where(blk > 0, np.maximum(blk, cap // np.maximum(blk, 1) * blk), 0).tolist()
    return units


def _cut(k: I64, lo: I64, n: I64, d: I64, cap: int, blocks: Sequence[int]) -> tuple[I64, I64, I64, I64]:
    """Pieces longer than ``cap`` as parts of at most ``cap`` bytes (fetched in parallel). In an
    object with block digests, the parts are cut at multiples of the largest whole number of
    blocks within ``cap`` (one block at least): widened to whole blocks, a part stays that long."""
    units = np.asarray(_units(blocks, k, cap) if blocks else np.zeros(len(k)), dtype=np.int64)
    aligned = units > 0
    unit = np.where(aligned, units, cap)
    first_end = np.where(aligned, (lo // np.maximum(unit, 1) + 1) * unit, lo + cap)
    cross = lo + n > first_end
    if not cross.any():
        return k, lo, n, d
    parts: list[tuple[int, int, int, int]] = []
    for i in np.flatnonzero(cross).tolist():
        kk, u, al = int(k[i]), int(unit[i]), bool(aligned[i])
        s, e, off = int(lo[i]), int(lo[i] + n[i]), int(d[i])
        while s < e:
            stop = min(e, (s // u + 1) * u if al else s + u)
            parts.append((kk, s, stop - s, off))
            off += stop - s
            s = stop
    keep = ~cross
    ex = np.asarray(parts, dtype=np.int64)
    k, lo, n, d = (np.concatenate([a[keep], ex[:, j]]) for j, a in enumerate((k, lo, n, d)))
    return k, lo, n, d


def plan(
    layout: Layout,
    starts: I64,
    lengths: I64,
    dest_offsets: I64,
    *,
    dest: U8,
    limits: Limits,
    jobs: list[Job],
) -> None:
    """Append to ``jobs`` what copies bytes ``[s, s+n)`` of ``layout`` to ``dest[d:d+n]``, for
    each ``(s, n, d)`` of ``starts``, ``lengths``, ``dest_offsets`` (byte units)."""
    k, lo, n, d = pieces_of(
        layout,
        np.asarray(starts, dtype=np.int64),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(dest_offsets, dtype=np.int64),
    )
    if not len(k):
        return
    cap = limits.max_request_bytes
    k, lo, n, d = _cut(k, lo, n, d, cap, layout.blocks)
    order = np.lexsort((lo, k))
    gap = bridged_gap(k[order], lo[order], n[order], limits)
    k, lo, n, d = (a[order] for a in (k, lo, n, d))
    wlo, whi = _widened(layout, k, lo, lo + n)
    # Where the object has block digests, a range stays within one of _cut's aligned units: the
    # parts that share a block then always share its one request.
    units = _units(layout.blocks, k, cap) if layout.blocks else None
    pieces = np.stack([lo, n, d], axis=1)  # each range's are a view of its rows
    if units is not None and min(units) > 0 and len(k) * (int(whi.max()) + 1) < 2**62:
        firsts, ends = _unit_ranges(k, wlo, whi, np.asarray(units, dtype=np.int64), gap)
    else:
        firsts, ends = _capped_ranges(k.tolist(), wlo.tolist(), whi.tolist(), units, gap, cap)
    job: Job | None = None
    starts, ks = wlo[firsts].tolist(), k[firsts].tolist()
    for r, (first, kk, start, end) in enumerate(zip(firsts, ks, starts, ends, strict=True)):
        path = layout.paths[kk]
        if job is None or not job.takes(path, dest, end - start, limits):
            job = Job(path, dest)
            jobs.append(job)
        job.starts.append(start)
        job.ends.append(end)
        job.pieces.append(pieces[first : firsts[r + 1] if r + 1 < len(firsts) else len(pieces)])


def _capped_ranges(
    ks: list[int], wlo: list[int], whi: list[int], units: list[int] | None, gap: int, cap: int
) -> tuple[list[int], list[int]]:
    """The ranges of pieces sorted by object and offset, widened to ``[wlo, whi)``: the index of
    each range's first piece, and each range's end. A piece joins the range before it where
    it is of the same object and starts within ``gap`` of its end, and the range stays within one
    of the piece's ``units`` (an object with block digests) or ``cap`` bytes long (one without)."""
    firsts: list[int] = []
    ends: list[int] = []
    cur_k = cur_s = cur_e = -1
    for i, (kk, ws, we) in enumerate(zip(ks, wlo, whi, strict=True)):
        unit = units[i] if units is not None else 0
        if (
            kk == cur_k
            and ws <= cur_e + gap
            and (ws // unit == cur_s // unit if unit else max(cur_e, we) - cur_s <= cap)
        ):
            cur_e = max(cur_e, we)
            continue
        if firsts:
            ends.append(cur_e)
        firsts.append(i)
        cur_k, cur_s, cur_e = kk, ws, we
    if firsts:
        ends.append(cur_e)
    return firsts, ends


def _unit_ranges(k: I64, wlo: I64, whi: I64, units: I64, gap: int) -> tuple[list[int], list[int]]:
    """:func:`_capped_ranges` where every piece's object has block digests, in a few numpy calls
    (a loop over the pieces held the GIL for milliseconds on an I/O thread): in a run of pieces
    of one object and one unit, the widened starts only grow, so the furthest end so far of the
    run is the furthest end of the range being built, and a range starts where a piece starts
    more than ``gap`` past it."""
    count = len(k)
    index = wlo // units
    new_run = np.ones(count, dtype=bool)
    new_run[1:] = (k[1:] != k[:-1]) | (index[1:] != index[:-1])
    run = np.cumsum(new_run) - 1
    span = int(whi.max()) + 1
    reach = np.maximum.accumulate(run * span + whi) - run * span  # the furthest end so far, per run
    first = new_run.copy()
    first[1:] |= wlo[1:] > reach[:-1] + gap
    firsts = np.flatnonzero(first)
    ends = np.maximum.reduceat(whi, firsts)
    return firsts.tolist(), ends.tolist()


def _widened(layout: Layout, k: I64, lo: I64, hi: I64) -> tuple[I64, I64]:
    """Pieces' byte ranges ``[lo, hi)`` of their objects ``k``, widened to whole blocks where the
    object has block digests (each block fetched is checked whole)."""
    if not layout.blocks:
        return lo, hi
    size = np.asarray(layout.blocks, dtype=np.int64)[k]
    has = size > 0
    size = np.where(has, size, 1)
    nbytes = np.diff(layout.bounds)[k]
    wlo = np.where(has, lo // size * size, lo)
    whi = np.where(has, np.minimum(nbytes, -(-hi // size) * size), hi)
    return wlo, whi


def plan_windows(
    layouts: Mapping[str, Layout], starts: I64, length: int, limits: Limits
) -> tuple[list[Job], dict[str, Array]]:
    """Jobs that read elements ``[s, s+length)`` of every array, and the ``(n, length)`` blocks
    they fill (one per array, in the arrays' own dtypes)."""
    starts = np.asarray(starts, dtype=np.int64)
    n = len(starts)
    jobs: list[Job] = []
    outs: dict[str, Array] = {}
    for name, layout in layouts.items():
        item = layout.dtype.itemsize
        out = np.empty((n, length), dtype=layout.dtype)
        outs[name] = out
        row = length * item
        plan(
            layout,
            starts * item,
            np.full(n, row, dtype=np.int64),
            np.arange(n, dtype=np.int64) * row,
            dest=out.reshape(-1).view(np.uint8),
            limits=limits,
            jobs=jobs,
        )
    return jobs, outs


def plan_spans(layout: Layout, starts: I64, stops: I64, limits: Limits) -> tuple[list[Job], Array, list[int]]:
    """Jobs that read elements ``[starts[i], stops[i])`` back to back into one flat buffer, the
    buffer, and each span's bounds in it (``len(starts) + 1`` of them)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(stops, dtype=np.int64) - starts
    item = layout.dtype.itemsize
    pos = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=pos[1:])
    flat = np.empty(int(pos[-1]), dtype=layout.dtype)
    jobs: list[Job] = []
    plan(
        layout,
        starts * item,
        lengths * item,
        pos[:-1] * item,
        dest=flat.view(np.uint8),
        limits=limits,
        jobs=jobs,
    )
    return jobs, flat, pos.tolist()


def clip(pieces: Pieces, start: int, end: int) -> Pieces:
    """The parts of ``pieces`` inside bytes ``[start, end)`` of their object, each with its
    destination moved by as much as its start (a piece across the bounds is cut at them)."""
    lo, n, d = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    s = np.maximum(lo, start)
    e = np.minimum(lo + n, end)
    inside = e > s
    if inside.all() and (s == lo).all() and (e == lo + n).all():
        return pieces
    s, e = s[inside], e[inside]
    return np.stack([s, e - s, d[inside] + (s - lo[inside])], axis=1)


def fill(job: Job, buffers: Sequence[Any]) -> None:
    """Copy the pieces of each fetched range (``buffers[i]`` holds ``[starts[i], ends[i])``)."""
    if len(buffers) != len(job.starts):
        raise ValueError(f"{len(buffers)} buffers for {len(job.starts)} ranges")
    for i, buf in enumerate(buffers):
        fill_range(job, i, buf)


#: Pieces of a range copied one by one up to this many. More are copied by a bounded number of
#: numpy calls whatever their count and lengths (:func:`_scatter`): a copy of each piece in turn
#: takes and drops the GIL once per piece, a thousand times for a range of a thousand samples,
#: and every other thread, the caller's event loop among them, waits in line at each.
FEW_PIECES = 16


def pieces_table(pieces: Sequence[Sequence[int]]) -> Pieces:
    """``pieces`` (object offset, length, destination offset) as a :data:`Pieces` array."""
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 3)


def fill_range(job: Job, i: int, buf: Any) -> None:
    """Copy the pieces of ``job``'s range ``i`` out of its fetched bytes ``buf``."""
    base, end = job.starts[i], job.ends[i]
    src = np.frombuffer(memoryview(buf), dtype=np.uint8)
    if src.nbytes != end - base:
        raise ValueError(f"a buffer of {src.nbytes} bytes for a range of {end - base}")
    dest = job.dest
    table = job.pieces[i]
    if len(table) <= FEW_PIECES or dest.ndim != 1:
        for s, ln, off in table.tolist():
            dest[off : off + ln] = src[s - base : s - base + ln]
        return
    at, lengths, offs = table[:, 0] - base, table[:, 1], table[:, 2]
    if int(lengths.min()) < 0 or int(at.min()) < 0 or int((at + lengths).max()) > src.nbytes:
        raise ValueError(f"a piece outside the range [{base}, {end})")
    if int(offs.min()) < 0 or int((offs + lengths).max()) > dest.shape[0]:
        raise ValueError(f"a piece of the range [{base}, {end}) outside its {dest.shape[0]}-byte destination")
    _scatter(src, dest, at, lengths, offs)


def _scatter(src: U8, dest: U8, at: I64, lengths: I64, offs: I64) -> None:
    """Copy ``src[at[j] : at[j] + lengths[j]]`` to ``dest[offs[j] :]`` for every ``j`` (bounds
    checked) in at most two row copies per power of two of the lengths, however many pieces.

    The pieces of lengths in ``[2**k, 2**(k+1))`` are rows of one strided view of ``src``,
    gathered and scattered to rows of one of ``dest`` (the GIL released meanwhile): as many bytes
    from each piece's start as the shortest has, then as many up to each longer piece's end as
    the longest has beyond the shortest. These overlap (with the same bytes) rather than pass
    the piece's end: at most twice its bytes copied.
    """
    octave = np.frexp(lengths)[1]  # 0 for an empty piece: rows of no bytes
    order = np.argsort(octave, kind="stable")
    at, lengths, offs, octave = at[order], lengths[order], offs[order], octave[order]
    bounds = [0, *(np.flatnonzero(np.diff(octave)) + 1).tolist(), len(lengths)]
    for lo, hi in itertools.pairwise(bounds):
        a, n, o = at[lo:hi], lengths[lo:hi], offs[lo:hi]
        head, tail = int(n.min()), int(n.max() - n.min())
        _rows(src, dest, a, o, head)
        if tail:
            longer = n > head
            _rows(src, dest, a[longer] + n[longer] - tail, o[longer] + n[longer] - tail, tail)


def _rows(src: U8, dest: U8, at: I64, offs: I64, width: int) -> None:
    """Copy ``width`` bytes from each ``src[at[j]:]`` to ``dest[offs[j]:]``."""
    step = dest.strides[0]
    rows = np.lib.stride_tricks.as_strided(src, shape=(src.shape[0] - width + 1, width), strides=(1, 1))
    out = np.lib.stride_tricks.as_strided(
        dest, shape=(dest.shape[0] - width + 1, width), strides=(step, step), writeable=True
    )
    out[offs] = rows[at]


#: The most bytes a read made ahead of the read that follows it (an epoch's first batch, read
#: alone before the rest of its mixing window) fetches beside its own blocks in one of that
#: read's ranges, so as to reach the range's nearer end (:func:`lead`). Those bytes come before
#: the first batch (its GETs grow by at most this), but are not fetched twice: the following read
#: takes them off its range's end and fetches the rest with the one request it sends anyway.
LEAD_BYTES = 2**20


def lead(jobs: list[Job], after: Sequence[Job], limits: Limits, most: int = LEAD_BYTES) -> list[Job]:
    """``jobs`` with their ranges that lie inside a range of the read planned next (``after``)
    widened to that range's ends, by at most ``most`` bytes a side, as jobs again (``limits``).

    The blocks a read fetches are held for the next read (:mod:`._held`), which cuts a held run
    out of its ranges for free only at a range's end: one inside a range splits its GET in two
    and is fetched again instead. A range of ``after`` holding runs of ``jobs`` is fetched here
    from its start through the last run of a prefix, and from the first run of a suffix to its
    end, the split that widens the most runs, then the fewest bytes; runs left between are
    fetched as they were. Ranges outside ``after``'s stay as they are; nothing is fetched twice.
    """
    pairs: dict[str, list[tuple[int, int]]] = {}
    for job in after:
        pairs.setdefault(job.path, []).extend(zip(job.starts, job.ends, strict=True))
    spans = {path: sorted(p) for path, p in pairs.items()}  # per object: sorted, disjoint
    ranges = [
        (job, s, e, p)
        for job in jobs
        for i, (s, e, p) in enumerate(zip(job.starts, job.ends, job.pieces, strict=True))
        if i not in job.held
    ]
    if not spans or len(ranges) != sum(len(job.starts) for job in jobs):
        return jobs  # nothing to lead, or ranges in hand already: as planned
    out: list[tuple[Job, int, int, Pieces]] = []
    group: list[tuple[Job, int, int, Pieces]] = []
    where: tuple[str, int, int] | None = None  # the range of `after` the group lies in

    def flush() -> None:
        if group and where is not None:
            out.extend(_widen_group(group, where[1], where[2], most))
        else:
            out.extend(group)
        group.clear()

    for r in ranges:
        job, s, e, _ = r
        inside: tuple[str, int, int] | None = None
        bounds = spans.get(job.path)
        if bounds is not None:
            k = bisect.bisect_right(bounds, (s, 2**62)) - 1
            if k >= 0 and e <= bounds[k][1]:
                inside = (job.path, *bounds[k])
        if inside is None or inside != where or (group and group[-1][0].dest is not job.dest):
            flush()
            where = inside
        group.append(r)
    flush()
    return _regroup(out, limits)


def _widen_group(
    group: list[tuple[Job, int, int, Pieces]], lo: int, hi: int, most: int
) -> list[tuple[Job, int, int, Pieces]]:
    """The runs ``group`` (sorted, of one object, inside range ``[lo, hi)`` of the next read),
    a prefix of them widened to ``lo`` and a suffix to ``hi`` (:func:`lead`)."""
    k = len(group)
    own = [0, *itertools.accumulate(e - s for _, s, e, _ in group)]  # own[i]: bytes of runs [0, i)
    best: tuple[int, int, int, int] | None = None  # (-runs widened, bytes added, i, j)
    for i in range(k + 1):  # runs [0, i) widened to lo
        left = (group[i - 1][2] - lo) - own[i] if i else 0
        if left > most:
            break
        for j in range(k, i - 1, -1):  # runs [j, k) widened to hi
            right = (hi - group[j][1]) - (own[k] - own[j]) if j < k else 0
            if right > most:
                break
            key = (-(i + k - j), left + right, i, j)
            if best is None or key < best:
                best = key
    if best is None or best[0] == 0:
        return group
    _, _, i, j = best
    out: list[tuple[Job, int, int, Pieces]] = []
    if i:
        out.append((group[0][0], lo, group[i - 1][2], np.concatenate([g[3] for g in group[:i]])))
    out.extend(group[i:j])
    if j < k:
        out.append((group[j][0], group[j][1], hi, np.concatenate([g[3] for g in group[j:]])))
    return out


def _regroup(ranges: list[tuple[Job, int, int, Pieces]], limits: Limits) -> list[Job]:
    """Ranges (each with the job it came from) as jobs again, grouped as :func:`plan` groups."""
    jobs: list[Job] = []
    job: Job | None = None
    for old, s, e, pieces in ranges:
        if job is None or not job.takes(old.path, old.dest, e - s, limits):
            job = Job(old.path, old.dest, keeper=old.keeper)
            jobs.append(job)
        job.starts.append(s)
        job.ends.append(e)
        job.pieces.append(pieces)
    return jobs
