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
import hashlib
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom._process import Live
from guideloom.storage._cache._chunk_table import ChunkTable
from guideloom.storage._cache._chunks import blocks_of
from guideloom.storage._cache._copy_download import (
    I64,
    WAITING,
    WRITTEN,
    CopyDownload,
    Partial,
    pread_into,
    preader,
)
from guideloom.storage._format._blocks import (
    BLOCK_BYTES,
    INLINE_BLOCKS,
    BlockMismatch,
    FileBlocks,
    check_range,
    file_blocks,
    widen,
)
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._local._check import read_local_manifest
from guideloom.storage._remote._ranges import U8, Piece, Pieces, pieces_table

__all__ = ["DatasetCache", "copy_footprint"]

#: Bytes per ranged GET of the download.
PART_BYTES = 8 * 2**20
#: How long a range read waits for a part the download is fetching (or is to fetch next, for a
#: dense read) before it reads the range from the store: a second GET of the same bytes.
PART_WAIT_SECONDS = 1.0
#: A range of at least 1/this of a part is a dense read: a part it needs that is not on its way
#: yet is fetched next, and waited for. Such a range would cost as many bytes from the store as
#: a good share of the part, which the copy fetches anyway; a sparser range (a few rows of a
#: shuffle over a large dataset) is cheaper to read directly than to wait for its part.
DENSE_FRACTION = 4
#: How often a process that does not download looks for the folder another one is writing.
POLL_SECONDS = 1.0

#: A complete copy of at most this many bytes is checked (every block) on the reading thread when
#: first used (a few milliseconds); a larger one in the background, read remotely meanwhile.
CHECK_INLINE_BYTES = 64 * 2**20

#: Aborted before the interpreter joins its threads (as concurrent.futures' pools stop), so a
#: download in progress stops after its current parts instead of holding the process open.
_LIVE: Live[DatasetCache] = Live(lambda cache: cache.abort())


def _runs(pieces: Pieces) -> Iterator[Piece]:
    """``pieces`` (sorted by object offset), those adjacent both in the object and in the
    destination merged: a sequential read is one run a range."""
    run: Piece | None = None
    for at, n, off in pieces.tolist():
        if run is not None and at == run[0] + run[1] and off == run[2] + run[1]:
            run = (run[0], run[1] + n, run[2])
            continue
        if run is not None:
            yield run
        run = (at, n, off)
    if run is not None:
        yield run


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


class DatasetCache(CopyDownload):
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
        self._starting = threading.Lock()  # a start and an abort see the thread whole
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
        self._partial: Partial | None = None  # the download in progress, while its files are open
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
                    blocks.ensure(0, f.nbytes, preader(fd))
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
        return buf if self.read_into(path, start, end, pieces_table([(start, end - start, 0)]), buf) else None

    def read_into(self, path: str, start: int, end: int, pieces: Pieces, dest: U8) -> bool:
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
                    pread_into(fd, dest[off : off + n].data, at, path)
                if trust.observe(os.fstat(fd)):
                    raise OSError(errno.EAGAIN, f"{path}: the copy changed while read")
            else:  # in progress: the blocks read checked against the bytes downloaded
                digests, block = trust
                lo, hi = widen(start, end, block, self.table.sizes[self.table.index[path]])
                buf = np.empty(hi - lo, dtype=np.uint8)
                pread_into(fd, buf.data, lo, path)
                check_range(digests, block, lo, buf)
                for at, n, off in pieces.tolist():
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
                missing = [g for g in gids if state[g] != WRITTEN]
                if not missing:
                    return os.dup(partial.fds[path]), (partial.digests[path], partial.block)
                left = deadline - time.monotonic()
                waiting = [g for g in missing if state[g] == WAITING]
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
            blocks.ensure(start, end, preader(fd))
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
