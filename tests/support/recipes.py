"""Running the training-framework recipes of ``examples/recipes/`` as real ranks, and reading back
what each rank trained on.

Every recipe takes ``--data``, ``--checkpoint``, ``--stop-after``, ``--resume``, ``--batch-size``,
``--epochs`` and ``--record PREFIX``, and writes ``PREFIX-rank<r>.json``: the ``(epoch, sample
id)`` pairs it trained on and its loader's final state.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import ROOT
from .ranks import run_ranks

RECIPES = ROOT / "examples" / "recipes"
NUM_SAMPLES = 203  # the recipes' dataset
EPOCHS = 2  # the recipes' default


def run_recipe(
    recipe: str, world_size: int, *args: str, cwd: Path, ignore: Sequence[str] = (), timeout: float = 150
) -> list[str]:
    """Run ``examples/recipes/<recipe>`` on ``world_size`` ranks with warnings as errors, less the
    ``-W`` filters in ``ignore`` (``"ignore:message:Category"``); return each rank's output.

    Rank 0 must end with the recipe's verdict from ``loader.audit()``, ``exactly once: yes``; the
    other ranks print none."""
    argv = [sys.executable, "-W", "error", *(f"-W{w}" for w in ignore), str(RECIPES / recipe), *args]
    outputs = run_ranks(world_size, argv, cwd=cwd, timeout=timeout)
    verdicts = [[line for line in out.splitlines() if line.startswith("exactly once:")] for out in outputs]
    assert len(verdicts[0]) == 1 and verdicts[0][0].startswith("exactly once: yes ("), outputs[0]
    assert not any(verdicts[1:]), verdicts
    return outputs


def records(prefix: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{prefix}-rank{r}.json").read_text()) for r in range(world_size)]


def seen_by_epoch(*runs: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Every sample id the ranks of ``runs`` trained on, by epoch, sorted (duplicates kept)."""
    out: dict[int, list[int]] = defaultdict(list)
    for run in runs:
        for rank in run:
            for epoch, sample in rank["seen"]:
                out[epoch].append(sample)
    return {epoch: sorted(ids) for epoch, ids in sorted(out.items())}


def position(state: dict[str, Any]) -> tuple[int, int]:
    return state["epoch"], state["observation_offset"]


def check_save_then_resume(
    save: list[dict[str, Any]], resume: list[dict[str, Any]], *, saved_offset: int
) -> dict[str, Any]:
    """The checks every recipe shares; returns the loader state the first run saved.

    The saving ranks agree on the loader's state at the save, mid-epoch; the resumed ranks finish
    that epoch and the next; the two runs together trained on every sample of each epoch exactly
    once.
    """
    saved = save[0]["state"]
    assert all(rank["state"] == saved for rank in save), [rank["state"] for rank in save]
    assert position(saved) == (0, saved_offset)
    assert all(position(rank["state"]) == (EPOCHS, 0) for rank in resume)
    before = seen_by_epoch(save)
    assert list(before) == [0] and len(before[0]) == saved_offset
    assert seen_by_epoch(save, resume) == {epoch: list(range(NUM_SAMPLES)) for epoch in range(EPOCHS)}
    return saved
