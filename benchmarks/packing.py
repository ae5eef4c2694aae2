"""Document packing: throughput against the plain stream loader, resume TTFB, layout build cost.

Workload: a local document dataset (uint16, lognormal lengths, mean about 600
tokens) and a local stream dataset holding the same tokens in the same order;
sequence_length=2048, local_batch_size=16, shuffle on, num_workers=0. The stream loader's
collate widens the tokens to int64; the packed loaders' collate does the same and also stacks
``position_ids`` and ``segment_ids`` (what document-masked attention needs). Configurations
alternate in rounds in one process and are reported as ratios to the stream loader of the same
round (this machine is shared and noisy).

- resume TTFB: a fresh loader over the (already laid out) packed dataset, ``load_state_dict`` at
  a random offset, time until the first batch is in hand; and the same in a fresh process, where
  open() also builds the layout.
- window: one read window of 112 rows (what the loader reads at a time here) read with
  ``read_many_sync`` and its 7 batches collated, without the loader around it.
- layout build: time and peak memory (tracemalloc: every numpy and Python allocation) of the
  layout of 10M documents, in a child process per mode, over a storage that serves the offsets
  from a memory-mapped file (the layout reads only offsets, as it does from a written dataset).

- Parquet order: ``pack(open_parquet(...))`` over files of 250-row row groups (the same
  lognormal lengths, uint16 lists), one shuffled epoch with ``shuffle_block_size="auto"`` (the
  packed sequences' row-group blocks) against the plain shuffle, each mode, alternating in
  rounds: row groups decoded in the epoch (counted by the storage; the length index's one pass
  at open left out) and sequences/s. ``max_decoded_bytes`` holds 24 row groups, above the
  default ``shuffle_window`` of 16 row groups.
- padding: the sequences best fit by ranges of row groups makes against one best fit over the
  whole dataset (layouts only, over the documents' offsets).

    python -m benchmarks.packing            # the full run (~3 minutes once the data exists)
    python -m benchmarks.packing --quick    # a smoke run
    python -m benchmarks.packing --only window   # one read window + its collates, no loader
    python -m benchmarks.packing --only parquet  # the row-group order over packed Parquet
    python -m benchmarks.packing --only padding  # best fit by ranges of row groups: padding
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import guideloom as gl
from benchmarks import summary

SEQ = 2048
BATCH = 16
ROOT = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))


def stream_collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def packed_collate(samples: gl.PackedRows) -> dict[str, torch.Tensor]:
    """Tokens widened to int64 as for the stream; position and segment ids as they come (int32:
    what RoPE tables, SDPA masks and flash-attn's cu_seqlens take). ``block`` is the batch's
    array of one key, without a copy or a call per sample."""
    return {
        "tokens": torch.from_numpy(samples.block("tokens").astype(np.int64)),
        "position_ids": torch.from_numpy(samples.block("position_ids")),
        "segment_ids": torch.from_numpy(samples.block("segment_ids")),
    }


def tokens_collate(samples: gl.PackedRows) -> torch.Tensor:
    """The stream's collate on the packed tokens alone: what packing costs without index arrays."""
    return torch.from_numpy(samples.block("tokens").astype(np.int64))


def lognormal_lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(mean=6.0, sigma=1.0, size=n)).astype(np.int64)  # mean ~665


