"""Real torch.distributed ranks (gloo, separate processes on 127.0.0.1) sharing one dataset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from tests.support import ROOT
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_never_share_a_sample_and_agree_on_the_checkpoint(tmp_path: Path, world_size: int) -> None:
    n_samples, seq = 100, 8  # 100 samples, global batch 3 * world: a partial last step
    gl.write_stream(tmp_path / "ds", np.arange(n_samples * seq + 5, dtype=np.uint32), shard_bytes=1000)
    argv = [sys.executable, "-m", "tests.support.stream_rank", str(tmp_path / "ds")]
    run_ranks(
        world_size,
        lambda rank: [*argv, str(tmp_path / f"rank{rank}.json"), "4"],
        cwd=ROOT,
        timeout=150,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert all(r["overlaps"] == 0 for r in results)
    # every rank took the same number of steps (empty batches pad the last one)
    steps = {len(r["steps"]) for r in results}
    assert steps == {-(-n_samples // (3 * world_size))}
    seen = [i for r in results for b in r["steps"] for i in b]
    assert sorted(seen) == list(range(n_samples))
    # every rank holds the same checkpoint at the same step
    for r in results:
        assert r["states"] == results[0]["states"]
    state = results[0]["states"][0]
    assert state.pop("dataset")["observations"] == n_samples  # the fingerprint: rank-independent too
    assert state == {
        "epoch": 0,
        "observation_offset": 5 * 3 * world_size,
        "shuffle": True,
        "shuffle_seed": 17,
        "drop_last": False,
        "history": f"0:0:0:3:{world_size}",
    }
    assert all(r["epoch_after"] == 1 for r in results)
