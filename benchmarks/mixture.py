"""Mixture open and resume times against their targets: a 1,000-source mixture opens in < 100 ms and
resumes in < 20 ms at position 10^9 (time to the first batch after ``load_state_dict``).

    python -m benchmarks mixture [--sources 1000] [--rounds 7]
    python -m benchmarks mixture --discrepancy 300     # the schedule's prefix error, random mixtures

Each source is an in-memory uint16 stream of a few 2048-token samples, with lognormal weights (as
real mixtures are: a few large sources, a long tail); the mixture's epoch is 2 * 10^9 samples so
position 10^9 lies mid-epoch, every source deep into epochs of its own. Figures, medians of
``--rounds`` fresh loaders, each in this process:

- open: ``mix(...)`` + ``StatefulDataLoader(...)`` + ``open()`` (the schedule's tree is built
  there: nothing is precomputed per position);
- first batch: ``iter()`` + ``next()`` at position 0 of a fresh, open loader;
- resume: ``load_state_dict`` at position 10^9 + ``iter()`` + ``next()`` on a fresh loader of a
  fresh mixture, just opened (nothing read or looked up before);
- the same resume over one plain stream of the same samples (the baseline, measured in the same
  run: the machine is shared and noisy, so the ratio is the figure to compare);
- the steady-state rate (``--batches`` batches, ``num_workers=0``, a stacking collate) of the
  mixture and of the plain stream, in alternation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import guideloom as gl

L = 2048
B = 16
POSITION = 10**9
EPOCH = 2 * 10**9
CPU = torch.device("cpu")  # torch is imported here, before any timing: not a mixture's cost
TOTAL = 8000  # samples over all sources: 32 MiB of 2048 uint16 tokens (8 per source for 1,000)


def collate(samples: Sequence[np.ndarray]) -> np.ndarray:
    return np.stack(samples)


def make_sources(n: int, seed: int = 0) -> tuple[dict[str, gl.MemoryStreamStorage], dict[str, float]]:
    rng = np.random.default_rng(seed)
    per = max(1, TOTAL // n) * L
    tokens = rng.integers(0, 50_000, size=n * per, dtype=np.uint16)
    sources = {f"src{i:04d}": gl.MemoryStreamStorage(tokens[i * per : (i + 1) * per]) for i in range(n)}
    weights = dict(zip(sources, rng.lognormal(0.0, 1.5, size=n).tolist(), strict=True))
    return sources, weights


def mixture_loader(sources: dict[str, Any], weights: dict[str, float]) -> gl.StatefulDataLoader[Any, Any]:
    m = gl.mix(sources, weights, sequence_length=L, num_samples=EPOCH)
    return gl.StatefulDataLoader(m, collate, local_batch_size=B, shuffle=True, shuffle_seed=1234, device=CPU)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def first_batch(loader: gl.StatefulDataLoader[Any, Any]) -> Any:
    it = iter(loader)
    try:
        return next(it)
    finally:
        it.close()


def resume_ms(loader: gl.StatefulDataLoader[Any, Any], state: dict[str, Any]) -> float:
    def run() -> Any:
        loader.load_state_dict(state)  # type: ignore[arg-type]
        return first_batch(loader)

    ms, batch = timed(run)
    assert batch.shape == (B, L)
    return ms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks mixture", description=summary(__doc__))
    ap.add_argument("--sources", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=500, help="batches of the steady-state rate")
    ap.add_argument(
        "--discrepancy",
        type=int,
        metavar="MIXTURES",
        help="instead: the schedule's prefix error on random mixtures",
    )
    args = ap.parse_args(argv)
    if args.discrepancy:
        discrepancy(args.discrepancy)  # a short epoch: every mixture gets a quota table
        discrepancy(args.discrepancy, epoch=10**9)  # a long one: exact ratios only, else the tree
        return
    sources, weights = make_sources(args.sources)
    plain_tokens = np.concatenate([s.read_many_sync(np.asarray([0]), len(s))[0] for s in sources.values()])
    opens, firsts, resumes, plains = [], [], [], []
    mix_rates: list[float] = []
    plain_rates: list[float] = []
    for _ in range(args.rounds):
        ms, loader = timed(lambda: _opened(mixture_loader(sources, weights)))
        opens.append(ms)
        firsts.append(timed(lambda: first_batch(loader))[0])  # noqa: B023 - used at once
        state = {**loader.state_dict(), "epoch": 3, "observation_offset": POSITION}
        loader.close()
        # the resume of a fresh job: a new mixture and loader, opened, nothing read before
        resumed = _opened(mixture_loader(sources, weights))
        resumes.append(resume_ms(resumed, state))
        stats = resumed.stats()
        resumed.close()
        plain = gl.StatefulDataLoader(
            gl.StreamDataset(gl.MemoryStreamStorage(plain_tokens), L),
            collate,
            local_batch_size=B,
            shuffle=True,
            shuffle_seed=1234,
            device=CPU,
        )
        with plain:
            pstate = {**plain.state_dict(), "epoch": 3, "observation_offset": len(plain.dataset) // 2}
            plains.append(resume_ms(plain, pstate))
            plain.load_state_dict({**pstate, "observation_offset": 0})  # type: ignore[typeddict-item]
            plain_rates.append(throughput(plain, min(args.batches, len(plain))))
        with _opened(mixture_loader(sources, weights)) as ld:
            ld.load_state_dict(state)  # type: ignore[arg-type]
            mix_rates.append(throughput(ld, min(args.batches, len(plain))))
    epochs = [v for k, v in stats.items() if k.startswith("source_epoch/")]
    med = statistics.median
    lines = [
        f"mixture of {args.sources} sources, epoch {EPOCH:,} samples, B={B}, L={L}, "
        f"{args.rounds} rounds (medians)",
        f"open (mix + loader + open):            {med(opens):7.2f} ms   "
        f"(target < 100 ms; all: {_fmt(opens)})",
        f"first batch at position 0:             {med(firsts):7.2f} ms   (all: {_fmt(firsts)})",
        f"resume TTFB at epoch 3, position 10^9: {med(resumes):7.2f} ms   "
        f"(target < 20 ms; all: {_fmt(resumes)})",
        f"baseline: one stream, resume TTFB:     {med(plains):7.2f} ms   "
        f"(mixture / baseline {med(resumes) / med(plains):.2f}x)",
        f"steady state, {args.batches} batches: mixture {med(mix_rates):,.0f} samples/s, one stream "
        f"{med(plain_rates):,.0f} samples/s (mixture / stream {med(mix_rates) / med(plain_rates):.2f}x)",
        f"source epochs at the resumed position: min {min(epochs):,.0f}, median {med(epochs):,.0f}, "
        f"max {max(epochs):,.0f}",
    ]
    print("\n".join(lines))


def discrepancy(mixtures: int, positions: int = 20_000, seed: int = 5, epoch: int | None = None) -> None:
    """The worst ``|k_s(n) - w_s n|`` over the first ``positions`` prefixes of an epoch of
    ``epoch`` positions (default: ``positions``), and the proven bound, on random mixtures of
    2-40 sources: uniform, heavy-tailed (uniform^6) and mixed (1, 2, 10, 1e-3) weights; and how
    many got each kind of schedule."""
    from benchmarks._internals import Layout as _Layout

    rng = np.random.default_rng(seed)
    worst, bounds, kinds = [], [], {"quota period": 0, "quota epoch": 0, "tree": 0}
    for _ in range(mixtures):
        n, kind = int(rng.integers(2, 41)), rng.random()
        if kind < 0.3:
            w = rng.random(n)
        elif kind < 0.6:
            w = rng.random(n) ** 6 + 1e-12
        else:
            w = rng.choice([1.0, 1.0, 1.0, 2.0, 10.0, 1e-3], n)
        lay = _Layout.build([1] * n, w.tolist(), epoch or positions)
        kinds[
            {"quota": "quota period", "quota-epoch": "quota epoch"}.get(lay.shape.split(":")[0], "tree")
        ] += 1
        src, _ = lay.locate(np.arange(positions, dtype=np.int64))
        prefix = np.arange(1, positions + 1)
        worst.append(
            max(float(np.abs(np.cumsum(src == s) - lay.weights[s] * prefix).max()) for s in range(n))
        )
        bounds.append(float(lay.bounds.max()))
    a, b = np.asarray(worst), np.asarray(bounds)
    print(
        f"{mixtures} random mixtures of 2-40 sources, the first {positions:,} positions of an "
        f"epoch of {epoch or positions:,}: worst prefix error {a.max():.3f} (median "
        f"{np.median(a):.3f}), {np.mean(a > 1):.0%} above 1; proven bound up to {b.max():.3f}, "
        f"{np.mean(b > 1):.0%} above 1; schedules: {kinds}"
    )


def throughput(loader: gl.StatefulDataLoader[Any, Any], batches: int) -> float:
    """Samples per second over ``batches`` batches of the loader's next iterator (inline)."""
    it = iter(loader)
    try:
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batches * B / (time.perf_counter() - t0)
    finally:
        it.close()


def _opened(loader: gl.StatefulDataLoader[Any, Any]) -> gl.StatefulDataLoader[Any, Any]:
    loader.open()
    return loader


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    main()
