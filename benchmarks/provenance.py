"""Provenance and the audit against their targets: ``loader.explain()`` of one step at position
10^12 of a 1,000-source mixture over packed documents in < 10 ms, and the audit's tally costing
< 1% of a trivial-collate epoch.

    python -m benchmarks provenance [--sources 1000] [--rounds 7]

- explain: 1,000 written document datasets (a few dozen documents each, on local disk), each
  packed into 64-token sequences (``"concat"``), mixed with lognormal weights into an epoch of
  2 * 10^12 samples. A loader of 16 samples on 8 ranks resumes from a checkpoint at position
  10^12 whose history has two elastic changes; the figure is ``loader.explain(step, rank=3)`` of
  the step at 10^12 (16 samples: position, source, documents, element ranges, files and bytes),
  median of ``--rounds`` calls, and the first call after ``open()`` on its own.
- audit: one epoch of an in-memory stream (16-token samples, batches of 16, a collate that
  returns its list: what is left is the loader's own cost per batch) with
  ``track_deliveries=True`` and ``False`` in alternation (the order swapped every round),
  ``--rounds`` each, timed from the first batch to the last; the figure is the ratio of the
  medians (and of the minima), and the time of one ``audit()`` before the epoch's last batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import guideloom as gl

CPU = torch.device("cpu")
EPOCH = 2 * 10**12
POSITION = 10**12
B, W, RANK = 16, 8, 3
L = 64


def _write_sources(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        dest = folder / f"src{i:04d}"
        if (dest / "manifest.json").exists():
            continue
        docs = [rng.integers(0, 50000, int(rng.integers(10, 200)), dtype=np.uint16) for _ in range(40)]
        gl.write_documents(dest, docs, shard_bytes=4096)


def _mixture(folder: Path, count: int) -> gl.Mixture:
    rng = np.random.default_rng(1)
    weights = rng.lognormal(0.0, 1.5, count)
    sources = {f"src{i:04d}": gl.pack(gl.open_documents(folder / f"src{i:04d}"), L) for i in range(count)}
    return gl.mix(sources, {k: float(w) for k, w in zip(sources, weights, strict=True)}, num_samples=EPOCH)  # type: ignore[arg-type]


def explain_figures(count: int, rounds: int) -> dict[str, float]:
    folder = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    folder = folder / f"provenance-{count}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _write_sources(folder, count)
    written = time.perf_counter() - t0
    g = B * W
    # two elastic changes before: 4 x 8 to step 1000, 12 x 4 to step 3000, then 16 x 8
    first, second = 1000 * 32, 1000 * 32 + 2000 * 48
    offset = POSITION - POSITION % g
    step = 3000 + (offset - second) // g
    history = f"0:0:0:4:8;0:{first}:1000:12:4;0:{second}:3000:{B}:{W}"
    state = {
        "epoch": 0,
        "observation_offset": offset,
        "shuffle": True,
        "shuffle_seed": 7,
        "drop_last": True,
        "history": history,
    }
    loader = gl.StatefulDataLoader(
        _mixture(folder, count),
        list,
        device=CPU,
        local_batch_size=B,
        world_size=W,
        rank=RANK,
        shuffle=True,
        shuffle_seed=7,
    )
    t0 = time.perf_counter()
    loader.open()
    opened = time.perf_counter() - t0
    try:
        loader.load_state_dict(state)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        records = loader.explain(step, rank=RANK)
        cold = time.perf_counter() - t0
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            records = loader.explain(step, rank=RANK)
            times.append(time.perf_counter() - t0)
        earlier = loader.explain(1500, rank=2)  # a step of the second geometry, for the printout
    finally:
        loader.close()
    assert len(records) == B and records[0]["position"] == offset + RANK * B
    assert earlier[0]["position"] == first + 500 * 48 + 2 * 12
    print(f"  sources written in {written:.1f} s (cached across runs), opened in {opened:.2f} s")
    print(f"  step {step:,} rank {RANK}, its first sample: {records[0]}")
    return {"explain_ms": statistics.median(times) * 1e3, "explain_cold_ms": cold * 1e3}


def _identity(samples: Sequence[Any]) -> Sequence[Any]:
    return samples


def _epoch(storage: gl.MemoryStreamStorage, track: bool) -> float:
    """One epoch's batches after the first (the iterator's start is apart: it is the same)."""
    loader = gl.StatefulDataLoader.from_storage(
        storage, _identity, sequence_length=16, local_batch_size=16, device=CPU, track_deliveries=track
    )
    with loader:
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        for _ in it:
            pass
        return time.perf_counter() - t0


def _audit_time(storage: gl.MemoryStreamStorage, rounds: int) -> float:
    loader = gl.StatefulDataLoader.from_storage(
        storage, _identity, sequence_length=16, local_batch_size=16, device=CPU
    )
    with loader:
        it = iter(loader)
        for _ in range(len(loader) - 1):  # the last batch left: the epoch is not over
            next(it)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            assert loader.audit().ok
            times.append(time.perf_counter() - t0)
        it.close()
    return statistics.median(times)


def audit_figures(rounds: int, samples: int) -> dict[str, float]:
    storage = gl.MemoryStreamStorage(np.arange(samples * 16, dtype=np.uint16))
    on: list[float] = []
    off: list[float] = []
    _epoch(storage, True)  # warm up
    for i in range(rounds):  # in alternation, the order swapped every round
        for track in (True, False) if i % 2 else (False, True):
            (on if track else off).append(_epoch(storage, track))
    batches = samples // 16
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {
        "epoch_on_s": m_on,
        "epoch_off_s": m_off,
        "per_batch_on_us": m_on / batches * 1e6,
        "per_batch_off_us": m_off / batches * 1e6,
        "overhead_ratio": m_on / m_off,
        "min_ratio": min(on) / min(off),
        "audit_ms": _audit_time(storage, rounds) * 1e3,
    }


def _load() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks provenance", description=summary(__doc__))
    ap.add_argument("--sources", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--samples", type=int, default=200_000, help="samples of the audit's epoch")
    args = ap.parse_args(argv)
    print(f"load average before: {_load()}")
    print(f"explain: {args.sources} packed document sources, epoch of 2*10^12, step at 10^12")
    ex = explain_figures(args.sources, args.rounds)
    verdict = "met" if ex["explain_ms"] < 10 else "NOT met"
    print(
        f"  explain one step (16 samples): {ex['explain_ms']:.2f} ms median (target < 10 ms: {verdict}); "
        f"first call {ex['explain_cold_ms']:.2f} ms"
    )
    print(f"audit: epochs of {args.samples:,} samples, batches of 16, identity collate, {args.rounds} rounds")
    au = audit_figures(args.rounds, args.samples)
    pct = (au["overhead_ratio"] - 1) * 100
    verdict = "met" if pct < 1 else "NOT met"
    print(f"  tally on:  {au['epoch_on_s']:.3f} s an epoch, {au['per_batch_on_us']:.2f} us a batch")
    print(f"  tally off: {au['epoch_off_s']:.3f} s an epoch, {au['per_batch_off_us']:.2f} us a batch")
    print(
        f"  overhead: {pct:+.2f}% (ratio {au['overhead_ratio']:.4f}; target < 1%: {verdict}); "
        f"audit() at the epoch's end {au['audit_ms']:.3f} ms"
    )
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
