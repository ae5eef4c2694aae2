"""Following a changing quorum, tried from the outside: odd sequences of ``set_geometry``,
``commit`` and ``rollback``; replica groups that die and heal from a live peer's committed state
over mixtures, packed datasets, process workers and ``async for``. Every sample of an epoch is
committed exactly once: the committed samples of all replica groups, counted, are the samples of
one uninterrupted epoch."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import guideloom as gl
from tests.support.data import identity_stream
from tests.support.loader import make

pytestmark = pytest.mark.usefixtures("no_thread_leak")

REPLICAS = 3


def stream_keys(samples: Sequence[Any]) -> list[int]:
    """A stream sample's first element: its identity (the streams below never repeat one)."""
    return [int(s[0]) for s in samples]


def packed_keys(samples: Sequence[Any]) -> list[tuple[int, ...]]:
    """A packed sequence's tokens (each document's tokens are its own): its identity."""
    return [tuple(int(t) for t in s["tokens"]) for s in samples]


Factory = Callable[[], gl.StatefulDataLoader[Any, list[Any]]]


def identity(**kw: Any) -> Factory:
    kw = {"shuffle": True, "shuffle_seed": 5, "drop_last": False, "local_batch_size": 2, **kw}
    return lambda: make(identity_stream(47), collate=stream_keys, **kw)


def mixture(**kw: Any) -> Factory:
    def build() -> gl.StatefulDataLoader[Any, list[Any]]:
        m = gl.mix(
            {
                "a": gl.MemoryStreamStorage(np.arange(4 * 23, dtype=np.int64)),
                "b": gl.MemoryStreamStorage(np.arange(10_000, 10_000 + 4 * 19, dtype=np.int64)),
            },
            sequence_length=4,
        )
        return gl.StatefulDataLoader(
            m,
            stream_keys,
            local_batch_size=2,
            device=torch.device("cpu"),
            shuffle=True,
            shuffle_seed=9,
            drop_last=False,
            **kw,
        )

    return build


def packed(**kw: Any) -> Factory:
    def build() -> gl.StatefulDataLoader[Any, list[Any]]:
        docs = [np.arange(i * 100, i * 100 + 2 + i % 7, dtype=np.int64) for i in range(60)]
        return gl.StatefulDataLoader(
            gl.pack(gl.MemoryDocumentStorage(docs), 6),
            packed_keys,
            local_batch_size=2,
            device=torch.device("cpu"),
            shuffle=True,
            shuffle_seed=2,
            drop_last=False,
            **kw,
        )

    return build


def one_epoch(factory: Factory) -> Counter[Any]:
    """The samples of one uninterrupted epoch at world size 1."""
    with factory() as ld:
        return Counter(k for batch in ld for k in batch)


Schedule = list[tuple[frozenset[int], bool]]


def run_sync(factory: Factory, schedule: Schedule) -> Counter[Any]:
    """Follow ``schedule`` (live replicas per step, whether the step commits) through one epoch,
    then all replicas committing; a replica (re)joining loads a live peer's committed state.
    Returns the committed samples, counted over the participants."""
    loaders = [factory() for _ in range(REPLICAS)]
    its: list[Any] = [None] * REPLICAS
    live: set[int] = set()
    committed: Counter[Any] = Counter()
    steps = iter(schedule)
    for ld in loaders:
        ld.open()
    try:
        while True:
            members, commits = next(steps, (frozenset(range(REPLICAS)), True))
            if live and not live & members:
                members |= {min(live)}
            for r in sorted(members - live):
                if its[r] is not None:
                    its[r].close()
                peer = next((p for p in sorted(live & members)), None)
                if peer is not None:
                    loaders[r].load_state_dict(loaders[peer].state_dict(committed=True))
                its[r] = iter(loaders[r])
            for r in sorted(live - members):  # dies
                its[r].close()
                its[r] = None
            live = set(members)
            order = sorted(live)
            got: dict[int, list[Any]] = {}
            for rank, r in enumerate(order):
                loaders[r].set_geometry(rank=rank, world_size=len(order))
                batch = next(its[r], None)
                if batch is not None:
                    got[r] = batch
            if not got:
                return committed
            assert len(got) == len(order), "replicas disagree on the end of the epoch"
            for r in order:
                if commits:
                    loaders[r].commit()
                    committed.update(got[r])
                else:
                    loaders[r].rollback()
    finally:
        for it in its:
            if it is not None:
                it.close()
        for ld in loaders:
            ld.close()


