"""Before/after: the same workloads on two revisions of guideloom, side by side in one run.

An architecture change must keep every figure within noise. This checks out ``--base`` (any git
revision) into a worktree beside the repository, then runs each workload in a fresh subprocess per
revision, alternating revisions round by round (this machine is shared and noisy: the ratio of
two runs taken moments apart is what means something), and prints medians and the ratio
``current / base`` per workload.

    python -m benchmarks revisions --base 016ac7a           # 3 rounds
    python -m benchmarks revisions --base HEAD~5 --quick    # 1 round, fewer batches

Both trees are byte-compiled first: a tree imported from source (``PYTHONDONTWRITEBYTECODE``
set, or a fresh checkout) pays ~70 ms per interpreter, which each process worker pays too.

The workloads use the public API only, so any two revisions compare: a 100M-token uint16 stream
on local disk (the suite's dataset), sequence_length=2048, local_batch_size=16, shuffle, the
README's collate (``np.asarray`` to int64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import summary

REPO = Path(__file__).resolve().parent.parent

#: name -> (loader keywords, async?)
WORKLOADS: dict[str, tuple[dict[str, object], bool]] = {
    "nw=0": ({}, False),
    "nw=0 prefetch=8": ({"prefetch": 8}, False),
    "nw=2 threads prefetch=16": ({"num_workers": 2, "prefetch": 16}, False),
    "nw=2 processes prefetch=16": ({"num_workers": 2, "prefetch": 16, "parallel_method": "process"}, False),
    "async nw=0 prefetch=8": ({"prefetch": 8}, True),
}

CHILD = Path(__file__).with_name("_revision_child.py")


def _worktree(rev: str) -> Path:
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dest = Path(tempfile.gettempdir()) / f"guideloom-rev-{sha[:12]}"
    if not (dest / "guideloom" / "__init__.py").exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--force", str(dest), sha], cwd=REPO, check=True
        )
    return dest


def _measure(tree: Path, data: Path, name: str, batches: int, warmup: int) -> dict[str, float]:
    kwargs, is_async = WORKLOADS[name]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(CHILD), str(data), name, json.dumps(kwargs), "1" if is_async else "0"]
    # Run from the tree, by path: the tree's guideloom is the one imported, not this checkout's.
    argv = [*cmd, str(batches), str(warmup)]
    out = subprocess.run(argv, check=False, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} on {tree} failed:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks revisions", description=summary(__doc__))
    ap.add_argument("--base", required=True, help="git revision to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3, --quick 1)")
    ap.add_argument(
        "--batches", type=int, default=None, help="timed batches per run (default 2000, --quick 500)"
    )
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = args.batches or (500 if args.quick else 2000)

    from benchmarks.local_stream import ensure_dataset

    data = ensure_dataset(args.tokens)
    trees = {"base": _worktree(args.base), "current": REPO}
    for tree in trees.values():  # both import from bytecode, whatever PYTHONDONTWRITEBYTECODE says
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(tree / "guideloom")],
            check=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        )
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(rounds):
        for name in WORKLOADS:
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for label, tree in order:
                res = _measure(tree, data, name, batches, warmup=50)
                results.setdefault((label, name), []).append(res)
                print(
                    f"round {r + 1} {label:7s} {name:26s} {res['samples_per_s']:10,.0f} samples/s", flush=True
                )

    print(
        f"\nbase = {args.base}, current = working tree; "
        f"medians of {rounds} round(s), {batches} batches each\n"
    )
    print(
        "| workload | base samples/s | current samples/s | current / base "
        "| first batch base / current (ms) | resume TTFB base / current (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in WORKLOADS:
        b = statistics.median(x["samples_per_s"] for x in results[("base", name)])
        c = statistics.median(x["samples_per_s"] for x in results[("current", name)])
        tb = statistics.median(x["resume_ttfb_ms"] for x in results[("base", name)])
        tc = statistics.median(x["resume_ttfb_ms"] for x in results[("current", name)])
        fb = statistics.median(x.get("first_batch_ms", float("nan")) for x in results[("base", name)])
        fc = statistics.median(x.get("first_batch_ms", float("nan")) for x in results[("current", name)])
        print(f"| {name} | {b:,.0f} | {c:,.0f} | {c / b:.2f} | {fb:.1f} / {fc:.1f} | {tb:.1f} / {tc:.1f} |")


if __name__ == "__main__":
    main()
