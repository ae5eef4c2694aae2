"""The order the suite's workers take the tests in (``tests/support/schedule.py``): every test
once, each worker's first share starting with its part of the long tests."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tests.support.schedule import COMMITTED, LONG_SECONDS, deal, share_sizes


@given(n_tests=st.integers(0, 300), n_workers=st.integers(1, 8))
def test_the_shares_are_worksteals_first_sends(n_tests: int, n_workers: int) -> None:
    sizes = share_sizes(n_tests, n_workers)
    assert sum(sizes) == n_tests and max(sizes) - min(sizes) <= 1


@given(
    seconds=st.lists(st.sampled_from([0.0, 0.1, 1.9, 2.0, 5.0, 30.0, 120.0]), max_size=120),
    n_workers=st.integers(1, 6),
    known=st.booleans(),
)
def test_every_test_runs_once_and_each_share_starts_with_its_long_tests(
    seconds: list[float], n_workers: int, known: bool
) -> None:
    ids = [f"tests/test_{i // 7}.py::test_{i}" for i in range(len(seconds))]
    durations = {nodeid: s for nodeid, s in zip(ids, seconds, strict=True) if known or s >= LONG_SECONDS}
    order = deal(ids, durations, n_workers)
    assert sorted(order) == list(range(len(ids)))
    start = 0
    long_work = []
    for size in share_sizes(len(ids), n_workers):
        share = [seconds[i] for i in order[start : start + size]]
        start += size
        n_long = sum(s >= LONG_SECONDS for s in share)
        assert all(s >= LONG_SECONDS for s in share[:n_long]), share  # the long ones first
        assert share[:n_long] == sorted(share[:n_long], reverse=True), share
        short = order[start - size + n_long : start]
        assert short == sorted(short)  # the others in collection order
        long_work.append(sum(share[:n_long]))
    # dealt longest first to the least loaded share: where every share had room for all of them,
    # no share holds more long work than the least loaded one plus the longest test
    long = [s for s in seconds if s >= LONG_SECONDS]
    if long and len(long) <= min(share_sizes(len(ids), n_workers)):
        assert max(long_work) - min(long_work) <= max(long)


def test_the_committed_durations_name_tests_by_node_id() -> None:
    durations = json.loads(COMMITTED.read_text())
    assert durations and all("::" in k and isinstance(v, float) and v > 0 for k, v in durations.items())


@given(
    seconds=st.lists(st.sampled_from([0.0, 0.5, 3.0, 40.0]), min_size=1, max_size=80),
    modules=st.lists(st.integers(1, 6), min_size=1, max_size=20),
    n_workers=st.integers(1, 4),
)
def test_the_tests_of_a_unit_stay_together_where_a_share_has_room(
    seconds: list[float], modules: list[int], n_workers: int
) -> None:
    """Units: runs of 1 to 6 tests in a row; even ones are a module's, odd ones tests of their own."""
    units: list[str] = []
    for m, size in enumerate(modules):
        units += [f"m{m}" if m % 2 == 0 else f"m{m}-{j}" for j in range(size)]
    units = units[: len(seconds)]
    ids = [f"{u}::t{i}" for i, u in enumerate(units)]
    order = deal(ids, dict(zip(ids, seconds, strict=False)), n_workers, units)
    assert sorted(order) == list(range(len(ids)))
    sizes = share_sizes(len(ids), n_workers)
    where = {i: k for k in range(n_workers) for i in order[sum(sizes[:k]) : sum(sizes[: k + 1])]}
    members_of = {u: [i for i, v in enumerate(units) if v == u] for u in set(units)}
    long = [m for m in members_of.values() if sum(seconds[i] for i in m) >= LONG_SECONDS]
    if sum(len(m) for m in long) > min(sizes):
        return  # a share may have no room left for a whole unit: it is spread, as it must be
    for unit, members in members_of.items():
        if members in long:
            assert len({where[i] for i in members}) == 1, unit  # dealt out whole, to one share
            at = sorted(order.index(i) for i in members)
            assert at == list(range(at[0], at[0] + len(at)))  # in a row
