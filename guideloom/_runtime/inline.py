"""No concurrency: the whole pipeline as a plain loop in the caller's thread."""

from __future__ import annotations

from guideloom._core.delivery import Delivery, apply
from guideloom._core.schedule import Indexes, read_window, run_sync, windows
from guideloom._runtime.config import (
    PipelineConfig,
    making_steps,
    max_window_batches,
    reading_name,
    window_bounds,
)

__all__ = ["InlinePipeline"]


class InlinePipeline:
    """The whole pipeline as a plain loop in the caller's thread: one batch per :meth:`next`.

    For ``num_workers=0`` and ``prefetch=0`` over a storage that ``reads_inline``: nothing may be
    prepared ahead of a request, so an event loop would only add its own turns to every batch
    (about as much as a whole batch's work, measured here). The stages are :func:`run_pipeline`'s:
    windowed reads, collate, transfer, and a failure delivered at the batch that failed, after
    which nothing is produced. It keeps no reference to a batch it has returned.
    """

    def __init__(self, cfg: PipelineConfig, first_step: int = 0) -> None:
        self._cfg = cfg
        self._indexes = Indexes(cfg.plan, cfg.order)
        self._windows = windows(cfg.plan, first_step, max_window_batches(cfg), window_bounds(cfg))
        self._read = cfg.dataset.read_many_sync
        self._reading = reading_name(cfg)
        self._steps = making_steps(cfg)
        self._pending: list[Delivery] = []  # the window's uncollated batches, last first

    def buffered(self) -> int:
        """Batches of the current window read and not yet returned."""
        return len(self._pending)

    def next_raw(self) -> Delivery | None:
        """The next batch as read, not collated (or the read's error in its place); ``None`` at the
        end of the epoch. Thread workers collate what this returns."""
        pending = self._pending
        if not pending:
            specs = next(self._windows, None)
            if specs is None:
                return None
            pending.extend(reversed(run_sync(read_window(specs, self._indexes, self._reading), self._read)))
        try:
            return pending.pop()
        except IndexError:  # close() from another thread meanwhile
            return None

    def next(self) -> Delivery | None:
        """The next batch (or the error in its place); ``None`` once the epoch or a failure ended it."""
        d = self.next_raw()
        if d is None:
            return None
        if apply(d, *self._steps):
            self.close()
        return d

    def close(self) -> None:
        """Produce nothing more."""
        self._pending.clear()
        self._windows = iter(())
