"""Kill a loader's main process with SIGKILL at random moments of its process workers' start-up,
and report what it left: ``python kill_at_start.py STREAM TRIALS MAX_DELAY SEED``.

Each trial forks a fresh main process from this one (torch and guideloom imported once, here),
which iterates a loader with two process workers over ``STREAM``; this process kills it after a
random delay, then waits (10 s at most) until every process it left (the zygote, the workers:
this process is their subreaper) has exited, and until no shared-memory segment of its pool is
left in ``/dev/shm``. One JSON line per trial: the delay, the segments and processes left.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from guideloom._runtime.processes import live_segments, pool
from tests.support.data import ids
from tests.support.processes import loader_for

PR_SET_CHILD_SUBREAPER = 36


def main_process(stream: Path, prefix: str) -> None:
    """The killed one: a loader's epochs over process workers, forever."""
    pool.SHM_PREFIX = prefix  # this trial's segments, told apart from any other process's
    loader = loader_for(stream, ids, num_workers=2, prefetch=2)
    while True:
        for _ in loader:
            pass


def descendants_left(seconds: float) -> int:
    """Reap every process left to this one (it is their subreaper), ``seconds`` at most; how
    many were still running then."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid:
            continue
        if time.monotonic() > deadline:
            return len([t for t in os.listdir("/proc") if t.isdigit() and _parent(t) == os.getpid()])
        time.sleep(0.01)


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def main() -> None:
    stream, trials, max_delay, seed = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        int(sys.argv[4]),
    )
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rng = random.Random(seed)
    for _ in range(trials):
        delay = rng.uniform(0.0, max_delay)
        prefix = f"guideloom-kill{os.getpid()}x{rng.getrandbits(32):08x}-"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the killed main process
            try:
                main_process(stream, prefix)
            finally:
                os._exit(0)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        procs = descendants_left(10.0)
        deadline = time.monotonic() + 5.0
        while (left := live_segments(prefix)) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"delay": round(delay, 3), "segments": left, "processes": procs}), flush=True)
        for name in left:  # not this test's to keep
            os.unlink(f"/dev/shm/{name}")


if __name__ == "__main__":
    main()
