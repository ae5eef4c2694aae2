"""A local dataset served by a ``fetch`` function as an object store would, for the chunk cache
(``guideloom.storage._cache._chunks``): every test can count what was fetched and inject faults."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import guideloom
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._remote._ranges import Job, Layout, Limits, fill, plan_windows

CHUNK = 4096
SEQ = CHUNK // 2  # uint16 elements: one sample is one chunk


class Store:
    """A dataset written locally and served by ``fetch`` as an object store would."""

    def __init__(self, tmp_path: Path, chunks: int = 8, shard_bytes: int = 1 << 30) -> None:
        self.tokens = (np.arange(chunks * SEQ) * 7 % 65_521).astype(np.uint16)
        folder = tmp_path / "ds"
        self.manifest = guideloom.write_stream(folder, self.tokens, shard_bytes=shard_bytes)
        self.data = {f.path: (folder / f.path).read_bytes() for f in self.manifest.tokens.files}
        self.layouts = {name: Layout.of(spec) for name, spec in self.manifest.fields.items()}
        self.fetched: list[tuple[str, int, int]] = []
        self.remote_ranges = 0
        self.delay = 0.0
        #: Ends a delayed fetch at once (a test done with a slow download need not wait it out).
        self.hurry = threading.Event()

    def fetch(self, path: str, start: int, end: int) -> bytes:
        if self.delay:
            self.hurry.wait(self.delay)
        self.fetched.append((path, start, end))
        return self.data[path][start:end]

    async def remote(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.remote_ranges += len(job.starts)
            fill(job, [self.data[job.path][s:e] for s, e in zip(job.starts, job.ends, strict=True)])

    def cache(self, root: Path, max_bytes: int, **kw: Any) -> ChunkCache:
        return ChunkCache(root, "s3://bucket/ds", self.manifest, self.fetch, max_bytes=max_bytes, **kw)

    def window(self, cache: ChunkCache, samples: list[int]) -> tuple[tuple[int, int, int], Any]:
        starts = np.asarray(samples, dtype=np.int64) * SEQ
        return (len(starts), int(starts[0]), int(starts[-1])), cache.table.of_rows(self.layouts, starts, SEQ)

    def read(self, cache: ChunkCache, samples: list[int], *, planned: bool = True) -> np.ndarray:
        starts = np.asarray(samples, dtype=np.int64) * SEQ
        jobs, outs = plan_windows(self.layouts, starts, SEQ, Limits())
        key = (len(starts), int(starts[0]), int(starts[-1])) if planned else None
        asyncio.run(cache.run(jobs, key, self.remote))
        return outs["tokens"]

    def expected(self, samples: list[int]) -> np.ndarray:
        return np.stack([self.tokens[i * SEQ : (i + 1) * SEQ] for i in samples])


def settle(cache: ChunkCache, timeout: float = 10.0) -> None:
    """Wait until the planner has nothing more to do at the reader's current position: nothing
    in flight and nothing it would start. The planner picks a chunk and marks it in flight under
    the cache's lock, so what is seen here under that lock holds until the reader moves on; each
    download's end wakes this wait (and a short timeout covers a planner waiting out a grace)."""
    deadline = time.monotonic() + timeout
    with cache._cond:
        while True:
            cache._refill_locked()
            idle = not cache._inflight and (
                cache._disabled or cache._stalled_at == cache._now or cache._candidate_locked() is None
            )
            if idle:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("the planner did not settle")
            cache._cond.wait(min(left, 0.01))


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


class Sampler:
    """The folder's size, sampled on a thread for as long as the ``with`` block lasts."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self.samples = folder, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, folder_bytes(self.folder))
            self.samples += 1
            time.sleep(0.0005)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
