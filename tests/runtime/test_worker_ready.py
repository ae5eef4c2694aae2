"""A process worker that never reports ready fails its loader's start within a deadline: it is
stopped and the loader says so, naming it, instead of waiting for it forever."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from guideloom._runtime.processes import pool
from tests.support.data import NeverOpens, ids


def _loader(mode: str) -> gl.StatefulDataLoader[int, list[int]]:
    return gl.StatefulDataLoader.from_storage(
        NeverOpens(np.arange(64 * 4, dtype=np.int64)),
        ids,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        parallel_method="process",
        collate_mode=mode,
        device=torch.device("cpu"),
    )


def test_a_worker_that_never_reports_ready_fails_the_start_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinned to the workers: the first batch waits for them, then fails with the reason."""
    monkeypatch.setattr(pool, "READY_S", 1.0)
    t0 = time.monotonic()
    with _loader("workers") as loader, pytest.raises(gl.WorkerError, match="did not report ready within 1 s"):
        for _ in loader:
            pass
    assert time.monotonic() - t0 < 30


def test_batches_made_inline_while_the_workers_start_do_not_wait_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``collate_mode="auto"``: the batches made here meanwhile are the epoch's, and closing the
    loader does not wait for the workers' deadline."""
    monkeypatch.setattr(pool, "READY_S", 60.0)
    t0 = time.monotonic()
    with _loader("auto") as loader:
        got = [i for batch in loader for i in batch]
    assert sorted(got) == list(range(64))
    assert time.monotonic() - t0 < 30


class _ReadHere(gl.MemoryStreamStorage):
    """Read by the main process only (as an object store is), each read's time recorded there."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.calls: list[float] = []

    def reads_inline(self) -> bool:
        return False

    def read_by_workers(self) -> bool:
        return False

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        self.calls.append(time.monotonic())
        return await super().read_many(starts, length)


class _SlowToStart:
    """A collate whose worker takes ``delay`` seconds to unpickle it: the workers' start is slow."""

    def __init__(self, delay: float) -> None:
        self.delay, self.maker = delay, os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.maker:
            time.sleep(self.delay)

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        return ids(samples)


def test_the_windows_after_the_first_batchs_are_read_while_the_workers_start() -> None:
    """Over a storage the main process reads, the first batch's window is read alone, and once
    it is in, the windows after it are read while the workers still start."""
    storage = _ReadHere(np.arange(512 * 4, dtype=np.int64))
    loader = gl.StatefulDataLoader.from_storage(
        storage, _SlowToStart(2.0), sequence_length=4, local_batch_size=2, num_workers=2,
        parallel_method="process", collate_mode="workers", device=torch.device("cpu"),
    )  # fmt: skip
    with loader:
        it = iter(loader)
        t0 = time.monotonic()
        first = next(it)
        waited = time.monotonic() - t0
        rest = [i for batch in it for i in batch]
    assert sorted(first + rest) == list(range(512))
    assert waited >= 1.5  # the first batch waited for the workers' start
    early = [t for t in storage.calls if t - t0 < 1.0]
    assert len(early) >= 3, f"{len(early)} reads while the workers started ({len(storage.calls)} in all)"
