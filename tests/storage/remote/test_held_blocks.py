"""Verified blocks held for the reads after the one that fetched them (``HeldBlocks``) and the
ranges of a later read cut around them (``cut_held``), against direct slices of in-memory bytes:
every piece gets its bytes, no held byte is fetched again by the reads of one mixing window (a
first batch read alone, then the window read in parts), a held range of another object version
is never used, and no more than the bound is held."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom.storage._remote._held import HOLD_BYTES, HeldBlocks, Read, cut_held
from guideloom.storage._remote._objstore import ObjectVersion
from guideloom.storage._remote._ranges import Job, Layout, Limits, fill_range, lead, plan

SETTINGS = settings(max_examples=150, deadline=None)
Reads = list[tuple[int, int]]


@st.composite
def reads_in_parts(draw: Any) -> tuple[int, list[int], list[Reads], Limits]:
    """A block size, shard sizes, and reads (each a list of (start, length)): a small first
    one, then parts of various sizes."""
    block = draw(st.sampled_from([4, 16, 32]))
    sizes = draw(st.lists(st.integers(1, 400), min_size=1, max_size=4))
    total = sum(sizes)

    def reads(most: int, longest: int) -> Reads:
        out = []
        for _ in range(draw(st.integers(1, most))):
            start = draw(st.integers(0, total - 1))
            out.append((start, draw(st.integers(1, min(longest, total - start)))))
        return out

    cap = draw(st.sampled_from([block, 2 * block, 8 * block, 64 * block]))
    limits = Limits(draw(st.integers(0, 3 * block)), cap, 4 * cap, draw(st.integers(1, 10)))
    parts = [reads(4, 2 * block)] + [reads(30, 6 * block) for _ in range(draw(st.integers(1, 5)))]
    return block, sizes, parts, limits


def planned(layout: Layout, reads: Reads, limits: Limits) -> tuple[list[Job], np.ndarray]:
    starts = np.asarray([s for s, _ in reads], dtype=np.int64)
    lengths = np.asarray([n for _, n in reads], dtype=np.int64)
    dest_at = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)
    jobs: list[Job] = []
    plan(layout, starts, lengths, dest_at, dest=dest, limits=limits, jobs=jobs)
    return jobs, dest


def expected(data: bytes, reads: Reads) -> bytes:
    return b"".join(data[s : s + n] for s, n in reads)


def blocks_of(s: int, e: int, block: int) -> set[int]:
    return set(range(s // block, (e + block - 1) // block))


@SETTINGS
@given(reads_in_parts(), st.integers(0, 2**32 - 1))
def test_reads_in_parts_get_every_byte_and_fetch_no_held_block_again(
    case: tuple[int, list[int], list[Reads], Limits], seed: int
) -> None:
    block, sizes, parts, limits = case
    rng = np.random.default_rng(seed)
    paths = [f"shard-{i}.bin" for i in range(len(sizes))]
    objects = {
        p: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for p, n in zip(paths, sizes, strict=True)
    }
    data = b"".join(objects[p] for p in paths)
    layout = Layout.of_sizes(np.uint8, paths, sizes, [block] * len(sizes))
    versions = {p: ObjectVersion(n, etag=f'"{p}"') for p, n in zip(paths, sizes, strict=True)}
    stale = paths[int(rng.integers(len(paths)))] if rng.random() < 0.3 else None

    held = HeldBlocks(limit=sum(sizes))  # all of it fits: nothing made room for
    held.begin()
    fetched: set[tuple[str, int]] = set()  # blocks fetched since the last let-go
    for reads in parts:
        jobs, dest = planned(layout, reads, limits)
        before = held.nbytes
        touches = any(
            held.take(job.path, s, e, versions[job.path])
            for job in jobs
            for s, e in zip(job.starts, job.ends, strict=True)
        )
        read = Read.of(jobs)
        assert held.begin_read(read) == [], "the reads before it finished: nothing to wait for"
        if before and not touches and stale is None:
            assert held.nbytes == 0, "a read that touches nothing held begins the next window"
            fetched.clear()
        elif stale is None:
            assert held.nbytes == before, "what the reads of a window touch stays held"
        if held.nbytes == 0:
            fetched.clear()
        for job in jobs:
            cut_held(job, held, versions[job.path], min_cut=0)
        for job in jobs:
            size = len(objects[job.path])
            for i, (s, e) in enumerate(zip(job.starts, job.ends, strict=True)):
                assert s % block == 0 and (e % block == 0 or e == size), "whole blocks, each checked"
                buf = objects[job.path][s:e]
                if i in job.held:
                    assert job.path != stale, "a held range of another version is never used"
                    assert bytes(job.held[i]) == buf
                    fill_range(job, i, job.held[i])
                    continue
                if job.path != stale:
                    again = {(job.path, b) for b in blocks_of(s, e, block)} & fetched
                    assert not again, "no held block is fetched again"
                    fetched |= {(job.path, b) for b in blocks_of(s, e, block)}
                fill_range(job, i, buf)
                version = ObjectVersion(1) if job.path == stale else versions[job.path]
                held.add(job.path, s, e, buf, version, read)
        assert dest.tobytes() == expected(data, reads), "every piece gets its bytes"
        held.end_read(read)
        assert read.done.done()
        assert held.peak_nbytes <= held.limit
    held.clear()
    assert held.nbytes == 0


def test_a_later_read_waits_for_the_earlier_one_that_fetches_its_blocks() -> None:
    version = ObjectVersion(2**20)
    chunk = bytes(4096)

    def read_of(*spans: tuple[int, int]) -> Read:
        return Read({"a": ([s for s, _ in spans], [e for _, e in spans])})

    held = HeldBlocks(limit=4 * 4096)
    held.begin()
    first = read_of((0, 4 * 4096))
    assert held.begin_read(first) == []
    second = read_of((100, 2 * 4096), (2 * 4096 + 1, 4 * 4096 - 1))
    assert held.begin_read(second) == [first.done], "it touches blocks the first one fetches"
    other = read_of((8 * 4096, 9 * 4096))
    assert held.begin_read(other) == [], "another window's read touches none"
    for k in range(4):
        held.add("a", k * 4096, (k + 1) * 4096, chunk, version, first)
    assert held.nbytes == 4 * 4096
    held.end_read(first)
    assert first.done.done() and not second.done.done()
    # the bound: the ranges the unfinished second read touches are not let go to make room
    held.add("a", 8 * 4096, 9 * 4096, chunk, version, other)
    assert held.nbytes == 4 * 4096 and held.peak_nbytes == 4 * 4096
    assert [a for a, _, _ in held.take("a", 0, 4 * 4096, version)] == [0, 4096, 2 * 4096, 3 * 4096]
    held.end_read(second)
    # now they are used longest ago and no read touches them: let go to make room
    held.add("a", 8 * 4096, 9 * 4096, chunk, version, other)
    assert held.take("a", 8 * 4096, 9 * 4096, version)[0][:2] == (8 * 4096, 9 * 4096)
    assert held.take("a", 0, 4096, version) == [], "the one used longest ago went first"
    assert held.nbytes == 4 * 4096
    held.end_read(other)
    # a read of the next window, touching nothing held: everything is let go
    assert held.begin_read(read_of((20 * 4096, 21 * 4096))) == []
    assert held.nbytes == 0


def test_held_blocks_are_bounded_and_let_go() -> None:
    version = ObjectVersion(128 * 2**20)
    held = HeldBlocks()
    assert held.limit == HOLD_BYTES == 64 * 2**20
    held.begin()
    read = Read({"a": ([0], [128 * 2**20])})
    held.begin_read(read)
    chunk = bytes(2**20)
    for k in range(HOLD_BYTES // 2**20 + 4):  # more than the bound: the oldest are let go
        held.add("a", k * 2**20, (k + 1) * 2**20, chunk, version, read)
    assert held.nbytes == held.peak_nbytes == HOLD_BYTES
    assert held.take("a", 0, 4 * 2**20, version) == []
    # taken: they stay held for the later parts of the window
    M = 2**20
    got = held.take("a", 5 * M + 4096, 7 * M, version)
    assert [(a, b) for a, b, _ in got] == [(5 * M + 4096, 6 * M), (6 * M, 7 * M)]
    assert bytes(got[0][2]) == chunk[4096:]
    assert held.nbytes == HOLD_BYTES
    # another version of the object: never used, let go
    assert held.take("a", 4 * M, 5 * M, ObjectVersion(128 * M, etag='"other"')) == []
    assert held.take("a", 4 * M, 5 * M, version) == []
    assert held.nbytes == HOLD_BYTES - M
    held.end_read(read)
    # a new session lets go of what the last one held, and so does closing
    held.begin()
    assert held.nbytes == 0
    held.add("a", 0, 2**20, chunk, version, read)
    assert held.nbytes == 2**20
    held.clear()
    assert held.nbytes == 0


def test_a_range_fetched_over_held_blocks_is_held_around_them() -> None:
    """A range that fetched blocks held already (a lone held block inside a range is fetched
    again with it) is held around them, so the reads after it find all of it held."""
    k = 4096
    data = np.random.default_rng(3).integers(0, 256, 8 * k, dtype=np.uint8).tobytes()
    version = ObjectVersion(len(data))
    held = HeldBlocks(limit=len(data))
    held.begin()
    first = Read({"a": ([2 * k, 5 * k], [3 * k, 6 * k])})
    held.begin_read(first, held.ticket())
    held.add("a", 2 * k, 3 * k, data[2 * k : 3 * k], version, first)
    held.add("a", 5 * k, 6 * k, data[5 * k : 6 * k], version, first)
    held.end_read(first)
    window = Read({"a": ([0], [8 * k])})
    assert held.begin_read(window, held.ticket()) == []
    held.add("a", 0, 8 * k, data, version, window)
    assert held.nbytes == held.peak_nbytes == len(data), "each byte held once"
    got = held.take("a", 0, 8 * k, version)
    assert [(a, b) for a, b, _ in got] == [
        (0, 2 * k),
        (2 * k, 3 * k),
        (3 * k, 5 * k),
        (5 * k, 6 * k),
        (6 * k, 8 * k),
    ]
    assert b"".join(bytes(v) for _, _, v in got) == data
    held.end_read(window)


@st.composite
def first_and_next(draw: Any) -> tuple[int, list[int], Reads, Reads, Limits]:
    """A block size, shard sizes, a small first read and a dense read after it (in order, most
    of the blocks, as the rest of a mixing window)."""
    block = draw(st.sampled_from([4, 16, 32]))
    sizes = draw(st.lists(st.integers(1, 400), min_size=1, max_size=4))
    total = sum(sizes)
    first = [(s, 1) for s in draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=6))]
    step = draw(st.integers(1, 2 * block))
    after = [(s, min(step, total - s)) for s in range(draw(st.integers(0, step)), total, step)]
    after = after or [(0, 1)]
    cap = draw(st.sampled_from([block, 8 * block, 64 * block]))
    limits = Limits(draw(st.integers(0, 3 * block)), cap, 4 * cap, draw(st.integers(1, 10)))
    return block, sizes, first, after, limits


def _fetch_both(
    objects: dict[str, bytes], layout: Layout, first: list[Job], after: Reads, limits: Limits
) -> tuple[int, int, set[tuple[str, int]]]:
    """``first``'s ranges fetched and held, then the read ``after`` cut around them as the
    storage cuts (the default rule) and fetched: the GETs and bytes of both, and the blocks
    fetched twice; every piece of ``after`` checked against the data."""
    block = layout.blocks[0]
    versions = {p: ObjectVersion(len(b), etag=f'"{p}"') for p, b in objects.items()}
    held = HeldBlocks(limit=sum(len(b) for b in objects.values()))
    held.begin()
    gets = nbytes = 0
    fetched: set[tuple[str, int]] = set()
    twice: set[tuple[str, int]] = set()
    read = Read.of(first)
    held.begin_read(read)
    for job in first:
        for i, (s, e) in enumerate(zip(job.starts, job.ends, strict=True)):
            buf = objects[job.path][s:e]
            fill_range(job, i, buf)
            held.add(job.path, s, e, buf, versions[job.path], read)
            gets, nbytes = gets + 1, nbytes + e - s
            fetched |= {(job.path, b) for b in blocks_of(s, e, block)}
    held.end_read(read)
    jobs, dest = planned(layout, after, limits)
    read = Read.of(jobs)
    held.begin_read(read)
    for job in jobs:
        cut_held(job, held, versions[job.path])
        for i, (s, e) in enumerate(zip(job.starts, job.ends, strict=True)):
            if i in job.held:
                fill_range(job, i, job.held[i])
                continue
            fill_range(job, i, objects[job.path][s:e])
            gets, nbytes = gets + 1, nbytes + e - s
            twice |= {(job.path, b) for b in blocks_of(s, e, block)} & fetched
    held.end_read(read)
    data = b"".join(objects.values())
    assert dest.tobytes() == expected(data, after), "every piece of the next read gets its bytes"
    return gets, nbytes, twice


@SETTINGS
@given(first_and_next(), st.sampled_from([0, 64, 2**20, 2**20]), st.integers(0, 2**32 - 1))
def test_a_first_read_led_to_the_next_read_s_range_ends_fetches_no_byte_twice(
    case: tuple[int, list[int], Reads, Reads, Limits], most: int, seed: int
) -> None:
    """A first read whose ranges reach the ends of the next read's ranges that hold its blocks
    (by at most ``most`` bytes a side) costs no GET and no byte more than one that does not,
    gets every byte, and with room enough fetches no block twice."""
    block, sizes, first, after, limits = case
    rng = np.random.default_rng(seed)
    objects = {
        f"shard-{i}.bin": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(sizes)
    }
    layout = Layout.of_sizes(np.uint8, list(objects), sizes, [block] * len(sizes))
    data = b"".join(objects.values())
    plain, plain_dest = planned(layout, first, limits)
    led, led_dest = planned(layout, first, limits)
    ranges_before = sum(len(j.starts) for j in led)
    led = lead(led, planned(layout, after, limits)[0], limits, most)
    for job in led:
        assert len(job.starts) <= limits.ranges_per_call and job.nbytes <= max(
            limits.job_bytes, job.ends[0] - job.starts[0]
        )
        for s, e in zip(job.starts, job.ends, strict=True):
            size = len(objects[job.path])
            assert s % block == 0 and (e % block == 0 or e == size), "whole blocks, each checked"
            assert e - s <= max(limits.max_request_bytes, block)
    assert sum(len(j.starts) for j in led) <= ranges_before, "no GET more in the first read"
    plain_ranges = [(j.path, s, e) for j in plain for s, e in zip(j.starts, j.ends, strict=True)]
    for job in led:
        for s, e in zip(job.starts, job.ends, strict=True):
            inside = [(a, b) for p, a, b in plain_ranges if p == job.path and s <= a < e]
            assert all(b <= e for _, b in inside), "a range of the first read is kept whole"
            assert e - s - sum(b - a for a, b in inside) <= most, "at most `most` bytes more a range"
    gets, nbytes, twice = _fetch_both(objects, layout, led, after, limits)
    plain_gets, plain_nbytes, _ = _fetch_both(objects, layout, plain, after, limits)
    assert led_dest.tobytes() == plain_dest.tobytes() == expected(data, first), "every piece gets its bytes"
    assert gets <= plain_gets and nbytes <= plain_nbytes
    if most >= max(sizes):
        assert not twice, "no block fetched twice"


def test_a_read_of_the_next_window_planned_first_lets_go_only_once_the_earlier_reads_are_planned() -> None:
    """Reads are planned concurrently: the next window's read, called after the rest of this
    window's, may be planned first; what it does not touch stays held for the earlier one."""
    version = ObjectVersion(2**20)
    held = HeldBlocks(limit=2**20)
    held.begin()
    first = Read({"a": ([0], [4096])})
    held.begin_read(first, held.ticket())
    held.add("a", 0, 4096, bytes(4096), version, first)
    held.end_read(first)
    rest, following = held.ticket(), held.ticket()  # called in this order
    held.begin_read(Read({"a": ([8192], [12288])}), following)  # touches nothing held
    assert held.nbytes == 4096, "the rest of the window is not planned yet"
    window = Read({"a": ([0], [8192])})
    assert held.begin_read(window, rest) == []
    assert held.take("a", 0, 4096, version)[0][:2] == (0, 4096)
    held.end_read(window)
    # a read called and never planned holds up no let-go
    skipped = held.ticket()
    later = held.ticket()
    held.begin_read(Read({"a": ([65536], [69632])}), later)
    assert held.nbytes == 4096
    held.skip(skipped)
    assert held.nbytes == 0


