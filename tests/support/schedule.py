"""The order in which pytest-xdist's workers take the tests: the long ones first, spread evenly.

Under ``--dist worksteal`` each worker starts on one contiguous share of the collection and, once
its own share is done, takes half of what is left in the longest share (from its end). A test of a
minute that comes last in a share sets the suite's end, and so do two such tests in one share. So
each worker's share starts with its part of the long tests, dealt out longest first to the share
with the least work so far, then its part of the others in collection order. The tests of a
module with a fixture set up once for the module (a Ray cluster) are dealt out together, as one.

How long each test takes is read from the last run's durations (pytest's cache, written by the
controller at the end of each run) over those in ``tests/durations.json`` (a clone's first run);
a test known in neither is short. The order changes what runs when, never what runs.
``python -m tests.support.schedule`` writes ``tests/durations.json`` again from the cache.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from . import ROOT

T = TypeVar("T")

LONG_SECONDS = 2.0
"""A test that took this long or longer (setup, call and teardown) is dealt out first."""

CACHE_KEY = "guideloom/durations"
"""Where pytest's cache (``.pytest_cache``) keeps each test's seconds from the runs before."""

COMMITTED = ROOT / "tests" / "durations.json"
"""The long tests' seconds as measured on a 2-core machine, for a clone's first run."""


def committed_durations(path: Path = COMMITTED) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def share_sizes(n_tests: int, n_workers: int) -> list[int]:
    """The number of tests worksteal sends each worker first (``check_schedule``'s arithmetic)."""
    sizes, left = [], n_tests
    for i in range(n_workers):
        sizes.append(left // (n_workers - i))
        left -= sizes[-1]
    return sizes


def deal(
    ids: Sequence[str], durations: Mapping[str, float], n_workers: int, units: Sequence[str] | None = None
) -> list[int]:
    """The indexes of ``ids`` in the order to hand to ``n_workers`` worksteal workers.

    ``units[i]`` names what test ``i`` belongs to; tests of one name in a row (the tests of a
    module whose fixtures are set up once for the module) are dealt out together, so that their
    fixtures are still set up once. By default each test is its own unit."""
    units = list(ids) if units is None else list(units)
    sizes = share_sizes(len(ids), n_workers)
    runs: list[list[int]] = []  # the tests of each unit, in collection order
    for i in range(len(ids)):
        if runs and units[runs[-1][-1]] == units[i]:
            runs[-1].append(i)
        else:
            runs.append([i])

    def seconds(run: list[int]) -> float:
        return sum(durations.get(ids[i], 0.0) for i in run)

    long = sorted((r for r in runs if seconds(r) >= LONG_SECONDS), key=lambda r: -seconds(r))
    shares: list[list[int]] = [[] for _ in sizes]
    work = [0.0] * len(sizes)
    for run in long:
        room = [k for k in range(len(sizes)) if sizes[k] - len(shares[k]) >= len(run)]
        if room:
            k = min(room, key=lambda k: (work[k], k))
            shares[k] += run
            work[k] += seconds(run)
            continue
        left = list(run)  # more tests than any share has room for: spread over the emptiest
        while left:
            k = max(range(len(sizes)), key=lambda k: (sizes[k] - len(shares[k]), -k))
            n = sizes[k] - len(shares[k])
            shares[k] += left[:n]
            work[k] += seconds(left[:n])
            left = left[n:]
    taken = {i for run in long for i in run}
    rest = iter(i for i in range(len(ids)) if i not in taken)
    for k, size in enumerate(sizes):
        shares[k] += [next(rest) for _ in range(size - len(shares[k]))]
    return [i for share in shares for i in share]


def reorder(
    items: list[T], ids: Sequence[str], durations: Mapping[str, float], n_workers: int, units: Sequence[str]
) -> None:
    """Put ``items`` (with node ids ``ids``, units ``units``) in :func:`deal`'s order, in place."""
    items[:] = [items[i] for i in deal(ids, durations, n_workers, units)]


def main() -> int:
    """Write the long tests of the last runs (pytest's cache) to ``tests/durations.json``."""
    cached = ROOT / ".pytest_cache" / "v" / CACHE_KEY
    if not cached.exists():
        print(f"no durations in {cached}: run the suite first (make test)", file=sys.stderr)
        return 1
    seconds: dict[str, float] = json.loads(cached.read_text())
    long = {k: round(v, 1) for k, v in sorted(seconds.items()) if v >= LONG_SECONDS / 2}
    COMMITTED.write_text(json.dumps(long, indent=0, sort_keys=True) + "\n")
    print(f"{len(long)} tests of {LONG_SECONDS / 2:g} s or more written to {COMMITTED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
