"""Local stream throughput: guideloom against a bare memmap loop and torch's DataLoader.

Workload: a uint16 stream of 100M tokens on local disk, sequence_length=2048,
local_batch_size=16, shuffle on, collate to an int64 (16, 2048) tensor, N batches after a
warm-up. Every configuration runs in the same process, in alternating rounds, and the figures are
reported as ratios to the bare loop of the same round (this machine is shared and noisy).

    python -m benchmarks local            # full run (~2 minutes once the data exists)
    python -m benchmarks local --quick    # a smaller smoke run
    python -m benchmarks local --process-workers   # only the process-worker table
    python -m benchmarks local --steady   # only the steady-state worker ratios
    python -m benchmarks local --nw0      # only num_workers=0 against the bare loop
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import guideloom as gl

SEQ = 2048
BATCH = 16


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """The collate every loader uses: the rows as one array (``np.asarray`` stacks a list of rows;
    guideloom's ``Rows`` are the rows of one block, returned without a copy), widened to int64."""
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


class GilBoundCollate:
    """The README's collate after ``loops`` iterations of pure Python, which hold the GIL
    (a tokenizer-like collate); picklable, so process workers can run it too."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, samples: Sequence[np.ndarray]) -> torch.Tensor:
        # A local bound: ``self.loops`` read per iteration would make the loop's cost depend on
        # whether the object was pickled (CPython 3.11 materialises an instance's __dict__ when
        # pickling it, and attribute reads on it are ~1.7x slower from then on: in the workers,
        # which unpickle it, and in the main process, which pickled it for them).
        n, loops = 0, self.loops
        while n < loops:  # bytecode the interpreter runs with the GIL held
            n += 1
        return collate(samples)


def gil_bound_collate(ms: float = 1.0) -> GilBoundCollate:
    """A :class:`GilBoundCollate` calibrated here, now, to take about ``ms`` milliseconds a batch
    of ``BATCH`` rows (the README collate's own time included)."""
    rows = [np.zeros(SEQ, np.uint16)] * BATCH
    probe = GilBoundCollate(200_000)
    best = min(_timed(probe, rows) for _ in range(10))
    alone = min(_timed(collate, rows) for _ in range(10))
    loops = probe.loops * max(1e-5, ms / 1000 - alone) / max(1e-6, best - alone)
    return GilBoundCollate(max(1, int(loops)))


def _timed(fn: Callable[[Any], Any], arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def ensure_dataset(tokens: int) -> Path:
    root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    path = root / f"stream-u16-{tokens}"
    if not (path / "manifest.json").exists():
        print(f"writing {tokens:,} tokens to {path} ...", flush=True)
        rng = np.random.default_rng(0)
        chunk = 8 * 2**20

        def chunks() -> Any:
            for start in range(0, tokens, chunk):
                yield rng.integers(0, 50_000, min(chunk, tokens - start), dtype=np.uint16)

        gl.write_stream(path, chunks(), dtype=np.uint16, overwrite=True)
    return path


def order_for(n_samples: int, batches: int) -> np.ndarray:
    """The same shuffled sample order guideloom uses (its plan), for the baselines."""
    from benchmarks._internals import Permutation

    return Permutation(n_samples, shuffle=True, seed=0, epoch=0).range(0, batches * BATCH)


def _rows_view(path: Path) -> np.ndarray:
    files = gl.open_stream(path).manifest.tokens.files  # type: ignore[attr-defined]
    mm = np.memmap(path / files[0].path, dtype=np.uint16, mode="r")
    rows = len(mm) // SEQ
    return np.asarray(mm[: rows * SEQ]).reshape(rows, SEQ)


def run_bare(path: Path, batches: int) -> float:
    """The limit, no loader at all: gather each batch's rows from a memmap in one numpy operation."""
    view = _rows_view(path)
    order = order_for(len(view), batches)
    for b in range(min(batches, 100)):  # warm-up, as the loaders get
        collate(view[order[b * BATCH : (b + 1) * BATCH]])
    t0 = time.perf_counter()
    for b in range(batches):
        collate(view[order[b * BATCH : (b + 1) * BATCH]])  # one gather, then the int64 conversion
    return batches * BATCH / (time.perf_counter() - t0)


def run_bare_per_sample(path: Path, batches: int) -> float:
    """No loader, but one slice per sample (what a map-style Dataset's __getitem__ does)."""
    view = _rows_view(path)
    order = order_for(len(view), batches)
    for b in range(min(batches, 100)):
        collate([view[i] for i in order[b * BATCH : (b + 1) * BATCH].tolist()])
    t0 = time.perf_counter()
    for b in range(batches):
        collate([view[i] for i in order[b * BATCH : (b + 1) * BATCH].tolist()])
    return batches * BATCH / (time.perf_counter() - t0)


def run_bare_threads(path: Path, batches: int, workers: int = 2, group: int = 4) -> float:
    """No loader, collation on a thread pool: what Python threads can do for this collate at all.

    The main thread gathers groups of batches and hands each group to the pool, keeping
    2 * workers groups in flight, results taken in order. With the GIL, this bounds any
    thread-worker loader on this collate.
    """
    from concurrent.futures import ThreadPoolExecutor

    view = _rows_view(path)
    order = order_for(len(view), batches)
    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        pending = []
        for s in range(0, batches, group):
            rows = [list(view[order[b * BATCH : (b + 1) * BATCH]]) for b in range(s, min(batches, s + group))]
            pending.append(pool.submit(lambda rs: [collate(r) for r in rs], rows))
            if len(pending) > 2 * workers:
                pending.pop(0).result()
        for f in pending:
            f.result()
        dt = time.perf_counter() - t0
    return batches * BATCH / dt


def make_loader(path: Path, **kw: Any) -> gl.StatefulDataLoader[Any, torch.Tensor]:
    return gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        kw.pop("collate_fn", collate),
        sequence_length=SEQ,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=0,
        device=torch.device("cpu"),
        **kw,
    )


def _samples_per_s(it: Any, batches: int, warmup: int) -> float:
    """Samples/s of ``batches`` batches from ``it``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * BATCH / (time.perf_counter() - t0)


def run_sync(path: Path, batches: int, warmup: int, **kw: Any) -> float:
    loader = make_loader(path, **kw)
    with loader:
        it = iter(loader)
        rate = _samples_per_s(it, batches, warmup)
        it.close()
    return rate


def run_async(path: Path, batches: int, warmup: int, **kw: Any) -> float:
    async def main() -> float:
        loader = make_loader(path, **kw)
        async with loader:
            it = aiter(loader)
            for _ in range(warmup):
                await anext(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                await anext(it)
            dt = time.perf_counter() - t0
            await it.aclose()
        return batches * BATCH / dt

    import uvloop

    return uvloop.run(main())


class _MemmapRows(torch.utils.data.Dataset[np.ndarray]):
    def __init__(self, path: Path) -> None:
        files = gl.open_stream(path).manifest.tokens.files  # type: ignore[attr-defined]
        self.path = path / files[0].path
        self.mm: np.ndarray | None = None
        self.rows = os.path.getsize(self.path) // 2 // SEQ

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> np.ndarray:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        return np.asarray(self.mm[i * SEQ : (i + 1) * SEQ])


def run_torch(
    path: Path, batches: int, warmup: int, num_workers: int, fn: Callable[[Any], Any] = collate
) -> float:
    """Samples/s of torch's ``DataLoader`` over the same rows and order, with collate ``fn``."""
    ds = _MemmapRows(path)
    order = order_for(ds.rows, warmup + batches).tolist()
    dl = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, sampler=order, collate_fn=fn, num_workers=num_workers
    )
    it = iter(dl)
    rate = _samples_per_s(it, batches, warmup)
    del it
    return rate


def run_with_step(path: Path, batches: int, warmup: int, **kw: Any) -> float:
    """Steps/s of a loop whose 'training step' is torch work (which releases the GIL, as a real
    step does): what prefetch is for. ``kw`` None runs the step alone, with no loading."""
    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def step(batch: Any) -> None:
        for _ in range(4):
            torch.mm(a, a)

    if kw.get("alone"):
        t0 = time.perf_counter()
        for _ in range(batches):
            step(None)
        return batches / (time.perf_counter() - t0)
    loader = make_loader(path, **kw)
    with loader:
        it = iter(loader)
        for _ in range(warmup):
            step(next(it))
        t0 = time.perf_counter()
        for _ in range(batches):
            step(next(it))
        dt = time.perf_counter() - t0
        it.close()
    return batches / dt


# -- process workers ---------------------------------------------------------------------------------
def epoch2_first_batch(path: Path, **kw: Any) -> tuple[float, float]:
    """Seconds to the first batch of epoch 1 (workers start) and of epoch 2 (persistent workers:
    no respawn), with process workers and the README's collate."""
    loader = make_loader(path, **kw)
    with loader:
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        first = time.perf_counter() - t0
        for _ in it:  # the rest of epoch 1
            pass
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        second = time.perf_counter() - t0
        it.close()
    return first, second


def process_worker_table(path: Path, batches: int, warmup: int, rounds: int, skip_torch: bool) -> None:
    """The process-worker targets: nw=2 processes against nw=0 (and torch at nw=2) for a GIL-bound and a
    trivial collate, ratios within each round; then epoch 2's first batch."""
    gil = gil_bound_collate(1.0)
    gil_ms = statistics.median(_timed(gil, [np.zeros(SEQ, np.uint16)] * BATCH) for _ in range(20)) * 1e3
    proc = {"num_workers": 2, "parallel_method": "process", "prefetch": 16}
    gil_batches = max(50, batches // 5)
    rows: dict[str, Callable[[], float]] = {
        "GIL-bound nw=0": lambda: run_sync(path, gil_batches, warmup // 5, collate_fn=gil),
        "GIL-bound nw=2 processes": lambda: run_sync(path, gil_batches, warmup // 5, collate_fn=gil, **proc),
        "trivial nw=0": lambda: run_sync(path, batches, warmup, collate_fn=collate),
        "trivial nw=2 processes": lambda: run_sync(path, batches, warmup, collate_fn=collate, **proc),
    }
    if not skip_torch:
        rows["GIL-bound torch DataLoader nw=2"] = lambda: run_torch(path, gil_batches, warmup // 5, 2, gil)
        rows["trivial torch DataLoader nw=2"] = lambda: run_torch(path, batches, warmup, 2, collate)
    got: dict[str, list[float]] = {k: [] for k in rows}
    ratios: dict[str, list[float]] = {k: [] for k in rows}
    ttfb: list[tuple[float, float]] = []
    for r in range(rounds):
        for name, fn in rows.items():
            got[name].append(fn())
        for name in rows:
            base = "GIL-bound nw=0" if name.startswith("GIL") else "trivial nw=0"
            ratios[name].append(got[name][-1] / got[base][-1])
        ttfb.append(epoch2_first_batch(path, **proc))
        print(f"process workers: round {r + 1}/{rounds} done", flush=True)
    print(
        f"\nprocess workers ({os.cpu_count()} CPUs): GIL-bound collate {gil_ms:.2f} ms a batch "
        f"({gil.loops} loops), trivial = the README's; {rounds} rounds (medians)"
    )
    print(f"{'configuration':44s} {'samples/s':>12s} {'x nw=0':>8s}")
    for name in rows:
        print(f"{name:44s} {statistics.median(got[name]):12,.0f} {statistics.median(ratios[name]):8.2f}")
    if not skip_torch:
        for kind in ("GIL-bound", "trivial"):
            vs = [
                a / b
                for a, b in zip(
                    got[f"{kind} nw=2 processes"], got[f"{kind} torch DataLoader nw=2"], strict=True
                )
            ]
            print(f"{kind} nw=2 processes / torch DataLoader nw=2: {statistics.median(vs):.2f}x (median)")
    firsts, seconds = [a for a, _ in ttfb], [b for _, b in ttfb]
    print(
        f"process workers, first batch: epoch 1 (spawn) {statistics.median(firsts) * 1e3:.0f} ms, "
        f"epoch 2 (persistent) {statistics.median(seconds) * 1e3:.1f} ms "
        f"(medians; max {max(seconds) * 1e3:.1f} ms)"
    )


def first_batch_on_sparse_tib() -> tuple[float, float, float]:
    """Open a stream whose data file is a 1 TiB sparse file; time and RSS to the first shuffled batch."""
    code = r"""
import json, os, sys, time, resource, hashlib
import numpy as np, torch
root = sys.argv[1]
n = 2**40 // 2
os.makedirs(root, exist_ok=True)
with open(os.path.join(root, "tokens.bin"), "wb") as f:
    f.truncate(2 * n)
man = {"format": "guideloom-dataset", "format_version": 1, "kind": "stream", "dtype": "uint16",
       "num_elements": n, "checksum": "sha256",
       "fields": {"tokens": {"dtype": "uint16", "files": [
           {"path": "tokens.bin", "elements": n, "bytes": 2 * n, "sha256": "0" * 64}]}}}
with open(os.path.join(root, "manifest.json"), "w") as f:
    json.dump(man, f)
import guideloom as gl
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
collate = lambda s: torch.from_numpy(np.stack(s).astype(np.int64))
loader = gl.StatefulDataLoader.from_storage(gl.open_stream(root), collate,
    sequence_length=2048, local_batch_size=16, shuffle=True, shuffle_seed=0, device=torch.device("cpu"))
with loader:
    batch = next(iter(loader))
dt = time.perf_counter() - t0
print(dt, base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", code, os.path.join(tmp, "tib")], check=True, capture_output=True, text=True
        ).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


class _Feed:
    """One loader opened once (its workers persistent) and iterated across epochs, timed in
    windows: what a training job sees after its first few hundred batches."""

    def __init__(self, path: Path, **kw: Any) -> None:
        self.loader = make_loader(path, **kw)
        self.loader.__enter__()
        self.it = iter(self.loader)

    def take(self, n: int) -> float:
        """Samples/s of the next ``n`` batches (a new epoch's iterator where one ends)."""
        t0 = time.perf_counter()
        for _ in range(n):
            try:
                next(self.it)
            except StopIteration:
                self.it = iter(self.loader)
                next(self.it)
        return n * BATCH / (time.perf_counter() - t0)

    def warm(self, seconds: float) -> None:
        """Batches for ``seconds`` (after the first, which may wait for the workers to start)."""
        self.take(1)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.take(50)

    def close(self) -> None:
        self.it = iter(())
        self.loader.__exit__(None, None, None)


def steady_state_table(path: Path, rounds: int, window: int = 1000, warm_s: float = 1.0) -> None:
    """The worker ratios in steady state. Every configuration's loader is opened once
    and warmed for ``warm_s``; then each round times one window of each configuration between
    two windows of its ``nw=0`` baseline (A B A: a drift of the machine's speed weighs on both),
    and the ratio is B over the mean of the two A's. Medians over the rounds, and the spread."""
    gil = gil_bound_collate(1.0)
    gil_window = max(20, window // 10)
    proc = {"num_workers": 2, "parallel_method": "process", "prefetch": 16}
    feeds = {
        "trivial nw=0": _Feed(path, collate_fn=collate),
        "trivial nw=2 threads": _Feed(path, collate_fn=collate, num_workers=2),
        "trivial nw=2 processes": _Feed(path, collate_fn=collate, **proc),
        "GIL-bound nw=0": _Feed(path, collate_fn=gil),
        "GIL-bound nw=2 threads": _Feed(path, collate_fn=gil, num_workers=2),
        "GIL-bound nw=2 processes": _Feed(path, collate_fn=gil, **proc),
    }
    try:
        for feed in feeds.values():
            feed.warm(warm_s)
        ratios: dict[str, list[float]] = {k: [] for k in feeds if "nw=0" not in k}
        rates: dict[str, list[float]] = {k: [] for k in feeds}
        for _ in range(rounds):
            for name, got in ratios.items():
                kind = name.split()[0]
                base, n = feeds[f"{kind} nw=0"], (window if kind == "trivial" else gil_window)
                a, b, c = base.take(n), feeds[name].take(n), base.take(n)
                rates[name].append(b)
                rates[f"{kind} nw=0"] += [a, c]
                got.append(2 * b / (a + c))
        print(
            f"\nsteady state ({os.cpu_count()} CPUs): loaders opened once, warmed {warm_s:.1f} s, "
            f"{rounds} rounds of A B A windows ({window} batches; GIL-bound {gil_window}); "
            f"GIL-bound collate {gil.loops:,} loops"
        )
        print(f"{'configuration':44s} {'samples/s':>12s} {'x nw=0':>8s} {'quartiles':>14s}")
        for name in feeds:
            line = f"{name:44s} {statistics.median(rates[name]):12,.0f}"
            if name in ratios:
                q = statistics.quantiles(ratios[name], n=4)
                line += f" {statistics.median(ratios[name]):8.2f} {q[0]:6.2f}-{q[2]:.2f}"
            print(line)
    finally:
        for feed in feeds.values():
            feed.close()


def _burst_p10(step: Callable[[], Any], bursts: int, size: int = 64) -> float:
    """Seconds a batch of ``step`` (one batch each call) in its 10th-percentile burst of ``size``
    batches: the cost of a batch while nothing else ran, which a loaded machine still shows
    in some of its bursts (a mean over a whole run counts every other process's time slices)."""
    times = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(size):
            step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 10] / size


def _bare_steps(path: Path, batches: int) -> Callable[[], Any]:
    view = _rows_view(path)
    order = order_for(len(view), batches)
    b = 0

    def step() -> Any:
        nonlocal b
        i, b = b, (b + 1) % batches
        return collate(view[order[i * BATCH : (i + 1) * BATCH]])

    return step


def nw0_table(path: Path, batches: int, warmup: int, rounds: int, prefetch: int) -> None:
    """``num_workers=0`` (the README's collate, a fresh loader each, ``warmup`` untimed batches) against
    the bare loop over the same rows: each round times the bare loop, the loaders (sync ``for`` at
    ``prefetch=0`` and ``prefetch``, ``async for``), and the bare loop again; a ratio is a loader's
    rate over the mean of its round's two bare loops. Each round's ratios are printed with the load
    average as it ended, then the medians. Then the same ratio from the 10th-percentile bursts of
    64 batches (:func:`_burst_p10`), bare loop and ``prefetch=0`` alternating: the figure an idle
    machine gives."""
    names = ("sync prefetch=0", f"sync prefetch={prefetch}", "async prefetch=0")
    ratios: dict[str, list[float]] = {k: [] for k in names}
    bare: list[float] = []
    load0 = os.getloadavg()[0]
    for r in range(rounds):
        a = run_bare(path, batches)
        got = [
            run_sync(path, batches, warmup),
            run_sync(path, batches, warmup, prefetch=prefetch),
            run_async(path, batches, warmup),
        ]
        b = run_bare(path, batches)
        bare += [a, b]
        for name, rate in zip(names, got, strict=True):
            ratios[name].append(2 * rate / (a + b))
        shown = "  ".join(f"{name} {ratios[name][-1]:.2f}" for name in names)
        print(f"nw=0 round {r + 1}/{rounds}: load {os.getloadavg()[0]:.2f}; x bare: {shown}", flush=True)
    bursts = max(20, batches // 64)
    best: list[float] = []
    for r in range(rounds):
        loader = make_loader(path)
        with loader:
            it = iter(loader)
            for _ in range(warmup):
                next(it)
            mine = _burst_p10(it.__next__, min(bursts, (len(it) - 1) // 64))
            it.close()
        best.append(_burst_p10(_bare_steps(path, batches), bursts) / mine)
        print(
            f"nw=0 p10 bursts round {r + 1}/{rounds}: load {os.getloadavg()[0]:.2f}; x bare {best[-1]:.2f}",
            flush=True,
        )
    load = (load0 + os.getloadavg()[0]) / 2
    print(
        f"\nnum_workers=0, README collate, {batches} batches after {warmup} warm-up, {rounds} rounds "
        f"(medians); bare loop {statistics.median(bare):,.0f} samples/s; load average {load:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    print(f"{'configuration':44s} {'x bare':>8s} {'range':>12s}")
    for name in names:
        r = ratios[name]
        print(f"{'guideloom nw=0 ' + name:44s} {statistics.median(r):8.2f} {min(r):6.2f}-{max(r):.2f}")
    print(
        f"{'guideloom nw=0 sync prefetch=0, p10 bursts':44s} {statistics.median(best):8.2f} "
        f"{min(best):6.2f}-{max(best):.2f}"
    )


def thread_worker_targets(path: Path, batches: int, warmup: int, rounds: int) -> None:
    """Thread workers against no workers, for the README's collate and a
    GIL-bound collate of ~1 ms; each ratio against ``nw=0`` of the same round (sync ``for``)."""
    gil = gil_bound_collate(1.0)
    gil_batches = max(50, batches // 3)
    cases: dict[str, tuple[Callable[[], float], str]] = {
        "README collate  nw=0": (lambda: run_sync(path, batches, warmup), "README collate  nw=0"),
        "README collate  nw=2 thread": (
            lambda: run_sync(path, batches, warmup, num_workers=2),
            "README collate  nw=0",
        ),
        "README collate  nw=2 thread prefetch=8": (
            lambda: run_sync(path, batches, warmup, num_workers=2, prefetch=8),
            "README collate  nw=0",
        ),
        "GIL-bound ~1 ms nw=0": (
            lambda: run_sync(path, gil_batches, warmup, collate_fn=gil),
            "GIL-bound ~1 ms nw=0",
        ),
        "GIL-bound ~1 ms nw=2 thread": (
            lambda: run_sync(path, gil_batches, warmup, collate_fn=gil, num_workers=2),
            "GIL-bound ~1 ms nw=0",
        ),
        "GIL-bound ~1 ms nw=2 thread prefetch=8": (
            lambda: run_sync(path, gil_batches, warmup, collate_fn=gil, num_workers=2, prefetch=8),
            "GIL-bound ~1 ms nw=0",
        ),
    }
    rates: dict[str, list[float]] = {k: [] for k in cases}
    ratios: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, (fn, _base) in cases.items():
            rates[name].append(fn())
        for name, (_fn, base) in cases.items():
            ratios[name].append(rates[name][-1] / rates[base][-1])
    print(f"\nthread workers (GIL-bound collate: {gil.loops:,} Python loops, {gil_batches} batches)")
    print(f"{'configuration':44s} {'samples/s':>12s} {'x nw=0':>8s} {'min x':>6s}")
    for name in cases:
        print(
            f"{name:44s} {statistics.median(rates[name]):12,.0f} {statistics.median(ratios[name]):8.2f} "
            f"{min(ratios[name]):6.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10M tokens, 200 batches, 1 round")
    ap.add_argument("--prefetch", type=int, default=16, help="prefetch for the prefetching configurations")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--thread-workers-only", action="store_true", help="only the thread-worker targets")
    ap.add_argument("--process-workers", action="store_true", help="only the process-worker table")
    ap.add_argument(
        "--steady", action="store_true", help="only the steady-state worker ratios (long-lived loaders)"
    )
    ap.add_argument("--nw0", action="store_true", help="only num_workers=0 against the bare loop")
    ap.add_argument("--steady-rounds", type=int, default=15, help="rounds of the steady-state table")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.batches, args.warmup, args.rounds = 10_000_000, 200, 50, 1
    path = ensure_dataset(args.tokens)
    if args.nw0:
        nw0_table(path, args.batches, args.warmup, args.rounds, args.prefetch)
        return
    if args.steady:
        steady_state_table(path, args.steady_rounds)
        return
    if args.process_workers:
        process_worker_table(path, args.batches, args.warmup, args.rounds, args.skip_torch)
        steady_state_table(path, args.steady_rounds)
        return
    nb, wu, pf = args.batches, args.warmup, args.prefetch
    if args.thread_workers_only:
        thread_worker_targets(path, nb, wu, args.rounds)
        steady_state_table(path, args.steady_rounds)
        return
    configs: dict[str, Callable[[], float]] = {
        "bare loop, batched gather (the limit)": lambda: run_bare(path, nb),
        "bare loop, one slice per sample": lambda: run_bare_per_sample(path, nb),
        "bare loop, 2 collate threads": lambda: run_bare_threads(path, nb),
        "guideloom sync  nw=0 prefetch=0": lambda: run_sync(path, nb, wu),
        f"guideloom sync  nw=0 prefetch={pf}": lambda: run_sync(path, nb, wu, prefetch=pf),
        f"guideloom async nw=0 prefetch={pf}": lambda: run_async(path, nb, wu, prefetch=pf),
        f"guideloom sync  nw=2 thread prefetch={pf}": lambda: run_sync(
            path, nb, wu, num_workers=2, prefetch=pf
        ),
        f"guideloom async nw=2 thread prefetch={pf}": lambda: run_async(
            path, nb, wu, num_workers=2, prefetch=pf
        ),
    }
    if not args.skip_torch:
        configs["torch DataLoader nw=0"] = lambda: run_torch(path, nb, wu, 0)
        configs["torch DataLoader nw=2"] = lambda: run_torch(path, nb, wu, 2)
    steps: dict[str, Callable[[], float]] = {
        "training step alone (no loading)": lambda: run_with_step(path, nb, wu, alone=True),
        "step + guideloom prefetch=0": lambda: run_with_step(path, nb, wu),
        f"step + guideloom prefetch={pf}": lambda: run_with_step(path, nb, wu, prefetch=pf),
    }
    step_results: dict[str, list[float]] = {k: [] for k in steps}
    results: dict[str, list[float]] = {k: [] for k in configs}
    ratios: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        bare = None
        for name, fn in configs.items():
            v = fn()
            results[name].append(v)
            if bare is None:
                bare = v
            ratios[name].append(v / bare)
        for name, fn in steps.items():
            step_results[name].append(fn())
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(
        f"\n{args.tokens:,} uint16 tokens, sequence_length={SEQ}, local_batch_size={BATCH}, shuffle, "
        f"{nb} batches after {wu} warm-up, {args.rounds} rounds (medians)"
    )
    print(f"{'configuration':44s} {'samples/s':>12s} {'x limit':>8s}")
    for name in configs:
        print(f"{name:44s} {statistics.median(results[name]):12,.0f} {statistics.median(ratios[name]):8.2f}")
    print("\nwith a training step of torch work (4 matmuls of 384x384, one thread), steps/s:")
    alone = statistics.median(step_results["training step alone (no loading)"])
    for name in steps:
        v = statistics.median(step_results[name])
        print(f"{name:44s} {v:12,.0f} {v / alone:8.2f}")
    thread_worker_targets(path, nb, wu, args.rounds)
    dt, base, rss = first_batch_on_sparse_tib()
    print(
        f"\n1 TiB sparse stream: open + first shuffled batch in {dt:.3f} s; peak RSS {rss:.0f} MiB, "
        f"of which {base:.0f} MiB is the interpreter with numpy and torch imported "
        f"(+{rss - base:.0f} MiB for the loader)"
    )
    print(f"this process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    process_worker_table(path, nb, wu, args.rounds, args.skip_torch)
    steady_state_table(path, args.steady_rounds)


if __name__ == "__main__":
    main()
