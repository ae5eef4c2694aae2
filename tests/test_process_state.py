"""Process-wide state kept in one place (``guideloom/_process.py``): no other module registers an
exit hook or keeps a registry of live objects, and what is stopped at interpreter exit is stopped
in the documented order."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

import guideloom as gl
from tests.support.processes import run_script


def test_process_workers_open_at_exit_are_stopped_by_their_pool_not_terminated(tmp_path: Path) -> None:
    """A script that exits with its loader's workers up: each pool is closed once the threads are
    joined and before ``multiprocessing``'s exit function, which would terminate the workers
    (SIGTERM, exit code -15) instead of the pool's stop (the worker ends its loop: exit code 0)."""
    stream = tmp_path / "stream"
    gl.write_stream(stream, np.arange(4096, dtype=np.uint16))
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit

            procs = []

            def report():  # registered first: runs after every other exit hook
                print("exit codes", *sorted({{p.proc.exitcode for p in procs}}), flush=True)

            atexit.register(report)

            import threading
            import torch
            import guideloom as gl

            def rows(samples):
                return torch.from_numpy(samples[0].astype("int64"))

            if __name__ == "__main__":
                loader = gl.StatefulDataLoader.from_storage(
                    gl.open_stream({str(stream)!r}), rows, sequence_length=16, num_workers=2,
                    parallel_method="process", device=torch.device("cpu"),
                )
                loader.open()
                it = iter(loader)
                next(it)
                pool = it._driver.procs.pool
                pool.start()  # the workers are up
                procs.extend(pool.procs)
                next(it)
                # a thread of the script's that still iterates when the main thread ends
                threading.Thread(target=lambda: print("thread", len([next(it) for _ in range(3)]))).start()
            """
        )
    )
    out = run_script(script).stdout.split("\n")
    assert out[:2] == ["thread 3", "exit codes 0"], out
