"""The copies of fetched pieces into place on the storage's I/O threads take turns: at most
``CPU_TURNS``' bound of them run at once, whatever the number of ranges in flight, and what is
delivered is unchanged."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader, _process
from guideloom.storage._remote import _fetch, _ranges
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, Copies

CPU = torch.device("cpu")
SEQ = 256  # 512-byte samples: many pieces a range
MiB = 2**20


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


@pytest.fixture(scope="module")
def small_samples(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> Iterator[Copies]:
    """2 MiB of uint16 tokens in 256 KiB shards (block digests in sidecars)."""
    tokens = np.random.default_rng(3).integers(0, 65_000, MiB, dtype=np.uint16)
    folder = tmp_path_factory.mktemp("turns") / "turns"
    guideloom.write_stream(folder, tokens, shard_bytes=MiB // 4)
    s3.upload_folder(folder, BUCKET, "copies/turns")
    yield Copies(folder, f"s3://{BUCKET}/copies/turns", "turns", tokens)
    shutil.rmtree(folder, ignore_errors=True)


class Overlap:
    """How many of the wrapped calls ran at once, at most, off the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.most = self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if _process.runs_a_loop():  # a small read planned inline: not an I/O thread's work
                return fn(*args, **kwargs)
            with self._lock:
                self.now += 1
                self.calls += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.002)  # long enough for others to start meanwhile, if they may
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.now -= 1

        return counted


@pytest.mark.parametrize("mode", ["sync", "async", "threads"])
def test_copies_take_turns_and_deliver_the_same_batches(
    small_samples: Copies, s3: MotoS3, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overlap = Overlap()
    monkeypatch.setattr(_fetch, "fill_range", overlap.wrap(_ranges.fill_range))

    def run(storage: Any) -> list[torch.Tensor]:
        options: dict[str, Any] = {"num_workers": 2} if mode == "threads" else {}
        it = StatefulDataLoader.from_storage(
            storage,
            collate,
            sequence_length=SEQ,
            local_batch_size=16,
            shuffle=True,
            shuffle_seed=7,
            shuffle_block_size=64,
            device=CPU,
            **options,
        )
        with it:
            if mode == "async":

                async def epoch() -> list[torch.Tensor]:
                    return [b async for b in it]

                return asyncio.run(epoch())
            return list(it)

    got = run(guideloom.open_stream(small_samples.s3_url, **s3.options()))
    want = run(guideloom.open_stream(small_samples.local))
    assert len(got) == len(want) == len(small_samples.tokens) // SEQ // 16
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert overlap.calls > 20  # many ranges copied on I/O threads
    assert overlap.most <= max(1, _process.cores() - 1)


def test_a_child_forked_while_a_turn_is_held_has_every_turn() -> None:
    """The thread that held it does not exist in the child: its turn would never come back."""
    import os
    import subprocess
    import sys

    code = (
        "import os\n"
        "from guideloom._process import Turns\n"
        "turns = Turns(lambda: 1)\n"
        "with turns:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        with turns:\n"
        "            os._exit(7)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 7, status\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ})


def test_a_worker_process_takes_its_turns_by_its_own_cores() -> None:
    """Sized when a turn is first taken: in a child forked from a process of 4 cores that is one
    of a loader's worker processes (one core), one turn; in the parent, 3."""
    import os
    import subprocess
    import sys

    code = (
        "import os\n"
        "from guideloom import _process\n"
        "_process.cores = lambda _cores=_process.cores: 1 if _process._ONE_CORE else 4\n"
        "turns = _process.Turns(lambda: _process.cores() - 1)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    _process.one_core()\n"
        "    os._exit(10 + turns.at_once)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 11, status\n"
        "assert turns.at_once == 3, turns.at_once\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ})
