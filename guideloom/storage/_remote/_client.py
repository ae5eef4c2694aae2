"""One object-store dataset's connection: its store client, limits, retries and range fetches.

:class:`Remote` reads the manifest and checks the objects' sizes when a dataset is opened (and
records each object's version: every later read is conditional on it), and
runs the jobs that :mod:`guideloom.storage._remote._ranges` plans through its
:class:`~guideloom.storage._remote._fetch.RangeFetcher`: concurrently, under a limit of requests and
bytes in flight (per event loop), each with bounded retries and backoff. Every obstore call is a
synchronous one on an I/O thread (see :mod:`guideloom.storage._remote._objstore`).

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from guideloom._core.text import plural
from guideloom._errors import DatasetIntegrityError
from guideloom._process import Live
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._remote._fetch import (
    RangeFetcher,
    ReadCounters,
    RemoteBlocks,
    gather_first_error,
    get_verified,
    integrity_error,
)
from guideloom.storage._remote._locations import Location, parse_location
from guideloom.storage._remote._objstore import (
    RANGES_PER_CALL,
    ObjectVersion,
    call_with_retries,
    io_executor,
    make_store,
)
from guideloom.storage._remote._options import (
    ReadSettings,
    RetryPolicy,
    map_error,
    secret_values,
    split_options,
)
from guideloom.storage._remote._ranges import Job, Limits

__all__ = ["Remote", "gather_first_error", "open_remote"]

#: Every store guideloom still holds, dropped at exit once the threads are joined (a thread may
#: read through one until it ends), so nothing of obstore outlives the interpreter.
_OPEN: Live[Remote] = Live(lambda remote: remote.drop_store(), after_threads=True)

#: A manifest checked this recently (``open_stream`` checks it and every object's size) is not
#: read again by ``open()``: the round trip would sit in front of the first batch, and a
#: dataset rewritten within these seconds is a race no check closes. Later opens read it again.
MANIFEST_FRESH_SECONDS = 5.0


class Remote:
    """A dataset location's store client, its read limits, and its range-fetch engine (``fetcher``)."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.loc: Location = parse_location(url)
        self.opts: ReadSettings
        self.opts, _w, self._config, self._client = split_options(options, write=False)
        self.secrets = secret_values(self._config, url)
        cap = self.opts.max_request_bytes
        # A job takes the byte budget as one acquisition: keep several within it, so that the
        # in-flight bound holds and the requests still overlap.
        self.limits = Limits(
            coalesce_gap=self.opts.coalesce_gap,
            max_request_bytes=cap,
            job_bytes=max(cap, self.opts.max_inflight_bytes // 4),
            ranges_per_call=RANGES_PER_CALL,
            # coalesce_gap=0 asks for the exact ranges: no bridging by amplification either
            max_read_amplification=self.opts.max_read_amplification if self.opts.coalesce_gap else 1.0,
        )
        self._store: Any = None
        self._store = self._new_store()
        self.checked_until = 0.0  # monotonic: until then open() need not read the manifest again
        self.counters = ReadCounters()  # counted into by the blocking reads here and by the fetcher
        #: Each data object as the dataset was opened with it (``check_objects``); reads are
        #: conditional on it.
        self.versions: dict[str, ObjectVersion] = {}
        #: Why the dataset is refused as a whole (a cache found its copy of an object damaged):
        #: every later read is.
        self.damaged: str | None = None
        #: Why each object a read found missing or changed is refused: every later read of it
        #: is, while reads of the other objects (each conditional on its own version) go on, so
        #: a read far ahead does not fail the batches before the first that needs the object.
        self.refused: dict[str, str] = {}
        #: Each object's block digests (set by ``check_objects``): every fetched range is checked.
        self.blocks = RemoteBlocks()
        self.blocks.read = self.read_object
        self.fetcher = RangeFetcher(
            self.loc, self.opts, self.secrets, self.counters, self.versions, self.blocks, self.refused
        )
        _OPEN.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy in a process worker: its block digests' sidecars are read through this copy.
        self.__dict__.update(state)
        self.blocks.read = self.read_object

    def _new_store(self) -> Any:
        return make_store(self.loc, self._config, self._client, self.opts.policy, obstore_retries=False)

    @property
    def policy(self) -> RetryPolicy:
        return self.opts.policy

    def store(self) -> Any:
        if self._store is None:
            self._store = self._new_store()
            _OPEN.add(self)
        return self._store

    def drop_store(self) -> None:
        self._store = None

    def store_for_reading(self) -> Any:
        if self._store is None:
            raise RuntimeError(f"{self.loc.display} is not open; call `await storage.open()` first")
        return self._store

    @property
    def requests(self) -> int:
        """Range GETs sent, retries included (each is billed)."""
        return self.counters.requests

    @property
    def bytes_read(self) -> int:
        """Bytes those GETs returned."""
        return self.counters.bytes_read

    def count_reads(self, requests: int, nbytes: int) -> None:
        """Count reads another copy of this connection made (a process worker's)."""
        self.counters.requests += requests
        self.counters.bytes_read += nbytes

    def peak_inflight_bytes(self) -> int:
        return self.fetcher.peak_inflight_bytes()

    # -- integrity -------------------------------------------------------------------------------
    def mark_damaged(self, message: str) -> None:
        """Refuse every later read: an object does not match the manifest (the first reason stays)."""
        if self.damaged is None:
            self.damaged = message

    def check_intact(self, paths: Iterable[str] = ()) -> None:
        """Raise :class:`DatasetIntegrityError` once the dataset was found damaged, or where one
        of ``paths`` (the objects a read touches) was found missing or changed."""
        if self.damaged is not None:
            raise DatasetIntegrityError(self.damaged)
        refused = self.refused
        if refused:
            for path in paths:
                if path in refused:
                    raise DatasetIntegrityError(refused[path])

    # -- blocking calls (the caller's thread, the I/O pool or the cache's threads) ----------------
    def fetch_range(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of object ``path``: a blocking, checked call with retries (the
        cache's); :class:`DatasetIntegrityError` where the object changed since it was opened."""
        self.check_intact((path,))
        store = self.store()  # a copy goes on after close(): it keeps a client of its own
        version = self.versions.get(path)

        def get() -> Any:
            self.counters.requests += 1
            return get_verified(store, path, start, end, version, self.blocks)

        error: Exception
        try:
            data = call_with_retries(get, self.policy)
            self.counters.bytes_read += end - start
            return data
        except Exception as exc:
            changed = integrity_error(self.loc, path, exc)
            if changed is not None:
                self.refused.setdefault(path, str(changed))
                error = changed
            else:
                what = f"reading {self.loc.object_url(path)} bytes {start}-{end - 1}"
                error = map_error(exc, what, self.secrets)
        raise error

    def read_manifest(self) -> Manifest:
        import obstore

        store = self.store()
        try:
            data = call_with_retries(lambda: bytes(obstore.get(store, MANIFEST_NAME).bytes()), self.policy)
        except Exception as exc:
            error = map_error(exc, f"cannot read {self.loc.object_url(MANIFEST_NAME)}", self.secrets)
        else:
            return Manifest.from_json_bytes(data, source=self.loc.display)
        if isinstance(error, FileNotFoundError):
            error = FileNotFoundError(
                f"no dataset at {self.loc.display!r}: it has no {MANIFEST_NAME} (an unfinished "
                "or interrupted write leaves none; write or copy the dataset again)"
            )
        raise error

    def list_sizes(self) -> dict[str, ObjectVersion] | None:
        """Every object's size and version (ETag, modification time) under the prefix, from one
        listing; None where listing is impossible (``http(s)://``, no list permission)."""
        import obstore

        if self.loc.kind == "http":
            return None
        store = self.store()
        try:
            listed = call_with_retries(lambda: obstore.list(store).collect(), self.policy)
            return {str(m["path"]): ObjectVersion.of(m) for m in listed}
        except Exception:
            return None  # e.g. no list permission: one HEAD per object instead

    def object_sizes(
        self, paths: Sequence[str], listed: dict[str, ObjectVersion] | None = None
    ) -> dict[str, ObjectVersion]:
        """Sizes and versions of ``paths`` (missing ones absent): from ``listed``
        (:meth:`list_sizes`, made while the manifest was read), one listing, or HEADs where
        listing is impossible."""
        import obstore

        store = self.store()
        sizes = listed if listed is not None else self.list_sizes()
        if sizes is not None:
            return {p: sizes[p] for p in paths if p in sizes}

        def head(path: str) -> tuple[str, ObjectVersion | None]:
            try:
                meta = call_with_retries(lambda: obstore.head(store, path), self.policy)
            except FileNotFoundError:
                return path, None
            except Exception as exc:
                error = map_error(exc, f"cannot inspect {self.loc.object_url(path)}", self.secrets)
            else:
                return path, ObjectVersion.of(meta)
            raise error

        out: dict[str, ObjectVersion] = {}
        for path, version in io_executor().map(head, paths):
            if version is not None:
                out[path] = version
        return out

    def check_objects(self, manifest: Manifest, listed: dict[str, ObjectVersion] | None = None) -> None:
        """Refuse a manifest whose objects are missing or of the wrong size (as for local files);
        record each object's version, on which every later read is conditional."""
        files = manifest.all_files()
        found = self.object_sizes([f.path for _, _, f in files], listed)
        for name, _spec, f in files:
            version = found.get(f.path)
            if version is None:
                raise DatasetIntegrityError(
                    f"{self.loc.display}: object {f.path!r} of field {name!r} named by the manifest "
                    "is missing"
                )
            size = version.size
            if size != f.nbytes:
                raise DatasetIntegrityError(
                    f"{self.loc.display}: object {f.path!r} of field {name!r} has {plural(size, 'byte')}, "
                    f"the manifest says {f.nbytes}; the dataset is damaged or was not copied completely"
                )
            self.versions[f.path] = replace(version, sha256=f.sha256)
        self.blocks.set(manifest, self.loc.display)

    def read_object(self, path: str) -> bytes:
        """The whole of object ``path`` (a small one: a block digests file), with retries."""
        import obstore

        store = self.store()
        try:
            return call_with_retries(lambda: bytes(obstore.get(store, path).bytes()), self.policy)
        except Exception as exc:
            error = map_error(exc, f"reading {self.loc.object_url(path)}", self.secrets)
        if isinstance(error, FileNotFoundError):
            error = DatasetIntegrityError(
                f"{self.loc.display}: the block digests file {path!r} named by the manifest is missing"
            )
        raise error

    def sha256(self, path: str, progress: Callable[[int], object] | None = None) -> str:
        """The hex sha256 of object ``path``, streamed once (``progress`` gets each chunk's size)."""
        import obstore

        digest = hashlib.sha256()
        try:
            result = obstore.get(self.store(), path)
            for chunk in result.stream(min_chunk_size=8 * 2**20):
                digest.update(memoryview(chunk))
                if progress is not None:
                    progress(memoryview(chunk).nbytes)
        except Exception as exc:
            error = map_error(exc, f"reading {self.loc.object_url(path)}", self.secrets)
        else:
            return digest.hexdigest()
        raise error

    def stream(self, path: str) -> Iterator[Any]:
        """Object ``path``'s bytes in chunks of 8 MiB or more, in order (a blocking iterator)."""
        import obstore

        error: Exception
        try:
            result = obstore.get(self.store(), path)
            for chunk in result.stream(min_chunk_size=8 * 2**20):
                yield memoryview(chunk)
            return
        except Exception as exc:
            error = map_error(exc, f"reading {self.loc.object_url(path)}", self.secrets)
        raise error

    def put(self, path: str, data: bytes) -> None:
        """Write object ``path`` (one PUT: it appears whole or not at all), with retries."""
        import obstore

        store = self.store()
        try:
            call_with_retries(lambda: obstore.put(store, path, data), self.policy)
            return
        except Exception as exc:
            error = map_error(exc, f"writing {self.loc.object_url(path)}", self.secrets)
        raise error

    async def reopen(self, manifest: Manifest) -> None:
        """``open()``: a client, and the manifest read again and compared (off the event loop),
        unless it was checked less than :data:`MANIFEST_FRESH_SECONDS` ago (once)."""
        if time.monotonic() < self.checked_until:
            self.checked_until = 0.0
            return
        loop = asyncio.get_running_loop()
        current = await loop.run_in_executor(io_executor(), self.read_manifest)
        if current != manifest:
            raise DatasetIntegrityError(
                f"{self.loc.display}: the manifest changed since the dataset was opened; open it again"
            )

    # -- batched range reads (the engine is :class:`~._fetch.RangeFetcher`) -----------------------
    async def run(self, jobs: list[Job]) -> None:
        """Run ``jobs`` concurrently under the request and byte limits; the first failure wins.
        An object found missing or changed is refused, and so is every later read of it (the
        fetcher records it in :attr:`refused`); an integrity failure it does not name an object
        for refuses every later read."""
        self.check_intact(job.path for job in jobs)
        if not jobs:
            return
        try:
            await self.fetcher.run(self.store_for_reading(), jobs)
        except DatasetIntegrityError as exc:
            if str(exc) not in {self.refused.get(job.path) for job in jobs}:
                self.mark_damaged(str(exc))
            raise


def open_remote(url: str, options: dict[str, Any]) -> tuple[Remote, Manifest]:
    """A connection to ``url`` and its manifest, checked against the objects' sizes."""
    remote = Remote(url, options)
    # The listing does not need the manifest: made while it is read, one round trip less.
    listing = io_executor().submit(remote.list_sizes) if remote.loc.kind != "http" else None
    manifest = remote.read_manifest()
    remote.check_objects(manifest, None if listing is None else listing.result())
    remote.checked_until = time.monotonic() + MANIFEST_FRESH_SECONDS
    return remote, manifest
