"""Failures: collate and storage errors reach the consumer at the batch that failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

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
    {"num_workers": 2, "parallel_method": "process"},
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
