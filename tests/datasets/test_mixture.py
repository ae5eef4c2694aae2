"""Weighted mixtures: each source's epochs, exactly-once across ranks, exact resume with another
batch or world size, and the mixture in the loader. The schedule's prefix bound, which is pure
arithmetic, is in ``tests/core/test_mixture.py``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from tests.support import ROOT
from tests.support.loader import roundtrip, take

CPU = torch.device("cpu")


def sourced(samples: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Collate for ``with_source`` mixtures of MapDataset(range) sources (module level: picklable)."""
    return [(name, int(x)) for name, x in samples]


def ints(samples: Sequence[int]) -> list[int]:
    return [int(x) for x in samples]


def int_sources(sizes: Sequence[int]) -> dict[str, gl.MapDataset[int]]:
    """Sources ``s0, s1, ...`` whose samples are their own indexes."""
    return {f"s{i}": gl.MapDataset(range(n)) for i, n in enumerate(sizes)}


def loader(mixture: gl.Mixture, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("device", CPU)
    return gl.StatefulDataLoader(mixture, sourced if mixture.with_source else ints, **kw)


# -- the schedule through a mixture -------------------------------------------------------------
def test_weights_near_the_float_limit_mix_as_their_ratios() -> None:
    """Weights whose sum overflows a float still mix as their ratios (it divided 0 by 0)."""
    sources = {n: gl.MemoryStreamStorage(np.arange(40, dtype=np.int32)) for n in "abc"}
    kw: dict[str, Any] = {"sequence_length": 4, "with_source": True}
    huge = gl.mix(sources, weights={"a": 1e308, "b": 1e308, "c": 1e308}, **kw)
    even = gl.mix(sources, weights={"a": 1.0, "b": 1.0, "c": 1.0}, **kw)
    for m in (huge, even):
        asyncio.run(m.open())
    assert len(huge) == len(even) == 30
    keys = [m.order(shuffle=False, seed=0, epoch=0).take(np.arange(30)) for m in (huge, even)]
    assert keys[0].tolist() == keys[1].tolist()
    assert Counter(name for name, _ in huge.read_many_sync(keys[0])) == {"a": 10, "b": 10, "c": 10}


# -- each source's order --------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    weights=st.lists(st.floats(0.05, 1.0), min_size=5, max_size=5),
    num_samples=st.integers(1, 300),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epochs=st.integers(1, 3),
)
def test_each_source_reads_its_own_epochs_exactly_once_each(
    sizes: list[int], weights: list[float], num_samples: int, shuffle: bool, seed: int, epochs: int
) -> None:
    sources = int_sources(sizes)
    m = gl.mix(sources, dict(zip(sources, weights, strict=False)), num_samples=num_samples)
    stream: dict[int, list[int]] = {s: [] for s in range(len(sizes))}
    order = m.order(shuffle=shuffle, seed=seed, epoch=0)
    for epoch in range(epochs):
        src, sepoch, index = m.order(shuffle=shuffle, seed=seed, epoch=epoch).sources(np.arange(num_samples))
        for s, e, i in zip(src.tolist(), sepoch.tolist(), index.tolist(), strict=True):
            c = len(stream[s])
            assert e == c // sizes[s]  # the source's own epoch, continuing across mixture epochs
            stream[s].append(i)
    for s, seq in stream.items():
        n = sizes[s]
        for e in range(0, len(seq), n):
            chunk = seq[e : e + n]
            assert len(set(chunk)) == len(chunk)  # no repeat within a source epoch
            if shuffle and n > 1:  # the vectorised lookup == the scalar keyed permutation
                perm = order.source_permutation(s, e // n)
                assert (
                    chunk == perm.take(np.arange(len(chunk))).tolist() == [perm[i] for i in range(len(chunk))]
                )
            else:
                assert chunk == list(range(len(chunk)))


def test_keys_are_offsets_plus_indexes_and_read_back_as_samples() -> None:
    a = gl.MemoryStreamStorage(np.arange(100, dtype=np.int64))
    b = gl.MemoryDocumentStorage([np.full(i + 1, 1000 + i, dtype=np.int64) for i in range(5)])
    m = gl.mix({"a": a, "b": b}, {"a": 2, "b": 1}, sequence_length=10, with_source=True)
    assert len(m) == 15 and m.samples_per_epoch == {"a": 10, "b": 5}
    order = m.order(shuffle=True, seed=7, epoch=0)
    keys = order.take(np.arange(len(m)))
    assert sorted(keys.tolist()) == list(range(15))  # one epoch of each: every sample once
    samples = asyncio.run(m.read_many(keys))
    inline = m.read_many_sync(keys)
    assert [(n, x.tolist()) for n, x in samples] == [(n, x.tolist()) for n, x in inline]
    for k, (name, sample) in zip(keys.tolist(), samples, strict=True):
        if k < 10:
            assert name == "a" and sample.tolist() == list(range(10 * k, 10 * k + 10))
        else:
            assert name == "b" and sample.tolist() == [1000 + k - 10] * (k - 9)
    assert order[3] == keys[3] and order.range(2, 5).tolist() == keys[2:5].tolist()


# -- the loader -------------------------------------------------------------------------------
def run_ranks(
    m: gl.Mixture, world: int, batch: int, epochs: int = 1, **kw: Any
) -> list[list[tuple[str, int]]]:
    """Every rank's batches of ``epochs`` epochs, merged per step in rank order: the global run."""
    per_rank = []
    for rank in range(world):
        with loader(m, local_batch_size=batch, world_size=world, rank=rank, **kw) as ld:
            per_rank.append([b for _ in range(epochs) for b in take(ld)])
    return [[x for r in range(world) for x in per_rank[r][step]] for step in range(len(per_rank[0]))]


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(3, 30), min_size=2, max_size=4),
    world=st.integers(1, 4),
    batch=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_no_duplicates_within_a_source_epoch_across_ranks(
    sizes: list[int], world: int, batch: int, seed: int
) -> None:
    m = gl.mix(int_sources(sizes), num_samples=3 * sum(sizes), with_source=True)
    if world * batch > len(m):
        return
    seen = [x for step in run_ranks(m, world, batch, shuffle=True, shuffle_seed=seed) for x in step]
    per_source: dict[str, list[int]] = {}
    for name, i in seen:
        per_source.setdefault(name, []).append(i)
    for name, seq in per_source.items():
        n = sizes[int(name[1:])]
        for e in range(0, len(seq), n):
            assert len(set(seq[e : e + n])) == len(seq[e : e + n]), (name, e // n)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 25), min_size=1, max_size=4),
    first=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    second=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop_after=st.integers(0, 12),
    epoch=st.integers(0, 2),
    shuffle=st.booleans(),
)
def test_resume_at_any_offset_with_any_batch_and_world_equals_the_uninterrupted_run(
    sizes: list[int],
    first: tuple[int, int],
    second: tuple[int, int],
    stop_after: int,
    epoch: int,
    shuffle: bool,
) -> None:
    m = gl.mix(int_sources(sizes), num_samples=2 * sum(sizes) + 3, with_source=True)
    kw: dict[str, Any] = {"shuffle": shuffle, "shuffle_seed": 11, "drop_last": True}
    (b1, w1), (b2, w2) = first, second
    if max(b1 * w1, b2 * w2) > len(m):
        return
    with loader(m, **kw) as full:  # the reference: batch 1, one rank, the whole order
        full.load_state_dict({**full.state_dict(), "epoch": epoch})
        expected = [x for b in take(full) for x in b]
    with loader(m, local_batch_size=b1, world_size=w1, **kw) as ld:
        ld.load_state_dict({**ld.state_dict(), "epoch": epoch})
        stop = min(stop_after, len(ld))
        head = [x for b in take(ld, stop) for x in b]  # rank 0's blocks of the first `stop` steps
        state = roundtrip(ld.state_dict())
    offset = state["observation_offset"]
    assert offset == stop * b1 * w1
    assert head == [x for k in range(stop) for x in expected[k * b1 * w1 : k * b1 * w1 + b1]]
    merged: list[list[tuple[str, int]]] = []  # global batches: the ranks' blocks in rank order
    for rank in range(w2):
        with loader(m, local_batch_size=b2, world_size=w2, rank=rank, **kw) as ld:
            ld.load_state_dict(state)
            batches = take(ld)
        for step, b in enumerate(batches):
            if step == len(merged):
                merged.append([])
            merged[step].extend(b)
    resumed = [x for step in merged for x in step]
    g = b2 * w2
    steps = (len(m) - offset) // g
    assert resumed == expected[offset : offset + steps * g]