def test_a_part_of_the_next_window_waits_for_room_to_hold_its_blocks() -> None:
    """A mixing window read in two parts, each touching all its blocks: the next window's first
    part, called while the last window's parts hold the bound, waits for them (then holds its
    blocks for its own later part); a window read whole, a read too large for the bound, or one
    that fits beside what is held waits for none."""
    k = 4096
    version = ObjectVersion(2**20)
    chunk = bytes(k)

    def part(first: int, wanted: int) -> Read:
        return Read({"a": ([first * k], [(first + 4) * k])}, wanted)

    held = HeldBlocks(limit=4 * k)
    held.begin()
    one, two, nxt = part(0, 2 * k), part(0, 2 * k), part(8, 2 * k)
    first, second, third = held.ticket(), held.ticket(), held.ticket()
    held.begin_read(one, first)
    assert held.room(one) == [], "nothing earlier"
    for b in range(4):
        held.arrived(one, k)
        held.add("a", b * k, (b + 1) * k, chunk, version, one)
    held.begin_read(nxt, third)
    [planning] = held.room(nxt)
    assert not planning.done(), "a read called before it is not planned yet"
    assert held.begin_read(two, second) == [one.done]
    assert planning.done()
    assert held.room(nxt) == [one.done, two.done], "the bound is full of the last window's blocks"
    whole = part(8, 4 * k)
    held.begin_read(whole, held.ticket())
    assert held.room(whole) == [], "a window read whole: no later part takes its blocks"
    held.end_read(whole)
    huge = Read({"a": ([8 * k], [16 * k])}, 4 * k)
    held.begin_read(huge, held.ticket())
    assert held.room(huge) == [], "its blocks would not fit even alone"
    held.end_read(huge)
    roomy = HeldBlocks(limit=16 * k)
    early, late = part(0, 2 * k), part(8, 2 * k)
    roomy.begin_read(early, roomy.ticket())
    roomy.begin_read(late, roomy.ticket())
    assert roomy.room(late) == [], "both windows' blocks fit under the bound"
    held.end_read(one)
    assert held.room(nxt) == [two.done]
    held.end_read(two)
    assert held.room(nxt) == []
    # its blocks take the place of the last window's, for its later part
    for b in range(8, 12):
        held.arrived(nxt, k)
        held.add("a", b * k, (b + 1) * k, chunk, version, nxt)
    assert [a for a, _, _ in held.take("a", 8 * k, 12 * k, version)] == [8 * k, 9 * k, 10 * k, 11 * k]
    assert held.nbytes == held.peak_nbytes == 4 * k
    assert held.room(nxt) == [] and nxt.pending == 0


