"""Start real ``torch.distributed`` ranks as processes, the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on 127.0.0.1, gloo over loopback), and wait for all of them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from guideloom_dev.servers import free_port


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
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                list(argv(rank) if callable(argv) else argv),
                env=env,
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
