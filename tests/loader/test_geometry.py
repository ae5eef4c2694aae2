"""Changing rank and world size between steps, and taking back uncommitted steps: what a job
whose data-parallel group changes from step to step (a fault-tolerant quorum) relies on.

Several replicas, each a loader of its own over the same data, follow a schedule of quorums in
one process: each step the live replicas are cut the next global batch, and the step is
committed or taken back; a replica that comes back loads the committed state of a live peer.
Every sample of the epoch is committed exactly once, whatever the schedule."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import guideloom as gl
from tests.support.data import identity_stream
from tests.support.loader import make, take

pytestmark = pytest.mark.usefixtures("no_thread_leak")

N = 61  # prime: no global batch divides the epoch


def loader(**kw: Any) -> gl.StatefulDataLoader[Any, list[int]]:
    kw.setdefault("shuffle", True)
    kw.setdefault("shuffle_seed", 11)
    kw.setdefault("drop_last", False)
    return make(identity_stream(N), local_batch_size=2, **kw)


class Replica:
    """One replica group's loader and its open iterator."""

    def __init__(self, **kw: Any) -> None:
        self.loader = loader(**kw)
        self.loader.open()
        self.it: Any = None

    def join(self, peer: Replica | None) -> None:
        """(Re)join: the committed state of a live peer, as a fault-tolerant job heals."""
        if self.it is not None:
            self.it.close()
        if peer is not None:
            self.loader.load_state_dict(peer.loader.state_dict(committed=True))
        self.it = iter(self.loader)

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
        self.loader.close()


def run(schedule: list[tuple[frozenset[int], bool]], **kw: Any) -> tuple[Counter[int], list[Replica]]:
    """Follow ``schedule`` (the live replicas of each step, whether it commits) through one epoch,
    then go on with all three committing; the samples committed, counted. At least one replica
    of a step lives on into the next (one of the quorum always does: the state lives there)."""
    replicas = [Replica(**kw) for _ in range(3)]
    live: set[int] = set()
    committed: Counter[int] = Counter()
    steps = iter(schedule)
    try:
        while True:
            members, commits = next(steps, (frozenset({0, 1, 2}), True))
            if live and not live & members:  # one replica lives on: the others heal from it
                members |= {min(live)}
            for r in sorted(members - live):  # a replica (re)joins from a live peer
                peer = next((replicas[p] for p in sorted(live & members)), None)
                replicas[r].join(peer)
            live = set(members)
            order = sorted(live)
            got: dict[int, list[int]] = {}
            done = False
            for rank, r in enumerate(order):
                rep = replicas[r]
                rep.loader.set_geometry(rank=rank, world_size=len(order))
                batch = next(rep.it, None)
                if batch is None:
                    done = True
                else:
                    got[r] = batch
            if done:
                assert not got, "replicas disagree on the end of the epoch"
                return committed, replicas
            for r in order:
                if commits:
                    replicas[r].loader.commit()
                    committed.update(got[r])
                else:
                    replicas[r].loader.rollback()
    finally:
        for rep in replicas:
            rep.close()


quorum = st.sets(st.integers(0, 2), min_size=1).map(frozenset)
schedules = st.lists(st.tuples(quorum, st.booleans()), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules, how=st.sampled_from([{}, {"prefetch": 3}, {"num_workers": 2, "prefetch": 2}]))
def test_every_sample_is_committed_once_through_any_schedule_of_quorums(
    schedule: list[tuple[frozenset[int], bool]], how: dict[str, int]
) -> None:
    committed, _ = run(schedule, **how)
    assert sorted(committed) == list(range(N))
    assert set(committed.values()) == {1}


def test_a_rollback_hands_the_same_samples_out_again_under_the_new_geometry() -> None:
    with loader(prefetch=4, num_workers=2) as one:
        it = iter(one)
        one.set_geometry(rank=0, world_size=3)
        first = next(it)
        one.commit()
        taken = next(it)  # not committed: a peer died during the step
        assert one.state_dict(committed=True)["observation_offset"] == 6
        assert one.state_dict()["observation_offset"] == 12
        one.rollback()
        assert one.state_dict()["observation_offset"] == one.committed_offset == 6
        one.set_geometry(rank=0, world_size=2)
        again = next(it)
        with loader() as ref:
            ref.set_geometry(rank=1, world_size=2)
            ref.load_state_dict(one.state_dict(committed=True))
            other = next(iter(ref))
        assert taken == again[:2]  # rank 0 of 3 and of 2 start the batch at the same position
        assert len(again + other) == 4
        assert not set(again + other) & set(first)
        it.close()


def test_the_history_records_each_change_and_explain_names_the_committed_samples() -> None:
    with loader(prefetch=2) as one:
        it = iter(one)
        seen: list[tuple[int, list[int]]] = []
        for step, world in enumerate([1, 2, 2, 3, 1, 3]):
            one.set_geometry(rank=0, world_size=world)
            batch = next(it)
            one.rollback() if step == 3 else one.commit()
            if step != 3:
                seen.append((len(seen), batch))
        it.close()
        history = one.state_dict()["history"]
        assert [int(e.split(":")[4]) for e in history.split(";")] == [1, 2, 1, 3]  # 3 taken back
        for step, batch in seen:
            assert [d["index"] for d in one.explain(step, rank=0)] == batch


