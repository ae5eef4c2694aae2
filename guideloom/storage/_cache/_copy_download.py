"""The download that fills a local copy of an object-store dataset: the parts fetched on
threads in the loader's planned order (those dense reads wait for first), each written once and
hashed in order, every object checked against the manifest, the folder renamed into place
complete (see :mod:`guideloom.storage._cache._copy`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache._chunk_table import ChunkTable
from guideloom.storage._format._blocks import (
    BLOCK_BYTES,
    BlockHasher,
    BlockMismatch,
    block_count,
    block_digests,
    check_range,
)
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._format._verify import with_blocks
from guideloom.storage._write._sinks import fsync_dir, write_synced

__all__ = ["FETCHING", "I64", "WAITING", "WRITTEN", "CopyDownload", "Partial", "pread_into", "preader"]

I64 = npt.NDArray[np.int64]

#: How many parts of the download are in flight at once (as many again for dense reads).
PARTS_IN_FLIGHT = 8
#: The download gives up the plan's order once this many planned windows in a row have no part
#: left to take (a shuffle that touches every part in every window): the rest go in part order.
PLAN_BARREN_WINDOWS = 8
#: The download waits for the first read to complete, at most this long: the first batch does
#: not share the link and the CPUs with 64 MiB of copy in flight.
FIRST_READ_GRACE_SECONDS = 1.0


def preader(fd: int) -> Callable[[int, int], bytes]:
    """Bytes ``[a, b)`` of ``fd``, as a block check reads them."""
    return lambda a, b: os.pread(fd, b - a, a)


def _with_blocks(manifest: Manifest, folder: Path, digests: dict[str, Any]) -> Manifest:
    """``manifest`` with the block digests (``BLOCK_BYTES``) of the bytes downloaded, whose
    sha256 matched, their sidecars written to ``folder``: the copy's own, whatever the dataset
    carries, and never read back from the copy (which may have changed on disk since)."""
    return with_blocks(manifest, digests, lambda rel, data: write_synced(folder / rel, data), replace=True)


# A part's state in a copy in progress.
WAITING, FETCHING, WRITTEN = 0, 1, 2


class Partial:
    """A download in progress: its open partial files and the state of each part (guarded by
    the cache's ``_mutex``). Written parts are never written again: a new download makes new
    files (the partial folder is removed first) and a new ``Partial``."""

    def __init__(self, table: ChunkTable, fds: dict[str, int]) -> None:
        self.table = table
        self.fds = fds
        #: Each object's sha256 so far, over its first ``hashed[path]`` bytes: a part is hashed
        #: as it is written, in order, so an object is checked as soon as its last part is down.
        self.hashers = {path: hashlib.sha256() for path in table.paths}
        self.hashed = dict.fromkeys(table.paths, 0)
        #: Each object's digests of the bytes downloaded, a digest per ``block`` bytes (a part is
        #: whole blocks), filled as parts are: a read from the copy in progress checks the blocks
        #: it reads against them.
        self.block = BLOCK_BYTES if table.chunk % BLOCK_BYTES == 0 else table.chunk
        self.digests = {
            path: np.zeros(block_count(int(n), self.block), dtype=np.uint64)
            for path, n in zip(table.paths, table.sizes, strict=True)
        }
        #: The copy's own block digests (``BLOCK_BYTES``), of each object's bytes in order as its
        #: sha256 is computed: they hold once that matches the manifest.
        self.blocks = {path: BlockHasher(BLOCK_BYTES) for path in table.paths}
        self.hash_locks = {path: threading.Lock() for path in table.paths}
        self.state = bytearray(table.count)  # WAITING, FETCHING or WRITTEN, per part
        self.queue: deque[int] = deque()  # parts of the planned windows walked so far, to take
        self.wanted: deque[int] = deque()  # parts dense reads are waiting for: taken first
        self.events: dict[int, threading.Event] = {}  # set once the part is written (or given up)
        self.untaken = table.count  # parts still waiting
        self.barren = 0  # planned windows in a row that had no part left to take
        self.cursor = [0, 0]  # how far the two passes in part order have looked


def _hash_file(path: Path) -> tuple[Any, BlockHasher]:
    """A file's sha256 and block digests (``BLOCK_BYTES``), in one pass."""
    digest, blocks = hashlib.sha256(), BlockHasher(BLOCK_BYTES)
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * 2**20):
            digest.update(chunk)
            blocks.update(chunk)
    return digest, blocks


