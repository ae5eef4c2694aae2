"""``async for`` shares the caller's event loop fairly: it gives the loop a turn
once per batch even when batches are buffered, runs ``collate_fn`` on the loop only where it is
measured cheaper than the hop to a thread and nothing is made ahead, and a cancelled consumer
task joins every guideloom thread and worker process before its cancellation propagates."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom._loader.iterators import TURN_S
from guideloom._runtime.chooser import LOOP_CHEAP_CALLS, LOOP_COLLATE_S
from tests.support.data import IdsOf, IdsWhere, identity_stream, slow_ids
from tests.support.loader import guideloom_threads

pytestmark = pytest.mark.usefixtures("no_thread_leak")

TICK = 0.05  # the heartbeat's period, seconds
LATE = 0.030  # the most a heartbeat may be late


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """The README's collate."""
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


@dataclass
class Beats:
    """How late each tick of :func:`heartbeat` ran: in wall time, and in the event loop's own
    time (what the loop's thread ran, on the CPU, between the tick's due time and the tick)."""

    wall: list[float] = field(default_factory=list)
    loop: list[float] = field(default_factory=list)


@contextlib.asynccontextmanager
async def heartbeat() -> AsyncIterator[Beats]:
    """A ticker on the running loop that means to run every ``TICK`` seconds (tick ``k`` is due
    at ``start + k * TICK``, so one late tick does not shift the later ones).

    Lateness is measured against that schedule in the loop thread's CPU time: a watchdog thread
    reads the loop thread's CPU clock at each due time, and the tick reads it again when it
    runs. The difference is what the loop ran instead of the tick, which is what starving the
    loop means; a loop thread that the OS did not run (this 2-core machine is shared) adds wall
    time but no CPU time, so the check holds on a busy machine and still fails when
    ``async for`` or a collate keeps the loop busy.
    """
    # A full collection of the test session's heap (pytest's, torch's, hypothesis's objects) can
    # fall due in the loop thread during the ticks and hold it for tens of milliseconds (most
    # likely what made CI's first tick once 42 ms late, when no later one was over 7 ms). That
    # is the interpreter's, not the loader's: the heap as it stands is collected and set aside
    # (gc.freeze) first.
    gc.collect()
    gc.freeze()
    beats = Beats()
    stop = threading.Event()
    clock = time.pthread_getcpuclockid(threading.get_ident())
    start = time.perf_counter() + TICK
    at_due: dict[int, float] = {}

    def watchdog() -> None:
        k = 0
        while not stop.is_set():
            stop.wait(max(0.0, start + k * TICK - time.perf_counter()))
            at_due[k] = time.clock_gettime(clock)
            k += 1

    async def ticker() -> None:
        k = 0
        while not stop.is_set():
            due = start + k * TICK
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            cpu, now = time.thread_time(), time.perf_counter()
            beats.wall.append(now - due)
            if k in at_due:  # else the watchdog itself ran late, after the tick: on time
                beats.loop.append(max(0.0, cpu - at_due[k]))
            k += 1
            while start + k * TICK <= now:  # ticks missed altogether count once, above
                k += 1

    dog = threading.Thread(target=watchdog, name="heartbeat-watchdog", daemon=True)
    dog.start()
    task = asyncio.create_task(ticker())
    try:
        yield beats
    finally:
        stop.set()
        await task
        dog.join()
        gc.unfreeze()


@dataclass
class Turns:
    """How many turns another task of the loop got."""

    count: int = 0


@contextlib.asynccontextmanager
async def counting_turns() -> AsyncIterator[Turns]:
    """A task on the running loop that counts its turns (one per ``asyncio.sleep(0)``) while the
    block runs: how often the block let the loop's other tasks run."""
    turns = Turns()
    stop = False

    async def other() -> None:
        while not stop:
            turns.count += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    start = turns.count
    try:
        yield turns
    finally:
        stop = True
        await task
        turns.count -= start


