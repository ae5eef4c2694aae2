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
go to the object store. An object that does not match the manifest (a chunk that is the whole
object fails its checksum, or the object changed on the store since it was opened) is refused:
every read after it raises :class:`DatasetIntegrityError` (:attr:`ChunkCache.damaged`).
Warnings are issued from the reading thread, never from a background thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom._process import Live
from guideloom.storage._cache._chunk_download import Downloader
from guideloom.storage._cache._chunk_folder import ChunkFolder
from guideloom.storage._cache._chunk_schedule import ChunkSchedule
from guideloom.storage._cache._chunk_table import BLOCK, ChunkTable, blocks_of, route
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._remote._objstore import io_executor
from guideloom.storage._remote._ranges import Job

__all__ = ["CHUNK_BYTES", "ChunkCache", "blocks_of"]

I64 = npt.NDArray[np.int64]

#: Default chunk size (``cache_chunk_bytes``).
CHUNK_BYTES: Final = 16 * 2**20
#: How long a read waits for a chunk this process is downloading before reading remotely.
CHUNK_WAIT_SECONDS = 0.25
#: As for the whole copy (_copy.py): downloads stop before the interpreter joins its threads.
_LIVE: Live[ChunkCache] = Live(lambda cache: cache.stop())


class ChunkCache:
    """One dataset's chunk cache under ``root``: the planner, the downloads and the local reads.

    ``fetch(path, start, end)`` returns bytes ``[start, end)`` of object ``path`` (blocking, with
    its own retries); it runs on the download threads.

    This class is the reading side and the faults it warns of; its parts are the plan and
    Belady's rule (``ChunkSchedule``), the shared folder (``ChunkFolder``) and the background downloads
    (``Downloader``). One condition, ``_cond``, guards the state of all of them.
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
        # The limit is part of the folder's identity: each process enforces its own limit on the
        # folder it shares, so processes with different limits must not share one.
        digest = hashlib.sha256(
            location.encode()
            + b"\0"
            + manifest.to_json_bytes()
            + b"\0"
            + str(chunk).encode()
            + b"\0"
            + str(max_bytes).encode()
        ).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in location.rstrip("/").split("/")[-1])
        self.folder = self.root / f"{name or 'dataset'}-{digest}.chunks"
        self.location = location
        self.table = ChunkTable(manifest, chunk)
        self._cond = threading.Condition()
        self._pinned: dict[int, int] = {}  # chunk -> reads using it now (not evicted)
        self._faults: list[str] = []  # warnings to issue from the reading thread
        self._warned: set[str] = set()
        self.local_reads = 0
        self.remote_reads = 0
        self._schedule = ChunkSchedule(max(1, max_bytes // max(1, chunk)))
        self._disk = ChunkFolder(self.folder, self.table, location, self._cond, self._fault)
        self._downloader = Downloader(
            fetch, location, max_bytes, self._cond, self._schedule, self._disk, self._pinned, self._fault
        )
        _LIVE.add(self)
        self._disk.rescan()

    def plan(self, windows: Iterable[tuple[Any, ...]]) -> None:
        """The windows the reader will read next, in order: a key per read, its chunks and
        (optionally) the bytes it reads from each (``ChunkTable.use_of_rows``); without them every
        chunk counts as fully used.

        Replaces the previous plan (a new epoch, or an iterator resumed elsewhere). Consumed
        lazily, as far ahead as the horizon reaches.
        """
        with self._cond:
            self._schedule.reset(windows)
            self._cond.notify_all()
        self._downloader.start()

    def stop(self) -> None:
        """Stop the planner and the downloads (their temporary files are removed), and wait."""
        self._downloader.stop()

    # -- state kept by the parts, read here by callers and the tests -----------------------------
    @property
    def last_error(self) -> str | None:
        """The last download that failed without a fault of the folder (the reads went remote)."""
        return self._downloader.last_error

    @property
    def downloads(self) -> int:
        return self._downloader.downloads

    @property
    def evictions(self) -> int:
        return self._downloader.evictions

    @property
    def _local(self) -> dict[int, str]:
        return self._disk.local

    @property
    def _inflight(self) -> dict[int, concurrent.futures.Future[None]]:
        return self._downloader.inflight

    @property
    def _fetching(self) -> set[int]:
        return self._downloader.fetching

    @property
    def _disabled(self) -> bool:
        return self._downloader.disabled

    @property
    def _now(self) -> int:
        return self._schedule.now

    @property
    def _stalled_at(self) -> int | None:
        return self._schedule.stalled_at

    def _refill_locked(self) -> None:
        self._schedule.refill()

    def _candidate_locked(self) -> tuple[int, int] | None:
        return self._downloader.candidate_locked()

    # -- faults ------------------------------------------------------------------------------------
    def _fault(self, message: str, *, disable: bool = False) -> None:
        with self._cond:
            if disable:
                self._downloader.disabled = True
                self._cond.notify_all()
            if message not in self._warned:
                self._warned.add(message)
                self._faults.append(message)

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
        self.check_intact()
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
                    missed = await loop.run_in_executor(io_executor(), self._disk.serve, local)
                    if missed:
                        await remote_run(missed)

            from guideloom.storage._remote._client import gather_first_error

            await gather_first_error([nearby(), remote_run(far)] if far else [nearby()])
            done = True
        finally:
            with self._cond:
                if done and self._schedule.grace_until:
                    self._schedule.grace_until = 0.0  # a read is in: downloads may start
                    self._cond.notify_all()
                for g in pins:
                    n = self._pinned[g] - 1
                    if n:
                        self._pinned[g] = n
                    else:
                        del self._pinned[g]
                        self._schedule.stalled_at = None  # it may be evicted now: the planner looks again
                if pins:
                    self._cond.notify_all()
        self.warn_pending()

    @property
    def damaged(self) -> str | None:
        """Why the dataset is refused, once a download found an object that does not match the
        manifest; None otherwise."""
        return self._downloader.damaged

    def check_intact(self) -> None:
        if self._downloader.damaged is not None:
            raise DatasetIntegrityError(self._downloader.damaged)

    def _split(
        self, jobs: list[Job], key: tuple[int, int, int] | None
    ) -> tuple[list[Job], list[concurrent.futures.Future[None]], list[Job], list[int]]:
        """Under the lock: move the plan to ``key``, route ``jobs`` (``route``) and pin the chunks
        read locally; the downloads of those still on their way are returned to wait for."""
        waits: dict[int, concurrent.futures.Future[None]] = {}
        with self._cond:
            if key is not None and self._schedule.advance(key):
                self._cond.notify_all()
            disk, downloader = self._disk, self._downloader
            local, pins, far = route(self.table, jobs, lambda g: g in disk.local or g in downloader.fetching)
            for g in pins:
                self._pinned[g] = self._pinned.get(g, 0) + 1
                if g not in disk.local:
                    waits[g] = downloader.inflight[g]
            self.local_reads += len(local)
            self.remote_reads += sum(len(j.starts) for j in far)
        return local, list(waits.values()), far, pins

    def stats(self) -> dict[str, int]:
        """Chunks downloaded and evicted, and ranges read from disk and remotely."""
        return {
            "cache_downloads": self.downloads,
            "cache_evictions": self.evictions,
            "cache_local_ranges": self.local_reads,
            "cache_remote_ranges": self.remote_reads,
        }
