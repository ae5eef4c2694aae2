"""Mixture weights on a schedule (``WeightSchedule``): every prefix holds each source within the
documented bound of its weight's integral, each source's stream is read once in order, and a
resume on another geometry reads what the run would have."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._datasets.mixture.schedule import Layout
from guideloom._datasets.mixture.scheduled import ScheduledLayout

weights = st.lists(st.sampled_from([0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 0.3333, 1.7]), min_size=2, max_size=5)


@settings(max_examples=60, deadline=None)
@given(
    n_sources=st.integers(2, 5),
    knots=st.lists(st.tuples(st.integers(1, 400), weights), min_size=1, max_size=4),
    first=weights,
    interpolation=st.sampled_from(["constant", "linear"]),
    lengths=st.lists(st.integers(1, 300), min_size=5, max_size=5),
)
def test_every_prefix_is_within_the_bound_of_the_integral_and_each_source_reads_its_stream_once(
    n_sources: int,
    knots: list[tuple[int, list[float]]],
    first: list[float],
    interpolation: Any,
    lengths: list[int],
) -> None:
    names = [f"s{i}" for i in range(n_sources)]

    def named(w: list[float]) -> dict[str, float]:
        return {n: w[i % len(w)] * (1 + 0.01 * i) for i, n in enumerate(names)}

    position, pairs = 0, [(0, named(first))]
    for gap, w in knots:
        position += gap
        pairs.append((position, named(w)))
    schedule = gl.WeightSchedule(pairs, interpolation=interpolation)
    layout = ScheduledLayout.build(lengths[:n_sources], schedule, names)
    horizon = position + 300
    src, cum = layout.locate(np.arange(horizon, dtype=np.int64))
    counts = np.zeros((horizon + 1, n_sources), dtype=np.int64)
    np.add.at(counts, (np.arange(1, horizon + 1), src), 1)
    counts = np.cumsum(counts, axis=0)
    bounds = layout.bounds
    for p in range(horizon + 1):
        assert (np.abs(counts[p] - layout.integral(p)) <= bounds + 1e-9).all(), (
            p,
            counts[p],
            layout.integral(p),
        )
        if p % 37 == 0:
            np.testing.assert_array_equal(layout.counts(p), counts[p])
    for s in range(n_sources):  # the source's stream: counts 0, 1, 2, ... each once
        assert sorted(cum[src == s].tolist()) == list(range(int(counts[-1][s])))
    assert (bounds <= 3.5).all()


def test_within_a_constant_piece_the_bound_is_the_constant_mixtures() -> None:
    schedule = gl.WeightSchedule([(0, {"a": 0.7, "b": 0.3}), (1000, {"a": 0.2, "b": 0.8})])
    layout = ScheduledLayout.build([50, 50], schedule, ["a", "b"])
    # a period of 10 divides the first piece: the second starts without drift, so the bound is
    # the larger of the two constant schedules'
    constant = [
        Layout.build([50, 50], [0.7, 0.3], 1000).bounds,
        Layout.build([50, 50], [0.2, 0.8], 1000).bounds,
    ]
    np.testing.assert_array_equal(layout.bounds, np.maximum(*constant))


def make(schedule: gl.WeightSchedule, b: int, w: int, r: int) -> gl.StatefulDataLoader[Any, Any]:
    web = gl.MemoryStreamStorage(np.arange(3000, dtype=np.uint16))
    code = gl.MemoryDocumentStorage([np.full(3, i, dtype=np.uint16) for i in range(120)])
    m = gl.mix({"web": web, "code": code}, schedule, sequence_length=10, num_samples=150, with_source=True)
    return gl.StatefulDataLoader(
        m,
        list,
        device=torch.device("cpu"),
        local_batch_size=b,
        world_size=w,
        rank=r,
        shuffle=True,
        shuffle_seed=2,
    )


def key(sample: tuple[str, np.ndarray]) -> tuple[str, int]:
    return sample[0], int(np.asarray(sample[1])[0])


def test_a_resume_on_another_geometry_reads_what_the_run_would_have() -> None:
    schedule = gl.WeightSchedule(
        [(0, {"web": 0.9, "code": 0.1}), (100, {"web": 0.4, "code": 0.6}), (250, {"web": 0.5, "code": 0.5})],
        interpolation="linear",
    )
    straight = make(schedule, 6, 1, 0)
    whole = [key(x) for _ in range(2) for batch in straight for x in batch]
    first = make(schedule, 3, 2, 0)
    it = iter(first)
    for _ in range(7):
        next(it)
    it.close()
    state = first.state_dict()
    resumed = [make(schedule, 5, 3, r) for r in range(3)]
    for ld in resumed:
        ld.load_state_dict(state)
    rest: list[tuple[str, int]] = []
    iters = [iter(ld) for ld in resumed]
    for batches in zip(*iters, strict=True):
        rest += [key(x) for batch in batches for x in batch]
    assert len(rest) == (150 - 42) // 15 * 15
    assert rest == whole[42 : 42 + len(rest)]  # the rest of epoch 0: the same samples, in order
    # epoch 1 begins at global position 150: a third of the way down the second ramp
    stats = resumed[0].stats()
    assert stats["weight/code"] == pytest.approx(0.6 - 0.1 / 3)
    assert stats["drawn/code"] == pytest.approx(sum(name == "code" for name, _ in whole[:150]) / 150)


def test_the_fingerprint_holds_the_schedule() -> None:
    a = gl.WeightSchedule([(0, {"web": 0.9, "code": 0.1}), (100, {"web": 0.4, "code": 0.6})])
    b = gl.WeightSchedule([(0, {"web": 0.9, "code": 0.1}), (101, {"web": 0.4, "code": 0.6})])
    fa, fb = make(a, 2, 1, 0).state_dict()["dataset"], make(b, 2, 1, 0).state_dict()["dataset"]
    assert fa["digest"] != fb["digest"]


def test_a_schedule_is_checked() -> None:
    with pytest.raises(ValueError, match="position 0"):
        gl.WeightSchedule([(5, {"a": 1.0})])
    with pytest.raises(ValueError, match="increase"):
        gl.WeightSchedule([(0, {"a": 1.0}), (0, {"a": 2.0})])
    with pytest.raises(ValueError, match="same sources"):
        gl.WeightSchedule([(0, {"a": 1.0}), (3, {"b": 2.0})])
    with pytest.raises(ValueError, match="interpolation"):
        gl.WeightSchedule([(0, {"a": 1.0})], interpolation="cubic")  # type: ignore[arg-type]
    web = gl.MemoryStreamStorage(np.arange(30, dtype=np.uint16))
    with pytest.raises(ValueError, match="missing"):
        gl.mix({"web": web, "x": web}, gl.WeightSchedule([(0, {"web": 1.0})]), sequence_length=3)
    with pytest.raises(ValueError, match="finite and > 0"):
        gl.mix({"web": web}, gl.WeightSchedule([(0, {"web": -1.0})]), sequence_length=3)


def test_explain_of_a_scheduled_mixture_is_what_was_read() -> None:
    schedule = gl.WeightSchedule([(0, {"web": 0.9, "code": 0.1}), (60, {"web": 0.2, "code": 0.8})])
    ld = make(schedule, 4, 1, 0)
    with ld:
        it = iter(ld)
        for step in range(30):
            batch = next(it)
            records = ld.explain(step)
            assert [(r["source"], r["source_index"]) for r in records] == [
                (name, r["source_index"]) for (name, _), r in zip(batch, records, strict=True)
            ]
            for (name, sample), r in zip(batch, records, strict=True):
                first = int(np.asarray(sample)[0])
                assert first == (r["elements"][0][0] if name == "web" else r["documents"][0][0])
        it.close()
