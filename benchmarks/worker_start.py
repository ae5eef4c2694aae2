"""Starting process workers: guideloom's against torch's ``DataLoader`` with 2 workers, in one run.

Workload: the 100M-token uint16 stream of ``python -m benchmarks local`` on local disk,
``sequence_length=2048``, ``local_batch_size=16``, shuffled, the README's collate (the rows widened
to int64), ``num_workers=2``; guideloom with ``parallel_method="process"``, ``persistent_workers=True``
and ``prefetch=4`` (torch's default prefetch holds 2 batches per worker: 4), batches on the CPU.
Each measurement is a fresh process (torch and guideloom imported first, as in a training
script), and torch's and guideloom's alternate round by round. Printed, medians over the rounds:

- first batch: from creating the loader (guideloom: and opening it) to the first batch in hand;
- workers up: when guideloom's workers had all opened the dataset (until then the batches are
  made inline); then the same two for a second loader in the same process;
- resume: ``load_state_dict`` on the open loader, a new iterator and its first batch, and
  whether the same worker processes served it;
- peak PSS: the sum of ``Pss`` in ``/proc/<pid>/smaps_rollup`` over the process and every process
  under it (workers, and a fork server with what it forked), sampled every 25 batches of an
  epoch run after the workers are up, while they serve;
- the ratios to torch's figures of the same round.

    python -m benchmarks worker-start [--rounds 5]
    python -m benchmarks worker-start --methods here,forkserver,spawn,fork   # the start methods compared
    python -m benchmarks worker-start --pinned --rounds 7   # first batch, collate_mode="workers"

``--pinned``: only the first batch of a fresh loader (each a fresh process), guideloom with
``collate_mode="workers"`` (the first batch waits for the workers: none is made inline) against
torch's ``DataLoader(num_workers=2)`` over a dataset with ``__getitems__`` (one batched gather
a batch, as guideloom's workers read).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import guideloom as gl
from benchmarks._internals import worker_pool
from benchmarks.local_stream import BATCH, SEQ, _MemmapRows, collate, ensure_dataset

ROOT = Path(__file__).resolve().parents[1]
#: The environment variable that names how guideloom's process workers start (docs/workers.md).
START_ENV = "GUIDELOOM_WORKER_START"
#: Batches iterated once the workers are up, while PSS is sampled; and after the resume.
STEADY_BATCHES = 400
RESUMED_BATCHES = 100


# -- memory --------------------------------------------------------------------------------------
def _pss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _tree(root: int) -> set[int]:
    """``root`` and every process under it (a fork server's workers are its children)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


class PeakPss:
    """The largest sum of PSS over this process's tree seen by :meth:`sample`, how many
    processes it counted, and its parts: this process, the workers, the fork server (guideloom's
    zygote or multiprocessing's ``forkserver``) and any other (Python's resource tracker)."""

    def __init__(self) -> None:
        self.mib, self.processes = 0.0, 0
        self.parts: dict[str, float] = {}

    def sample(self, workers: set[int] | None = None) -> None:
        from multiprocessing import forkserver

        tree = _tree(os.getpid())
        each = {p: _pss_mib(p) for p in tree}
        total = sum(each.values())
        if total <= self.mib:
            return
        me = os.getpid()
        if workers is None:  # torch's: every child is a worker
            workers = tree - {me}
        # the fork server: multiprocessing's, or the zygote that forked the workers
        servers = {forkserver._forkserver._forkserver_pid} | {_parent(w) for w in workers}  # type: ignore[attr-defined]
        servers -= {me, None}
        self.mib, self.processes = total, len(tree)
        self.parts = {"main": each[me], "workers": 0.0, "fork server": 0.0, "other": 0.0}
        for p, mib in each.items():
            if p in workers:
                self.parts["workers"] += mib
            elif p in servers:
                self.parts["fork server"] += mib
            elif p != me:
                self.parts["other"] += mib


def _steady(it: Any, batches: int, peak: PeakPss, workers: set[int] | None = None) -> None:
    for k in range(batches):
        next(it)
        if k % 25 == 0:
            peak.sample(workers)
    peak.sample(workers)


class Endless:
    """Batches from a loader, epoch after epoch, as a training loop takes them."""

    def __init__(self, loader: gl.StatefulDataLoader[Any, torch.Tensor]) -> None:
        self.loader = loader
        self.it = iter(loader)

    def __iter__(self) -> Endless:
        return self

    def __next__(self) -> torch.Tensor:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def close(self) -> None:
        self.it.close()


# -- one measurement, in a fresh process ---------------------------------------------------------
def child_torch(path: Path) -> dict[str, Any]:
    ds = _MemmapRows(path)
    peak = PeakPss()
    t0 = time.perf_counter()
    dl = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0),
        collate_fn=collate, num_workers=2, persistent_workers=True,
    )  # fmt: skip
    it = iter(dl)
    next(it)
    first = time.perf_counter() - t0
    _steady(it, STEADY_BATCHES, peak)
    del it, dl
    return {"first_ms": first * 1e3, "pss_mib": peak.mib, "processes": peak.processes, "parts": peak.parts}