async def run_async(factory: Factory, schedule: Schedule) -> Counter[Any]:
    """:func:`run_sync` with ``async for``'s iterators on one event loop."""
    loaders = [factory() for _ in range(REPLICAS)]
    its: list[Any] = [None] * REPLICAS
    live: set[int] = set()
    committed: Counter[Any] = Counter()
    steps = iter(schedule)
    for ld in loaders:
        await ld.aopen()
    try:
        while True:
            members, commits = next(steps, (frozenset(range(REPLICAS)), True))
            if live and not live & members:
                members |= {min(live)}
            for r in sorted(members - live):
                if its[r] is not None:
                    await its[r].aclose()
                peer = next((p for p in sorted(live & members)), None)
                if peer is not None:
                    loaders[r].load_state_dict(loaders[peer].state_dict(committed=True))
                its[r] = aiter(loaders[r])
            for r in sorted(live - members):
                await its[r].aclose()
                its[r] = None
            live = set(members)
            order = sorted(live)
            got: dict[int, list[Any]] = {}
            for rank, r in enumerate(order):
                loaders[r].set_geometry(rank=rank, world_size=len(order))
                batch = await anext(its[r], None)
                if batch is not None:
                    got[r] = batch
            if not got:
                return committed
            assert len(got) == len(order), "replicas disagree on the end of the epoch"
            for r in order:
                if commits:
                    loaders[r].commit()
                    committed.update(got[r])
                else:
                    loaders[r].rollback()
    finally:
        for it in its:
            if it is not None:
                await it.aclose()
        for ld in loaders:
            await ld.aclose()


quorum = st.sets(st.integers(0, REPLICAS - 1), min_size=1).map(frozenset)
schedules = st.lists(st.tuples(quorum, st.booleans()), max_size=30)
#: A fixed schedule that shrinks the quorum to one, grows it, and fails steps around each change.
FIXED: Schedule = [
    (frozenset({0}), True),
    (frozenset({0, 1}), False),
    (frozenset({0, 1, 2}), True),
    (frozenset({1}), False),
    (frozenset({1}), True),
    (frozenset({0, 1, 2}), False),
    (frozenset({2, 0}), True),
    (frozenset({2}), False),
    (frozenset({0, 1, 2}), True),
    (frozenset({1, 2}), False),
]

KINDS = {
    "stream-threads": identity(num_workers=2, prefetch=2),
    "mixture-prefetch": mixture(prefetch=3),
    "packed-threads": packed(num_workers=2, prefetch=2),
    "stream-drop-last-false-block-shuffle": identity(shuffle_block_size=4, prefetch=2),
}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules, kind=st.sampled_from(sorted(KINDS)))
def test_every_sample_is_committed_once_over_mixtures_packs_and_workers(
    schedule: Schedule, kind: str
) -> None:
    factory = KINDS[kind]
    assert run_sync(factory, schedule) == one_epoch(factory)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules, kind=st.sampled_from(["stream-threads", "packed-threads"]))
def test_every_sample_is_committed_once_through_async_for(schedule: Schedule, kind: str) -> None:
    factory = KINDS[kind]
    assert asyncio.run(run_async(factory, schedule)) == one_epoch(factory)


@pytest.mark.parametrize("make_factory", [identity, mixture], ids=["stream", "mixture"])
def test_process_workers_with_prefetch_follow_a_changing_quorum(make_factory: Any) -> None:
    factory = make_factory(num_workers=2, parallel_method="process", prefetch=2)
    assert run_sync(factory, FIXED) == one_epoch(identity() if make_factory is identity else mixture())


def test_rollback_twice_and_commit_without_a_batch_change_nothing() -> None:
    with identity(prefetch=2)() as ld:
        ld.rollback()
        ld.commit()
        it = iter(ld)
        first = next(it)
        ld.rollback()
        ld.rollback()
        assert ld.committed_offset == ld.state_dict()["observation_offset"] == 0
        assert next(it) == first
        ld.commit()
        ld.commit()
        assert ld.committed_offset == 2
        it.close()


def test_a_world_larger_than_what_is_left_hands_out_the_rest_once_and_ends_the_epoch() -> None:
    """Geometry grown past the samples left, drop_last=False: the ranks together get exactly the
    rest (those past it an empty batch); taken back and cut for one rank, the same rest."""
    with make(identity_stream(10), local_batch_size=2, shuffle=False, drop_last=False) as ld:
        it = iter(ld)
        assert next(it) == [0, 1]
        ld.commit()
        ld.set_geometry(rank=3, world_size=5)  # 10 a step, 8 left
        assert next(it) == [8, 9]
        ld.rollback()
        ld.set_geometry(rank=0, world_size=1)
        rest = [k for b in it for k in b]
        assert rest == list(range(2, 10))


