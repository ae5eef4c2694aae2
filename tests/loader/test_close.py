"""Closing is bounded in time whatever ``collate_fn`` does: a collate that never returns is left
running on its (daemon) thread, with a warning that names it, and the loader closes."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom._runtime import threadpool
from guideloom._runtime.threadpool import CLOSE_GRACE_S
from tests.support.processes import run_script

RELEASE = threading.Event()


def stuck_at_40(samples: Sequence[np.ndarray]) -> list[int]:
    """Collates until the sample of element 40, then waits for the test to release it."""
    if int(samples[0][0]) >= 40:
        RELEASE.wait(60)
    return [int(s[0]) for s in samples]


def _loader(**kw: object) -> gl.StatefulDataLoader[np.ndarray, list[int]]:
    return gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(400)), stuck_at_40, sequence_length=4, local_batch_size=2,
        device=torch.device("cpu"), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _release_at_the_end() -> object:
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close here waits out the whole grace for the hung collate: 0.25 s of it, not the default
    (the bounds checked below stay those of the default). A script run here keeps the default."""
    monkeypatch.setattr(threadpool, "CLOSE_GRACE_S", 0.25)


@pytest.mark.parametrize(
    "kw", [{"num_workers": 2}, {"prefetch": 4}, {"num_workers": 2, "prefetch": 2}, {"num_workers": 1}]
)
@pytest.mark.slow
def test_close_returns_while_a_collate_hangs_and_says_which(kw: dict[str, object]) -> None:
    loader = _loader(**kw)
    loader.open()
    got: list[list[int]] = []
    consumer = threading.Thread(target=lambda: got.extend(iter(loader)), daemon=True)
    consumer.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="had not returned .* left running"):
        loader.close()
    assert time.monotonic() - t0 < CLOSE_GRACE_S + 3
    RELEASE.set()
    consumer.join(10)
    assert not consumer.is_alive()
    assert [b[0] for b in got] == list(range(0, 40, 8))  # the batches before the stuck one


#: What every close must end within, whatever the collate does: the bound the loader promises.
CLOSE_BOUND_S = 10.0


@pytest.mark.parametrize(
    "kw", [{"num_workers": 2}, {"num_workers": 1}, {"num_workers": 2, "prefetch": 2}, {"prefetch": 4}]
)
@pytest.mark.slow
def test_a_next_blocked_on_a_hung_collate_ends_when_another_thread_closes(kw: dict[str, object]) -> None:
    """A consumer blocked in ``next()`` on a batch whose collate never returns is released by
    ``close()`` in another thread, with ``StopIteration`` (the iteration ends, as at the end of
    an epoch), long before the collate returns; the position stays at the last batch it got."""
    loader = _loader(**kw)
    loader.open()
    got: list[list[int]] = []
    ended: list[float] = []

    def consume() -> None:
        got.extend(iter(loader))  # ends with StopIteration; any other exception fails the join
        ended.append(time.monotonic())

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.5)
    assert consumer.is_alive()  # blocked on the stuck batch
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="left running"):
        loader.close()
    consumer.join(CLOSE_BOUND_S)
    assert ended and ended[0] - t0 < CLOSE_BOUND_S, "next() was not released by close()"
    assert not RELEASE.is_set()
    assert [b[0] for b in got] == list(range(0, 40, 8))
    assert loader.state_dict()["observation_offset"] == 2 * len(got)  # batches of 2 samples


@pytest.mark.parametrize("closer", ["aclose from another task", "close from another thread"])
@pytest.mark.slow
def test_an_async_for_blocked_on_a_hung_collate_ends_when_the_loader_closes(closer: str) -> None:
    """The same for ``async for``: its ``__anext__`` ends with ``StopAsyncIteration``."""
    loader = _loader(num_workers=2)
    got: list[list[int]] = []
    ended: list[float] = []

    async def consume() -> None:
        async for batch in loader:
            got.append(batch)
        ended.append(time.monotonic())

    async def run() -> float:
        await loader.aopen()
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        assert not task.done()  # blocked on the stuck batch
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="left running"):
            if closer == "aclose from another task":
                await loader.aclose()
            else:
                await asyncio.to_thread(loader.close)
        await asyncio.wait_for(task, CLOSE_BOUND_S)
        return t0

    t0 = asyncio.run(run())
    assert ended and ended[0] - t0 < CLOSE_BOUND_S
    assert not RELEASE.is_set()
    assert [b[0] for b in got] == list(range(0, 40, 8))


@pytest.mark.slow
def test_async_close_returns_while_a_collate_hangs() -> None:
    loader = _loader(num_workers=2)

    async def run() -> float:
        async with loader:
            it = aiter(loader)
            await anext(it)
            task = asyncio.create_task(anext(it))
            await asyncio.sleep(0.3)
            for _ in range(8):  # up to the stuck batch
                if task.done():
                    task = asyncio.create_task(anext(it))
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            with pytest.warns(RuntimeWarning, match="left running"):
                await it.aclose()  # type: ignore[attr-defined]
            task.cancel()
            return time.monotonic() - t0

    assert asyncio.run(run()) < CLOSE_GRACE_S + 3


@pytest.mark.parametrize("workers", ["none", "process"])
@pytest.mark.slow
def test_a_script_that_exits_mid_epoch_ends_at_once_and_quietly(tmp_path: Path, workers: str) -> None:
    """An iterator left open at interpreter exit (the loader opened by it, not by ``with``) is not
    closed from its finaliser while the interpreter tears its modules down: the exit takes no
    close's grace period and prints nothing."""
    kw = "num_workers=2, parallel_method='process'," if workers == "process" else ""
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import numpy as np, torch
            import guideloom as gl

            if __name__ == "__main__":
                tokens = np.arange(64 * 400, dtype=np.uint16)
                loader = gl.StatefulDataLoader.from_storage(
                    gl.MemoryStreamStorage(tokens), list, sequence_length=64, local_batch_size=4,
                    prefetch=2, {kw} device=torch.device("cpu"),
                )
                it = iter(loader)
                kept = [next(it) for _ in range(10)]
                print("leaving")
            """
        )
    )
    t0 = time.monotonic()
    r = run_script(script, timeout=60)
    assert r.stdout.split() == ["leaving"]
    assert r.stderr == ""
    assert time.monotonic() - t0 < CLOSE_GRACE_S + 15  # no close waited out at exit