class _MemmapBatches(_MemmapRows):
    """:class:`_MemmapRows` with ``__getitems__``: torch's fetcher reads a batch's rows in one gather."""

    def __getitems__(self, indexes: list[int]) -> Any:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        return self.mm[: self.rows * SEQ].reshape(self.rows, SEQ)[indexes]


def child_torch_first(path: Path) -> dict[str, Any]:
    """Seconds to the first batch of torch's ``DataLoader`` with 2 workers over ``__getitems__``."""
    ds = _MemmapBatches(path)
    t0 = time.perf_counter()
    dl = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0),
        collate_fn=collate, num_workers=2, persistent_workers=True,
    )  # fmt: skip
    it = iter(dl)
    next(it)
    first = time.perf_counter() - t0
    del it, dl
    return {"first_ms": first * 1e3}


def child_guideloom_pinned(path: Path, prefetch: int) -> dict[str, Any]:
    """Seconds to the first batch with ``collate_mode="workers"``: the loader made and opened,
    the workers started, the batch made by one of them (started as ``GUIDELOOM_WORKER_START``
    says)."""
    t0 = time.perf_counter()
    loader = _loader(path, prefetch, collate_mode="workers")
    loader.open()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    it.close()
    loader.close()
    return {"first_ms": first * 1e3}


def _loader(path: Path, prefetch: int, **kw: Any) -> gl.StatefulDataLoader[Any, torch.Tensor]:
    return gl.StatefulDataLoader.from_storage(
        gl.open_stream(path), collate, sequence_length=SEQ, local_batch_size=BATCH, shuffle=True,
        shuffle_seed=0, num_workers=2, parallel_method="process", persistent_workers=True,
        prefetch=prefetch, device=torch.device("cpu"), **kw,
    )  # fmt: skip


def _worker_pids(loader: gl.StatefulDataLoader[Any, Any]) -> list[int]:
    pool = worker_pool(loader)
    return [] if pool is None else [p.proc.pid for p in pool.procs if p is not None and p.proc.pid]


def _first_and_up(
    path: Path, prefetch: int
) -> tuple[gl.StatefulDataLoader[Any, torch.Tensor], Endless, float, float]:
    """A new loader, opened: seconds to its first batch, and until its workers are up (the
    batches go on meanwhile, epoch after epoch)."""
    t0 = time.perf_counter()
    loader = _loader(path, prefetch)
    loader.open()
    it = Endless(loader)
    next(it)
    first = time.perf_counter() - t0
    pool = worker_pool(loader)
    assert pool is not None
    while pool.starting():
        next(it)
    return loader, it, first, time.perf_counter() - t0


def child_guideloom(path: Path, prefetch: int) -> dict[str, Any]:
    """The figures of one round, the workers started as ``GUIDELOOM_WORKER_START`` says."""
    peak = PeakPss()
    loader, it, first, up = _first_and_up(path, prefetch)
    try:
        _steady(it, STEADY_BATCHES, peak, set(_worker_pids(loader)))
        state = loader.state_dict()
        it.close()
        before = _worker_pids(loader)
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        it = Endless(loader)
        next(it)
        resume = time.perf_counter() - t0
        same = _worker_pids(loader) == before
        _steady(it, RESUMED_BATCHES, peak, set(before))
        it.close()
    finally:
        loader.close()
    second, it2, second_first, second_up = _first_and_up(path, prefetch)
    it2.close()
    second.close()
    return {
        "first_ms": first * 1e3,
        "up_ms": up * 1e3,
        "resume_ms": resume * 1e3,
        "same_workers": same,
        "second_first_ms": second_first * 1e3,
        "second_up_ms": second_up * 1e3,
        "pss_mib": peak.mib,
        "processes": peak.processes,
        "parts": peak.parts,
    }