def test_audit_covers_what_was_committed() -> None:
    with loader(prefetch=3) as one:
        it = iter(one)
        for i in range(10):
            next(it)
            one.rollback() if i % 3 == 2 else one.commit()
            assert one.audit().ok
        list(it)
        assert one.audit().ok


def test_set_geometry_refuses_a_bad_geometry_and_the_same_one_changes_nothing() -> None:
    with loader() as one:
        with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
            one.set_geometry(rank=2, world_size=2)
        with pytest.raises(ValueError, match="more than the dataset's 61 observations"):
            one.set_geometry(rank=0, world_size=31)
        one.set_geometry(rank=0, world_size=1)
        one.rollback()  # nothing handed out: nothing to take back
        assert one.state_dict()["history"] == ""


def test_explain_past_the_kept_history_says_why_it_has_none() -> None:
    """More changes of geometry in an epoch than the history keeps: an early step cannot be
    explained, and the error says so (no checkpoint was resumed)."""
    with make(identity_stream(2000), local_batch_size=1, shuffle=False) as one:
        it = iter(one)
        for step in range(300):
            one.set_geometry(rank=0, world_size=1 + step % 2)
            next(it)
            one.commit()
        it.close()
        assert len(one.state_dict()["history"].split(";")) <= 256  # bounded
        with pytest.raises(ValueError) as error:
            one.explain(0, rank=0)
        message = str(error.value)
        assert "resumed" not in message, message
        assert "256" in message, message


def test_audit_after_the_quorum_shrank_reports_no_skip_that_did_not_happen() -> None:
    """Two replicas take three committed steps, one is lost, the other goes on alone: every
    position was handed out once. The survivor's audit either says so or refuses plainly (it
    cannot count the lost rank's batches), never that a batch was skipped."""
    a, b = loader(prefetch=2), loader(prefetch=2)
    with a, b:
        ia, ib = iter(a), iter(b)
        for _ in range(3):
            a.set_geometry(rank=0, world_size=2)
            b.set_geometry(rank=1, world_size=2)
            next(ia), next(ib)
            a.commit(), b.commit()
        ib.close()
        a.set_geometry(rank=0, world_size=1)
        for _ in range(3):
            next(ia)
            a.commit()
        try:
            report = a.audit()
        except RuntimeError:
            report = None
        ia.close()
    assert report is None or report.ok, report.message


@pytest.mark.parametrize("taken_back", [False, True], ids=["committed-state", "after-rollback"])
def test_the_committed_state_after_more_changes_than_the_history_keeps_loads_in_a_joining_replica(
    taken_back: bool,
) -> None:
    """An epoch with more changes of quorum than the history keeps, then steps not committed
    under other quorums: the committed state (what a joining replica receives) loads, and the
    joining replica goes on with the samples the live one would."""
    with make(identity_stream(3000), local_batch_size=1, shuffle=True, shuffle_seed=1) as one:
        it = iter(one)
        for step in range(300):
            one.set_geometry(rank=0, world_size=1 + step % 2)
            next(it)
            one.commit()
        for step in range(3):
            one.set_geometry(rank=0, world_size=3 + step % 2)
            next(it)
        if taken_back:
            one.rollback()
            state = one.state_dict()
        else:
            state = one.state_dict(committed=True)
        one.rollback()
        one.set_geometry(rank=0, world_size=2)
        expected = next(it)
        it.close()
        with make(identity_stream(3000), local_batch_size=1, shuffle=True, shuffle_seed=1) as joining:
            joining.load_state_dict(state)
            joining.set_geometry(rank=0, world_size=2)
            assert take(joining, 1) == [expected]


def _follow(seed: int, asynchronous: bool = False, **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Two epochs of one loader whose geometry changes at random steps (a drawn rank and world
    size, the step committed or taken back), by ``for`` or ``async for``: the batches handed
    out, and its stats."""
    out: list[list[int]] = []
    rng = random.Random(seed)

    def step(one: gl.StatefulDataLoader[Any, list[int]]) -> None:
        if rng.random() < 0.6:
            world = rng.randint(1, 3)
            one.set_geometry(rank=rng.randrange(world), world_size=world)

    def settle(one: gl.StatefulDataLoader[Any, list[int]]) -> None:
        one.commit() if rng.random() < 0.8 else one.rollback()

    async def epochs_async(one: gl.StatefulDataLoader[Any, list[int]]) -> None:
        for _ in range(2):
            it = aiter(one)
            while True:
                step(one)
                batch = await anext(it, None)
                if batch is None:
                    break
                out.append(batch)
                settle(one)
            await it.aclose()  # type: ignore[attr-defined]

    with loader(**kw) as one:
        if asynchronous:
            asyncio.run(epochs_async(one))
            return out, dict(one.stats())
        for _ in range(2):
            it = iter(one)
            while True:
                step(one)
                batch = next(it, None)
                if batch is None:
                    break
                out.append(batch)
                settle(one)
            it.close()
        return out, dict(one.stats())


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_process_workers_hand_out_what_no_worker_does_through_changes_of_geometry(
    seed: int, asynchronous: bool
) -> None:
    """Process workers re-planned at each change (a few ints sent, not the order; the first
    group alone), and sent the next epoch's order whole: the same batches as without workers."""
    made, stats = _follow(seed, asynchronous, parallel_method="process", num_workers=2, prefetch=2)
    assert made == _follow(seed)[0]
    assert len(made) > 30 and stats["collated_processes"] == stats["batches"]