def test_from_storage_and_the_constructor_take_a_mixture_alike() -> None:
    a = gl.MemoryStreamStorage(np.arange(400, dtype=np.int64))
    b = gl.MemoryStreamStorage(np.arange(1000, 1600, dtype=np.int64))
    m = gl.mix({"a": a, "b": b}, {"a": 1, "b": 1})

    def firsts(samples: Sequence[np.ndarray]) -> list[int]:
        return [int(s[0]) for s in samples]

    with gl.StatefulDataLoader.from_storage(
        m, firsts, sequence_length=20, local_batch_size=4, shuffle=True, shuffle_seed=2, device=CPU
    ) as ld:
        via_storage = take(ld)
    m20 = gl.mix({"a": a, "b": b}, {"a": 1, "b": 1}, sequence_length=20)
    with gl.StatefulDataLoader(
        m20, firsts, local_batch_size=4, shuffle=True, shuffle_seed=2, device=CPU
    ) as ld:
        via_dataset = take(ld)
    assert via_storage == via_dataset and len(via_storage) == 50 // 4
    # per-source lengths: a stream source takes its own
    mixed = gl.mix({"a": a, "b": b}, sequence_length={"a": 10, "b": 30})
    assert mixed.samples_per_epoch == {"a": 40, "b": 20}


