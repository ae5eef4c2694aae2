"""The local cache of a remote stream: a byte-limited chunk cache against the whole copy and local files.

Workload: a uint16 stream (256 MiB, 32 MiB objects) served by nginx on 127.0.0.1
behind the loopback proxy at 20 ms round trip, ``sequence_length=2048`` (4 KiB samples),
``local_batch_size=16``, ``prefetch=8``. Each measurement is one fresh child process with a cold
cache folder, over two whole epochs; in one run, so the ratios compare like with like:

  (a) local files: the same dataset opened from its folder (the ceiling of a complete cache);
  (b) ``cache_dir`` without a limit (the whole copy, downloaded in the background);
  (c) ``cache_dir`` with ``cache_max_bytes`` = 25% of the dataset (the chunk cache): samples/s
      per epoch, first batch, the peak size of the cache folder (sampled every 2 ms), chunks
      downloaded and evicted, GETs;
  (c') no cache at all (``open_stream(url)``): what the chunk cache must not fall below;
  (d) exact resume over (c): 40% of an epoch, a checkpoint, a fresh process with another batch
      size, and the rest: the rows equal those of an uninterrupted local run.

The whole copy's first epoch is printed beside the no-cache run's (samples/s and their ratio,
target >= 0.9): the copy serves the loader's reads of the parts it has fetched, so a cold cache
must cost the first epoch little.

Orders: ``--order sequential`` (no shuffle) and ``--order global`` (the global row shuffle) by
default; ``block`` is the chunk-aware shuffle in 4 MiB blocks (what ``shuffle_block_size="auto"``
picks over object storage), given explicitly so that local files read the same order.
``--server s3`` reads the same dataset from a moto S3 server of its own (on 127.0.0.1, no added
round trip) instead of nginx behind the proxy.

    python -m benchmarks remote-cache            # about 3 minutes once the data exists
    python -m benchmarks remote-cache --quick    # 64 MiB, a smoke run
    python -m benchmarks remote-cache --server s3 --order sequential,global
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import guideloom as gl  # noqa: E402
from benchmarks import remote_stream  # noqa: E402
from benchmarks._internals import copies_whole  # noqa: E402

SEQ = 2048
BATCH = 16
MiB = 2**20


def ensure_dataset(root: Path, nbytes: int) -> Path:
    path = root / f"cache-u16-{nbytes // MiB}MiB"
    if not (path / "manifest.json").exists():
        print(f"writing a {nbytes // MiB} MiB uint16 stream to {path} ...", flush=True)
        rng = np.random.default_rng(0)
        tokens = nbytes // 2

        def chunks() -> Any:
            for start in range(0, tokens, 8 * MiB):
                yield rng.integers(0, 50_000, min(8 * MiB, tokens - start), dtype=np.uint16)

        gl.write_stream(path, chunks(), dtype=np.uint16, shard_bytes=32 * MiB, overwrite=True)
    return path


def folder_bytes(folder: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def order_kw(order: str) -> dict[str, Any]:
    if order == "sequential":
        return {"shuffle": False}
    if order == "global":
        return {"shuffle": True, "shuffle_seed": 0}
    # The block shuffle "auto" picks over object storage (4 MiB blocks of 4 KiB samples), given
    # explicitly: "auto" over local files is the global shuffle, and the runs must compare alike.
    return {"shuffle": True, "shuffle_seed": 0, "shuffle_block_size": 1024}


def rows_digest(batch: Any, digest: Any) -> None:
    digest.update(np.ascontiguousarray(batch.numpy()).tobytes())


# -- child processes ---------------------------------------------------------------------------------
def child_epochs(source: str, options: dict[str, Any], order: str, epochs: int) -> dict[str, Any]:
    """``epochs`` whole epochs: samples/s of each, the first batch, the cache folder's peak."""
    import torch

    from guideloom import StatefulDataLoader

    torch.zeros(1)
    peak = [0]
    stop = threading.Event()
    root = options.get("cache_dir")
    # The folder's peak is sampled where there is a limit to hold it to (a walk of the folder
    # every 2 ms takes the GIL from the reader); the whole copy's is its size at the end.
    limited = root is not None and options.get("cache_max_bytes") is not None

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], folder_bytes(root))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    if limited:
        sampler.start()
    t0 = time.perf_counter()
    storage = gl.open_stream(source, **options)
    loader = StatefulDataLoader.from_storage(
        storage,
        lambda s: torch.from_numpy(np.asarray(s).astype(np.int64)),
        sequence_length=SEQ,
        local_batch_size=BATCH,
        device="cpu",
        prefetch=8,
        **order_kw(order),
    )
    out: dict[str, Any] = {"epochs": []}
    with loader:
        for e in range(epochs):
            if e == 1 and copies_whole(storage):
                # The whole copy: the second epoch is the one over the complete copy.
                t = time.perf_counter()
                while not storage.reads_inline() and time.perf_counter() - t < 300:
                    time.sleep(0.05)
                out["copy_wait_s"] = time.perf_counter() - t
            n = 0
            digest = hashlib.sha256()
            start = time.perf_counter()
            for b in loader:
                if n == 0 and e == 0:
                    out["first_batch_s"] = time.perf_counter() - t0
                n += 1
                rows_digest(b, digest)
            elapsed = time.perf_counter() - start
            stats = getattr(storage, "stats", dict)()
            out["epochs"].append(
                {
                    "samples_per_s": n * BATCH / elapsed,
                    "seconds": elapsed,
                    "digest": digest.hexdigest(),
                    "stats": {k: v for k, v in stats.items() if isinstance(v, int)},  # so far
                }
            )
    stop.set()
    if limited:
        sampler.join()
    elif root:
        peak[0] = folder_bytes(root)
    out["peak_cache_bytes"] = peak[0]
    stats = getattr(storage, "stats", lambda: {})()
    out["stats"] = {k: v for k, v in stats.items() if isinstance(v, int)}
    return out


