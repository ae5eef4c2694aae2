"""One measurement for :mod:`benchmarks.revisions`, run in a fresh process from the tree under test
(public API only, so any revision runs it): prints samples/s, the first batch of a fresh loader and
the resume TTFB as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

import guideloom as gl


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def main() -> None:
    path, kwargs, is_async = sys.argv[1], json.loads(sys.argv[3]), sys.argv[4] == "1"
    batches, warmup = int(sys.argv[5]), int(sys.argv[6])
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        collate,
        sequence_length=2048,
        local_batch_size=16,
        shuffle=True,
        shuffle_seed=7,
        device=torch.device("cpu"),
        **kwargs,
    )

    first: list[float] = []

    def run_sync() -> float:
        t_open = time.perf_counter()
        with loader:
            it = iter(loader)
            next(it)
            first.append(time.perf_counter() - t_open)
            for _ in range(warmup):
                next(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            dt = time.perf_counter() - t0
            it.close()  # type: ignore[attr-defined]
        return dt

    async def run_async() -> float:
        t_open = time.perf_counter()
        async with loader:
            it = loader.__aiter__()
            await it.__anext__()
            first.append(time.perf_counter() - t_open)
            for _ in range(warmup):
                await it.__anext__()
            t0 = time.perf_counter()
            for _ in range(batches):
                await it.__anext__()
            dt = time.perf_counter() - t0
            await it.aclose()  # type: ignore[attr-defined]
        return dt

    dt = asyncio.run(run_async()) if is_async else run_sync()

    # Resume: time to the first batch half-way through the epoch, in this process.
    state = loader.state_dict()
    state["observation_offset"] = 16 * (len(loader) // 2)
    t0 = time.perf_counter()
    loader.load_state_dict(state)
    with loader:
        it = iter(loader)
        next(it)
        ttfb = time.perf_counter() - t0
        it.close()  # type: ignore[attr-defined]
    figures = {
        "samples_per_s": batches * 16 / dt,
        "resume_ttfb_ms": ttfb * 1e3,
        "first_batch_ms": first[0] * 1e3,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
