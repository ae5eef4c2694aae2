"""``async with`` / ``async for``, and sync iteration from inside a running event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import guideloom as gl
from tests.support.data import Tracked, identity_stream
from tests.support.loader import make, slow_thread_worker_loader, take, without_the_process_module

pytestmark = pytest.mark.usefixtures("no_thread_leak")


@pytest.mark.asyncio
async def test_aclose_from_another_task_with_thread_workers_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_the_process_module(monkeypatch)
    loader = slow_thread_worker_loader()
    got: list[Any] = []
    started = asyncio.Event()

    async def consume() -> None:
        async for b in loader:
            got.append(b)
            started.set()

    await loader.aopen()
    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    await loader.aclose()
    await asyncio.wait_for(task, 10)  # ends without an error
    assert 0 < len(got) < 200


@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "prefetch": 3}])
async def test_async_for_matches_sync(workers: dict[str, int]) -> None:
    kw = {"local_batch_size": 3, "shuffle": True, "shuffle_seed": 4, "drop_last": False, **workers}
    with make(identity_stream(31), **kw) as loader:
        expected = take(loader)
    loader = make(identity_stream(31), **kw)
    got = []
    async with loader:
        async for b in loader:
            got.append(b)
        assert loader.state_dict()["epoch"] == 1
    assert got == expected


@pytest.mark.asyncio
async def test_async_iterator_close_midway_and_active_check() -> None:
    loader = make(identity_stream(20), local_batch_size=2, prefetch=2)
    async with loader:
        it = aiter(loader)
        assert await anext(it) == [0, 1]
        with pytest.raises(RuntimeError, match="still active"):
            aiter(loader)
        await it.aclose()
        assert loader.state_dict()["observation_offset"] == 2
        it2 = aiter(loader)
        assert await anext(it2) == [2, 3]
    # leaving the context closed it
    with pytest.raises(StopAsyncIteration):
        await anext(it2)


class SlowBlockingStream(gl.MemoryStreamStorage):
    """A storage whose reads block (like a cold disk); it offloads them as local storage does."""

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        import anyio.to_thread

        def blocking() -> Sequence[Any]:
            time.sleep(0.3)
            return asyncio.run(super(SlowBlockingStream, self).read_many(starts, length))

        return await anyio.to_thread.run_sync(blocking)


@pytest.mark.asyncio
@pytest.mark.slow
async def test_async_iteration_keeps_the_event_loop_responsive() -> None:
    from tests.support.loader import loop_gaps

    loader = make(SlowBlockingStream(np.arange(400)), local_batch_size=4)
    async with loop_gaps() as gaps, loader:
        n = 0
        async for _ in loader:
            n += 1
    assert n == 25
    assert max(gaps) < 0.2, max(gaps)  # each read blocks 300 ms, but off the loop


def test_sync_iteration_inside_a_running_loop_thread_is_independent() -> None:
    """The sync facade runs its own loop: it works from code that has no loop at all."""
    with make(identity_stream(12), local_batch_size=4) as loader:
        assert take(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_sync_close_of_an_async_opened_loader_closes_the_storage() -> None:
    loader = make(tracked := Tracked(np.arange(40)))

    async def open_it() -> None:
        await loader.aopen()

    asyncio.run(open_it())
    loader.close()
    assert tracked.events == ["open", "close"]


def test_sync_iteration_from_inside_a_running_event_loop() -> None:
    """Code that runs an event loop (a notebook) can still use the sync facade."""

    async def main() -> list[list[int]]:
        with make(identity_stream(12), local_batch_size=4) as loader:
            return take(loader)

    assert asyncio.run(main()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.asyncio
async def test_remaining_of_an_async_iterator() -> None:
    loader = make(identity_stream(100), local_batch_size=10)
    loader.load_state_dict({**loader.state_dict(), "observation_offset": 30})
    async with loader:
        it = loader.__aiter__()
        assert len(it) == 7
        await it.__anext__()
        assert len(it) == 6
        await it.aclose()


class CountingIds:
    """Collate to the observation ids of a stream of 4-element samples, counting its calls
    (from any thread)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, samples: Sequence[npt.NDArray[Any]]) -> list[int]:
        with self.lock:
            self.calls += 1
        return [int(s[0]) // 4 for s in samples]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "workers",
    [{"prefetch": 1}, {"prefetch": 4}, {"num_workers": 2, "prefetch": 2, "parallel_method": "thread"}],
    ids=["prefetch 1", "prefetch 4", "2 threads"],
)
async def test_async_for_collates_no_more_ahead_than_prefetch_allows(workers: dict[str, Any]) -> None:
    """However long the loop body takes, at most ``prefetch + num_workers`` batches are
    collated beyond those handed out, as in sync code."""
    collate = CountingIds()
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), collate, sequence_length=4, local_batch_size=2, **workers
    )
    capacity = workers["prefetch"] + workers.get("num_workers", 0)
    got: list[int] = []
    async with loader:
        async for batch in loader:
            got.extend(batch)
            for _ in range(3):  # the collate threads run ahead as far as they may
                await asyncio.sleep(0.001)
            assert collate.calls <= len(got) // 2 + capacity
    assert sorted(got) == list(range(400))
