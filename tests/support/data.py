"""Identity datasets and storages, and the collate functions the loader tests pass.

In an identity stream element ``i`` is ``i``, so a sample's first element tells which sample it
is. Every collate here is module-level: process workers unpickle it by its module path.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import guideloom as gl


def identity_stream(n_samples: int, sequence_length: int = 4, extra: int = 0) -> gl.MemoryStreamStorage:
    return gl.MemoryStreamStorage(np.arange(n_samples * sequence_length + extra, dtype=np.int64))


class IdsOf:
    """Picklable collate that maps samples of an identity stream to their indexes."""

    def __init__(self, sequence_length: int) -> None:
        self.sequence_length = sequence_length

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        return [int(s[0]) // self.sequence_length for s in samples]


class IdsWhere(IdsOf):
    """:class:`IdsOf` that also records, in ``names``, the thread each call ran on."""

    def __init__(self, sequence_length: int) -> None:
        super().__init__(sequence_length)
        self.names: list[str] = []

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        self.names.append(threading.current_thread().name)
        return super().__call__(samples)


def ids(samples: Sequence[np.ndarray]) -> list[int]:
    """Collate: the indexes of the samples of a stream whose elements are their own positions
    (sample ``k`` of length ``n`` starts with element ``k * n``)."""
    return [int(s[0]) // len(s) for s in samples]


def slow_ids(samples: Sequence[np.ndarray]) -> list[int]:
    """The indexes of the samples of a stream whose elements are their own positions (an identity
    stream, or the process tests' positions): sample ``k`` of length ``n`` starts with element
    ``k * n``. 20 ms a batch, so that an epoch is still running when a test acts on it."""
    time.sleep(0.02)
    return [int(s[0]) // len(s) for s in samples]


def die(samples: Sequence[np.ndarray]) -> list[int]:
    """A collate that kills its worker process, as an out-of-memory kill would."""
    if any(int(s[0]) >= 40 for s in samples):
        os._exit(3)
    return [int(s[0]) for s in samples]


def stack_collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """Stack 1-D samples into an int64 tensor; an empty list gives a (0, 0) tensor."""
    if len(samples) == 0:
        return torch.empty((0, 0), dtype=torch.int64)
    return torch.from_numpy(np.stack(samples).astype(np.int64))


class Tracked(gl.MemoryStreamStorage):
    """Records when the loader opens and closes it."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.events: list[str] = []

    async def open(self) -> None:
        self.events.append("open")

    async def close(self) -> None:
        self.events.append("close")


class Boom(Exception):
    """The error a test's collate or storage raises on purpose."""


class FailingStorage(gl.MemoryStreamStorage):
    """Fails the reads that include the sample starting at ``bad_start``."""

    def __init__(self, tokens: npt.ArrayLike, bad_start: int) -> None:
        super().__init__(tokens)
        self.bad_start = bad_start

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        if self.bad_start in starts.tolist():
            raise OSError(f"disk error at {self.bad_start}")
        return await super().read_many(starts, length)


class NeverOpens(gl.MemoryStreamStorage):
    """A storage whose ``open()`` never returns in another process than the one that made it:
    a process worker that opens it never reports ready."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.maker = os.getpid()

    async def open(self) -> None:
        if os.getpid() != self.maker:
            await asyncio.sleep(3600)
        await super().open()
