"""The batched range-read engine of an object-store dataset: planned jobs, fetched with retries.

:mod:`guideloom.storage._ranges` plans the jobs (pure); :class:`RangeFetcher` runs them:
concurrently, under a limit of requests and bytes in flight (per event loop), each with bounded
retries and backoff, every range a conditional GET of the object the dataset was opened with.
It is apart from the connection (:class:`guideloom.storage._client.Remote`), which owns the
store client and the dataset-level calls (manifest, sizes, checksums), so that the hot path's
limits and retry decisions read on their own; it holds no store, the connection hands it one per
:meth:`run`.

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._objstore import (
    Location,
    ObjectChangedError,
    ObjectVersion,
    PerLoop,
    ReadOptions,
    get_checked,
    io_executor,
    range_executor,
    remote_read_error,
    retryable,
)
from guideloom.storage._ranges import Job, fill

__all__ = ["RangeFetcher", "ReadCounters", "gather_first_error", "integrity_error"]

T = TypeVar("T")


@dataclass(slots=True)
class ReadCounters:
    """What a connection's reads cost: range GETs sent and the bytes they returned.

    Its own object because two paths count into it, the connection's blocking reads and the
    fetcher's batched ones, and ``stats()`` reports their sum.
    """

    requests: int = 0  # range GETs sent, retries included (each is billed)
    bytes_read: int = 0  # bytes those GETs returned


class RangeFetcher:
    """Runs range-read jobs: the in-flight limits, the retries with backoff, the final errors.

    Each range of a job is one conditional GET (:func:`~._objstore.get_checked`) on an I/O
    thread, the ranges of a job concurrently, each with its own retries: obstore's multi-range
    call takes no conditions, merges adjacent ranges into one request, and panics on a body
    shorter than asked for.
    """

    def __init__(
        self,
        loc: Location,
        opts: ReadOptions,
        secrets: Sequence[str],
        counters: ReadCounters,
        versions: Mapping[str, ObjectVersion] | None = None,
    ) -> None:
        self.loc = loc
        self.policy = opts.policy
        self.secrets = secrets
        self.counters = counters
        #: Each data object as the dataset was opened with it (filled by the connection's open).
        self.versions: Mapping[str, ObjectVersion] = {} if versions is None else versions
        self._inflight = PerLoop(opts.max_inflight_requests, opts.max_inflight_bytes)

    def peak_inflight_bytes(self) -> int:
        return self._inflight.peak_bytes()

    def _final_error(
        self, path: str, start: int, end: int, exc: Exception, attempt: int, elapsed: float, delay: float
    ) -> Exception | None:
        """The error a failed attempt ends with, or None when it is to be retried after ``delay``."""
        error = integrity_error(self.loc, path, exc)
        if error is not None:
            return error
        policy = self.policy
        if not retryable(exc) or attempt > policy.retries or elapsed + delay > policy.retry_timeout:
            what = f"{self.loc.object_url(path)} bytes {start}-{end - 1}"
            return remote_read_error(what, exc, attempt, elapsed, self.secrets)
        return None

    async def _get(self, store: Any, path: str, start: int, end: int, t0: float, attempt: int = 0) -> Any:
        """Bytes ``[start, end)`` of ``path``, checked, with bounded retries (``t0``: the job's
        start, from which ``retry_timeout`` counts; ``attempt``: those already made)."""
        loop = asyncio.get_running_loop()
        version = self.versions.get(path)
        while True:
            attempt += 1
            self.counters.requests += 1
            try:
                data = await loop.run_in_executor(
                    io_executor(), get_checked, store, path, start, end, version
                )
                self.counters.bytes_read += end - start
                return data
            except Exception as exc:
                delay = self.policy.delay(attempt)
                error = self._final_error(path, start, end, exc, attempt, time.monotonic() - t0, delay)
            if error is not None:
                raise error  # outside the handler: obstore's error is not its __context__
            await asyncio.sleep(delay)

    def _run_job_sync(self, store: Any, job: Job) -> list[Any]:
        """On an I/O thread: one attempt at each of ``job``'s ranges, concurrently (the first
        here, the others on the range pool); each range's bytes, or the exception it failed with.

        One hand-off to the event loop per job, not per range: that is what keeps a read of many
        small ranges as cheap in CPU as obstore's multi-range call, which takes no conditions."""
        path, version = job.path, self.versions.get(job.path)
        pool = range_executor()
        rest = [
            pool.submit(_attempt, store, path, s, e, version)
            for s, e in zip(job.starts[1:], job.ends[1:], strict=True)
        ]
        out = [_attempt(store, path, job.starts[0], job.ends[0], version)]
        out.extend(f.result() for f in rest)
        return out

    async def _run_job(self, store: Any, job: Job) -> None:
        """Fetch ``job``'s ranges concurrently, then copy their pieces out; the ranges that
        failed go on to :meth:`_get`'s retries, concurrently."""
        t0 = time.monotonic()
        path, n = job.path, len(job.starts)
        if n == 1:
            fill(job, [await self._get(store, path, job.starts[0], job.ends[0], t0)])
            return
        loop = asyncio.get_running_loop()
        self.counters.requests += n
        bufs = await loop.run_in_executor(io_executor(), self._run_job_sync, store, job)
        retry: list[int] = []
        error: Exception | None = None
        for i, got in enumerate(bufs):
            if not isinstance(got, Exception):
                self.counters.bytes_read += job.ends[i] - job.starts[i]
                continue
            delay = self.policy.delay(1)
            error = self._final_error(path, job.starts[i], job.ends[i], got, 1, time.monotonic() - t0, delay)
            if error is not None:
                break
            retry.append(i)
        if error is not None:
            raise error  # outside any handler: obstore's error is not its __context__
        if retry:
            await asyncio.sleep(self.policy.delay(1))
            again = await gather_first_error(
                [self._get(store, path, job.starts[i], job.ends[i], t0, attempt=1) for i in retry]
            )
            for i, buf in zip(retry, again, strict=True):
                bufs[i] = buf
        fill(job, bufs)

    async def run(self, store: Any, jobs: list[Job]) -> None:
        """Run ``jobs`` on ``store`` concurrently under the request and byte limits; the first
        failure wins."""
        if not jobs:
            return
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


def _attempt(store: Any, path: str, start: int, end: int, version: ObjectVersion | None) -> Any:
    """One :func:`get_checked` call: the bytes, or the exception it failed with (returned)."""
    try:
        return get_checked(store, path, start, end, version)
    except Exception as exc:
        return exc


async def gather_first_error(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently and return their results; on the first failure cancel the
    rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def integrity_error(loc: Location, path: str, exc: BaseException) -> DatasetIntegrityError | None:
    """The error a read of ``path`` that failed with ``exc`` ends with when the object is missing
    or is not the one the dataset was opened with (never retried); None for other failures."""
    import obstore.exceptions as oe

    url = loc.object_url(path)
    if isinstance(exc, FileNotFoundError | oe.NotFoundError):
        return DatasetIntegrityError(
            f"{url}, named by the manifest, is missing: the dataset changed or was deleted after it "
            "was opened"
        )
    if isinstance(exc, ObjectChangedError):
        why = str(exc)
    elif isinstance(exc, oe.PreconditionError):
        why = "the store refused the read: the object is no longer the one the dataset was opened with"
    else:
        return None
    return DatasetIntegrityError(
        f"{url}, named by the manifest, changed on the object store after the dataset was opened "
        f"({why}); none of its bytes are read: open the dataset again once it is whole, or write "
        "or copy it again"
    )
