"""Object-store datasets: ``s3://``, ``gs://``, ``az://`` and (read-only) ``http(s)://``.

The layout is the local one (``manifest.json`` and raw shard files under a prefix), so a dataset
folder copied to a bucket with any tool reads back identically. Opening reads and checks the
manifest and the objects' sizes; reading turns every batched ``read_many`` into byte ranges per
object, coalesces ranges that are adjacent or closer than ``coalesce_gap``, and fetches them
concurrently under a limit of requests and of bytes in flight, with bounded retries (see
:mod:`guideloom._storage._objstore` for why every obstore call is a synchronous one on a Python
thread).

Options (``open_stream(url, **options)``, ``open_documents``, ``write_stream(url, ...)``):

- store configuration, over the standard environment variables: ``endpoint`` (or
  ``endpoint_url``), ``access_key_id``, ``secret_access_key``, ``session_token``, ``region``,
  ``skip_signature``, ... (any obstore ``S3Config`` / ``GCSConfig`` / ``AzureConfig`` key),
  ``allow_http``, ``allow_invalid_certificates``, ``client_options`` (obstore ``ClientConfig``);
- reading: ``max_inflight_requests`` (256), ``max_inflight_bytes`` (64 MiB), ``coalesce_gap``
  (8 KiB), ``max_request_bytes`` (4 MiB), ``max_concurrent_reads`` (read-ahead windows the
  loader keeps in flight, 4), ``offsets_cache_bytes`` (documents: offsets up to this size are
  loaded at ``open()``, larger ones are read per batch; 64 MiB), ``cache_dir`` (a local folder:
  the dataset is copied there in the background and read locally once complete, see
  :mod:`guideloom._storage._cache`; none by default);
- faults: ``timeout`` (seconds per request, 30), ``connect_timeout`` (5), ``retries`` (5),
  ``retry_timeout`` (no retry starts after this many seconds, 120), ``backoff`` (0.1),
  ``max_backoff`` (5);
- writing: ``part_size`` (multipart part size, 16 MiB), ``max_upload_concurrency`` (4).

Credentials are never part of a message, a log line or a ``repr``: messages name the location
without user information or query string, and every credential value is masked.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import hashlib
import secrets as _secrets
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import numpy.typing as npt

from .._errors import DatasetFormatError, DatasetIntegrityError, StorageError
from ._cache import DatasetCache
from ._objstore import (
    RANGES_PER_CALL,
    Location,
    PerLoop,
    ReadOptions,
    RetryPolicy,
    ShortReadError,
    call_with_retries,
    io_executor,
    make_store,
    obstore_message,
    parse_location,
    remote_read_error,
    retryable,
    secret_values,
    split_options,
)
from .base import Rows
from .local import LocalDocumentStorage, LocalStreamStorage
from .manifest import MANIFEST_NAME, ArraySpec, Manifest
from .manifested import ManifestDocumentStorage, ManifestStreamStorage, check_kind

__all__ = [
    "ObjectDocumentStorage",
    "ObjectSink",
    "ObjectStreamStorage",
    "open_documents",
    "open_stream",
    "sink_for",
    "verify_dataset",
]

Array = npt.NDArray[Any]
I64 = npt.NDArray[np.int64]


# -- errors ----------------------------------------------------------------------------------------
def _map_error(exc: Exception, what: str, secrets: Sequence[str]) -> Exception:
    """An obstore failure as the Python error a user expects, with a scrubbed message."""
    import obstore.exceptions as oe

    msg = f"{what}: {obstore_message(exc, secrets)}"
    if isinstance(exc, FileNotFoundError | oe.NotFoundError):
        return FileNotFoundError(msg)
    if isinstance(exc, PermissionError | oe.PermissionDeniedError | oe.UnauthenticatedError):
        return PermissionError(msg)
    return StorageError(msg)


# -- one dataset's connection ----------------------------------------------------------------------
_OPEN: weakref.WeakSet[_Remote] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Drop every store guideloom still holds, so nothing of obstore outlives the interpreter."""
    for remote in list(_OPEN):
        remote.drop_store()
    gc.collect()


