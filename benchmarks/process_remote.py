"""Process workers over object storage: epochs with ``parallel_method="process"`` against the
same epochs with thread workers, on a moto S3 server on 127.0.0.1, in one run.

Workload: a uint16 stream (``--mib`` MiB, 4 MiB objects), ``sequence_length=2048`` (4 KiB
samples), ``local_batch_size=16``, ``num_workers=2``, ``prefetch=4`` (``--prefetch``), each order
and collate below: ``plain`` (``np.stack`` into a tensor: tens of microseconds) and ``gil`` (the
same after 1 ms of Python that holds the GIL). Each measurement is a fresh process, as a
training run is: the storage is opened, then a loader made, and its first epoch (the workers
start) and second epoch are each timed whole, from ``iter()`` to the last batch. Threads and
processes alternate ``--rounds`` times. Printed: seconds per epoch, the ratio processes /
threads per epoch (the targets: <= 1.2 with ``plain``, <= 0.71 with ``gil``), the share of the
batches collated by the worker processes (``stats()``), GETs per MiB read in epoch 2, and the CPU
seconds epoch 2 cost the main process and the worker processes (the S3 server, a process of its
own, shares the same cores). The load average before and after the run is printed too.

    python -m benchmarks process-remote [--mib 64] [--rounds 3] [--collate plain,gil]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary

MiB = 2**20


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gil_collate(samples: Sequence[np.ndarray]) -> Any:
    """The plain collate after 1 ms of Python that holds the GIL (a tokenizer's, say)."""
    from benchmarks.remote_stream import collate

    deadline = time.perf_counter() + 0.001
    n = 0
    while time.perf_counter() < deadline:
        n += 1
    return collate(samples)


def _collate(name: str) -> Any:
    from benchmarks.remote_stream import collate

    return gil_collate if name == "gil" else collate


def child(url: str, options: dict[str, Any], method: str, shuffle: bool, prefetch: int, collate: str) -> None:
    """One measurement in this fresh process; prints its figures as JSON."""
    import torch

    import guideloom as gl

    storage = gl.open_stream(url, **options)
    loader = gl.StatefulDataLoader.from_storage(
        storage, _collate(collate), sequence_length=2048, local_batch_size=16, num_workers=2,
        prefetch=prefetch, parallel_method=method, shuffle=shuffle, shuffle_seed=0,  # type: ignore[arg-type]
        device=torch.device("cpu"),
    )  # fmt: skip
    out: dict[str, Any] = {}
    with loader:
        t0 = time.perf_counter()
        for _ in loader:  # the workers start
            pass
        out["e1"] = time.perf_counter() - t0
        first = loader.stats()
        workers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
        cpu0 = cpu_seconds(os.getpid()), sum(cpu_seconds(w) for w in workers)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        out["e2"] = time.perf_counter() - t0
        out["main_cpu"] = cpu_seconds(os.getpid()) - cpu0[0]
        out["workers_cpu"] = sum(cpu_seconds(w) for w in workers) - cpu0[1]
        after = loader.stats()
    out["e1_procs"] = first["collated_processes"] / max(1, first["batches"])
    e2_batches = after["batches"] - first["batches"]
    out["e2_procs"] = (after["collated_processes"] - first["collated_processes"]) / max(1, e2_batches)
    mib = (after["bytes_read"] - first["bytes_read"]) / MiB
    out["get_per_mib"] = (after["requests"] - first["requests"]) / max(1e-9, mib)
    print(json.dumps(out))


def _run_child(
    url: str, options: dict[str, Any], method: str, shuffle: bool, args: Any, collate: str
) -> dict[str, Any]:
    job = json.dumps([url, options, method, shuffle, args.prefetch, collate])
    code = "import sys, json; from benchmarks.process_remote import child; child(*json.loads(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, job], capture_output=True, text=True, check=False, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{method}/{collate} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--mib", type=int, default=64, help="dataset size in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating (default 3)")
    p.add_argument("--prefetch", type=int, default=4, help="batches prefetched (default 4)")
    p.add_argument("--collate", default="plain,gil", help="collates to run: plain, gil (default both)")
    p.add_argument("--orders", default="sequential,global", help="orders: sequential, global (default both)")
    args = p.parse_args(argv)
    import guideloom as gl
    from benchmarks.remote_stream import moto_bucket

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ds"
        rng = np.random.default_rng(0)
        tokens = args.mib * MiB // 2
        gl.write_stream(folder, rng.integers(0, 50_000, tokens, dtype=np.uint16), shard_bytes=4 * MiB)
        with moto_bucket(folder) as options:
            print(f"load average before: {_load()}  ({os.cpu_count()} CPUs)")
            print(
                f"{'order':<11}{'collate':<8}{'workers':<9}{'e1 s':>7}{'e1 x':>7}{'e1 proc':>8}"
                f"{'e2 s':>7}{'e2 x':>7}{'e2 proc':>8}{'GET/MiB':>8}{'main CPU':>9}{'wrk CPU':>8}"
            )
            for order in args.orders.split(","):
                shuffle = order == "global"
                for collate in args.collate.split(","):
                    runs: dict[str, list[dict[str, Any]]] = {"thread": [], "process": []}
                    for _ in range(args.rounds):
                        for method in ("thread", "process"):
                            runs[method].append(
                                _run_child("s3://bench/gl", options, method, shuffle, args, collate)
                            )
                    med = {
                        m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()
                    }
                    for method in ("thread", "process"):
                        f = med[method]
                        e1x, e2x = f["e1"] / med["thread"]["e1"], f["e2"] / med["thread"]["e2"]
                        print(
                            f"{order:<11}{collate:<8}{method:<9}{f['e1']:>7.2f}{e1x:>6.2f}x{f['e1_procs']:>8.0%}"
                            f"{f['e2']:>7.2f}{e2x:>6.2f}x{f['e2_procs']:>8.0%}{f['get_per_mib']:>8.1f}"
                            f"{f['main_cpu']:>9.2f}{f['workers_cpu']:>8.2f}",
                            flush=True,
                        )
            print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
