"""Process workers (parallel_method="process"): batches through shared memory, workers kept
between iterators, death, stuck collates, leaks, and the ``__main__`` guard."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._runtime.processes import SHUTDOWN_GRACE_S, RemoteTraceback, WorkerPool, live_segments
from tests.support.data import take

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_thread_leak")]

SEQ = 64


@pytest.fixture
def own_segments(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[str]]:
    """The live ``/dev/shm`` segments of the pools this test made. Only those: another session's
    tests may hold segments of their own meanwhile. Fails if the test made no pool at all."""
    tokens: list[str] = []
    init = WorkerPool.__init__

    def recording(self: WorkerPool, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        tokens.append(self.token)

    monkeypatch.setattr(WorkerPool, "__init__", recording)

    def live() -> list[str]:
        assert tokens, "the test made no worker pool: its leak check would prove nothing"
        return [name for token in tokens for name in live_segments(token + "-")]

    return live


def rich(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """A collate whose batch holds what travels through shared memory (large tensors and arrays,
    bfloat16 too) and what travels pickled (small tensors, plain objects)."""
    block = np.stack([np.asarray(s) for s in samples]).astype(np.int64)
    big = np.tile(block, (1, 16))  # (4, 1024): 32 KiB, well above the 4 KiB threshold
    return {
        "tokens": torch.from_numpy(big),
        "half": torch.from_numpy(big).to(torch.bfloat16),
        "array": big.astype(np.float32),
        "transposed": torch.from_numpy(big).t(),  # not contiguous
        "small": torch.from_numpy(block[:, :2].copy()),
        "ids": [int(s[0]) // SEQ for s in samples],
        "same": (torch.from_numpy(big),) * 2,
    }


def ids(samples: Sequence[np.ndarray]) -> list[int]:
    return [int(s[0]) // SEQ for s in samples]


def slow_ids(samples: Sequence[np.ndarray]) -> list[int]:
    time.sleep(0.02)
    return ids(samples)


class Boom(Exception):
    pass


def fails_at_40(samples: Sequence[np.ndarray]) -> torch.Tensor:
    if any(int(s[0]) // SEQ == 40 for s in samples):
        raise Boom("sample 40")
    return torch.from_numpy(np.tile(np.stack(samples).astype(np.int64), (1, 16)))  # shared memory


def stuck_at_8(samples: Sequence[np.ndarray]) -> list[int]:
    if any(int(s[0]) // SEQ == 8 for s in samples):
        time.sleep(10_000)  # a collate that never returns
    return ids(samples)


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local stream of 200 samples whose elements are their own positions."""
    folder = tmp_path_factory.mktemp("procpool") / "stream"
    gl.write_stream(folder, np.arange(200 * SEQ, dtype=np.int32), shard_bytes=20_000)
    return folder


def loader_for(path: Path, collate: Any, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("num_workers", 2)
    kw.setdefault("local_batch_size", 4)
    return gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        collate,
        sequence_length=SEQ,
        parallel_method="process",
        device=torch.device("cpu"),
        **kw,
    )


def worker_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("guideloom-worker")}


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_batches_match_inline_and_workers_persist_between_iterators(
    stream: Path, own_segments: Callable[[], list[str]]
) -> None:
    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=3) as inline:
        expected = [take(inline), take(inline)]  # two epochs
    loader = loader_for(stream, rich, shuffle=True, shuffle_seed=3, prefetch=6)
    with loader:
        first = take(loader)
        pids = worker_pids()
        assert len(pids) == 2
        t0 = time.perf_counter()
        it = iter(loader)
        second = [next(it)]
        first_batch_s = time.perf_counter() - t0
        second.extend(it)
        assert worker_pids() == pids  # the same processes served epoch 2: no respawn
        assert first_batch_s < 2.0, first_batch_s  # no spawn (seconds); the benchmark times it
        for got, want in zip((first, second), expected, strict=True):
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert_same(a, b)
        shared = first[0]["tokens"]
        assert shared.is_contiguous() and first[0]["same"][0] is first[0]["same"][1]
        owner = first[0]["array"]
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert isinstance(owner, ctypes.Array)  # a view of a shared-memory slot, not a copy
    assert worker_pids() == set()
    del first, second, shared
    assert own_segments() == []


def test_load_state_dict_between_iterators_with_persistent_workers(stream: Path) -> None:
    with loader_for(stream, ids, num_workers=0, shuffle=True, shuffle_seed=5) as inline:
        expected = take(inline)
    loader = loader_for(stream, ids, shuffle=True, shuffle_seed=5, prefetch=4)
    start = loader.state_dict()

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(stop=st.integers(0, len(expected) - 1), back=st.integers(0, 3))
    def resume_anywhere(stop: int, back: int) -> None:
        loader.load_state_dict(start)
        before = take(loader, stop)
        state = loader.state_dict()
        take(loader, back)  # read on, then go back: the workers keep nothing that matters for order
        loader.load_state_dict(state)
        after = take(loader)
        assert before + after == expected

    with loader:
        resume_anywhere()
        assert len(worker_pids()) == 2