def ensure_datasets(tokens: int) -> tuple[Path, Path]:
    """A document dataset of about ``tokens`` tokens and a stream of the same tokens."""
    docs_path, stream_path = ROOT / f"pack-docs-u16-{tokens}", ROOT / f"pack-stream-u16-{tokens}"
    if not (docs_path / "manifest.json").exists() or not (stream_path / "manifest.json").exists():
        print(f"writing {tokens:,} tokens as documents and as a stream under {ROOT} ...", flush=True)
        lengths = lognormal_lengths(tokens // 600, 0)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
        data = np.random.default_rng(1).integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        gl.write_documents(
            docs_path, (data[a:b] for a, b in itertools.pairwise(bounds.tolist())), overwrite=True
        )
        gl.write_stream(stream_path, data, overwrite=True)
    return docs_path, stream_path


def batches_of(loader: gl.StatefulDataLoader[Any, Any]) -> Any:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def rate(loader: gl.StatefulDataLoader[Any, Any], batches: int) -> float:
    """Samples per second over ``batches`` batches after 20 warm-up batches."""
    with loader:
        it = batches_of(loader)
        for _ in range(20):
            next(it)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        elapsed = time.perf_counter() - t0
        it.close()
    return batches * BATCH / elapsed


def throughput(docs_path: Path, stream_path: Path, rounds: int, batches: int) -> dict[str, Any]:
    cpu = torch.device("cpu")
    opts: dict[str, Any] = {"local_batch_size": BATCH, "shuffle": True, "shuffle_seed": 7, "device": cpu}
    packed = {mode: gl.pack(gl.open_documents(docs_path), SEQ, mode) for mode in ("concat", "best_fit")}
    for ds in packed.values():
        asyncio.run(ds.open())  # the layout, once (resume and build are measured below)
    stream = gl.open_stream(stream_path)
    samples: dict[str, list[float]] = {
        k: [] for k in ("stream", "concat", "best_fit", "concat tokens only", "best_fit tokens only")
    }
    for _ in range(rounds):
        samples["stream"].append(
            rate(
                gl.StatefulDataLoader.from_storage(stream, stream_collate, sequence_length=SEQ, **opts),
                batches,
            )
        )
        for mode, ds in packed.items():
            samples[mode].append(rate(gl.StatefulDataLoader(ds, packed_collate, **opts), batches))
            samples[f"{mode} tokens only"].append(
                rate(gl.StatefulDataLoader(ds, tokens_collate, **opts), batches)
            )
    ratios = {
        k: statistics.median(p / s for p, s in zip(v, samples["stream"], strict=True))
        for k, v in samples.items()
        if k != "stream"
    }
    fill = {}
    for mode, ds in packed.items():
        asyncio.run(ds.open())  # the loaders closed it
        got = ds.read_many_sync(np.arange(min(len(ds), 4096), dtype=np.int64))
        fill[mode] = float(np.mean([np.count_nonzero(s["segment_ids"]) / SEQ for s in got]))
    return {
        "samples_per_s": {k: statistics.median(v) for k, v in samples.items()},
        "ratio_to_stream": ratios,
        "token_fill": fill,
        "sequences": {mode: len(ds) for mode, ds in packed.items()},
        "documents": len(gl.open_documents(docs_path)),
    }


def window_costs(docs_path: Path, stream_path: Path, rounds: int, windows: int) -> dict[str, Any]:
    """Microseconds to read one window of 112 rows (7 batches) with ``read_many_sync`` and
    collate its 7 batches, without the loader around it: the median of ``windows`` windows per
    round, rounds alternating the configurations; ratios to the stream's window."""
    rows = 7 * BATCH
    rng = np.random.default_rng(0)
    stream = gl.open_stream(stream_path)
    asyncio.run(stream.open())
    nrows = len(stream) // SEQ
    packed = {mode: gl.pack(gl.open_documents(docs_path), SEQ, mode) for mode in ("concat", "best_fit")}
    for ds in packed.values():
        asyncio.run(ds.open())

    def median_us(read: Any, collate: Any, picks: list[np.ndarray]) -> float:
        times = []
        for i in range(windows):
            t0 = time.perf_counter()
            got = read(picks[i % len(picks)])
            for b in range(0, rows, BATCH):
                collate(got[b : b + BATCH])
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    stream_picks = [rng.permutation(nrows)[:rows].astype(np.int64) * SEQ for _ in range(64)]
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        samples.setdefault("stream", []).append(
            median_us(lambda s: stream.read_many_sync(s, SEQ), stream_collate, stream_picks)
        )
        for mode, ds in packed.items():
            picks = [rng.permutation(len(ds))[:rows].astype(np.int64) for _ in range(64)]
            samples.setdefault(mode, []).append(median_us(ds.read_many_sync, packed_collate, picks))
            samples.setdefault(f"{mode} tokens only", []).append(
                median_us(ds.read_many_sync, tokens_collate, picks)
            )
    us = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "us_per_window": us,
        "ratio_to_stream": {k: us["stream"] / v for k, v in us.items() if k != "stream"},
    }


def resume_ttfb(docs_path: Path, trials: int) -> dict[str, Any]:
    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    rng = random.Random(3)
    for mode in ("concat", "best_fit"):
        ds = gl.pack(gl.open_documents(docs_path), SEQ, mode)
        asyncio.run(ds.open())
        with gl.StatefulDataLoader(
            ds, packed_collate, local_batch_size=BATCH, shuffle=True, shuffle_seed=7, device=cpu
        ) as first:
            saved = first.state_dict()  # a checkpoint, with its fingerprint, to resume from
        times = []
        for _ in range(trials):
            offset = rng.randrange(len(ds) - BATCH)
            loader = gl.StatefulDataLoader(
                ds, packed_collate, local_batch_size=BATCH, shuffle=True, shuffle_seed=7, device=cpu
            )
            state = {**saved, "epoch": 3, "observation_offset": offset}
            t0 = time.perf_counter()
            with loader:
                loader.load_state_dict(state)
                it = iter(loader)
                next(it)
                times.append(time.perf_counter() - t0)
                it.close()
        out[mode] = {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times)}
        code = (
            "import time, torch, guideloom as gl, sys\n"
            "t0 = time.perf_counter()\n"
            f"ds = gl.pack(gl.open_documents({str(docs_path)!r}), {SEQ}, {mode!r})\n"
            "from benchmarks.packing import packed_collate\n"
            f"loader = gl.StatefulDataLoader(ds, packed_collate, local_batch_size={BATCH}, shuffle=True, "
            "shuffle_seed=7, device=torch.device('cpu'))\n"
            "with loader:\n"
            f"    state = {{**{saved!r}, 'epoch': 3, 'observation_offset': len(ds) // 2 + 5}}\n"
            "    loader.load_state_dict(state)\n"
            "    it = iter(loader); next(it); print(1e3 * (time.perf_counter() - t0)); it.close()\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parents[1],
        )
        out[mode]["fresh_process_ms"] = float(proc.stdout.strip().splitlines()[-1])
    return out