def test_a_held_run_is_cut_out_at_a_range_s_ends_or_where_it_is_long() -> None:
    from guideloom.storage._remote._held import _worth_cutting

    k = 64 * 1024
    pieces = [
        (0, k, "a"),
        (3 * k, 4 * k, "b"),
        (6 * k, 7 * k, "c"),
        (7 * k, 8 * k, "d"),
        (9 * k, 10 * k, "e"),
    ]
    # [0, 10k): the run at its start and the one at its end cost no request; the lone block in
    # between is not worth one, the run of two is where at least two blocks are worth one
    assert _worth_cutting(pieces, 0, 10 * k, 4 * k) == [(0, k, "a"), (9 * k, 10 * k, "e")]
    assert _worth_cutting(pieces, 0, 10 * k, 2 * k) == [(0, k, "a"), (6 * k, 7 * k, "c"), (7 * k, 8 * k, "d"),
                                                         (9 * k, 10 * k, "e")]  # fmt: skip
    assert _worth_cutting(pieces, 0, 10 * k, 0) == pieces


def test_a_new_reading_session_waits_for_no_read_of_an_old_one() -> None:
    """A read abandoned while it was planned (its iterator closed, its loop ended) never ends
    itself: the next session's reads must not wait for it."""
    held = HeldBlocks()
    stale = Read({"a": ([0], [4096])})
    assert held.begin_read(stale, held.ticket()) == []
    later = Read({"a": ([0], [4096])})
    assert len(held.begin_read(later, held.ticket())) == 1  # in one session: it waits for it
    held.end_read(later)
    held.begin()
    assert stale.done.done() and stale.finished
    again = Read({"a": ([0], [4096])})
    assert held.begin_read(again, held.ticket()) == []


