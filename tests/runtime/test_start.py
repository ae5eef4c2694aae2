"""How process workers start (``guideloom/_runtime/processes/start.py``): the start method the
environment names (``GUIDELOOM_WORKER_START``), read at each choice, and a clear error for one
guideloom does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

from guideloom._runtime.processes import start, zygote
from tests.support.loader import take
from tests.support.processes import ids, loader_for, worker_pids


def test_unset_or_empty_is_here_and_each_known_method_is_read_at_each_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(start.START_ENV, raising=False)
    assert start.start_method() == "here"
    monkeypatch.setenv(start.START_ENV, "")
    assert start.start_method() == "here"
    for method in ("forkserver", "spawn", "fork"):
        monkeypatch.setenv(start.START_ENV, method)
        assert start.start_method() == method
        assert start.worker_context().get_start_method() == method


@pytest.mark.parametrize("value", ["Fork", "threads", "here,fork"])
def test_a_method_guideloom_does_not_know_is_one_error_naming_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(start.START_ENV, value)
    with pytest.raises(ValueError, match=r"^GUIDELOOM_WORKER_START=.* one of here, forkserver, spawn, fork "):
        start.worker_context()


def test_a_bad_method_is_told_when_the_loader_starts_its_workers_not_when_a_store_opens(
    monkeypatch: pytest.MonkeyPatch, stream: Path
) -> None:
    monkeypatch.setenv(start.START_ENV, "threads")
    before = list(zygote._STANDBY)
    start._standby()  # what runs before the first object store: no error, and no standby
    assert list(zygote._STANDBY) == before
    with (
        loader_for(stream, ids) as loader,
        pytest.raises(ValueError, match="GUIDELOOM_WORKER_START='threads'"),
    ):
        take(loader)


@pytest.mark.slow
def test_the_loader_starts_its_workers_by_the_method_the_environment_names(
    monkeypatch: pytest.MonkeyPatch, stream: Path
) -> None:
    with loader_for(stream, ids, num_workers=0) as inline:
        want = take(inline)
    monkeypatch.setenv(start.START_ENV, "forkserver")
    with loader_for(stream, ids, collate_mode="workers") as loader:
        it = iter(loader)
        assert it._driver.procs is not None
        assert it._driver.procs.pool.ctx.get_start_method() == "forkserver"
        got = list(it)
        assert len(worker_pids()) == 2
    assert got == want
