"""Failures: collate and storage errors reach the consumer at the batch that failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.data import Boom, FailingStorage, identity_stream
from tests.support.loader import flat, make, take

pytestmark = pytest.mark.usefixtures("no_thread_leak")


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2}, {"prefetch": 4}, {"num_workers": 2, "prefetch": 3}]
)
def test_collate_error_reaches_consumer_at_its_batch(workers: dict[str, int]) -> None:
    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        out = [int(s[0]) // 4 for s in samples]
        if 12 in out:
            raise Boom(f"bad batch {out}")
        return out

    loader = make(identity_stream(40), collate=collate, local_batch_size=4, **workers)
    got = []
    with loader:
        with pytest.raises(Boom, match="bad batch"):
            for b in loader:
                got.append(b)
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert loader.state_dict()["observation_offset"] == 12
        # the failing batch is retried by the next iterator
        with pytest.raises(Boom):
            take(loader)


def stop_at_seven(samples: Sequence[np.ndarray]) -> list[int]:
    """A collate that raises StopIteration at batch 7 (a ``next()`` on an exhausted iterator)."""
    out = [int(s[0]) // 4 for s in samples]
    if 28 in out:
        next(iter(()))
    return out


def stop_async_at_seven(samples: Sequence[np.ndarray]) -> list[int]:
    out = [int(s[0]) // 4 for s in samples]
    if 28 in out:
        raise StopAsyncIteration
    return out


_ALL_MODES = [
    {},
    {"prefetch": 4},
    {"num_workers": 2},
    {"num_workers": 2, "prefetch": 3},
    pytest.param({"num_workers": 2, "parallel_method": "process"}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("workers", _ALL_MODES)
def test_collate_stop_iteration_is_an_error_not_the_end_of_the_epoch(workers: dict[str, object]) -> None:
    """As PEP 479 rules for generators: a StopIteration from collate_fn would end a ``for`` loop
    as if the epoch were complete; it reaches the consumer as a RuntimeError at its batch."""
    loader = make(identity_stream(80), collate=stop_at_seven, local_batch_size=4, **workers)
    got = []
    with loader:
        with pytest.raises(RuntimeError, match="raised StopIteration") as info:
            for b in loader:
                got.append(b)
        assert isinstance(info.value.__cause__, StopIteration)
        assert len(got) == 7
        assert loader.state_dict()["observation_offset"] == 28
        with pytest.raises(RuntimeError, match="StopIteration"):  # not an empty epoch
            take(loader)


@pytest.mark.parametrize("workers", _ALL_MODES)
def test_collate_stop_async_iteration_is_an_error_under_async_for(workers: dict[str, object]) -> None:
    loader = make(identity_stream(80), collate=stop_async_at_seven, local_batch_size=4, **workers)

    async def run() -> list[list[int]]:
        got = []
        async with loader:
            with pytest.raises(RuntimeError, match="raised StopAsyncIteration"):
                async for b in loader:
                    got.append(b)
        return got

    assert len(asyncio.run(run())) == 7
    assert loader.state_dict()["observation_offset"] == 28


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "prefetch": 2}])
def test_storage_error_surfaces_at_the_failing_batch(workers: dict[str, int]) -> None:
    loader = make(FailingStorage(np.arange(400), bad_start=4 * 57), local_batch_size=5, **workers)
    got = []
    with loader, pytest.raises(OSError, match="disk error at 228"):
        for b in loader:
            got.append(b)
    assert flat(got) == list(range(55))


def test_exception_group_free_errors_in_async() -> None:
    async def main() -> None:
        loader = make(FailingStorage(np.arange(400), bad_start=4 * 7), local_batch_size=5)
        got = []
        async with loader:
            with pytest.raises(OSError, match="disk error"):
                async for b in loader:
                    got.append(b)
        assert got == [[0, 1, 2, 3, 4]]

    asyncio.run(main())


def stack_nonempty(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """A collate that cannot take an empty list (``torch.stack([])`` raises)."""
    return torch.stack([torch.from_numpy(np.asarray(s)) for s in samples])


_EMPTY_BATCH_MODES = [
    {},
    {"prefetch": 4},
    {"num_workers": 2, "collate_mode": "workers"},
    {"num_workers": 2, "collate_mode": "inline"},
    pytest.param(
        {"num_workers": 2, "parallel_method": "process", "collate_mode": "workers"}, marks=pytest.mark.slow
    ),
]


def _trailing_rank(workers: dict[str, object]) -> gl.StatefulDataLoader[Any, Any]:
    """Rank 1 of 4, 10 samples, batches of 2, drop_last=False: its second batch is empty."""
    return make(
        identity_stream(10), collate=stack_nonempty, local_batch_size=2, world_size=4, rank=1,
        drop_last=False, **workers,
    )  # fmt: skip


@pytest.mark.parametrize("workers", _EMPTY_BATCH_MODES)
def test_a_collate_failing_on_an_empty_batch_says_why_the_batch_was_empty(workers: dict[str, object]) -> None:
    loader = _trailing_rank(workers)
    with loader:
        it = iter(loader)
        assert next(it).tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
        with pytest.raises(RuntimeError, match="non-empty TensorList") as info:
            next(it)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "this batch was empty" in notes and "world_size=4" in notes and "rank 1" in notes
    assert "accept an empty list" in notes and "drop_last=True" in notes


@pytest.mark.parametrize(
    "workers",
    [
        {},
        {"num_workers": 2},
        pytest.param({"num_workers": 2, "parallel_method": "process"}, marks=pytest.mark.slow),
    ],
)
def test_the_empty_batch_note_under_async_for(workers: dict[str, object]) -> None:
    loader = _trailing_rank(workers)

    async def run() -> BaseException:
        async with loader:
            with pytest.raises(RuntimeError, match="non-empty TensorList") as info:
                async for _ in loader:
                    pass
        return info.value

    notes = getattr(asyncio.run(run()), "__notes__", [])
    assert len(notes) == 1 and "this batch was empty" in notes[0]


def test_a_failure_of_a_batch_with_samples_gets_no_note() -> None:
    def fails(samples: Sequence[np.ndarray]) -> None:
        raise Boom("not about emptiness")

    loader = make(identity_stream(10), collate=fails, local_batch_size=2, world_size=4, rank=1,
                  drop_last=False)  # fmt: skip
    with loader, pytest.raises(Boom) as info:
        take(loader)
    assert not getattr(info.value, "__notes__", [])
