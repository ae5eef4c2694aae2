"""Process workers over object storage: an epoch with ``parallel_method="process"`` against the
same epoch with thread workers, on a moto S3 server on 127.0.0.1, in one run.

Workload: a uint16 stream (``--mib`` MiB, 4 MiB objects), ``sequence_length=2048`` (4 KiB
samples), ``local_batch_size=16``, ``num_workers=2``, ``prefetch=4`` (``--prefetch``), each order below. Each
measurement is a fresh loader in this process: a first epoch starts its workers (not timed), and
the second, read from the store again, is timed whole, from ``iter()`` to its last batch, as
every epoch after the first of a training run is. Threads and processes alternate ``--rounds``
times. Printed: seconds per epoch, GET requests per MiB read (the loader's ``stats()``), the
ratio processes / threads, and the CPU seconds an epoch costs the main process and the worker
processes (the S3 server, a process of its own, shares the same cores).

    python -m benchmarks process-remote [--mib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import guideloom as gl
from benchmarks.remote_stream import collate, moto_bucket

MiB = 2**20


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch(
    url: str, options: dict[str, Any], method: str, shuffle: bool, prefetch: int
) -> tuple[float, float, float, float]:
    """Seconds for a whole second epoch, its GETs per MiB read, and the CPU seconds it cost the
    main process and the worker processes."""
    storage = gl.open_stream(url, **options)
    loader = gl.StatefulDataLoader.from_storage(
        storage, collate, sequence_length=2048, local_batch_size=16, num_workers=2, prefetch=prefetch,
        parallel_method=method, shuffle=shuffle, shuffle_seed=0, device=torch.device("cpu"),  # type: ignore[arg-type]
    )  # fmt: skip
    with loader:
        for _ in loader:  # the workers start
            pass
        before = loader.stats()
        workers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
        cpu0 = cpu_seconds(os.getpid()), sum(cpu_seconds(w) for w in workers)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        seconds = time.perf_counter() - t0
        main_cpu = cpu_seconds(os.getpid()) - cpu0[0]
        workers_cpu = sum(cpu_seconds(w) for w in workers) - cpu0[1]
        after = loader.stats()
    requests = after["requests"] - before["requests"]
    return (
        seconds,
        requests / max(1e-9, (after["bytes_read"] - before["bytes_read"]) / MiB),
        main_cpu,
        workers_cpu,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="dataset size in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each, alternating (default 5)")
    p.add_argument("--prefetch", type=int, default=4, help="batches prefetched (default 4)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ds"
        rng = np.random.default_rng(0)
        tokens = args.mib * MiB // 2
        gl.write_stream(folder, rng.integers(0, 50_000, tokens, dtype=np.uint16), shard_bytes=4 * MiB)
        with moto_bucket(folder) as options:
            print(
                f"{'order':<12}{'workers':<10}{'s/epoch':>9}{'GET/MiB':>9}{'vs threads':>12}"
                f"{'main CPU s':>12}{'workers CPU s':>15}"
            )
            for order, shuffle in (("sequential", False), ("global", True)):
                runs: dict[str, list[tuple[float, float, float, float]]] = {"thread": [], "process": []}
                for _ in range(args.rounds):
                    for method in ("thread", "process"):
                        runs[method].append(epoch("s3://bench/gl", options, method, shuffle, args.prefetch))
                base = statistics.median(r[0] for r in runs["thread"])
                for method in ("thread", "process"):
                    s, g, main_cpu, workers_cpu = (
                        statistics.median(r[k] for r in runs[method]) for k in range(4)
                    )
                    print(
                        f"{order:<12}{method:<10}{s:>9.2f}{g:>9.1f}{s / base:>11.2f}x"
                        f"{main_cpu:>12.2f}{workers_cpu:>15.2f}"
                    )


if __name__ == "__main__":
    main()
