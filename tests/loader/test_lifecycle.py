"""Lifecycle: open and close, iterators, threads between iterators, stats, remaining()."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from tests.support.data import Boom, IdsWhere, Tracked, identity_stream
from tests.support.loader import make, slow_thread_worker_loader, take, without_the_process_module

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_second_iterator_while_active_raises_and_closing_midway_continues() -> None:
    with make(identity_stream(10), local_batch_size=2, prefetch=2) as loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        with pytest.raises(RuntimeError, match="still active"):
            iter(loader)
        it.close()
        assert take(loader) == [[2, 3], [4, 5], [6, 7], [8, 9]]


@pytest.mark.parametrize("workers", [{}, {"prefetch": 2}, {"num_workers": 2}])
def test_a_new_iterator_after_the_last_batch_starts_the_next_epoch(workers: dict[str, Any]) -> None:
    """A loop that takes ``len(loader)`` batches and never sees StopIteration (Lightning's
    Trainer does this) may start the next epoch with a new ``iter()``, as with torch."""
    with make(identity_stream(6), local_batch_size=2, shuffle=True, shuffle_seed=1, **workers) as loader:
        first = iter(loader)
        epoch0 = [next(first) for _ in range(len(loader))]
        assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["observation_offset"] == 6
        second = iter(loader)  # the spent one ends as exhausted: epoch 1 from its start
        assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["observation_offset"] == 0
        epoch1 = list(second)
        with pytest.raises(StopIteration):
            next(first)
    assert sorted(x for b in epoch0 for x in b) == sorted(x for b in epoch1 for x in b) == list(range(6))
    assert epoch0 != epoch1  # another epoch, another shuffle
    assert loader.state_dict()["epoch"] == 2


def test_an_iterator_one_batch_short_of_the_end_is_still_active() -> None:
    with make(identity_stream(6), local_batch_size=2) as loader:
        it = iter(loader)
        next(it), next(it)
        with pytest.raises(RuntimeError, match="still active"):
            iter(loader)
        assert next(it) == [4, 5]
        assert take(loader, 1) == [[0, 1]]  # it was spent: the next epoch
        assert loader.state_dict()["epoch"] == 1


@pytest.mark.asyncio
async def test_a_new_async_iterator_after_the_last_batch_starts_the_next_epoch() -> None:
    async with make(identity_stream(6), local_batch_size=2) as loader:
        first = aiter(loader)
        epoch0 = [await anext(first) for _ in range(len(loader))]
        epoch1 = [b async for b in loader]
    assert epoch0 == epoch1 == [[0, 1], [2, 3], [4, 5]]
    assert loader.state_dict()["epoch"] == 2


def test_abandoned_for_loop_iterator_is_released() -> None:
    with make(identity_stream(10), local_batch_size=2) as loader:
        for batch in loader:
            assert batch == [0, 1]
            break
        assert take(loader, 1) == [[2, 3]]


def test_close_ends_an_active_iterator() -> None:
    loader = make(identity_stream(100), local_batch_size=2, num_workers=2, prefetch=4)
    loader.open()
    it = iter(loader)
    next(it)
    loader.close()
    assert list(it) == []
    loader.close()  # idempotent
    with loader:
        assert take(loader, 1) == [[2, 3]]


def test_iterating_an_unopened_loader_opens_it_for_the_iterator() -> None:
    loader = make(identity_stream(6), local_batch_size=2)
    assert take(loader) == [[0, 1], [2, 3], [4, 5]]
    assert loader.state_dict()["epoch"] == 1


def test_storage_is_opened_and_closed() -> None:
    with make(tracked := Tracked(np.arange(40))) as loader:
        take(loader)
    assert tracked.events == ["open", "close"]


def test_closing_from_another_thread_with_thread_workers_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_the_process_module(monkeypatch)
    loader = slow_thread_worker_loader()
    got: list[Any] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            for b in loader:
                got.append(b)
                started.set()
        except BaseException as exc:
            errors.append(exc)

    loader.open()
    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(10)
    loader.close()
    t.join(10)
    assert not t.is_alive() and errors == [] and 0 < len(got) < 200


def test_many_open_close_cycles_leave_no_threads() -> None:
    loader = make(identity_stream(30), local_batch_size=2, num_workers=2, prefetch=2)
    sizes = []
    for _ in range(20):
        with loader:
            sizes.append(len(take(loader, 3)))
    # 15 batches an epoch; an iterator started at the epoch's end is exhausted at once (epoch + 1)
    assert sizes == [3, 3, 3, 3, 3, 0] * 3 + [3, 3]
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["observation_offset"] == 12


def test_stats_count_batches_samples_and_waiting() -> None:
    def slow(samples: Sequence[np.ndarray]) -> int:
        time.sleep(0.02)
        return len(samples)

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(10),
        slow,
        sequence_length=4,
        local_batch_size=3,
        drop_last=False,
        device=torch.device("cpu"),
    )
    with loader:
        assert take(loader) == [3, 3, 3, 1]
    stats = loader.stats()
    assert stats["batches"] == 4 and stats["samples"] == 10
    assert stats["wait_seconds"] >= 4 * 0.02 * 0.9 and 0 < stats["last_wait_seconds"] <= stats["wait_seconds"]


def test_no_thread_runs_between_iterators_even_while_open() -> None:
    from tests.support.loader import guideloom_threads

    def boom(samples: Sequence[np.ndarray]) -> list[int]:
        if int(samples[0][0]) >= 16:
            raise Boom("late failure")
        return [int(s[0]) for s in samples]

    before = set(guideloom_threads())
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40),
        boom,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        prefetch=2,
        device=torch.device("cpu"),
    )
    with loader:
        assert take(loader, 1) == [[0, 4]]
        assert set(guideloom_threads()) == before
        with pytest.raises(Boom):
            take(loader)
        assert set(guideloom_threads()) == before  # the failure shut everything down


def test_without_workers_or_prefetch_batches_load_on_demand_in_the_callers_thread() -> None:
    collate = IdsWhere(4)
    threads = collate.names

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(20), collate, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    with loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        time.sleep(0.05)
        assert len(threads) == 1  # nothing collated ahead of the request
        assert next(it) == [2, 3]
        it.close()
    assert set(threads) == {threading.current_thread().name}


def test_an_inline_iterator_closed_from_another_thread() -> None:
    with make(identity_stream(20), local_batch_size=2) as loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        t = threading.Thread(target=it.close)
        t.start()
        t.join()
        with pytest.raises(StopIteration):
            next(it)
        assert take(loader, 1) == [[2, 3]]


class _Batch:
    """A collated batch that can be watched with a weak reference."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


