"""Parquet over object storage: ``gl.open_parquet`` over ``http://`` against Hugging Face
streaming over the same URLs, at 0 ms and 20 ms of added round trip.

Data: ``benchmarks/parquet.py``'s (40,000 rows in 8 files, zstd, row groups of 1,000 rows, a
``text`` column and an ``input_ids`` ``list<int32>`` column, its BPE tokenizer), served by nginx
on 127.0.0.1 (``guideloom_dev/servers.py``), directly (0 ms) and behind the loopback latency
proxy in a process of its own (10 ms each way: 20 ms round trip), as the suite's remote part does.
Both loaders get the files' URLs as a list (an ``http://`` folder cannot be listed).

- ``gl-parquet-text``: ``open_parquet([urls], "text", tokenizer=..., eos=...)``,
  ``shuffle_block_size="auto"``, 2 process workers tokenizing where they collate
  (local_batch_size 32).
- ``hf-streaming``: ``load_dataset("parquet", data_files=[urls], streaming=True)`` (fsspec's HTTP
  filesystem), ``.shuffle(buffer_size=1000)``, ``split_dataset_by_node``, ``.map`` of the same
  tokenizer (batched), torchdata's ``StatefulDataLoader(num_workers=2)``, batch 32.
- ``gl-parquet-text-threads``: the same with 2 thread workers (``parallel_method="thread"``): no
  worker process to start.
- ``gl-parquet-tokens``: ``open_parquet([urls], "input_ids")``, ``shuffle_block_size="auto"``, no
  workers.
- ``gl-parquet-text-noahead``, ``gl-parquet-tokens-noahead``: the same with ``fetch_ahead=0``
  (each read fetches its row groups itself, one GET after another): the baseline of fetching the
  loader's upcoming row groups ahead (``fetch_ahead=8``, the default, in the others).

Every configuration runs in a fresh process, in alternating rounds; samples/s counts from the
first batch on for up to ``--seconds`` or to the end of the first epoch (each row group is read
once, as by a run over more files than it can keep decoded; guideloom keeps ``open_parquet``'s
default ``max_decoded_bytes``: the loader's process decodes for all its workers over an object
store). The first-batch time runs from
the call that opens the files (``open_parquet``, ``load_dataset``; the imports are done before it)
to the first batch out of the loader: it holds the footers' reads, the workers' start and the
first row groups' reads. The load average is printed before and after.

    python -m benchmarks parquet-remote --seconds 8 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.parquet import (  # noqa: E402
    BATCH,
    collate_docs,
    collate_hf,
    hf_tokenize,
    loadavg,
    make_data,
    measured_child,
    timed_batches,
)

CONFIGS = (
    "gl-parquet-text",
    "hf-streaming",
    "gl-parquet-text-threads",
    "gl-parquet-tokens",
    "gl-parquet-text-noahead",
    "gl-parquet-tokens-noahead",
)
#: Decoded row groups kept by guideloom here: ``open_parquet``'s default. Over an object store
#: the loader's process reads and decodes for all its workers, a window or two ahead; a run
#: measures at most one epoch, so each row group is fetched and decoded once, as by HF.
DECODED_REMOTE = 512 * 2**20
ROWS, FILES = 40_000, 8


def urls_of(base: str, data: Path) -> list[str]:
    return [f"{base}/parquet/{p.name}" for p in sorted((data / "data").glob("*.parquet"))]


def make_loader(config: str, urls: list[str], tokenizer: str) -> Any:
    """The configuration's loader over ``urls`` (what its first-batch time starts from)."""
    import torch

    import guideloom as gl

    cpu = torch.device("cpu")
    ahead: dict[str, Any] = {"fetch_ahead": 0} if config.endswith("-noahead") else {}  # else the default
    config = config.removesuffix("-noahead")
    if config in ("gl-parquet-text", "gl-parquet-text-threads"):
        storage = gl.open_parquet(
            urls, "text", tokenizer=tokenizer, eos="</s>", max_decoded_bytes=DECODED_REMOTE, **ahead
        )
        method = "thread" if config.endswith("threads") else "process"
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, num_workers=2, parallel_method=method,
            shuffle=True, shuffle_block_size="auto", device=cpu,
        )  # fmt: skip
    if config == "gl-parquet-tokens":
        storage = gl.open_parquet(urls, "input_ids", max_decoded_bytes=DECODED_REMOTE, **ahead)
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, shuffle=True, shuffle_block_size="auto", device=cpu
        )
    if config == "hf-streaming":
        import datasets
        from datasets.distributed import split_dataset_by_node
        from tokenizers import Tokenizer
        from torchdata.stateful_dataloader import StatefulDataLoader

        eos = Tokenizer.from_file(tokenizer).token_to_id("</s>")
        ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True)
        ds = ds.shuffle(seed=0, buffer_size=1000)
        ds = split_dataset_by_node(ds, rank=0, world_size=1)
        ds = ds.map(
            functools.partial(hf_tokenize, path=tokenizer, eos=eos),
            batched=True,
            batch_size=BATCH,
            remove_columns=["text", "input_ids"],
        )
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=collate_hf)
    raise ValueError(config)


