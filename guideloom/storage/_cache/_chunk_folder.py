"""The chunk cache's folder, shared by every process of a node: complete chunks under their
digest, reservations of space under a lock, the byte limit held for the folder as a whole."""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache._chunk_table import ChunkTable, blocks_of
from guideloom.storage._format._blocks import BLOCK_BYTES, FileBlocks, block_digests, identity
from guideloom.storage._remote._ranges import Job, fill

__all__ = ["ChunkFolder", "FileLock", "LOCK_WAIT_SECONDS"]

I64 = npt.NDArray[np.int64]


#: How long a download waits for another process that holds the chunk's lock.
LOCK_WAIT_SECONDS = 60.0


# The filesystem boundary: the tests inject faults (ENOSPC, EROFS) here.
def _create(path: Path, size: int) -> None:
    """Create ``path`` at its full ``size`` (the reservation that the folder's size shows)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)  # nothing of a reservation that failed (EFBIG, ENOSPC)
        raise
    os.close(fd)


def _write(path: Path, data: memoryview) -> None:
    """Write ``data`` to ``path`` from its start and fsync it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)


def _preader(fd: int) -> Callable[[int, int], bytes]:
    """Bytes ``[a, b)`` of ``fd``, as a block check reads them."""
    return lambda a, b: os.pread(fd, b - a, a)


