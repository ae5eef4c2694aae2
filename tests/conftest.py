"""Shared fixtures: small datasets, collate functions and a thread-leak check."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch


def stack_collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """Stack 1-D samples into an int64 tensor; an empty list gives a (0, 0) tensor."""
    if len(samples) == 0:
        return torch.empty((0, 0), dtype=torch.int64)
    return torch.from_numpy(np.stack(samples).astype(np.int64))


def ids_collate(samples: Sequence[np.ndarray]) -> list[int]:
    """For identity streams (element i == i) of sequence length L: the sample indexes, in order."""
    return [int(s[0]) for s in samples]


def guideloom_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("guideloom")]


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fail if a test leaves guideloom threads running."""
    before = set(guideloom_threads())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in guideloom_threads() if t not in before and t.is_alive()]
        if not left:
            return
        time.sleep(0.02)
    pytest.fail(f"threads left running: {[t.name for t in left]}")


@pytest.fixture
def cpu() -> torch.device:
    return torch.device("cpu")


def batches_as_ids(batches: list[Any]) -> list[list[int]]:
    return [list(b) for b in batches]
