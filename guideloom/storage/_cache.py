"""A local copy of an object-store dataset, downloaded in the background (``cache_dir=``).

An object store answers a random 4 KiB row in one round trip, however fast its bandwidth: over a
20 ms link a globally shuffled epoch is bound by latency, not bytes. With ``cache_dir`` the
dataset's objects are copied whole into a local folder by large concurrent ranged GETs, while
the loader keeps reading ranges remotely; once every object is down and matches its checksum,
reads switch to the local copy (memory-mapped, as for a local dataset) with no change to the
order or to what is delivered. The next ``open()`` finds the copy and reads locally at once.

The copy is a local dataset folder, ``<cache_dir>/<name>-<digest>``, the digest naming the
location and its manifest, so a dataset that changes gets a new folder. It is written under
``.partial`` and renamed into place with its manifest, so a folder that exists is complete.
A lock file lets one process of a node download while the others (other ranks) wait for the
folder to appear and read remotely meanwhile. A failed download (disk full, the object store
failing) warns once and leaves the loader reading remotely; it loses nothing. An object that does
not match the manifest (its checksum, or a change on the store since the dataset was opened) is
another matter: the storage refuses every read after it (:attr:`DatasetCache.damaged`), and never
serves the store's changed bytes instead. A copy in
progress outlives ``close()`` of its storage (a loader outside ``with`` closes it each epoch) and
stops at interpreter exit.
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
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._chunks import blocks_of
from guideloom.storage._local import file_sha256
from guideloom.storage._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._sinks import fsync_dir, write_synced

__all__ = ["DatasetCache", "copy_footprint"]

#: Bytes per ranged GET of the download, and how many are in flight at once.
PART_BYTES = 8 * 2**20
PARTS_IN_FLIGHT = 8
#: How often a process that does not download looks for the folder another one is writing.
POLL_SECONDS = 1.0
#: The download waits for the first read to complete, at most this long: the first batch does
#: not share the link and the CPUs with 64 MiB of copy in flight.
FIRST_READ_GRACE_SECONDS = 1.0

_LIVE: weakref.WeakSet[DatasetCache] = weakref.WeakSet()


def _abort_all() -> None:
    for cache in list(_LIVE):
        cache.abort()


# Runs before the interpreter joins its threads (as concurrent.futures' pools do), so a download
# in progress stops after its current parts instead of holding the process open.
threading._register_atexit(_abort_all)  # type: ignore[attr-defined]


def copy_footprint(manifest: Manifest) -> int:
    """The bytes a whole copy of ``manifest``'s dataset takes in the cache folder, counted as
    the chunk cache counts its limit (4 KiB blocks a file): its files and its manifest."""
    files = [f.nbytes for _, _, f in manifest.all_files()] + [len(manifest.to_json_bytes())]
    return sum(blocks_of(n) for n in files)


class DatasetCache:
    """One dataset's local copy: where it lives, and the download that fills it.

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
        digest = hashlib.sha256(location.encode() + b"\0" + manifest.to_json_bytes()).hexdigest()[:16]
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
            try:
                for f in files:
                    target = (partial / f.path).resolve()
                    if not target.is_relative_to(partial.resolve()):
                        raise ValueError(f"object {f.path!r} lies outside the dataset")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fds[f.path] = fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.ftruncate(fd, f.nbytes)
                parts = [
                    (f.path, s, min(f.nbytes, s + PART_BYTES))
                    for f in files
                    for s in range(0, f.nbytes, PART_BYTES)
                ]
                self._fetch_parts(parts, fds)
                for fd in fds.values():  # on disk before the folder that says "complete" appears
                    os.fsync(fd)
            finally:
                for fd in fds.values():
                    os.close(fd)
            for f in files:  # every byte is checked before the copy is used
                if self._abort.is_set():
                    return
                if file_sha256(partial / f.path) != f.sha256:
                    raise DatasetIntegrityError(
                        f"{self.location}: object {f.path!r} does not match its checksum in the "
                        "manifest (copied whole to the cache folder, none of it is read): write or "
                        "copy the dataset again"
                    )
            write_synced(partial / MANIFEST_NAME, self.manifest.to_json_bytes())
            for folder in {(partial / f.path).parent for f in files} | {partial}:
                fsync_dir(folder)
            if self._abort.is_set():
                return
            os.replace(partial, self.folder)  # the folder appears complete, or not at all
            fsync_dir(self.root)  # and the rename is on disk too: a crash cannot undo it halfway
            self._ready = True
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _fetch_parts(self, parts: list[tuple[str, int, int]], fds: dict[str, int]) -> None:
        """Fetch ``parts`` on ``PARTS_IN_FLIGHT`` threads; the first failure stops them all."""
        queue = iter(parts)
        lock = threading.Lock()
        failures: list[BaseException] = []

        def worker() -> None:
            while not self._abort.is_set() and not failures:
                with lock:
                    part = next(queue, None)
                if part is None:
                    return
                path, start, end = part
                try:
                    data = memoryview(self._fetch(path, start, end))
                    if data.nbytes != end - start:
                        raise ValueError(f"short read of {path!r}: {data.nbytes} of {end - start} bytes")
                    os.pwrite(fds[path], data, start)
                except BaseException as exc:
                    failures.append(exc)
                    return

        threads = [
            threading.Thread(target=worker, name=f"guideloom-cache-{i}")
            for i in range(min(PARTS_IN_FLIGHT, max(1, len(parts))))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