class _Buffers:
    """Buffers that record the name of the thread that frees each."""

    def __init__(self, n: int) -> None:
        self.where: list[str] = []
        self.done = threading.Event()
        self._n = n

    def new(self) -> np.ndarray[Any, Any]:
        """A buffer of 4 KiB: the caller keeps no reference to it."""
        b = np.zeros(4096, dtype=np.uint8)
        weakref.finalize(b, self._freed)
        return b

    def _freed(self) -> None:
        self.where.append(threading.current_thread().name)
        if len(self.where) == self._n:
            self.done.set()


def test_buffers_let_go_are_freed_off_the_caller_s_thread() -> None:
    """What is let go (a new window's first read, the bound, another version, a close) leaves the
    bytes held at once, and the buffers are freed one by one on a thread of their own: freeing a
    window's fetched buffers at once held the GIL for tens of milliseconds, on the event loop
    where it planned the read."""
    version = ObjectVersion(2**20)
    held = HeldBlocks(limit=3 * 4096)
    held.begin()
    window = Read({"a": ([0], [2**20])})
    held.begin_read(window, held.ticket())
    buffers = _Buffers(5)
    for k in range(3):
        held.add("a", k * 4096, (k + 1) * 4096, buffers.new(), version, window)
    held.end_read(window)
    # the bound: the oldest is let go for the next
    held.add("a", 3 * 4096, 4 * 4096, buffers.new(), version, window)
    assert held.nbytes == 3 * 4096
    # another version of the object: let go as it is met
    assert held.take("a", 4096, 2 * 4096, ObjectVersion(2**20, etag='"other"')) == []
    assert held.nbytes == 2 * 4096
    # the next window: what no unfinished read touches is let go
    nxt = Read({"b": ([0], [4096])})
    held.begin_read(nxt, held.ticket())
    assert held.nbytes == 0
    held.add("b", 0, 4096, buffers.new(), version, nxt)
    held.end_read(nxt)
    held.clear()  # and closing lets go of the rest
    assert held.nbytes == 0
    assert buffers.done.wait(10), buffers.where
    assert sorted(set(buffers.where)) == ["guideloom-free_0"], buffers.where


