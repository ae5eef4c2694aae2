"""A local stream and collates for the process-worker tests (``parallel_method="process"``).

The collates are module-level: the workers, forked from the fork server, unpickle them by their
module path. In the stream, sample ``i`` starts with element ``i * SEQ``.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom._runtime.processes import WorkerPool, live_segments
from tests.support.data import ids

from .data import Boom

SEQ = 64


@pytest.fixture
def workers_up_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pool's workers are up before an iterator's first batch, as they are from a loader's
    second epoch on: for tests of what crosses from a worker, whose batches must all come from
    the workers (by default a loader makes its first batches itself while they start). A start
    that fails still raises at the first batch."""
    begin = WorkerPool.begin

    def begin_and_wait(self: WorkerPool) -> None:
        begin(self)
        starter = self._starter
        if starter is not None:
            starter.join()

    monkeypatch.setattr(WorkerPool, "begin", begin_and_wait)


@pytest.fixture
def own_segments(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """The live ``/dev/shm`` segments of the pools this test made. Only those: another session's
    tests may hold segments of their own meanwhile. Fails if the test made no pool at all."""
    tokens: list[str] = []
    init = WorkerPool.__init__

    def recording(self: WorkerPool, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        tokens.append(self.token)

    monkeypatch.setattr(WorkerPool, "__init__", recording)

    def live() -> list[str]:
        assert tokens, "the test made no worker pool: its leak check would prove nothing"
        return [name for token in tokens for name in live_segments(token + "-")]

    return live


def write_positions(folder: Path, n_samples: int = 200, shard_bytes: int = 20_000) -> Path:
    """A local stream of ``n_samples`` samples whose elements are their own positions."""
    gl.write_stream(folder, np.arange(n_samples * SEQ, dtype=np.int32), shard_bytes=shard_bytes)
    return folder


def rich(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """A collate whose batch holds what travels through shared memory (large tensors and arrays,
    bfloat16 too) and what travels pickled (small tensors, plain objects)."""
    block = np.stack([np.asarray(s) for s in samples]).astype(np.int64)
    big = np.tile(block, (1, 16))  # (4, 1024): 32 KiB, well above the 4 KiB threshold
    return {
        "tokens": torch.from_numpy(big),
        "half": torch.from_numpy(big).to(torch.bfloat16),
        "array": big.astype(np.float32),
        "transposed": torch.from_numpy(big).t(),  # not contiguous
        "small": torch.from_numpy(block[:, :2].copy()),
        "ids": [int(s[0]) // SEQ for s in samples],
        "same": (torch.from_numpy(big),) * 2,
    }


def fails_at_40(samples: Sequence[np.ndarray]) -> torch.Tensor:
    if any(int(s[0]) // SEQ == 40 for s in samples):
        raise Boom("sample 40")
    return torch.from_numpy(np.tile(np.stack(samples).astype(np.int64), (1, 16)))  # shared memory


def exits_at_40(samples: Sequence[np.ndarray]) -> list[int]:
    """A collate that kills its worker process at sample 40, as an out-of-memory kill would."""
    if any(int(s[0]) // SEQ == 40 for s in samples):
        os._exit(3)
    return ids(samples)


def loader_for(path: Path, collate: Any, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("num_workers", 2)
    kw.setdefault("local_batch_size", 4)
    return gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        collate,
        sequence_length=SEQ,
        parallel_method="process",
        device=torch.device("cpu"),
        **kw,
    )


def worker_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("guideloom-worker")}


#: Held by a thread of the main process in a test: a worker that inherited it held would wait.
HELD = threading.Lock()


def takes_the_lock(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """In a worker: take :data:`HELD` (fails after 10 s if it is held there); the batch says
    which process made it. Inline, where a test holds it, the lock is not taken."""
    if multiprocessing.current_process().name.startswith("guideloom-worker"):
        if not HELD.acquire(timeout=10):
            raise RuntimeError("the worker's copy of the lock is held: it inherited the main process's")
        HELD.release()
    return collated_where(samples)


def collated_where(samples: Sequence[Any]) -> dict[str, Any]:
    """A collate that says which process ran it, beside the stacked samples."""
    return {"pid": os.getpid(), "tokens": torch.from_numpy(np.stack(samples).astype(np.int64))}


def run_script(
    script: Path, *args: str, check: bool = True, buffered: bool = False, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter that imports this checkout's guideloom, its output
    captured as text; ``buffered``: its stdout block-buffered (PYTHONUNBUFFERED unset), as a
    script's is when it writes to a pipe."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run(
        [sys.executable, str(script), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if check and done.returncode:
        raise AssertionError(
            f"{script.name} exited with {done.returncode}\n"
            f"--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
        )
    return done


def stuck_forever(samples: Sequence[np.ndarray]) -> list[int]:
    """A collate that never returns from its second batch on (a deadlock in a worker)."""
    if int(samples[0][0]) // SEQ >= 4:
        while True:
            time.sleep(1)
    return ids(samples)


class CollateWarning(UserWarning):
    """What :func:`warning_ids` warns with, for every batch."""


def warning_ids(samples: Sequence[Any]) -> list[int]:
    """:func:`ids`, warning with :class:`CollateWarning` first."""
    warnings.warn("a batch the collate finds odd", CollateWarning, stacklevel=1)
    return ids(samples)
