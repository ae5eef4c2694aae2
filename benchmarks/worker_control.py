"""Where the workers' collate runs, under load: ``collate_mode="auto"`` against both pinned modes.

Beside the loader, ``--hogs`` processes (one per CPU by default) each spin a busy loop, as other
jobs on a shared machine do. For thread and process workers (``num_workers=2``, ``prefetch=4``)
and three collates (a ~1 ms pure-Python loop that holds the GIL, a ~1 ms numpy collate that
releases it, and the README's, ~30 us, cheaper than a hand-off), with a training step of one ~1 ms
matrix product (which releases the GIL), three loaders, ``collate_mode="auto"``, ``"workers"``
and ``"inline"`` (which is ``num_workers=0``), are opened once, warmed, then timed in
interleaved windows (a drift of the machine's load weighs on all three). The figure is steps/s;
the target: auto at 0.95x or more of the better pinned mode, as the median over the rounds of
each round's ratio.

    python -m benchmarks worker-control                 # one hog per CPU, ~4 minutes
    python -m benchmarks worker-control --hogs 0        # a quiet machine (or as quiet as it is)
    python -m benchmarks worker-control --only thread --collates gil --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import guideloom as gl  # noqa: E402
from benchmarks.local_stream import BATCH, SEQ, collate, ensure_dataset, gil_bound_collate  # noqa: E402

MODES = ("auto", "workers", "inline")
TARGET = 0.95
#: Steps not timed at the start of each window: the batches the workers prepared meanwhile.
UNTIMED = 10


class NumpyCollate:
    """A collate whose work releases the GIL: the batch widened to int64 and each row sorted
    ``repeats`` times (numpy's sort runs without the GIL); picklable for process workers."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats

    def __call__(self, samples: Sequence[np.ndarray]) -> torch.Tensor:
        block = np.asarray(samples).astype(np.int64)
        out = block
        for _ in range(self.repeats):
            out = np.sort(block, axis=1)
        return torch.from_numpy(out)


def numpy_collate(ms: float = 1.0) -> NumpyCollate:
    """A :class:`NumpyCollate` calibrated here, now, to about ``ms`` milliseconds a batch."""
    rows = [np.random.default_rng(0).integers(0, 50_000, SEQ, dtype=np.uint16) for _ in range(BATCH)]
    one = NumpyCollate(1)
    best = min(_timed(one, rows) for _ in range(20))
    return NumpyCollate(max(1, round(ms / 1000 / best)))


def _timed(fn: Callable[[Any], Any], arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


class Step:
    """The consumer's training step: one matrix product on one torch thread, sized to take about
    ``ms`` milliseconds; torch releases the GIL for all of it, as a step spent waiting on a GPU
    does (many small products would hand the GIL back and forth with a collate thread instead)."""

    def __init__(self, ms: float) -> None:
        torch.set_num_threads(1)
        self.a: torch.Tensor | None = None
        if ms <= 0:  # a loop that only loads
            return
        n = 128
        while True:
            self.a = torch.randn(n, n)
            best = min(_timed(self, None) for _ in range(5))
            if best >= ms / 1000 or n >= 4096:
                break
            n = max(n + 16, int(n * min(2.0, (ms / 1000 / best) ** (1 / 3))))

    def __call__(self, batch: Any) -> None:
        if self.a is not None:
            torch.mm(self.a, self.a)


def _spin() -> None:
    """A hog: a busy loop until terminated."""
    while True:
        pass


class Feed:
    """One loader opened once (workers persistent) and iterated across epochs in timed windows."""

    def __init__(self, path: Path, collate: Any, step: Step, **kw: Any) -> None:
        self.loader = gl.StatefulDataLoader.from_storage(
            gl.open_stream(path), collate, sequence_length=SEQ, local_batch_size=BATCH, shuffle=True,
            shuffle_seed=0, device=torch.device("cpu"), **kw,
        )  # fmt: skip
        self.step = step
        self.loader.open()
        self.it = iter(self.loader)

    def run(self, seconds: float, untimed: int = 0) -> float:
        """Steps/s over ``seconds`` after ``untimed`` steps (what the workers prepared while the
        other loaders ran would flatter the first ones); a new epoch's iterator where one ends."""
        n, t0 = -untimed, time.perf_counter()
        end = t0 + seconds
        while True:
            try:
                batch = next(self.it)
            except StopIteration:
                self.it = iter(self.loader)
                continue
            self.step(batch)
            n += 1
            if n == 0:
                t0 = time.perf_counter()
                end = t0 + seconds
            elif n > 0 and n % 4 == 0 and time.perf_counter() >= end:
                return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.it = iter(())
        self.loader.close()


def _fmt_stats(stats: dict[str, float]) -> str:
    places = "/".join(f"{stats[f'collated_{p}']:.0f}" for p in ("inline", "threads", "processes"))
    out = f"collated inline/threads/processes {places}"
    if "chooser_workers" in stats:
        out += (
            f"; last verdict {'workers' if stats['chooser_workers'] else 'inline'} "
            f"(workers {stats['chooser_workers_seconds'] * 1e3:.2f} ms, inline "
            f"{stats['chooser_inline_seconds'] * 1e3:.2f} ms, {stats['chooser_verdicts']:.0f} verdicts)"
        )
    return out


def measure(
    path: Path, method: str, name: str, collate: Any, step: Step, rounds: int, seconds: float, warm: float
) -> bool:
    """One table row group: the three modes' steps/s, interleaved; whether auto met the target."""
    feeds = {
        mode: Feed(path, collate, step, num_workers=2, parallel_method=method, prefetch=4, collate_mode=mode)
        for mode in MODES
    }
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for feed in feeds.values():
            feed.run(warm)
        for r in range(rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]  # each mode first in turn: a drift weighs on all
            for mode in order:
                rates[mode].append(feeds[mode].run(seconds, untimed=UNTIMED))
        stats = feeds["auto"].loader.stats()
    finally:
        for feed in feeds.values():
            feed.close()
    med = {mode: statistics.median(v) for mode, v in rates.items()}
    best = "workers" if med["workers"] >= med["inline"] else "inline"
    # Each round's auto over the same round's better pinned mode (better by the medians), so
    # that a burst of another process's load weighs on both sides of a ratio.
    ratios = [a / b for a, b in zip(rates["auto"], rates[best], strict=True)]
    ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratio, ratio, ratio)
    ok = ratio >= TARGET
    print(
        f"{method:8s} {name:22s} {med['auto']:8.0f} {med['workers']:8.0f} {med['inline']:8.0f} "
        f"{med['workers'] / med['inline']:9.2f} {ratio:11.2f} {q1:6.2f}-{q3:.2f}  "
        + ("ok" if ok else "BELOW"),
        flush=True,
    )
    print(f"{'':31s}auto: {_fmt_stats(stats)}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks worker-control", description=summary(__doc__))
    ap.add_argument(
        "--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: one per CPU)"
    )
    ap.add_argument("--only", default="thread,process", help="worker kinds: thread,process")
    ap.add_argument("--collates", default="gil,numpy,trivial", help="collates: gil,numpy,trivial")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per timed window (default 0.5)")
    ap.add_argument(
        "--warm", type=float, default=1.0, help="seconds each loader runs untimed first (default 1)"
    )
    ap.add_argument(
        "--step-ms", type=float, default=1.0, help="the step's matrix product (default 1 ms; 0: none)"
    )
    ap.add_argument("--tokens", type=int, default=100_000_000, help="tokens in the dataset (default 100M)")
    args = ap.parse_args(argv)
    path = ensure_dataset(args.tokens)
    # Calibrated before the hogs start: the same work on a quiet core.
    collates: dict[str, tuple[str, Any]] = {}
    if "gil" in args.collates:
        gil = gil_bound_collate(1.0)
        collates["gil"] = ("GIL-bound ~1 ms", gil)
    if "numpy" in args.collates:
        collates["numpy"] = ("numpy ~1 ms", numpy_collate(1.0))
    if "trivial" in args.collates:
        collates["trivial"] = ("trivial (README)", collate)
    step = Step(args.step_ms)
    # fork where there is one: a hog needs nothing of this process but a core
    ctx = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    hogs = [ctx.Process(target=_spin, name=f"hog-{i}", daemon=True) for i in range(args.hogs)]
    for h in hogs:
        h.start()
    try:
        print(
            f"{os.cpu_count()} CPUs, {args.hogs} busy-loop processes beside the loader; num_workers=2, "
            f"prefetch=4, batch {BATCH}x{SEQ}, step: one ~{args.step_ms:g} ms matrix product; steps/s, "
            f"medians of {args.rounds} interleaved {args.seconds:g} s windows after {args.warm:g} s warm-up; "
            "auto/best: median over the rounds of auto over the better pinned mode"
        )
        print(
            f"{'workers':8s} {'collate':22s} {'auto':>8s} {'workers':>8s} {'inline':>8s} "
            f"{'wrk/inl':>9s} {'auto/best':>11s} {'quartiles':>10s}"
        )
        results = [
            measure(path, method, label, collate, step, args.rounds, args.seconds, args.warm)
            for method in args.only.split(",")
            for label, collate in collates.values()
        ]
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()
    print(
        f"target: auto at {TARGET}x or more of the better pinned mode: {sum(results)} of {len(results)} met"
    )


if __name__ == "__main__":
    main()
