"""The loader's two iterators: ``for batch in loader`` and ``async for batch in loader``.

Both claim the loader, run an epoch planned by the loader's state
(:meth:`~guideloom._loader.state.LoaderState.plan_epoch`), and advance its checkpoint one
handed-out batch at a time; how the epoch runs is the runtime's.

The path from ``__iter__`` to a delivered batch: ``pytorch.py`` (opens the loader, plans the
epoch) -> :class:`SyncIterator` here, handed the plan -> ``_runtime/drive.py``
(:class:`~guideloom._runtime.drive.SyncDriver`: reads the windows the flow asks for) ->
``_runtime/flow.py`` (:class:`~guideloom._runtime.flow.EpochFlow`: groups, the next batch in plan
order) -> ``_runtime/executors.py`` (the group made inline, on ``threadpool.py``'s threads or
through the ``processes/`` pool's session). ``async for``: :class:`AsyncIterator`, which opens the
loader and plans at its first batch, then the same three runtime modules with
:class:`~guideloom._runtime.drive.AsyncDriver`, whose reads are tasks on the caller's loop handed
to the flow as they end. Each runtime module is entered once: a driver calls its flow, the flow
its executor, nothing calls back up (``config.py`` gives the epoch's sizes and ``chooser.py`` the
choices a measuring driver consults, both leaves).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import weakref
from collections.abc import AsyncIterator as AsyncIteratorABC
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from guideloom._core.delivery import Delivery, for_the_consumer
from guideloom._core.plan import EpochPlan, num_batches
from guideloom._loader.figures import PLACES
from guideloom._loader.lifecycle import wait_through_cancellation
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.drive import AsyncDriver, SyncDriver

if TYPE_CHECKING:
    from guideloom._loader.host import Loader
    from guideloom._loader.lifecycle import Lifecycle
    from guideloom._loader.state import LoaderState

__all__ = ["AsyncIterator", "SyncIterator", "open_for_iteration"]

BatchT = TypeVar("BatchT")

#: ``async for`` gives its loop a turn at least this often (seconds): where a batch is ready, the
#: loop's other tasks run first once this much time has passed since the iterator last let them
#: (a wait for a batch lets them too). A turn at every batch costs a pass of the loop, a few
#: microseconds: a tenth of the time of a batch of small samples collated ahead.
TURN_S = 0.001
#: The ``stats()`` counter of batches collated at each place (``collated_<place>``).
_COLLATED = {place: f"collated_{place}" for place in PLACES}


class _IteratorBase(Generic[BatchT]):
    """What every iterator shares: claiming the loader and advancing its state."""

    def __init__(self, loader: Loader[BatchT], state: LoaderState) -> None:
        self._loader = loader  # its public parameters (the geometry a replan takes)
        # The loader's state this iterator changes: its position, its figures, its lifecycle.
        self._state = state
        self._ckpt, self._figures, self._life = state.ckpt, state.figures, state.life
        self._counts = self._figures.counts  # stats()'s figures, counted in place per batch
        self._done = True  # until a subclass has started: __del__ and close() then do nothing
        self._owns_open = False
        self._delivered = 0
        self._run_plan: EpochPlan | None = None
        self._life.active.claim(self)

    def __len__(self) -> int:
        """Batches this iterator still yields: the rest of the epoch from where it stands (after a
        resume, what is left, not the whole epoch), which is what ``tqdm(iter(loader))`` shows."""
        if not hasattr(self, "_cfg"):  # an async iterator plans its epoch at its first batch
            return self._loader.remaining()
        if self._done:
            return 0
        return self._expected_count() - self._delivered

    def _configure(self, cfg: PipelineConfig) -> None:
        """This iterator's epoch; planned once the loader is open (a storage may know its length
        only then)."""
        self._cfg = cfg
        self._begin_run(cfg.plan)

    def _begin_run(self, plan: EpochPlan) -> None:
        """Count the batches of ``plan`` from none: the whole epoch's, or what is left of it
        after a change of geometry or a rollback (a run of the audit's tally each)."""
        self._run_plan, self._delivered = plan, 0
        if self._loader.track_deliveries:  # the audit's run: this iterator's batches, counted
            ref = weakref.ref(self)
            delivered = self._delivered

            def count() -> int:
                it = ref()
                return delivered if it is None else it._delivered

            run = [plan.start_offset, 0, plan.local_batch_size, plan.world_size, plan.rank]
            self._ckpt.tally.begin(run, count, id(self))

    def _expected(self) -> int | None:
        """Batches of this run, ``None`` while its epoch is counted as it goes."""
        plan = self._run_plan
        if plan is None:
            return 0
        return None if plan.observations is None else len(plan)

    def _expected_count(self) -> int:
        """Batches of this run: for an epoch counted as it goes, the rest counted first
        (blocking: the dataset counts its remaining blocks, see ``len(loader)``)."""
        expected = self._expected()
        if expected is None:
            return num_batches(len(self._loader.dataset), *self._geometry())
        return expected

    def _geometry(self) -> tuple[int, bool, int]:
        plan = self._run_plan
        assert plan is not None
        return plan.global_batch_size, plan.drop_last, plan.start_offset

    def _accept(self, d: Delivery, waited: float, place: str) -> BatchT:
        """The bookkeeping of every batch handed out (the wait, and for a batch its position,
        the audit's count and the figures of ``stats()``, written out: it is the hot path); a
        failed batch's error raised."""
        counts = self._counts
        counts["wait_seconds"] += waited
        counts["last_wait_seconds"] = waited
        if d.error is not None:
            error = for_the_consumer(d.error)
            if d.spec.size == 0:
                _note_empty_batch(error, self._cfg)
            raise error
        spec = d.spec
        self._ckpt.offset = spec.offset_after
        self._delivered += 1
        counts["batches"] += 1
        counts["samples"] += spec.stop - spec.start
        counts[_COLLATED[place]] += 1
        value: BatchT = d.value
        return value

    def planned(self) -> bool:
        """Whether this iterator runs a plan of its epoch (an async one plans at its first batch)."""
        return not self._done and hasattr(self, "_cfg") and self._running_driver() is not None

    def replan(self, offset: int) -> None:
        """Go on from global ``offset`` of the epoch with the loader's geometry (rank, world
        size) from the next batch on: what was read ahead or is being made is dropped and the
        epoch re-planned on the same executors (no worker restarts). Called between two batches,
        by the thread (or on the loop) that iterates; an async iterator not started yet plans
        its epoch from the loader when it starts, and needs none."""
        driver = self._running_driver()
        if self._done or driver is None or not hasattr(self, "_cfg"):
            return
        loader, old = self._loader, self._cfg.plan
        plan = dataclasses.replace(
            old,
            local_batch_size=loader.local_batch_size,
            world_size=loader.world_size,
            rank=loader.rank,
            start_offset=offset,
        )
        self._ckpt.tally.end(id(self))
        driver.replan(plan)
        self._cfg = dataclasses.replace(self._cfg, plan=plan)
        self._begin_run(plan)

    def _finish_epoch(self) -> None:
        expected = self._expected()
        if self._delivered != expected:
            raise RuntimeError(
                f"guideloom bug: the pipeline ended after {self._delivered} of "
                f"{expected} batches without an error"
            )
        self._ckpt.next_epoch()

    def spent(self) -> bool:
        """Whether every batch of this iterator's epoch has been handed out, and it still runs."""
        return not self._done and hasattr(self, "_cfg") and self._delivered == self._expected()

    def finish(self) -> None:
        """End a spent iterator as its ``StopIteration`` would: the next epoch begins."""
        self._finish_epoch()
        self.close_sync()

    def _running_driver(self) -> SyncDriver | AsyncDriver | None:
        raise NotImplementedError

    def close_sync(self) -> None:
        raise NotImplementedError

    async def close_async(self) -> None:
        raise NotImplementedError


def _note_empty_batch(error: BaseException, cfg: PipelineConfig) -> None:
    """Say on ``error`` (raised making an empty batch) why the batch was empty and what to do:
    a collate that cannot take ``[]`` otherwise fails with a message about reductions or
    stacking that names no loader argument."""
    plan = cfg.plan
    note = (
        f"guideloom: this batch was empty: collate_fn([]). With drop_last=False and "
        f"world_size={plan.world_size}, a rank whose block lies past the end of the epoch's last, "
        f"incomplete global batch (here rank {plan.rank}) gets an empty sample list, so that every "
        "rank takes the same number of steps. Make collate_fn accept an empty list (return an "
        "empty batch), or pass drop_last=True."
    )
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def open_for_iteration(loader: Loader[Any], life: Lifecycle) -> bool:
    """Before ``for batch in loader`` plans its epoch: a spent iterator ends (its epoch is
    over), and an unopened loader is opened for the new iterator's duration, since how the
    epoch runs depends on whether the storage reads inline, which may be known only once it is
    open (a remote dataset's local copy). Returns whether the iterator owns that opening."""
    life.active.end_spent()
    owns_open = life.state == "closed"
    if owns_open:
        loader.open()
    return owns_open


class SyncIterator(_IteratorBase[BatchT], Iterator[BatchT]):
    """The iterator ``for batch in loader`` uses: ``next()``'s bookkeeping over a driver."""

    _driver: SyncDriver | None = None

    def __init__(
        self, loader: Loader[BatchT], state: LoaderState, cfg: PipelineConfig, owns_open: bool
    ) -> None:
        super().__init__(loader, state)
        self._owns_open = owns_open
        self._configure(cfg)
        self._done = False
        try:
            # collate_mode="workers": nothing is measured, the workers are waited for
            self._driver = driver = SyncDriver(cfg, self._life if loader.collate_mode == "auto" else None)
        except BaseException:
            self.close()
            raise
        self._next = driver.hot  # the hot path: no extra frame
        self._flow = driver.flow  # the same flow from plan to plan (a replan restarts it)

    def __iter__(self) -> SyncIterator[BatchT]:
        return self

    def _running_driver(self) -> SyncDriver | None:
        return self._driver

    def __next__(self, _clock: Callable[[], float] = time.perf_counter) -> BatchT:
        if self._done:
            raise StopIteration
        try:
            t0 = _clock()
            d = self._next()
            waited = _clock() - t0
        except BaseException as exc:
            if isinstance(exc, Exception) and self._done:
                raise StopIteration from None  # close() in another thread ended this next()
            self._close_after_error()
            raise
        if d is None:
            if not self._done:  # the end of the epoch, not a close() in another thread
                try:
                    self._finish_epoch()
                finally:
                    self.close()
            raise StopIteration
        if d.error is not None:
            self._close_after_error()
        return self._accept(d, waited, self._flow.place)

    def _close_after_error(self) -> None:
        """Close, and shut the loader's process workers down too (a failed epoch leaves nothing
        running; the next iterator starts new workers)."""
        try:
            self.close()
        finally:
            pool = self._life.drop_workers()
            if pool is not None:
                pool.close()

    def close(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            if self._driver is not None:
                self._driver.close()
        finally:
            self._ckpt.tally.end(id(self))
            self._life.active.release(self)
            if self._owns_open:
                self._life.close(self._loader.dataset, keep_workers=True)

    close_sync = close

    async def close_async(self) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # At interpreter exit the process's own exit ends the pipeline's daemon threads and the
        # workers (their atexit handler): a close then would wait on modules already torn down.
        if not getattr(self, "_done", True) and not _finalizing():
            self.close()


class AsyncIterator(_IteratorBase[BatchT], AsyncIteratorABC[BatchT]):
    """The iterator ``async for batch in loader`` uses: the pipeline runs on the caller's loop.
    Its epoch is planned at its first batch, once the loader is open, by the loader's state
    (:meth:`~guideloom._loader.state.LoaderState.plan_epoch`)."""

    def __init__(self, loader: Loader[BatchT], state: LoaderState) -> None:
        state.life.active.end_spent()
        super().__init__(loader, state)
        self._driver: AsyncDriver | None = None
        self._done = False
        self._turned = 0.0  # when the loop's other tasks last ran while this iterator waited

    def __aiter__(self) -> AsyncIterator[BatchT]:
        return self

    def _running_driver(self) -> AsyncDriver | None:
        return self._driver

    async def _start(self) -> AsyncDriver:
        loader = self._loader
        # What an earlier iterator, dropped without being closed, left running (its reads and
        # workers) finishes first: it must not touch the workers this one will use.
        await self._life.active.ajoin_left()
        if self._life.state == "closed":
            await loader.aopen()
            self._owns_open = True
        self._configure(self._state.plan_epoch(loader))
        # The caller's loop serves other tasks: collate_fn runs on it only where it is measured
        # cheaper than the hop to a thread and nothing is made ahead (num_workers=0, prefetch=0).
        self._driver = driver = AsyncDriver(
            self._cfg,
            pinned=loader.collate_mode == "workers",
            loop_choice=self._life.loop_choice(loader.collate_fn),
        )
        return driver

    async def __anext__(self) -> BatchT:
        if self._done:
            raise StopAsyncIteration
        try:
            driver = self._driver or await self._start()
            ready = driver.ready()
            t0 = time.perf_counter()
            if ready and t0 - self._turned >= TURN_S:
                # A batch in hand: taking it would not suspend, so give the loop its turn here
                # (a checkpoint, anyio's word), or a consumer that never waits for a batch would
                # starve every other task on the loop.
                await asyncio.sleep(0)
                self._turned = t0 = time.perf_counter()
            d = await driver.next()
            waited = time.perf_counter() - t0
            if not ready:  # it waited for the batch: the loop ran the other tasks meanwhile
                self._turned = t0 + waited
        except BaseException:
            await self._aclose_after_error()
            raise
        if d is None:
            if self._done:  # aclose() in another task ended the epoch while this one waited
                raise StopAsyncIteration
            try:
                self._finish_epoch()
            finally:
                await self.aclose()
            raise StopAsyncIteration
        if d.error is not None:
            await self._aclose_after_error()
        return self._accept(d, waited, driver.place)

    async def _aclose_after_error(self) -> None:
        """As ``SyncIterator._close_after_error``: the process workers are shut down too."""
        try:
            await self.aclose()
        finally:
            pool = self._life.drop_workers()
            if pool is not None:  # joined even if the task is cancelled (again) meanwhile
                closing = asyncio.get_running_loop().run_in_executor(None, pool.close)
                if await wait_through_cancellation(closing):
                    raise asyncio.CancelledError

    async def aclose(self) -> None:
        """Stop the pipeline and release the loader; the position stays at the last batch yielded."""
        if self._done:
            return
        self._done = True
        try:
            # Every stage and worker has stopped before this returns, even when the task that
            # closes is cancelled meanwhile (a cancelled ``async for``): its cancellation is
            # raised once the workers are joined, not before, so nothing outlives the loop.
            cancelled = False
            driver, self._driver = self._driver, None
            if driver is not None:
                reading = driver.stop()
                if reading:
                    cancelled = await wait_through_cancellation(
                        asyncio.gather(*reading, return_exceptions=True)
                    )
                joined = asyncio.get_running_loop().run_in_executor(None, driver.shutdown)
                cancelled = await wait_through_cancellation(joined) or cancelled
                joined.result()
            if cancelled:
                raise asyncio.CancelledError
        finally:
            self._ckpt.tally.end(id(self))
            self._life.active.release(self)
            if self._owns_open:
                await self._life.aclose(self._loader.dataset, keep_workers=True)

    close_async = aclose

    def close_sync(self) -> None:
        if self._done:
            return
        self._done = True
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.stop_threadsafe()
        # Nothing is awaited here (collected, or closed from sync code): closing the loader joins it.
        self._life.active.leave(None, driver)
        self._ckpt.tally.end(id(self))
        self._life.active.release(self)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if not getattr(self, "_done", True) and not _finalizing():
            self.close_sync()
