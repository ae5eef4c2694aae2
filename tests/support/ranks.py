"""Start real ``torch.distributed`` ranks as processes, the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on 127.0.0.1, gloo over loopback), and wait for all of them."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from guideloom_dev.servers import free_port

from . import ROOT
from .zygote import Zygote, imports_of


def torchrun_env() -> dict[str, str]:
    """This process's environment, with one OpenMP thread unless it says otherwise (torchrun's
    default for each rank; a zygote forks only while it has one thread)."""
    return {"OMP_NUM_THREADS": "1", **os.environ}


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """:func:`torchrun_env` and the variables torchrun gives rank ``rank``."""
    return dict(
        torchrun_env(),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )


class Zygotes:
    """Zygotes kept for the :func:`run_ranks` calls made within :func:`shared_zygotes`: the ranks
    of a program's runs fork from one that imported its modules once (one a set of interpreter
    options, modules and environment)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zygotes-"))
        self._zygotes: dict[tuple[object, ...], Zygote] = {}

    def get(self, python: Sequence[str], preload: Sequence[str], env: dict[str, str]) -> Zygote:
        same = sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")
        key = (tuple(python), tuple(preload), tuple(same))
        zygote = self._zygotes.get(key)
        if zygote is None or not zygote.alive():
            log = self.folder / f"zygote-{len(self._zygotes)}.log"
            zygote = self._zygotes[key] = Zygote(log, preload, cwd=ROOT, env=env, python=python)
        return zygote

    def close(self) -> None:
        for zygote in self._zygotes.values():
            zygote.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_shared: list[Zygotes] = []  # the innermost shared_zygotes() last


@contextlib.contextmanager
def shared_zygotes() -> Iterator[None]:
    """Within, :func:`run_ranks` keeps each zygote it starts for the calls that follow (a test
    module's fixture: the zygotes end with it)."""
    _shared.append(Zygotes())
    try:
        yield
    finally:
        _shared.pop().close()


def run_ranks(
    world_size: int,
    argv: Sequence[str] | Callable[[int], Sequence[str]],
    *,
    cwd: Path,
    timeout: float = 200,
) -> list[str]:
    """Run ``argv`` (or ``argv(rank)``: ``python [-W ...] -m MODULE ARGS`` or ``python [-W ...]
    SCRIPT ARGS``, the same program for every rank) once per rank; return each rank's output
    (stdout and stderr together).

    Each rank is forked from a zygote that has imported what the program imports at its top level
    (torch, a framework, guideloom), with the same interpreter options
    (``tests/support/zygote.py``; within :func:`shared_zygotes`, one kept from an earlier call):
    each rank is still its own process with its own gloo group, and runs the program from its
    start as ``__main__``. What the zygote's imports wrote (a warning) begins each rank's output,
    as it would have begun each rank's own.

    Fails the test, with that rank's output, when a rank exits non-zero; kills every rank still
    running when one hangs past ``timeout`` seconds."""
    argvs = [list(argv(rank) if callable(argv) else argv) for rank in range(world_size)]
    programs = [program(a) for a in argvs]
    python, module, path, _ = programs[0]
    assert all(p[:3] == (python, module, path) for p in programs), f"one program for every rank: {argvs}"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        logs = Path(folder)
        env = torchrun_env()
        with contextlib.ExitStack() as stack:
            if _shared:
                zygote = _shared[-1].get(python, imports_of(path), env)
            else:
                zygote = Zygote(logs / "zygote.log", imports_of(path), cwd=ROOT, env=env, python=python)
                stack.enter_context(zygote)
            children = [
                zygote.start(
                    a, logs / f"rank{r}.log", module=module, env=rank_env(r, world_size, port), cwd=cwd
                )
                for r, (*_, a) in enumerate(programs)
            ]
            deadline = time.monotonic() + timeout
            try:
                codes = [c.wait(timeout=max(0.0, deadline - time.monotonic())) for c in children]
            finally:
                for c in children:
                    c.kill()
        # what the imports wrote (a warning) each rank would have written first
        imported = zygote.log.read_text()
        outputs = [imported + (logs / f"rank{r}.log").read_text() for r in range(world_size)]
    for rank, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"rank {rank} of {world_size} failed ({code}):\n{out}"
    return outputs


def program(argv: Sequence[str]) -> tuple[list[str], str, Path, list[str]]:
    """``python [OPTIONS] -m MODULE ARGS`` or ``python [OPTIONS] SCRIPT ARGS`` read as the
    interpreter's options, the module (or ""), the program's file, and what the zygote's child
    takes as its ``argv`` (the module's arguments, or the script and its arguments)."""
    assert argv[0] == sys.executable, f"a rank runs this interpreter: {argv}"
    options: list[str] = []
    i = 1
    while argv[i].startswith("-") and argv[i] != "-m":
        assert argv[i] != "-c", f"a rank runs a module or a script: {argv}"
        takes_value = argv[i] in ("-W", "-X")
        options += argv[i : i + 1 + takes_value]
        i += 1 + takes_value
    if argv[i] == "-m":
        spec = importlib.util.find_spec(argv[i + 1])
        assert spec is not None and spec.origin is not None, f"no module {argv[i + 1]}"
        return options, argv[i + 1], Path(spec.origin), list(argv[i + 2 :])
    return options, "", Path(argv[i]), list(argv[i:])
