"""Process workers that never cost more than they bring, for a sync ``for``.

A process worker reads and collates a whole group of batches, writes their arrays into shared
memory and describes them in a message; the main process maps the slot and rebuilds the arrays.
For a collate that costs less than that transport (the README's ``np.asarray`` of the rows: tens
of microseconds a batch) two workers on two cores deliver fewer batches a second than the main
process makes alone. So over a storage that reads inline (memory, page-cached local files),
:class:`ProcessChoiceRun` measures, as the thread workers do (:class:`~guideloom._runtime.chooser.Chooser`,
same rules: chunks compared A-B-B-A, the workers kept only at <= 0.9x inline's cycle, the other
mode probed again after a while that grows up to 3 s): it times the consumer's whole cycle with
the batches coming from the workers and with the batch read and collated inline in ``next()``,
and keeps the cheaper. The workers stay up meanwhile (``persistent_workers``), idle.

Either way the batches, their order, the error at the batch that failed and the checkpoint are
the same: only where ``collate_fn`` runs differs. A switch happens between batches: to inline
once the groups already sent have been delivered (from the step after them), back to the
workers once the window read inline is used up (the workers go on from the step after it).
A read inline is not timed as one lump: inline is charged, for each batch, what a batch's read
costs in the workers (they report it with each group; until then, the window's read spread over
its batches). The reads belong to inline's cost, since the workers read their own batches, but
the main process's first reads fault in pages of the dataset that the workers mapped long ago, a
passing cost that would otherwise keep a cheap collate on the workers.

Two things keep the choice cheap for a collate cheaper than its transport. The workers report
what a batch's read and collate cost them; once the main process spends as much CPU time in
``next()`` per batch of the workers' (taking it in, mapping its slot) as the batch took them to
make, making it inline cannot cost more, and inline is chosen at once, without waiting for the
probe's chunks (which a busy machine makes noisy). CPU time, not wall time: waiting for workers
that a loaded machine slows down is not a cost of their transport. And while a choice of inline stands,
``next()`` is the bare read and collate: it looks at the clock once every
:data:`QUIET_CALLS` calls, and times nothing until the choice is due to be probed again.
"""

from __future__ import annotations

import random
import time

from guideloom._core.delivery import Delivery, apply
from guideloom._runtime.chooser import CHUNK_SECONDS, QUIET_CALLS, Chooser
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.inline import InlinePipeline
from guideloom._runtime.processes import SyncRun

__all__ = ["CPU_SAMPLE", "PROCESS_DECISIVE", "ProcessChoiceRun", "process_chooser"]

#: The share of the workers' batches whose taking is timed in CPU time: reading a thread's CPU
#: clock is a system call, at which a loaded machine may switch to another thread (measured: a
#: 13% slower loop when every batch was timed), where the wall clock is read without one.
CPU_SAMPLE = 1 / 16

#: A probe ends after one chunk of each mode once one costs this many times the other. Lower than
#: the threads' :data:`~guideloom._runtime.chooser.DECISIVE`: process workers either clearly pay
#: (a GIL-bound collate: ~1.7x) or clearly cost (a cheap one: ~3x), and each chunk of the worse
#: mode here is dear (a refill of the workers' pipeline, or milliseconds of collate inline).
PROCESS_DECISIVE = 1.4


def process_chooser(capacity: int) -> Chooser:
    """A new chooser between process workers and inline collation for a pipeline of ``capacity``
    batches ahead. The loader's lifecycle keeps it with its persistent workers: what one epoch
    learnt holds for the next, which starts in the mode the last one ended in."""
    limit = capacity + 1
    return Chooser(
        skip=limit, chunk=max(8, 2 * limit), inline_chunk=8, inline_skip=0, decisive=PROCESS_DECISIVE
    )


