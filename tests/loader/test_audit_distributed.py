"""``audit()`` across real torch.distributed ranks (gloo, separate processes on 127.0.0.1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    ("world_size", "fault", "bad_rank", "step"),
    [(2, "none", 0, None), (3, "skip", 1, 4), (2, "repeat", 1, 3), (3, "extra", 2, 6)],
)
def test_the_ranks_audit_passes_a_clean_run_and_names_the_step_a_rank_went_wrong(
    tmp_path: Path, world_size: int, fault: str, bad_rank: int, step: int | None
) -> None:
    argv = [sys.executable, "-m", "tests.support.audit_rank"]
    run_ranks(world_size, lambda r: [*argv, str(tmp_path / f"rank{r}.json"), fault, str(bad_rank)], cwd=ROOT)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    g = 3 * world_size
    for report in reports:
        assert report["first"]["ok"], report["first"]
        assert report["first"]["delivered"] == 4 * g
        assert report == reports[0]  # every rank reaches the same verdict
    second = reports[0]["second"]
    if fault == "none":
        assert second["ok"], second
        assert (second["start"], second["offset"], second["delivered"]) == (4 * g, 6 * g, 2 * g)
    else:
        assert not second["ok"]
        assert second["step"] == step, second
        assert f"step {step}" in second["message"]