def _one_object() -> tuple[HeldBlocks, Any]:
    """Held blocks of one 640-byte object of 16-byte blocks, and a read of (start, length) spans."""
    layout = Layout.of_sizes(np.uint8, ["a.bin"], [640], [16])
    limits = Limits(0, 64, 256, 4)
    held = HeldBlocks(limit=640)
    held.begin()
    return held, lambda reads: Read.of(planned(layout, reads, limits)[0])


def test_a_read_called_later_but_planned_first_waits_for_the_earlier_one_that_shares_its_blocks() -> None:
    """The order of the calls decides which read fetches shared blocks, not that of the plans:
    the later read waits for the earlier one to be planned, then for it to end (its blocks are
    then held for it); the earlier one waits for nothing the later one does."""
    held, read_of = _one_object()
    early_ticket, late_ticket = held.ticket(), held.ticket()
    late = read_of([(40, 8), (300, 8)])
    waits = held.begin_read(late, late_ticket)
    assert len(waits) == 1 and not waits[0].done(), "a read called before it is not planned yet"
    early = read_of([(0, 640)])
    assert held.begin_read(early, early_ticket) == [], "it waits for no read called after it"
    assert waits[0].done(), "a read was planned: the later one asks again"
    assert held.waits(late) == [early.done], "the earlier read touches its blocks: it waits for it"
    held.end_read(early)
    assert held.waits(late) == []
    held.end_read(late)


