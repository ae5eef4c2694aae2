"""Thread workers fed from the caller's thread (``guideloom._runtime.threads``):
the same batches in the same order, errors at their batch, nothing collated beyond the
prefetch bound, whichever mode (workers or inline) each ``next()`` runs in."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.plan import EpochPlan, Permutation
from guideloom._runtime import chooser as _thread_workers
from guideloom._runtime.chooser import Chooser as _Chooser
from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.drive import SyncDriver
from guideloom._runtime.executors import Threads
from tests.support.data import Boom, identity_stream, ids


class FailingReads(gl.MemoryStreamStorage):
    """Fails every read that includes element ``bad``."""

    def __init__(self, tokens: Any, bad: int) -> None:
        super().__init__(tokens)
        self.bad = bad

    def read_many_sync(self, starts: Any, length: int) -> Sequence[Any]:
        if self.bad in starts.tolist():
            raise OSError(f"bad read at {self.bad}")
        return super().read_many_sync(starts, length)


class Counting:
    """Collate to the observation ids; counts the calls, raises at observation ``fail``."""

    def __init__(self, fail: int | None) -> None:
        self.fail = fail
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        with self.lock:
            self.calls += 1
        ids = [int(s[0]) for s in samples]
        if self.fail in ids:
            raise Boom(self.fail)
        return ids


class Flipping(_Chooser):
    """Switches mode every ``every`` calls, whatever they cost (every transition exercised)."""

    def __init__(self, every: int, start_workers: bool, held: bool = False) -> None:
        super().__init__(skip=0, chunk=1)
        self.every, self.calls, self.workers, self.held = every, 0, start_workers, held

    def record(self, seconds: float, settled: bool) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self.workers = not self.workers

    def held_until(self) -> float | None:
        """``held``: the choice stands, so inline runs its quiet stretches of untimed calls."""
        return time.perf_counter() + 100 if self.held else None


def config(
    storage: gl.MemoryStreamStorage, collate: Any, n: int, batch: int, nw: int, prefetch: int
) -> PipelineConfig:
    return PipelineConfig(
        dataset=gl.StreamDataset(storage, 1),
        plan=EpochPlan(n, batch, 1, 0, drop_last=False, start_offset=0),
        order=Permutation(n, shuffle=True, seed=5, epoch=0),
        collate_fn=collate,
        device=torch.device("cpu"),
        pin_memory=False,
        num_workers=nw,
        parallel_method="thread",
        prefetch=prefetch,
    )


class Given:
    """The loader's choosers, as a driver finds them: this one chooser for every kind."""

    def __init__(self, chooser: _Chooser) -> None:
        self._chooser = chooser

    def chooser(self, kind: str, make: Any, *, fresh: bool = False) -> _Chooser:
        return self._chooser


def inline(cfg: PipelineConfig) -> SyncDriver:
    """The epoch of ``cfg`` made inline (no worker, nothing ahead)."""
    return SyncDriver(dataclasses.replace(cfg, num_workers=0, prefetch=0), None)


def drain(next_: Any) -> list[tuple[Any, str | None]]:
    out = []
    while (d := next_()) is not None:
        out.append((d.value, None if d.error is None else f"{type(d.error).__name__}{d.error.args}"))
        if d.error is not None:
            break
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 6),
    nw=st.integers(1, 3),
    prefetch=st.integers(0, 12),
    every=st.integers(1, 9),
    start_workers=st.booleans(),
    held=st.booleans(),
    fail=st.one_of(st.none(), st.tuples(st.sampled_from(["collate", "read"]), st.integers(0, 299))),
)
def test_same_batches_order_and_errors_as_inline_in_either_mode(
    n: int,
    batch: int,
    nw: int,
    prefetch: int,
    every: int,
    start_workers: bool,
    held: bool,
    fail: tuple[str, int] | None,
) -> None:
    """Against the inline pipeline: exactly the same deliveries, the failure at its batch and
    nothing after it, and never more than ``prefetch + num_workers`` batches collated beyond
    the consumer's requests, with modes switching every few batches."""
    bad_collate = fail[1] if fail is not None and fail[0] == "collate" else None
    bad_read = fail[1] if fail is not None and fail[0] == "read" else -1

    def storage() -> gl.MemoryStreamStorage:
        return FailingReads(np.arange(n), bad_read)

    expected = drain(inline(config(storage(), Counting(bad_collate), n, batch, nw, prefetch)).next)
    collate = Counting(bad_collate)
    cfg = config(storage(), collate, n, batch, nw, prefetch)
    pipe = SyncDriver(cfg, Given(Flipping(every, start_workers, held)))
    got = []
    while (d := pipe.next()) is not None:
        got.append((d.value, None if d.error is None else f"{type(d.error).__name__}{d.error.args}"))
        time.sleep(0)  # let the workers run ahead as far as they may
        with collate.lock:
            assert collate.calls <= len(got) + cfg.capacity
        if d.error is not None:
            break
    pipe.close()
    assert got == expected


