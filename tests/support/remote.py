"""What the object-store tests share: one dataset in several places, a loader over it, proxies
started for a test (two runs' batches are compared with ``loader.assert_same``).

The servers themselves are in ``guideloom_dev.servers``; the session-wide fixtures that start them
are in ``tests/storage/remote/conftest.py``. ``collate`` is module-level: process workers unpickle
it by its module path."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guideloom import StatefulDataLoader
from guideloom_dev.servers import FaultProxy

BUCKET = "guideloom-test"
_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


@dataclass
class Copies:
    """One dataset in three places: a local folder, an S3 prefix and an nginx-served folder."""

    local: Path
    s3_url: str
    http_path: str  # path under the nginx root
    tokens: np.ndarray
    meta: np.ndarray | None = None


def start_proxy(started: list[FaultProxy], upstream_port: int, **kwargs: float) -> FaultProxy:
    p = FaultProxy(upstream_port, lifetime=kwargs.pop("lifetime", 100.0), **kwargs).start()
    started.append(p)
    return p


CPU = torch.device("cpu")


def collate(samples: Sequence[Any]) -> Any:
    if isinstance(samples[0], dict):
        return {k: torch.from_numpy(np.stack([s[k] for s in samples]).astype(np.int64)) for k in samples[0]}
    return torch.from_numpy(np.stack(samples).astype(np.int64))


def loader_over(storage: Any, **kwargs: Any) -> StatefulDataLoader[Any, Any]:
    kwargs.setdefault("sequence_length", 100)
    kwargs.setdefault("local_batch_size", 4)
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("shuffle_seed", 7)
    return StatefulDataLoader.from_storage(storage, kwargs.pop("collate_fn", collate), device=CPU, **kwargs)


def all_batches(storage: Any, **kwargs: Any) -> list[Any]:
    with loader_over(storage, **kwargs) as loader:
        return list(loader)


async def all_batches_async(storage: Any, **kwargs: Any) -> list[Any]:
    out = []
    async with loader_over(storage, **kwargs) as loader:
        async for b in loader:
            out.append(b)
    return out
