"""Object-store datasets: ``s3://``, ``gs://``, ``az://`` and (read-only) ``http(s)://``.

The layout is the local one (``manifest.json`` and raw shard files under a prefix), so a dataset
folder copied to a bucket with any tool reads back identically. Opening reads and checks the
manifest and the objects' sizes (``open()`` reads the manifest again and refuses one that
changed, unless ``open_stream`` checked it moments before: no round trip before the first
batch that tells nothing new); reading turns every batched read into byte ranges per object,
coalescing ranges that are adjacent or closer than ``coalesce_gap`` (:mod:`._ranges`), and fetches
them concurrently under a limit of requests and of bytes in flight, with bounded retries
(:mod:`._client`; see :mod:`._objstore` for why every obstore call is a synchronous one on a
Python thread). Writing goes through :class:`guideloom.storage._write._sinks.ObjectSink`.

Options (``open_stream(url, **options)``, ``open_documents``, ``write_stream(url, ...)``):

- store configuration, over the standard environment variables: ``endpoint`` (or
  ``endpoint_url``), ``access_key_id``, ``secret_access_key``, ``session_token``, ``region``,
  ``skip_signature``, ... (any obstore ``S3Config`` / ``GCSConfig`` / ``AzureConfig`` key),
  ``allow_http``, ``allow_invalid_certificates``, ``client_options`` (obstore ``ClientConfig``);
- reading: ``max_inflight_requests`` (256), ``max_inflight_bytes`` (64 MiB), ``coalesce_gap``
  (8 KiB; 0 fetches exactly the ranges asked for), ``max_read_amplification`` (4: a read may
  bridge its smallest gaps while the bridged bytes stay within 3x the bytes asked for),
  ``max_request_bytes`` (4 MiB), ``max_concurrent_reads`` (read-ahead windows the
  loader keeps in flight, 4), ``offsets_cache_bytes`` (documents: offsets up to this size are
  loaded at ``open()``, larger ones are read per batch; 64 MiB), ``cache_dir`` (a local folder:
  the dataset is copied there in the background, read from the copy as its parts come down and
  locally once complete, see :mod:`guideloom.storage._cache._copy`; none by default),
  ``cache_max_bytes`` (a limit on the folder: a dataset larger than it is cached in chunks of
  ``cache_chunk_bytes`` (16 MiB), downloaded ahead in the loader's order and evicted by next
  use, see :mod:`guideloom.storage._cache._chunks`; none: the whole copy);
- faults: ``timeout`` (seconds per request, 30), ``connect_timeout`` (5), ``retries`` (5),
  ``retry_timeout`` (no retry starts after this many seconds, 120), ``backoff`` (0.1),
  ``max_backoff`` (5);
- writing: ``part_size`` (multipart part size, 16 MiB), ``max_upload_concurrency`` (4).

Credentials are never part of a message, a log line or a ``repr``: messages name the location
without user information or query string, and every credential value is masked.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from guideloom._core.order import DEFAULT_WINDOW, REMOTE_BLOCK_BYTES
from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._cache._copy import DatasetCache, copy_footprint
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, add_bases
from guideloom.storage._format._manifested import ManifestDocumentStorage, ManifestStreamStorage, check_kind
from guideloom.storage._local._storage import LocalDocumentStorage, LocalStreamStorage
from guideloom.storage._remote._client import Remote, open_remote
from guideloom.storage._remote._fetch import run_aside
from guideloom.storage._remote._objstore import io_executor
from guideloom.storage._remote._options import ReadOptions
from guideloom.storage._remote._ranges import Layout, plan_spans, plan_windows
from guideloom.storage._write._sinks import ObjectSink
from guideloom.storage.base import Rows

__all__ = [
    "ObjectDocumentStorage",
    "ObjectStreamStorage",
    "open_documents",
    "open_stream",
    "sink_for",
    "verify_dataset",
]

Array = npt.NDArray[Any]
I64 = npt.NDArray[np.int64]


# -- storages --------------------------------------------------------------------------------------
_L = TypeVar("_L", LocalStreamStorage, LocalDocumentStorage)
R = TypeVar("R")


class _ObjectStorageMixin:
    #: ``shuffle_block_size="auto"``: blocks of about 4 MiB (a round trip amortised over MiBs).
    shuffle_block_bytes: int | None = REMOTE_BLOCK_BYTES
    #: Read-ahead windows of up to one "auto" mixing window (64 MiB): a window's samples, sorted,
    #: are whole blocks, or for a global shuffle dense enough to coalesce into large requests.
    read_window_bytes: int = REMOTE_BLOCK_BYTES * DEFAULT_WINDOW
    read_window_batches: int = 4096
    _remote: Remote
    manifest: Manifest
    _opened: bool
    _plain_reads: ClassVar[bool]
    _cache: DatasetCache | None = None
    _chunks: ChunkCache | None = None
    _local: LocalStreamStorage | LocalDocumentStorage | None = None

    def _setup_cache(self) -> None:
        opts = self._remote.opts
        root = opts.cache_dir
        if root is None:
            return
        limit = opts.cache_max_bytes
        if limit is None or limit >= copy_footprint(self.manifest):  # the whole copy fits: no chunks
            loc = self._remote.loc.display
            self._cache = DatasetCache(root, loc, self.manifest, self._remote.fetch_range)
            self._remote.fetcher.local = self._cache  # ranges it has written are read from it
        else:
            self._chunks = ChunkCache(
                root,
                self._remote.loc.display,
                self.manifest,
                self._remote.fetch_range,
                max_bytes=limit,
                chunk_bytes=opts.cache_chunk_bytes,
            )

    def _check_intact(self) -> None:
        """Refuse the read once an object was found not to match the manifest: by a read, by
        the whole copy's checksums or by the chunk cache's (never served from the store)."""
        self._remote.check_intact()
        for cache in (self._cache, self._chunks):
            damaged = None if cache is None else cache.damaged
            if damaged is not None:
                self._remote.mark_damaged(damaged)
                raise DatasetIntegrityError(damaged)

    async def _run(self, jobs: list[Any], key: tuple[int, int, int] | None = None) -> None:
        """Fetch ``jobs``: through the chunk cache when there is one, else from the store.

        Checked before and after: what a cache found damaged while the read was in flight is
        refused, not delivered."""
        self._check_intact()
        if self._chunks is None:
            await self._remote.run(jobs)
            if self._cache is not None:
                self._cache.first_read.set()
        else:
            await self._chunks.run(jobs, key, self._remote.run)
        self._check_intact()

    async def _stop_chunks(self) -> None:
        if self._chunks is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._chunks.stop)

    def _start_cache(self) -> None:
        if self._cache is not None and not self._cache_passive:
            self._cache.start()

    #: A copy in a worker process: it reads the local copy once complete, but the process that
    #: made the storage is the one that downloads it.
    _cache_passive = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled closed, for a process worker that opens its own connection."""
        return {
            **self.__dict__,
            "_cache": None,
            "_chunks": None,  # a worker makes its own: the folder and its limit are shared by lock
            "_local": None,
            "_opened": False,
            "_cache_passive": True,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_cache()

    def _local_copy(self) -> LocalStreamStorage | LocalDocumentStorage | None:
        """The complete local copy (``cache_dir``), opened once every block of it was checked
        in this process; None until then. A copy found damaged is never read: it is removed and
        copied again, with a warning naming what did not match (reads stay remote meanwhile)."""
        cache = self._cache
        if cache is None:
            return None
        if cache.copy_damaged is not None:
            self._rebuild_copy(cache.copy_damaged)
            return None
        if self._local is None and self._opened:
            copied = cache.checked_copy()
            if copied is not None:
                local: LocalStreamStorage | LocalDocumentStorage
                try:
                    if self.manifest.kind == "stream":
                        local = LocalStreamStorage(cache.folder, copied)
                    else:
                        local = LocalDocumentStorage(cache.folder, copied)
                    local.open_sync()  # checks the copy's manifest and every file's size
                except (OSError, DatasetFormatError, DatasetIntegrityError) as exc:
                    self._rebuild_copy(str(exc))
                    return None
                self._local = local
            elif (damaged := cache.copy_damage()) is not None:  # found by the check just made
                self._rebuild_copy(damaged)
            else:
                cache.warn_if_failed()
        return self._local

    def _rebuild_copy(self, why: str) -> None:
        cache = self._cache
        assert cache is not None
        self._local = None
        warnings.warn(
            f"guideloom's copy of {self._remote.loc.display} in {cache.folder} is damaged ({why}); "
            "none of it is read: it is copied again, and read from the object store meanwhile; "
            "nothing is lost",
            RuntimeWarning,
            stacklevel=4,
        )
        cache.rebuild()

    def _close_cache(self) -> None:
        """Let go of the local copy. A copy in progress goes on (a loader opens and closes its
        storage with each epoch outside a ``with`` block); it stops at interpreter exit."""
        self._local = None

    def reads_inline(self) -> bool:
        # Not for a subclass that overrides read_many: its own read is the one to call.
        return self._plain_reads and self._local_copy() is not None

    def _complete_copy(self, kind: type[_L]) -> _L:
        """The complete local copy, for a blocking read (only where ``reads_inline()``)."""
        local = self._local_copy()
        if not isinstance(local, kind):
            raise RuntimeError(f"{self!r} has no complete local copy to read from (reads_inline() is False)")
        return local

    def _open_copy(self) -> LocalStreamStorage | LocalDocumentStorage | None:
        """For an async read: the complete local copy, or None (the store is read)."""
        if not self._opened:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        return self._local_copy()

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

    def read_counts(self) -> tuple[int, int]:
        return self._remote.requests, self._remote.bytes_read

    def add_read_counts(self, requests: int, nbytes: int) -> None:
        self._remote.count_reads(requests, nbytes)

    def stats(self) -> dict[str, int]:
        """Range requests (GETs) issued so far, retries included, the bytes they returned, and
        the peak bytes that were in flight at once (with a ``cache_max_bytes`` cache, also its
        chunks downloaded and evicted and the ranges it served locally and remotely; with the
        whole copy, the ranges it served while in progress and those read remotely meanwhile,
        and the parts it fetched and their bytes, which the GETs and bytes include)."""
        out = {
            "requests": self._remote.requests,
            "bytes_read": self._remote.bytes_read,
            "peak_inflight_bytes": self._remote.peak_inflight_bytes(),
        }
        for cache in (self._chunks, self._cache):
            if cache is not None:
                out.update(cache.stats())
        return out


class ObjectStreamStorage(_ObjectStorageMixin, ManifestStreamStorage):
    """A stream dataset under an object-store prefix, read with concurrent range requests."""

    #: guideloom's own read: a subclass that defines ``read_many`` is read through it.
    _plain_reads: ClassVar[bool] = True

    def __init__(self, remote: Remote, manifest: Manifest) -> None:
        check_kind(manifest, "stream", remote.loc.display)
        self._remote = remote
        self.manifest = manifest
        self.max_concurrent_reads = remote.opts.max_concurrent_reads
        self._arrays = {name: Layout.of(spec) for name, spec in manifest.fields.items()}
        #: the fields whose files carry bases (a merge of prepared parts), added as read
        self._bases = {n: b for n, s in manifest.fields.items() if (b := s.bases()) is not None}
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
        await self._stop_chunks()
        self._remote.drop_store()

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]], length: int) -> None:
        """The loader's upcoming windows, in read order: a chunk cache downloads ahead by them,
        and the whole copy fetches its parts in their order."""
        chunks, arrays = self._chunks, self._arrays
        cache = self._cache
        if cache is not None:
            table = cache.table
            cache.plan(
                table.of_rows(arrays, st, length)
                for st in (np.asarray(w, dtype=np.int64) for w in windows)
                if len(st)
            )
        if chunks is None:
            return

        def planned() -> Any:
            for starts in windows:
                st = np.asarray(starts, dtype=np.int64)
                if len(st):
                    yield (_key(st), *chunks.table.use_of_rows(arrays, st, length))

        chunks.plan(planned())

    def read_many_sync(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        try:
            return self._complete_copy(LocalStreamStorage).read_many_sync(starts, length)
        except DatasetIntegrityError as exc:
            self._rebuild_copy(str(exc))
        return run_aside(self._read_store(starts, length))

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        local = self._open_copy()
        if isinstance(local, LocalStreamStorage):
            try:
                return await local.read_many(starts, length)
            except DatasetIntegrityError as exc:
                self._rebuild_copy(str(exc))
        return await self._read_store(starts, length)

    async def _read_store(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        starts = np.asarray(starts, dtype=np.int64)
        n = len(starts)
        if n and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"{self!r}: read_many windows must lie inside [0, {len(self)})")
        jobs, outs = await _planned(n, plan_windows, self._arrays, starts, length, self._remote.limits)
        await self._run(jobs, _key(starts) if n else None)
        for name, bases in self._bases.items():
            add_bases(outs[name], starts[:, None] + np.arange(length, dtype=np.int64), bases)
        tokens = outs.pop("tokens")
        if not outs:
            return Rows(tokens)
        return [{"tokens": tokens[i], **{k: v[i] for k, v in outs.items()}} for i in range(n)]


class ObjectDocumentStorage(_ObjectStorageMixin, ManifestDocumentStorage):
    """A document dataset under an object-store prefix."""

    _plain_reads: ClassVar[bool] = True

    def __init__(self, remote: Remote, manifest: Manifest) -> None:
        check_kind(manifest, "documents", remote.loc.display)
        assert manifest.offsets is not None
        self._remote = remote
        self.manifest = manifest
        self.max_concurrent_reads = remote.opts.max_concurrent_reads
        self._tokens = Layout.of(manifest.tokens)
        self._offsets_arr = Layout.of(manifest.offsets)
        self._offsets_bases = manifest.offsets.bases()
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
        await self._stop_chunks()
        self._remote.drop_store()

    def _check_offsets(self, offsets: I64) -> I64:
        if offsets[0] != 0 or offsets[-1] != self.manifest.num_elements or np.any(np.diff(offsets) < 0):
            raise DatasetIntegrityError(f"{self.url}: document offsets are out of order or out of range")
        return offsets

    async def _read_offsets(self, positions: I64 | None) -> I64:
        """All offsets (``None``), or the offsets at ``positions``."""
        if positions is None:  # all of them, as one window
            positions, length = np.zeros(1, np.int64), self.manifest.num_documents + 1
        else:
            length = 1
        jobs, outs = plan_windows({"offsets": self._offsets_arr}, positions, length, self._remote.limits)
        out = outs["offsets"].reshape(-1)
        await self._run(jobs)
        where = positions if length == 1 else np.arange(length, dtype=np.int64)
        return add_bases(out, where, self._offsets_bases)

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """The loader's upcoming reads, in order: a chunk cache downloads ahead by them, and the
        whole copy fetches its parts in their order (when the offsets are held in memory,
        ``offsets_cache_bytes``)."""
        chunks, offsets, cache = self._chunks, self._offsets, self._cache
        if offsets is None:
            return
        layout, item = self._tokens, self._tokens.dtype.itemsize
        if cache is not None:

            def parts() -> Any:
                for indices in windows:
                    idx = np.asarray(indices, dtype=np.int64)
                    if len(idx):
                        starts = offsets[idx]
                        yield cache.table.of_spans(layout, starts * item, (offsets[idx + 1] - starts) * item)

            cache.plan(parts())
        if chunks is None:
            return

        def planned() -> Any:
            for indices in windows:
                idx = np.asarray(indices, dtype=np.int64)
                if len(idx):
                    starts = offsets[idx]
                    used = chunks.table.use_of_spans(
                        layout, starts * item, (offsets[idx + 1] - starts) * item
                    )
                    yield (_key(idx), *used)

        chunks.plan(planned())

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        try:
            return self._complete_copy(LocalDocumentStorage).read_many_sync(indices)
        except DatasetIntegrityError as exc:
            self._rebuild_copy(str(exc))
        return run_aside(self._read_store(indices))

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        local = self._open_copy()
        if isinstance(local, LocalDocumentStorage):
            try:
                return await local.read_many(indices)
            except DatasetIntegrityError as exc:
                self._rebuild_copy(str(exc))
        return await self._read_store(indices)

    async def _read_store(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
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
        jobs, flat, bounds = await _planned(n, plan_spans, self._tokens, starts, stops, self._remote.limits)
        await self._run(jobs, _key(indices) if n else None)
        return [flat[bounds[i] : bounds[i + 1]] for i in range(n)]

    def document_offsets_sync(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        try:
            return self._complete_copy(LocalDocumentStorage).document_offsets_sync(positions)
        except DatasetIntegrityError as exc:
            self._rebuild_copy(str(exc))
        return run_aside(self._offsets_from_store(positions))

    async def document_offsets(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        local = self._open_copy()
        if isinstance(local, LocalDocumentStorage):
            try:
                return await local.document_offsets(positions)
            except DatasetIntegrityError as exc:
                self._rebuild_copy(str(exc))
        return await self._offsets_from_store(positions)

    async def _offsets_from_store(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        positions = np.asarray(positions, dtype=np.int64)
        if self._offsets is not None:
            return self._offsets[positions]
        if len(positions) > 1 and np.all(np.diff(positions) == 1):  # a run: one range per object
            return self._check_run(await self._read_offsets_run(int(positions[0]), len(positions)))
        return await self._read_offsets(positions)

    async def _read_offsets_run(self, start: int, length: int) -> I64:
        jobs, outs = plan_windows(
            {"offsets": self._offsets_arr}, np.asarray([start], np.int64), length, self._remote.limits
        )
        await self._run(jobs)  # through the chunk cache, when there is one
        where = np.arange(start, start + length, dtype=np.int64)
        return add_bases(outs["offsets"].reshape(-1), where, self._offsets_bases)

    def _check_run(self, offsets: I64) -> I64:
        if np.any(np.diff(offsets) < 0) or (len(offsets) and int(offsets[-1]) > self.manifest.num_elements):
            raise DatasetIntegrityError(f"{self.url}: document offsets are out of order or out of range")
        return offsets

    def read_spans_sync(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        return self._complete_copy(LocalDocumentStorage).read_spans_sync(starts, stops)

    async def read_spans(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        local = self._open_copy()
        if isinstance(local, LocalDocumentStorage):
            return await local.read_spans(starts, stops)
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        if len(starts) and (int(starts.min()) < 0 or int(stops.max()) > self.manifest.num_elements):
            raise IndexError(f"{self!r}: spans must lie in [0, {self.manifest.num_elements})")
        jobs, flat, bounds = await _planned(
            len(starts), plan_spans, self._tokens, starts, stops, self._remote.limits
        )
        await self._run(jobs)  # through the chunk cache, when there is one
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(starts))]


#: Reads of more samples than this are planned on an I/O thread: planning costs a few
#: microseconds a sample, so a large window planned on the event loop would stall it.
PLAN_INLINE_SAMPLES = 256


async def _planned(n: int, plan: Callable[..., R], *args: Any) -> R:
    """``plan(*args)``: inline for a small read, on an I/O thread for a large one."""
    if n <= PLAN_INLINE_SAMPLES:
        return plan(*args)
    return await asyncio.get_running_loop().run_in_executor(io_executor(), functools.partial(plan, *args))


def _key(starts: npt.NDArray[np.int64]) -> tuple[int, int, int]:
    """What identifies a read among the planned windows."""
    return len(starts), int(starts[0]), int(starts[-1])


# -- entry points (called by guideloom.storage._api) -----------------------------------------------
def sink_for(url: str, **options: Any) -> ObjectSink:
    return ObjectSink(url, options)


def open_stream(url: str, **options: Any) -> ObjectStreamStorage:
    remote, manifest = open_remote(url, options)
    return ObjectStreamStorage(remote, manifest)


def open_documents(url: str, **options: Any) -> ObjectDocumentStorage:
    remote, manifest = open_remote(url, options)
    return ObjectDocumentStorage(remote, manifest)


def verify_dataset(
    url: str,
    *,
    progress: Callable[[int], object] | None = None,
    add_block_digests: bool = False,
    sha256: bool = True,
    **options: Any,
) -> Manifest:
    """Download every data object once and check its checksum and block digests against the
    manifest (with ``sha256=False``, the sha256 only of objects without block digests); with
    ``add_block_digests``, give a dataset without them block digests (their objects first, then
    ``manifest.json``, in one PUT)."""
    from guideloom.storage._format._verify import verify_files, with_blocks

    remote, manifest = open_remote(url, options)
    try:
        computed = verify_files(
            manifest,
            remote.loc.display,
            remote.stream,
            remote.read_object,
            sha256=sha256,
            progress=progress,
        )
        if add_block_digests and not manifest.has_blocks:
            manifest = with_blocks(manifest, computed, remote.put)
            remote.put(MANIFEST_NAME, manifest.to_json_bytes())
    finally:
        remote.drop_store()
    return manifest
