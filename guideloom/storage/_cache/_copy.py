"""A local copy of an object-store dataset, downloaded in the background (``cache_dir=``).

An object store answers a random 4 KiB row in one round trip, however fast its bandwidth: over a
20 ms link a globally shuffled epoch is bound by latency, not bytes. With ``cache_dir`` the
dataset's objects are copied whole into a local folder by large concurrent ranged GETs of
:data:`PART_BYTES` each; once every object is down and matches its checksum, reads switch to the
local copy (memory-mapped, as for a local dataset) with no change to the order or to what is
delivered. The next ``open()`` finds the copy and reads locally at once.

The first epoch does not read the data twice. While the copy is in progress the loader's range
reads ask it first (:meth:`DatasetCache.read_into`, as each range starts): a range that lies
wholly in parts already written is read from the partial file, one whose part is on its way
waits for it (a short while: :data:`PART_WAIT_SECONDS`), and so does a dense range (at least a
quarter of a part, :data:`DENSE_FRACTION`) whose part is not on its way yet: as many threads
again fetch the parts such reads wait for, first. Only the rest, sparse rows of parts still to
come, is fetched from the store. The other parts go down in the order the loader will read them
(``will_read``), those it has not begun to read remotely first, so the copy runs ahead of the
reads it serves. At most ``2 * PARTS_IN_FLIGHT`` parts are in flight. Each part is hashed as it
is written, in order, so an object is checked against the manifest as soon as its last part is
down, not after the whole copy.

The copy is a local dataset folder, ``<cache_dir>/<name>-<digest>``, the digest naming the
location and its manifest, so a dataset that changes gets a new folder. It is written under
``.partial`` and renamed into place with its manifest, so a folder that exists is complete.
A lock file lets one process of a node download while the others (other ranks) wait for the
folder to appear and read remotely meanwhile (only the downloading process reads its partial
files). A failed download (disk full, the object store failing) warns once and leaves the loader
reading remotely; it loses nothing. An object that does not match the manifest (its checksum, or
a change on the store since the dataset was opened) is another matter: the storage refuses every
read after it (:attr:`DatasetCache.damaged`), and never serves the store's changed bytes instead.
A copy in progress outlives ``close()`` of its storage (a loader outside ``with`` closes it each
epoch) and stops at interpreter exit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom._process import Live
from guideloom.storage._cache._chunk_table import ChunkTable
from guideloom.storage._cache._chunks import blocks_of
from guideloom.storage._format._blocks import (
    BLOCK_BYTES,
    INLINE_BLOCKS,
    BlockHasher,
    BlockMismatch,
    FileBlocks,
    block_count,
    block_digests,
    check_range,
    file_blocks,
    widen,
)
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._format._verify import with_blocks
from guideloom.storage._local._storage import read_local_manifest
from guideloom.storage._remote._ranges import U8, Piece
from guideloom.storage._write._sinks import fsync_dir, write_synced

__all__ = ["DatasetCache", "copy_footprint"]

I64 = npt.NDArray[np.int64]

#: Bytes per ranged GET of the download, and how many are in flight at once.
PART_BYTES = 8 * 2**20
PARTS_IN_FLIGHT = 8
#: How long a range read waits for a part the download is fetching (or is to fetch next, for a
#: dense read) before it reads the range from the store: a second GET of the same bytes.
PART_WAIT_SECONDS = 1.0
#: A range of at least 1/this of a part is a dense read: a part it needs that is not on its way
#: yet is fetched next, and waited for. Such a range would cost as many bytes from the store as
#: a good share of the part, which the copy fetches anyway; a sparser range (a few rows of a
#: shuffle over a large dataset) is cheaper to read directly than to wait for its part.
DENSE_FRACTION = 4
#: The download gives up the plan's order once this many planned windows in a row have no part
#: left to take (a shuffle that touches every part in every window): the rest go in part order.
PLAN_BARREN_WINDOWS = 8
#: How often a process that does not download looks for the folder another one is writing.
POLL_SECONDS = 1.0
#: The download waits for the first read to complete, at most this long: the first batch does
#: not share the link and the CPUs with 64 MiB of copy in flight.
FIRST_READ_GRACE_SECONDS = 1.0

#: A complete copy of at most this many bytes is checked (every block) on the reading thread when
#: first used (a few milliseconds); a larger one in the background, read remotely meanwhile.
CHECK_INLINE_BYTES = 64 * 2**20

#: Aborted before the interpreter joins its threads (as concurrent.futures' pools stop), so a
#: download in progress stops after its current parts instead of holding the process open.
_LIVE: Live[DatasetCache] = Live(lambda cache: cache.abort())


def _runs(pieces: Sequence[Piece]) -> Iterator[Piece]:
    """``pieces`` (sorted by object offset), those adjacent both in the object and in the
    destination merged: a sequential read is one run a range."""
    run: Piece | None = None
    for at, n, off in pieces:
        if run is not None and at == run[0] + run[1] and off == run[2] + run[1]:
            run = (run[0], run[1] + n, run[2])
            continue
        if run is not None:
            yield run
        run = (at, n, off)
    if run is not None:
        yield run


def _preader(fd: int) -> Callable[[int, int], bytes]:
    """Bytes ``[a, b)`` of ``fd``, as a block check reads them."""
    return lambda a, b: os.pread(fd, b - a, a)


def _with_blocks(manifest: Manifest, folder: Path, digests: dict[str, Any]) -> Manifest:
    """``manifest`` with the block digests (``BLOCK_BYTES``) of the bytes downloaded, whose
    sha256 matched, their sidecars written to ``folder``: the copy's own, whatever the dataset
    carries, and never read back from the copy (which may have changed on disk since)."""
    return with_blocks(manifest, digests, lambda rel, data: write_synced(folder / rel, data), replace=True)


def copy_footprint(manifest: Manifest) -> int:
    """The bytes a whole copy of ``manifest``'s dataset takes in the cache folder, counted as
    the chunk cache counts its limit (4 KiB blocks a file): its files and its manifest."""
    specs = [f for _, _, f in manifest.all_files()]
    counts = [-(-f.nbytes // (f.blocks.size if f.blocks else BLOCK_BYTES)) for f in specs]
    # the copy's manifest carries block digests (up to 17 bytes a block inline), large files a sidecar
    files = [f.nbytes for f in specs] + [len(manifest.to_json_bytes()) + 200 * len(specs)]
    files += [17 * n if n <= INLINE_BLOCKS else 0 for n in counts]
    files += [8 * n for n in counts if n > INLINE_BLOCKS]
    return sum(blocks_of(n) for n in files)


# A part's state in a copy in progress.
_WAITING, _FETCHING, _WRITTEN = 0, 1, 2


class _Partial:
    """A download in progress: its open partial files and the state of each part (guarded by
    the cache's ``_mutex``). Written parts are never written again: a new download makes new
    files (the partial folder is removed first) and a new ``_Partial``."""

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
        self.state = bytearray(table.count)  # _WAITING, _FETCHING or _WRITTEN, per part
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


def _pread_into(fd: int, view: memoryview, at: int, path: str) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``at`` (:class:`OSError` where it ends early)."""
    done, n = 0, view.nbytes
    while done < n:
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
            raise OSError(errno.EIO, f"{path}: the copy ends early")
        done += got


class DatasetCache:
    """One dataset's local copy: where it lives, the download that fills it, and the reads it
    serves while in progress.

    ``fetch(path, start, end)`` returns bytes ``[start, end)`` of object ``path`` (a blocking call
    with its own retries); it runs on the download's threads.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        location: str,
        manifest: Manifest,
        fetch: Callable[[str, int, int], Any],
    ) -> None:
        self.root = Path(root).expanduser()
        # a copy holds block digests of its own (``copy-blocks``): copies made without are not used
        key = location.encode() + b"\0" + manifest.to_json_bytes() + b"\0copy-blocks"
        digest = hashlib.sha256(key).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in location.rstrip("/").split("/")[-1])
        self.folder = self.root / f"{name or 'dataset'}-{digest}"
        self.location = location
        self.manifest = manifest
        self._fetch = fetch
        self._abort = threading.Event()
        self._done = threading.Event()
        self.first_read = threading.Event()  # set by the storage once a read has completed
        self._thread: threading.Thread | None = None
        self._next_poll = 0.0
        self._ready = False
        self._lock_was_held = False  # another process was downloading when this one tried
        self.error: BaseException | None = None
        self._warned = False
        #: Every object cut into parts of ``PART_BYTES``: the download's units, global ids.
        self.table = ChunkTable(manifest, PART_BYTES)
        #: Guards the copy's state; a read waits for its part on an event of that part, and the
        #: demand threads for a wanted part on ``_demand``, so a part written wakes only its readers.
        self._mutex = threading.Lock()
        self._demand = threading.Condition(self._mutex)
        self._partial: _Partial | None = None  # the download in progress, while its files are open
        self._plan_lock = threading.Lock()  # consumes the plan (one download thread at a time)
        self._plan: Iterator[I64] | None = None
        #: Parts the loader has begun to read from the store under this plan: fetched last.
        self._claimed = bytearray(self.table.count)
        self.local_reads = 0  # ranges served from the copy in progress
        self.remote_reads = 0  # ranges it did not hold (read from the store)
        self.parts_fetched = 0
        self.bytes_fetched = 0
        #: The complete copy's manifest once every block of it was checked in this process.
        self._checked: Manifest | None = None
        self._checking: threading.Thread | None = None
        #: Why the complete copy is damaged (a block, a file, its manifest): it is not read, and
        #: the storage has it copied again (:meth:`rebuild`).
        self.copy_damaged: str | None = None
        self._copied: Manifest | None = None
        _LIVE.add(self)

    # -- state -------------------------------------------------------------------------------------
    def complete(self) -> bool:
        """Whether the local copy is there (a folder with a manifest is always complete)."""
        if self._ready:
            return True
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_SECONDS
        self._ready = (self.folder / MANIFEST_NAME).is_file()
        if not self._ready and self._lock_was_held and not self.running() and not self._abort.is_set():
            self.start()  # the process that held the lock may have failed or exited: take over
        return self._ready

    @property
    def damaged(self) -> str | None:
        """Why the dataset is refused, where the download found an object that does not match
        the manifest (its checksum, or a change on the store); None otherwise."""
        error = self.error
        return str(error) if isinstance(error, DatasetIntegrityError) else None

    def warn_if_failed(self) -> None:
        """Warn once that the download failed (the loader keeps reading remotely); not for a
        damaged dataset, which the storage refuses instead."""
        if self.error is not None and not self._warned and self.damaged is None:
            self._warned = True
            warnings.warn(
                f"guideloom could not copy {self.location} to the cache folder {self.folder}: "
                f"{self.error}. Reading it from the object store instead; nothing is lost.",
                RuntimeWarning,
                stacklevel=3,
            )

    def stats(self) -> dict[str, int]:
        """Ranges served from the copy in progress and those read remotely meanwhile, and the
        parts the download fetched and their bytes."""
        return {
            "cache_local_ranges": self.local_reads,
            "cache_remote_ranges": self.remote_reads,
            "cache_downloads": self.parts_fetched,
            "cache_download_bytes": self.bytes_fetched,
        }

    # -- the complete copy ---------------------------------------------------------------------------
    def copy_damage(self) -> str | None:
        """What a check found damaged in the complete copy (it is then never read), or None."""
        return self.copy_damaged

    def checked_copy(self) -> Manifest | None:
        """The complete copy's manifest once every block of every file was checked against its
        digest in this process (a background pass, started here the first time), else None: the
        copy is not read locally until then, nor ever where a block does not match
        (:attr:`copy_damaged`)."""
        if self._checked is not None or self.copy_damaged is not None or not self.complete():
            return self._checked
        if sum(f.nbytes for _, _, f in self.manifest.all_files()) <= CHECK_INLINE_BYTES:
            self._check_copy()  # a few milliseconds: the copy is read at once
            return self._checked
        with self._mutex:
            if self._checking is None:
                self._checking = threading.Thread(target=self._check_copy, name="guideloom-cache-check")
                self._checking.daemon = True
                self._checking.start()
        return None

    def _check_copy(self) -> None:
        try:
            copied = read_local_manifest(self.folder)
            if copied.digest() != self.manifest.digest() or not copied.has_blocks:
                raise DatasetIntegrityError(
                    f"{self.folder}: its {MANIFEST_NAME} is not the dataset's with block digests"
                )
            for _name, _spec, f in copied.all_files():
                assert f.blocks is not None
                path = self.folder / f.path
                fd = os.open(path, os.O_RDONLY)
                try:
                    blocks = file_blocks(
                        str(path), os.fstat(fd), f.blocks, self.folder, f"{self.folder}: file {f.path!r}"
                    )
                    blocks.ensure(0, f.nbytes, _preader(fd))
                finally:
                    os.close(fd)
        except (OSError, DatasetFormatError, DatasetIntegrityError) as exc:
            self.copy_damaged = str(exc)
            return
        self._checked = copied

    def rebuild(self) -> None:
        """Remove the damaged complete copy and copy the dataset again (reads go to the store
        meanwhile)."""
        self.abort()
        checking = self._checking
        if checking is not None and checking is not threading.current_thread():
            checking.join()
        with self._mutex:
            self._ready, self._checked, self._checking, self.copy_damaged = False, None, None, None
            self._next_poll = 0.0
        gone = self.folder.with_name(f"{self.folder.name}.damaged-{os.getpid()}-{time.monotonic_ns()}")
        with contextlib.suppress(OSError):
            os.replace(self.folder, gone)
        shutil.rmtree(gone, ignore_errors=True)
        self.start()

    # -- the reads it serves while in progress -----------------------------------------------------
    def plan(self, windows: Iterable[I64]) -> None:
        """The parts each of the loader's upcoming reads touch, in read order (consumed lazily):
        the download fetches them in that order. Replaces the previous plan (a new epoch)."""
        if self._ready:
            return  # read locally from the next window on
        with self._plan_lock:
            self._plan = iter(windows)
            with self._mutex:
                self._claimed[:] = bytes(len(self._claimed))
                partial = self._partial
                if partial is not None:
                    partial.queue.clear()
                    partial.barren = 0

    def read(self, path: str, start: int, end: int) -> npt.NDArray[np.uint8] | None:
        """Bytes ``[start, end)`` of object ``path`` from the local copy, or None where it does
        not hold them (see :meth:`read_into`)."""
        buf = np.empty(end - start, dtype=np.uint8)
        return buf if self.read_into(path, start, end, [(start, end - start, 0)], buf) else None

    def read_into(self, path: str, start: int, end: int, pieces: Sequence[Piece], dest: U8) -> bool:
        """Copy the ``pieces`` of range ``[start, end)`` of object ``path`` (object offset,
        length, offset in ``dest``) from the copy in progress, when every part the range lies in
        is written, or from the complete copy (for the reads planned before it was); False
        otherwise: the caller fetches the range from the store. A part on its way is waited for,
        up to ``PART_WAIT_SECONDS``, and so is one a dense range needs (``DENSE_FRACTION``),
        which the download fetches next. Blocking (an I/O thread's call).

        These bytes are the ones the store would return, before the object's checksum is
        verified: each part was fetched by the loader's own checked read (``Remote.fetch_range``:
        conditional on the ETag, or modification time, the dataset was opened with, the answer's
        size, ETag and length checked, with the same retries), written whole before it counts as
        written, and never written again; the descriptor read is a duplicate of the download's,
        so it reads that file even once the folder is renamed or removed. A checksum that fails
        (checked as soon as an object's last part is written) is a fault of the object the store
        itself serves at that version, which a remote read would deliver just the same: from then
        on the cache is damaged and the storage refuses every read, as it does when no byte was
        served locally.
        """
        got = self._descriptor(path, start, end)
        if got is None:
            with self._mutex:
                self.remote_reads += 1
            return False
        fd, trust = got
        try:
            if isinstance(trust, FileBlocks):  # the complete copy: its blocks checked, the file unchanged
                for at, n, off in _runs(pieces):  # straight into place: no buffer, no second copy
                    _pread_into(fd, dest[off : off + n].data, at, path)
                if trust.observe(os.fstat(fd)):
                    raise OSError(errno.EAGAIN, f"{path}: the copy changed while read")
            else:  # in progress: the blocks read checked against the bytes downloaded
                digests, block = trust
                lo, hi = widen(start, end, block, self.table.sizes[self.table.index[path]])
                buf = np.empty(hi - lo, dtype=np.uint8)
                _pread_into(fd, buf.data, lo, path)
                check_range(digests, block, lo, buf)
                for at, n, off in pieces:
                    dest[off : off + n] = buf[at - lo : at - lo + n]
        except (OSError, BlockMismatch, DatasetIntegrityError):
            with self._mutex:
                self.remote_reads += 1
            return False  # the store has it: a local fault costs a GET, never a read
        finally:
            os.close(fd)
        with self._mutex:
            self.local_reads += 1
        return True

    def _descriptor(self, path: str, start: int, end: int) -> tuple[int, FileBlocks | Any] | None:
        """A descriptor of ``path``'s local file that holds bytes ``[start, end)`` (the caller
        closes it) and what its reads are checked with: the complete copy's checked blocks, or
        the block digests of the bytes downloaded; or None: read them from the store (the parts
        they lie in are claimed)."""
        if path not in self.table.index:
            return None
        gids = self.table.gids(path, start, end)
        dense = end - start >= self.table.chunk // DENSE_FRACTION
        deadline = time.monotonic() + PART_WAIT_SECONDS
        first, asked = self._partial, False
        while first is not None:
            with self._mutex:
                partial = self._partial
                if partial is not first:
                    break
                state = partial.state
                missing = [g for g in gids if state[g] != _WRITTEN]
                if not missing:
                    return os.dup(partial.fds[path]), (partial.digests[path], partial.block)
                left = deadline - time.monotonic()
                waiting = [g for g in missing if state[g] == _WAITING]
                if left <= 0 or (waiting and not dense):
                    break
                if waiting and not asked:
                    partial.wanted.extend(waiting)  # fetched next, by a demand thread
                    asked = True
                    self._demand.notify(len(waiting))
                event = partial.events.setdefault(missing[0], threading.Event())
            event.wait(left)
        with self._mutex:
            ready = self._ready
            if not ready:
                for g in gids:  # it fetches them last (before the download starts too)
                    self._claimed[g] = 1
        if not ready or self.copy_damaged is not None:
            return None
        try:  # complete: a read planned before the storage switched to the copy
            fd = os.open(self.folder / path, os.O_RDONLY)
        except OSError:
            return None
        try:  # each block checked before it is read (once per process)
            spec = self._copied_spec(path)
            blocks = file_blocks(
                str(self.folder / path), os.fstat(fd), spec, self.folder, f"{self.folder}: file {path!r}"
            )
            blocks.ensure(start, end, _preader(fd))
        except (OSError, DatasetFormatError, DatasetIntegrityError) as exc:
            os.close(fd)
            self.copy_damaged = str(exc)
            return None
        return fd, blocks

    def _copied_spec(self, path: str) -> Any:
        """The block digests of ``path`` in the complete copy's manifest (read once)."""
        copied = self._checked or self._copied
        if copied is None:
            copied = read_local_manifest(self.folder)
            if copied.digest() != self.manifest.digest():
                raise DatasetIntegrityError(f"{self.folder}: its {MANIFEST_NAME} is not the dataset's")
            self._copied = copied
        for _name, _spec, f in copied.all_files():
            if f.path == path and f.blocks is not None:
                return f.blocks
        raise DatasetIntegrityError(f"{self.folder}: file {path!r} has no block digests in the copy")

    # -- the download ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background download unless the copy exists or one is running. Idempotent."""
        if self.running():
            return
        if (self.folder / MANIFEST_NAME).is_file():
            self._ready = True
            return
        self._abort.clear()
        self._done.clear()
        self.error = None
        self._thread = threading.Thread(target=self._run, name="guideloom-cache", daemon=False)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self) -> None:
        """Stop a download in progress (its partial folder is removed) and wait for it."""
        self._abort.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
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
            copy: _Partial | None = None
            try:
                for f in files:
                    target = (partial / f.path).resolve()
                    if not target.is_relative_to(partial.resolve()):
                        raise ValueError(f"object {f.path!r} lies outside the dataset")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fds[f.path] = fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.ftruncate(fd, f.nbytes)
                copy = _Partial(self.table, fds)
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

    def _hash(self, copy: _Partial, path: str, start: int, data: memoryview) -> None:
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
                    if copy.state[g] != _WRITTEN:
                        break
                _f, _s, end = table.span(g)
                back = np.empty(end - pos, dtype=np.uint8)
                _pread_into(fd, back.data, pos, path)
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

    def _next_part(self, copy: _Partial) -> int | None:
        """The part to fetch next (marked as fetching), None once every part is taken: those
        dense reads wait for, then the parts of the planned reads in their order, then the others
        in order; parts the loader has begun to read from the store come after those it has not."""
        state, claimed = copy.state, self._claimed

        def take(parts: deque[int], unclaimed: bool) -> int | None:  # under the mutex
            while parts:
                g = parts.popleft()
                if state[g] == _WAITING and not (unclaimed and claimed[g]):
                    state[g] = _FETCHING
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
                while g < len(state) and (state[g] != _WAITING or (npass == 0 and claimed[g])):
                    g += 1
                copy.cursor[npass] = g
                if g < len(state):
                    state[g] = _FETCHING
                    copy.untaken -= 1
                    return g
        return None

    def _walk_plan(self, copy: _Partial) -> bool:
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
        left = gids[(state[gids] == _WAITING) & (claimed[gids] == 0)]
        copy.barren = 0 if len(left) else copy.barren + 1
        with self._mutex:
            copy.queue.extend(left.tolist())
        return True

    def _wanted_part(self, copy: _Partial, stop: Callable[[], bool]) -> int | None:
        """For a demand thread: the next part a dense read waits for (marked as fetching), once
        there is one; None once every part is taken, or ``stop()``."""
        with self._demand:
            while not stop():
                while copy.wanted:
                    g = copy.wanted.popleft()
                    if copy.state[g] == _WAITING:
                        copy.state[g] = _FETCHING
                        copy.untaken -= 1
                        return g
                if not copy.untaken:
                    return None
                self._demand.wait(0.1)  # woken by a read that wants a part (or looks at stop())
        return None

    def _fetch_parts(self, copy: _Partial) -> None:
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
                        copy.state[g] = _WRITTEN
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