def test_a_committed_state_loads_into_a_loader_of_another_batch_size() -> None:
    """The offset is global: a peer with another local batch size goes on where the committed
    state says, and the two together hand out the rest once."""
    with make(identity_stream(40), local_batch_size=2, shuffle=True, shuffle_seed=4, drop_last=False) as a:
        it = iter(a)
        a.set_geometry(rank=0, world_size=3)
        seen = list(next(it))
        a.commit()
        next(it)  # not committed
        state = a.state_dict(committed=True)
        it.close()
    with make(identity_stream(40), local_batch_size=3, shuffle=True, shuffle_seed=4, drop_last=False) as b:
        b.load_state_dict(state)
        rest = [k for batch in b for k in batch]
    with make(identity_stream(40), local_batch_size=2, shuffle=True, shuffle_seed=4, drop_last=False) as ref:
        whole = [k for batch in ref for k in batch]
    assert whole[:2] == seen
    assert rest == whole[6:]


def test_a_new_iterator_after_the_epochs_last_batch_commits_the_epoch() -> None:
    """The end of an epoch commits it (as ``commit()``'s docstring says): a new ``iter()`` after
    the epoch's last batch was handed out (a loop that stops after ``len(loader)`` batches, as
    Lightning's does) starts the next epoch, and ``rollback()`` takes nothing back. A loop that
    may fail a step settles it (``commit()`` or ``rollback()``) before asking for the next
    batch, as ``FaultTolerantLoader`` does."""
    with make(identity_stream(6), local_batch_size=2, shuffle=False, drop_last=False) as ld:
        it = iter(ld)
        next(it), next(it)
        ld.commit()
        assert next(it) == [4, 5]  # the epoch's last batch, its step not committed
        again = iter(ld)
        assert ld.state_dict(committed=True)["epoch"] == 1
        assert ld.state_dict(committed=True)["observation_offset"] == 0
        ld.rollback()
        assert next(again) == [0, 1]
        again.close()


def test_steps_taken_back_under_another_geometry_leave_no_segment_in_the_history() -> None:
    """A replica that joins and dies during its first step, again and again: the job's committed
    steps are all read by one rank, so the history needs one segment and every step explains."""
    with make(identity_stream(2000), local_batch_size=1, shuffle=False) as ld:
        it = iter(ld)
        committed = []
        for _ in range(300):
            ld.set_geometry(rank=0, world_size=2)  # a peer joins ...
            next(it)
            ld.rollback()  # ... and dies during the step: taken back at the next
            ld.set_geometry(rank=0, world_size=1)
            committed.append(next(it))
            ld.commit()
        it.close()
        for step in (0, 1, 150, 299):
            assert [d["index"] for d in ld.explain(step, rank=0)] == committed[step]
        assert len(ld.state_dict(committed=True)["history"].split(";")) < 10


Op = tuple[str, int, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("geometry"), st.integers(0, 4), st.integers(1, 5)).map(
            lambda t: (t[0], t[1] % t[2], t[2])
        ),
        st.sampled_from(
            [("next", 0, 0), ("commit", 0, 0), ("rollback", 0, 0), ("reopen", 0, 0), ("reload", 0, 0)]
        ),
    ),
    max_size=60,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    drop_last=st.booleans(),
    how=st.sampled_from([{}, {"prefetch": 3}, {"num_workers": 2, "prefetch": 2}]),
)
def test_any_sequence_of_geometry_batches_commits_and_rollbacks_follows_the_model(
    ops: list[Op], drop_last: bool, how: dict[str, int]
) -> None:
    """One loader through any sequence of ``set_geometry``, batches, ``commit``, ``rollback``,
    iterators closed and started again, and reloads of its own committed state, against a model
    of the global position: each batch is the rank's block of the next global batch, a rollback
    returns to the last commit, the end of an epoch starts the next at 0."""
    n, b = 23, 2
    rank, world, epoch, offset, committed = 0, 1, 0, 0, 0
    with make(identity_stream(n), local_batch_size=b, shuffle=False, drop_last=drop_last, **how) as ld:
        it = iter(ld)
        for op, r, w in ops:
            if op == "geometry":
                ld.set_geometry(rank=r, world_size=w)
                rank, world = r, w
            elif op == "next":
                got = next(it, None)
                more = offset + world * b <= n if drop_last else offset < n
                if more:
                    assert got == list(range(offset + rank * b, min(offset + (rank + 1) * b, n)))
                    offset += world * b
                else:
                    assert got is None, (epoch, offset, rank, world)
                    epoch, offset, committed = epoch + 1, 0, 0
                    it = iter(ld)
            elif op == "commit":
                ld.commit()
                committed = offset
            elif op == "rollback":
                ld.rollback()
                offset = committed
            else:
                it.close()
                if op == "reload":
                    ld.load_state_dict(ld.state_dict(committed=True))
                    offset = committed
                it = iter(ld)
            state, kept = ld.state_dict(), ld.state_dict(committed=True)
            assert (state["epoch"], state["observation_offset"]) == (epoch, offset)
            assert (kept["epoch"], kept["observation_offset"]) == (epoch, committed)
            assert ld.committed_offset == committed
        it.close()
