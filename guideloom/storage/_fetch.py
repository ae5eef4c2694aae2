"""The batched range-read engine of an object-store dataset: planned jobs, fetched with retries.

:mod:`guideloom.storage._ranges` plans the jobs (pure); :class:`RangeFetcher` runs them:
concurrently, under a limit of requests and bytes in flight (per event loop), each with bounded
retries and backoff, a failed multi-range call retried range by range. It is apart from the
connection (:class:`guideloom.storage._client.Remote`), which owns the store client and the
dataset-level calls (manifest, sizes, checksums), so that the hot path's limits and retry
decisions read on their own; it holds no store, the connection hands it one per :meth:`run`.

Errors carry scrubbed messages only, and are raised outside the ``except`` block that caught
obstore's error, so no link of their ``__context__`` chain holds a credential.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._objstore import (
    Location,
    PerLoop,
    ReadOptions,
    ShortReadError,
    io_executor,
    remote_read_error,
    retryable,
)
from guideloom.storage._ranges import Job, fill

__all__ = ["RangeFetcher", "ReadCounters", "gather_first_error"]


@dataclass(slots=True)
class ReadCounters:
    """What a connection's reads cost: range GETs sent and the bytes they returned.

    Its own object because two paths count into it, the connection's blocking reads and the
    fetcher's batched ones, and ``stats()`` reports their sum.
    """

    requests: int = 0  # range GETs sent, retries included (each is billed)
    bytes_read: int = 0  # bytes those GETs returned


class RangeFetcher:
    """Runs range-read jobs: the in-flight limits, the retries with backoff, the final errors."""

    def __init__(
        self, loc: Location, opts: ReadOptions, secrets: Sequence[str], counters: ReadCounters
    ) -> None:
        self.loc = loc
        self.policy = opts.policy
        self.secrets = secrets
        self.counters = counters
        self._inflight = PerLoop(opts.max_inflight_requests, opts.max_inflight_bytes)

    def peak_inflight_bytes(self) -> int:
        return self._inflight.peak_bytes()

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
            self.counters.requests += len(job.starts)
            try:
                await loop.run_in_executor(io_executor(), self._run_job_sync, store, job)
                self.counters.bytes_read += job.nbytes
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