@pytest.mark.parametrize("workers", [{}, {"prefetch": 2}, {"num_workers": 2, "prefetch": 1}])
def test_the_pipeline_keeps_no_reference_to_a_delivered_batch(workers: dict[str, int]) -> None:
    import gc
    import weakref

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(64),
        lambda s: _Batch([int(x[0]) for x in s]),
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
        **workers,
    )
    with loader:
        it = iter(loader)
        next(it)
        batch = next(it)
        ref = weakref.ref(batch)
        del batch
        deadline = time.monotonic() + 2
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert ref() is None, "a delivered batch must be freed once the consumer drops it"
        it.close()


class LengthAfterOpen(gl.MemoryStreamStorage):
    """A storage that learns its length only when opened (as a remote listing would)."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.opened = False

    async def open(self) -> None:
        self.opened = True

    async def close(self) -> None:
        self.opened = False

    def __len__(self) -> int:
        if not self.opened:
            raise RuntimeError("open me first")
        return super().__len__()


@pytest.mark.parametrize("workers", [{}, {"prefetch": 2}])
def test_a_storage_that_knows_its_length_only_once_open(workers: dict[str, int]) -> None:
    loader = make(LengthAfterOpen(np.arange(24)), local_batch_size=2, **workers)
    assert take(loader) == [[0, 1], [2, 3], [4, 5]]  # the iterator opens the loader first
    with loader:
        assert len(loader) == 3

    async def main() -> list[list[int]]:
        got = []
        async for b in make(LengthAfterOpen(np.arange(24)), local_batch_size=2, **workers):
            got.append(b)
        return got

    assert asyncio.run(main()) == [[0, 1], [2, 3], [4, 5]]


def test_a_failed_open_closes_the_storage_again() -> None:
    storage = Tracked(np.arange(8))
    loader = make(storage, local_batch_size=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader.open()
    assert storage.events == ["open", "close"]


def test_remaining_counts_what_is_left_after_a_resume() -> None:
    with make(identity_stream(100), local_batch_size=10) as loader:
        assert len(loader) == loader.remaining() == 10
        it = iter(loader)
        assert len(it) == 10
        next(it)
        next(it)
        assert len(it) == 8 and loader.remaining() == 8
        it.close()
        assert len(it) == 0
        state = loader.state_dict()
    with make(identity_stream(100), local_batch_size=5) as resumed:  # another batch size
        resumed.load_state_dict(state)
        assert len(resumed) == 20  # len(loader) stays the whole epoch
        assert resumed.remaining() == 16
        it = iter(resumed)
        assert len(it) == 16 == len(list(it))
        assert resumed.remaining() == 20  # the next epoch, whole