class MappedOffsets(gl.DocumentStorageAbstract[Any, np.ndarray]):
    """Offsets of documents from a memory-mapped .npy file: all a pack layout reads."""

    blocking_calls_are_cheap = True

    def __init__(self, path: Path) -> None:
        self.offsets = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(np.uint16)

    def document_offsets_sync(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(self.offsets[positions], dtype=np.int64)


def build_child(path: str, mode: str, traced: str) -> None:
    """In a child process: build one layout, print its time (untraced) or its peak memory
    (traced with tracemalloc, which slows the build) as JSON."""
    storage = MappedOffsets(Path(path))
    ds = gl.pack(storage, SEQ, mode)  # type: ignore[arg-type]
    if traced == "traced":
        tracemalloc.start()
    t0 = time.perf_counter()
    asyncio.run(ds.open())
    elapsed = time.perf_counter() - t0
    if traced == "traced":
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(json.dumps({"peak_mib": peak / 2**20}))
        return
    print(json.dumps({"seconds": elapsed, "layout_mib": ds.layout_nbytes() / 2**20, "sequences": len(ds)}))


def layout_build(documents: int) -> dict[str, Any]:
    path = ROOT / f"pack-offsets-{documents}.npy"
    if not path.exists():
        ROOT.mkdir(parents=True, exist_ok=True)
        offsets = np.zeros(documents + 1, dtype=np.int64)
        np.cumsum(lognormal_lengths(documents, 5), out=offsets[1:])
        np.save(path, offsets)
    out: dict[str, Any] = {"documents": documents, "offsets_mib": path.stat().st_size / 2**20}
    for mode in ("concat", "best_fit"):
        out[mode] = {}
        for traced in ("timed", "traced"):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.packing", "--build-child", str(path), mode, traced],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).parents[1],
            )
            out[mode].update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


PARQUET_ROWS_PER_GROUP = 250