def test_reads_that_share_no_block_wait_only_for_the_plans_before_them() -> None:
    held, read_of = _one_object()
    first, second = held.ticket(), held.ticket()
    b = read_of([(320, 64)])
    assert held.begin_read(b, second) != []
    a = read_of([(0, 64)])
    assert held.begin_read(a, first) == []
    assert held.waits(b) == [], "planned before it, and none of its blocks: it fetches at once"
    held.end_read(a)
    held.end_read(b)


def test_a_read_asks_for_room_once_every_read_called_before_it_has_or_ended() -> None:
    """The turn to fetch follows the order of the calls: a read planned first waits while one
    called before it is unplanned or planned and not fetching; a read that asked, one that
    ended without asking (cancelled) and one whose planning failed (skipped) let it go on."""
    held, read_of = _one_object()
    first, second, third, fourth = (held.ticket() for _ in range(4))
    d = read_of([(600, 16)])
    held.begin_read(d, fourth)
    turn = held.turn(d)
    assert len(turn) == 1 and not turn[0].done(), "three reads before it are not planned yet"
    a = read_of([(0, 16)])
    assert held.begin_read(a, first) == []
    assert held.turn(a) == [], "no read called before it"
    assert turn[0].done(), "a read was planned: it asks again"
    assert len(held.turn(d)) == 1, "the first is planned, not fetching"
    held.asks(a)
    held.skip(third)
    c = read_of([(400, 16)])  # planned, never fetches
    held.begin_read(c, second)
    assert held.turn(c) == [], "the read before it fetches"
    turn = held.turn(d)
    assert len(turn) == 1 and not turn[0].done(), "the second is planned, not fetching"
    held.end_read(c)
    assert turn[0].done() and held.turn(d) == []
    held.end_read(a)
    held.end_read(d)


