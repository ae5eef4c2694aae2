"""``explain()`` and ``audit()``: what each step of each rank read, after elastic resumes, and
whether the ranks together were handed every position exactly once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.audit import RankTally, audit_base, compare
from guideloom._core.plan import num_batches
from guideloom._datasets import MapDataset
from guideloom._loader.provenance import _mine


def loader(
    n: int, b: int, w: int, r: int, *, drop_last: bool, seed: int = 5
) -> gl.StatefulDataLoader[Any, Any]:
    return gl.StatefulDataLoader(
        MapDataset(list(range(n))),
        collate_fn=list,
        device=torch.device("cpu"),
        local_batch_size=b,
        world_size=w,
        rank=r,
        shuffle=True,
        shuffle_seed=seed,
        drop_last=drop_last,
    )


def run_stretch(
    n: int, b: int, w: int, steps: int | None, state: dict[str, Any] | None, *, drop_last: bool
) -> tuple[list[gl.StatefulDataLoader[Any, Any]], list[list[list[int]]], dict[str, Any]]:
    """Every rank of a ``(b, w)`` job from ``state``, ``steps`` steps (None: to the epoch's end);
    the loaders, what each rank received and the checkpoint after."""
    loaders = [loader(n, b, w, r, drop_last=drop_last) for r in range(w)]
    got: list[list[list[int]]] = [[] for _ in range(w)]
    for r, ld in enumerate(loaders):
        if state is not None:
            ld.load_state_dict(state)  # type: ignore[arg-type]
        it = iter(ld)
        for k, batch in enumerate(it):
            got[r].append(batch)
            if steps is not None and k + 1 == steps:
                break
        if ld.state_dict()["epoch"] == 0:
            it.close()
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # rank-independent, history included
    return loaders, got, dict(states[0])


geometries = st.tuples(st.integers(1, 5), st.integers(1, 4))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(40, 160),
    first=geometries,
    second=geometries,
    third=geometries,
    steps=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    drop_last=st.booleans(),
)
@pytest.mark.slow
def test_explain_of_every_step_after_two_elastic_resumes_is_what_the_ranks_received(
    n: int,
    first: tuple[int, int],
    second: tuple[int, int],
    third: tuple[int, int],
    steps: tuple[int, int],
    drop_last: bool,
) -> None:
    received: dict[tuple[int, int], list[int]] = {}
    state: dict[str, Any] | None = None
    step0 = 0
    for (b, w), k in zip((first, second, third), (*steps, None), strict=True):
        offset = 0 if state is None else state["observation_offset"]
        left = num_batches(n, b * w, drop_last, offset)
        if k is not None:  # a stretch that would end the epoch is cut short (or left out)
            k = min(k, left - 1)
            if k < 1:
                continue
        loaders, got, state = run_stretch(n, b, w, k, state, drop_last=drop_last)
        for r in range(w):
            for i, batch in enumerate(got[r]):
                received[(step0 + i, r)] = batch
        step0 += len(got[0])
    assert state["epoch"] == 1
    final = loaders[0]
    for (step, rank), batch in received.items():
        records = final.explain(step, rank=rank, epoch=0)
        assert [x["index"] for x in records] == batch
        assert all(x["step"] == step and x["rank"] == rank and x["epoch"] == 0 for x in records)
    # every step of the epoch was received by every rank of its time: nothing more to explain
    with pytest.raises(IndexError):
        final.explain(step0, rank=0, epoch=0)
    # the positions of the epoch: each once (the partial last batch pads nothing)
    positions = sorted(x["position"] for (s, r) in received for x in final.explain(s, rank=r, epoch=0))
    assert positions == list(range(len(positions)))


def test_explain_of_steps_not_taken_yet_is_what_the_loader_will_read() -> None:
    ld = loader(50, 3, 1, 0, drop_last=True)
    ahead = [ld.explain(s) for s in range(5)]
    it = iter(ld)
    assert [[x["index"] for x in recs] for recs in ahead] == [next(it) for _ in range(5)]
    it.close()


def test_explain_refuses_what_no_run_read() -> None:
    ld = loader(50, 4, 2, 0, drop_last=True)
    with pytest.raises(IndexError, match="rank 2"):
        ld.explain(0, rank=2)
    with pytest.raises(IndexError, match="6 steps"):
        ld.explain(6)
    with pytest.raises(ValueError, match="step must be"):
        ld.explain(-1)
    old = loader(50, 4, 1, 0, drop_last=True)
    old.load_state_dict(
        {"epoch": 0, "observation_offset": 8, "shuffle": True, "shuffle_seed": 5, "drop_last": True}
    )
    with pytest.raises(ValueError, match="no history before step 2"):
        old.explain(1)
    assert [x["position"] for x in old.explain(2)] == [8, 9, 10, 11]


def tallies(loaders: list[gl.StatefulDataLoader[Any, Any]]) -> list[RankTally]:
    return [_mine(ld, ld._state.ckpt) for ld in loaders]


def judge(loaders: list[gl.StatefulDataLoader[Any, Any]], n: int) -> Any:
    ld = loaders[0]
    return compare(
        tallies(loaders),
        num_observations=n,
        x=audit_base(ld._state.ckpt.epoch),
        history=ld._state.ckpt.history,
        geometry=(ld.local_batch_size, ld.world_size),
    )


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(40, 120),
    b=st.integers(1, 4),
    w=st.integers(1, 4),
    steps=st.integers(1, 6),
    fault=st.sampled_from(["none", "skip", "repeat", "extra"]),
    bad_rank=st.integers(0, 3),
)
def test_the_audit_passes_clean_runs_and_names_the_step_of_a_skipped_or_repeated_batch(
    n: int, b: int, w: int, steps: int, fault: str, bad_rank: int
) -> None:
    g = b * w
    steps = min(steps, n // g - 4)  # room for a skip and two steps more
    if steps < 1:
        return
    bad_rank %= w
    if w == 1:  # one rank agrees with itself: a fault shows only against the other ranks
        fault = "none"
    loaders, _, state = run_stretch(n, b, w, steps, None, drop_last=True)
    report = judge(loaders, n)
    assert report.ok, report
    assert report.delivered == steps * g
    # every rank resumes from the checkpoint; one of them from a wrong one (or takes a step more)
    resumed = [loader(n, b, w, r, drop_last=True) for r in range(w)]
    for r, ld in enumerate(resumed):
        mine = dict(state)
        if r == bad_rank and fault == "skip":
            mine["observation_offset"] += g
        if r == bad_rank and fault == "repeat":
            mine["observation_offset"] -= g
        ld.load_state_dict(mine)  # type: ignore[arg-type]
        it = iter(ld)
        for _ in range(2 if not (r == bad_rank and fault == "extra") else 3):
            next(it)
        it.close()
    report = judge(resumed, n)
    if fault == "none":
        assert report.ok, report
        assert (report.start, report.offset, report.delivered) == (steps * g, (steps + 2) * g, 2 * g)
        return
    assert not report.ok
    expected_step = {"skip": steps, "repeat": steps - 1, "extra": steps + 2}[fault]
    assert report.step == expected_step, report
    assert f"step {expected_step}" in report.message


def test_an_audit_without_every_rank_refuses() -> None:
    ld = loader(40, 2, 2, 0, drop_last=True)
    with pytest.raises(RuntimeError, match=r"torch\.distributed"):
        ld.audit()
    off = gl.StatefulDataLoader(MapDataset(list(range(10))), list, device="cpu", track_deliveries=False)
    with pytest.raises(RuntimeError, match="track_deliveries=True"):
        off.audit()
    np.testing.assert_equal(len(list(off)), 10)


def test_async_iteration_and_process_workers_are_tallied_and_explained() -> None:
    import asyncio

    async def run() -> list[list[int]]:
        ld = loader(60, 4, 1, 0, drop_last=True)
        got = []
        async with ld:
            async for batch in ld:
                got.append(batch)
                if len(got) == 5:
                    break
            assert ld.audit().ok and ld.audit().delivered == 20
            assert [[x["index"] for x in ld.explain(s)] for s in range(5)] == got
        return got

    assert len(asyncio.run(run())) == 5
    workers = gl.StatefulDataLoader(
        MapDataset(list(range(60))),
        list,
        device=torch.device("cpu"),
        local_batch_size=4,
        shuffle=True,
        shuffle_seed=5,
        num_workers=2,
        parallel_method="process",
        collate_mode="workers",
        prefetch=3,
    )
    with workers:
        it = iter(workers)
        got = [next(it) for _ in range(6)]
        report = workers.audit()  # the running iterator's batches so far, none prefetched
        assert report.ok and report.delivered == 24, report
        it.close()
        assert [[x["index"] for x in workers.explain(s)] for s in range(6)] == got


def test_explain_counts_one_rank_and_one_step_in_the_singular() -> None:
    ld = loader(4, 4, 1, 0, drop_last=True)  # one rank, one step an epoch
    with pytest.raises(IndexError, match=r"step 0 ran on 1 rank$"):
        ld.explain(0, rank=1)
    with pytest.raises(IndexError, match=r"which has 1 step$"):
        ld.explain(1)