def pread_into(fd: int, view: memoryview, at: int, path: str) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``at`` (:class:`OSError` where it ends early)."""
    done, n = 0, view.nbytes
    while done < n:
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
            raise OSError(errno.EIO, f"{path}: the copy ends early")
        done += got


class CopyDownload:
    """The download of a :class:`~guideloom.storage._cache._copy.DatasetCache` (a part of it):
    one process of those sharing ``cache_dir`` copies the dataset, in the background."""

    # the cache's state it reads and writes (set by DatasetCache.__init__)
    root: Path
    folder: Path
    location: str
    manifest: Manifest
    table: ChunkTable
    error: BaseException | None
    first_read: threading.Event
    _fetch: Callable[[str, int, int], Any]
    _abort: threading.Event
    _done: threading.Event
    _thread: threading.Thread | None
    _starting: threading.Lock
    _ready: bool
    _lock_was_held: bool
    _mutex: threading.Lock
    _demand: threading.Condition
    _partial: Partial | None
    _plan_lock: threading.Lock
    _plan: Iterator[I64] | None
    _claimed: bytearray
    parts_fetched: int
    bytes_fetched: int

    def start(self) -> None:
        """Start the background download unless the copy exists or one is running. Idempotent.
        The thread is the download's once it has started: an abort meanwhile (from another
        thread) waits for the start, then for the thread."""
        with self._starting:
            if self.running():
                return
            if (self.folder / MANIFEST_NAME).is_file():
                self._ready = True
                return
            self._abort.clear()
            self._done.clear()
            self.error = None
            t = threading.Thread(target=self._run, name="guideloom-cache", daemon=False)
            t.start()
            self._thread = t

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self) -> None:
        """Stop a download in progress (its partial folder is removed) and wait for it."""
        self._abort.set()
        with self._starting:
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._starting:
            if self._thread is t:
                self._thread = None

    def _run(self) -> None:
        """The download thread: one process of those sharing ``cache_dir`` copies the dataset."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._lock() as held:
                self._lock_was_held = not held
                if not held or (self.folder / MANIFEST_NAME).is_file():
                    return  # another process downloads it (or just did): poll for the folder
                self.first_read.wait(FIRST_READ_GRACE_SECONDS)
                self._download()
        except BaseException as exc:
            if not self._abort.is_set():
                self.error = exc
        finally:
            self._done.set()

    @contextlib.contextmanager
    def _lock(self) -> Iterator[bool]:
        fd = os.open(self.root / f"{self.folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    def _download(self) -> None:
        partial = self.folder.with_name(self.folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # an earlier, interrupted download
        partial.mkdir()
        try:
            files = [f for _, _, f in self.manifest.all_files()]
            need, free = sum(f.nbytes for f in files), shutil.disk_usage(partial).free
            if free < need:
                raise OSError(
                    errno.ENOSPC,
                    f"{self.root} has {free:,} bytes free and the copy needs {need:,}; free some space "
                    "or pass another cache_dir",
                )
            fds: dict[str, int] = {}
            copy: Partial | None = None
            try:
                for f in files:
                    target = (partial / f.path).resolve()
                    if not target.is_relative_to(partial.resolve()):
                        raise ValueError(f"object {f.path!r} lies outside the dataset")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fds[f.path] = fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.ftruncate(fd, f.nbytes)
                copy = Partial(self.table, fds)
                with self._mutex:
                    self._partial = copy  # reads may be served from its written parts now
                self._fetch_parts(copy)
                for fd in fds.values():  # on disk before the folder that says "complete" appears
                    os.fsync(fd)
                for f in files:  # every byte is checked before the copy is used
                    if self._abort.is_set():
                        return
                    if copy.hashed[f.path] != f.nbytes:  # not hashed as its parts were written: now
                        copy.hashers[f.path], copy.blocks[f.path] = _hash_file(partial / f.path)
                    if copy.hashers[f.path].hexdigest() != f.sha256:
                        raise self._mismatch(f.path)
                digests = {f.path: copy.blocks[f.path].digests() for f in files}
                copied = _with_blocks(self.manifest, partial, digests)
                write_synced(partial / MANIFEST_NAME, copied.to_json_bytes())
                for folder in {(partial / f.path).parent for f in files} | {partial}:
                    fsync_dir(folder)
                if self._abort.is_set():
                    return
                os.replace(partial, self.folder)  # the folder appears complete, or not at all
                fsync_dir(self.root)  # and the rename is on disk too: a crash cannot undo it halfway
                self._ready = True
            finally:
                with self._mutex:
                    self._partial = None  # no read takes a descriptor from here on
                    waiting = list(copy.events.values()) if copy is not None else []
                for event in waiting:
                    event.set()  # their reads go on without this copy
                for fd in fds.values():
                    os.close(fd)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _mismatch(self, path: str) -> DatasetIntegrityError:
        return DatasetIntegrityError(
            f"{self.location}: object {path!r} does not match its checksum in the manifest (copied "
            "whole to the cache folder): write or copy the dataset again"
        )

    def _hash(self, copy: Partial, path: str, start: int, data: memoryview) -> None:
        """Hash part ``[start, start + len(data))`` of ``path``, just written, if the object is
        hashed up to it, and the parts after it already written (read back); an object hashed
        whole is checked against the manifest here (:class:`DatasetIntegrityError`, which stops
        the download: the cache is damaged from then on)."""
        table = copy.table
        f = table.index[path]
        with copy.hash_locks[path]:
            if copy.hashed[path] != start:
                return  # an earlier part is not written yet: the thread that writes it goes on here
            digest = copy.hashers[path]
            digest.update(data)
            copy.blocks[path].update(data)
            pos, size, fd = start + data.nbytes, table.sizes[f], copy.fds[path]
            while pos < size:
                g = table.gids(path, pos, pos + 1)[0]
                with self._mutex:
                    if copy.state[g] != WRITTEN:
                        break
                _f, _s, end = table.span(g)
                back = np.empty(end - pos, dtype=np.uint8)
                pread_into(fd, back.data, pos, path)
                try:  # read back: what was written, unless the file changed on disk since
                    check_range(copy.digests[path], copy.block, pos, back)
                except BlockMismatch as exc:
                    raise OSError(errno.EIO, f"{path}: the copy in progress changed on disk: {exc}") from None
                digest.update(back.data)
                copy.blocks[path].update(back.data)
                pos = end
            copy.hashed[path] = pos
            if pos == size and digest.hexdigest() != table.sha256[f]:
                raise self._mismatch(path)

    def _next_part(self, copy: Partial) -> int | None:
        """The part to fetch next (marked as fetching), None once every part is taken: those
        dense reads wait for, then the parts of the planned reads in their order, then the others
        in order; parts the loader has begun to read from the store come after those it has not."""
        state, claimed = copy.state, self._claimed

        def take(parts: deque[int], unclaimed: bool) -> int | None:  # under the mutex
            while parts:
                g = parts.popleft()
                if state[g] == WAITING and not (unclaimed and claimed[g]):
                    state[g] = FETCHING
                    copy.untaken -= 1
                    return g
            return None

        with self._mutex:
            g = take(copy.wanted, False)
        if g is not None:
            return g
        with self._plan_lock:
            while True:
                with self._mutex:
                    g = take(copy.wanted, False)
                    if g is None:
                        g = take(copy.queue, True)
                if g is not None:
                    return g
                if not self._walk_plan(copy):
                    break
        with self._mutex:
            g = take(copy.wanted, False)
            if g is not None:
                return g
            for npass in (0, 1):  # those not claimed, then any
                g = copy.cursor[npass]
                while g < len(state) and (state[g] != WAITING or (npass == 0 and claimed[g])):
                    g += 1
                copy.cursor[npass] = g
                if g < len(state):
                    state[g] = FETCHING
                    copy.untaken -= 1
                    return g
        return None

    def _walk_plan(self, copy: Partial) -> bool:
        """Queue the parts of the next planned window that are left to take (under the plan
        lock); False once the plan is done, or given up (``PLAN_BARREN_WINDOWS``)."""
        if self._plan is None or copy.barren >= PLAN_BARREN_WINDOWS:
            self._plan = None
            return False
        try:
            window = next(self._plan, None)
        except Exception:  # a plan that cannot be walked is only a lost hint
            window = None
        if window is None:
            self._plan = None
            return False
        gids = np.unique(np.asarray(window, dtype=np.int64))
        state = np.frombuffer(copy.state, dtype=np.uint8)  # read unlocked: taken under the lock
        claimed = np.frombuffer(self._claimed, dtype=np.uint8)
        left = gids[(state[gids] == WAITING) & (claimed[gids] == 0)]
        copy.barren = 0 if len(left) else copy.barren + 1
        with self._mutex:
            copy.queue.extend(left.tolist())
        return True

    def _wanted_part(self, copy: Partial, stop: Callable[[], bool]) -> int | None:
        """For a demand thread: the next part a dense read waits for (marked as fetching), once
        there is one; None once every part is taken, or ``stop()``."""
        with self._demand:
            while not stop():
                while copy.wanted:
                    g = copy.wanted.popleft()
                    if copy.state[g] == WAITING:
                        copy.state[g] = FETCHING
                        copy.untaken -= 1
                        return g
                if not copy.untaken:
                    return None
                self._demand.wait(0.1)  # woken by a read that wants a part (or looks at stop())
        return None

    def _fetch_parts(self, copy: Partial) -> None:
        """Fetch every part on ``PARTS_IN_FLIGHT`` threads in the download's order, and the parts
        dense reads wait for on as many more (the loader's reads, which would otherwise be its own
        GETs); the first failure stops them all."""
        table = copy.table
        failures: list[BaseException] = []

        def stop() -> bool:
            return self._abort.is_set() or bool(failures)

        def worker(take: Callable[[], int | None]) -> None:
            while not stop():
                g = take()
                if g is None:
                    return
                f, start, end = table.span(g)
                path = table.paths[f]
                try:
                    data = memoryview(self._fetch(path, start, end)).cast("B")
                    if data.nbytes != end - start:
                        raise ValueError(f"short read of {path!r}: {data.nbytes} of {end - start} bytes")
                    first = start // copy.block  # parts are whole blocks (but an object's last)
                    digests = block_digests(data, copy.block)
                    copy.digests[path][first : first + len(digests)] = digests
                    done = 0
                    while done < data.nbytes:  # a part counts as written once all of it is
                        done += os.pwrite(copy.fds[path], data[done:], start + done)
                    with self._mutex:
                        copy.state[g] = WRITTEN
                        self.parts_fetched += 1
                        self.bytes_fetched += end - start
                        event = copy.events.pop(g, None)
                    if event is not None:
                        event.set()
                    self._hash(copy, path, start, data)
                except BaseException as exc:
                    failures.append(exc)  # the readers waiting for a part go on once the copy stops
                    return

        n = min(PARTS_IN_FLIGHT, max(1, table.count))
        threads = [
            threading.Thread(target=worker, args=(take,), name=f"guideloom-cache-{kind}{i}")
            for kind, take in (
                ("", lambda: self._next_part(copy)),
                ("demand-", lambda: self._wanted_part(copy, stop)),
            )
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
