"""``device="cuda"``: batches copied to the GPU (pinned first with ``pin_memory=True``, copies
``non_blocking``) equal the CPU loader's batches, for every kind of worker, also while other
work runs on another CUDA stream. Skipped without CUDA: nothing in CI needs a GPU."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.support.cuda import assert_same_on_cuda, nested
from tests.support.data import identity_stream
from tests.support.loader import make, take

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("no_thread_leak"),
]


WORKERS = [
    {},
    {"prefetch": 4},
    {"num_workers": 2, "prefetch": 2},
    {"num_workers": 2, "collate_mode": "workers"},
    {"num_workers": 2, "parallel_method": "process", "prefetch": 4},
]
KW: dict[str, Any] = {"collate": nested, "local_batch_size": 8, "shuffle": True, "shuffle_seed": 3}


def cpu_batches(n: int = 400) -> list[Any]:
    with make(identity_stream(n), **KW) as loader:
        return take(loader)


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("workers", WORKERS)
def test_batches_on_cuda_equal_the_cpu_batches(workers: dict[str, Any], pin: bool) -> None:
    expected = cpu_batches()
    with make(identity_stream(400), device="cuda", pin_memory=pin, **workers, **KW) as loader:
        got = take(loader)
    torch.cuda.synchronize()
    assert len(got) == len(expected)
    for g, c in zip(got, expected, strict=True):
        assert_same_on_cuda(g, c)


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "prefetch": 4}])
def test_pinned_non_blocking_copies_under_compute_on_another_stream(workers: dict[str, Any]) -> None:
    """Matrix products keep another stream busy while batches arrive; every batch is kept on the
    device (its memory not reused) and compared once the GPU is idle."""
    expected = cpu_batches()
    stream = torch.cuda.Stream()
    a = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(a)
    got = []
    with make(identity_stream(400), device="cuda", pin_memory=True, **workers, **KW) as loader:
        for batch in loader:
            with torch.cuda.stream(stream):
                for _ in range(4):
                    torch.mm(a, a, out=out)
            got.append(batch)
    torch.cuda.synchronize()
    for g, c in zip(got, expected, strict=True):
        assert_same_on_cuda(g, c)


def test_async_for_to_cuda_with_pinned_memory() -> None:
    expected = cpu_batches()
    loader = make(identity_stream(400), device="cuda", pin_memory=True, num_workers=2, **KW)

    async def run() -> list[Any]:
        async with loader:
            return [b async for b in loader]

    got = asyncio.run(run())
    torch.cuda.synchronize()
    for g, c in zip(got, expected, strict=True):
        assert_same_on_cuda(g, c)
