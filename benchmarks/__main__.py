"""guideloom's benchmark suite, one entry point.

    python -m benchmarks setup             # create the bench venv with the peers (once; also done by run)
    python -m benchmarks run               # the whole suite (< 20 min on 2 cores), table + chart
    python -m benchmarks run --quick       # one round, shorter windows (a few minutes)
    python -m benchmarks report            # rewrite the table and chart from results/latest.json

The peers (torchdata, MosaicML Streaming, LitData, Grain) live in their own venv outside the
repository ($GUIDELOOM_BENCH_VENV, default $TMPDIR/guideloom-bench-venv); `run` creates it on first
use and re-runs itself there. The data is generated once under $GUIDELOOM_BENCH_DIR (default
$TMPDIR/guideloom-bench), cached by its parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ALL_PEERS = ["torch", "torch-getitems", "torchdata", "torchdata-getitems", "streaming", "litdata", "grain"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create the bench venv")
    s.add_argument("--force", action="store_true")
    r = sub.add_parser("run", help="run the suite")
    r.add_argument("--quick", action="store_true", help="one round, shorter measurement windows")
    r.add_argument("--rounds", type=int, help="alternating rounds (default 3, --quick 1)")
    r.add_argument("--only", default="local,resume,remote", help="parts to run (local,resume,remote)")
    r.add_argument("--peers", default=",".join(ALL_PEERS), help="peers to include")
    r.add_argument("--tokens", type=int, default=100_000_000)
    r.add_argument("--no-save", action="store_true", help="print only; leave benchmarks/results as is")
    sub.add_parser("report", help="rewrite the table and chart from benchmarks/results/latest.json")
    args = ap.parse_args(argv)

    if args.cmd == "setup":
        from .suite.env import ensure_venv

        print(ensure_venv(force=args.force))
        return
    from .suite.env import ensure_bench_python

    ensure_bench_python(argv)
    from .suite.main import RESULTS, run, save
    from .suite.report import chart, docs_page, markdown

    if args.cmd == "run":
        out = run(args.quick, args.rounds, set(args.only.split(",")), args.peers.split(","), args.tokens)
        if not args.no_save:
            save(out)
    else:
        out = json.loads((RESULTS / "latest.json").read_text())
    md = markdown(out)
    print("\n" + md)
    if args.cmd == "report" or not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "results.md").write_text(md)
        chart(out, RESULTS / "results.png")
        docs = RESULTS.parents[1] / "docs" / "benchmarks.md"
        notes = Path(__file__).parent / "suite" / "notes.md"  # the analysis, kept by hand
        docs.write_text(docs_page(md) + ("\n" + notes.read_text() if notes.exists() else ""))
        print(f"wrote {RESULTS / 'results.md'}, {RESULTS / 'results.png'} and {docs}")


if __name__ == "__main__":
    main()
