"""Thread workers for the sync iterator that never cost more than they bring (issue 11 item 2).

Over a storage that reads inline (memory, page-cached local files), ``for batch in loader`` with
``parallel_method="thread"`` needs no event loop: the consumer's thread reads the upcoming
batches (the :class:`~guideloom._pipeline.InlinePipeline`'s windows) and hands them to the
worker threads in groups, one ``concurrent.futures`` hand-off per group, taking results back in
plan order. No loop thread stands between the two, so a batch crosses threads twice, not four
times, and there is no asyncio future or channel wake-up per batch.

Threads share one GIL: they pay off only when the collate releases it (numpy, torch) or when the
consumer's own step does (a training step of torch ops, during which the workers collate). A
cheap collate costs less than its hand-off, and a GIL-bound one gains nothing from a second
thread. So the pipeline measures instead of guessing: it times what each ``next()`` costs the
consumer with the workers and with the collate run inline in ``next()``, a probe of each in
turn, keeps the cheaper, and probes the other again every :data:`REPROBE_SECONDS` (a step that
grows, a collate that slows down). Either way the batches, their order, the errors at their
batch and the checkpoint are the same: only where ``collate_fn`` runs differs. In inline mode
nothing is prepared ahead, as at ``num_workers=0``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._pipeline import COLLATE_ERRORS, Delivery, InlinePipeline, PipelineConfig, group_size, move_to_device

if TYPE_CHECKING:
    import torch

__all__ = ["REPROBE_SECONDS", "ThreadWorkerPipeline"]

#: How long a choice between workers and inline collation stands before the other is probed again.
REPROBE_SECONDS = 2.0

Results = list[tuple[Any, BaseException | None]]


def _collate_group(
    collate_fn: Callable[[Sequence[Any]], Any],
    device: torch.device | None,
    pin_memory: bool,
    batches: list[Any],
) -> Results:
    """A worker's call: collate (and move) consecutive batches; stops at the first failure,
    which is returned in place of its batch."""
    out: Results = []
    for b in batches:
        try:
            value = collate_fn(b)
            if device is not None:
                value = move_to_device(value, device, pin_memory)
            out.append((value, None))
        except COLLATE_ERRORS as exc:
            out.append((None, exc))
            break
    return out


class _Chooser:
    """Which mode ``next()`` runs in: a probe of each mode, then the cheaper for a while.

    A probe skips the batches that fill (or drain) the workers' queue, then averages the time
    of ``probe`` calls.
    """

    def __init__(self, skip: int, probe: int) -> None:
        self._skip, self._probe = skip, probe
        self.workers = True  # the first probe: workers, as asked for
        self._cost: dict[bool, float] = {}
        self._probing = True
        self._n = -skip
        self._total = 0.0
        self._until = 0.0

    def record(self, seconds: float, settled: bool) -> None:
        """One ``next()`` of ``seconds`` in the current mode; ``settled``: the queue holds only
        this mode's work (an inline probe waits for the workers' queue to drain first)."""
        if not settled:
            return
        self._n += 1
        if self._n <= 0:
            return
        self._total += seconds
        if self._probing and self._n >= self._probe:
            self._cost[self.workers] = self._total / self._n
            if len(self._cost) < 2:  # the other mode has not been measured yet
                self._switch(not self.workers, probing=True)
                return
            self._switch(min(self._cost, key=lambda m: (self._cost[m], not m)), probing=False)
            self._until = time.perf_counter() + REPROBE_SECONDS
        elif not self._probing and self._n >= self._probe and time.perf_counter() >= self._until:
            self._cost[self.workers] = self._total / self._n  # the chosen mode's cost of late
            del self._cost[not self.workers]
            self._switch(not self.workers, probing=True)

    def _switch(self, workers: bool, *, probing: bool) -> None:
        self.workers, self._probing = workers, probing
        self._n, self._total = -self._skip, 0.0


class ThreadWorkerPipeline:
    """Read in the caller's thread, collate on ``executor``'s threads or inline, in plan order.

    At most ``prefetch + num_workers`` batches are prepared ahead of the consumer's requests (as
    with the channel's credits); groups of up to :func:`~guideloom._pipeline.group_size` batches
    go to a worker in one call, and a new group is started only once a whole group's room is
    free, so a consumer taking one batch at a time does not shrink the groups to one batch.
    """

    def __init__(
        self, cfg: PipelineConfig, executor: concurrent.futures.Executor, chooser: _Chooser | None = None
    ) -> None:
        self._source = InlinePipeline(cfg)
        self._executor = executor
        self._collate = cfg.collate_fn
        self._device = cfg.device if cfg.device.type != "cpu" else None
        self._pin = cfg.pin_memory
        self._limit = cfg.capacity + 1  # batches prepared ahead, plus the one asked for
        self._group = group_size(cfg.capacity, cfg.num_workers)
        # Groups in plan order, each its batches (first last, popped as delivered) and the
        # worker's future (None once its results are in the batches).
        self._queue: deque[tuple[list[Delivery], concurrent.futures.Future[Results] | None]] = deque()
        self._ahead = 0  # batches in the queue
        self._ended = False  # the source has nothing more (the end, a failure, close())
        self._chooser = chooser or _Chooser(skip=self._limit, probe=max(32, 2 * self._limit))

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end."""
        t0 = time.perf_counter()
        chooser = self._chooser
        if chooser.workers:
            self._fill()
        settled = chooser.workers or not self._queue
        d = self._take() if self._queue else self._inline()
        chooser.record(time.perf_counter() - t0, settled)
        return d

    def _inline(self) -> Delivery | None:
        if self._ended:
            return None
        d = self._source.next_raw()
        if d is None:
            self._ended = True
            return None
        if d.error is None:
            d.value, d.error = _collate_group(self._collate, self._device, self._pin, [d.value])[0]
        if d.error is not None:
            self._end()
        return d

    def _fill(self) -> None:
        """Hand groups to the workers while a whole group's room is free (or nothing is queued)."""
        group: list[Delivery] = []
        while not self._ended and (self._limit - self._ahead >= self._group or not self._queue):
            while len(group) < self._group and self._ahead + len(group) < self._limit:
                d = self._source.next_raw()
                if d is None:
                    self._ended = True
                    break
                if d.error is not None:  # a read failed: it is delivered after the batches before it
                    self._submit(group)
                    self._queue.append(([d], None))
                    self._ahead += 1
                    self._end()
                    return
                group.append(d)
            if not group:
                return
            self._submit(group)

    def _submit(self, group: list[Delivery]) -> None:
        if not group:
            return
        batches = [d.value for d in group]
        for d in group:
            d.value = None  # the worker holds the raw batch; delivered values replace it
        fut = self._executor.submit(_collate_group, self._collate, self._device, self._pin, batches)
        group.reverse()
        self._queue.append((list(group), fut))
        self._ahead += len(group)
        group.clear()

    def _take(self) -> Delivery:
        ds, fut = self._queue[0]
        if fut is not None:
            results = fut.result()
            results.reverse()
            dropped = len(ds) - len(results)
            if dropped:  # the group stopped at a failure: nothing after it (first last in ds)
                del ds[:dropped]
                self._ahead -= dropped
            for d in reversed(ds):
                d.value, d.error = results.pop()
            self._queue[0] = (ds, None)
        d = ds.pop()
        self._ahead -= 1
        if not ds:
            self._queue.popleft()
        if d.error is not None:
            self._end()
        return d

    def _end(self) -> None:
        """Nothing after a failure is produced: drop what is queued behind it."""
        self._ended = True
        self._source.close()

    def close(self) -> None:
        """Produce nothing more; queued groups are cancelled (the owner joins the workers)."""
        self._end()
        while self._queue:
            _, fut = self._queue.popleft()
            if fut is not None:
                fut.cancel()
        self._ahead = 0
