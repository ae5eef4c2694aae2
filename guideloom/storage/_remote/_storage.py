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

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, add_bases
from guideloom.storage._format._manifested import ManifestDocumentStorage, ManifestStreamStorage, check_kind
from guideloom.storage._local._storage import LocalDocumentStorage, LocalStreamStorage
from guideloom.storage._remote._client import Remote, open_remote
from guideloom.storage._remote._ranges import Job, Layout, plan_spans, plan_windows
from guideloom.storage._remote._shared import _key, _ObjectStorageMixin
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
        self._let_go()
        await self._stop_chunks()
        self._remote.drop_store()

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]], length: int) -> None:
        """The loader's upcoming windows, in read order: a chunk cache downloads ahead by them,
        and the whole copy fetches its parts in their order. A reading session begins: what the
        last one held for its later reads is let go (:class:`~._held.HeldBlocks`), and its first
        read fetches the ends of the next one's ranges that hold its blocks (:meth:`_read_planned`)."""
        self._remote.fetcher.held.begin()
        windows = self._expect(windows)
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
        return self._copy_or_store_sync(
            LocalStreamStorage,
            lambda c: c.read_many_sync(starts, length),
            lambda: self._read_store(starts, length),
        )

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        return await self._copy_or_store(
            LocalStreamStorage,
            lambda c: c.read_many(starts, length),
            lambda: self._read_store(starts, length),
        )

    async def _read_store(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        starts = np.asarray(starts, dtype=np.int64)
        n = len(starts)
        if n and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"{self!r}: read_many windows must lie inside [0, {len(self)})")
        key = _key(starts) if n else None
        said = self._next_of(starts)
        after = None if said is None else functools.partial(self._jobs_of_next, said, length)
        _, outs = await self._read_planned(
            n, key, plan_windows, self._arrays, starts, length, self._remote.limits, after=after
        )
        for name, bases in self._bases.items():
            add_bases(outs[name], starts[:, None] + np.arange(length, dtype=np.int64), bases)
        tokens = outs.pop("tokens")
        if not outs:
            return Rows(tokens)
        return [{"tokens": tokens[i], **{k: v[i] for k, v in outs.items()}} for i in range(n)]

    def _jobs_of_next(self, said: Callable[[], I64 | None], length: int) -> list[Job]:
        """The jobs of the read said to come next (none: no next read)."""
        starts = said()
        if starts is None or not len(starts):
            return []
        return plan_windows(self._arrays, starts, length, self._remote.limits)[0]


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
        self._let_go()
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
        ``offsets_cache_bytes``). A reading session begins: what the last one held for its later
        reads is let go (:class:`~._held.HeldBlocks`), and its first read fetches the ends of the
        next one's ranges that hold its blocks (:meth:`_read_planned`)."""
        self._remote.fetcher.held.begin()
        chunks, offsets, cache = self._chunks, self._offsets, self._cache
        if offsets is None:
            self._upcoming = None
            return
        windows = self._expect(windows)
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
        return self._copy_or_store_sync(
            LocalDocumentStorage, lambda c: c.read_many_sync(indices), lambda: self._read_store(indices)
        )

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        return await self._copy_or_store(
            LocalDocumentStorage, lambda c: c.read_many(indices), lambda: self._read_store(indices)
        )

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
        key = _key(indices) if n else None
        said = self._next_of(indices)
        after = None if said is None else functools.partial(self._jobs_of_next, said)
        _, flat, bounds = await self._read_planned(
            n, key, plan_spans, self._tokens, starts, stops, self._remote.limits, after=after
        )
        return [flat[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _jobs_of_next(self, said: Callable[[], I64 | None]) -> list[Job]:
        """The jobs of the read said to come next (none: no next read, or offsets not held)."""
        indices, offsets = said(), self._offsets
        if indices is None or not len(indices) or offsets is None:
            return []
        return plan_spans(self._tokens, offsets[indices], offsets[indices + 1], self._remote.limits)[0]

    def document_offsets_sync(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return self._copy_or_store_sync(
            LocalDocumentStorage,
            lambda c: c.document_offsets_sync(positions),
            lambda: self._offsets_from_store(positions),
        )

    async def document_offsets(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return await self._copy_or_store(
            LocalDocumentStorage,
            lambda c: c.document_offsets(positions),
            lambda: self._offsets_from_store(positions),
        )

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
        return self._copy_or_store_sync(
            LocalDocumentStorage,
            lambda c: c.read_spans_sync(starts, stops),
            lambda: self._spans_from_store(starts, stops),
        )

    async def read_spans(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        return await self._copy_or_store(
            LocalDocumentStorage,
            lambda c: c.read_spans(starts, stops),
            lambda: self._spans_from_store(starts, stops),
        )

    async def _spans_from_store(
        self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]
    ) -> Sequence[Any]:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        if len(starts) and (int(starts.min()) < 0 or int(stops.max()) > self.manifest.num_elements):
            raise IndexError(f"{self!r}: spans must lie in [0, {self.manifest.num_elements})")
        # through the chunk cache, when there is one
        _, flat, bounds = await self._read_planned(
            len(starts), None, plan_spans, self._tokens, starts, stops, self._remote.limits
        )
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(starts))]


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
