"""The path from ``iter(loader)`` to a delivered batch: the runtime modules a reader follows,
each entered once (a driver calls its flow, the flow its executor; nothing calls back up)."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import guideloom
from tests.support.data import identity_stream
from tests.support.loader import make

pytestmark = pytest.mark.usefixtures("no_thread_leak")

RUNTIME = str(Path(guideloom.__file__).parent / "_runtime") + "/"


class Stops:
    """A profile hook (``sys.setprofile``) on the consumer's thread: the runtime modules entered,
    and each call stack on which one was entered again below itself (not counting what a
    ``weakref.finalize`` runs when the collector frees an object at whatever call it interrupts)."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.reentered: list[list[str]] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(RUNTIME):
            return
        files: list[str] = []
        f: FrameType | None = frame
        while f is not None:
            files.append(f.f_code.co_filename)
            f = f.f_back
        if any(name.endswith("/weakref.py") for name in files):
            return  # a finalizer the collector ran here (an earlier loader's pool closing): off the path
        # the stack, outermost first, as modules: a module's consecutive frames are one stop
        stops = [name for name, _ in itertools.groupby(reversed(files))]
        name = frame.f_code.co_filename
        self.modules.add(name.removeprefix(RUNTIME))
        if stops.count(name) > 1:
            self.reentered.append([s.rpartition("guideloom/")[2] for s in stops if "guideloom/" in s])


def _short(paths: list[list[str]]) -> list[str]:
    return sorted({" -> ".join(p) for p in paths})


@pytest.mark.parametrize(("num_workers", "prefetch"), [(0, 0), (0, 2), (2, 0)])
def test_a_sync_for_enters_each_runtime_module_once(num_workers: int, prefetch: int) -> None:
    loader = make(identity_stream(64), local_batch_size=2, num_workers=num_workers, prefetch=prefetch)
    path = Stops()
    with loader:
        sys.setprofile(path)
        try:
            got = [b for batch in loader for b in batch]
        finally:
            sys.setprofile(None)
    assert sorted(got) == list(range(64))
    assert not path.reentered, _short(path.reentered)
    # the driver, its flow and the executors: nothing of the runtime's beyond them but the
    # epoch's sizes (config), and the measured choice and collate threads where there are workers
    assert {"drive.py", "flow.py", "executors.py"} <= path.modules
    assert path.modules <= {"drive.py", "flow.py", "executors.py", "config.py", "chooser.py", "threadpool.py"}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_async_for_enters_each_runtime_module_once(num_workers: int) -> None:
    loader = make(identity_stream(64), local_batch_size=2, num_workers=num_workers)
    path = Stops()

    async def run() -> list[int]:
        async with loader:
            sys.setprofile(path)
            try:
                return [b async for batch in loader for b in batch]
            finally:
                sys.setprofile(None)

    got = asyncio.run(run())
    assert sorted(got) == list(range(64))
    assert not path.reentered, _short(path.reentered)
    assert {"drive.py", "flow.py", "executors.py"} <= path.modules
    # and the leaves: the sizes, the collate thread, and at prefetch=0 the choice of the loop
    leaves = {"config.py", "threadpool.py", "chooser.py"}
    assert path.modules <= {"drive.py", "flow.py", "executors.py", *leaves}


@pytest.mark.slow
@pytest.mark.parametrize("collate_mode", ["workers", "auto"])
def test_process_workers_enter_each_runtime_module_once(collate_mode: str) -> None:
    def loader() -> Any:
        return make(
            identity_stream(64),
            local_batch_size=2,
            num_workers=2,
            parallel_method="process",
            collate_mode=collate_mode,
        )

    sync_path, async_path = Stops(), Stops()
    with loader() as ld:
        sys.setprofile(sync_path)
        try:
            got = [b for batch in ld for b in batch]
        finally:
            sys.setprofile(None)
    assert sorted(got) == list(range(64))

    async def run() -> list[int]:
        async with loader() as ld:
            sys.setprofile(async_path)
            try:
                return [b async for batch in ld for b in batch]
            finally:
                sys.setprofile(None)

    assert sorted(asyncio.run(run())) == list(range(64))
    for path in (sync_path, async_path):
        assert not path.reentered, _short(path.reentered)
        # behind the executor, the process pool's session (processes/): the executor's own
        beyond = {m for m in path.modules if not m.startswith("processes/")}
        assert {"drive.py", "flow.py", "executors.py"} <= beyond
        assert beyond <= {"drive.py", "flow.py", "executors.py", "config.py", "chooser.py", "threadpool.py"}
