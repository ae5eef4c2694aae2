"""Mixture weights on a schedule (``WeightSchedule``): every prefix holds each source within the
documented bound of its weight's integral, each source's stream is read once in order, and a
resume on another geometry reads what the run would have."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.mixture import Layout
from guideloom._core.weight_schedule import ScheduledLayout

weights = st.lists(st.sampled_from([0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 0.3333, 1.7]), min_size=2, max_size=5)


def _pairs(first: dict[str, float], knots: list[tuple[int, dict[str, float]]]) -> list[Any]:
    """A schedule's knots: ``first`` at 0, then each weight set ``gap`` positions after the last."""
    position, pairs = 0, [(0, first)]
    for gap, w in knots:
        position += gap
        pairs.append((position, w))
    return pairs


def _drawn(
    names: list[str], pairs: list[Any], interpolation: Any, lengths: list[int]
) -> tuple[gl.WeightSchedule, ScheduledLayout, npt.NDArray[np.int64]]:
    """The schedule of ``pairs``, its layout over sources of ``lengths``, and the source drawn at
    each position up to 300 past the last knot; checked on the way: every prefix's counts are
    within the layout's bounds of the integral of the weights (and equal ``layout.counts``), and
    each source reads its own stream once, in order."""
    schedule = gl.WeightSchedule(pairs, interpolation=interpolation)
    layout = ScheduledLayout.build(lengths[: len(names)], schedule, names)
    horizon = pairs[-1][0] + 300
    src, cum = layout.locate(np.arange(horizon, dtype=np.int64))
    counts = np.zeros((horizon + 1, len(names)), dtype=np.int64)
    np.add.at(counts, (np.arange(1, horizon + 1), src), 1)
    counts = np.cumsum(counts, axis=0)
    for p in range(horizon + 1):
        assert (np.abs(counts[p] - layout.integral(p)) <= layout.bounds + 1e-9).all(), (
            p,
            counts[p],
            layout.integral(p),
        )
        if p % 37 == 0:
            np.testing.assert_array_equal(layout.counts(p), counts[p])
    for s in range(len(names)):  # the source's stream: counts 0, 1, 2, ... each once
        assert sorted(cum[src == s].tolist()) == list(range(int(counts[-1][s])))
    return schedule, layout, src


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

    pairs = _pairs(named(first), [(gap, named(w)) for gap, w in knots])
    _, layout, _ = _drawn(names, pairs, interpolation, lengths)
    bounds = layout.bounds
    # a piece's bound is its own plus the earlier pieces' end deviations, each within their own
    owns = [
        p.a.bounds if p.b is None else p.a.bounds + p.b.bounds + np.abs(layout.knot_weights[i + 1] - w) / 2
        for i, (p, w) in enumerate(zip(layout.pieces, layout.knot_weights, strict=True))
    ]
    assert (bounds <= np.sum(owns, axis=0) + 1e-9).all()


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
    with pytest.raises(ValueError, match="finite and >= 0"):
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


knot_weights = st.dictionaries(
    st.sampled_from(["web", "code", "math"]),
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False),
    min_size=1,
    max_size=3,
)


@settings(max_examples=60, deadline=None)
@given(
    first=knot_weights,
    later=st.lists(st.tuples(st.integers(1, 10**6), st.floats(0.01, 100.0)), max_size=3),
    interpolation=st.sampled_from(["constant", "linear"]),
)
def test_schedules_of_the_same_knots_are_equal(
    first: dict[str, float], later: list[tuple[int, float]], interpolation: Any
) -> None:
    knots: list[tuple[int, dict[str, float]]] = [(0, first)]
    for gap, scale in later:
        knots.append((knots[-1][0] + gap, {k: v * scale for k, v in first.items()}))
    a = gl.WeightSchedule(knots, interpolation=interpolation)
    b = gl.WeightSchedule([(p, dict(w)) for p, w in knots], interpolation=interpolation)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    other = "linear" if interpolation == "constant" else "constant"
    assert a != gl.WeightSchedule(knots, interpolation=other)
    moved = [(p + (i > 0), w) for i, (p, w) in enumerate(knots)]
    assert (a == gl.WeightSchedule(moved, interpolation=interpolation)) == (len(knots) == 1)
    name = next(iter(first))
    changed = [(0, {**first, name: first[name] * 2}), *knots[1:]]
    assert a != gl.WeightSchedule(changed, interpolation=interpolation)
    assert a != "not a schedule"


