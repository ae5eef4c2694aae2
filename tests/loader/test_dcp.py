"""torch.distributed.checkpoint with the loader: 2 gloo ranks save mid-epoch, 3 ranks resume.

Runs ``examples/dcp_resume.py`` (the example the checkpointing page shows) as real rank
processes, started the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
``tests/loader/test_distributed.py`` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import FileSystemReader

from tests.support import ROOT
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


EXAMPLE = ROOT / "examples" / "dcp_resume.py"
NUM_SAMPLES = 1_001  # the example's dataset


def run_example(world_size: int, *args: str, cwd: Path) -> None:
    for rank, out in enumerate(run_ranks(world_size, [sys.executable, str(EXAMPLE), *args], cwd=cwd)):
        assert "Warning" not in out, f"rank {rank} of {world_size} warned:\n{out}"


def flat_keys(state: dict[str, Any], prefix: str) -> list[str]:
    """The entry names DCP gives a nested state dict (``loader.epoch``, ``loader.a.b``...)."""
    keys = []
    for key, value in state.items():
        if isinstance(value, dict):
            keys += flat_keys(value, f"{prefix}.{key}")
        else:
            keys.append(f"{prefix}.{key}")
    return keys


def read(ckpt: Path, run: str, world_size: int) -> list[dict[str, Any]]:
    return [
        json.loads((ckpt.parent / f"{ckpt.name}.seen-{run}-rank{r}.json").read_text())
        for r in range(world_size)
    ]


def test_two_ranks_save_three_ranks_resume_every_sample_once(tmp_path: Path) -> None:
    data, ckpt, steps = tmp_path / "corpus", tmp_path / "ckpt", 7
    run_example(2, "--data", str(data), "--checkpoint", str(ckpt), "--steps", str(steps), cwd=tmp_path)
    saved = read(ckpt, "save", 2)
    # the state is rank-independent: every rank holds the same checkpoint
    assert saved[0]["state"] == saved[1]["state"]
    state = saved[0]["state"]
    assert {k: state[k] for k in ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")} == {
        "epoch": 0,
        "observation_offset": steps * 4 * 2,
        "shuffle": True,
        "shuffle_seed": 1234,
        "drop_last": False,
    }
    # a DCP checkpoint, with each of the loader's entries stored once
    entries = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert sorted(entries) == sorted(flat_keys(saved[0]["state"], "loader"))

    run_example(3, "--data", str(data), "--checkpoint", str(ckpt), "--resume", cwd=tmp_path)
    resumed = read(ckpt, "resume", 3)
    before = [i for r in saved for i in r["seen"]]
    after = [i for r in resumed for i in r["seen"]]
    assert len(before) == steps * 4 * 2
    assert sorted(before + after) == list(range(NUM_SAMPLES))  # each sample exactly once
    assert all(r["state"]["epoch"] == 1 for r in resumed)
    # DCP carried the history over: the resumed epoch's steps are numbered on from the saved one's
    assert resumed[0]["state"]["history"] == f"0:0:0:4:2;0:{steps * 8}:{steps}:4:3"
