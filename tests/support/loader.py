"""Small helpers shared by the loader tests: a flattener, a tracked storage, failing parts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from guideloom.pytorch import StatefulDataLoader
from tests.support.data import identity_stream


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


class Tracked(gl.MemoryStreamStorage):
    """Records when the loader opens and closes it."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.events: list[str] = []

    async def open(self) -> None:
        self.events.append("open")

    async def close(self) -> None:
        self.events.append("close")


def without_the_process_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process that never used process workers: ``concurrent.futures`` has not
    imported its ``process`` submodule (issue 10 item 1)."""
    import concurrent.futures

    monkeypatch.delattr(concurrent.futures, "process", raising=False)


def slow_ids(samples: Sequence[np.ndarray]) -> list[int]:
    time.sleep(0.01)
    return [int(s[0]) // 4 for s in samples]


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


class Boom(Exception):
    pass


class FailingStorage(gl.MemoryStreamStorage):
    def __init__(self, tokens: npt.ArrayLike, bad_start: int) -> None:
        super().__init__(tokens)
        self.bad_start = bad_start

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        if self.bad_start in starts.tolist():
            raise OSError(f"disk error at {self.bad_start}")
        return await super().read_many(starts, length)