def child_resume(
    source: str, options: dict[str, Any], order: str, stop_at: int, state: Any, rows_file: str
) -> dict[str, Any]:
    """Read until batch ``stop_at`` and return the checkpoint, or resume from ``state`` (batch
    size 12) to the end; each row read is written to ``rows_file`` as an 8-byte digest."""
    import torch

    from guideloom import StatefulDataLoader

    storage = gl.open_stream(source, **options)
    loader = StatefulDataLoader.from_storage(
        storage,
        lambda s: torch.from_numpy(np.asarray(s).astype(np.int64)),
        sequence_length=SEQ,
        local_batch_size=BATCH if state is None else 12,
        device="cpu",
        prefetch=8,
        **order_kw(order),
    )
    rows: list[bytes] = []
    out: dict[str, Any] = {}
    with loader:
        if state is not None:
            loader.load_state_dict(state)
        for n, b in enumerate(loader):
            rows.extend(hashlib.blake2b(r.tobytes(), digest_size=8).digest() for r in b.numpy())
            if state is None and n + 1 == stop_at:
                out["state"] = loader.state_dict()
                break
    Path(rows_file).write_bytes(b"".join(rows))
    return out


def run_child(*args: Any) -> dict[str, Any]:
    return remote_stream.run_child(*args, script=__file__)


def child_main(spec: str) -> None:
    kind, *args = json.loads(spec)
    fn = {"epochs": child_epochs, "resume": child_resume}[kind]
    print(json.dumps(fn(*args)), flush=True)


# -- the run -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 256 MiB")
    parser.add_argument("--order", default="sequential,global", help="sequential,global,block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument(
        "--modes",
        default="local,whole,limited,no-cache",
        help="what to measure (local,whole,limited,no-cache)",
    )
    parser.add_argument("--rtt", type=float, default=0.020, help="added round trip, seconds (0.020)")
    parser.add_argument(
        "--server", choices=("nginx", "s3"), default="nginx", help="nginx behind the proxy, or moto S3"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child)
        return

    size = (64 if args.quick else 256) * MiB
    data_root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    data_root.mkdir(parents=True, exist_ok=True)
    local = ensure_dataset(data_root, size)
    with serve(args, data_root, local) as (url, store_opts, where):
        print(
            f"stream {size // MiB} MiB uint16 (32 MiB objects) via {where}; sequence_length={SEQ}, "
            f"local_batch_size={BATCH}, prefetch=8; cache_max_bytes={size // 4 // MiB} MiB (25%), "
            "16 MiB chunks; two epochs per child, cold cache folders",
            flush=True,
        )
        measure(args, url, store_opts, local, size)


@contextlib.contextmanager
def serve(
    args: argparse.Namespace, data_root: Path, local: Path
) -> Iterator[tuple[str, dict[str, Any], str]]:
    """The dataset on the server ``args.server`` names: its URL, the options to read it with,
    and a description."""
    if args.server == "s3":
        with remote_stream.moto_bucket(local) as s3:
            yield "s3://bench/gl", s3, "moto S3 on 127.0.0.1 (its own process)"
        return
    from guideloom_dev.servers import Nginx, nginx_binary, proxy_process

    if nginx_binary() is None:
        raise SystemExit("nginx is needed: run .ci/install-servers.sh")
    nginx = Nginx(data_root)
    try:
        with proxy_process(nginx.port, delay=args.rtt / 2, lifetime=1800) as port:
            yield f"http://127.0.0.1:{port}/{local.name}", {}, f"nginx + proxy at {args.rtt * 1000:.0f} ms"
    finally:
        nginx.stop()


