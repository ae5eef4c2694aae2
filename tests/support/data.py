"""Helpers shared by the loader tests: identity datasets and the resume check."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import torch

import guideloom as gl


@contextlib.asynccontextmanager
async def loop_gaps() -> AsyncIterator[list[float]]:
    """Record the gaps between the ticks of a 5 ms ticker on the running loop: a blocked loop
    shows up as a long gap."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    try:
        yield gaps
    finally:
        stop.set()
        await task


def ids(samples: Sequence[np.ndarray]) -> list[int]:
    """Collate for identity streams: element ``i`` of the stream is ``i``, so a sample's first
    element divided by the sequence length is its observation index. Module-level: picklable."""
    return [int(s[0]) for s in samples]


def die(samples: Sequence[np.ndarray]) -> list[int]:
    """A collate that kills its worker process, as an out-of-memory kill would."""
    import os

    if any(int(s[0]) >= 40 for s in samples):
        os._exit(3)
    return [int(s[0]) for s in samples]


class IdsOf:
    """Picklable collate that maps samples of an identity stream to their indexes."""

    def __init__(self, sequence_length: int) -> None:
        self.sequence_length = sequence_length

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        return [int(s[0]) // self.sequence_length for s in samples]


def identity_stream(n_samples: int, sequence_length: int = 4, extra: int = 0) -> gl.MemoryStreamStorage:
    return gl.MemoryStreamStorage(np.arange(n_samples * sequence_length + extra, dtype=np.int64))


def make(storage: Any, sequence_length: int = 4, **kw: Any) -> gl.StatefulDataLoader[Any, list[int]]:
    kw.setdefault("device", torch.device("cpu"))
    return gl.StatefulDataLoader.from_storage(
        storage, IdsOf(sequence_length), sequence_length=sequence_length, **kw
    )


def take(loader: gl.StatefulDataLoader[Any, Any], k: int | None = None) -> list[Any]:
    """Up to ``k`` batches (all when None) from a fresh iterator, which is then closed."""
    if k == 0:
        return []
    it = iter(loader)
    out = []
    try:
        for batch in it:
            out.append(batch)
            if k is not None and len(out) == k:
                break
    finally:
        it.close()
    return out


def roundtrip(state: gl.StatefulDataLoaderStateDict) -> Any:
    """Save and load a checkpoint the way training jobs do (torch.save, weights_only load)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def check_resume_equals_uninterrupted(n_samples: int, stop_after: int, **kw: Any) -> None:
    """Resume at step ``stop_after`` in a fresh loader == the uninterrupted run, for one config."""
    storage = identity_stream(n_samples)
    with make(storage, **kw) as full:
        expected = take(full)
    with make(storage, **kw) as first:
        before = take(first, stop_after)
        state = roundtrip(first.state_dict())
    with make(storage, **kw) as second:
        second.load_state_dict(state)
        after = take(second)
    assert before + after == expected, (kw, stop_after)
