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