def measure(args: argparse.Namespace, url: str, store_opts: dict[str, Any], local: Path, size: int) -> None:
    """The rounds of every order, and their summary lines."""
    limit = size // 4
    modes = args.modes.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="guideloom-cache-bench-"))
    try:
        for order in args.order.split(","):

            def fresh(name: str, order: str = order) -> str:
                folder = scratch / f"{order}-{name}"
                shutil.rmtree(folder, ignore_errors=True)
                return str(folder)

            options: dict[str, Callable[[], dict[str, Any]]] = {
                "local": lambda: {},
                "whole": lambda: {**store_opts, "cache_dir": fresh("whole")},
                "limited": lambda: {**store_opts, "cache_dir": fresh("limited"), "cache_max_bytes": limit},
                # The same reads with no cache at all: what a cache must never cost more than.
                "no-cache": lambda: dict(store_opts),
            }
            rounds: list[dict[str, dict[str, Any]]] = []
            for rnd in range(args.rounds):  # alternating rounds: each ratio within its round
                runs: dict[str, dict[str, Any]] = {}
                for mode in modes:
                    source = str(local) if mode == "local" else url
                    runs[mode] = run_child("epochs", source, options[mode](), order, 2)
                rounds.append(runs)
                for name, r in runs.items():
                    e1, e2 = r["epochs"]
                    s1 = e1["stats"]
                    # GETs and bytes until the end of epoch 1 (a cache's downloads included)
                    first = f", epoch 1 {s1['requests']} GETs {s1['bytes_read'] / MiB:.0f} MiB" if s1 else ""
                    print(
                        f"  [{order} {rnd + 1}] {name:8}: epoch 1 {e1['samples_per_s']:8.0f} samples/s "
                        f"({e1['seconds']:5.1f} s), epoch 2 {e2['samples_per_s']:8.0f} samples/s, first "
                        f"batch {r['first_batch_s'] * 1000:5.0f} ms, peak cache "
                        f"{r['peak_cache_bytes'] / MiB:6.1f} MiB{first}; in all {r['stats']}",
                        flush=True,
                    )
            summarize(order, rounds, limit, size, url, store_opts, local, scratch, fresh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summarize(
    order: str,
    rounds: list[dict[str, dict[str, Any]]],
    limit: int,
    size: int,
    url: str,
    store_opts: dict[str, Any],
    local: Path,
    scratch: Path,
    fresh: Any,
) -> None:
    """The lines that compare the modes of ``order`` (those measured), and the resume check."""
    have = set(rounds[0])

    def ratio(a: str, b: str, epoch: int) -> str:
        """The median over rounds of a's samples/s over b's, in the same round."""
        xs = [r[a]["epochs"][epoch]["samples_per_s"] / r[b]["epochs"][epoch]["samples_per_s"] for r in rounds]
        return f"{statistics.median(xs):.2f}x [{', '.join(f'{x:.2f}' for x in xs)}]"

    def rate(mode: str, epoch: int) -> str:
        return f"{statistics.median(r[mode]['epochs'][epoch]['samples_per_s'] for r in rounds):,.0f}"

    digests = {e["digest"] for runs in rounds for r in runs.values() for e in r["epochs"]}
    ttfb = {k: max(r[k]["first_batch_s"] for r in rounds) * 1000 for k in have}
    same = len(digests) == (1 if order == "sequential" else 2)
    print(f"[{order}] same rows in every run: {same}", flush=True)
    if {"whole", "no-cache"} <= have:
        print(
            f"[{order}] whole copy / no cache, epoch 1: {rate('whole', 0)} vs {rate('no-cache', 0)} "
            f"samples/s (medians), {ratio('whole', 'no-cache', 0)} (target >= 0.9); epoch 2 "
            f"{ratio('whole', 'no-cache', 1)}",
            flush=True,
        )
    if {"whole", "local"} <= have:
        print(
            f"[{order}] complete cache: epoch 2 of the whole copy {ratio('whole', 'local', 1)} local "
            f"files (target >= 0.8); first batch cold <= {ttfb['whole']:.0f} ms (target < 1000)",
            flush=True,
        )
    if "limited" not in have:
        return
    peak = max(r["limited"]["peak_cache_bytes"] for r in rounds)
    opts = {**store_opts, "cache_dir": fresh("resume"), "cache_max_bytes": limit}
    stop_at = int(0.4 * size / (SEQ * 2) / BATCH)
    files = [str(scratch / f"{order}-rows-{k}") for k in range(3)]
    head = run_child("resume", url, opts, order, stop_at, None, files[0])
    run_child("resume", url, opts, order, 0, head["state"], files[1])
    run_child("resume", str(local), {}, order, 10**9, None, files[2])
    got = Path(files[0]).read_bytes() + Path(files[1]).read_bytes()
    whole = Path(files[2]).read_bytes()
    # drop_last: the resumed run (batches of 12) may end up to 11 rows short
    exact = got == whole[: len(got)] and 0 <= len(whole) - len(got) < 12 * 8
    line = f"[{order}] 25% cache: peak {peak / MiB:.1f} MiB <= {limit / MiB:.0f} MiB: {peak <= limit}; "
    if "whole" in have:
        line += (
            f"epoch 1 {ratio('limited', 'whole', 0)} the unlimited cache's (target >= 0.8), epoch 2 "
            f"{ratio('limited', 'whole', 1)}; "
        )
    print(f"{line}first batch <= {ttfb['limited']:.0f} ms (target < 1000); resume exact: {exact}", flush=True)
    if "no-cache" in have:
        print(
            f"[{order}] 25% cache / no cache: epoch 1 {ratio('limited', 'no-cache', 0)}, epoch 2 "
            f"{ratio('limited', 'no-cache', 1)} (a cache must not cost more than none: >= 1)",
            flush=True,
        )


if __name__ == "__main__":
    main()
