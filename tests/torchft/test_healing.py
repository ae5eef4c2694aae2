"""Healing in the order a ``torchft.Manager`` with its default asynchronous quorum runs it, step
by step in one process: a replica that heals is handed a batch at its first step (it does not
take part), receives a live peer's state in ``should_commit()`` and applies it at its next step;
a peer's state is taken at the quorum, before that peer's own ``next()``. A replica that has
just healed is up to date, so the next replica to heal may take its state from it."""

from __future__ import annotations

from collections import Counter

import pytest

from guideloom.torchft import FaultTolerantLoader
from tests.support.data import identity_stream
from tests.support.loader import make
from tests.support.quorum import ScriptedManager

pytestmark = pytest.mark.usefixtures("no_thread_leak")

N = 12


class Replica:
    def __init__(self) -> None:
        self.loader = make(
            identity_stream(N), local_batch_size=1, shuffle=True, shuffle_seed=3, drop_last=False
        )
        self.loader.open()
        self.manager = ScriptedManager()
        self.batches = FaultTolerantLoader(self.loader, self.manager)

    def close(self) -> None:
        self.batches.close()
        self.loader.close()


def step(replicas: list[Replica], committed: Counter[int], heal_from: dict[int, int] | None = None) -> None:
    """One step of torchft's async quorum: replicas behind the others heal (from the peer named in
    ``heal_from``), the up-to-date ones take part, every step commits."""
    heal_from = heal_from or {}
    top = max(r.manager.step for r in replicas)
    members = [r for r in replicas if r.manager.step == top]
    for i, source in heal_from.items():
        healer = replicas[i]
        healer.manager.pending = replicas[source].manager.fns["guideloom"][1]()  # at the quorum
        healer.manager.step = top
    for r in replicas:
        r.manager.rank = members.index(r) if r in members else None
        r.manager.participants = len(members)
    got = [r.batches.next() for r in replicas]
    for r, batch in zip(replicas, got, strict=True):
        if r.manager.pending is not None:  # should_commit() applies a received state
            r.manager.fns["guideloom"][0](r.manager.pending)
            r.manager.pending = None
        if r.batches.participating and r.batches.epoch == 0:
            committed.update(batch)
        r.manager.step += 1


def test_a_replica_that_just_healed_hands_the_state_it_received_to_the_next_one() -> None:
    a, b, c = Replica(), Replica(), Replica()
    committed: Counter[int] = Counter()
    try:
        step([a], committed)
        step([a, b], committed, heal_from={1: 0})  # b heals from a
        step([a, b, c], committed, heal_from={2: 1})  # c heals from b, which has just healed
        while all(r.batches.epoch == 0 for r in (a, b, c)):
            step([a, b, c], committed)
    finally:
        for r in (a, b, c):
            r.close()
    repeated = sorted(i for i, n in committed.items() if n > 1)
    lost = sorted(set(range(N)) - set(committed))
    assert not repeated and not lost, f"repeated {repeated}, lost {lost}"


def test_a_state_refused_for_its_step_is_not_applied() -> None:
    """A peer's state too far behind the Manager is refused; the replica's own position stays."""
    one = Replica()
    try:
        one.manager.rank, one.manager.participants = 0, 1
        for _ in range(2):
            one.batches.next()
            one.manager.step += 1
        other = Replica()
        try:
            it = iter(other.loader)
            for _ in range(7):
                next(it)
                other.loader.commit()
            it.close()
            stale = {"loader": other.loader.state_dict(committed=True), "step": one.manager.step - 3}
        finally:
            other.close()
        one.batches.load_state_dict(stale)
        with pytest.raises(RuntimeError, match="3 steps behind"):
            one.batches.next()
        assert one.loader.state_dict()["observation_offset"] == 2  # the two committed steps
        batch = one.batches.next()
        assert one.loader.state_dict()["observation_offset"] == 3, f"went on from the refused state: {batch}"
    finally:
        one.close()


def test_a_batch_asked_for_before_the_first_quorum_is_refused() -> None:
    """Before its first quorum a Manager has no participants (torchft answers ``None`` and 0): a
    batch asked for then (``for batch in batches`` before ``zero_grad()``, as torchft's own loop
    is written) would be cut for one replica while the job has several. It is refused with a
    message that says to start the quorum first."""
    a, b = Replica(), Replica()
    try:
        for r in (a, b):
            r.manager.rank, r.manager.participants = None, 0
        with pytest.raises((RuntimeError, ValueError), match="quorum"):
            next(iter(a.batches))
        with pytest.raises((RuntimeError, ValueError), match="quorum"):
            b.batches.next()
    finally:
        a.close()
        b.close()


def test_a_replica_that_heals_twice_in_a_row_goes_on_from_the_second_state() -> None:
    """A replica heals, misses the next quorum (it was slow), and heals again at the one after:
    the first state it received is superseded by the second, not an error."""
    a, b = Replica(), Replica()
    committed: Counter[int] = Counter()
    try:
        step([a], committed)
        step([a, b], committed, heal_from={1: 0})  # b heals from a
        step([a], committed)  # b misses this quorum
        step([a, b], committed, heal_from={1: 0})  # and heals again
        while all(r.batches.epoch == 0 for r in (a, b)):
            step([a, b], committed)
    finally:
        a.close()
        b.close()
    repeated = sorted(i for i, n in committed.items() if n > 1)
    lost = sorted(set(range(N)) - set(committed))
    assert not repeated and not lost, f"repeated {repeated}, lost {lost}"
