"""Running a loader in a test: build one over an identity stream, take batches, check a resume,
compare two runs' batches, and watch the threads and the event loop it uses."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom.pytorch import StatefulDataLoader

from .data import IdsOf, identity_stream, slow_ids


def make(
    storage: Any, sequence_length: int = 4, collate: Any = None, **kw: Any
) -> gl.StatefulDataLoader[Any, list[int]]:
    """A CPU loader whose batches are the ids of their samples (or what ``collate`` makes)."""
    kw.setdefault("device", torch.device("cpu"))
    return gl.StatefulDataLoader.from_storage(
        storage, collate or IdsOf(sequence_length), sequence_length=sequence_length, **kw
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


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


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


def assert_same(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same batches (or the same batch): the same types, and tensors and
    arrays of the same dtype, shape and values, through dicts, lists and tuples. A list or tuple
    of them must not be empty: two empty runs would agree while proving nothing."""
    if isinstance(a, list | tuple):
        assert len(a) > 0, "nothing to compare"
    _assert_same(a, b)


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def slow_thread_worker_loader() -> StatefulDataLoader[Any, Any]:
    """Thread workers with a slow collate: an epoch still runs when the loader is closed."""
    return StatefulDataLoader.from_storage(
        identity_stream(400),
        slow_ids,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        prefetch=4,
        device=torch.device("cpu"),
    )


def without_the_process_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process that never used process workers: ``concurrent.futures`` has not
    imported its ``process`` submodule."""
    import concurrent.futures

    monkeypatch.delattr(concurrent.futures, "process", raising=False)


#: The process-wide pools' threads (guideloom._process.pool): shared by every storage of the
#: process and kept for its life, not a loader's.
PROCESS_POOLS = ("guideloom-io_", "guideloom-range_", "guideloom-free_", "guideloom-aside")


def guideloom_threads() -> list[threading.Thread]:
    """guideloom's threads alive now, those of the process-wide pools left out."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("guideloom") and not t.name.startswith(PROCESS_POOLS)
    ]


@contextlib.asynccontextmanager
async def loop_gaps() -> AsyncIterator[list[float]]:
    """Record the gaps between the ticks of a 5 ms ticker on the running loop: a blocked loop
    shows up as a long gap.

    The objects earlier tests left behind are frozen out of the collector while it records, so a
    full collection of the test process's heap is not mistaken for a stall of the code under test.
    """
    gaps: list[float] = []
    gc.collect()
    gc.freeze()
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
        gc.unfreeze()