def test_a_new_reading_session_gives_no_read_of_an_old_one_its_turn() -> None:
    held, read_of = _one_object()
    held.ticket()  # a read of the old session, never planned
    late = read_of([(0, 16)])
    held.begin_read(late, held.ticket())
    turn = held.turn(late)
    assert len(turn) == 1
    held.begin()
    assert turn[0].done()
    again = read_of([(0, 16)])
    held.begin_read(again, held.ticket())
    assert held.turn(again) == []


def test_a_part_s_blocks_stay_held_for_its_later_part_not_yet_planned() -> None:
    """The next window's first part fetches while its later part is not planned yet (nothing
    claims its blocks): each block it adds takes the place of the last window's, never of its
    own, whatever the objects' names and however many reads were planned meanwhile."""
    k = 4096
    chunk = bytes(k)
    version = ObjectVersion(4 * k)

    def part(path: str) -> Read:
        return Read({path: ([0], [4 * k])}, 2 * k)

    held = HeldBlocks(limit=4 * k)
    held.begin()
    last_one, last_two, next_one = part("b"), part("b"), part("a")  # "a" sorts first
    tickets = [held.ticket() for _ in range(3)]
    held.begin_read(last_one, tickets[0])
    held.begin_read(last_two, tickets[1])
    held.begin_read(next_one, tickets[2])  # planned ahead: no read is planned after it a while
    for b in range(4):
        held.add("b", b * k, (b + 1) * k, chunk, version, last_one)
    held.end_read(last_one)
    assert len(held.take("b", 0, 4 * k, version)) == 4
    held.end_read(last_two)
    assert held.room(next_one) == []
    for b in range(4):
        held.add("a", b * k, (b + 1) * k, chunk, version, next_one)
    next_two = part("a")
    held.begin_read(next_two, held.ticket())
    assert [a for a, _, _ in held.take("a", 0, 4 * k, version)] == [0, k, 2 * k, 3 * k]
    assert held.nbytes == 4 * k
