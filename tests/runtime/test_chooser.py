"""The workers chooser's verdict (what ``stats()`` reports of it) and a pinned chooser."""

from __future__ import annotations

import contextvars
import math
import time

import pytest

from guideloom._runtime import chooser as chooser_module
from guideloom._runtime.chooser import Chooser, PinnedChooser, Verdict


@pytest.fixture(autouse=True)
def untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chooser_module, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(chooser_module, "WARMUP_CALLS", 0)


def test_a_verdict_records_the_mean_chunk_of_each_mode() -> None:
    c = Chooser(skip=0, chunk=1)
    assert c.verdict is None  # probing: nothing chosen yet
    for seconds in (2e-3, 1.1e-3, 1e-3, 1.5e-3):  # A B B A: workers, inline, inline, workers
        c.record(seconds, settled=True)
    assert c.verdict == pytest.approx(
        Verdict(workers=False, workers_seconds=1.75e-3, inline_seconds=1.05e-3, made=1)
    )


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


def probe(c: Chooser, workers: list[float], inline: list[float]) -> list[bool]:
    """Feed ``c`` chunks (of one call each, or as many as a stretched chunk takes) costing the
    next of ``workers`` or ``inline``, as its mode asks, until its probe ends; the modes of the
    chunks it took."""
    costs = {True: iter(workers), False: iter(inline)}
    modes = []
    while c.held_until() is None:
        modes.append(c.workers)
        seconds = next(costs[c.workers])
        for _ in range(c._stretch):
            c.record(seconds, settled=True)
    return modes


def test_noisy_chunks_that_overlap_extend_the_probe_and_keep_the_workers() -> None:
    """Chunks from a loaded machine: the workers cheaper on the whole (means 5.5 vs 10.2 ms, the
    later chunks four calls long) but not in each comparison (their first chunk met a burst of
    load). The probe goes on past A B B A, and the workers stay."""
    c = Chooser(skip=0, chunk=1)
    modes = probe(c, workers=[8.8e-3, 4e-3, 5e-3], inline=[8.5e-3, 8.5e-3, 11e-3])
    assert modes == [True, False, False, True, False, True]
    assert c.workers and c.verdict is not None and not math.isnan(c.verdict.workers_seconds)


def test_one_burst_does_not_end_a_probe() -> None:
    """A chunk of the workers over twice inline's (another process's burst) decides nothing on
    its own: the workers are timed again, and they are the cheaper by the means."""
    c = Chooser(skip=0, chunk=1)
    modes = probe(c, workers=[6e-3, 1e-3, 1e-3], inline=[2.6e-3, 2.7e-3, 2.8e-3])
    assert modes == [True, False, False, True, False, True]
    assert c.workers


def test_inline_cheaper_in_every_comparison_is_chosen_and_held_when_clear() -> None:
    c = Chooser(skip=0, chunk=1)
    assert probe(c, workers=[3e-3, 3.2e-3], inline=[2e-3, 2.1e-3]) == [True, False, False, True]
    assert not c.workers
    until = c.held_until()
    assert until is not None and until > time.perf_counter()


def test_overlapping_chunks_after_the_longest_probe_go_by_the_means() -> None:
    """The mean, not the median: a loaded machine's preemptions are a cost of the mode they hit
    more often."""
    c = Chooser(skip=0, chunk=1)
    probe(c, workers=[3e-3, 1e-3, 4e-3], inline=[2e-3, 2e-3, 3e-3])
    assert not c.workers  # inline's mean 2.67 ms, the workers' 3.33 ms
    c = Chooser(skip=0, chunk=1)
    probe(c, workers=[3e-3, 1e-3, 2e-3], inline=[2e-3, 2e-3, 2.2e-3])
    assert c.workers  # 2 against 2.13 ms: as good as equal, the workers were asked for
    c = Chooser(skip=0, chunk=1)
    probe(c, workers=[1.1e-3, 1e-3, 4e-3], inline=[1.05e-3, 1.05e-3, 1.05e-3])
    assert not c.workers  # the workers' median is cheaper; their mean, with one long chunk, is not