def test_the_chooser_keeps_the_cheaper_mode_and_probes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fed made-up timings: the chooser's decisions, probe by probe."""
    monkeypatch.setattr(_thread_workers, "REPROBE_SECONDS", 0.05)
    monkeypatch.setattr(_thread_workers, "FIRST_REPROBE_SECONDS", 0.05)
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    c = _Chooser(skip=2, chunk=4)

    def chunk(workers: bool, seconds: float, skip: bool = False) -> None:
        assert c.workers is workers
        for _ in range(6 if skip else 4):  # after a switch, 2 calls are not counted
            c.record(seconds, settled=True)

    chunk(True, 1e-3, skip=True)  # workers first, as asked for
    c.record(1.0, settled=False)  # not counted (the queue still held the other mode's work)
    chunk(False, 7e-4, skip=True)  # a close call (under DECISIVE): the whole A B B A order
    chunk(False, 6e-4)
    chunk(True, 1e-3, skip=True)  # A B B A: a drift weighs on both
    assert not c.workers  # inline was cheaper: kept
    for _ in range(10):
        c.record(6e-4, settled=True)
    assert not c.workers  # until the reprobe time
    time.sleep(0.06)
    for _ in range(4):  # the end of the chunk under way
        if c.workers:
            break
        c.record(6e-4, settled=True)
    chunk(True, 4e-4, skip=True)  # workers probed again, and now cheaper (a step that
    chunk(True, 4e-4)  # releases the GIL, during which the workers collate)
    chunk(False, 6e-4, skip=True)  # the chosen mode's chunk after the probe
    assert c.workers
    for _ in range(10):
        c.record(4e-4, settled=True)
    assert c.workers


