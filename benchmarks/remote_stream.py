"""Remote stream throughput: guideloom over HTTP at 20 ms round trip, against its ceiling.

Workload: a uint16 stream of 256 MiB served by nginx on 127.0.0.1, behind a loopback
proxy that adds 10 ms each way (20 ms round trip), ``sequence_length=2048`` (4 KiB samples),
``local_batch_size=16``, shuffle on. In one run it measures

  (a) guideloom's samples/s, sync (``for``) and async (``async for``), and its time to first
      batch (from ``open_stream(url)`` to the first batch in hand);
  (b) the ceiling: a bare loop of concurrent obstore range reads (``get_range_async`` under a
      semaphore) of the same samples through the same proxy, at the best concurrency of a sweep;
  (c) a loader that reads one sample at a time synchronously (``obstore.get_range`` in a loop);
  (d) peak memory (max RSS of the reading process) of guideloom over the 256 MiB stream and over
      one twice as large, to show it is set by the in-flight limits, not by the data.

Each measurement runs in its own child process (a fresh interpreter, its own max RSS). The proxy
runs in a process of its own so it does not compete with the reader for the GIL; on a 2-core
machine nginx, the proxy and the reader still share the CPUs, so treat the figures as ratios.

    python -m benchmarks remote            # full run (about 2 minutes once data exists)
    python -m benchmarks remote --quick    # a smaller smoke run
    python -m benchmarks remote --economy  # global shuffle vs shuffle_block_size="auto" on moto
                                           # S3 and nginx at 20 ms: samples/s, GETs, bytes, $/epoch
    python -m benchmarks remote --bytes    # bytes fetched per epoch / the dataset's bytes with
                                           # "auto" on moto S3: batch 8 and 32, 32 and 96 MiB,
                                           # epochs 1 and 2 (sync, async, thread workers)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import guideloom as gl  # noqa: E402

SEQ = 2048
BATCH = 16
ITEM = 2  # uint16
SEED = 0
MiB = 2**20


def collate(samples: Sequence[np.ndarray]) -> Any:
    import torch

    return torch.from_numpy(np.stack(samples).astype(np.int64))


def ensure_dataset(root: Path, nbytes: int) -> Path:
    path = root / f"u16-{nbytes // MiB}MiB"
    if not (path / "manifest.json").exists():
        print(f"writing a {nbytes // MiB} MiB uint16 stream to {path} ...", flush=True)
        rng = np.random.default_rng(0)
        tokens = nbytes // ITEM
        chunk = 8 * MiB

        def chunks() -> Any:
            for start in range(0, tokens, chunk):
                yield rng.integers(0, 50_000, min(chunk, tokens - start), dtype=np.uint16)

        gl.write_stream(path, chunks(), dtype=np.uint16, overwrite=True)
    return path


def sample_starts(num_samples: int, count: int) -> np.ndarray:
    """The byte offsets of the first ``count`` samples of the loader's shuffled epoch 0."""
    from benchmarks._internals import Permutation

    order = Permutation(num_samples, shuffle=True, seed=SEED, epoch=0)
    return order.take(np.arange(count, dtype=np.int64)) * (SEQ * ITEM)


# -- child processes ---------------------------------------------------------------------------------
def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_loader(
    url: str,
    batches: int,
    mode: str,
    options: dict[str, Any],
    loader_options: dict[str, Any] | None = None,
    max_s: float = 1e9,
) -> dict[str, Any]:
    import torch  # a training script has torch loaded already: keep its import out of the timing

    from guideloom import StatefulDataLoader

    torch.zeros(1)
    base_rss = _maxrss_mib()
    t0 = time.perf_counter()
    storage = gl.open_stream(url, **options)
    loader = StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=SEQ,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=SEED,
        device="cpu",
        prefetch=4,
        **(loader_options or {}),
    )
    first = 0.0
    n = 0
    t1 = c1 = 0.0
    if mode == "sync":
        with loader:
            for _ in loader:
                n += 1
                if n == 1:
                    first = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    c1 = _cpu_s()
                if n == batches + 1 or time.perf_counter() - t0 > max_s:
                    break
        batches = n - 1
    else:

        async def run() -> None:
            nonlocal n, first, t1, c1
            async with loader:
                async for _ in loader:
                    n += 1
                    if n == 1:
                        first = time.perf_counter() - t0
                        t1 = time.perf_counter()
                        c1 = _cpu_s()
                    if n == batches + 1:
                        break

        t1 = c1 = 0.0
        asyncio.run(run())
    elapsed = time.perf_counter() - t1
    cpu = _cpu_s() - c1
    stats = storage.stats()
    figures = loader.stats()
    return {
        "batches": batches,
        "num_samples": len(loader.dataset),
        "shuffle_block_size": figures["shuffle_block_size"],
        "epoch_requests": figures.get("epoch_requests", 0),
        "epoch_bytes_read": figures.get("epoch_bytes_read", 0),
        "samples_read": (batches + 1) * BATCH,
        "samples_per_s": batches * BATCH / elapsed if elapsed > 0 else 0.0,
        "cpu_ms_per_1k": 1000 * cpu / (batches * BATCH / 1000),
        "first_batch_s": first,
        "maxrss_mib": _maxrss_mib(),
        "rss_growth_mib": _maxrss_mib() - base_rss,
        "peak_inflight_mib": stats["peak_inflight_bytes"] / MiB,
        "requests": stats["requests"],
    }