def test_a_small_source_repeats_in_fresh_orders_and_stats_report_its_epoch() -> None:
    m = gl.mix({"big": gl.MapDataset(range(100)), "small": gl.MapDataset(range(5))}, {"big": 1, "small": 1})
    assert len(m) == 105 and m.samples_per_epoch["small"] == 52
    with loader(m, local_batch_size=5, shuffle=True, shuffle_seed=0) as ld:
        assert ld.stats()["source_epoch/small"] == 0.0
        it = iter(ld)
        for _ in range(4):
            next(it)
        stats = ld.stats()
        assert stats["source_epoch/small"] == 2.0 and stats["source_epoch/big"] == 0.0  # 10 of 5
        it.close()
    m2 = gl.mix({"big": gl.MapDataset(range(100)), "small": gl.MapDataset(range(5))}, {"big": 1, "small": 1})
    order = m2.order(shuffle=True, seed=0, epoch=0)
    src, sepoch, index = order.sources(np.arange(len(m2)))
    small = [(e, i) for s, e, i in zip(src, sepoch, index, strict=True) if s == 1]
    passes = [[i for e, i in small if e == k] for k in range(10)]
    assert all(sorted(p) == list(range(5)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # each pass in its own order


def test_a_checkpoint_of_another_mixture_is_refused() -> None:
    srcs = int_sources([10, 20])
    with loader(gl.mix(srcs, {"s0": 1, "s1": 1}), local_batch_size=2) as ld:
        take(ld, 2)
        state = roundtrip(ld.state_dict())
    assert state["dataset"]["kind"] == "mixture"
    with loader(gl.mix(srcs, {"s0": 1, "s1": 1}), local_batch_size=3) as same:
        same.load_state_dict(state)  # same mixture, another batch size: fine
    for other in (
        gl.mix(srcs, {"s0": 1, "s1": 2}),
        gl.mix({"x": srcs["s0"], "s1": srcs["s1"]}, {"x": 1, "s1": 1}),
        gl.mix(srcs, {"s0": 1, "s1": 1}, num_samples=31),
    ):
        with loader(other, local_batch_size=2) as ld, pytest.raises(ValueError, match="another dataset"):
            ld.load_state_dict(state)


@pytest.mark.parametrize("method", ["thread", "process"])
@pytest.mark.slow
def test_workers_deliver_the_inline_run(method: str) -> None:
    m = gl.mix(int_sources([17, 9, 30]), {"s0": 3, "s1": 1, "s2": 2}, with_source=True)
    with loader(m, local_batch_size=4, shuffle=True, shuffle_seed=5) as ld:
        inline = take(ld)
    with loader(
        m, local_batch_size=4, shuffle=True, shuffle_seed=5, num_workers=2, parallel_method=method, prefetch=2
    ) as ld:
        assert take(ld) == inline


def test_async_for_over_a_mixture_matches_the_sync_run() -> None:
    a = gl.MemoryStreamStorage(np.arange(300, dtype=np.int64))
    b = gl.MemoryDocumentStorage([np.full(3, 1000 + i, dtype=np.int64) for i in range(20)])
    m = gl.mix({"a": a, "b": b}, sequence_length={"a": 10}, with_source=True)

    def collate(samples: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, int]]:
        return [(n, int(s[0])) for n, s in samples]

    def make() -> gl.StatefulDataLoader[Any, Any]:
        return gl.StatefulDataLoader(m, collate, local_batch_size=3, shuffle=True, shuffle_seed=1, device=CPU)

    with make() as ld:
        sync = take(ld)

    async def main() -> list[Any]:
        async with make() as ld:
            return [b async for b in ld]

    assert asyncio.run(main()) == sync
    # 16 batches of 3: the schedule's first 48 positions (weights 30:20, by the sources' sizes)
    expected = dict(zip(m.names, m._layout().counts(48).tolist(), strict=True))
    assert Counter(n for b in sync for n, _ in b) == expected
    assert abs(expected["a"] - 0.6 * 48) <= 1


def test_a_mixture_of_mixtures() -> None:
    inner = gl.mix(int_sources([10, 10]))
    outer = gl.mix({"inner": inner, "other": gl.MapDataset(range(100, 120))}, with_source=True)
    with loader(outer, local_batch_size=4, shuffle=True, shuffle_seed=3) as ld:
        seen = [x for b in take(ld) for x in b]
    assert sorted(i for n, i in seen if n == "inner") == sorted(list(range(10)) * 2)
    assert sorted(i for n, i in seen if n == "other") == list(range(100, 120))


# -- bad input --------------------------------------------------------------------------------
def test_bad_input_is_refused_with_a_clear_error() -> None:
    a = gl.MemoryStreamStorage(np.arange(100, dtype=np.int64))
    d = gl.MemoryDocumentStorage([np.arange(3)])
    with pytest.raises(TypeError, match="non-empty mapping"):
        gl.mix({})
    with pytest.raises(TypeError, match="must be stream or document storage"):
        gl.mix({"a": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="missing \\['b'\\]"):
        gl.mix({"a": a, "b": d}, {"a": 1.0}, sequence_length=10)
    with pytest.raises(ValueError, match="finite and > 0"):
        gl.mix({"a": a, "b": d}, {"a": 1.0, "b": 0.0}, sequence_length=10)
    with pytest.raises(TypeError, match="must be a number"):
        gl.mix({"a": a, "b": d}, {"a": 1.0, "b": True}, sequence_length=10)
    with pytest.raises(ValueError, match="takes no sequence_length"):
        gl.mix({"a": a, "b": d}, sequence_length={"a": 10, "b": 10})
    with pytest.raises(ValueError, match="unknown sources"):
        gl.mix({"a": a}, sequence_length={"z": 10})
    with pytest.raises(ValueError, match="sequence_length must be >= 1"):
        gl.mix({"a": a}, sequence_length=0)
    pending = gl.mix({"a": a, "b": d})
    with pytest.raises(ValueError, match="'a' need a sequence_length"):
        len(pending)
    ld = gl.StatefulDataLoader(pending, ints, device=CPU)
    with pytest.raises(ValueError, match="need a sequence_length"):
        ld.open()
    with pytest.raises(ValueError, match="would apply to none"):
        gl.StatefulDataLoader.from_storage(gl.mix({"b": d}), ints, sequence_length=4, device=CPU)
    with pytest.raises(ValueError, match="has no samples"):
        len(gl.mix({"a": gl.MapDataset([]), "b": gl.MapDataset([1])}))
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        gl.mix({"a": a}, sequence_length=4, num_samples=0)
    with pytest.raises(ValueError, match="below 2\\*\\*62"):
        gl.mix({"a": a}, sequence_length=4, num_samples=2**62)
    with pytest.raises(TypeError, match="weights must be a dict"):
        gl.mix({"a": a}, [1.0], sequence_length=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source names must be non-empty strings"):
        gl.mix({1: a})  # type: ignore[dict-item]


# -- the example --------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_example_runs_and_checks_itself(tmp_path: Path) -> None:
    example = ROOT / "examples" / "mixture.py"
    env = dict(os.environ, PYTHONPATH=str(example.parent.parent))
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(example), "--dir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical to the uninterrupted run" in proc.stdout
    assert proc.stdout.count("source epoch") == 3


class Counted(gl.MapDataset[int]):
    """A MapDataset that counts its opens and closes."""

    def __init__(self, n: int) -> None:
        super().__init__(range(n))
        self.opens = self.closes = 0

    async def open(self) -> None:
        self.opens += 1

    async def close(self) -> None:
        self.closes += 1


def test_opening_a_mixture_opens_every_source_and_a_failure_closes_them() -> None:
    a, b = Counted(10), Counted(20)
    with loader(gl.mix({"a": a, "b": b}), local_batch_size=2):
        assert (a.opens, b.opens, a.closes) == (1, 1, 0)
    assert (a.closes, b.closes) == (1, 1)
    c, empty = Counted(10), Counted(0)
    with pytest.raises(ValueError, match="'e' has no samples"):
        loader(gl.mix({"c": c, "e": empty})).open()
    assert (c.opens, c.closes, empty.opens, empty.closes) == (1, 1, 1, 1)


# -- real ranks -----------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_real_gloo_ranks_share_no_sample_of_a_source_epoch_and_resume_on_another_world(
    tmp_path: Path,
) -> None:
    from tests.support.mixture_rank import SEQ, mixture, source_ids
    from tests.support.ranks import run_ranks

    gl.write_stream(tmp_path / "stream", np.arange(40 * SEQ, dtype=np.uint32), shard_bytes=400)
    gl.write_documents(tmp_path / "docs", [np.full(i % 5 + 1, i, dtype=np.uint32) for i in range(13)])
    argv = [sys.executable, "-m", "tests.support.mixture_rank", str(tmp_path)]
    run_ranks(2, lambda r: [*argv, str(tmp_path / f"rank{r}.json")], cwd=ROOT)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["steps"] == results[1]["steps"]  # both gathered the same global batches
    seen = [tuple(x) for step in results[0]["steps"] for x in step]
    m = mixture(tmp_path)
    with gl.StatefulDataLoader(
        m, source_ids, local_batch_size=8, shuffle=True, shuffle_seed=5, device=CPU
    ) as ld:
        single = [x for _ in range(2) for b in take(ld) for x in b]
        stats = ld.stats()
    assert seen == single  # 2 ranks x 4 == 1 rank x 8, sample for sample, over two epochs
    per_epoch = len(seen) // 2  # 88 of the 90 positions: drop_last drops 2 at each epoch's end
    triples = []
    for epoch in range(2):
        src, sepoch, index = m.order(shuffle=True, seed=5, epoch=epoch).sources(np.arange(per_epoch))
        triples += list(zip(src.tolist(), sepoch.tolist(), index.tolist(), strict=True))
    assert [(m.names[s], i) for s, _, i in triples] == seen
    assert len(set(triples)) == len(triples)  # no sample twice within one of its source's epochs
    assert results[0]["stats"] == {
        **results[0]["stats"],
        **{k: v for k, v in stats.items() if "source_epoch" in k},
    }
    state = results[0]["state"]  # epoch 1 after 4 steps of 8: resume it on 3 ranks of 2
    assert (state["epoch"], state["observation_offset"]) == (1, 32)
    rest: list[list[tuple[str, int]]] = []
    for rank in range(3):
        with gl.StatefulDataLoader(
            m,
            source_ids,
            local_batch_size=2,
            rank=rank,
            world_size=3,
            shuffle=True,
            shuffle_seed=5,
            device=CPU,
        ) as ld:
            ld.load_state_dict(state)
            for step, b in enumerate(take(ld)):
                if step == len(rest):
                    rest.append([])
                rest[step].extend(b)
    tail = [x for step in rest for x in step]
    epoch1 = single[len(single) // 2 :]
    assert tail == epoch1[32 : 32 + len(tail)] and len(tail) == (90 - 32) // 6 * 6


def packed_rows(samples: Sequence[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...]]]:
    """(source, a row's first tokens and segment ids) for packed and stream samples alike."""
    out = []
    for name, s in samples:
        if name == "packed":
            out.append(
                (name, (*np.asarray(s["tokens"][:4]).tolist(), *np.asarray(s["segment_ids"][:4]).tolist()))
            )
        else:
            out.append((name, tuple(np.asarray(s[:4]).tolist())))
    return out


def test_a_packed_source_beside_a_stream_resumes_exactly_on_another_world() -> None:
    rng = np.random.default_rng(3)
    docs = gl.MemoryDocumentStorage(
        [rng.integers(1, 1000, int(n), dtype=np.int64) for n in rng.integers(3, 40, 80)]
    )
    packed = gl.pack(docs, sequence_length=16, mode="best_fit")
    stream = gl.MemoryStreamStorage(np.arange(2000, dtype=np.int64))
    m = gl.mix(
        {"packed": packed, "stream": stream},
        {"packed": 1, "stream": 1},
        sequence_length={"stream": 16},
        with_source=True,
    )

    def make(batch: int, rank: int = 0, world: int = 1) -> gl.StatefulDataLoader[Any, Any]:
        return gl.StatefulDataLoader(
            m,
            packed_rows,
            local_batch_size=batch,
            rank=rank,
            world_size=world,
            shuffle=True,
            shuffle_seed=8,
            device=CPU,
        )

    with make(1) as ld:  # the uninterrupted run: the whole epoch, in order
        full = [x for b in take(ld) for x in b]
        assert ld.stats()["source_epoch/packed"] >= 1  # served its share: one pass at least
    with make(6) as ld:
        head = [x for b in take(ld, 5) for x in b]
        state = roundtrip(ld.state_dict())
    assert state["dataset"]["kind"] == "mixture" and head == full[:30]
    steps: list[list[Any]] = []
    for rank in range(2):
        with make(2, rank, 2) as ld:
            ld.load_state_dict(state)
            for step, b in enumerate(take(ld)):
                if step == len(steps):
                    steps.append([])
                steps[step].extend(b)
    tail = [x for s in steps for x in s]
    assert tail == full[30 : 30 + len(tail)] and len(tail) == (len(full) - 30) // 4 * 4
    assert {n for n, _ in full} == {"packed", "stream"}


def test_a_sequence_length_from_the_loader_reaches_a_nested_mixture() -> None:
    """A stream source inside an inner mixture takes from_storage's sequence_length (the error
    that asks for one said to pass it there, and from_storage then refused it)."""
    stream = gl.MemoryStreamStorage(np.arange(100, dtype=np.uint16))
    nested = gl.mix({"m": gl.mix({"s": stream}), "a": gl.MapDataset(list(range(10)))})
    with pytest.raises(ValueError, match="'s' need a sequence_length"):
        len(nested)
    loader = gl.StatefulDataLoader.from_storage(nested, list, sequence_length=5, device=CPU)
    with loader:
        batches = list(loader)
    assert len(batches) == 30 and sorted(len(b[0]) for b in batches if not isinstance(b[0], int)) == [5] * 20


def test_a_mixture_ignores_shuffle_blocks_and_does_not_record_them() -> None:
    """A mixture makes its own order: shuffle_block_size changes nothing, so its checkpoint
    records no blocks and a loader without them resumes it without a warning."""

    def make(**kw: Any) -> gl.StatefulDataLoader[Any, Any]:
        m = gl.mix({"a": gl.MapDataset(range(50)), "b": gl.MapDataset(range(50, 100))})
        return gl.StatefulDataLoader(
            m, ints, local_batch_size=4, shuffle=True, shuffle_seed=1, device=CPU, **kw
        )

    blocked = make(shuffle_block_size=8)
    with blocked:
        expected = take(blocked)
        blocked.load_state_dict({**blocked.state_dict(), "epoch": 0, "observation_offset": 12})
        state = blocked.state_dict()
    assert "shuffle_block_size" not in state and blocked.stats()["shuffle_block_size"] == 1
    plain = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.load_state_dict(state)
    with plain:
        assert take(plain) == expected[3:]