@settings(max_examples=60, deadline=None)
@given(
    bad=st.sampled_from([0.0, 0, -1.0, -1e-9, float("nan"), float("inf"), float("-inf")]),
    at=st.integers(0, 2),
)
def test_a_weight_that_is_negative_or_not_finite_is_refused_when_the_schedule_is_made(
    bad: float, at: int
) -> None:
    knots: list[tuple[int, dict[str, float]]] = [(i * 10, {"web": 1.0, "code": 2.0}) for i in range(3)]
    knots[at] = (at * 10, {"web": 1.0, "code": bad})
    if bad == 0:  # 0 anneals a source off; a knot must leave some source a weight > 0
        gl.WeightSchedule(knots, interpolation="linear")
        knots[at] = (at * 10, {"web": 0.0, "code": bad})
        with pytest.raises(ValueError, match=f"knot at position {at * 10} gives every source a weight of 0"):
            gl.WeightSchedule(knots, interpolation="linear")
        return
    with pytest.raises(ValueError, match="must be finite and >= 0") as info:
        gl.WeightSchedule(knots, interpolation="linear")
    assert f"'code' at position {at * 10}" in str(info.value)
    with pytest.raises(TypeError, match="must be a number"):
        gl.WeightSchedule([(0, {"web": "1.0"})])  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="must be a number"):
        gl.WeightSchedule([(0, {"web": True})])


with_zeros = st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 3.0, 0.3333]), min_size=2, max_size=5)


@settings(max_examples=80, deadline=None)
@given(
    n_sources=st.integers(2, 5),
    knots=st.lists(st.tuples(st.integers(1, 400), with_zeros), min_size=1, max_size=4),
    first=with_zeros,
    interpolation=st.sampled_from(["constant", "linear"]),
    lengths=st.lists(st.integers(1, 300), min_size=5, max_size=5),
)
def test_a_source_of_weight_0_draws_nothing_there_and_every_prefix_keeps_the_bound(
    n_sources: int,
    knots: list[tuple[int, list[float]]],
    first: list[float],
    interpolation: Any,
    lengths: list[int],
) -> None:
    names = [f"s{i}" for i in range(n_sources)]

    def named(w: list[float]) -> dict[str, float]:
        out = {n: w[i % len(w)] * (1 + 0.01 * i) for i, n in enumerate(names)}
        if not any(out.values()):
            out[names[-1]] = 1.0  # some source must have weight at every position
        return out

    pairs = _pairs(named(first), [(gap, named(w)) for gap, w in knots])
    schedule, _, src = _drawn(names, pairs, interpolation, lengths)
    ends = [*schedule.positions[1:], len(src)]
    for i, (start, end) in enumerate(zip(schedule.positions, ends, strict=True)):
        w = pairs[i][1]
        after = pairs[i + 1][1] if interpolation == "linear" and i + 1 < len(pairs) else w
        for s, name in enumerate(names):  # weight 0 over the whole piece (a ramp: at both ends)
            if w[name] == 0 and after[name] == 0:
                assert not (src[start:end] == s).any(), (name, start, end)


def test_a_source_annealed_off_is_not_read_once_its_weight_is_0() -> None:
    web = gl.MemoryStreamStorage(np.arange(3_000, dtype=np.uint16))
    code = gl.MemoryStreamStorage(np.arange(10_000, 13_000, dtype=np.uint16))
    off = gl.WeightSchedule(
        [(0, {"web": 0.0, "code": 1.0}), (200, {"web": 1.0, "code": 1.0}), (400, {"web": 1.0, "code": 0.0})],
        interpolation="linear",
    )
    mixture = gl.mix({"web": web, "code": code}, off, sequence_length=3, num_samples=600, with_source=True)
    assert mixture.weights == {"web": 0.0, "code": 1.0}
    loader = gl.StatefulDataLoader(mixture, list, device=torch.device("cpu"), local_batch_size=10)
    got = [name for batch in loader for name, _ in batch]
    assert len(got) == 600 and set(got[400:]) == {"web"}
    # web's weight rises 0 -> 1/2 over the first ramp, 1/2 -> 1 over the second, then holds 1
    assert abs(got.count("web") - (50 + 150 + 200)) <= mixture.discrepancy_bounds["web"]
    assert got[0] == "code"