class ChunkFolder:
    """The folder shared by the node's processes, and this process's index of its chunks.

    The cache's disk protocol, in one place: per-chunk ``flock`` locks and their dead holders,
    the scan, the space budget's lock and reservations, completing a download, and the local
    reads with their once-per-process checksum. The index (``local``, ``verified``) is guarded
    by the cache's condition ``cond``; faults are reported to ``fault``.
    """

    def __init__(
        self,
        path: Path,
        table: ChunkTable,
        location: str,
        cond: threading.Condition,
        fault: Callable[[str], None],
    ) -> None:
        self.path = path
        self.table = table
        self.location = location
        self._cond = cond
        self._fault = fault
        self.local: dict[int, str] = {}  # chunk -> file name: complete on disk, as last seen
        self.verified: set[int] = set()
        #: chunk -> (file name, the digests of its blocks as downloaded or checked whole, and the
        #: blocks checked for the file as last seen): every read checks its blocks against them
        self.blocks: dict[int, tuple[str, FileBlocks]] = {}

    # -- locks -------------------------------------------------------------------------------------
    def try_lock(self, gid: int, stopped: Callable[[], bool], *, wait: bool = False) -> int | None:
        """Chunk ``gid``'s lock (an open descriptor holding ``flock``), or None: another process
        holds it (after ``LOCK_WAIT_SECONDS`` with ``wait``, or once ``stopped()``)."""
        locks = self.path / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (LOCK_WAIT_SECONDS if wait else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if stopped() or time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.02)

    def _dead(self, gid: int) -> bool:
        """Whether nobody holds chunk ``gid``'s lock (its temporary file is a crashed download's)."""
        try:
            fd = os.open(self.path / "locks" / f"c{gid:09d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def budget(self) -> Any:
        """The folder's space budget lock (across processes), for a ``with`` block."""
        return FileLock(self.path / "budget.lock")

    # -- the scan and the space --------------------------------------------------------------------
    def rescan(self) -> None:
        try:
            self.scan()
        except OSError:
            pass  # no folder yet (or unreadable): nothing is on disk

    def scan(self, own: int = -1) -> int:
        """Learn the folder's complete chunks (others' too); drop temporary files of dead
        downloads. Returns the bytes the folder holds (in blocks). ``own``: a chunk whose lock
        this process holds (any temporary file of it is a dead one)."""
        used = 0
        found: dict[int, str] = {}
        with self._cond:
            before = dict(self.local)  # what completes during the listing is not dropped
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            entries = []
        for e in entries:
            name = e.name
            if not name.startswith("c") or "." not in name:
                continue
            head, _, tail = name.partition(".")
            try:
                gid = int(head[1:])
            except ValueError:
                continue
            if gid >= self.table.count:
                continue
            if tail.startswith("tmp-"):
                if gid == own or self._dead(gid):
                    try:
                        os.unlink(e.path)
                        continue
                    except FileNotFoundError:
                        pass  # renamed since the listing: complete now, and counted as such
                used += blocks_of(self.table.nbytes(gid))
            else:
                if gid in found:  # two copies of one chunk: keep one
                    Path(e.path).unlink(missing_ok=True)
                    continue
                found[gid] = name
                used += blocks_of(self.table.nbytes(gid))
        with self._cond:
            for g, name in before.items():
                if g not in found and self.local.get(g) == name:
                    del self.local[g]
                    self.verified.discard(g)
                    self.blocks.pop(g, None)
            for g, name in found.items():
                if self.local.get(g) != name:
                    self.local[g] = name
                    self.verified.discard(g)
                    self.blocks.pop(g, None)
        return used

    def reserve(self, gid: int) -> Path:
        """Chunk ``gid``'s temporary file, created at its full size (under ``budget()``)."""
        tmp = self.path / f"c{gid:09d}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        _create(tmp, self.table.nbytes(gid))
        return tmp

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def _named(self, gid: int, data: Any) -> str:
        """Chunk ``gid``'s file name for bytes ``data``: its digest covers the range the chunk
        stands for (object, first byte) with the bytes, so a file renamed within the folder or
        copied from another range is no chunk of this one."""
        f, start, _end = self.table.span(gid)
        where = f"{self.table.paths[f]}\0{start}\0".encode()
        return f"c{gid:09d}.{hashlib.sha256(where + bytes(memoryview(data))).hexdigest()[:32]}"

    def complete(self, gid: int, tmp: Path, data: memoryview) -> str:
        """Write chunk ``gid``'s bytes into its reserved ``tmp``, fsync it and rename it into
        place (complete, or not there at all); returns its file name. Its blocks' digests are
        those of ``data``: whatever happens to the file on disk, a read checks what it reads."""
        final = self._named(gid, data)
        self.blocks[gid] = (
            final,
            FileBlocks(block_digests(data, BLOCK_BYTES), BLOCK_BYTES, data.nbytes, final),
        )
        _write(tmp, data)
        os.rename(tmp, self.path / final)
        return final

    # -- local reads -------------------------------------------------------------------------------
    def serve(self, jobs: list[Job]) -> list[Job]:
        """On an I/O thread: fill ``jobs`` (one range each) from the chunk files; return those
        that could not be (evicted meanwhile, damaged, unreadable) for a remote read."""
        missed: list[Job] = []
        for job in jobs:
            s, e = job.starts[0], job.ends[0]
            buf = bytearray(e - s)
            ok = True
            for g in self.table.gids(job.path, s, e):
                with self._cond:
                    name = self.local.get(g)
                    checked = g in self.verified and self.blocks.get(g, ("",))[0] == name
                if name is None or (not checked and not self._verify(g, name)):
                    ok = False
                    break
                with self._cond:
                    blocks = self.blocks[g][1]
                _f, cs, ce = self.table.span(g)
                lo, hi = max(s, cs), min(e, ce)
                try:
                    fd = os.open(self.path / name, os.O_RDONLY)
                except FileNotFoundError:  # evicted by another process
                    with self._cond:
                        if self.local.get(g) == name:
                            del self.local[g]
                    ok = False
                    break
                except OSError as exc:
                    self._fault(
                        f"guideloom cannot read its chunk cache {self.path} ({exc}); reading remotely"
                    )
                    ok = False
                    break
                try:  # the file as last seen, its blocks read checked; unchanged after the copy
                    blocks.observe(os.fstat(fd))
                    blocks.ensure(lo - cs, hi - cs, _preader(fd))
                    got = os.preadv(fd, [memoryview(buf)[lo - s : hi - s]], lo - cs)
                    if blocks.observe(os.fstat(fd)):
                        got = -1  # changed while read: read remotely, checked again next time
                except DatasetIntegrityError:
                    self._damaged(g, name)
                    got = -1
                finally:
                    os.close(fd)
                if got != hi - lo:
                    ok = False
                    break
            if ok:
                fill(job, [buf])
            else:
                missed.append(job)
        return missed

    def _verify(self, gid: int, name: str) -> bool:
        """Check a chunk found on disk against the digest in its name, of its range and bytes (once
        per process while the file is unchanged): its blocks' digests, from then on, are those of
        the bytes checked."""
        try:
            fd = os.open(self.path / name, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fault(f"guideloom cannot read its chunk cache {self.path} ({exc}); reading remotely")
            return False
        try:
            before = os.fstat(fd)
            data = os.pread(fd, self.table.nbytes(gid) + 1, 0)
            changed = identity(os.fstat(fd)) != identity(before)
        finally:
            os.close(fd)
        if changed:
            return False  # written while read: read remotely, checked again next time
        if len(data) == self.table.nbytes(gid) and self._named(gid, data) == name:
            blocks = FileBlocks(block_digests(data, BLOCK_BYTES), BLOCK_BYTES, len(data), name)
            blocks.observe(before)
            blocks.ensure(0, len(data), lambda a, b: memoryview(data)[a:b])
            with self._cond:
                self.blocks[gid] = (name, blocks)
                self.verified.add(gid)
            return True
        self._damaged(gid, name)
        return False

    def _damaged(self, gid: int, name: str) -> None:
        """Delete chunk ``gid``'s damaged file ``name`` and say so (its range is read remotely)."""
        with self._cond:
            if self.local.get(gid) == name:
                del self.local[gid]
            self.verified.discard(gid)
            if self.blocks.get(gid, ("",))[0] == name:
                del self.blocks[gid]
        (self.path / name).unlink(missing_ok=True)
        self._fault(
            f"guideloom's chunk cache {self.path} held a damaged chunk ({name}); it was deleted "
            f"and {self.location} is read from the object store instead, nothing is lost"
        )


class FileLock:
    """``flock`` on ``path`` for the ``with`` block (the folder's space budget)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
