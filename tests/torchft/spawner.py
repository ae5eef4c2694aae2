"""Replicas forked from one process that has imported what they run (torch, torchft, guideloom),
as a zygote: a replica started again after a SIGKILL is up at once, not after the seconds a new
interpreter takes to import torch. Each replica is still a process of its own, killed with
SIGKILL and started afresh (its Manager, store, loader and model are made after the fork).

Run as ``python -m tests.torchft.spawner`` by ``test_torchft.py``: each line on stdin is
``[replica argv, log path]``; it answers ``["pid", pid]`` for each replica started and
``["exit", pid, code]`` (negative: the signal that ended it) when one ends. At the end of stdin
the replicas still running are killed.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time
import traceback

from tests.torchft import replica


def _child(argv: list[str], log: str) -> None:
    """In the forked replica: its output to ``log``, then the replica's ``main``."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = replica.main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    answers = sys.stdout
    live: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending, ended = b"", False

    def say(*what: object) -> None:
        answers.write(json.dumps(what) + "\n")
        answers.flush()

    while not ended or live:
        if not ended and selector.select(0.01):
            chunk = os.read(0, 65536)
            ended = not chunk
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                argv, log = json.loads(line)
                answers.flush()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the replica
                    selector.close()
                    _child(argv, log)
                live.add(pid)
                say("pid", pid)
            if ended:
                for pid in live:
                    os.kill(pid, signal.SIGKILL)
        elif ended:
            time.sleep(0.01)  # the replicas killed at the end, until they are reaped
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            say("exit", pid, os.waitstatus_to_exitcode(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