def test_a_probe_ends_once_one_mode_is_decisively_cheaper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers four times as costly as inline. The first probe runs its whole A B B A order (one
    chunk of the workers may be a burst of another process's load); a later probe ends once the
    workers are timed twice, without the last chunk of inline."""
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    monkeypatch.setattr(_thread_workers, "FIRST_REPROBE_SECONDS", 0.0)  # probe again at once
    monkeypatch.setattr(_thread_workers, "PROBE_SHARE", float("inf"))
    c = _Chooser(skip=0, chunk=2)
    modes = []
    for _ in range(16):
        modes.append(c.workers)
        c.record(4e-3 if c.workers else 1e-3, settled=True)
    t, f = [True] * 2, [False] * 2
    assert modes == t + f + f + t + f + t + t + f


def test_the_warm_up_runs_on_the_workers_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 5)
    c = _Chooser(skip=1, chunk=2)
    modes = []
    for _ in range(10):
        modes.append(c.workers)
        c.record(1e-3 if c.workers else 1e-4, settled=True)
    assert modes == [True] * 8 + [False] * 2  # 5 warm-up calls, a skip, a chunk; then inline


def test_inline_goes_ahead_only_when_it_is_cheaper_by_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers were asked for: inline 3% cheaper is as good as equal, 10% cheaper is chosen."""
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    for inline, kept in ((0.97e-3, True), (0.9e-3, False)):
        c = _Chooser(skip=0, chunk=1)
        for _ in range(10):
            c.record(1e-3 if c.workers else inline, settled=True)
        assert c.workers is kept, inline


def test_a_chunk_lasts_at_least_chunk_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    c = _Chooser(skip=0, chunk=1)
    for _ in range(int(_thread_workers.CHUNK_SECONDS / 1e-5) - 1):
        c.record(1e-5, settled=True)  # cheap calls: not yet a chunk's worth of time
    assert c.workers
    c.record(2e-5, settled=True)
    assert not c.workers  # the first chunk (workers) is done: inline next


def test_a_collate_that_releases_the_gil_runs_on_the_workers() -> None:
    """Two workers sleeping 2 ms a batch deliver twice as fast as one inline: after the probes
    the workers collate; the inline probe is all the caller's thread collates."""
    names: list[str] = []

    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        names.append(threading.current_thread().name)
        time.sleep(0.002)  # releases the GIL, as numpy and torch do
        return [int(s[0]) // 4 for s in samples]

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(2000), collate, sequence_length=4, local_batch_size=2, num_workers=2, prefetch=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    with loader:
        it = iter(loader)
        assert isinstance(it._driver.flow.workers, Threads)
        got = [i for b in it for i in b]
    assert got == list(range(2000))
    on_workers = sum(n.startswith("guideloom-collate") for n in names)
    assert on_workers >= 0.75 * len(names), (on_workers, len(names))


def test_closing_from_another_thread_while_waiting_for_a_worker() -> None:
    started = threading.Event()

    def slow(samples: Sequence[np.ndarray]) -> list[int]:
        started.set()
        time.sleep(0.05)
        return [int(s[0]) // 4 for s in samples]

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400), slow, sequence_length=4, local_batch_size=2, num_workers=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    with loader:
        it = iter(loader)
        got = []
        closer = threading.Timer(0.3, it.close)
        closer.start()
        for b in it:
            got.append(b)
        closer.join()
        assert 0 < len(got) < 200
        assert loader.state_dict()["observation_offset"] == 2 * len(got)


def test_a_clear_choice_stands_longer_than_a_close_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    first = _thread_workers.FIRST_REPROBE_SECONDS
    intervals = {}
    for ratio in (1.2, 4.0):  # inline 1.2x and 4x cheaper than the workers
        c = _Chooser(skip=0, chunk=1)
        for _ in range(4):
            c.record(1e-3 if c.workers else 1e-3 / ratio, settled=True)
        assert not c.workers
        intervals[ratio] = c._interval  # twice the hold
    assert intervals == {1.2: 2 * first, 4.0: 16 * first}


def test_a_repeated_verdict_stands_longer_than_a_changed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each close choice stands twice as long as the one before, four times once a probe repeats
    the verdict before it; a changed verdict grows by two again."""
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    first = _thread_workers.FIRST_REPROBE_SECONDS
    c = _Chooser(skip=0, chunk=1)
    holds = []
    for workers in (False, False, False, True):
        c._choose(workers, clear=False)
        holds.append(c._interval)
    assert holds == pytest.approx([2 * first, 8 * first, 32 * first, 64 * first])


class SlowReads(gl.MemoryStreamStorage):
    """Every read takes 20 ms, as a window of many batches read in one call may."""

    def read_many_sync(self, starts: Any, length: int) -> Sequence[Any]:
        time.sleep(0.02)
        return super().read_many_sync(starts, length)


class Recording(_Chooser):
    """Records what the pipeline reports, in inline mode throughout."""

    def __init__(self) -> None:
        super().__init__(skip=0, chunk=1)
        self.workers = False
        self.seen: list[float] = []

    def record(self, seconds: float, settled: bool) -> None:
        self.seen.append(seconds)


def test_the_chooser_is_not_charged_for_reads() -> None:
    """Both modes read the same windows in the caller's thread: the cycles the chooser weighs
    leave the reads out, so a slow window read does not decide against the chunk it falls in."""
    chooser = Recording()
    cfg = config(SlowReads(np.arange(64)), Counting(None), 64, 2, 2, 2)
    pipe = SyncDriver(cfg, Given(chooser))
    while pipe.next() is not None:
        pass
    pipe.close()
    assert len(chooser.seen) >= 30
    assert max(chooser.seen) < 0.015, chooser.seen  # each read alone takes 20 ms


def test_a_chunk_that_one_pause_dominates_is_dropped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer stopped for a while (an evaluation, a checkpoint) during an inline chunk: that
    chunk decides nothing; a second one in a row counts, pause or not."""
    monkeypatch.setattr(_thread_workers, "CHUNK_SECONDS", 0.0)
    monkeypatch.setattr(_thread_workers, "WARMUP_CALLS", 0)
    c = _Chooser(skip=0, chunk=4)
    for _ in range(4):
        c.record(2e-3, settled=True)  # the workers' chunk
    assert not c.workers
    for s in (1e-3, 1.0, 1e-3, 1e-3):  # inline, with one pause of a second
        c.record(s, settled=True)
    assert not c.workers  # dropped (counted, its 0.25 s a call would have sent it back to the workers)
    for _ in range(4):
        c.record(1e-3, settled=True)  # inline's first chunk that counts
    assert not c.workers
    c.settle(True)
    for s in (2e-3, 1.0, 2e-3, 2e-3):
        c.record(s, settled=True)
    assert c.workers and c.held_until() is not None  # settled and held: the pause changed nothing


def test_settle_ends_a_probe_with_a_held_choice() -> None:
    c = _Chooser(skip=0, chunk=4)
    assert c.held_until() is None  # probing from the start
    c.settle(False)
    until = c.held_until()
    assert not c.workers and until is not None and until > time.perf_counter()


def test_a_loaders_chooser_lasts_from_one_epoch_to_the_next() -> None:
    """What one epoch learnt holds for the next: its chooser, in the mode it ended in, and the
    batches are those of num_workers=0 either way."""

    kw: dict[str, Any] = {"sequence_length": 4, "local_batch_size": 2, "shuffle": True, "shuffle_seed": 2}
    with gl.StatefulDataLoader.from_storage(identity_stream(400), ids, **kw) as inline:
        expected = [list(inline), list(inline)]
    loader = gl.StatefulDataLoader.from_storage(identity_stream(400), ids, num_workers=2, **kw)
    choosers, starts, ends = [], [], []
    with loader:
        for epoch in expected:
            it = iter(loader)
            assert isinstance(it._driver.flow.workers, Threads)
            got = [next(it)]
            choosers.append(it._driver.chooser)
            starts.append(choosers[-1].workers)
            got.extend(it)
            assert got == epoch
            ends.append(choosers[-1].workers)
            del it
    assert choosers[0] is choosers[1]
    assert starts[1] is ends[0]  # epoch 2 began in the mode epoch 1 ended in
