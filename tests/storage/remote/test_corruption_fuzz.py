"""The corruption fuzzer (``benchmarks/corruption.py``) at a fixed seed: no damaged dataset,
cache or part ever delivers a wrong sample, and every refusal is one clear guideloom error.

``python -m benchmarks faults --trials 2000 --seed S`` runs thousands; here a few hundred run on
the session's moto and nginx. A failure names each trial and the command that re-runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.corruption import (
    FAILURES,
    KINDS,
    MODES,
    Outcome,
    Twins,
    Worker,
    Wrong,
    build_data,
    combinations,
    env_for,
    mutate,
    report,
    run_trials,
    select,
    trial,
)
from guideloom_dev.servers import MotoS3, nginx_binary
from tests.support.remote import BUCKET


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pristine datasets and their same-shape twins, written once for the session (the tests
    of this module may run apart, each on whichever worker is free)."""
    folder = tmp_path_factory.mktemp("faults") / "data"
    folder.mkdir()
    build_data(folder)
    return folder


@pytest.fixture
def env(s3: MotoS3, www: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The session's moto, and nginx where it is installed (the http modes are left out otherwise)."""
    nginx = request.getfixturevalue("nginx") if nginx_binary() is not None else None
    return env_for(s3, BUCKET, nginx, www if nginx is not None else None)


def _fuzz(
    data: Path, env: dict[str, Any], seed: int, trials: range, only: str = "", jobs: int = 2
) -> list[Outcome]:
    """Trials ``trials`` (indexes) of the run seeded ``seed``, in ``jobs`` trial processes."""
    remote = {"s3"} | ({"http"} if "http" in env else set())
    keys = select(combinations(remote), only)
    outcomes = run_trials([trial(seed, i, keys) for i in trials], data, env, jobs=jobs, timeout=60)
    assert [o.index for o in outcomes] == list(trials)
    bad = [o for o in outcomes if o.outcome in FAILURES]
    assert not bad, "\n" + report(outcomes, seed, only)
    return outcomes


@pytest.mark.slow
def test_no_damage_delivers_a_wrong_sample(data: Path, env: dict[str, Any]) -> None:
    outcomes = _fuzz(data, env, seed=0, trials=range(300))
    # the trials did damage something: some were refused, and the whole run is not vacuous
    assert sum(o.outcome == "refused" for o in outcomes) >= 40


# The 1,000 trials of seed 1 in four parts, which the suite's workers run side by side.
MORE_TRIALS = [range(first, first + 250) for first in range(0, 1000, 250)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("trials", MORE_TRIALS, ids=[f"{r.start}-{r.stop - 1}" for r in MORE_TRIALS])
def test_no_damage_delivers_a_wrong_sample_in_more_trials(
    data: Path, env: dict[str, Any], trials: range
) -> None:
    _fuzz(data, env, seed=1, trials=trials, jobs=1)


@pytest.mark.slow
def test_the_oracle_sees_a_wrong_sample(data: Path) -> None:
    """Batches of another dataset of the same shape (the twin) are caught as wrong, and the
    pristine dataset passes, over both epochs."""
    worker = Worker(data, {})
    for kind in ("stream", "documents", "parquet", "prepared"):
        with pytest.raises(Wrong, match="not the pristine batch"):
            worker._epochs(kind, str(data / f"{kind}-alt"), {}, worker.expected[kind], 1, None)
        worker._epochs(kind, str(data / kind), {}, worker.expected[kind], 2, None)


def test_trials_are_a_pure_function_of_seed_and_index() -> None:
    keys = combinations({"s3", "http"})
    assert [trial(5, i, keys) for i in range(50)] == [trial(5, i, keys) for i in range(50)]
    one = "local-stream/data/flip/mid-epoch"
    assert select(keys, one) == [one]
    assert trial(5, 7, select(keys, one)).seed == trial(5, 7, keys).seed  # --only KEY --trial 7 re-runs it
    assert all(k.split("/")[0] in MODES for k in keys)
    assert not any(k.endswith("before-merge") and not k.startswith("prepared") for k in keys)


def test_twins_are_the_same_size_with_other_bytes(data: Path) -> None:
    for kind in ("stream", "documents", "parquet", "prepared"):
        twins = Twins(data / kind, data / f"{kind}-alt")
        for path in sorted((data / kind).rglob("*")):
            if path.is_file():
                name = path.relative_to(data / kind).as_posix()
                twin = twins.of(name)
                assert twin is not None and len(twin) == path.stat().st_size, name
                assert twin != path.read_bytes(), name


@settings(max_examples=200, deadline=None)
@given(old=st.binary(max_size=200), kind=st.sampled_from(KINDS[:-1]), seed=st.integers(0, 2**32))
def test_every_damage_changes_the_file(old: bytes, kind: str, seed: int) -> None:
    new, what = mutate(kind, old, np.random.default_rng(seed), None)
    assert new != old, what
    if kind == "flip":
        assert len(new) == max(len(old), 1)
    if kind == "truncate" and old:
        assert len(new) < len(old) and old.startswith(new)
    if kind == "append":
        assert new.startswith(old) and len(new) > len(old)
