"""A ``collate_fn`` that raises ``SystemExit`` or ``KeyboardInterrupt``: the
consumer gets that same exception at the batch, after every earlier batch, in every way of
running the pipeline (inline, on a loop, thread and process workers; ``for`` and ``async for``)."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.data import identity_stream, ids

pytestmark = pytest.mark.usefixtures("no_thread_leak")


class ExitAt:
    """Picklable collate: the batch's observation indexes, and ``exc(code)`` raised at the batch
    that holds observation ``at``."""

    def __init__(self, exc: type[BaseException], at: int) -> None:
        self.exc, self.at = exc, at

    def __call__(self, samples: Sequence[np.ndarray]) -> list[int]:
        ids = [int(s[0]) // 4 for s in samples]
        if self.at in ids:
            raise self.exc(7)
        return ids


MODES = {
    "inline": {},
    "loop": {"prefetch": 2},
    "threads": {"num_workers": 2, "prefetch": 1},
    "processes": {"num_workers": 2, "parallel_method": "process"},
}


def loader_for(exc: type[BaseException], mode: str) -> gl.StatefulDataLoader[Any, list[int]]:
    return gl.StatefulDataLoader.from_storage(
        identity_stream(40),
        ExitAt(exc, 13),
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
        **MODES[mode],  # type: ignore[arg-type]
    )


def params() -> list[Any]:
    out = []
    for exc in (SystemExit, KeyboardInterrupt):
        for mode in MODES:
            marks = [pytest.mark.slow] if mode == "processes" else []
            out.append(pytest.param(exc, mode, id=f"{exc.__name__}-{mode}", marks=marks))
    return out


@pytest.mark.parametrize(("exc", "mode"), params())
def test_for_loop_gets_the_collates_own_exception(exc: type[BaseException], mode: str) -> None:
    got: list[list[int]] = []
    loader = loader_for(exc, mode)
    with loader:
        with pytest.raises(exc) as info:
            for b in loader:
                got.append(b)
        assert info.value.args == (7,)
        assert got == [[2 * i, 2 * i + 1] for i in range(6)]  # every batch before observation 13
        assert loader.state_dict()["observation_offset"] == 12
        with pytest.raises(exc):  # a new iterator starts again at the batch that failed
            next(iter(loader))
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("exc", "mode"), params())
def test_async_for_gets_the_collates_own_exception(exc: type[BaseException], mode: str) -> None:
    got: list[list[int]] = []

    async def main() -> None:
        loader = loader_for(exc, mode)
        async with loader:
            with pytest.raises(exc) as info:
                async for b in loader:
                    got.append(b)
            assert info.value.args == (7,)
            assert loader.state_dict()["observation_offset"] == 12

    asyncio.run(main())
    assert got == [[2 * i, 2 * i + 1] for i in range(6)]
    assert multiprocessing.active_children() == []


class ExitingStorage(gl.MemoryStreamStorage):
    """A storage whose read of observation ``at`` raises ``exc(7)`` (a Ctrl-C or an exit asked
    for while reading), from ``read_many_sync`` or from the coroutine ``read_many``."""

    def __init__(self, exc: type[BaseException], at: int, coroutine: bool) -> None:
        super().__init__(np.arange(40 * 4, dtype=np.int64))
        self.exc, self.at, self.coroutine = exc, at, coroutine

    def _check(self, starts: np.ndarray, length: int) -> None:
        if (np.asarray(starts) == self.at * length).any():
            raise self.exc(7)

    def read_many_sync(self, starts: Any, length: int) -> Sequence[Any]:
        self._check(starts, length)
        return super().read_many_sync(starts, length)

    async def read_many(self, starts: Any, length: int) -> Sequence[Any]:
        self._check(starts, length)
        return await super().read_many(starts, length)

    def reads_inline(self) -> bool:
        return not self.coroutine


@pytest.mark.parametrize("coroutine", [False, True], ids=["read_many_sync", "read_many"])
@pytest.mark.parametrize(("exc", "mode"), params())
def test_a_storage_read_that_exits_reaches_the_consumer_as_itself(
    exc: type[BaseException], mode: str, coroutine: bool
) -> None:
    """Not localised (a re-read would not raise a Ctrl-C again): it reaches the consumer at the
    first batch of the read that raised it, every batch before in order, nothing after (it came
    out as 'guideloom bug: the pipeline ended', escaped asyncio.run, or killed a worker)."""

    def check(got: list[list[int]], info: Any, offset: int) -> None:
        assert info.value.args == (7,)
        assert len(got) <= 6 and got == [[2 * i, 2 * i + 1] for i in range(len(got))]
        assert offset == 2 * len(got)

    def make() -> gl.StatefulDataLoader[Any, list[int]]:
        return gl.StatefulDataLoader.from_storage(
            ExitingStorage(exc, 13, coroutine), ids, sequence_length=4, local_batch_size=2,
            device=torch.device("cpu"), **MODES[mode],  # type: ignore[arg-type]
        )  # fmt: skip

    got: list[list[int]] = []
    with make() as loader:
        with pytest.raises(exc) as info:
            for b in loader:
                got.append(b)
        check(got, info, loader.state_dict()["observation_offset"])

    async def main() -> None:
        async with make() as loader:
            with pytest.raises(exc) as info:
                async for b in loader:
                    agot.append(b)
            check(agot, info, loader.state_dict()["observation_offset"])

    agot: list[list[int]] = []
    asyncio.run(main())
    assert multiprocessing.active_children() == []
