"""One measurement in a fresh interpreter: ``python -m benchmarks.suite.child '<json spec>'``.

Prints one JSON line: time to first batch (from building the loader, and loading its state for a
resume, to the first batch in hand), steady-state samples/s after a warm-up, and CPU seconds of the
whole process tree (this process, its threads and its worker processes) per 1,000 batches.
Peak RSS of the tree is sampled by the parent (:mod:`benchmarks.suite.runner`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

import psutil


def tree_cpu() -> float:
    """User+system seconds of this process and every descendant, the exited ones included.

    A loader whose workers are not persistent ends them with every epoch; the live processes'
    times alone would lose an exited worker's seconds (and the window's difference could come out
    negative), so each process also counts the children it has reaped (``children_user`` and
    ``children_system``), as the kernel adds them to their parent when it waits for them."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # a training script has torch loaded already: keep its import out of the timing

    from . import loaders
    from .data import BATCH, SEQ

    torch.zeros(1)
    if spec["peer"] in ("streaming", "litdata", "grain", "torchdata", "torchdata-getitems"):
        __import__(
            {"streaming": "streaming", "litdata": "litdata", "grain": "grain.python"}.get(
                spec["peer"], "torchdata.stateful_dataloader"
            )
        )
    factory = loaders.PEERS[spec["peer"]](spec)
    t0 = time.perf_counter()
    it = factory()
    first = next(it)
    ttfb = time.perf_counter() - t0
    assert tuple(first.shape) == (BATCH, SEQ) and first.dtype == torch.int64, (first.shape, first.dtype)
    out: dict[str, Any] = {"ttfb_s": ttfb}
    if spec["batches"] > 1:
        warm_until = time.perf_counter() + spec["warmup_s"]
        n = 0
        while n < spec["warmup"] or time.perf_counter() < warm_until:
            next(it)
            n += 1
        c0, t1, n = tree_cpu(), time.perf_counter(), 0
        stop = t1 + spec["max_s"]
        try:  # the window ends at the epoch's end at the latest (an epoch is 3,051 batches)
            while n < spec["batches"] and (n < spec["min_batches"] or time.perf_counter() < stop):
                next(it)
                n += 1
        except StopIteration:
            pass
        dt, cpu = time.perf_counter() - t1, tree_cpu() - c0
        out.update(
            batches=n,
            samples_per_s=n * BATCH / dt,
            tokens_per_s=n * BATCH * SEQ / dt,
            cpu_s_per_1k=1000 * cpu / n,
        )
    out["maxrss_self_mib"] = psutil.Process().memory_info().rss / 2**20
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    warnings.simplefilter("ignore")
    if spec["peer"].startswith("remote-"):
        from .remote import measure_remote

        out = measure_remote(spec)
    else:
        out = measure(spec)
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # worker pools and obstore's runtime need no orderly interpreter teardown here


if __name__ == "__main__":
    main()
