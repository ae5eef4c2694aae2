"""Start real ``torch.distributed`` ranks as processes, the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on 127.0.0.1, gloo over loopback), and wait for all of them: each a fresh
interpreter (:func:`run_ranks`), or forked from a zygote that has imported the program's heavy
modules once (:func:`fork_ranks`)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from guideloom_dev.servers import free_port

from . import ROOT
from .zygote import Zygote


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """This process's environment and the variables torchrun gives rank ``rank``."""
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )


def run_ranks(
    world_size: int,
    argv: Sequence[str] | Callable[[int], Sequence[str]],
    *,
    cwd: Path,
    timeout: float = 200,
) -> list[str]:
    """Run ``argv`` (or ``argv(rank)``) once per rank; return each rank's output (stdout and
    stderr together).

    Fails the test, with that rank's output, when a rank exits non-zero; kills every rank still
    running when one hangs past ``timeout`` seconds."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        procs.append(
            subprocess.Popen(
                list(argv(rank) if callable(argv) else argv),
                env=rank_env(rank, world_size, port),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} of {world_size} failed:\n{out}"
    return outputs


def fork_ranks(
    world_size: int,
    script: Sequence[str],
    *,
    preload: Sequence[str],
    python: Sequence[str] = (),
    cwd: Path,
    timeout: float = 200,
) -> list[str]:
    """As :func:`run_ranks` for ``python [python...] SCRIPT ARGS`` (``script``), each rank forked
    from a zygote that has imported ``preload`` once (``tests/support/zygote.py``): each rank is
    still its own process with its own gloo group, and runs the script from its start as
    ``__main__``; ``python`` are the interpreter's options (``-W error``), the zygote's.

    Each rank's output is kept in a ``ranks-*`` folder in ``cwd``."""
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=cwd))
    with Zygote(logs / "zygote.log", preload, cwd=ROOT, env=dict(os.environ), python=python) as zygote:
        children = [
            zygote.start(script, logs / f"rank{r}.log", env=rank_env(r, world_size, port), cwd=cwd)
            for r in range(world_size)
        ]
        deadline = time.monotonic() + timeout
        try:
            codes = [c.wait(timeout=max(0.0, deadline - time.monotonic())) for c in children]
        finally:
            for c in children:
                c.kill()
    outputs = [(logs / f"rank{r}.log").read_text() for r in range(world_size)]
    for rank, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"rank {rank} of {world_size} failed ({code}):\n{out}"
    return outputs
