"""Range planning (``guideloom.storage._remote._ranges``) against direct slices of in-memory bytes."""

from __future__ import annotations

import gc
import itertools
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom.storage._remote._ranges import (
    FEW_PIECES,
    Job,
    Layout,
    Limits,
    _capped_ranges,
    _unit_ranges,
    fill,
    fill_range,
    lead,
    pieces_table,
    plan,
    plan_spans,
    plan_windows,
)

SETTINGS = settings(max_examples=150, deadline=None)


def objects_of(sizes: list[int], seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"shard-{i}.bin": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(sizes)}


def fetch(jobs: list[Job], objects: dict[str, bytes]) -> None:
    """What the client does, without a server: each range's bytes, then ``fill``."""
    for job in jobs:
        fill(job, [objects[job.path][s:e] for s, e in zip(job.starts, job.ends, strict=True)])


limits_st = st.builds(
    lambda gap, cap, extra, per_call: Limits(gap, cap, cap + extra, per_call),
    st.integers(0, 64),
    st.integers(1, 200),
    st.integers(0, 800),
    st.integers(1, 10),
)


@st.composite
def byte_reads(draw: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """Shard sizes (some empty) and (start, length) reads anywhere in their concatenation."""
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
    total = sum(sizes)
    reads = []
    for _ in range(draw(st.integers(0, 25))):
        start = draw(st.integers(0, total))
        reads.append((start, draw(st.integers(0, total - start))))
    return sizes, reads


def check_plan_shape(jobs: list[Job], layout: Layout, limits: Limits) -> None:
    """Every range: inside its object, at most max_request_bytes, exactly its pieces' extent, and
    never spanning a hole wider than coalesce_gap; every job: one object, bounded."""
    sizes = dict(zip(layout.paths, np.diff(layout.bounds).tolist(), strict=True))
    for job in jobs:
        assert 1 <= len(job.starts) <= limits.ranges_per_call
        assert len(job.starts) == 1 or job.nbytes <= limits.job_bytes
        for s, e, table in zip(job.starts, job.ends, job.pieces, strict=True):
            assert table.dtype == np.int64 and table.ndim == 2 and table.shape[1] == 3
            pieces = table.tolist()
            assert 0 <= s < e <= sizes[job.path]
            assert e - s <= limits.max_request_bytes
            assert pieces and all(ln > 0 for _, ln, _ in pieces)
            assert min(p for p, _, _ in pieces) == s and max(p + ln for p, ln, _ in pieces) == e
            covered = s
            for p, ln, _ in sorted(pieces):
                assert p - covered <= limits.coalesce_gap, "a range spans a hole wider than the gap"
                covered = max(covered, p + ln)


@SETTINGS
@given(byte_reads(), limits_st, st.integers(0, 2**16))
def test_planned_ranges_deliver_every_requested_byte_exactly_once(
    case: tuple[list[int], list[tuple[int, int]]], limits: Limits, seed: int
) -> None:
    sizes, reads = case
    objects = objects_of(sizes, seed)
    reference = np.frombuffer(b"".join(objects.values()), dtype=np.uint8)
    layout = Layout.of_sizes(np.uint8, list(objects), sizes)
    starts = np.asarray([s for s, _ in reads], dtype=np.int64)
    lengths = np.asarray([n for _, n in reads], dtype=np.int64)
    dest_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if reads else starts
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)
    jobs: list[Job] = []
    plan(layout, starts, lengths, dest_offsets, dest=dest, limits=limits, jobs=jobs)
    check_plan_shape(jobs, layout, limits)

    written = np.zeros(len(dest), dtype=np.int64)  # each destination byte has exactly one piece
    for job in jobs:
        for pieces in job.pieces:
            for _, ln, off in pieces.tolist():
                written[off : off + ln] += 1
    assert np.all(written == 1)
    fetch(jobs, objects)
    expected = [reference[s : s + n] for s, n in reads]
    assert np.array_equal(dest, np.concatenate(expected) if expected else dest)


