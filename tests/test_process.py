"""What guideloom keeps per process (``guideloom._process``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from guideloom import _process
from guideloom.storage._format import _blocks

ROOT = Path(__file__).resolve().parents[1]


def test_remembered_checks_are_bounded_and_forgotten_oldest_first() -> None:
    seen = _process.remembered(3)
    for i in range(5):
        seen[i] = str(i)
    assert list(seen) == [2, 3, 4] and seen.setdefault(4, "x") == "4"
    seen[2] = "again"  # a refreshed entry is the newest
    seen[5] = "5"
    assert list(seen) == [4, 2, 5]


def test_reset_forgets_every_check_so_blocks_are_checked_again(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(200_000, dtype=np.uint16))
    time.sleep(_blocks.RACY_NS / 1e9)  # checks of a file changed within RACY_NS are not remembered
    storage = gl.open_stream(tmp_path / "ds")
    storage.open_sync()
    storage.read_many_sync(np.asarray([0]), 10)
    assert any(f.checked.any() for f in _blocks._FILES.values())
    _process.reset()
    assert not len(_blocks._FILES)
    fresh = gl.open_stream(tmp_path / "ds")
    fresh.open_sync()
    assert fresh.read_many_sync(np.asarray([5]), 3)[0].tolist() == [5, 6, 7]
    assert any(f.checked.any() for f in _blocks._FILES.values())


def test_live_objects_are_stopped_before_the_interpreter_joins_its_threads() -> None:
    """A live object whose work runs on a non-daemon thread until stopped: the process exits."""
    code = (
        "import threading\n"
        "from guideloom._process import Live\n"
        "class Work:\n"
        "    def __init__(self):\n"
        "        self.stop = threading.Event()\n"
        "        threading.Thread(target=self.stop.wait).start()\n"
        "live = Live(lambda w: w.stop.set())\n"
        "w = Work()\n"
        "live.add(w)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def test_live_objects_after_threads_are_stopped_once_the_threads_are_joined() -> None:
    """A store's client that a thread reads through until it ends is dropped after that thread
    (and after what is stopped before the threads are joined); ``then`` follows the last stop,
    and a kind that fails to stop is reported without keeping the next from its stop."""
    code = (
        "import threading, time\n"
        "from guideloom._process import Live\n"
        "class Thing:\n"
        "    pass\n"
        "early = Live(lambda t: print('early', flush=True))\n"
        "def fails(t):\n"
        "    raise RuntimeError('this kind fails to stop')\n"
        "Live(fails, after_threads=True).add(late_too := Thing())\n"
        "late = Live(lambda t: print('late', flush=True), after_threads=True, then=lambda: print('then'))\n"
        "a, b = Thing(), Thing()\n"
        "early.add(a)\n"
        "late.add(b)\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30, capture_output=True)
    assert out.stdout.decode().split() == ["early", "thread", "late", "then"]
    assert "RuntimeError: this kind fails to stop" in out.stderr.decode()


def test_pools_are_one_per_name() -> None:
    assert _process.pool("io", 128) is _process.pool("io", 128)
    assert _process.pool("io", 128) is not _process.pool("range", 512)


def test_a_worker_process_keeps_a_read_on_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_process, "_ONE_CORE", False)
    assert _process.cores() == len(os.sched_getaffinity(0))
    _process.one_core()
    assert _process.cores() == 1