def test_persistent_workers_false_starts_workers_per_iterator(stream: Path) -> None:
    loader = loader_for(stream, ids, persistent_workers=False, prefetch=2)
    with loader:
        it = iter(loader)
        assert next(it) == [0, 1, 2, 3]
        pids = worker_pids()
        assert len(pids) == 2
        it.close()
        assert worker_pids() == set()
        assert take(loader, 1) == [[4, 5, 6, 7]]  # the position goes on
        assert worker_pids() == set()


def test_a_worker_killed_with_sigkill_is_a_worker_error_within_a_second(
    stream: Path, own_segments: Callable[[], list[str]]
) -> None:
    loader = loader_for(stream, slow_ids, prefetch=4, local_batch_size=2)
    got: list[list[int]] = []
    with loader:
        it = iter(loader)
        for _ in range(3):
            got.append(next(it))
        victim = min(worker_pids())
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(gl.WorkerError, match="died") as info:
            while True:
                got.append(next(it))
        assert time.monotonic() - killed < 1.0
        assert worker_pids() == set()  # the failed epoch shut every worker down, loader open or not
        assert "SIGKILL" in str(info.value)
        assert [i for b in got for i in b] == list(range(2 * len(got)))  # in order, none lost before
        state = loader.state_dict()
        assert state["observation_offset"] == 2 * len(got)
        # The next iterator starts a worker in the dead one's place and resumes exactly.
        rest = take(loader)
        assert [i for b in got + rest for i in b] == list(range(200))
        assert victim not in worker_pids() and len(worker_pids()) == 2
    assert worker_pids() == set()
    assert own_segments() == []


