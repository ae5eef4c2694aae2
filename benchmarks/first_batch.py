"""Time to first batch over object storage, traced request by request.

For the default order (a global row shuffle) and ``shuffle_block_size="auto"``, on moto S3 (its
own process) and on nginx behind the 20 ms loopback proxy, one fresh process per measurement
prints every store call from ``open_stream(url)`` to the first batch in hand (manifest, listing,
range GETs: start and end in ms, object, bytes) and the time to the first batch. Beside them, in
the same run, a bare obstore range GET of one sample (4 KiB) and a boto3 one: on moto a range GET
costs a copy of its whole object, so those say how much of the first batch is the server's floor.

    python -m benchmarks first-batch                 # both servers, both orders, 3 rounds
    python -m benchmarks first-batch --rounds 1 --trace   # and every request of each run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.remote_stream import BATCH, SEQ, collate, ensure_small_shards, moto_bucket, run_child  # noqa: E402

MiB = 2**20
MODES: dict[str, dict[str, Any]] = {"global (default)": {}, '"auto"': {"shuffle_block_size": "auto"}}


def _traced() -> tuple[list[tuple[str, float, float, str, int]], float]:
    """Wrap obstore's calls so each one is logged as (call, start, end, path, bytes)."""
    import obstore

    log: list[tuple[str, float, float, str, int]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def wrap(name: str) -> None:
        fn = getattr(obstore, name)

        def traced(store: Any, *args: Any, **kw: Any) -> Any:
            s = time.perf_counter()
            out = fn(store, *args, **kw)
            e = time.perf_counter()
            path = str(args[0]) if args else ""
            if name == "get_range":
                n = kw["end"] - kw["start"] if "end" in kw else kw.get("length", 0)
            elif name == "get_ranges":
                n = sum(b - a for a, b in zip(kw["starts"], kw["ends"], strict=True))
            else:
                n = 0
            with lock:
                log.append((name, s - t0, e - t0, path, n))
            return out

        setattr(obstore, name, traced)

    for name in ("get", "get_range", "get_ranges", "list", "head"):
        wrap(name)
    return log, t0


def child_first(url: str, options: dict[str, Any], loader_options: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.zeros(1)
    import guideloom as gl
    from guideloom import StatefulDataLoader

    log, t0 = _traced()
    marks: dict[str, float] = {}
    storage = gl.open_stream(url, **options)
    marks["open_stream"] = time.perf_counter() - t0
    loader = StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=SEQ,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=0,
        device="cpu",
        prefetch=16,
        **loader_options,
    )
    with loader:
        marks["loader.open"] = time.perf_counter() - t0
        for _ in loader:
            marks["first batch"] = time.perf_counter() - t0
            break
    return {
        "marks": marks,
        "log": sorted(log, key=lambda r: r[1]),
    }


def child_bare(endpoint_or_url: str, options: dict[str, Any], path: str, count: int) -> dict[str, Any]:
    """Bare range GETs of one sample's size: obstore (sync, one at a time, then ``count`` at
    once on threads) and, on S3, boto3; ms each."""
    import obstore

    from benchmarks._internals import make_store, parse_location, split_options

    loc = parse_location(endpoint_or_url)
    opts, _w, config, client = split_options(dict(options), write=False)
    store = make_store(loc, config, client, opts.policy, obstore_retries=False)
    n = SEQ * 2
    out: dict[str, Any] = {}
    obstore.get_range(store, path, start=0, length=n)  # the connection
    times = []
    for i in range(5):
        s = time.perf_counter()
        obstore.get_range(store, path, start=(i + 1) * 5 * MiB, length=n)
        times.append(time.perf_counter() - s)
    out["obstore_ms"] = statistics.median(times) * 1000
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        s = time.perf_counter()
        list(pool.map(lambda i: obstore.get_range(store, path, start=i * MiB, length=n), range(count)))
        out[f"obstore_{count}_at_once_ms"] = (time.perf_counter() - s) * 1000
        # The server's ceiling for "auto"'s reads: 4 MiB range GETs, ``count`` in flight.
        block, reps = 4 * MiB, 4 * count
        s = time.perf_counter()
        list(
            pool.map(
                lambda i: obstore.get_range(store, path, start=(i % 7) * block, length=block), range(reps)
            )
        )
        rate = reps * block / (time.perf_counter() - s)
        out["obstore_4MiB_GETs_MiB_per_s"] = rate / MiB
        out["as_samples_per_s"] = rate / n
    if loc.kind == "s3":
        import boto3

        c = boto3.client(
            "s3",
            endpoint_url=options["endpoint"],
            aws_access_key_id=options["access_key_id"],
            aws_secret_access_key=options["secret_access_key"],
            region_name=options["region"],
        )
        bucket, key = loc.display[len("s3://") :].split("/", 1)
        c.get_object(Bucket=bucket, Key=f"{key}/{path}", Range=f"bytes=0-{n - 1}")["Body"].read()
        times = []
        for i in range(5):
            s = time.perf_counter()
            rng = f"bytes={(i + 1) * 5 * MiB}-{(i + 1) * 5 * MiB + n - 1}"
            c.get_object(Bucket=bucket, Key=f"{key}/{path}", Range=rng)["Body"].read()
            times.append(time.perf_counter() - s)
        out["boto3_ms"] = statistics.median(times) * 1000
    return out


def _child_main(spec: str) -> None:
    kind, *args = json.loads(spec)
    fn = {"first": child_first, "bare": child_bare}[kind]
    print(json.dumps(fn(*args)), flush=True)
    os._exit(0)


def _print_trace(r: dict[str, Any]) -> None:
    for name, s, e, path, n in r["log"]:
        print(f"      {s * 1000:7.1f} -> {e * 1000:7.1f} ms  {name:<10} {path:<28} {n:>9} B", flush=True)
    print("      " + "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in r["marks"].items()), flush=True)


def _measure(server: str, url: str, options: dict[str, Any], path: str, args: argparse.Namespace) -> None:
    firsts: dict[str, list[float]] = {m: [] for m in MODES}
    bare: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for label, lo in MODES.items():
            r = run_child("first", url, options, lo, script=__file__)
            firsts[label].append(r["marks"]["first batch"])
            gets = [row for row in r["log"] if row[0].startswith("get_range")]
            print(
                f"  {server:<12} {label:<17} first batch {r['marks']['first batch'] * 1000:6.0f} ms "
                f"(open_stream {r['marks']['open_stream'] * 1000:.0f} ms, loader.open "
                f"{r['marks']['loader.open'] * 1000:.0f} ms; {len(gets)} range calls before it)",
                flush=True,
            )
            if args.trace:
                _print_trace(r)
        b = run_child("bare", url, options, path, BATCH, script=__file__)
        bare.append(b)
        print(
            f"  {server:<12} bare range GETs (one of {SEQ * 2} B alone, {BATCH} at once; 4 MiB ones): "
            + ", ".join(f"{k} {v:.1f}" for k, v in b.items())
        )
    for label, xs in firsts.items():
        print(
            f"  {server:<12} {label:<17} median first batch {statistics.median(xs) * 1000:.0f} ms", flush=True
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="print every store call of each run")
    parser.add_argument("--rtt", type=float, default=0.020)
    parser.add_argument("--only", default="moto,nginx")
    args = parser.parse_args(argv)
    if args.child:
        _child_main(args.child)
        return
    from guideloom_dev.servers import Nginx, proxy_process

    data_root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data_root.mkdir(parents=True, exist_ok=True)
    folder = ensure_small_shards(data_root, 100_000_000, 32 * MiB)
    first_shard = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")[0]
    print(f"100M uint16 tokens, 32 MiB shards; L={SEQ}, B={BATCH}, shuffle, prefetch=16", flush=True)
    if "moto" in args.only:
        with moto_bucket(folder) as s3:
            _measure("moto S3", "s3://bench/gl", s3, first_shard, args)
    if "nginx" in args.only:
        nginx = Nginx(data_root)
        try:
            with proxy_process(nginx.port, delay=args.rtt / 2, lifetime=900) as pport:
                url = f"http://127.0.0.1:{pport}/{folder.name}"
                _measure(f"nginx+{args.rtt * 1000:.0f}ms", url, {}, first_shard, args)
        finally:
            nginx.stop()


if __name__ == "__main__":
    main()
