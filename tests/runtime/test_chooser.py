"""The workers chooser's verdict (what ``stats()`` reports of it) and a pinned chooser."""

from __future__ import annotations

import math

import pytest

from guideloom._runtime import chooser as chooser_module
from guideloom._runtime.chooser import Chooser, PinnedChooser, Verdict


@pytest.fixture(autouse=True)
def untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chooser_module, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(chooser_module, "WARMUP_CALLS", 0)


def test_a_verdict_records_the_costs_it_compared() -> None:
    """The workers' dearer chunk against inline's cheaper one, as the choice weighs them."""
    c = Chooser(skip=0, chunk=1)
    assert c.verdict is None  # probing: nothing chosen yet
    for seconds in (2e-3, 1.1e-3, 1e-3, 1.5e-3):  # A B B A: workers, inline, inline, workers
        c.record(seconds, settled=True)
    assert c.verdict == Verdict(workers=False, workers_seconds=2e-3, inline_seconds=1e-3, made=1)


def test_verdicts_are_counted_and_a_settle_keeps_its_figures() -> None:
    c = Chooser(skip=0, chunk=1)
    c.settle(True)
    assert c.verdict is not None and c.verdict.workers and math.isnan(c.verdict.inline_seconds)
    c.settle(False, (3e-4, 1e-4))
    assert c.verdict == Verdict(False, 3e-4, 1e-4, 2)


def test_a_pinned_chooser_never_measures_or_switches() -> None:
    c = PinnedChooser(workers=True)
    for _ in range(1000):
        c.record(1.0, settled=True)  # the workers at a second a call: inline would win
    c.settle(False, (1.0, 1e-6))
    assert c.workers and c.verdict is None
    assert c.held_until() == math.inf