def busy(seconds: float) -> None:
    """``seconds`` of this thread's CPU time: synchronous work, as a training step's Python."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def stream(n_batches: int, batch: int = 16, length: int = 512) -> gl.MemoryStreamStorage:
    return gl.MemoryStreamStorage(np.arange(n_batches * batch * length, dtype=np.uint16) % 50_000)


@pytest.mark.asyncio
@pytest.mark.slow
async def test_heartbeat_on_time_with_prefetch_and_an_inline_step() -> None:
    """500 batches, prefetch=8, and a consumer that does 3 ms of blocking work after each batch:
    the batches are always buffered, yet the ticker gets its turn."""
    loader = gl.StatefulDataLoader.from_storage(
        stream(500), collate, sequence_length=512, local_batch_size=16, prefetch=8, device=torch.device("cpu")
    )
    n = 0
    async with heartbeat() as beats, loader:
        async for batch in loader:
            assert batch.shape == (16, 512)
            busy(0.003)  # the training step, blocking the loop
            n += 1
    assert n == 500
    assert len(beats.wall) >= 25  # 500 steps of >= 3 ms: at least 1.5 s of ticks
    assert max(beats.loop) < LATE, (sorted(beats.loop)[-5:], sorted(beats.wall)[-5:])


def slow_collate(samples: Sequence[np.ndarray]) -> list[int]:
    """150 ms of pure Python (it holds the GIL but for the interpreter's switch interval)."""
    busy(0.15)
    return [int(s[0]) for s in samples]


@pytest.mark.asyncio
@pytest.mark.slow
async def test_heartbeat_on_time_with_a_slow_collate_and_no_workers() -> None:
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(12), slow_collate, sequence_length=4, local_batch_size=1, device=torch.device("cpu")
    )
    got = []
    async with heartbeat() as beats, loader:
        async for b in loader:
            got.append(b[0] // 4)
    assert got == list(range(12))
    assert len(beats.wall) >= 25  # 12 collates of 150 ms: 1.8 s of ticks
    assert max(beats.loop) < LATE, (sorted(beats.loop)[-5:], sorted(beats.wall)[-5:])


@pytest.mark.asyncio
@pytest.mark.parametrize(("prefetch", "num_workers"), [(3, 0), (0, 2), (3, 2)])
async def test_collate_never_runs_on_the_callers_loop_where_batches_are_made_ahead(
    prefetch: int, num_workers: int
) -> None:
    where = IdsWhere(4)
    names = where.names

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(20), where, sequence_length=4, local_batch_size=2, prefetch=prefetch,
        num_workers=num_workers, device=torch.device("cpu"),
    )  # fmt: skip
    async with loader:
        got = [b async for b in loader]
    assert [i for b in got for i in b] == list(range(20))
    assert names and all(n.startswith("guideloom-collate") for n in names), set(names)


@pytest.mark.asyncio
async def test_at_prefetch_0_a_cheap_collate_moves_to_the_loop_and_a_slow_one_back() -> None:
    """Nothing is made ahead at ``prefetch=0``: a collate measured cheaper than the hop to its
    thread (``LOOP_CHEAP_CALLS`` calls in a row) runs on the loop; one that then takes longer
    goes back to the thread, and earns the loop again with twice as many cheap calls."""
    names: list[str] = []
    slow = {10, 11, 12}

    def where(samples: Sequence[np.ndarray]) -> list[int]:
        names.append(threading.current_thread().name)
        batch = [int(s[0]) // 4 for s in samples]
        if batch[0] // 2 in slow:
            time.sleep(2 * LOOP_COLLATE_S)  # a wait: slow on the wall clock, not on the CPU
        return batch

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), where, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    async with loader:
        got = [b async for b in loader]
        collated = loader.stats()
    assert [i for b in got for i in b] == list(range(400))
    loop = threading.current_thread().name
    on_loop = [n == loop for n in names]
    n = LOOP_CHEAP_CALLS
    # (a cheap call that a loaded machine kept from a core for a millisecond counts as slow: only
    # what holds however the machine is loaded is asserted)
    assert not any(on_loop[:n]) and any(on_loop[n:10])  # measured on the thread, then the loop
    assert sum(on_loop[10:13]) <= 1  # a slow one held the loop once at most
    # back on the thread: 2 * n cheap calls in a row after the last slow one earn the loop again
    assert not any(on_loop[13 : 13 + 2 * n]), on_loop
    assert sum(on_loop[13 + 2 * n :]) > len(on_loop[13 + 2 * n :]) // 2, on_loop
    assert collated["collated_inline"] == sum(on_loop)
    assert collated["collated_threads"] == len(names) - sum(on_loop)


