"""Shuffle quality of chunk-aware orders against a global row shuffle.

    python benchmarks/shuffle_quality.py            # the table (N = 48,828, B = 16), a few seconds
    python benchmarks/shuffle_quality.py --timing   # also µs per position of a 16k-position take

For each order, over the first epoch's batches of ``B`` consecutive positions (measured against
the block grid of the row's block size; the global shuffle is measured against each grid):

- distinct blocks per batch (mean, 5th percentile);
- mean and median ``|i - j| / N`` between consecutive samples of a batch (a global shuffle: 1/3
  and about 0.29);
- the fraction of batches holding two samples of the same block;
- range requests per batch when each batch is read on its own: runs of adjacent sample indexes
  once the batch is sorted;
- whole-block GETs per batch when a reader keeps one window of blocks in memory (blocks / batches),
  and that window's bytes at 4 KiB per sample.
"""

from __future__ import annotations

import argparse
import functools
import sys
import timeit
from pathlib import Path

import numpy as np

from benchmarks import summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._internals import DEFAULT_WINDOW, BlockPermutation, Permutation, default_block_size

N = 48_828  # 100M tokens / 2048
B = 16
SAMPLE_BYTES = 4096  # 2048 uint16 tokens
BLOCKS = (8, 32, 128)
WINDOWS = (1, 4, 16, 64)


def metrics(order: np.ndarray, block: int, batch: int = B) -> dict[str, float]:
    """The quality figures of one epoch order on a block grid of ``block`` samples."""
    n = len(order)
    batches = order[: (n // batch) * batch].reshape(-1, batch)
    blocks = np.sort(batches // block, axis=1)
    distinct = 1 + (np.diff(blocks, axis=1) != 0).sum(axis=1)
    dist = np.abs(np.diff(batches, axis=1)).ravel() / n
    rows = np.sort(batches, axis=1)
    runs = 1 + (np.diff(rows, axis=1) != 1).sum(axis=1)
    return {
        "distinct_mean": float(distinct.mean()),
        "distinct_p5": float(np.percentile(distinct, 5)),
        "dist_mean": float(dist.mean()),
        "dist_median": float(np.median(dist)),
        "same_block": float(np.mean(distinct < batch)),
        "requests": float(runs.mean()),
    }


def table(seed: int = 0) -> str:
    default_block = default_block_size(SAMPLE_BYTES)
    lines = [
        f"N = {N:,}, B = {B}, seed {seed}, epoch 0; distances relative to N; "
        f"GETs and buffer: whole blocks of {SAMPLE_BYTES} B samples, one window held",
        "",
        "| order | block | window | distinct blocks/batch (mean, p5) | mean, median \\|i-j\\|/N "
        "| batches with a repeated block | range requests/batch | block GETs/batch | window buffer |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    glob = Permutation(N, shuffle=True, seed=seed, epoch=0).range(0, N)
    batches = N // B
    for block in (*BLOCKS, default_block):
        m = metrics(glob, block)
        lines.append(_row("global", block, "-", m, "-", "-"))
        for window in sorted({*WINDOWS, DEFAULT_WINDOW}):
            order = BlockPermutation(N, seed=seed, epoch=0, block_size=block, window=window).range(0, N)
            m = metrics(order, block)
            gets = -(-N // block) / batches
            buffer = min(window * block, N) * SAMPLE_BYTES / 2**20
            lines.append(_row("blocks", block, str(window), m, f"{gets:.3f}", f"{buffer:.2f} MiB"))
    return "\n".join(lines)


def _row(name: str, block: int, window: str, m: dict[str, float], gets: str, buffer: str) -> str:
    return (
        f"| {name} | {block} | {window} | {m['distinct_mean']:.2f}, {m['distinct_p5']:.0f} "
        f"| {m['dist_mean']:.3f}, {m['dist_median']:.3f} | {m['same_block']:.3f} | {m['requests']:.2f} "
        f"| {gets} | {buffer} |"
    )


def timing() -> str:
    """µs per position of one 16k-position take, BlockPermutation vs Permutation (best of 5)."""
    n = 10_000_003
    positions = np.arange(n // 2, n // 2 + 16_384, dtype=np.int64)
    rows = ["| order | µs per call | ns per position |", "| --- | ---: | ---: |"]
    cases: list[tuple[str, Permutation | BlockPermutation]] = [
        ("Permutation (global)", Permutation(n, shuffle=True, seed=1, epoch=0))
    ]
    for block, window in ((8, 16), (128, 16), (1024, 16), (1000, 16)):
        blocks = BlockPermutation(n, seed=1, epoch=0, block_size=block, window=window)
        cases.append((f"BlockPermutation block {block}, window {window}", blocks))
    for name, perm in cases:
        best = min(timeit.repeat(functools.partial(perm.take, positions), number=20, repeat=5)) / 20
        rows.append(f"| {name} | {best * 1e6:.0f} | {best / len(positions) * 1e9:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", action="store_true", help="also time a 16k-position take")
    args = ap.parse_args(argv)
    print(table(args.seed))
    if args.timing:
        print()
        print(timing())


if __name__ == "__main__":
    main()