@SETTINGS
@given(byte_reads(), limits_st, st.integers(1, 96), st.integers(0, 2**16))
def test_with_block_digests_every_range_is_whole_blocks_and_each_block_is_requested_once(
    case: tuple[list[int], list[tuple[int, int]]], limits: Limits, block: int, seed: int
) -> None:
    """Every fetched byte is checked against its block's digest: ranges are widened to whole
    blocks, and pieces that share a block share one request, whatever ``max_request_bytes``."""
    sizes, reads = case
    objects = objects_of(sizes, seed)
    reference = np.frombuffer(b"".join(objects.values()), dtype=np.uint8)
    layout = Layout.of_sizes(np.uint8, list(objects), sizes, [block] * len(sizes))
    starts = np.asarray([s for s, _ in reads], dtype=np.int64)
    lengths = np.asarray([n for _, n in reads], dtype=np.int64)
    dest_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if reads else starts
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)
    jobs: list[Job] = []
    plan(layout, starts, lengths, dest_offsets, dest=dest, limits=limits, jobs=jobs)
    sizes_of = dict(zip(layout.paths, sizes, strict=True))
    requested: dict[tuple[str, int], int] = {}
    for job in jobs:
        for s, e in zip(job.starts, job.ends, strict=True):
            assert s % block == 0 and (e % block == 0 or e == sizes_of[job.path])
            assert e - s <= max(limits.max_request_bytes, block)
            for b in range(s // block, -(-e // block)):
                requested[job.path, b] = requested.get((job.path, b), 0) + 1
    assert all(n == 1 for n in requested.values()), requested
    fetch(jobs, objects)
    expected = [reference[s : s + n] for s, n in reads]
    assert np.array_equal(dest, np.concatenate(expected) if expected else dest)


@SETTINGS
@given(byte_reads(), limits_st)
def test_coalescing_is_as_wide_as_the_gap_and_the_request_size_allow(
    case: tuple[list[int], list[tuple[int, int]]], limits: Limits
) -> None:
    """Two consecutive ranges of one object are apart by more than the gap, or merging them
    would have made a request larger than max_request_bytes."""
    sizes, reads = case
    layout = Layout.of_sizes(np.uint8, [f"s{i}" for i in range(len(sizes))], sizes)
    lengths = np.asarray([n for _, n in reads], dtype=np.int64)
    jobs: list[Job] = []
    plan(
        layout,
        np.asarray([s for s, _ in reads], dtype=np.int64),
        lengths,
        np.zeros(len(reads), dtype=np.int64),
        dest=np.zeros(int(lengths.max(initial=0)), dtype=np.uint8),
        limits=limits,
        jobs=jobs,
    )
    ranges = [
        (job.path, s, e, min(p for p, _, _ in pcs), max(p + ln for p, ln, _ in pcs if p == s))
        for job in jobs
        for s, e, pcs in zip(job.starts, job.ends, (p.tolist() for p in job.pieces), strict=True)
    ]
    for (path1, s1, e1, _, _), (path2, s2, _e2, _, first_end) in itertools.pairwise(ranges):
        if path1 != path2:
            continue
        assert s2 >= s1
        assert s2 > e1 + limits.coalesce_gap or max(e1, first_end) - s1 > limits.max_request_bytes


@st.composite
def stream_reads(draw: Any) -> tuple[list[int], list[int], int]:
    """Shard sizes in elements, window starts and a window length (windows cross shards)."""
    sizes = draw(st.lists(st.integers(0, 120), min_size=1, max_size=5).filter(lambda s: sum(s) > 0))
    total = sum(sizes)
    length = draw(st.integers(1, total))
    starts = draw(st.lists(st.integers(0, total - length), max_size=12))
    return sizes, starts, length


@SETTINGS
@given(stream_reads(), limits_st, st.integers(0, 2**16))
def test_windows_of_tokens_and_metadata_fields_equal_direct_slices(
    case: tuple[list[int], list[int], int], limits: Limits, seed: int
) -> None:
    sizes, starts_list, length = case
    rng = np.random.default_rng(seed)
    dtypes = {"tokens": np.dtype("<u2"), "loss_mask": np.dtype("u1"), "doc_id": np.dtype("<i8")}
    arrays, layouts, objects = {}, {}, {}
    for name, dtype in dtypes.items():
        arrays[name] = rng.integers(0, 200, sum(sizes)).astype(dtype)
        pos = np.cumsum([0, *sizes])
        paths = [f"{name}-{i:05d}.bin" for i in range(len(sizes))]
        for p, a, b in zip(paths, pos, pos[1:], strict=False):
            objects[p] = arrays[name][a:b].tobytes()
        layouts[name] = Layout.of_sizes(dtype, paths, [n * dtype.itemsize for n in sizes])
    starts = np.asarray(starts_list, dtype=np.int64)
    jobs, outs = plan_windows(layouts, starts, length, limits)
    for name, layout in layouts.items():
        check_plan_shape([j for j in jobs if j.path.startswith(name)], layout, limits)
    fetch(jobs, objects)
    for name, out in outs.items():
        assert out.dtype == dtypes[name] and out.shape == (len(starts), length)
        for row, s in zip(out, starts_list, strict=True):
            assert np.array_equal(row, arrays[name][s : s + length])


@SETTINGS
@given(st.lists(st.integers(0, 90), min_size=1, max_size=40), limits_st, st.data())
def test_document_spans_equal_direct_slices(doc_lengths: list[int], limits: Limits, data: Any) -> None:
    rng = np.random.default_rng(len(doc_lengths))
    tokens = rng.integers(0, 2**31, sum(doc_lengths)).astype("<i4")
    offsets = np.cumsum([0, *doc_lengths]).astype(np.int64)
    shard = data.draw(st.integers(1, 400), label="shard elements")
    bounds = [*range(0, len(tokens), shard), len(tokens)] if len(tokens) else [0, 0]
    paths = [f"tokens-{i}.bin" for i in range(len(bounds) - 1)]
    objects = {p: tokens[a:b].tobytes() for p, a, b in zip(paths, bounds, bounds[1:], strict=False)}
    layout = Layout.of_sizes(tokens.dtype, paths, [(b - a) * 4 for a, b in itertools.pairwise(bounds)])
    indices = data.draw(st.lists(st.integers(0, len(doc_lengths) - 1), max_size=20), label="indices")
    idx = np.asarray(indices, dtype=np.int64)
    jobs, flat, spans = plan_spans(layout, offsets[idx], offsets[idx + 1], limits)
    check_plan_shape(jobs, layout, limits)
    fetch(jobs, objects)
    assert len(spans) == len(indices) + 1
    for i, doc in enumerate(indices):
        assert np.array_equal(flat[spans[i] : spans[i + 1]], tokens[offsets[doc] : offsets[doc + 1]])


def test_one_sample_larger_than_max_request_bytes_is_cut_into_parallel_requests() -> None:
    layout = Layout.of_sizes(np.uint8, ["a"], [10_000])
    jobs: list[Job] = []
    dest = np.zeros(9_000, dtype=np.uint8)
    limits = Limits(coalesce_gap=0, max_request_bytes=1_000, job_bytes=2_000, ranges_per_call=10)
    plan(layout, np.asarray([500]), np.asarray([9_000]), np.asarray([0]), dest=dest, limits=limits, jobs=jobs)
    ranges = [(s, e) for j in jobs for s, e in zip(j.starts, j.ends, strict=True)]
    assert ranges == [(s, min(s + 1_000, 9_500)) for s in range(500, 9_500, 1_000)]
    assert len(jobs) == 5, "a job holds at most job_bytes, so the parts are fetched in parallel"


def test_adjacent_and_close_reads_are_one_request_and_far_ones_are_not() -> None:
    layout = Layout.of_sizes(np.uint8, ["a"], [100_000])
    limits = Limits(coalesce_gap=100, max_request_bytes=10**6, job_bytes=10**6, ranges_per_call=10)
    jobs: list[Job] = []
    starts = np.asarray([0, 10, 120, 5_000], dtype=np.int64)  # 0-10, 10-20 adjacent; 120 is 100 away
    plan(
        layout,
        starts,
        np.full(4, 10),
        np.arange(4) * 10,
        dest=np.zeros(40, np.uint8),
        limits=limits,
        jobs=jobs,
    )
    assert [(j.starts, j.ends) for j in jobs] == [([0, 5_000], [130, 5_010])]


def test_reads_outside_the_stored_bytes_are_refused() -> None:
    layout = Layout.of_sizes(np.uint8, ["a", "b"], [10, 10])
    for start, n in ((15, 6), (-1, 2)):
        with pytest.raises(IndexError, match="outside"):
            plan(
                layout,
                np.asarray([start]),
                np.asarray([n]),
                np.asarray([0]),
                dest=np.zeros(10, np.uint8),
                limits=Limits(),
                jobs=[],
            )


def test_fill_refuses_a_buffer_of_the_wrong_length() -> None:
    job = Job("a", np.zeros(4, np.uint8), [0], [4], [pieces_table([(0, 4, 0)])])
    with pytest.raises(ValueError, match="3 bytes"):
        fill(job, [b"abc"])
    two = [pieces_table([(0, 4, 0)]), pieces_table([(8, 1, 3)])]
    singles = Job("a", job.dest, [0, 8], [4, 9], two).singles()
    assert [(j.starts, j.ends, [p.tolist() for p in j.pieces]) for j in singles] == [
        ([0], [4], [[[0, 4, 0]]]),
        ([8], [9], [[[8, 1, 3]]]),
    ]


@st.composite
def many_pieces(draw: Any) -> tuple[int, list[tuple[int, int, int]], int]:
    """A range's start, pieces of it (lengths repeated, as rows are, or not; some read twice)
    going to disjoint places, and the destination's size: more pieces than are copied one by one."""
    base = draw(st.integers(0, 1000))
    size = draw(st.integers(1, 400))
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    count = draw(st.integers(FEW_PIECES + 1, FEW_PIECES + 60))
    pieces, at = [], 0
    for _ in range(count):
        ln = min(draw(st.sampled_from(lengths)), size)
        start = base + draw(st.integers(0, size - ln))
        at += draw(st.integers(0, 5))
        pieces.append((start, ln, at))
        at += ln
    order = draw(st.permutations(range(count)))
    return base, [pieces[i] for i in order], at + draw(st.integers(0, 7))


@SETTINGS
@given(many_pieces(), st.integers(0, 2**16))
def test_a_range_of_many_pieces_fills_as_piece_by_piece_copies(case: Any, seed: int) -> None:
    base, pieces, size = case
    top = max(s + ln for s, ln, _ in pieces)
    src = np.random.default_rng(seed).integers(0, 256, 1 + top - base, np.uint8)
    _fills_as_copies(base, pieces, size, src)


def _fills_as_copies(base: int, pieces: list[tuple[int, int, int]], size: int, src: Any) -> None:
    """``fill_range`` of a range starting at ``base`` with bytes ``src`` puts each piece where a
    plain copy of it would, and nothing elsewhere."""
    expected = np.full(size, 7, np.uint8)
    for s, ln, off in pieces:
        expected[off : off + ln] = src[s - base : s - base + ln]
    job = Job("a", np.full(size, 7, np.uint8), [base], [base + len(src)], [pieces_table(pieces)])
    fill_range(job, 0, src.tobytes())
    np.testing.assert_array_equal(job.dest, expected)


@st.composite
def piece_layouts(draw: Any) -> tuple[int, list[tuple[int, int, int]], int]:
    """A range's start, its pieces (lengths of any spread, multiples of a common unit or not;
    back to back in the range as a document's are, or anywhere in it, some read twice) going to
    disjoint places in any order, and the destination's size."""
    unit = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    base = unit * draw(st.integers(0, 100))
    spread = st.integers(0, 9).flatmap(lambda bits: st.integers(0, 2**bits))
    lengths = draw(st.lists(spread, min_size=FEW_PIECES + 1, max_size=FEW_PIECES + 80))
    lengths = [unit * n for n in lengths]
    if draw(st.booleans()):  # back to back in the range
        starts = list(itertools.accumulate([base, *lengths[:-1]]))
        size = sum(lengths)
    else:
        size = max(lengths) + unit * draw(st.integers(0, 50))
        starts = [base + unit * draw(st.integers(0, (size - n) // unit)) for n in lengths]
    order = draw(st.permutations(range(len(lengths))))
    pieces, at = [], 0
    for i in order:
        at += unit * draw(st.integers(0, 3))
        pieces.append((starts[i], lengths[i], at))
        at += lengths[i]
    placed = draw(st.permutations(pieces))
    return base, placed, at + draw(st.integers(0, 9))


@SETTINGS
@given(piece_layouts(), st.integers(0, 2**16))
def test_a_range_fills_as_piece_by_piece_copies_whatever_its_layout(case: Any, seed: int) -> None:
    base, pieces, size = case
    top = max(1, *(s + n - base for s, n, _ in pieces))
    _fills_as_copies(base, pieces, size, np.random.default_rng(seed).integers(0, 256, top, np.uint8))


def calls_to_fill(count: int) -> int:
    """The calls ``fill_range`` makes for ``count`` back-to-back pieces of ``count`` lengths, each
    to its own place (checked)."""
    lengths = np.arange(1, count + 1, dtype=np.int64)
    at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    order = np.random.default_rng(count).permutation(count)
    offs = np.empty_like(at)
    offs[order] = np.concatenate([[0], np.cumsum(lengths[order])[:-1]])
    src = np.random.default_rng(1).integers(0, 256, int(lengths.sum()), np.uint8)
    job = Job("a", np.zeros(len(src), np.uint8), [0], [len(src)], [np.stack([at, lengths, offs], axis=1)])
    calls = 0

    def count_call(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count_call)
    try:
        fill_range(job, 0, src.tobytes())
    finally:
        sys.setprofile(None)
    for s, n, off in zip(at.tolist(), lengths.tolist(), offs.tolist(), strict=True):
        assert job.dest[off : off + n].tobytes() == src[s : s + n].tobytes()
    return calls


def test_pieces_of_distinct_lengths_fill_in_calls_that_do_not_grow_with_them() -> None:
    # A copy per piece or per length would be thousands of calls for these, each taking the GIL
    # the caller's event loop waits for; twice the pieces add one power of two, not their count.
    few, many = calls_to_fill(2000), calls_to_fill(4000)
    assert many - few < 100, f"{few} calls for 2,000 pieces, {many} for 4,000"
    assert many < 1000, f"{many} calls for 4,000 pieces"


def test_a_piece_outside_its_destination_is_refused() -> None:
    pieces = [(i, 1, i) for i in range(FEW_PIECES)] + [(FEW_PIECES, 1, -1)]
    job = Job("a", np.zeros(64, np.uint8), [0], [FEW_PIECES + 1], [pieces_table(pieces)])
    with pytest.raises(ValueError, match="destination"):
        fill_range(job, 0, bytes(FEW_PIECES + 1))
    job.pieces = [pieces_table([*pieces[:-1], (FEW_PIECES, 1, 64)])]
    with pytest.raises(ValueError, match="destination"):
        fill_range(job, 0, bytes(FEW_PIECES + 1))


def test_a_windows_pieces_are_arrays_not_python_objects() -> None:
    # A window of 8,192 rows planned on an I/O thread: a Python object per piece would set off
    # a dozen garbage collections there, each holding the GIL the caller's event loop waits for.
    layout = Layout.of_sizes(np.uint16, [f"o{i}" for i in range(8)], [4 * 2**20] * 8, [64 * 2**10] * 8)
    starts = np.random.default_rng(0).integers(0, 16 * 2**20 - 2048, 8192)
    gc.disable()
    try:
        before = gc.get_count()[0]
        jobs, _ = plan_windows({"tokens": layout}, starts, 2048, Limits())
        made = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert sum(len(p) for job in jobs for p in job.pieces) >= 8192  # rows cut at objects, requests
    assert made < 500, f"{made} objects the garbage collector tracks for 8,192 pieces"


def test_a_piece_outside_its_range_is_refused() -> None:
    pieces = [(i, 1, i) for i in range(FEW_PIECES)] + [(FEW_PIECES, 2, FEW_PIECES)]
    job = Job("a", np.zeros(64, np.uint8), [0], [FEW_PIECES + 1], [pieces_table(pieces)])
    with pytest.raises(ValueError, match="outside the range"):
        fill_range(job, 0, bytes(FEW_PIECES + 1))


@st.composite
def widened_pieces(draw: Any) -> tuple[Any, Any, Any, Any, int]:
    """Pieces sorted by object and offset, widened to whole blocks, and each one's unit (a whole
    number of its object's blocks), as ``plan`` hands them to the grouping into ranges."""
    ks, wlo, whi, units = [], [], [], []
    for obj in range(draw(st.integers(1, 4))):
        block = draw(st.integers(1, 16))
        unit = block * draw(st.integers(1, 32))
        size = draw(st.integers(1, 400))
        los = sorted(draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=40)))
        for lo in los:
            hi = draw(st.integers(lo + 1, size))
            ks.append(obj)
            wlo.append(lo // block * block)
            whi.append(min(size, -(-hi // block) * block))
            units.append(unit)
    arrays = (np.asarray(a, dtype=np.int64) for a in (ks, wlo, whi, units))
    return (*arrays, draw(st.integers(0, 8)))


@SETTINGS
@given(widened_pieces())
def test_ranges_within_block_units_are_grouped_as_piece_by_piece(case: Any) -> None:
    k, wlo, whi, units, gap = case
    expected = _capped_ranges(k.tolist(), wlo.tolist(), whi.tolist(), units.tolist(), gap, cap=1)
    assert _unit_ranges(k, wlo, whi, units, gap) == expected


def test_a_first_read_reaches_the_nearer_ends_of_the_next_read_s_ranges() -> None:
    """Runs of a read inside a range of the next read are widened to that range's ends, the
    split that widens the most runs with the fewest bytes, by at most ``most`` bytes a side;
    each piece still lands where it did."""
    layout = Layout.of_sizes(np.uint8, ["a", "b"], [64, 64], [4, 4])
    limits = Limits(coalesce_gap=0, max_request_bytes=64)

    def jobs_of(starts: list[int], length: int) -> list[Job]:
        jobs: list[Job] = []
        n = len(starts)
        at = np.arange(n, dtype=np.int64) * length
        dest = np.zeros(n * length, dtype=np.uint8)
        plan(layout, np.asarray(starts), np.full(n, length), at, dest=dest, limits=limits, jobs=jobs)
        return jobs

    def ranges(jobs: list[Job]) -> list[tuple[str, int, int]]:
        return [(j.path, s, e) for j in jobs for s, e in zip(j.starts, j.ends, strict=True)]

    after = jobs_of([0, 64 + 8], 48)  # "a" [0, 48) and "b" [8, 56)
    assert ranges(after) == [("a", 0, 48), ("b", 8, 56)]
    first = jobs_of([5, 37, 64 + 30], 2)  # blocks [4, 8) and [36, 40) of "a", [28, 32) of "b"
    assert ranges(first) == [("a", 4, 8), ("a", 36, 40), ("b", 28, 32)]
    # "a": [0, 8) and [36, 48) add 4 + 8 bytes; "b": its one run 20 bytes from either end
    assert ranges(lead(jobs_of([5, 37, 64 + 30], 2), after, limits)) == [
        ("a", 0, 8),
        ("a", 36, 48),
        ("b", 8, 32),
    ]
    # at most 6 bytes a side: [36, 40) and "b"'s run stay as they are
    assert ranges(lead(jobs_of([5, 37, 64 + 30], 2), after, limits, most=6)) == [
        ("a", 0, 8),
        ("a", 36, 40),
        ("b", 28, 32),
    ]
    # both runs of "a" to one end, one GET for two, where the other end costs more than allowed
    assert ranges(jobs_of([5, 13], 2)) == [("a", 4, 8), ("a", 12, 16)]
    assert ranges(lead(jobs_of([5, 13], 2), after, limits, most=8)) == [("a", 0, 16)]
    # each piece lands where it did
    led = lead(jobs_of([5, 37, 64 + 30], 2), after, limits)
    data = {p: np.arange(64, dtype=np.uint8).tobytes()[::-1] for p in ("a", "b")}
    fetch(led, data)
    want = data["a"][5:7] + data["a"][37:39] + data["b"][30:32]
    assert led[0].dest.tobytes() == want
    # a range outside the next read's, or none to lead to: as planned
    assert ranges(lead(jobs_of([50], 2), after, limits)) == [("a", 48, 52)]
    assert ranges(lead(jobs_of([5], 2), [], limits)) == [("a", 4, 8)]
