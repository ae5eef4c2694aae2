"""Process workers or the collate inline (:class:`~guideloom._runtime.process_choice.ProcessChoiceRun`):
whichever the chooser picks, and however often it switches, the batches, their order, the error
at its batch and the checkpoint are those of ``num_workers=0``."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
import guideloom._runtime.chooser as choice
import guideloom._runtime.processes.session as session_module
from tests.support.data import Boom
from tests.support.loader import assert_same, take
from tests.support.processes import (
    SEQ,
    fails_at_40,
    ids,
    rich,
    worker_pids,
)
from tests.support.processes import loader_for as _loader_for


def loader_for(path: Path, collate: Any, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    """A process-workers loader that measures (``collate_mode="auto"``, asked for: by default
    process workers collate in the worker processes only)."""
    kw.setdefault("collate_mode", "auto" if kw.get("num_workers", 2) else None)
    return _loader_for(path, collate, **kw)


# The chooser decides from an epoch's first batch on: the workers are up before it.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_thread_leak", "workers_up_first")]


class Flip:
    """A chooser that switches between the workers and inline every ``every`` settled calls
    (inline: once the groups the workers had been sent are delivered)."""

    measures = True  # the workers' CPU time per batch is weighed (and settle() ignored)

    def __init__(self, every: int, workers: bool = True, held: bool = False) -> None:
        self.every, self.calls, self.workers, self.held = every, 0, workers, held

    def record(self, seconds: float, settled: bool) -> None:
        if not settled:
            return
        self.calls += 1
        if self.calls % self.every == 0:
            self.workers = not self.workers

    def held_until(self) -> float | None:
        # held: the choice stands, so inline runs its quiet stretches of untimed calls between
        # flips; else every call is timed (and flips)
        return time.perf_counter() + 100 if self.held else None

    def settle(self, workers: bool, costs: tuple[float, float] = (0.0, 0.0)) -> None:
        pass  # the flips alone decide

    def span(self, batches: int) -> None:
        pass  # counted in calls, whatever the workers' tasks hold


@pytest.fixture
def flips(monkeypatch: pytest.MonkeyPatch) -> list[Flip]:
    """Every ProcessChoiceRun gets a :class:`Flip` (switching every 1, 2, 3, ... calls in turn)."""
    made: list[Flip] = []

    def make(**_: Any) -> Flip:
        made.append(Flip(len(made) % 5 + 1))
        return made[-1]

    monkeypatch.setattr(choice, "Chooser", make)
    return made


def from_slot(batch: dict[str, Any]) -> bool:
    """Whether the batch's arrays are views of a worker's shared-memory slot."""
    owner = batch["array"]
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return isinstance(owner, ctypes.Array)


@pytest.mark.parametrize("prefetch", [0, 5, 16])
def test_switching_at_any_batch_gives_the_batches_of_num_workers_0(
    stream: Path, flips: list[Flip], prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tasks of a few batches at most: with the credits a large prefetch gives, tasks of more
    # would make the whole 66-batch epoch on the workers before a switch to inline could show
    monkeypatch.setattr(session_module, "GROUP_MOST", 4)
    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=3, local_batch_size=3) as inline:
        epochs = [take(inline) for _ in range(3)]
    loader = loader_for(stream, rich, shuffle=True, shuffle_seed=3, local_batch_size=3, prefetch=prefetch)
    with loader:
        for expected in epochs:  # three epochs: flipping every 1, 2 and 3 calls
            loader._state.life._choosers.clear()  # a chooser of its own for each epoch
            it = iter(loader)
            assert it._driver.procs is not None and it._driver.chooser is not None
            got = list(it)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert_same(a, b)
            sources = {from_slot(b) for b in got}
            assert sources == {True, False}  # some batches came from the workers, some inline
            del got, it
    assert [f.every for f in flips] == [1, 2, 3]
    assert worker_pids() == set()


@pytest.mark.parametrize("every", [1, 5])
def test_quiet_inline_stretches_between_switches_give_the_batches_of_num_workers_0(
    stream: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """A choice of inline that stands makes ``next()`` untimed for a stretch of calls; switching
    after such stretches still gives the same batches."""
    monkeypatch.setattr(choice, "Chooser", lambda **_: Flip(every, held=True))
    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=3, local_batch_size=3) as inline:
        expected = take(inline)
    with loader_for(stream, rich, shuffle=True, shuffle_seed=3, local_batch_size=3, prefetch=4) as loader:
        got = take(loader)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)
        assert {from_slot(b) for b in got} == {True, False}
        del got
    assert worker_pids() == set()


@pytest.mark.parametrize("every", [1, 4, 1000])
def test_an_epoch_that_starts_inline_gives_the_batches_of_num_workers_0(
    stream: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """A pool's chooser lasts from one epoch to the next: an epoch may start inline, before the
    workers were sent anything of it, and switch to them later (or never: every=1000)."""
    made: list[Flip] = []
    monkeypatch.setattr(choice, "Chooser", lambda **_: made.append(Flip(every, workers=False)) or made[-1])
    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=5, local_batch_size=3) as inline:
        epochs = [take(inline) for _ in range(2)]
        inline.load_state_dict({**inline.state_dict(), "observation_offset": 30})
        resumed = take(inline)
    loader = loader_for(stream, rich, shuffle=True, shuffle_seed=5, local_batch_size=3, prefetch=4)
    with loader:
        for expected in epochs:
            mode = made[0].workers if made else False  # the mode the last epoch ended in
            it = iter(loader)
            got = list(it)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert_same(a, b)
            assert from_slot(got[0]) is mode  # the epoch started in the chooser's mode
            assert {from_slot(b) for b in got} == ({False} if every == 1000 else {True, False})
            del got, it
        loader.load_state_dict({**loader.state_dict(), "observation_offset": 30})
        got = take(loader)
        assert len(got) == len(resumed)
        for a, b in zip(got, resumed, strict=True):
            assert_same(a, b)
        del got
    assert len(made) == 1  # one chooser for the loader's pool, all epochs
    assert worker_pids() == set()


def test_resume_anywhere_while_switching(stream: Path, flips: list[Flip]) -> None:
    with loader_for(stream, ids, num_workers=0, shuffle=True, shuffle_seed=8) as inline:
        expected = take(inline)
    a = loader_for(stream, ids, shuffle=True, shuffle_seed=8, prefetch=6)
    b = loader_for(stream, ids, shuffle=True, shuffle_seed=8, prefetch=2, local_batch_size=5)
    start = a.state_dict()
    flat = [i for batch in expected for i in batch]

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(stop=st.integers(0, len(expected) - 1))
    def resume(stop: int) -> None:
        a.load_state_dict(start)
        before = take(a, stop)
        b.load_state_dict(a.state_dict())
        after = [i for batch in take(b) for i in batch]
        assert before == expected[:stop]
        rest = len(flat) - 4 * stop
        assert after == flat[4 * stop : 4 * stop + rest // 5 * 5]  # another batch size: the same samples on

    with a, b:
        resume()
    assert worker_pids() == set()


@pytest.mark.parametrize(
    ("every", "held"), [(1, False), (2, False), (3, False), (4, False), (5, False), (3, True)]
)
def test_a_failure_is_raised_at_its_batch_in_either_mode(
    stream: Path, monkeypatch: pytest.MonkeyPatch, every: int, held: bool
) -> None:
    monkeypatch.setattr(choice, "Chooser", lambda **_: Flip(every, held=held))
    with loader_for(stream, fails_at_40, num_workers=0) as inline:
        it0 = iter(inline)
        before0 = []
        with pytest.raises(Boom, match="sample 40"):
            before0.extend(it0)
        n = len(before0)
        del before0, it0
    with loader_for(stream, fails_at_40, prefetch=4) as loader:
        it = iter(loader)
        got: list[Any] = []
        with pytest.raises(Boom, match="sample 40"):
            got.extend(it)
        assert len(got) == n
        assert loader.state_dict()["observation_offset"] == n * 4
        del got, it
    assert worker_pids() == set()


def test_a_collate_cheaper_than_the_transport_runs_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real chooser: a collate of microseconds costs far less inline than its trip through a
    worker process, so the epoch's batches end up made inline (and are still the same). (The
    workers' tasks are held to one batch here: the transport a batch, which is what the chooser
    weighs against the collate.)"""
    monkeypatch.setattr(session_module, "GROUP_MOST", 1)
    folder = tmp_path / "long"
    gl.write_stream(folder, np.arange(12000 * SEQ, dtype=np.int32), shard_bytes=600_000)
    with loader_for(folder, ids, num_workers=0, shuffle=True, shuffle_seed=1) as inline:
        expected = take(inline)
    modes: list[bool] = []
    with loader_for(folder, ids, shuffle=True, shuffle_seed=1, prefetch=4) as loader:
        it = iter(loader)
        assert it._driver.procs is not None and it._driver.chooser is not None
        got = []
        for batch in it:
            got.append(batch)
            modes.append(it._driver.chooser.workers)
        del it
    assert got == expected
    assert modes[0] is True  # the workers first, as asked for
    # inline once measured, and to the end (when it settles moves with the machine's load)
    assert not any(modes[-len(modes) // 5 :]), modes.count(False)
    assert worker_pids() == set()


def test_a_collate_cheaper_than_its_transport_is_settled_inline_without_a_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers report a batch's read and collate cost; once the main process spends at least
    that much CPU time in next() per batch of theirs, inline is chosen at once (Chooser.settle),
    with those two figures as the verdict's, and held. Here the workers' reports are made tiny."""
    settled: list[tuple[bool, tuple[float, float]]] = []
    real = choice.Chooser.settle

    def spy(self: Any, workers: bool, costs: tuple[float, float]) -> None:
        settled.append((workers, costs))
        real(self, workers, costs)

    monkeypatch.setattr(choice.Chooser, "settle", spy)
    monkeypatch.setattr(session_module, "_moving", lambda average, value: 1e-9)
    monkeypatch.setattr(choice, "CPU_SAMPLE", 1.0)  # every batch timed, not one in 16 at random
    folder = tmp_path / "long"
    gl.write_stream(folder, np.arange(4000 * SEQ, dtype=np.int32), shard_bytes=200_000)
    with loader_for(folder, ids, shuffle=True, shuffle_seed=1, prefetch=4) as loader:
        it = iter(loader)
        assert it._driver.procs is not None and it._driver.chooser is not None
        n = sum(1 for _ in it)
        del it
        stats = loader.stats()
    assert n > 0 and settled and not any(workers for workers, _ in settled)
    cpu, work = settled[0][1]
    assert cpu >= work == 1e-9
    assert stats["chooser_verdicts"] >= len(settled)  # later probes may have chosen since
    assert worker_pids() == set()