@dataclass(slots=True)
class _Array:
    """An array stored as shard objects: their paths and cumulative byte bounds."""

    dtype: np.dtype[Any]
    paths: tuple[str, ...]
    bounds: I64  # len(paths) + 1 cumulative byte offsets

    @staticmethod
    def of(spec: ArraySpec) -> _Array:
        sizes = [f.nbytes for f in spec.files]
        return _Array(spec.dtype, tuple(f.path for f in spec.files), np.cumsum([0, *sizes], dtype=np.int64))


@dataclass(slots=True)
class _Job:
    """Up to RANGES_PER_CALL coalesced ranges of one object, fetched by one worker-thread call."""

    path: str
    starts: list[int]
    ends: list[int]
    pieces: list[list[tuple[int, int, int]]]  # per range: (object offset, length, destination offset)
    dest: npt.NDArray[np.uint8]

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))


class _Remote:
    """A dataset location's store client, its read limits and the range-fetch engine."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.loc: Location = parse_location(url)
        self.opts: ReadOptions
        self.opts, _w, self._config, self._client = split_options(options, write=False)
        self.secrets = secret_values(self._config)
        self._store: Any = None
        self._store = self._new_store()
        self._limits = PerLoop(self.opts.max_inflight_requests, self.opts.max_inflight_bytes)
        self.requests = 0
        _OPEN.add(self)

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

    def peak_inflight_bytes(self) -> int:
        return self._limits.peak_bytes()

    def fetch_range(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of object ``path``: a blocking call with retries (the cache's)."""
        import obstore

        store = self.store()  # a copy goes on after close(): it keeps a client of its own
        self.requests += 1
        try:
            return call_with_retries(
                lambda: obstore.get_range(store, path, start=start, end=end), self.policy
            )
        except Exception as exc:
            raise _map_error(exc, f"reading {self.loc.object_url(path)}", self.secrets) from None

    # -- manifest and objects (blocking; run on the caller's thread or the I/O pool) ----------
    def read_manifest(self) -> Manifest:
        import obstore

        store = self.store()
        try:
            data = call_with_retries(lambda: bytes(obstore.get(store, MANIFEST_NAME).bytes()), self.policy)
        except Exception as exc:
            err = _map_error(exc, f"cannot read {self.loc.object_url(MANIFEST_NAME)}", self.secrets)
            if isinstance(err, FileNotFoundError):
                raise FileNotFoundError(
                    f"no dataset at {self.loc.display!r}: it has no {MANIFEST_NAME} (an unfinished "
                    "or interrupted write leaves none; write or copy the dataset again)"
                ) from None
            raise err from None
        return Manifest.from_json_bytes(data, source=self.loc.display)

    def object_sizes(self, paths: Sequence[str]) -> dict[str, int]:
        """Sizes of ``paths`` (missing ones absent): one listing, or HEADs where listing is impossible."""
        import obstore

        store = self.store()
        if self.loc.kind != "http":
            try:
                listed = call_with_retries(lambda: obstore.list(store).collect(), self.policy)
                sizes = {str(m["path"]): int(m["size"]) for m in listed}
                return {p: sizes[p] for p in paths if p in sizes}
            except Exception:
                pass  # e.g. no list permission: fall back to one HEAD per object

        def head(path: str) -> tuple[str, int | None]:
            try:
                meta = call_with_retries(lambda: obstore.head(store, path), self.policy)
            except FileNotFoundError:
                return path, None
            except Exception as exc:
                raise _map_error(exc, f"cannot inspect {self.loc.object_url(path)}", self.secrets) from None
            return path, int(meta["size"])

        out: dict[str, int] = {}
        for path, size in io_executor().map(head, paths):
            if size is not None:
                out[path] = size
        return out

    def check_objects(self, manifest: Manifest) -> None:
        """Refuse a manifest whose objects are missing or of the wrong size (as for local files)."""
        files = manifest.all_files()
        sizes = self.object_sizes([f.path for _, _, f in files])
        for name, _spec, f in files:
            size = sizes.get(f.path)
            if size is None:
                raise DatasetIntegrityError(
                    f"{self.loc.display}: object {f.path!r} of field {name!r} named by the manifest "
                    "is missing"
                )
            if size != f.nbytes:
                raise DatasetIntegrityError(
                    f"{self.loc.display}: object {f.path!r} of field {name!r} has {size} bytes, the "
                    f"manifest says {f.nbytes}; the dataset is damaged or was not copied completely"
                )

    async def reopen(self, manifest: Manifest) -> None:
        """``open()``: a client, and the manifest read again and compared (off the event loop)."""
        loop = asyncio.get_running_loop()
        current = await loop.run_in_executor(io_executor(), self.read_manifest)
        if current != manifest:
            raise DatasetIntegrityError(
                f"{self.loc.display}: the manifest changed since the dataset was opened; open it again"
            )

    # -- batched range reads ---------------------------------------------------------------------
    def plan(
        self,
        arr: _Array,
        starts: I64,
        lengths: I64,
        dest_offsets: I64,
        *,
        dest: npt.NDArray[np.uint8],
        jobs: list[_Job],
    ) -> None:
        """Add the jobs that copy bytes ``[s, s+n)`` of ``arr`` to ``dest[d:d+n]`` for each triple."""
        keep = lengths > 0
        starts, lengths, dest_offsets = starts[keep], lengths[keep], dest_offsets[keep]
        if not len(starts):
            return
        bounds = arr.bounds
        ends = starts + lengths
        if int(ends.max()) > int(bounds[-1]) or int(starts.min()) < 0:
            raise IndexError(f"{self.loc.display}: a read reaches outside the stored data")
        shard = np.searchsorted(bounds, starts, side="right") - 1
        inside = ends <= bounds[shard + 1]
        k = shard[inside]
        lo = starts[inside] - bounds[k]
        n = lengths[inside]
        d = dest_offsets[inside]
        extra: list[tuple[int, int, int, int]] = []
        for i in np.flatnonzero(~inside).tolist():  # pieces that cross a shard boundary
            s, e, off = int(starts[i]), int(ends[i]), int(dest_offsets[i])
            while s < e:
                kk = int(np.searchsorted(bounds, s, side="right")) - 1
                stop = min(e, int(bounds[kk + 1]))
                extra.append((kk, s - int(bounds[kk]), stop - s, off))
                off += stop - s
                s = stop
        if extra:
            ex = np.asarray(extra, dtype=np.int64)
            k, lo, n, d = (np.concatenate([a, ex[:, j]]) for j, a in enumerate((k, lo, n, d)))
        cap = self.opts.max_request_bytes
        if int(n.max()) > cap:  # split huge pieces so they are fetched in parallel
            big = np.flatnonzero(n > cap)
            parts: list[tuple[int, int, int, int]] = []
            for i in big.tolist():
                for j in range(0, int(n[i]), cap):
                    parts.append((int(k[i]), int(lo[i]) + j, min(cap, int(n[i]) - j), int(d[i]) + j))
            small = n <= cap
            ex = np.asarray(parts, dtype=np.int64)
            k, lo, n, d = (np.concatenate([a[small], ex[:, j]]) for j, a in enumerate((k, lo, n, d)))
        order = np.lexsort((lo, k))
        gap = self.opts.coalesce_gap
        ks, los, ns, ds = (a[order].tolist() for a in (k, lo, n, d))
        job: _Job | None = None
        cur_s = cur_e = -1
        cur_pieces: list[tuple[int, int, int]] = []
        # A job takes the byte budget as one acquisition: keep several within it, so that the
        # in-flight bound holds and the requests still overlap.
        job_bytes = max(cap, self.opts.max_inflight_bytes // 4)

        def flush() -> None:
            nonlocal job
            if not cur_pieces:
                return
            path = arr.paths[cur_k]
            if (
                job is None
                or job.path != path
                or len(job.starts) >= RANGES_PER_CALL
                or job.nbytes + (cur_e - cur_s) > job_bytes
            ):
                job = _Job(path, [], [], [], dest)
                jobs.append(job)
            job.starts.append(cur_s)
            job.ends.append(cur_e)
            job.pieces.append(list(cur_pieces))

        cur_k = -1
        for kk, s, ln, off in zip(ks, los, ns, ds, strict=True):
            e = s + ln
            if kk == cur_k and s <= cur_e + gap and max(cur_e, e) - cur_s <= cap:
                cur_e = max(cur_e, e)
                cur_pieces.append((s, ln, off))
                continue
            flush()
            cur_k, cur_s, cur_e = kk, s, e
            cur_pieces = [(s, ln, off)]
        flush()

    def _run_job_sync(self, store: Any, job: _Job) -> None:
        """On an I/O thread: fetch the job's ranges, check their lengths, copy the pieces out."""
        import obstore

        if len(job.starts) == 1:
            bufs = [obstore.get_range(store, job.path, start=job.starts[0], end=job.ends[0])]
        else:
            bufs = obstore.get_ranges(store, job.path, starts=job.starts, ends=job.ends, coalesce=0)
        for i, buf in enumerate(bufs):
            want = job.ends[i] - job.starts[i]
            got = memoryview(buf).nbytes
            if got != want:
                raise ShortReadError(f"the server returned {got} of the {want} bytes asked for (short read)")
        dest = job.dest
        for buf, base, pieces in zip(bufs, job.starts, job.pieces, strict=True):
            src = np.frombuffer(memoryview(buf), dtype=np.uint8)
            for s, ln, off in pieces:
                dest[off : off + ln] = src[s - base : s - base + ln]

    def _describe(self, job: _Job) -> str:
        more = len(job.starts) - 1
        rng = f"bytes {job.starts[0]}-{job.ends[0] - 1}"
        return f"{self.loc.object_url(job.path)} {rng}" + (f" (and {more} more ranges)" if more else "")

    async def _run_job(self, store: Any, job: _Job, attempt: int = 0, t0: float | None = None) -> None:
        """Fetch ``job`` with bounded retries.

        A multi-range call is all-or-nothing, so after a failure its ranges are retried one by one
        (concurrently, within the same slots): one bad connection does not cost a whole group.
        """
        loop = asyncio.get_running_loop()
        policy = self.policy
        t0 = time.monotonic() if t0 is None else t0
        while True:
            attempt += 1
            self.requests += len(job.starts)
            try:
                await loop.run_in_executor(io_executor(), self._run_job_sync, store, job)
                return
            except Exception as exc:
                import obstore.exceptions as oe

                if isinstance(exc, FileNotFoundError | oe.NotFoundError):
                    raise DatasetIntegrityError(
                        f"{self.loc.object_url(job.path)}, named by the manifest, is missing: the "
                        "dataset changed or was deleted after it was opened"
                    ) from None
                delay = policy.delay(attempt)
                elapsed = time.monotonic() - t0
                if not retryable(exc) or attempt > policy.retries or elapsed + delay > policy.retry_timeout:
                    raise remote_read_error(
                        self._describe(job), exc, attempt, elapsed, self.secrets
                    ) from None
            await asyncio.sleep(delay)
            if len(job.starts) > 1:
                singles = [
                    _Job(job.path, [s], [e], [p], job.dest)
                    for s, e, p in zip(job.starts, job.ends, job.pieces, strict=True)
                ]
                await _gather_first_error([self._run_job(store, one, attempt, t0) for one in singles])
                return

    async def run(self, jobs: list[_Job]) -> None:
        """Run ``jobs`` concurrently under the request and byte limits; the first failure wins."""
        if not jobs:
            return
        store = self.store_for_reading()
        limit = self._limits.get()
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        failed: list[BaseException] = []

        async def one(job: _Job, nreq: int, nbytes: int) -> None:
            try:
                await self._run_job(store, job)
            except BaseException as exc:
                failed.append(exc)
                raise
            finally:
                limit.release(nreq, nbytes)

        try:
            for job in jobs:
                if failed:
                    break
                nreq, nbytes = len(job.starts), job.nbytes
                await limit.acquire(nreq, nbytes)
                try:
                    tasks.append(loop.create_task(one(job, nreq, nbytes)))
                except BaseException:
                    limit.release(nreq, nbytes)
                    raise
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def store_for_reading(self) -> Any:
        if self._store is None:
            raise RuntimeError(f"{self.loc.display} is not open; call `await storage.open()` first")
        return self._store


async def _gather_first_error(coros: list[Any]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _open_remote(url: str, options: dict[str, Any]) -> tuple[_Remote, Manifest]:
    remote = _Remote(url, options)
    manifest = remote.read_manifest()
    remote.check_objects(manifest)
    return remote, manifest


# -- storages --------------------------------------------------------------------------------------
class _ObjectStorageMixin:
    _remote: _Remote
    manifest: Manifest
    _opened: bool
    _cache: DatasetCache | None = None
    _cache_broken = False
    _local: LocalStreamStorage | LocalDocumentStorage | None = None

    def _setup_cache(self) -> None:
        root = self._remote.opts.cache_dir
        if root is not None:
            self._cache = DatasetCache(
                root, self._remote.loc.display, self.manifest, self._remote.fetch_range
            )

    def _start_cache(self) -> None:
        if self._cache is not None:
            self._cache.start()

    def _local_copy(self) -> LocalStreamStorage | LocalDocumentStorage | None:
        """The complete local copy (``cache_dir``), opened on first use; None until then, and
        None for good once the copy proves damaged (reads stay remote; nothing is lost)."""
        cache = self._cache
        if self._local is None and cache is not None and self._opened and not self._cache_broken:
            if cache.complete():
                local: LocalStreamStorage | LocalDocumentStorage
                folder = cache.folder
                try:
                    if self.manifest.kind == "stream":
                        local = LocalStreamStorage(folder, self.manifest)
                    else:
                        local = LocalDocumentStorage(folder, self.manifest)
                    local.open_now()  # checks the copy's manifest and every file's size
                except (OSError, DatasetFormatError, DatasetIntegrityError) as exc:
                    self._cache_broken = True
                    warnings.warn(
                        f"guideloom's copy of {self._remote.loc.display} in {folder} is damaged "
                        f"({exc}); reading from the object store instead, nothing is lost. Delete "
                        "the folder to have it copied again.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    return None
                self._local = local
            else:
                cache.warn_if_failed()
        return self._local

    def _close_cache(self) -> None:
        """Let go of the local copy. A copy in progress goes on (a loader opens and closes its
        storage with each epoch outside a ``with`` block); it stops at interpreter exit."""
        self._local = None

    def reads_inline(self) -> bool:
        return self._local_copy() is not None

    @property
    def cache_folder(self) -> str | None:
        """The local copy's folder with ``cache_dir`` (it exists once the copy is complete)."""
        return None if self._cache is None else str(self._cache.folder)

    @property
    def url(self) -> str:
        """The location, without credentials or query string."""
        return self._remote.loc.display

    @property
    def location(self) -> str:
        return self._remote.loc.display

    @property
    def options(self) -> ReadOptions:
        return self._remote.opts

    def stats(self) -> dict[str, int]:
        """Requests issued so far and the peak bytes that were in flight at once."""
        return {"requests": self._remote.requests, "peak_inflight_bytes": self._remote.peak_inflight_bytes()}


class ObjectStreamStorage(_ObjectStorageMixin, ManifestStreamStorage):
    """A stream dataset under an object-store prefix, read with concurrent range requests."""

    def __init__(self, remote: _Remote, manifest: Manifest) -> None:
        check_kind(manifest, "stream", remote.loc.display)
        self._remote = remote
        self.manifest = manifest
        self.max_concurrent_reads = remote.opts.max_concurrent_reads
        self._arrays = {name: _Array.of(spec) for name, spec in manifest.fields.items()}
        self._opened = False
        self._setup_cache()

    async def open(self) -> None:
        if not self._opened:
            self._remote.store()
            await self._remote.reopen(self.manifest)
            self._opened = True
            self._start_cache()

    async def close(self) -> None:
        self._opened = False
        self._close_cache()
        self._remote.drop_store()

    def read_many_sync(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        local = self._local_copy()
        if not isinstance(local, LocalStreamStorage):
            raise RuntimeError(f"{self!r} has no complete local copy to read from (reads_inline() is False)")
        return local.read_many_sync(starts, length)

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        if not self._opened:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        local = self._local_copy()
        if isinstance(local, LocalStreamStorage):
            return await local.read_many(starts, length)
        starts = np.asarray(starts, dtype=np.int64)
        n = len(starts)
        if n and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"{self!r}: read_many windows must lie inside [0, {len(self)})")
        jobs: list[_Job] = []
        outs: dict[str, Array] = {}
        for name, arr in self._arrays.items():
            item = arr.dtype.itemsize
            out = np.empty((n, length), dtype=arr.dtype)
            outs[name] = out
            row = length * item
            self._remote.plan(
                arr,
                starts * item,
                np.full(n, row, dtype=np.int64),
                np.arange(n, dtype=np.int64) * row,
                dest=out.reshape(-1).view(np.uint8),
                jobs=jobs,
            )
        await self._remote.run(jobs)
        tokens = outs.pop("tokens")
        if not outs:
            return Rows(tokens)
        return [{"tokens": tokens[i], **{k: v[i] for k, v in outs.items()}} for i in range(n)]


class ObjectDocumentStorage(_ObjectStorageMixin, ManifestDocumentStorage):
    """A document dataset under an object-store prefix."""

    def __init__(self, remote: _Remote, manifest: Manifest) -> None:
        check_kind(manifest, "documents", remote.loc.display)
        assert manifest.offsets is not None
        self._remote = remote
        self.manifest = manifest
        self.max_concurrent_reads = remote.opts.max_concurrent_reads
        self._tokens = _Array.of(manifest.tokens)
        self._offsets_arr = _Array.of(manifest.offsets)
        self._offsets: I64 | None = None
        self._opened = False
        self._setup_cache()

    async def open(self) -> None:
        if self._opened:
            return
        self._remote.store()
        await self._remote.reopen(self.manifest)
        self._opened = True
        self._start_cache()
        total = int(self._offsets_arr.bounds[-1])
        if total <= self._remote.opts.offsets_cache_bytes:
            try:
                self._offsets = self._check_offsets(await self._read_offsets(None))
            except BaseException:
                self._opened = False
                raise

    async def close(self) -> None:
        self._opened = False
        self._offsets = None
        self._close_cache()
        self._remote.drop_store()

    def _check_offsets(self, offsets: I64) -> I64:
        if offsets[0] != 0 or offsets[-1] != self.manifest.num_elements or np.any(np.diff(offsets) < 0):
            raise DatasetIntegrityError(f"{self.url}: document offsets are out of order or out of range")
        return offsets

    async def _read_offsets(self, positions: I64 | None) -> I64:
        """All offsets (``None``), or the offsets at ``positions``."""
        arr = self._offsets_arr
        if positions is None:
            count = self.manifest.num_documents + 1
            out = np.empty(count, dtype=np.int64)
            jobs: list[_Job] = []
            self._remote.plan(
                arr,
                np.zeros(1, np.int64),
                np.asarray([count * 8], np.int64),
                np.zeros(1, np.int64),
                dest=out.view(np.uint8),
                jobs=jobs,
            )
        else:
            out = np.empty(len(positions), dtype=np.int64)
            jobs = []
            self._remote.plan(
                arr,
                positions * 8,
                np.full(len(positions), 8, np.int64),
                np.arange(len(positions), dtype=np.int64) * 8,
                dest=out.view(np.uint8),
                jobs=jobs,
            )
        await self._remote.run(jobs)
        return out

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        local = self._local_copy()
        if not isinstance(local, LocalDocumentStorage):
            raise RuntimeError(f"{self!r} has no complete local copy to read from (reads_inline() is False)")
        return local.read_many_sync(indices)

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        if not self._opened:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        local = self._local_copy()
        if isinstance(local, LocalDocumentStorage):
            return await local.read_many(indices)
        indices = np.asarray(indices, dtype=np.int64)
        n = len(indices)
        if n and (int(indices.min()) < 0 or int(indices.max()) >= len(self)):
            raise IndexError(f"{self!r}: document indices must lie in [0, {len(self)})")
        if self._offsets is not None:
            starts, stops = self._offsets[indices], self._offsets[indices + 1]
        else:
            both = await self._read_offsets(np.concatenate([indices, indices + 1]))
            starts, stops = both[:n], both[n:]
        lengths = stops - starts
        bad = n and (
            np.any(lengths < 0) or int(starts.min()) < 0 or int(stops.max()) > self.manifest.num_elements
        )
        if bad:
            raise DatasetIntegrityError(f"{self.url}: document offsets are out of order or out of range")
        item = self.dtype.itemsize
        pos = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=pos[1:])
        flat = np.empty(int(pos[-1]), dtype=self.dtype)
        jobs: list[_Job] = []
        self._remote.plan(
            self._tokens, starts * item, lengths * item, pos[:-1] * item, dest=flat.view(np.uint8), jobs=jobs
        )
        await self._remote.run(jobs)
        bounds = pos.tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(n)]


# -- writing ---------------------------------------------------------------------------------------
class _UploadFile:
    """A write-only file that uploads one object (multipart once it outgrows one part)."""

    def __init__(self, sink: ObjectSink, relpath: str) -> None:
        import obstore

        self._sink, self.name = sink, relpath
        self._writer: Any = obstore.open_writer(
            sink.store,
            relpath,
            buffer_size=sink.wopts.part_size,
            max_concurrency=sink.wopts.max_upload_concurrency,
        )
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.closed or self._writer is None:
            raise ValueError("write to a closed upload")
        try:
            return int(self._writer.write(data))
        except Exception as exc:
            raise self._sink.error(exc, f"uploading {self._sink.loc.object_url(self.name)}") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except Exception as exc:
            raise self._sink.error(exc, f"uploading {self._sink.loc.object_url(self.name)}") from None
        finally:
            self._sink.uploads.pop(self.name, None)

    def discard(self) -> None:
        """Drop the upload unfinished: the object never appears."""
        self.closed = True
        self._writer = None

    def __enter__(self) -> _UploadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectSink:
    """Where the writers put an object-store dataset: data objects first, ``manifest.json`` last."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.loc = parse_location(url)
        if self.loc.kind == "http":
            raise ValueError(
                f"{self.loc.display}: http(s) locations are read-only; write the dataset to a local "
                "folder, s3://, gs:// or az:// and serve that"
            )
        _r, self.wopts, config, client = split_options(options, write=True)
        self.secrets = secret_values(config)
        self.store: Any = make_store(self.loc, config, client, self.wopts.policy, obstore_retries=True)
        self.write_id = _secrets.token_hex(4)
        self.uploads: dict[str, _UploadFile] = {}

    def __repr__(self) -> str:
        return f"ObjectSink({self.loc.display!r})"

    def describe(self) -> str:
        return self.loc.display

    def error(self, exc: Exception, what: str) -> Exception:
        return _map_error(exc, what, self.secrets)

    def prepare(self, *, overwrite: bool) -> Manifest | None:
        """Refuse an existing dataset unless ``overwrite``; return the manifest being replaced."""
        import obstore

        try:
            data = bytes(obstore.get(self.store, MANIFEST_NAME).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self.error(exc, f"cannot read {self.loc.object_url(MANIFEST_NAME)}") from None
        if not overwrite:
            raise FileExistsError(
                f"a dataset already exists at {self.loc.display}; pass overwrite=True to replace it"
            )
        try:
            return Manifest.from_json_bytes(data, source=self.loc.display)
        except DatasetFormatError:
            return None

    def open_file(self, relpath: str) -> IO[bytes]:
        f = _UploadFile(self, relpath)
        self.uploads[relpath] = f
        return cast(IO[bytes], f)

    def commit(self, manifest: Manifest, replaced: Manifest | None) -> None:
        """Put the manifest (one atomic PUT), then delete the objects of the dataset it replaced."""
        import obstore

        try:
            obstore.put(self.store, MANIFEST_NAME, manifest.to_json_bytes(), use_multipart=False)
        except Exception as exc:
            raise self.error(exc, f"writing {self.loc.object_url(MANIFEST_NAME)}") from None
        if replaced is not None:
            keep = {f.path for _, _, f in manifest.all_files()}
            stale = [f.path for _, _, f in replaced.all_files() if f.path not in keep]
            self._delete(stale)

    def _delete(self, paths: list[str]) -> None:
        import obstore

        for path in paths:
            try:
                obstore.delete(self.store, path)
            except FileNotFoundError:
                pass
            except Exception:
                pass  # best effort: an unreferenced object is harmless

    def abort(self, written: list[str]) -> None:
        """Discard unfinished uploads and delete the objects of a failed write."""
        for f in list(self.uploads.values()):
            f.discard()
        self.uploads.clear()
        self._delete(list(written))


# -- entry points (called by guideloom._storage.api) -----------------------------------------------
def sink_for(url: str, **options: Any) -> ObjectSink:
    return ObjectSink(url, options)


def open_stream(url: str, **options: Any) -> ObjectStreamStorage:
    remote, manifest = _open_remote(url, options)
    return ObjectStreamStorage(remote, manifest)


def open_documents(url: str, **options: Any) -> ObjectDocumentStorage:
    remote, manifest = _open_remote(url, options)
    return ObjectDocumentStorage(remote, manifest)


def verify_dataset(url: str, *, progress: Callable[[int], object] | None = None, **options: Any) -> Manifest:
    """Download every data object once and check its checksum against the manifest."""
    import obstore

    remote, manifest = _open_remote(url, options)
    store = remote.store()
    try:
        for name, _spec, f in manifest.all_files():
            digest = hashlib.sha256()
            try:
                result = obstore.get(store, f.path)
                for chunk in result.stream(min_chunk_size=8 * 2**20):
                    digest.update(memoryview(chunk))
                    if progress is not None:
                        progress(memoryview(chunk).nbytes)
            except Exception as exc:
                raise _map_error(exc, f"reading {remote.loc.object_url(f.path)}", remote.secrets) from None
            if digest.hexdigest() != f.sha256:
                raise DatasetIntegrityError(
                    f"{remote.loc.display}: object {f.path!r} of field {name!r} does not match its "
                    "checksum; the dataset is damaged: write or copy it again"
                )
    finally:
        remote.drop_store()
    return manifest
