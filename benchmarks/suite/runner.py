"""Runs every configuration in fresh child processes, in alternating rounds, and keeps the medians."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .data import Data

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Config:
    key: str  # unique id
    label: str  # as shown in the table
    peer: str
    group: str  # "local", "resume", "remote"
    nw: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def run_child(spec: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    """Run one measurement; sample the RSS of the child's whole process tree every 20 ms."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    env.update(spec.get("env", {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.suite.child", json.dumps(spec)],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    peak = [0.0, 0.0]  # RSS, and its anonymous (private) part
    done = threading.Event()

    def monitor() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not done.is_set():
            total = anon = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    total += p.memory_info().rss
                    anon += _rss_anon(p.pid)
                except (psutil.Error, OSError):
                    pass
            peak[0] = max(peak[0], total / 2**20)
            peak[1] = max(peak[1], anon / 2**20)
            done.wait(0.02)

    th = threading.Thread(target=monitor, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        err = f"timed out after {timeout:.0f} s\n{err}"
    finally:
        done.set()
        th.join()
        _kill_tree(proc)  # leftover worker processes of a peer, if any
    lines = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = "\n".join(err.strip().splitlines()[-6:])
        return {"error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["peak_rss_mib"] = peak[0]
    result["peak_anon_rss_mib"] = peak[1]
    return result


def _rss_anon(pid: int) -> int:
    """Bytes of the process's RSS that are anonymous memory (not mapped files: RssAnon)."""
    with open(f"/proc/{pid}/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def spec_for(cfg: Config, d: Data, timing: dict[str, Any], resume: int | None = None) -> dict[str, Any]:
    big = resume is not None
    spec: dict[str, Any] = {
        "peer": cfg.peer,
        "nw": cfg.nw,
        "resume": resume,
        "raw": str(d.big_raw if big else d.raw),
        "gl": str(d.big_gl if big else d.gl),
        "mds": str(d.big_mds if big else d.mds),
        "litdata": str(d.big_litdata if big else d.litdata),
        **timing,
        **cfg.extra,
    }
    if big:
        spec["batches"] = 1  # time to first batch only
    return spec


def run_rounds(
    configs: list[Config],
    specs: dict[str, list[dict[str, Any]]],
    rounds: int,
    baseline: str | None,
    log: Any = print,
) -> dict[str, dict[str, Any]]:
    """Every round runs every (config, spec) once, in a rotated order; returns medians.

    ``specs[key]`` is a list (one entry per variant, e.g. the two resume points); ratios are taken
    against ``baseline``'s samples/s of the same round."""
    per: dict[tuple[str, int], list[dict[str, Any]]] = {}
    jobs = [(c, i) for c in configs for i in range(len(specs[c.key]))]
    for r in range(rounds):
        shift = r % max(1, len(jobs))
        order = jobs[shift:] + jobs[:shift]
        if baseline is not None:  # the baseline opens every round
            order.sort(key=lambda j: j[0].key != baseline)
        base_sps = None
        t_round = time.perf_counter()
        round_results: list[tuple[tuple[str, int], dict[str, Any]]] = []
        for cfg, i in order:
            res = run_child(specs[cfg.key][i])
            round_results.append(((cfg.key, i), res))
            if cfg.key == baseline and "samples_per_s" in res:
                base_sps = res["samples_per_s"]
            if "error" in res:
                log(f"    {cfg.label} [{i}]: ERROR {res['error']}")
        for k, res in round_results:
            if base_sps and "samples_per_s" in res:
                res["x_limit"] = res["samples_per_s"] / base_sps
            per.setdefault(k, []).append(res)
        log(f"  round {r + 1}/{rounds}: {len(order)} runs in {time.perf_counter() - t_round:.0f} s")
    out: dict[str, dict[str, Any]] = {}
    for (key, i), results in per.items():
        ok = [x for x in results if "error" not in x]
        med: dict[str, Any] = {"runs": len(ok)}
        if not ok:
            med["error"] = results[-1]["error"]
        for m in {k for x in ok for k, v in x.items() if isinstance(v, int | float)}:
            vals = [x[m] for x in ok if m in x]
            med[m] = statistics.median(vals)
        # each round's samples/s (None where it failed), so a comparison of two configurations
        # can be the median of their ratios round by round (report.ratio)
        med["round_samples_per_s"] = [None if "error" in x else x.get("samples_per_s") for x in results]
        out[f"{key}#{i}"] = med
    return out
