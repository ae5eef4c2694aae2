"""``guideloom prepare`` split into tasks, against one ``prepare --workers 2``, on one machine.

The same JSONL corpus (default 200 MB, byte tokenizer, ``--document-ids``) is prepared three
ways, each a fresh ``python -m guideloom`` process (or eight), wall clock from start to the
dataset's manifest:

- ``--workers 2``: the baseline, one process and two tokenizing workers;
- 8 tasks: ``--task I --tasks 8`` as 8 separate processes started at once (what a Slurm array
  does, here all on this machine's cores), the last to finish merging;
- ``--engine ray --tasks 2``: a local Ray cluster of 2 CPUs started by the command, two tasks,
  then the merge (the wall clock includes starting Ray; the command's own figure, printed
  beside it, starts once Ray is up).

Each output's token stream, ``doc_id`` and ``doc_pos`` are hashed (the files' bytes in the
manifest's order, bases added) and compared with the baseline's.

    python -m benchmarks prepare-tasks [--mb 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.prepare_text import generate  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
COMMON = ["--document-ids", "--quiet"]


def _prepare(*args: Any) -> list[str]:
    return [sys.executable, "-m", "guideloom", "prepare", *map(str, args)]


def baseline(corpus: Path, dest: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(_prepare(corpus, "--output", dest, "--workers", 2, *COMMON), check=True, env=ENV)
    return time.perf_counter() - t0


def separate_processes(corpus: Path, dest: Path, tasks: int) -> float:
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(_prepare(corpus, "--output", dest, "--task", i, "--tasks", tasks, *COMMON), env=ENV)
        for i in range(tasks)
    ]
    codes = [p.wait() for p in procs]
    took = time.perf_counter() - t0
    if any(codes) or not (dest / "manifest.json").exists():
        raise SystemExit(f"the {tasks} task processes exited {codes}")
    return took


def on_ray(corpus: Path, dest: Path, tasks: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        _prepare(corpus, "--output", dest, "--engine", "ray", "--tasks", tasks, "--document-ids"),
        check=True,
        env=ENV,
        capture_output=True,
        text=True,
    ).stdout
    took = time.perf_counter() - t0
    inside = re.search(r"data files in ([0-9.]+) s", out)
    return took, float(inside.group(1)) if inside else float("nan")


def content(dest: Path) -> dict[str, str]:
    """sha256 of each field as read (the storage adds the files' bases)."""
    import guideloom as gl

    storage = gl.open_stream(dest)
    storage.open_sync()
    n = len(storage)
    hashes = {name: hashlib.sha256() for name in storage.manifest.fields}
    step = 2**24
    for start in range(0, n, step):
        length = min(step, n - start)
        row = storage.read_many_sync(np.asarray([start], np.int64), length)[0]
        for name, h in hashes.items():
            h.update(np.ascontiguousarray(row[name]).tobytes())
    return {name: h.hexdigest()[:16] for name, h in hashes.items()}


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks prepare-tasks", description=__doc__)
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (median)")
    ap.add_argument("--tasks", type=int, default=8, help="separate task processes (default 8)")
    ap.add_argument("--no-ray", action="store_true", help="leave out --engine ray")
    args = ap.parse_args(argv)
    data = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data.mkdir(parents=True, exist_ok=True)
    corpus = data / f"prepare-tasks-{args.mb}mb.jsonl"
    if not corpus.exists():
        generate(corpus.with_suffix(".tmp"), args.mb * 10**6)
        corpus.with_suffix(".tmp").rename(corpus)
    size = corpus.stat().st_size / 1e6
    print(f"corpus {corpus} ({size:.0f} MB), {os.cpu_count()} cpus, loadavg {_loadavg()}")
    work = Path(tempfile.mkdtemp(prefix="guideloom-prepare-tasks-"))
    times: dict[str, list[float]] = {"workers2": [], "tasks": [], "ray": [], "ray_inside": []}
    same: dict[str, bool] = {}
    try:
        for r in range(args.rounds):
            base = work / "base"
            times["workers2"].append(baseline(corpus, base))
            want = content(base)
            many = work / "tasks"
            times["tasks"].append(separate_processes(corpus, many, args.tasks))
            same[f"{args.tasks} tasks"] = same.get(f"{args.tasks} tasks", True) and content(many) == want
            if not args.no_ray:
                ray_dest = work / "ray"
                wall, inside = on_ray(corpus, ray_dest, 2)
                times["ray"].append(wall)
                times["ray_inside"].append(inside)
                same["ray 2 tasks"] = same.get("ray 2 tasks", True) and content(ray_dest) == want
                shutil.rmtree(ray_dest)
            shutil.rmtree(base)
            shutil.rmtree(many)
            done = ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items() if v)
            print(f"round {r + 1}: {done}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in times.items() if v}
    mb = corpus.stat().st_size / 1e6
    print(f"\nloadavg after {_loadavg()}")
    print("| run | wall s (median) | MB/s | speed vs --workers 2 | same samples |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(f"| prepare --workers 2 | {med['workers2']:.1f} | {mb / med['workers2']:.1f} | 1.00 | (baseline) |")
    label = f"{args.tasks} tasks, separate processes"
    speed = med["workers2"] / med["tasks"]
    alike = same[f"{args.tasks} tasks"]
    print(f"| {label} | {med['tasks']:.1f} | {mb / med['tasks']:.1f} | {speed:.2f} | {alike} |")
    if "ray" in med:
        print(
            f"| --engine ray --tasks 2 | {med['ray']:.1f} (after Ray's start: {med['ray_inside']:.1f}) | "
            f"{mb / med['ray']:.1f} | {med['workers2'] / med['ray']:.2f} "
            f"({med['workers2'] / med['ray_inside']:.2f}) | {same['ray 2 tasks']} |"
        )


if __name__ == "__main__":
    main()