def child_ceiling(
    url: str, samples: int, num_samples: int, concurrency: int, per_call: int = 1
) -> dict[str, Any]:
    """``concurrency`` range requests in flight: single ``get_range_async`` calls (``per_call=1``)
    or ``get_ranges_async`` calls of ``per_call`` ranges each (obstore runs those concurrently)."""
    import obstore
    from obstore.store import HTTPStore

    store = HTTPStore(url, client_options={"allow_http": True, "timeout": "30s"})
    name = gl.open_stream(url).manifest.tokens.files[0].path
    starts = sample_starts(num_samples, samples + concurrency).tolist()

    async def run() -> float:
        sem = asyncio.Semaphore(max(1, concurrency // per_call))

        async def one(group: list[int]) -> None:
            async with sem:
                if per_call == 1:
                    bufs = [await obstore.get_range_async(store, name, start=group[0], length=SEQ * ITEM)]
                else:
                    bufs = await obstore.get_ranges_async(
                        store, name, starts=group, lengths=[SEQ * ITEM] * len(group), coalesce=0
                    )
                assert all(len(memoryview(b)) == SEQ * ITEM for b in bufs)

        def groups(xs: list[int]) -> list[list[int]]:
            return [xs[i : i + per_call] for i in range(0, len(xs), per_call)]

        await asyncio.gather(*(one(g) for g in groups(starts[:concurrency])))  # warm the pool
        t = time.perf_counter()
        cpu0.append(_cpu_s())
        await asyncio.gather(*(one(g) for g in groups(starts[concurrency:])))
        return time.perf_counter() - t

    cpu0: list[float] = []
    elapsed = asyncio.run(run())
    cpu = _cpu_s() - cpu0[0]
    return {
        "samples_per_s": samples / elapsed,
        "maxrss_mib": _maxrss_mib(),
        "cpu_ms_per_1k": 1000 * cpu / (samples / 1000),
    }


def child_naive(url: str, samples: int, num_samples: int) -> dict[str, Any]:
    import obstore
    from obstore.store import HTTPStore

    store = HTTPStore(url, client_options={"allow_http": True, "timeout": "30s"})
    name = gl.open_stream(url).manifest.tokens.files[0].path
    starts = sample_starts(num_samples, samples + 1).tolist()
    obstore.get_range(store, name, start=starts[0], length=SEQ * ITEM)
    t = time.perf_counter()
    for s in starts[1:]:
        np.frombuffer(memoryview(obstore.get_range(store, name, start=s, length=SEQ * ITEM)), np.uint16)
    return {"samples_per_s": samples / (time.perf_counter() - t), "maxrss_mib": _maxrss_mib()}


def run_child(*args: Any, script: str = __file__) -> dict[str, Any]:
    """Run ``script --child <args as JSON>`` in a fresh interpreter and return the JSON line it
    prints last (each measurement gets a process of its own: no warm caches, its own peak RSS)."""
    out = subprocess.run(
        [sys.executable, script, "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"child {args[0]} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def child_main(spec: str) -> None:
    kind, *args = json.loads(spec)
    fn = {"loader": child_loader, "ceiling": child_ceiling, "naive": child_naive, "bytes": child_bytes}[kind]
    print(json.dumps(fn(*args)), flush=True)
    sys.stdout.flush()
    # The bare ceiling uses obstore's *_async functions directly, which can abort the interpreter
    # at exit (the bug guideloom avoids); skip finalisation so the measurement is what counts.
    os._exit(0)


# -- request economy: shuffle_block_size "auto" against the global shuffle ---------------------------
GET_PRICE_PER_1000 = 0.0004
"""S3 Standard list price of GET requests, USD per 1,000 (us-east-1, as listed on 2026-12-03)."""


def economy_line(label: str, r: dict[str, Any]) -> str:
    """One line: speed, first batch, GETs and bytes, GETs per MiB, and the cost of an epoch."""
    samples = max(1, r["samples_read"])
    gets, nbytes = r["epoch_requests"], r["epoch_bytes_read"]
    per_epoch = gets / samples * r["num_samples"]
    return (
        f"  {label:<30} {r['samples_per_s']:8.0f} samples/s  "
        f"first batch {r['first_batch_s'] * 1000:5.0f} ms  "
        f"{gets:6d} GETs {nbytes / MiB:8.1f} MiB for {samples} samples "
        f"({gets / max(nbytes / MiB, 1e-9):.3f} GET/MiB)  "
        f"~{per_epoch:,.0f} GETs/epoch = ${per_epoch * GET_PRICE_PER_1000 / 1000:.4f}/epoch "
        f"(block {r['shuffle_block_size']})"
    )


@contextlib.contextmanager
def moto_bucket(folder: Path) -> Iterator[dict[str, Any]]:
    """A moto S3 server of its own on 127.0.0.1 holding ``folder`` at ``s3://bench/gl``; yields
    the storage options to read it with, and stops the server on leaving."""
    import boto3

    import guideloom_dev.servers
    from guideloom_dev.servers import free_port, wait_for_port

    port = free_port()
    # the project's wrapper of moto's server: a production server's listen backlog (see it)
    server = Path(guideloom_dev.servers.__file__).with_name("moto_server.py")
    moto = subprocess.Popen(
        [sys.executable, str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        creds = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
        client = boto3.client("s3", endpoint_url=endpoint, **creds)
        client.create_bucket(Bucket="bench")
        for f in sorted(folder.iterdir()):
            client.upload_file(str(f), "bench", f"gl/{f.name}")
        yield {
            "endpoint": endpoint,
            "access_key_id": "bench",
            "secret_access_key": "bench",
            "region": "us-east-1",
            "allow_http": True,
        }
    finally:
        moto.terminate()
        try:
            moto.wait(10)
        except subprocess.TimeoutExpired:  # starved of a core (a loaded machine, a low priority)
            moto.kill()
            moto.wait()


def ensure_small_shards(root: Path, tokens: int, shard_bytes: int) -> Path:
    """The suite's 100M-token stream, written with LitData-sized shards (32 MiB)."""
    path = root / f"u16-{tokens}-shards{shard_bytes // MiB}MiB"
    if not (path / "manifest.json").exists():
        print(f"writing {tokens:,} uint16 tokens to {path} ({shard_bytes // MiB} MiB shards) ...", flush=True)
        rng = np.random.default_rng(0)
        chunk = 8 * MiB

        def chunks() -> Any:
            for start in range(0, tokens, chunk):
                yield rng.integers(0, 50_000, min(chunk, tokens - start), dtype=np.uint16)

        gl.write_stream(path, chunks(), dtype=np.uint16, shard_bytes=shard_bytes, overwrite=True)
    return path


def run_economy(args: argparse.Namespace) -> None:
    """guideloom over moto S3 (its own process) and nginx behind the 20 ms proxy, global row
    shuffle (the default) and ``shuffle_block_size="auto"``, with GETs, bytes and cost."""

    from guideloom_dev.servers import Nginx, nginx_binary, proxy_process

    tokens = 20_000_000 if args.quick else 100_000_000
    batches = 200 if args.quick else 1600
    data_root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data_root.mkdir(parents=True, exist_ok=True)
    folder = ensure_small_shards(data_root, tokens, 32 * MiB)
    modes = {"global row shuffle (default)": {}, 'shuffle_block_size="auto"': {"shuffle_block_size": "auto"}}
    with moto_bucket(folder) as s3:
        print(
            f"{tokens:,} uint16 tokens, 32 MiB shards; sequence_length={SEQ}, local_batch_size={BATCH}, "
            f"shuffle on; {batches} batches or {args.max_s:.0f} s per run; GET ${GET_PRICE_PER_1000}/1000",
            flush=True,
        )
        print("moto S3 on 127.0.0.1 (moto_server, its own process):", flush=True)
        for label, lo in modes.items():
            r = run_child("loader", "s3://bench/gl", batches, "sync", s3, lo, args.max_s)
            print(economy_line(label, r), flush=True)
    if nginx_binary() is None:
        print("nginx is not installed: HTTP part skipped")
        return
    nginx = Nginx(data_root)
    try:
        with proxy_process(nginx.port, delay=args.rtt / 2, lifetime=900) as pport:
            url = f"http://127.0.0.1:{pport}/{folder.name}"
            print(f"nginx behind the loopback proxy at {args.rtt * 1000:.0f} ms round trip:", flush=True)
            for label, lo in modes.items():
                r = run_child("loader", url, batches, "sync", {}, lo, args.max_s)
                print(economy_line(label, r), flush=True)
    finally:
        nginx.stop()


BYTES_SEQ = 512  # 1 KiB samples: a 64 KiB integrity block holds 64


def child_bytes(url: str, options: dict[str, Any], batch: int, mode: str, epochs: int) -> dict[str, Any]:
    """Whole epochs with ``shuffle_block_size="auto"``: the bytes and GETs each fetched."""
    from guideloom import StatefulDataLoader

    storage = gl.open_stream(url, **options)
    workers = {"num_workers": 2} if mode == "threads" else {}
    loader = StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=BYTES_SEQ,
        local_batch_size=batch,
        shuffle=True,
        shuffle_seed=SEED,
        shuffle_block_size="auto",
        device="cpu",
        **workers,
    )
    out: list[dict[str, Any]] = []
    with loader:
        for _ in range(epochs):
            if mode == "async":

                async def run() -> int:
                    return sum([1 async for _ in loader])

                n = asyncio.run(run())
            else:
                n = sum(1 for _ in loader)
            figures = loader.stats()
            out.append(
                {"batches": n, "bytes": figures["epoch_bytes_read"], "requests": figures["epoch_requests"]}
            )
    from benchmarks._internals import held_blocks

    held = held_blocks(storage)  # verified blocks held for later reads of a window
    return {
        "epochs": out,
        "data_bytes": len(storage) * 2,
        "peak_held_bytes": held.peak_nbytes,
        "held_bound": storage.read_window_bytes,
    }


def run_bytes(args: argparse.Namespace) -> None:
    """Bytes fetched per epoch over moto S3 with ``shuffle_block_size="auto"``, as a share of
    the dataset's bytes (1.0: every byte once), with the GETs that fetched them, and the most
    bytes of verified blocks held at once for the later reads of a mixing window (its bound)."""
    data_root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data_root.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.bytes_mib.split(",")]
    modes = args.bytes_modes.split(",")
    print(
        f'shuffle_block_size="auto", sequence_length={BYTES_SEQ} (1 KiB samples), 1 MiB shards, '
        "64 KiB integrity blocks; bytes fetched per epoch / the dataset's bytes (GETs)",
        flush=True,
    )
    for mib in sizes:
        folder = ensure_small_shards(data_root, mib * MiB // ITEM, MiB)
        with moto_bucket(folder) as s3:
            for mode in modes:
                for batch in (8, 32):
                    r = run_child("bytes", "s3://bench/gl", s3, batch, mode, 2)
                    data = r["data_bytes"]
                    cells = "  ".join(
                        f"epoch {i + 1} {e['bytes'] / data:.4f}x ({e['requests']} GETs)"
                        for i, e in enumerate(r["epochs"])
                    )
                    held = f"peak held {r['peak_held_bytes'] / MiB:.1f} MiB of {r['held_bound'] // MiB} MiB"
                    print(f"  {mib:3d} MiB  {mode:<7} batch {batch:2d}: {cells}  {held}", flush=True)


# -- the run -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller data and shorter runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rtt", type=float, default=0.020, help="added round trip, seconds (0.020)")
    parser.add_argument(
        "--economy",
        action="store_true",
        help='global shuffle vs shuffle_block_size="auto" on moto S3 and nginx: speed, GETs, cost',
    )
    parser.add_argument("--max-s", type=float, default=60.0, help="--economy: seconds per run at most")
    parser.add_argument(
        "--bytes",
        action="store_true",
        help='bytes fetched per epoch / the dataset\'s with "auto" on moto S3 (batch 8 and 32, epochs 1-2)',
    )
    parser.add_argument("--bytes-mib", default="32,96", help="--bytes: dataset sizes in MiB (32,96)")
    parser.add_argument("--bytes-modes", default="sync", help="--bytes: sync,async,threads (sync)")
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child)
        return
    if args.economy:
        run_economy(args)
        return
    if args.bytes:
        run_bytes(args)
        return

    from guideloom_dev.servers import Nginx, nginx_binary, proxy_process

    if nginx_binary() is None:
        raise SystemExit("nginx is needed: run .ci/install-servers.sh")
    size = (64 if args.quick else 256) * MiB
    batches = 100 if args.quick else 2000
    data_root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data_root.mkdir(parents=True, exist_ok=True)
    small = ensure_dataset(data_root, size)
    large = ensure_dataset(data_root, 2 * size)
    num_samples = size // (SEQ * ITEM)
    nginx = Nginx(data_root)
    try:
        with proxy_process(nginx.port, delay=args.rtt / 2, lifetime=900) as port:
            base = f"http://127.0.0.1:{port}"
            url, url2 = f"{base}/{small.name}", f"{base}/{large.name}"
            print(
                f"stream {size // MiB} MiB uint16 via nginx + proxy at {args.rtt * 1000:.0f} ms round trip; "
                f"sequence_length={SEQ} ({SEQ * ITEM // 1024} KiB samples), local_batch_size={BATCH}, "
                "shuffle on",
                flush=True,
            )
            ceiling: dict[str, float] = {}
            for per_call in (1, 10):
                call = "get_range_async" if per_call == 1 else f"get_ranges_async x{per_call}"
                for k in (64, 128, 256, 512):
                    key = f"{call}, {k} in flight"
                    ceiling[key] = run_child("ceiling", url, batches * BATCH, num_samples, k, per_call)[
                        "samples_per_s"
                    ]
                    print(f"  (b) bare obstore {key:>32}: {ceiling[key]:8.0f} samples/s", flush=True)
            best_k = max(ceiling, key=lambda k: ceiling[k])
            per_call = 1 if best_k.startswith("get_range_async") else 10
            best_conc = int(best_k.split(", ")[1].split()[0])
            naive = run_child("naive", url, 100 if not args.quick else 40, num_samples)
            print(f"  (c) one sample at a time: {naive['samples_per_s']:8.0f} samples/s", flush=True)
            # The machine is shared and noisy: alternate rounds of (ceiling, sync, async) and compare
            # each loader with the ceiling of its own round.
            rounds: list[dict[str, Any]] = []
            for r in range(2):
                ceil = run_child("ceiling", url, batches * BATCH, num_samples, best_conc, per_call)
                sync = run_child("loader", url, batches, "sync", {})
                asy = run_child("loader", url, batches, "async", {})
                rounds.append({"ceiling": ceil, "sync": sync, "async": asy})
                print(
                    f"  round {r + 1}: (b) {ceil['samples_per_s']:6.0f}  "
                    f"(a) sync {sync['samples_per_s']:6.0f} "
                    f"[{sync['samples_per_s'] / ceil['samples_per_s']:.2f}x, first batch "
                    f"{sync['first_batch_s'] * 1000:.0f} ms]  (a) async {asy['samples_per_s']:6.0f} "
                    f"[{asy['samples_per_s'] / ceil['samples_per_s']:.2f}x, first batch "
                    f"{asy['first_batch_s'] * 1000:.0f} ms]   CPU ms per 1k samples: ceiling "
                    f"{ceil['cpu_ms_per_1k']:.0f}, sync {sync['cpu_ms_per_1k']:.0f}, "
                    f"async {asy['cpu_ms_per_1k']:.0f}",
                    flush=True,
                )
            mem1 = rounds[0]["sync"]
            mem2 = run_child("loader", url2, batches, "sync", {})
            print(
                f"  (d) max RSS {size // MiB} MiB stream: {mem1['maxrss_mib']:.0f} MiB "
                f"(+{mem1['rss_growth_mib']:.0f} while reading); {2 * size // MiB} MiB stream: "
                f"{mem2['maxrss_mib']:.0f} MiB (+{mem2['rss_growth_mib']:.0f}); peak bytes in flight "
                f"{mem1['peak_inflight_mib']:.1f} / {mem2['peak_inflight_mib']:.1f} MiB",
                flush=True,
            )
            print()
            print(f"ceiling (b): best of the sweep {ceiling[best_k]:.0f} samples/s ({best_k})")
            for name in ("sync", "async"):
                ratios = [rd[name]["samples_per_s"] / rd["ceiling"]["samples_per_s"] for rd in rounds]
                speed = max(rd[name]["samples_per_s"] for rd in rounds)
                first = max(rd[name]["first_batch_s"] for rd in rounds)
                print(
                    f"guideloom {name:5}: {max(ratios):4.2f} x ceiling in its round (rounds: "
                    f"{', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.8), "
                    f"{speed / naive['samples_per_s']:6.1f} x one-at-a-time (target >= 10), "
                    f"first batch <= {first * 1000:.0f} ms (target < 500)"
                )
            print(
                f"memory: max RSS {mem1['maxrss_mib']:.0f} MiB for {size // MiB} MiB of data, "
                f"{mem2['maxrss_mib']:.0f} MiB for {2 * size // MiB} MiB: ratio "
                f"{mem2['maxrss_mib'] / mem1['maxrss_mib']:.2f} (target ~1)"
            )
    finally:
        nginx.stop()


if __name__ == "__main__":
    main()
