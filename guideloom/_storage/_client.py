"""One object-store dataset's connection: its store client, limits, retries and range fetches.

:class:`Remote` reads the manifest and checks the objects' sizes when a dataset is opened, and
runs the jobs that :mod:`guideloom._storage._ranges` plans: concurrently, under a limit of
requests and bytes in flight (per event loop), each with bounded retries and backoff. Every
obstore call is a synchronous one on an I/O thread (see :mod:`guideloom._storage._objstore`).

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import hashlib
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._errors import DatasetIntegrityError
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
    map_error,
    parse_location,
    remote_read_error,
    retryable,
    secret_values,
    split_options,
)
from ._ranges import Job, Limits, fill
from .manifest import MANIFEST_NAME, Manifest

__all__ = ["Remote", "gather_first_error", "open_remote"]

_OPEN: weakref.WeakSet[Remote] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Drop every store guideloom still holds, so nothing of obstore outlives the interpreter."""
    for remote in list(_OPEN):
        remote.drop_store()
    gc.collect()


class Remote:
    """A dataset location's store client, its read limits and the range-fetch engine."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.loc: Location = parse_location(url)
        self.opts: ReadOptions
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
        self._inflight = PerLoop(self.opts.max_inflight_requests, self.opts.max_inflight_bytes)
        self.requests = 0  # range GETs sent, retries included (each is billed)
        self.bytes_read = 0  # bytes those GETs returned
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

    def store_for_reading(self) -> Any:
        if self._store is None:
            raise RuntimeError(f"{self.loc.display} is not open; call `await storage.open()` first")
        return self._store

    def peak_inflight_bytes(self) -> int:
        return self._inflight.peak_bytes()

    # -- blocking calls (the caller's thread, the I/O pool or the cache's threads) ----------------
    def fetch_range(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of object ``path``: a blocking call with retries (the cache's)."""
        import obstore

        store = self.store()  # a copy goes on after close(): it keeps a client of its own

        def get() -> Any:
            self.requests += 1
            return obstore.get_range(store, path, start=start, end=end)

        try:
            data = call_with_retries(get, self.policy)
            self.bytes_read += end - start
            return data
        except Exception as exc:
            error = map_error(exc, f"reading {self.loc.object_url(path)}", self.secrets)
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
                error = map_error(exc, f"cannot inspect {self.loc.object_url(path)}", self.secrets)
            else:
                return path, int(meta["size"])
            raise error

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

    async def reopen(self, manifest: Manifest) -> None:
        """``open()``: a client, and the manifest read again and compared (off the event loop)."""
        loop = asyncio.get_running_loop()
        current = await loop.run_in_executor(io_executor(), self.read_manifest)
        if current != manifest:
            raise DatasetIntegrityError(
                f"{self.loc.display}: the manifest changed since the dataset was opened; open it again"
            )

    # -- batched range reads ---------------------------------------------------------------------
    def _run_job_sync(self, store: Any, job: Job) -> None:
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
        fill(job, bufs)

    def _describe(self, job: Job) -> str:
        more = len(job.starts) - 1
        rng = f"bytes {job.starts[0]}-{job.ends[0] - 1}"
        return f"{self.loc.object_url(job.path)} {rng}" + (f" (and {more} more ranges)" if more else "")

    def _final_error(
        self, job: Job, exc: Exception, attempt: int, elapsed: float, delay: float
    ) -> Exception | None:
        """The error a failed attempt ends with, or None when it is to be retried after ``delay``."""
        import obstore.exceptions as oe

        if isinstance(exc, FileNotFoundError | oe.NotFoundError):
            return DatasetIntegrityError(
                f"{self.loc.object_url(job.path)}, named by the manifest, is missing: the "
                "dataset changed or was deleted after it was opened"
            )
        policy = self.policy
        if not retryable(exc) or attempt > policy.retries or elapsed + delay > policy.retry_timeout:
            return remote_read_error(self._describe(job), exc, attempt, elapsed, self.secrets)
        return None

    async def _run_job(self, store: Any, job: Job, attempt: int = 0, t0: float | None = None) -> None:
        """Fetch ``job`` with bounded retries.

        A multi-range call is all-or-nothing, so after a failure its ranges are retried one by one
        (concurrently, within the same slots): one bad connection does not cost a whole group.
        """
        loop = asyncio.get_running_loop()
        t0 = time.monotonic() if t0 is None else t0
        while True:
            attempt += 1
            self.requests += len(job.starts)
            try:
                await loop.run_in_executor(io_executor(), self._run_job_sync, store, job)
                self.bytes_read += job.nbytes
                return
            except Exception as exc:
                delay = self.policy.delay(attempt)
                error = self._final_error(job, exc, attempt, time.monotonic() - t0, delay)
            if error is not None:
                raise error  # outside the handler: obstore's error is not its __context__
            await asyncio.sleep(delay)
            if len(job.starts) > 1:
                await gather_first_error([self._run_job(store, one, attempt, t0) for one in job.singles()])
                return

    async def run(self, jobs: list[Job]) -> None:
        """Run ``jobs`` concurrently under the request and byte limits; the first failure wins."""
        if not jobs:
            return
        store = self.store_for_reading()
        limit = self._inflight.get()
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        failed: list[BaseException] = []

        async def one(job: Job, nreq: int, nbytes: int) -> None:
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


async def gather_first_error(coros: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def open_remote(url: str, options: dict[str, Any]) -> tuple[Remote, Manifest]:
    """A connection to ``url`` and its manifest, checked against the objects' sizes."""
    remote = Remote(url, options)
    manifest = remote.read_manifest()
    remote.check_objects(manifest)
    return remote, manifest