def run_one(config: str, urls: list[str], tokenizer: str, seconds: float) -> dict[str, float]:
    """Open, first batch, then batches until ``seconds`` have passed since it or the epoch ends
    (one epoch at most: each row group is read once, as a long run over many files reads it)."""
    import datasets  # noqa: F401 - the imports are not part of the first batch's time
    import torch  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401

    import guideloom  # noqa: F401

    t0 = time.perf_counter()
    loader = make_loader(config, urls, tokenizer)
    opened = time.perf_counter() - t0
    return {**timed_batches(loader, config, t0, seconds, one_epoch=True), "open_s": opened}


def in_child(config: str, urls: list[str], tokenizer: str, seconds: float) -> dict[str, float]:
    """``run_one`` in a fresh process; its peak PSS (with its workers') sampled from here."""
    args = ["--urls", json.dumps(urls), "--tokenizer", tokenizer, "--seconds", str(seconds)]
    return measured_child("benchmarks.parquet_remote", config, args)


@contextlib.contextmanager
def serve(data: Path, rtts: tuple[float, ...]) -> Iterator[dict[float, str]]:
    """nginx over the Parquet folder (as ``/parquet/``); yields {added round trip in s: base url}."""
    from guideloom_dev.servers import Nginx, nginx_binary, proxy_process

    if nginx_binary() is None:
        raise SystemExit("nginx is not installed (.ci/install-servers.sh)")
    with tempfile.TemporaryDirectory(prefix="guideloom-parquet-www-") as www:
        os.symlink(data / "data", Path(www) / "parquet")
        nginx = Nginx(Path(www))
        try:
            with contextlib.ExitStack() as stack:
                urls = {}
                for rtt in rtts:
                    if rtt == 0:
                        urls[rtt] = nginx.url
                    else:
                        port = stack.enter_context(proxy_process(nginx.port, delay=rtt / 2, lifetime=3600))
                        urls[rtt] = f"http://127.0.0.1:{port}"
                yield urls
        finally:
            nginx.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks parquet-remote", description=summary(__doc__))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per configuration")
    ap.add_argument("--rtts", default="0,20", help="added round trips in ms, comma separated")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, json.loads(args.urls), args.tokenizer, args.seconds)))
        return
    data = make_data(ROWS, FILES)
    tokenizer = str(data / "tokenizer.json")
    rtts = tuple(float(x) / 1e3 for x in args.rtts.split(","))
    configs = args.configs.split(",")
    mib = sum(p.stat().st_size for p in (data / "data").glob("*.parquet")) / 2**20
    print(f"data: {ROWS:,} rows in {FILES} files ({mib:.1f} MiB of Parquet), served by nginx on 127.0.0.1")
    print(f"load average before: {loadavg()}")
    results: dict[tuple[float, str], list[dict[str, float]]] = {}
    with serve(data, rtts) as bases:
        for r in range(args.rounds):
            order = [(rtt, c) for rtt in rtts for c in configs]
            if r % 2:
                order.reverse()
            for rtt, config in order:
                got = in_child(config, urls_of(bases[rtt], data), tokenizer, args.seconds)
                results.setdefault((rtt, config), []).append(got)
                print(f"  round {r + 1} {1e3 * rtt:3.0f} ms {config:<23} {got['samples_s']:>8,.0f} samples/s "
                      f"{got['tokens_s']:>11,.0f} tokens/s  open {1e3 * got['open_s']:5.0f} ms  first batch "
                      f"{1e3 * got['first_batch_s']:5.0f} ms  peak PSS {got['peak_pss_mb']:5.0f} MiB",
                      flush=True)  # fmt: skip

    def med(rtt: float, config: str, key: str) -> float:
        return statistics.median(x[key] for x in results[(rtt, config)])

    print("\nmedians over rounds:")
    print(
        "| round trip added | configuration | samples/s | tokens/s | open ms | first batch ms "
        "| peak PSS MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for rtt in rtts:
        for c in configs:
            print(f"| {1e3 * rtt:.0f} ms | {c} | {med(rtt, c, 'samples_s'):,.0f} "
                  f"| {med(rtt, c, 'tokens_s'):,.0f} "
                  f"| {1e3 * med(rtt, c, 'open_s'):.0f} | {1e3 * med(rtt, c, 'first_batch_s'):.0f} "
                  f"| {med(rtt, c, 'peak_pss_mb'):.0f} |")  # fmt: skip
    if "hf-streaming" in configs:
        print("\nratios and targets (samples/s >= 1.5x HF streaming's, first batch < 1 s):")
        for rtt in rtts:
            hf_first = med(rtt, "hf-streaming", "first_batch_s")
            print(f"  {1e3 * rtt:.0f} ms (HF streaming's first batch {1e3 * hf_first:.0f} ms):")
            for c in ("gl-parquet-text", "gl-parquet-text-threads"):
                if c not in configs:
                    continue
                ratio = med(rtt, c, "samples_s") / med(rtt, "hf-streaming", "samples_s")
                pairs = zip(results[(rtt, c)], results[(rtt, "hf-streaming")], strict=True)
                per_round = ", ".join(f"{a['samples_s'] / b['samples_s']:.2f}" for a, b in pairs)
                first = med(rtt, c, "first_batch_s")
                print(f"    {c} / hf-streaming samples/s {ratio:.2f} (rounds {per_round}): "
                      f"{'met' if ratio >= 1.5 else 'NOT met'}; first batch {1e3 * first:.0f} ms: "
                      f"{'met' if first < 1 else 'NOT met'}")  # fmt: skip
        for c in ("gl-parquet-text", "gl-parquet-tokens"):
            if c in configs and f"{c}-noahead" in configs:
                for rtt in rtts:
                    speed = med(rtt, c, "samples_s") / med(rtt, f"{c}-noahead", "samples_s")
                    first = med(rtt, c, "first_batch_s") / med(rtt, f"{c}-noahead", "first_batch_s")
                    print(f"  {c}: fetching ahead / not, {1e3 * rtt:.0f} ms: samples/s {speed:.2f}x, "
                          f"first batch {first:.2f}x")  # fmt: skip
        if 0.0 in rtts:
            for rtt in rtts:
                if rtt:
                    for c in configs:
                        print(f"  {c}: {1e3 * rtt:.0f} ms / 0 ms samples/s "
                              f"{med(rtt, c, 'samples_s') / med(0.0, c, 'samples_s'):.2f}")  # fmt: skip
    print(f"\nload average after: {loadavg()}")


if __name__ == "__main__":
    main()
