"""The standby zygote's check of what a pool's workers would unpickle from ``__main__``."""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time
from typing import Any

import pytest

from guideloom._runtime.processes import zygote
from guideloom._runtime.processes.zygote import main_names


def _made_in_main(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, type]:
    """A function and a class as if the main script had defined them."""
    main = sys.modules["__main__"]

    def collate(samples: list[Any]) -> list[Any]:
        return samples

    class Dataset:
        def __init__(self) -> None:
            self.path = "__main__"  # a string that names the module, not a reference to it

    for obj, name in ((collate, "collate"), (Dataset, "Dataset")):
        obj.__module__, obj.__qualname__ = "__main__", name
        monkeypatch.setattr(main, name, obj, raising=False)
    return collate, Dataset


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_main_names_are_the_main_globals_a_pickle_refers_to(
    monkeypatch: pytest.MonkeyPatch, protocol: int
) -> None:
    collate, dataset = _made_in_main(monkeypatch)
    spec = pickle.dumps((dataset(), collate, [collate, dataset], "__main__", pickle.dumps), protocol=protocol)
    assert main_names(spec) == {"collate", "Dataset"}
    assert main_names(pickle.dumps((pickle.dumps, "__main__", "collate"), protocol=protocol)) == set()


def test_a_pickle_that_cannot_be_read_names_anything() -> None:
    assert main_names(b"not a pickle, though it names __main__") is None


def test_a_start_on_an_event_loop_never_sleeps_waiting_for_other_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a thread that does not end, a start from a coroutine answers at once (the loop is
    never put to sleep); from plain code it gives an ending thread its grace first."""
    slept: list[float] = []
    me, sleep = threading.get_ident(), time.sleep

    def recorded(seconds: float) -> None:  # the module sleeps through time.sleep, on this thread
        if threading.get_ident() == me:
            slept.append(seconds)
        else:  # another test's background thread (a pool letting held blocks go)
            sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="stays")
    other.start()
    try:

        async def on_the_loop() -> bool:
            return zygote.may_fork_here(None)

        assert asyncio.run(on_the_loop()) is False
        assert slept == []
        assert zygote.may_fork_here(None) is False
        assert slept  # the grace, outside a loop
    finally:
        stop.set()
        other.join()
