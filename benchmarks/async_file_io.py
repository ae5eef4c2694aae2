"""Async reads of a local file: one thread hop per read window (what guideloom does) against
aiofiles (one thread hop per read call), for the reads guideloom makes from async code: a window
of ranges of a data file, and a whole small file (a manifest).

    python -m benchmarks async-file-io [--ranges 64] [--range-bytes 65536] [--rounds 5]

Prints the median time per window of each way, and their ratio, measured in one run. aiofiles is
a benchmark requirement only (``pip install aiofiles``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio.to_thread
import numpy as np

from benchmarks import summary


def _preads(path: Path, offsets: list[int], size: int) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [os.pread(fd, size, off) for off in offsets]
    finally:
        os.close(fd)


async def window_one_hop(path: Path, offsets: list[int], size: int) -> list[bytes]:
    """guideloom's way: the whole window's reads in one call on a worker thread."""
    return await anyio.to_thread.run_sync(_preads, path, offsets, size)


async def window_aiofiles(path: Path, offsets: list[int], size: int) -> list[bytes]:
    import aiofiles

    out = []
    async with aiofiles.open(path, "rb") as f:
        for off in offsets:
            await f.seek(off)
            out.append(await f.read(size))
    return out


async def manifest_one_hop(path: Path) -> bytes:
    return await anyio.to_thread.run_sync(path.read_bytes)


async def manifest_aiofiles(path: Path) -> bytes:
    import aiofiles

    async with aiofiles.open(path, "rb") as f:
        data: bytes = await f.read()
    return data


async def _time(call: Callable[[], Awaitable[object]], repeat: int) -> float:
    await call()  # warm-up: the thread pool, the page cache
    t0 = time.perf_counter()
    for _ in range(repeat):
        await call()
    return (time.perf_counter() - t0) / repeat


async def main_async(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shard.bin"
        data.write_bytes(rng.integers(0, 256, 256 * 2**20, dtype=np.uint8).tobytes())
        manifest = Path(tmp) / "manifest.json"
        manifest.write_bytes(b'{"kind": "stream"}' + b" " * 16_000)
        limit = 256 * 2**20 - args.range_bytes
        rows = []
        for name, ours, theirs in (
            ("window", window_one_hop, window_aiofiles),
            ("manifest", manifest_one_hop, manifest_aiofiles),
        ):
            a, b = [], []
            for _ in range(args.rounds):  # interleaved: a drift in speed weighs on both
                offsets = sorted(rng.integers(0, limit, args.ranges).tolist())
                if name == "window":
                    a.append(await _time(functools.partial(ours, data, offsets, args.range_bytes), 20))
                    b.append(await _time(functools.partial(theirs, data, offsets, args.range_bytes), 20))
                else:
                    a.append(await _time(functools.partial(ours, manifest), 200))
                    b.append(await _time(functools.partial(theirs, manifest), 200))
            rows.append((name, statistics.median(a), statistics.median(b)))
    print(f"{'read':<10}{'one hop (us)':>14}{'aiofiles (us)':>15}{'aiofiles / one hop':>20}")
    for name, a, b in rows:
        print(f"{name:<10}{a * 1e6:>14.1f}{b * 1e6:>15.1f}{b / a:>20.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--ranges", type=int, default=64, help="ranges per window (default 64)")
    p.add_argument("--range-bytes", type=int, default=65536, help="bytes per range (default 64 KiB)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each, interleaved (default 5)")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