def _run_child(kind: str, path: Path, method: str, prefetch: int) -> dict[str, Any]:
    """One measurement in a fresh process; guideloom's workers started by ``method`` (set in the
    child's environment: ``GUIDELOOM_WORKER_START``)."""
    cmd = [sys.executable, "-m", "benchmarks.worker_start", "--child", kind, "--path", str(path)]
    cmd += ["--prefetch", str(prefetch)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(START_ENV, None)
    if method:
        env[START_ENV] = method
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def pinned_table(path: Path, methods: list[str], rounds: int, prefetch: int) -> None:
    """First batch with ``collate_mode="workers"`` against torch's over ``__getitems__``, a fresh
    process each, alternating round by round; medians, and the ratio within each round."""
    runs: dict[str, list[float]] = {"torch": [], **{m: [] for m in methods}}
    load0 = os.getloadavg()[0]
    for r in range(rounds):
        runs["torch"].append(_run_child("torch-first", path, "", prefetch)["first_ms"])
        for m in methods:
            runs[m].append(_run_child("pinned", path, m, prefetch)["first_ms"])
        print(f"round {r + 1}/{rounds} done", flush=True)
    load = (load0 + os.getloadavg()[0]) / 2
    print(
        f'\nfirst batch, collate_mode="workers", 2 workers, prefetch={prefetch}; '
        f"torch DataLoader(num_workers=2) "
        f"over __getitems__; a fresh process each, medians of {rounds} rounds; load average {load:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    torch_ms = runs["torch"]
    print(f"  torch DataLoader             {statistics.median(torch_ms):8.1f} ms")
    for m in methods:
        x = statistics.median(g / t for g, t in zip(runs[m], torch_ms, strict=True))
        print(f"  guideloom, started by {m!r:12s} {statistics.median(runs[m]):8.1f} ms  {x:5.2f}x torch")


# -- the table -----------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def _parts(rows: list[dict[str, Any]]) -> str:
    """The peak's parts, medians, those that are there."""
    names = [k for k in rows[0]["parts"] if any(r["parts"][k] for r in rows)]
    return " + ".join(f"{k} {statistics.median(r['parts'][k] for r in rows):.0f}" for k in names)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument(
        "--methods",
        default="here,forkserver",
        help="guideloom's start methods to measure (here,forkserver,spawn,fork)",
    )
    ap.add_argument("--pinned", action="store_true", help='only the first batch, collate_mode="workers"')
    ap.add_argument(
        "--child", choices=["torch", "guideloom", "torch-first", "pinned"], help=argparse.SUPPRESS
    )
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        path = Path(args.path)
        children = {
            "torch": lambda: child_torch(path),
            "guideloom": lambda: child_guideloom(path, args.prefetch),
            "torch-first": lambda: child_torch_first(path),
            "pinned": lambda: child_guideloom_pinned(path, args.prefetch),
        }
        print(json.dumps(children[args.child]()))
        return
    path = ensure_dataset(args.tokens)
    methods = args.methods.split(",")
    if args.pinned:
        pinned_table(path, methods, args.rounds, args.prefetch)
        return
    runs: dict[str, list[dict[str, Any]]] = {"torch": [], **{m: [] for m in methods}}
    for r in range(args.rounds):
        runs["torch"].append(_run_child("torch", path, "", args.prefetch))
        for m in methods:
            runs[m].append(_run_child("guideloom", path, m, args.prefetch))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    torch_runs = runs["torch"]
    print(
        f"\n{args.tokens:,} uint16 tokens, sequence_length={SEQ}, local_batch_size={BATCH}, shuffled, "
        f"2 workers, {os.cpu_count()} CPUs; medians of {args.rounds} rounds, ratios within each round"
    )
    print(
        f"torch DataLoader: first batch {_median(torch_runs, 'first_ms'):.1f} ms, "
        f"peak PSS {_median(torch_runs, 'pss_mib'):.0f} MiB "
        f"({int(_median(torch_runs, 'processes'))} processes: {_parts(torch_runs)})"
    )
    for m in methods:
        rows = runs[m]
        first_x = statistics.median(
            g["first_ms"] / t["first_ms"] for g, t in zip(rows, torch_runs, strict=True)
        )
        pss_x = statistics.median(g["pss_mib"] / t["pss_mib"] for g, t in zip(rows, torch_runs, strict=True))
        same = all(g["same_workers"] for g in rows)
        print(f"\nguideloom, workers started by {m!r}:")
        print(
            f"  first batch of a fresh loader   {_median(rows, 'first_ms'):8.1f} ms   {first_x:5.2f}x torch"
        )
        print(f"  workers up                      {_median(rows, 'up_ms'):8.1f} ms")
        print(
            f"  first batch after load_state_dict on the open loader "
            f"{_median(rows, 'resume_ms'):6.2f} ms (max {max(g['resume_ms'] for g in rows):.2f}); "
            f"same worker processes: {same}"
        )
        print(
            f"  peak PSS                        {_median(rows, 'pss_mib'):8.0f} MiB  {pss_x:5.2f}x torch "
            f"({int(_median(rows, 'processes'))} processes: {_parts(rows)})"
        )
        print(
            f"  a second loader in the process: first batch {_median(rows, 'second_first_ms'):.1f} ms, "
            f"workers up {_median(rows, 'second_up_ms'):.1f} ms"
        )


if __name__ == "__main__":
    main()