def test_a_choice_stands_ten_times_as_long_as_its_probe_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow calls make a long probe: the choice then stands long enough for probes to take a tenth
    of the time, past the usual growing holds."""
    clock = [100.0]
    monkeypatch.setattr(chooser_module.time, "perf_counter", lambda: clock[0])
    c = Chooser(skip=0, chunk=1)
    costs = {True: 0.2, False: 0.1}  # inline twice as cheap: a clear verdict after A B B A
    while c.held_until() is None:
        clock[0] += costs[c.workers]
        c.record(costs[c.workers], settled=True)
    took = 0.2 + 0.1 + 0.1 + 0.2  # the probe's four chunks
    assert c.held_until() == pytest.approx(clock[0] + took / chooser_module.PROBE_SHARE)


def test_a_pause_does_not_use_up_a_choices_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(chooser_module.time, "perf_counter", lambda: clock[0])
    c = Chooser(skip=0, chunk=4)
    c.settle(False)
    until = c.held_until()
    assert until is not None
    for s in (1e-3, 5.0, 1e-3, 1e-3):  # inline, with a pause of 5 s (an evaluation)
        clock[0] += s
        c.record(s, settled=True)
    assert c.held_until() == pytest.approx(until + 5.0)


def test_chunks_past_a_b_b_a_are_stretched() -> None:
    """Overlapping chunks: the probe's further chunks take STRETCH times the calls, and the mean
    weighs each chunk by its calls; the next probe starts with chunks of the usual length."""
    c = Chooser(skip=0, chunk=1)
    calls = []
    costs = {True: iter([3e-3, 1e-3, 2e-3]), False: iter([2e-3, 2e-3, 2.2e-3])}
    while c.held_until() is None:
        mode, n = c.workers, 0
        seconds = next(costs[mode])
        while c.workers is mode and c.held_until() is None:
            c.record(seconds, settled=True)
            n += 1
        calls.append(n)
    stretched = chooser_module.STRETCH
    assert calls == [1, 2, 1, stretched, stretched]  # calls per run of a mode: W, I I, W, I, W
    assert c._stretch == 1


def workers_in_tasks(c: Chooser, per: int, ahead: int) -> None:
    """Feed ``c`` until its probe ends: the workers make tasks of ``per`` batches (the first call
    of each waits 1.5 ms a batch for it, the others find their batch in hand), and after each
    switch to them ``ahead`` batches are in hand already (made while inline ran); inline costs
    1 ms a batch. Over whole tasks the workers cost 1.6 ms a batch: inline is the cheaper."""
    in_hand, calls, workers = ahead, 0, True
    while c.held_until() is None:
        if c.workers and not workers:
            in_hand = ahead
        workers = c.workers
        if not workers:
            c.record(1e-3, settled=True)
        elif in_hand:
            in_hand -= 1
            c.record(1e-4, settled=True)
        else:
            c.record(per * 1.5e-3 if calls % per == 0 else 1e-4, settled=True)
            calls += 1


def test_workers_whose_tasks_hold_several_batches_are_timed_over_whole_tasks() -> None:
    """Chunks of a few calls fall within the batches in hand after a switch, and find the
    workers ten times cheaper than they are; spanned over their tasks (``span``), the calls
    skipped after a switch cover what is in hand and each chunk holds whole tasks."""
    misled = Chooser(skip=3, chunk=2)
    workers_in_tasks(misled, per=4, ahead=12)
    assert misled.verdict is not None and misled.verdict.workers
    c = Chooser(skip=3, chunk=2)
    c.span(4)
    workers_in_tasks(c, per=4, ahead=12)
    assert c.verdict is not None and not c.verdict.workers
    assert c.verdict.workers_seconds == pytest.approx((4 * 1.5e-3 + 3e-4) / 4)


# -- where async for collates at prefetch=0 ----------------------------------------------------------
def test_a_loop_choice_earns_the_loop_with_cheap_calls_in_a_row_twice_as_many_after_each_slow_one() -> None:
    c = chooser_module.LoopChoice()
    cheap, slow = chooser_module.LOOP_COLLATE_S / 10, chooser_module.LOOP_COLLATE_S
    first = chooser_module.LOOP_CHEAP_CALLS
    for need in (first, 2 * first, 4 * first):
        for _ in range(need - 1):
            c.timed(cheap)
        c.timed(slow)  # a slow call on the thread: the count starts again
        assert not c.on_loop
        for _ in range(need - 1):
            c.timed(cheap)
        assert not c.on_loop
        c.timed(cheap)
        assert c.on_loop
        c.timed(slow)  # on the loop: back to the thread
        assert not c.on_loop
    for _ in range(20):  # however many slow calls on the loop, the loop is earned within the cap
        c.need = chooser_module.LOOP_MOST_CALLS
        c.on_loop = True
        c.timed(slow)
    assert c.need == chooser_module.LOOP_MOST_CALLS


def test_a_collate_is_timed_for_the_loop_choice_when_it_fails_too() -> None:
    c = chooser_module.LoopChoice()

    def fails() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        c.run(contextvars.Context(), fails)
    assert c.cheap == 1