def test_a_collate_error_reaches_the_consumer_at_its_batch_and_leaves_no_shared_memory(
    stream: Path, own_segments: Callable[[], list[str]]
) -> None:
    got: list[torch.Tensor] = []
    with loader_for(stream, fails_at_40, prefetch=8) as loader:
        with pytest.raises(Boom, match="sample 40") as info:
            for b in loader:
                got.append(b)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "fails_at_40" in str(info.value.__cause__)
        assert [int(b[0, 0]) // SEQ for b in got] == list(range(0, 40, 4))
        assert loader.state_dict()["observation_offset"] == 40
        assert worker_pids() == set()  # shut down with the failed epoch, while the loader is open
    del got
    assert own_segments() == []
    assert worker_pids() == set()


def test_a_stuck_collate_is_terminated_on_close(stream: Path) -> None:
    loader = loader_for(stream, stuck_at_8, prefetch=2)
    loader.open()
    it = iter(loader)
    assert [next(it), next(it)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(worker_pids()) == 2
    t0 = time.monotonic()
    loader.close()  # batch 2 never comes: its worker is terminated after the grace period
    elapsed = time.monotonic() - t0
    assert elapsed < SHUTDOWN_GRACE_S + 1.0, elapsed
    assert multiprocessing.active_children() == []


def test_a_script_without_the_main_guard_is_told_so(stream: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import numpy as np, torch
            import guideloom as gl

            def ids(samples):
                return [int(s[0]) for s in samples]

            loader = gl.StatefulDataLoader.from_storage(
                gl.open_stream({str(stream)!r}), ids, sequence_length=64, num_workers=1,
                parallel_method="process", device=torch.device("cpu"),
            )
            with loader:
                for batch in loader:
                    pass
            print("finished")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=100, env=env
    )
    assert r.returncode != 0
    assert "finished" not in r.stdout
    assert 'if __name__ == "__main__":' in r.stderr
    assert "WorkerError" in r.stderr
    assert [ln for ln in r.stderr.splitlines() if "guideloom.WorkerError" in ln or "WorkerError:" in ln]


def test_async_for_with_process_workers(stream: Path) -> None:
    import asyncio

    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=9) as inline:
        expected = take(inline)

    async def run() -> list[Any]:
        out = []
        async with loader_for(stream, rich, shuffle=True, shuffle_seed=9, prefetch=4) as loader:
            async for batch in loader:
                out.append(batch)
            assert len(worker_pids()) == 2  # kept for the next epoch until the loader closes
        assert worker_pids() == set()
        return out

    got = asyncio.run(run())
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


def small_of_every_dtype(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """Batches far below the shared-memory threshold, in every dtype (module level: picklable)."""
    rows = np.stack([np.asarray(s)[:2] for s in samples]) if len(samples) else np.zeros((0, 2), np.int64)
    dtypes = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32, torch.int32, torch.uint64)
    out: dict[str, Any] = {str(d): torch.from_numpy(rows % 100).to(d) for d in dtypes}
    out |= {str(d): torch.from_numpy(rows).to(d) for d in (torch.int64, torch.float32, torch.bfloat16)}
    out["numpy uint16"] = (rows % 100).astype(np.uint16)
    return out


def test_small_batches_of_every_dtype_cross_to_the_main_process(tmp_path: Path) -> None:
    """torch 2.13 cannot load back a pickled uint16/uint32/uint64 tensor: small ones, which
    travel in the pickle, went through a slot only above 4 KiB and crashed below (the usual
    dtype of token ids). The empty batch of a trailing rank too."""
    gl.write_stream(tmp_path / "s", np.arange(40 * SEQ, dtype=np.uint16))
    for kw in ({}, {"world_size": 3, "rank": 2, "drop_last": False, "local_batch_size": 9}):
        with loader_for(tmp_path / "s", small_of_every_dtype, num_workers=0, **kw) as inline:
            expected = take(inline)
        with loader_for(tmp_path / "s", small_of_every_dtype, **kw) as loader:
            got = take(loader)
        assert len(got) == len(expected)
        assert kw == {} or len(got[-1]["numpy uint16"]) == 0  # the trailing rank's empty batch
        for a, b in zip(got, expected, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert type(a[k]) is type(b[k]) and a[k].dtype == b[k].dtype, k
                assert a[k].shape == b[k].shape and (a[k] == b[k]).all(), k
    assert worker_pids() == set()


@pytest.mark.asyncio
async def test_an_async_for_that_fails_shuts_the_workers_down(stream: Path) -> None:
    """``async for`` too: the error at its batch, then no worker left while the loader is open."""
    loader = loader_for(stream, fails_at_40, prefetch=4)
    async with loader:
        got = []
        with pytest.raises(Boom, match="sample 40"):
            async for b in loader:
                got.append(b)
        assert len(got) == 10 and loader.state_dict()["observation_offset"] == 40
        assert worker_pids() == set()
    assert worker_pids() == set()


@pytest.mark.asyncio
async def test_async_for_left_with_break_again_and_again_never_hangs(stream: Path) -> None:
    """A dropped ``async for``'s pipeline could end after the next one had put its reader on the
    workers' pipes, and removed it: the next epoch waited forever (2 runs in 4). Each new
    iterator goes on where the last one stopped."""
    loader = loader_for(stream, ids, local_batch_size=4, prefetch=4)
    got: list[list[int]] = []
    for _ in range(6):
        n = 0
        async with asyncio.timeout(30):
            async for b in loader:
                got.append(b)
                n += 1
                if n == 3:
                    break
    assert [i for b in got for i in b] == list(range(72))
    await loader.aclose()
    assert worker_pids() == set()


class OpensOnlyHere(gl.MemoryStreamStorage):
    """A storage whose open() fails in a worker process (say, a credential only the main process
    has): picklable, at module level."""

    def open_sync(self) -> None:
        if multiprocessing.current_process().name.startswith("guideloom-worker"):
            raise Boom("no credentials in the worker")
        super().open_sync()


def test_a_storage_that_fails_to_open_in_a_worker_raises_its_own_error() -> None:
    """The storage's own exception (with a note naming the worker), as at num_workers=0, not a
    WorkerError; nothing left running."""
    loader = gl.StatefulDataLoader.from_storage(
        OpensOnlyHere(np.arange(64 * SEQ, dtype=np.int32)), ids, sequence_length=SEQ,
        local_batch_size=4, num_workers=2, parallel_method="process", device=torch.device("cpu"),
    )  # fmt: skip
    with loader:
        with pytest.raises(Boom, match="no credentials") as info:
            next(iter(loader))
        assert any("worker process" in note for note in getattr(info.value, "__notes__", []))
        assert loader.state_dict()["observation_offset"] == 0
    assert worker_pids() == set()


def as_tensor(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


class StoreFailsAt(gl.MemoryStreamStorage):
    """A storage whose read of sample 12 fails as the store itself would (``StorageError``: not
    localised, so it ends a whole group while the other worker is still busy with its own)."""

    def read_many_sync(self, starts: Any, length: int) -> Sequence[Any]:
        if (np.asarray(starts) == 12 * length).any():
            raise gl.StorageError("the store failed")
        return super().read_many_sync(starts, length)


def test_workers_stopped_in_the_middle_of_a_group_exit_at_once() -> None:
    """A worker that took "stop" between two batches of a group went back to wait for a message
    that never came and was terminated after the 5 s grace (5 runs in 8 once a failed epoch shut
    the workers down): each close now takes a fraction of that."""
    for _ in range(4):
        loader = gl.StatefulDataLoader.from_storage(
            StoreFailsAt(np.arange(64 * 4, dtype=np.int32)), as_tensor, sequence_length=4,
            local_batch_size=4, num_workers=2, parallel_method="process", prefetch=8,
            device=torch.device("cpu"),
        )  # fmt: skip
        with loader:
            it = iter(loader)
            next(it)
            t0 = time.monotonic()
            with pytest.raises(gl.StorageError):
                while True:
                    next(it)
            assert time.monotonic() - t0 < SHUTDOWN_GRACE_S - 1.0, "a worker waited out the grace"
            assert worker_pids() == set()
