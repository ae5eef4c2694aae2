"""guideloom's benchmarks and reliability runs, one entry point.

    python -m benchmarks local [--quick]           # local stream: guideloom vs a bare loop and torch (~2 min)
    python -m benchmarks remote [--quick]          # over HTTP at 20 ms round trip, vs its ceiling (nginx)
    python -m benchmarks remote-cache [--quick]    # cache_dir: a 25% chunk cache vs the whole copy vs local
    python -m benchmarks first-batch [--trace]     # time to first batch on moto and nginx, request by request
    python -m benchmarks suite [--quick]           # against torch, torchdata, Streaming, LitData, Grain
    python -m benchmarks suite --setup-only        # only create the suite's venv with the peers
    python -m benchmarks report                    # re-render table and chart from results/latest.json
    python -m benchmarks fuzz [--minutes 60]       # fuzz the manifest reader
    python -m benchmarks soak [--minutes 10]       # loading through a faulty proxy, workers killed
    python -m benchmarks packing [--quick]         # document packing vs the stream loader; layout of 10M docs
    python -m benchmarks mixture [--sources 1000]  # a 1,000-source mixture: open and resume at 10^9
    python -m benchmarks revisions --base REV      # the local workloads on two revisions, side by side
    python -m benchmarks process-remote            # process workers over object storage vs threads
    python -m benchmarks async-file-io             # async file reads: one thread hop a window vs aiofiles
    python -m benchmarks faults [--only WORD]      # the fault and bad-input trial's cases, as a group
    python -m benchmarks faults --trials N --seed S # the corruption fuzzer: no wrong sample is delivered
    python -m benchmarks worker-start [--rounds 3] # process workers' start and memory vs torch's DataLoader
    python -m benchmarks worker-control [--hogs N] # collate_mode auto vs pinned, beside busy-loop processes
    python -m benchmarks gpu [--quick]             # the device copy: GB/s, overlap with compute, correctness
    python -m benchmarks merge [--parts 1000,10000] # prepare --merge of 10,000 parts: time, size, open
    python -m benchmarks prepare-tasks [--mb 200]  # prepare as 8 task processes and on Ray vs --workers 2
    python -m benchmarks provenance [--sources N]  # explain() at 10^12 of 1,000 packed sources; audit cost
    python -m benchmarks parquet [--quick]         # Parquet text, packed and not (real prose) vs HF, LitData
    python -m benchmarks parquet-synthetic [--quick] # open_parquet vs HF streaming, prepared streams
    python -m benchmarks parquet-tokens [--rounds 3] # pre-tokenized Parquet: process workers vs none, resume
    python -m benchmarks parquet-remote [--rounds 2] # open_parquet over http (0/20 ms) vs HF streaming
    python -m benchmarks integrity [--block-sizes 16,64,256] # block verification's cost, local and S3
    python -m benchmarks torchft [--kills 24]      # a quorum's failures: lost/repeated vs torchft's sampler
    python -m benchmarks async-loop [--rounds 2] [--why]  # async for over S3: loop stalls, their causes

`suite` runs in a venv of its own with the peers ($GUIDELOOM_BENCH_VENV, default
$TMPDIR/guideloom-bench-venv): it creates it on first use and re-runs itself there. Nothing else
installs anything; `report` in particular only reads results/latest.json and writes the table, the
chart (when matplotlib is importable) and docs/benchmarks.md. Data is generated once under
$GUIDELOOM_BENCH_DIR (default $TMPDIR/guideloom-bench), cached by its parameters.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"  # suite.main's RESULTS, without its imports
ALL_PEERS = ["torch", "torch-getitems", "torchdata", "torchdata-getitems", "streaming", "litdata", "grain"]
_PASSTHROUGH = {
    "local": "benchmarks.local_stream",
    "remote": "benchmarks.remote_stream",
    "remote-cache": "benchmarks.remote_cache",
    "first-batch": "benchmarks.first_batch",
    "fuzz": "benchmarks.fuzz_manifest",
    "soak": "benchmarks.soak",
    "packing": "benchmarks.packing",
    "mixture": "benchmarks.mixture",
    "revisions": "benchmarks.revisions",
    "process-remote": "benchmarks.process_remote",
    "async-file-io": "benchmarks.async_file_io",
    "faults": "benchmarks.faults",
    "worker-start": "benchmarks.worker_start",
    "worker-control": "benchmarks.worker_control",
    "gpu": "benchmarks.gpu",
    "merge": "benchmarks.merge",
    "prepare-tasks": "benchmarks.prepare_tasks",
    "provenance": "benchmarks.provenance",
    "parquet": "benchmarks.parquet_prose",
    "parquet-synthetic": "benchmarks.parquet",
    "parquet-tokens": "benchmarks.parquet_tokens",
    "parquet-remote": "benchmarks.parquet_remote",
    "integrity": "benchmarks.integrity",
    "torchft": "benchmarks.torchft",
    "async-loop": "benchmarks.async_loop",
}


def _suite(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks suite", description="guideloom against its peers")
    ap.add_argument("--setup-only", action="store_true", help="create the suite's venv and stop")
    ap.add_argument("--force", action="store_true", help="with --setup-only: reinstall the venv")
    ap.add_argument("--quick", action="store_true", help="one round, shorter measurement windows")
    ap.add_argument("--rounds", type=int, help="alternating rounds (default 3, --quick 1)")
    ap.add_argument("--only", default="local,resume,remote", help="parts to run (local,resume,remote)")
    ap.add_argument("--peers", default=",".join(ALL_PEERS), help="peers to include")
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--no-save", action="store_true", help="print only; leave benchmarks/results as is")
    args = ap.parse_args(argv)
    from .suite.env import ensure_bench_python, ensure_venv

    if args.setup_only:
        print(ensure_venv(force=args.force))
        return
    ensure_bench_python(["suite", *argv])
    from .suite.main import run, save

    out = run(args.quick, args.rounds, set(args.only.split(",")), args.peers.split(","), args.tokens)
    if args.no_save:
        from .suite.report import markdown

        print("\n" + markdown(out))
        return
    save(out)
    _write_report(out)


def _report(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks report",
        description="Re-render results.md, results.png and docs/benchmarks.md from results/latest.json "
        "(installs nothing; without matplotlib, the chart is left as it is).",
    )
    ap.parse_args(argv)
    latest = RESULTS / "latest.json"
    if not latest.exists():
        raise SystemExit(f"no results to report: {latest} does not exist (run `python -m benchmarks suite`)")
    _write_report(json.loads(latest.read_text()))


def _write_report(out: dict[str, Any]) -> None:
    """The table (printed, results.md, docs/benchmarks.md) and, when matplotlib imports, the chart."""
    from .suite.report import chart, docs_page, markdown

    md = markdown(out)
    print("\n" + md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    written = [RESULTS / "results.md"]
    (RESULTS / "results.md").write_text(md)
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "matplotlib is not installed here: the table is written, the chart "
            f"{RESULTS / 'results.png'} is left as it was (pip install matplotlib, then run report again)"
        )
    else:
        chart(out, RESULTS / "results.png")
        written.append(RESULTS / "results.png")
    docs = RESULTS.parents[1] / "docs" / "benchmarks.md"
    figures = Path(__file__).parent / "suite" / "figures.md"  # each benchmark's latest figures
    try:
        docs.write_text(docs_page(out, figures.read_text()))
    except ValueError as exc:
        raise SystemExit(f"docs/benchmarks.md not written: {exc}") from None
    written.append(docs)
    print("wrote " + ", ".join(str(p) for p in written))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["suite", "report", *_PASSTHROUGH]  # every command the docstring lists
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"unknown command {argv[0]!r}: use one of {', '.join(commands)}")
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "suite":
        _suite(rest)
    elif command == "report":
        _report(rest)
    else:
        module = importlib.import_module(_PASSTHROUGH[command])
        sys.argv = [f"python -m benchmarks {command}", *rest]
        module.main(rest)


if __name__ == "__main__":
    main()