def ensure_parquet(documents: int) -> Path:
    """Parquet files (4) of ``documents`` rows of uint16 token lists, lognormal lengths, in row
    groups of 250 rows, written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = ROOT / f"pack-parquet-{documents}-{PARQUET_ROWS_PER_GROUP}"
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    lengths = lognormal_lengths(documents, 11)
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    for f, rows in enumerate(np.array_split(np.arange(documents), 4)):
        a, b = int(rows[0]), int(rows[-1]) + 1
        values = pa.array(tokens[offsets[a] : offsets[b]], pa.uint16())
        lists = pa.ListArray.from_arrays(pa.array(offsets[a : b + 1] - offsets[a], pa.int32()), values)
        table = pa.table({"input_ids": lists})
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=PARQUET_ROWS_PER_GROUP)
    (folder / "done").touch()
    return folder


def parquet_epoch(folder: Path, mode: Literal["concat", "best_fit"], auto: bool) -> dict[str, float]:
    """One shuffled epoch of ``pack(open_parquet(folder), SEQ, mode)``: row groups decoded and
    sequences/s (after open, which builds the length index and the layout)."""
    storage = gl.open_parquet(folder, "input_ids")
    group_bytes = int(storage.sample_nbytes_hint()) * PARQUET_ROWS_PER_GROUP
    storage.max_decoded_bytes = 24 * group_bytes  # a window of 16 row groups fits, not the files
    packed = gl.pack(storage, SEQ, mode)
    loader = gl.StatefulDataLoader(
        packed,
        tokens_collate,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=5,
        shuffle_block_size="auto" if auto else None,
        device=torch.device("cpu"),
        drop_last=False,
    )
    with loader:
        before = loader.stats()["parquet_row_group_decodes"]
        t0 = time.perf_counter()
        sequences = sum(len(batch) for batch in loader)
        elapsed = time.perf_counter() - t0
        decodes = loader.stats()["parquet_row_group_decodes"] - before
    return {
        "sequences": sequences,
        "row_groups": storage.num_row_groups,
        "decodes": decodes,
        "decodes_per_row_group": decodes / storage.num_row_groups,
        "sequences_per_s": sequences / elapsed,
    }


def fit_padding(documents: int) -> dict[str, Any]:
    """Sequences best fit makes by ranges of row groups, against one best fit over the whole
    dataset (what the ranges cost in padding), for ``documents`` documents of lognormal
    lengths (sigma 1; medians 300 and 1,000 tokens) in row groups of 100 and 1,000 rows,
    ``sequence_length=2048``: each row group on its own, and ranges of ``fit_group`` 64 and 256."""
    from benchmarks._internals import best_fit_layout

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for median in (300, 1000):
        lengths = np.maximum(1, rng.lognormal(np.log(median), 1.0, documents)).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        whole = len(best_fit_layout(lengths, starts, SEQ))
        row: dict[str, Any] = {
            "mean_length": float(lengths.mean()),
            "global_padding": 1 - float(lengths.sum()) / (whole * SEQ),
        }
        for rows in (100, 1000):
            blocks = MemoryBlocks(lengths, rows)
            for fit_group in (1, 64, 256):
                packed = gl.pack(blocks, SEQ, "best_fit", fit_group=fit_group)  # type: ignore[arg-type]
                asyncio.run(packed.open())
                row[f"rows{rows}_group{fit_group}_extra"] = len(packed) / whole - 1
        out[f"median{median}"] = row
    return out


class MemoryBlocks(gl.DocumentStorageAbstract[Any, np.ndarray]):
    """Documents' offsets only (all a layout reads), in blocks of ``rows`` documents."""

    blocking_calls_are_cheap = True

    def __init__(self, lengths: np.ndarray, rows: int) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(np.uint16)

    def document_offsets_sync(self, positions: np.ndarray) -> np.ndarray:
        return self.offsets[positions]

    def natural_blocks(self) -> np.ndarray:
        n = len(self)
        sizes = np.full(n // self.rows, self.rows, np.int64)
        return sizes if n % self.rows == 0 else np.append(sizes, n % self.rows)


def parquet_order(documents: int, rounds: int) -> dict[str, Any]:
    """The row-group order against the plain shuffle over packed Parquet, in alternating rounds
    (decodes are the same each round; sequences/s are medians, with their ratio per round)."""
    folder = ensure_parquet(documents)
    out: dict[str, Any] = {"documents": documents, "load_before": os.getloadavg()[0]}
    modes: tuple[Literal["concat", "best_fit"], ...] = ("concat", "best_fit")
    for mode in modes:
        runs: dict[str, list[dict[str, float]]] = {"auto": [], "plain": []}
        for _ in range(rounds):
            runs["auto"].append(parquet_epoch(folder, mode, True))
            runs["plain"].append(parquet_epoch(folder, mode, False))
        ratios = [a["sequences_per_s"] / p["sequences_per_s"] for a, p in zip(*runs.values(), strict=True)]
        out[mode] = {
            order: {
                **{k: v for k, v in got[-1].items() if k != "sequences_per_s"},
                "sequences_per_s": statistics.median(r["sequences_per_s"] for r in got),
            }
            for order, got in runs.items()
        }
        out[mode]["auto_speedup"] = statistics.median(ratios)
    out["load_after"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=summary(__doc__))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=None, help="tokens in the throughput datasets")
    ap.add_argument("--documents", type=int, default=None, help="documents in the layout-build measurement")
    ap.add_argument(
        "--only",
        default="throughput,resume,build,parquet,padding",
        help="parts to run (throughput,resume,build,window,parquet,padding)",
    )
    ap.add_argument("--build-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.build_child:
        build_child(*args.build_child)
        return
    tokens = args.tokens or (4_000_000 if args.quick else 40_000_000)
    documents = args.documents or (1_000_000 if args.quick else 10_000_000)
    rounds, batches = (1, 200) if args.quick else (5, 1500)
    parts = set(args.only.split(","))
    if parts & {"throughput", "window", "resume"}:
        docs_path, stream_path = ensure_datasets(tokens)
    result: dict[str, Any] = {}
    if "throughput" in parts:
        result["throughput"] = throughput(docs_path, stream_path, rounds, batches)
    if "window" in parts:
        result["window"] = window_costs(docs_path, stream_path, rounds, 100 if args.quick else 400)
    if "resume" in parts:
        result["resume"] = resume_ttfb(docs_path, 5 if args.quick else 20)
    if "build" in parts:
        result["layout_build"] = layout_build(documents)
    if "padding" in parts:
        result["fit_padding"] = fit_padding(20_000 if args.quick else 200_000)
    if "parquet" in parts:
        result["parquet_order"] = parquet_order(20_000 if args.quick else 100_000, 1 if args.quick else 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
