"""A process worker that never reports ready fails its loader's start within a deadline: it is
stopped and the loader says so, naming it, instead of waiting for it forever."""

from __future__ import annotations

import time

import numpy as np
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