@pytest.mark.asyncio
async def test_a_collate_on_the_loop_finds_no_running_loop_as_on_its_thread() -> None:
    """Where a collate runs is measured, not asked for: on the loop it finds what it finds on its
    thread, no running loop, so one that runs a loop of its own works at every batch."""
    seen: list[bool] = []

    async def doubled(ids: list[int]) -> list[int]:
        return [2 * i for i in ids]

    def own_loop(samples: Sequence[np.ndarray]) -> list[int]:
        ids = [int(s[0]) // 4 for s in samples]
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        if ids[0] % 16 != 8:
            return ids
        loop = asyncio.new_event_loop()  # "another loop is running" where the caller's is found
        try:
            return loop.run_until_complete(doubled(ids))
        finally:
            loop.close()

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(200), own_loop, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    async with loader:
        got = [b async for b in loader]
        assert loader.stats()["collated_inline"] > 0
    assert got == [[2 * i, 2 * i + 2] if i % 16 == 8 else [i, i + 1] for i in range(0, 200, 2)]
    assert not any(seen)


REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="unset")


@pytest.mark.asyncio
async def test_a_collate_on_the_loop_runs_in_a_context_of_its_own_as_on_its_thread() -> None:
    """A collate that sets a context variable sets it in a context of its own wherever it runs,
    as on its thread: the consumer's task never sees it, nor the collate the consumer's; each
    epoch's is new, as each epoch's collate thread is."""
    seen: list[str] = []

    def tagged(samples: Sequence[np.ndarray]) -> list[int]:
        seen.append(REQUEST.get())
        REQUEST.set("collate")
        return [int(s[0]) // 4 for s in samples]

    REQUEST.set("consumer")
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(200), tagged, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    after: list[str] = []
    async with loader:
        async for _ in loader:
            after.append(REQUEST.get())
        assert loader.stats()["collated_inline"] > 0
        first = seen[:]
        seen.clear()
        async for _ in loader:  # the next epoch starts on the loop, in a new context
            after.append(REQUEST.get())
    assert set(after) == {"consumer"}
    for epoch in (first, seen):
        assert epoch[0] == "unset" and set(epoch[1:]) == {"collate"}  # its own, from call to call


@pytest.mark.asyncio
async def test_a_collate_on_the_loop_still_gives_the_loop_its_turns() -> None:
    """Batches made on the loop as they are asked for never suspend ``async for``: it still
    gives the loop's other tasks a turn at least every ``TURN_S`` or so."""
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), IdsOf(4), sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )

    async with loader:
        it = aiter(loader)
        for _ in range(2 * LOOP_CHEAP_CALLS):  # measured cheap: on the loop from here
            await anext(it)
        async with counting_turns() as turns:
            t0 = time.thread_time()
            for _ in range(150):
                await anext(it)
                busy(TURN_S / 10)
            spent = time.thread_time() - t0
        await it.aclose()
        assert loader.stats()["collated_inline"] >= 100
    assert turns.count >= max(3, int(spent / TURN_S) // 2), (turns.count, spent)


class WideWindows(gl.MemoryStreamStorage):
    """A memory stream read in windows of hundreds of batches, as an object store is."""

    read_window_batches = 512


@pytest.mark.asyncio
@pytest.mark.parametrize("wide", [False, True])
async def test_a_wide_windows_lookup_and_split_run_off_the_callers_loop(
    wide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of hundreds of batches costs milliseconds to look up and split into batches:
    that runs off the loop, and the batches are those of the sync loop. Windows of a few dozen
    batches are looked up on the loop (less than the hop)."""
    from guideloom._core import schedule

    where: list[str] = []
    of = schedule.Indexes.of

    def watched(self: schedule.Indexes, specs: Any) -> Any:
        where.append(threading.current_thread().name)
        return of(self, specs)

    monkeypatch.setattr(schedule.Indexes, "of", watched)
    kind = WideWindows if wide else gl.MemoryStreamStorage
    data = np.arange(3000 * 4, dtype=np.int64)
    options: dict[str, Any] = dict(sequence_length=4, local_batch_size=3, shuffle=True, shuffle_seed=2)
    sync = gl.StatefulDataLoader.from_storage(kind(data), IdsOf(4), **options)
    with sync:
        expected = list(sync)
    where.clear()
    loader = gl.StatefulDataLoader.from_storage(kind(data), IdsOf(4), **options)
    async with loader:
        got = [batch async for batch in loader]
    assert got == expected
    loop_thread = threading.current_thread().name
    assert where, "no window was read"
    if wide:
        assert loop_thread not in where and set(where) == {"guideloom-aside"}
    else:
        assert set(where) == {loop_thread}


@pytest.mark.asyncio
@pytest.mark.parametrize("body_s", [TURN_S / 10, TURN_S])
async def test_async_for_gives_the_loop_a_turn_at_least_every_turn_s(body_s: float) -> None:
    """Batches all made ahead: the loop's other tasks still run, at every batch where the loop
    body takes ``TURN_S`` itself, and at least once every ``TURN_S`` or so where it takes less
    (a turn at each would cost a pass of the loop a batch)."""
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), IdsOf(4), sequence_length=4, local_batch_size=2, prefetch=200,
        device=torch.device("cpu"),
    )  # fmt: skip

    async with loader:
        it = aiter(loader)
        await anext(it)
        await asyncio.sleep(0.5)  # the collate thread makes every batch ahead
        # the loop thread's own time: a while it waits for a core (a loaded machine) passes no
        # turn by, as the first batch after it gives one
        handed = 150
        async with counting_turns() as turns:
            t0 = time.thread_time()
            for _ in range(handed):
                await anext(it)
                busy(body_s)
            spent = time.thread_time() - t0
        await it.aclose()
    if body_s >= TURN_S:
        assert turns.count >= handed, (turns.count, handed)
    else:
        assert turns.count >= max(3, int(spent / TURN_S) // 2), (turns.count, spent)


# -- cancellation -------------------------------------------------------------------------------------
WORKERS = [
    pytest.param({}, id="no-workers"),
    pytest.param({"num_workers": 2, "prefetch": 2}, id="threads"),
    pytest.param({"num_workers": 2, "parallel_method": "process"}, id="processes", marks=pytest.mark.slow),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("where", ["waiting-for-a-batch", "in-the-loop-body"])
async def test_cancelled_async_for_joins_every_thread_and_process_first(
    workers: dict[str, Any], where: str
) -> None:
    before = set(guideloom_threads())
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), slow_ids, sequence_length=4, local_batch_size=2, device=torch.device("cpu"),
        **workers,
    )  # fmt: skip
    started = asyncio.Event()
    leftover: list[Any] = []

    async def consume() -> None:
        try:
            async with loader:
                async for _ in loader:
                    started.set()
                    if where == "in-the-loop-body":
                        await asyncio.sleep(10)
        except asyncio.CancelledError:
            # What is still running as the cancellation propagates out of the consumer.
            leftover.extend(t.name for t in guideloom_threads() if t not in before and t.is_alive())
            leftover.extend(p.name for p in multiprocessing.active_children())
            raise

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert leftover == []
    await asyncio.sleep(1)
    assert [t.name for t in guideloom_threads() if t not in before and t.is_alive()] == []
    assert multiprocessing.active_children() == []


@pytest.mark.asyncio
async def test_cancelled_again_while_closing_still_joins_the_workers() -> None:
    """A second cancel() while the iterator joins its workers (asyncio.run's shutdown does
    that) neither skips the join nor swallows the cancellation."""
    before = set(guideloom_threads())
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), slow_ids, sequence_length=4, local_batch_size=2, num_workers=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    started = asyncio.Event()

    async def consume() -> None:
        async with loader:
            async for _ in loader:
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0.002)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [t.name for t in guideloom_threads() if t not in before and t.is_alive()] == []


@pytest.mark.asyncio
async def test_the_loader_keeps_where_async_for_collates_from_one_epoch_to_the_next() -> None:
    """A collate that earned the loop in one epoch runs there from the next epoch's first batch;
    one sent back to its thread earns it again with the cheap calls it left off at."""
    where = IdsWhere(4)
    names = where.names

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40), where, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    loop = threading.current_thread().name
    async with loader:
        first = [b async for b in loader]
        ended_on_loop = names[-1] == loop
        names.clear()
        second = [b async for b in loader]
    assert first == second
    if ended_on_loop:  # (a loaded machine may have sent the last calls back to the thread)
        assert names[0] == loop, names


@pytest.mark.asyncio
async def test_a_collate_fn_replaced_between_epochs_earns_the_loop_afresh() -> None:
    """What the loader learnt of one collate says nothing of another: a new ``collate_fn`` starts
    on its thread, so a slow one never holds the loop on its first call."""
    recorded = IdsWhere(4)
    names = recorded.names
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40), IdsOf(4), sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    loop = threading.current_thread().name
    async with loader:
        first = [b async for b in loader]
        loader.collate_fn = recorded
        second = [b async for b in loader]
    assert first == second
    assert names[0] != loop, names