class ProcessChoiceRun:
    """One epoch of a sync ``for``: batches from ``run``'s process workers or made inline."""

    def __init__(self, cfg: PipelineConfig, run: SyncRun, chooser: Chooser) -> None:
        self._cfg = cfg
        self._run = run
        self._collate = cfg.collate_fn
        self._inline: InlinePipeline | None = None
        self._next_step = run.step  # the plan step after the last batch delivered
        limit = cfg.capacity + 1
        self._chooser = chooser
        self._last: float | None = None  # when the last request came
        self._adjust = 0.0  # added to the cycle being timed: a window's read spread over its batches
        self._read_per_batch = 0.0
        self._settled = False
        self._skip, self._chunk = limit, max(8, 2 * limit)  # for the workers' time in next()
        self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0
        self._quiet = 0  # calls left before the clock is looked at again (inline, held)
        #: Where the last delivery was collated: ``"processes"`` or ``"inline"`` (``stats()``).
        self.place = "processes"

    @property
    def workers(self) -> bool:
        """Whether the batches come from the workers now (for tests and figures)."""
        return self._chooser.workers

    def next(self) -> Delivery | None:
        """The next batch in plan order (or the error in its place); ``None`` at the end."""
        if self._quiet:
            self._quiet -= 1
            inline = self._inline
            assert inline is not None
            self.place = "inline"
            return self._collated(inline, inline.next_raw())  # nothing timed
        now = time.perf_counter()
        chooser = self._chooser
        if self._last is not None:
            chooser.record(now - self._last + self._adjust, self._settled)
        self._last, self._adjust = now, 0.0
        run, inline = self._run, self._inline
        if chooser.workers:
            if inline is not None:
                if inline.buffered():  # the window read inline first: its rows are in hand
                    self._settled = False
                    return self._from_inline(inline)
                self._inline = None
                run.resume(self._next_step)
            elif run.paused:  # back before anything was made inline: the groups go on as sent
                run.resume()
            self._settled = True
            self.place = "processes"
            self._in_calls += 1
            if chooser.measures and self._in_calls > self._skip and random.random() < CPU_SAMPLE:
                c0 = time.thread_time()
                d = run.next()
                self._weigh(time.thread_time() - c0)
            else:
                d = run.next()
        elif run.pending:  # what the workers have been sent comes first
            run.paused = True
            self._settled = False
            self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0
            self.place = "processes"
            d = run.next()
        else:
            run.paused = True
            self._in_calls, self._in_sampled, self._in_total = 0, 0, 0.0
            if inline is None:  # a switch's one-off cost, not timed (as the workers' refill is not)
                t0 = time.perf_counter()
                inline = self._inline = InlinePipeline(self._cfg, first_step=self._next_step)
                self._adjust = t0 - time.perf_counter()
            self._settled = True
            until = chooser.held_until()
            if until is not None and now < until:  # nothing to time before the choice is probed
                self._quiet, self._last = QUIET_CALLS, None
            return self._from_inline(inline)
        if d is not None:
            self._next_step = d.spec.step + 1
        return d

    def _weigh(self, seconds: float) -> None:
        """The workers' mode: ``seconds`` of this thread's CPU time spent taking one of their
        batches (one call in about 1 / :data:`CPU_SAMPLE`, the calls that refill their queue
        after a switch left out). Once that costs as much, per batch, as the workers report a
        batch's read and collate costs them, inline is chosen. CPU time, not the time ``next()``
        took: that includes waiting for the workers, which a loaded machine slows down (and
        would slow the batch made inline down too)."""
        self._in_sampled += 1
        self._in_total += seconds
        if self._in_sampled < self._chunk or self._in_total < CHUNK_SECONDS:
            return
        mean = self._in_total / self._in_sampled
        self._in_sampled, self._in_total = 0, 0.0
        work = self._run.session.work_per_batch
        if work is not None and mean >= work:
            self._chooser.settle(False, (mean, work))

    def _from_inline(self, inline: InlinePipeline) -> Delivery | None:
        self.place = "inline"
        reads = not inline.buffered()
        t0 = time.perf_counter()
        d = inline.next_raw()
        if reads:  # a window read: its cost is spread over its batches
            seconds = time.perf_counter() - t0
            self._read_per_batch = seconds / (inline.buffered() + 1)
            self._adjust -= seconds
        # As the workers measure it, where they have: the main process's first reads fault in
        # pages the workers mapped long ago, which would charge inline for a passing cost.
        worker_read = self._run.session.read_per_batch
        self._adjust += self._read_per_batch if worker_read is None else worker_read
        return self._collated(inline, d)

    def _collated(self, inline: InlinePipeline, d: Delivery | None) -> Delivery | None:
        """``d``, read inline, collated (or the collate's error in its place)."""
        if d is None:
            self._quiet = 0
            return None
        if apply(d, self._collate):
            inline.close()
            self._quiet = 0
        self._next_step = d.spec.step + 1
        return d

    def close(self) -> None:
        """Produce nothing more (the owner closes the workers' run)."""
        if self._inline is not None:
            self._inline.close()
