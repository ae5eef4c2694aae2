"""A :class:`FaultTolerantLoader` driven through random failure schedules in one process, in the
order torchft's Manager runs a step (the quorum, the peers' state taken at it, ``next()``,
``should_commit()`` applying a received state, the step advancing only where it committed):
replica groups of ``num_shards`` ranks die during a step and come back as fresh processes that
heal from a live peer. Every sample of the first epoch is committed exactly once, the ranks of a
step read disjoint data, and misuse is refused plainly."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guideloom.torchft import FaultTolerantLoader
from tests.support.data import identity_stream
from tests.support.loader import make
from tests.support.quorum import ScriptedManager

pytestmark = pytest.mark.usefixtures("no_thread_leak")

N = 37  # prime: no global batch divides the epoch
GROUPS = 3


class Rank:
    """One rank of a replica group (a process): its loader, Manager and fault-tolerant loader."""

    def __init__(self, shard: int, shards: int, per_step: int = 1, **kw: Any) -> None:
        kw = {"local_batch_size": 2, "shuffle": True, "shuffle_seed": 7, "drop_last": False, **kw}
        self.loader = make(identity_stream(N), **kw)
        self.loader.open()
        self.manager = ScriptedManager()
        self.batches = FaultTolerantLoader(
            self.loader, self.manager, shard_rank=shard, num_shards=shards, batches_per_step=per_step
        )

    def close(self) -> None:
        self.batches.close()
        self.loader.close()


#: Per step: the groups that die during it, the dead groups that come back at its start, and
#: whether it fails for another reason (a slow peer, a timeout).
Event = tuple[frozenset[int], frozenset[int], bool]


def simulate(events: list[Event], shards: int, **kw: Any) -> tuple[Counter[int], list[str]]:
    """Run ``events`` then steps without failures until every live rank is in epoch 1; the
    samples of epoch 0 that participating ranks committed, and what went wrong on the way
    (among it, a committed step that ``explain()`` names otherwise)."""
    groups: dict[int, list[Rank]] = {g: [Rank(s, shards, **kw) for s in range(shards)] for g in range(GROUPS)}
    committed: Counter[int] = Counter()
    problems: list[str] = []
    records: list[tuple[int, int, int, list[int]]] = []  # (epoch, step, rank, batch) committed
    steps_of: Counter[int] = Counter()  # steps committed in each epoch
    events = list(events)
    try:
        for step in range(10_000):
            dies, back, fails = events.pop(0) if events else (frozenset(), frozenset(), False)
            for g in sorted(back):
                if g not in groups:
                    groups[g] = [Rank(s, shards, **kw) for s in range(shards)]
            top = max(r[0].manager.step for r in groups.values())
            members = sorted(g for g, ranks in groups.items() if ranks[0].manager.step == top)
            for g, ranks in groups.items():  # the quorum: behind ones heal from a member
                if g not in members:
                    source = groups[members[0]]
                    for s, r in enumerate(ranks):
                        r.manager.pending = source[s].manager.fns["guideloom"][1]()
                        r.manager.step = top
            dies = frozenset(g for g in dies if g in groups) - {members[0]}
            for g, ranks in groups.items():
                for r in ranks:
                    r.manager.rank = members.index(g) if g in members else None
                    r.manager.participants = len(members)
            got: dict[tuple[int, int], tuple[list[int], bool, int]] = {}
            for g, ranks in groups.items():
                for s, r in enumerate(ranks):
                    batch = r.batches.next()
                    got[g, s] = (batch, r.batches.participating, r.batches.epoch)
            seen: Counter[int] = Counter()
            for (_, _), (batch, participating, _) in got.items():
                if participating:
                    seen.update(batch)
            if any(c > 1 for c in seen.values()):
                problems.append(f"step {step}: ranks of the step read the same samples {seen}")
            commits = not dies and not fails
            for g in sorted(dies):  # SIGKILLed during the step: gone
                for r in groups.pop(g):
                    r.close()
            for ranks in groups.values():
                for r in ranks:
                    if r.manager.pending is not None:  # should_commit() applies a received state
                        r.manager.fns["guideloom"][0](r.manager.pending)
                        r.manager.pending = None
                    if commits:
                        r.manager.step += 1
            if commits:
                epochs = {epoch for (_, participating, epoch) in got.values() if participating}
                if len(epochs) > 1:
                    problems.append(f"step {step}: the participants' batches are of epochs {epochs}")
                for (g, s), (batch, participating, epoch) in got.items():
                    if participating:
                        if epoch == 0:
                            committed.update(batch)
                        records.append((epoch, steps_of[epoch], members.index(g) * shards + s, batch))
                steps_of.update(epochs)
            if not events and all(r.batches.epoch >= 1 for ranks in groups.values() for r in ranks):
                witness = next(iter(groups.values()))[0].loader
                kept = witness.state_dict()["epoch"] - 1  # the history keeps this epoch and the last
                for epoch, step_no, rank, batch in records:
                    if epoch < kept:
                        continue
                    named = [d["index"] for d in witness.explain(step_no, rank=rank, epoch=epoch)]
                    if named != batch:
                        problems.append(
                            f"explain({step_no}, rank={rank}, epoch={epoch}) names {named}, rank took {batch}"
                        )
                return committed, problems
        raise AssertionError("the epoch never ended")
    finally:
        for ranks in groups.values():
            for r in ranks:
                r.close()


group = st.integers(0, GROUPS - 1)
events = st.lists(
    st.tuples(st.frozensets(group, max_size=2), st.frozensets(group, max_size=2), st.booleans()),
    max_size=25,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, shards=st.sampled_from([1, 2]), prefetch=st.sampled_from([0, 2]))
def test_every_sample_is_committed_once_whatever_groups_die_and_heal(
    events: list[Event], shards: int, prefetch: int
) -> None:
    committed, problems = simulate(events, shards, prefetch=prefetch)
    assert not problems, problems
    repeated = sorted(i for i, n in committed.items() if n > 1)
    lost = sorted(set(range(N)) - set(committed))
    assert not repeated and not lost, f"repeated {repeated}, lost {lost}"


def test_a_group_that_heals_at_the_epochs_last_step_goes_on_in_the_next_epoch() -> None:
    """The heal step is the epoch's last: the healed group takes it (its peers commit it) and
    goes on with them into the next epoch."""
    quiet: Event = (frozenset(), frozenset(), False)
    # 3 groups x 2: 18 samples in steps 0-2; group 1 dies during step 3; 19 left for 2 groups x 2:
    # steps 4-8, the last (8) the one group 1 comes back and heals at
    schedule = [quiet] * 9
    schedule[3] = (frozenset({1}), frozenset(), False)
    schedule[8] = (frozenset(), frozenset({1}), False)
    committed, problems = simulate(schedule, 1)
    assert not problems, problems
    assert sorted(committed) == list(range(N))


def test_misuse_is_refused_with_a_message() -> None:
    r = Rank(0, 1)
    try:
        with pytest.raises(ValueError, match="num_shards"):
            FaultTolerantLoader(r.loader, ScriptedManager(), num_shards=0)
        with pytest.raises(ValueError, match="shard_rank"):
            FaultTolerantLoader(r.loader, ScriptedManager(), shard_rank=2, num_shards=2)
        with pytest.raises(ValueError, match="'loader' and 'step'"):
            r.batches.load_state_dict({"observation_offset": 3})  # type: ignore[dict-item]
        with pytest.raises(RuntimeError, match="quorum"):
            r.batches.next()
    finally:
        r.close()


def test_the_micro_batches_of_a_step_are_distinct_and_settled_together() -> None:
    """With gradient accumulation (``batches_per_step=2``), a step's second ``next()`` is the
    step's next batch; the step's outcome settles both (taken back together when the step
    failed, handed out again under the next quorum)."""
    r = Rank(0, 1, per_step=2)
    try:
        r.manager.rank, r.manager.participants = 0, 1
        first, second = r.batches.next(), r.batches.next()
        assert first != second
        again = r.batches.next(), r.batches.next()  # the step failed: current_step() did not move
        assert list(again) == [first, second]
        r.manager.step += 1  # committed
        third = r.batches.next()
        assert third not in (first, second)
    finally:
        r.close()


def test_a_second_batch_in_one_step_without_batches_per_step_is_the_step_after_a_failure() -> None:
    """Without ``batches_per_step``, a call whose Manager step did not move on follows a step
    that failed: its batch is handed out again (torchft's step count moves only on a commit)."""
    r = Rank(0, 1)
    try:
        r.manager.rank, r.manager.participants = 0, 1
        first = r.batches.next()
        assert r.batches.next() == first
    finally:
        r.close()


def test_a_group_that_heals_into_a_spare_keeps_the_state_it_received() -> None:
    """torchft's ``WorldSizeMode.FIXED_WITH_SPARES`` with two participants: a third group is a
    spare (``participating_rank()`` None) whenever the other two are up. It heals, is a spare at
    the next step, and takes part once a participant is lost."""
    a, b, c = Rank(0, 1), Rank(0, 1), Rank(0, 1)
    committed: list[int] = []

    def step(ranks: dict[Rank, int | None], heal: Rank | None = None) -> None:
        if heal is not None:  # the quorum: the healing group gets a live peer's state
            heal.manager.pending = a.manager.fns["guideloom"][1]()
            heal.manager.step = a.manager.step
        for r, rank in ranks.items():
            r.manager.rank, r.manager.participants = rank, 2
        got = {r: r.batches.next() for r in ranks}
        for r, rank in ranks.items():
            if r.manager.pending is not None:  # should_commit() applies it
                r.manager.fns["guideloom"][0](r.manager.pending)
                r.manager.pending = None
            r.manager.step += 1
            if rank is not None:
                committed.extend(got[r])

    try:
        step({a: 0, b: 1})
        step({a: 0, b: 1, c: None}, heal=c)  # c joins and heals
        step({a: 0, b: 1, c: None})  # c is up to date: a spare
        where = [
            (r.loader.state_dict()["epoch"], r.loader.state_dict()["observation_offset"]) for r in (a, c)
        ]
        assert where[0] == where[1], f"the spare is at {where[1]}, its peers at {where[0]}"
        step({a: 0, c: 1})  # b is lost: the spare takes part
        repeated = sorted(i for i in set(committed) if committed.count(i) > 1)
        assert not repeated, f"samples committed twice: {repeated}"
    finally:
        for r in (a, b, c):
            r.close()
