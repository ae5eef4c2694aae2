"""Verified blocks held from a session's first read (``HeldBlocks``) and the ranges of a later read
cut around them (``cut_held``), against direct slices of in-memory bytes: every piece gets its
bytes, no held byte is fetched again, a held range of another object version is never used."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom.storage._remote._fetch import HOLD_BYTES, HOLD_READS, HeldBlocks, cut_held
from guideloom.storage._remote._objstore import ObjectVersion
from guideloom.storage._remote._ranges import Job, Layout, Limits, fill_range, plan

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def two_reads(draw: Any) -> tuple[int, list[int], list[tuple[int, int]], list[tuple[int, int]], Limits]:
    """A block size, shard sizes, a small first read and a larger second one (start, length)."""
    block = draw(st.sampled_from([4, 16, 32]))
    sizes = draw(st.lists(st.integers(1, 400), min_size=1, max_size=4))
    total = sum(sizes)

    def reads(most: int, longest: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(draw(st.integers(1, most))):
            start = draw(st.integers(0, total - 1))
            out.append((start, draw(st.integers(1, min(longest, total - start)))))
        return out

    cap = draw(st.sampled_from([block, 2 * block, 8 * block, 64 * block]))
    limits = Limits(draw(st.integers(0, 3 * block)), cap, 4 * cap, draw(st.integers(1, 10)))
    return block, sizes, reads(4, 2 * block), reads(30, 6 * block), limits


def planned(layout: Layout, reads: list[tuple[int, int]], limits: Limits) -> tuple[list[Job], np.ndarray]:
    starts = np.asarray([s for s, _ in reads], dtype=np.int64)
    lengths = np.asarray([n for _, n in reads], dtype=np.int64)
    dest_at = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)
    jobs: list[Job] = []
    plan(layout, starts, lengths, dest_at, dest=dest, limits=limits, jobs=jobs)
    return jobs, dest


def expected(data: bytes, reads: list[tuple[int, int]]) -> bytes:
    return b"".join(data[s : s + n] for s, n in reads)


@SETTINGS
@given(two_reads(), st.integers(0, 2**32 - 1))
def test_a_read_cut_around_held_blocks_gets_every_byte_and_fetches_none_twice(
    case: tuple[int, list[int], list[tuple[int, int]], list[tuple[int, int]], Limits], seed: int
) -> None:
    block, sizes, first, second, limits = case
    rng = np.random.default_rng(seed)
    paths = [f"shard-{i}.bin" for i in range(len(sizes))]
    objects = {
        p: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for p, n in zip(paths, sizes, strict=True)
    }
    data = b"".join(objects[p] for p in paths)
    layout = Layout.of_sizes(np.uint8, paths, sizes, [block] * len(sizes))
    versions = {p: ObjectVersion(n, etag=f'"{p}"') for p, n in zip(paths, sizes, strict=True)}
    stale = paths[int(rng.integers(len(paths)))] if rng.random() < 0.3 else None

    held = HeldBlocks()
    held.begin()
    assert held.tick(), "a session's first read keeps what it fetches"
    jobs, dest = planned(layout, first, limits)
    kept: dict[str, list[tuple[int, int]]] = {}
    for job in jobs:
        for s, e in zip(job.starts, job.ends, strict=True):
            assert s % block == 0 and (e % block == 0 or e == len(objects[job.path]))
            buf = objects[job.path][s:e]
            version = ObjectVersion(1) if job.path == stale else versions[job.path]
            before = held.nbytes
            held.add(job.path, s, e, buf, version)
            if held.nbytes > before:
                kept.setdefault(job.path, []).append((s, e))
    for job in jobs:
        for i, (s, e) in enumerate(zip(job.starts, job.ends, strict=True)):
            fill_range(job, i, objects[job.path][s:e])
    assert dest.tobytes() == expected(data, first)

    assert not held.tick(), "only the first read of a session keeps"
    jobs, dest = planned(layout, second, limits)
    for job in jobs:
        cut_held(job, held, versions[job.path])
    fetched: dict[str, list[tuple[int, int]]] = {}
    for job in jobs:
        size = len(objects[job.path])
        for i, (s, e) in enumerate(zip(job.starts, job.ends, strict=True)):
            assert s % block == 0 and (e % block == 0 or e == size), "whole blocks, each checked"
            if i in job.held:
                assert job.path != stale, "a held range of another version is never used"
                assert bytes(job.held[i]) == objects[job.path][s:e]
                fill_range(job, i, job.held[i])
            else:
                fetched.setdefault(job.path, []).append((s, e))
                fill_range(job, i, objects[job.path][s:e])
    assert dest.tobytes() == expected(data, second), "every piece gets its bytes"
    for path, ranges in kept.items():
        if path == stale:
            continue
        for s, e in fetched.get(path, []):
            assert all(e <= a or b <= s for a, b in ranges), "no held byte is fetched again"
    # what the second read overlapped is held no longer
    for job in jobs:
        for s, e in zip(job.starts, job.ends, strict=True):
            assert held.take(job.path, s, e, versions[job.path]) == []


def test_held_blocks_are_bounded_and_let_go() -> None:
    version = ObjectVersion(64 * 2**20)
    held = HeldBlocks()
    held.begin()
    held.tick()
    chunk = bytes(2**20)
    for k in range(HOLD_BYTES // 2**20 + 4):  # more than the bound: the rest is not held
        held.add("a", k * 2**20, (k + 1) * 2**20, chunk, version)
    assert held.nbytes == HOLD_BYTES
    # taken: let go, what lies outside the range stays
    got = held.take("a", 2**20 + 4096, 3 * 2**20, version)
    assert [(a, b) for a, b, _ in got] == [(2**20 + 4096, 2 * 2**20), (2 * 2**20, 3 * 2**20)]
    assert held.nbytes == HOLD_BYTES - 2 * 2**20 + 4096
    assert held.take("a", 2**20, 2**20 + 4096, version)[0][:2] == (2**20, 2**20 + 4096)
    # another version of the object: never used, let go
    assert held.take("a", 0, 2**20, ObjectVersion(64 * 2**20, etag='"other"')) == []
    assert held.take("a", 0, 2**20, version) == []
    # reads that do not take them: let go after HOLD_READS of them
    for _ in range(HOLD_READS):
        held.tick()
    assert held.nbytes > 0
    held.tick()
    assert held.nbytes == 0
    # a new session lets go of what the last one held, and so does closing
    held.add("a", 0, 2**20, chunk, version)
    held.begin()
    assert held.nbytes == 0
    held.add("a", 0, 2**20, chunk, version)
    held.clear()
    assert held.nbytes == 0 and not held.tick()
