"""Thread workers for the sync iterator that never cost more than they bring.

Over a storage that reads inline (memory, page-cached local files), ``for batch in loader`` with
``parallel_method="thread"`` needs no event loop: the consumer's thread reads the upcoming
batches (the :class:`~guideloom._runtime.pipeline.InlinePipeline`'s windows) and hands them to the
worker threads in groups, one ``concurrent.futures`` hand-off per group, taking results back in
plan order. No loop thread stands between the two, so a batch crosses threads twice, not four
times, and there is no asyncio future or channel wake-up per batch.

Threads share one GIL: they pay off only when the collate releases it (numpy, torch) or when the
consumer's own step does (a training step of torch ops, during which the workers collate). A
cheap collate costs less than its hand-off, and a GIL-bound one gains nothing from a second
thread. So the pipeline measures instead of guessing: it times the consumer's cycle (from one
``next()`` to the next) with the workers and with the collate run inline in ``next()``, keeps
the cheaper, and probes the other again from time to time (a step that grows, a collate that
slows down; see :class:`~guideloom._runtime.chooser.Chooser`). Either way the batches, their
order, the errors at their batch and the checkpoint are the same: only where ``collate_fn`` runs
differs. In inline mode nothing is prepared ahead, as at ``num_workers=0``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from guideloom._core.delivery import Delivery, Results, apply, apply_group
from guideloom._core.plan import BatchSpec
from guideloom._runtime.chooser import QUIET_CALLS, Chooser
from guideloom._runtime.config import PipelineConfig, group_size, making_steps
from guideloom._runtime.groups import CollateGroups
from guideloom._runtime.inline import InlinePipeline

__all__ = ["ThreadWorkerPipeline", "thread_chooser"]


def thread_chooser(capacity: int) -> Chooser:
    """A new chooser between the worker threads and inline collation for a pipeline of
    ``capacity`` batches ahead (the loader keeps one from epoch to epoch)."""
    limit = capacity + 1
    return Chooser(skip=limit, chunk=max(8, 2 * limit))


class ThreadWorkerPipeline:
    """Read in the caller's thread, collate on ``executor``'s threads or inline, in plan order.

    At most ``prefetch + num_workers`` batches are prepared ahead of the consumer's requests (as
    with the channel's credits); groups of up to :func:`~guideloom._runtime.pipeline.group_size` batches
    go to a worker in one call, and a new group is started only once a whole group's room is
    free, so a consumer taking one batch at a time does not shrink the groups to one batch.
    """

    def __init__(
        self, cfg: PipelineConfig, executor: concurrent.futures.Executor, chooser: Chooser | None = None
    ) -> None:
        self._source = InlinePipeline(cfg)
        self._executor = executor
        self._steps = making_steps(cfg)
        self._limit = cfg.capacity + 1  # batches prepared ahead, plus the one asked for
        self._group = group_size(cfg.capacity, cfg.num_workers)
        self._groups: CollateGroups[concurrent.futures.Future[Results]] = CollateGroups()
        self._ended = False  # the source has nothing more (the end, a failure, close())
        self._last: float | None = None  # when the last request came
        self._read_seconds = 0.0  # spent reading since then
        self._settled = False
        self._chooser = chooser or thread_chooser(cfg.capacity)
        self._quiet = 0  # calls left before the clock is looked at again (inline, held)
        #: Where the last delivery was collated: ``"threads"`` or ``"inline"`` (``stats()``).
        self.place = "threads"
        #: Done once :meth:`close` ran: a ``next()`` waiting for a group in another thread ends.
        self._closing: concurrent.futures.Future[None] = concurrent.futures.Future()

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end, or
        once :meth:`close` ran in another thread."""
        # Timed from one request to the next: the consumer's whole cycle, its own work included,
        # as threads that hold the GIL slow that down too (time inside next() alone misses it).
        # The reads are not counted: both modes read the same windows in this thread, and a
        # window of 64 batches read in one call would weigh on whichever chunk it fell in.
        if self._quiet:  # inline, and the choice stands: the bare read and collate
            self._quiet -= 1
            return self._inline()
        now = time.perf_counter()
        chooser = self._chooser
        if self._last is not None:
            chooser.record(now - self._last - self._read_seconds, self._settled)
        self._last, self._read_seconds = now, 0.0
        if chooser.workers:
            self._fill()
        self._settled = chooser.workers or not self._groups
        if self._groups:
            return self._take()
        until = chooser.held_until()
        if not chooser.workers and until is not None and now < until:
            self._quiet, self._last = QUIET_CALLS, None  # nothing to time until the next probe
        return self._inline()

    def _inline(self) -> Delivery | None:
        self.place = "inline"
        if self._ended:
            self._quiet = 0
            return None
        d = self._read()
        if d is None:
            self._ended = True
            return None
        if apply(d, *self._steps):
            self._end()
        return d

    def _read(self) -> Delivery | None:
        t = time.perf_counter()
        d = self._source.next_raw()
        self._read_seconds += time.perf_counter() - t
        return d

    def _fill(self) -> None:
        """Hand groups to the workers while a whole group's room is free (or nothing is queued)."""
        groups = self._groups
        group: list[Delivery] = []
        while not self._ended and (self._limit - groups.ahead >= self._group or not groups):
            while len(group) < self._group and groups.ahead + len(group) < self._limit:
                d = self._read()
                if d is None:
                    self._ended = True
                    break
                if d.error is not None:  # a read failed: it is delivered after the batches before it
                    groups.start(group, self._submit)
                    groups.add_ready(d)
                    self._end()
                    return
                group.append(d)
            if not group:
                return
            groups.start(group, self._submit)
            group = []

    def _submit(self, specs: list[BatchSpec], batches: list[Any]) -> concurrent.futures.Future[Results]:
        return self._executor.submit(apply_group, self._steps, batches)

    def _take(self) -> Delivery | None:
        """The next delivery of the groups handed out; None once :meth:`close` ran in another
        thread while this one waited (for a collate that may never return)."""
        self.place = "threads"
        groups = self._groups
        fut = groups.head_future()
        if fut is not None:
            if not fut.done():
                either: list[concurrent.futures.Future[Any]] = [fut, self._closing]
                concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
            if self._closing.done():
                return None
            groups.resolve_head(fut.result())
        d = groups.take()
        if d.error is not None:
            self._end()
        return d

    def _end(self) -> None:
        """Nothing after a failure is produced: drop what is queued behind it."""
        self._ended = True
        self._source.close()

    def close(self) -> None:
        """Produce nothing more; queued groups are cancelled (the owner joins the workers), and
        a ``next()`` waiting in another thread returns None at once."""
        if not self._closing.done():
            self._closing.set_result(None)
        self._end()
        for fut in self._groups.futures():
            fut.cancel()
        self._groups.clear()
