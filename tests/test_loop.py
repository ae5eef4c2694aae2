"""The background event loop the synchronous facade runs its pipeline on."""

from __future__ import annotations

import gc
import warnings

import pytest

from guideloom._loop import LoopThread


async def _answer() -> int:
    return 42


def test_a_coroutine_runs_on_the_loop_thread() -> None:
    lt = LoopThread()
    try:
        assert lt.run(_answer()) == 42
    finally:
        lt.stop()


def test_a_loop_stopped_refuses_a_coroutine_and_closes_it() -> None:
    lt = LoopThread()
    lt.stop()
    coro = _answer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            lt.submit(coro)
        del coro
        gc.collect()
    assert [str(w.message) for w in caught] == []
