"""``async for`` over S3 and the caller's event loop: how long the loader keeps the loop from
other tasks, and its throughput against the sync loop, in one run.

    python -m benchmarks async-loop [--mib 64] [--rounds 2] [--latency-ms 0,20]
        [--sequence-length 2048] [--batch 16] [--prefetch 4] [--sequential]

Workload: a uint16 stream (``--mib`` MiB, 4 MiB objects) on a moto S3 server on 127.0.0.1,
directly and behind a proxy that adds ``--latency-ms`` to every request; ``sequence_length=2048``
(4 KiB samples; ``--sequence-length 512``: 1 KiB samples, four times the pieces to plan and copy
a byte), ``local_batch_size=16`` (``--batch``), shuffled with ``shuffle_block_size="auto"``
(``--sequential``: in order), ``prefetch=4`` (``--prefetch``), the README's collate;
``num_workers`` 0 and 2 (threads). A fresh loader per measurement; the epoch is timed from
``open_stream`` (called on a thread from the coroutine, as
docs/async.md says) to its last batch.

Beside each ``async for`` epoch, a heartbeat task on the same loop sleeps 1 ms at a time and
records how late each wake-up was: the loop's stalls. Printed per case: the worst and the 99th
percentile stall, the heartbeat's worst alone on an idle loop right after each epoch and as long
as it (what the machine itself adds, over as many wake-ups), the worst of each less the time
the loop's thread waited for a core meanwhile (``held back``: what this process kept the loop
from, its own work, the GIL, a collection, which the machine's load does not add to), and tokens
per second of ``async for`` against the sync ``for`` over the same data, each an epoch of its own
(the ``async for`` one without the heartbeat, whose wake-ups read the loop thread's scheduler
counts: work on the loop that the sync loop does not carry); the load average before and after.
With ``--gc-freeze`` the objects alive once the imports and the benchmark's own set-up (the S3
server's uploader client) are done are frozen (``gc.freeze()``): a full garbage collection, which
holds the GIL whoever triggers it, then skips them. With ``--why`` each case is followed by what
its late wake-ups were made of (:mod:`benchmarks.stalls`): the loop's own work, the run queue
(the machine's load), or blocked (the GIL, a collection), with the stacks seen meanwhile, and
who had the cores meanwhile: this process's other threads, the servers, the rest of the machine.
``--server-nice 19`` gives the servers' scheduling group the lowest priority (on a loaded machine
they may then starve), ``--server-cpu 1`` pins them to CPU 1 and the loop's process to the
others: what is left of the stalls is not theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import guideloom as gl
from benchmarks import summary
from benchmarks.remote_stream import collate, ensure_dataset, moto_bucket
from benchmarks.stalls import RunQueue, Stalls, thread_cpu

MiB = 2**20
KW: dict[str, Any] = dict(
    sequence_length=2048,
    local_batch_size=16,
    shuffle=True,
    shuffle_seed=0,
    shuffle_block_size="auto",
    prefetch=4,
    device=torch.device("cpu"),
)


def _loader(storage: Any, workers: int) -> Any:
    return gl.StatefulDataLoader.from_storage(
        storage, collate, num_workers=workers, parallel_method="thread", **KW
    )


#: The stall recorder of ``--why`` (None: nothing recorded).
WHY: Stalls | None = None


#: Each wake-up's lateness and, beside it, that lateness less the loop's run-queue wait (seconds).
Late = tuple[list[float], list[float]]


async def _heartbeat(stop: asyncio.Event, late: Late) -> None:
    """Sleep 1 ms at a time until ``stop``; record how late each wake-up was, and how much of it
    the loop's thread was not waiting for a core (seconds)."""
    loop = asyncio.get_running_loop()
    why = WHY
    queue = RunQueue()
    while not stop.is_set():
        t0, q0 = loop.time(), queue.waited()
        if why is not None:
            why.before()
        await asyncio.sleep(0.001)
        lateness = max(0.0, loop.time() - t0 - 0.001)
        late[0].append(lateness)
        late[1].append(max(0.0, lateness - (queue.waited() - q0)))
        if why is not None:
            why.after(lateness)


async def _idle(seconds: float) -> Late:
    stop = asyncio.Event()
    late: Late = ([], [])
    task = asyncio.create_task(_heartbeat(stop, late))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return late


async def _async_epoch(
    url: str, options: dict[str, Any], workers: int, *, beat: bool = True
) -> tuple[float, int, Late]:
    stop = asyncio.Event()
    late: Late = ([], [])
    ticker = asyncio.create_task(_heartbeat(stop, late) if beat else stop.wait())
    await asyncio.sleep(0.01)  # the heartbeat runs before the loader does
    t0 = time.perf_counter()
    # open_stream reads the manifest before it returns: a coroutine calls it on a thread
    loader = _loader(await asyncio.to_thread(gl.open_stream, url, **options), workers)
    n = 0
    async with loader:
        async for batch in loader:
            n += batch.numel()
    seconds = time.perf_counter() - t0
    stop.set()
    await ticker
    return seconds, n, late


def _sync_epoch(url: str, options: dict[str, Any], workers: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    loader = _loader(gl.open_stream(url, **options), workers)
    n = 0
    with loader:
        for batch in loader:
            n += batch.numel()
    return time.perf_counter() - t0, n


def _servers() -> list[int]:
    """The pids of this process's children: the S3 server and the latency proxy."""
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds used so far by processes ``pids`` (user + system)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _renice_servers(nice: int) -> None:
    """Give the servers' scheduling group (each runs in a session of its own, so an autogroup of
    its own on Linux) the niceness ``nice``: how much of a core they take from the loop."""
    for pid in _servers():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _ms(values: list[float], q: float | None = None) -> float:
    if not values:
        return 0.0
    return 1e3 * (max(values) if q is None else float(np.quantile(values, q)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks async-loop", description=summary(__doc__))
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--latency-ms", default="0,20", help="added to every request, comma-separated")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the imports are done")
    ap.add_argument("--why", action="store_true", help="what each case's late wake-ups were made of")
    ap.add_argument("--workers", default="0,2", help="num_workers, comma-separated")
    ap.add_argument("--sequence-length", type=int, default=KW["sequence_length"], help="tokens a sample")
    ap.add_argument("--batch", type=int, default=KW["local_batch_size"], help="local_batch_size")
    ap.add_argument("--prefetch", type=int, default=KW["prefetch"], help="prefetch (default 4)")
    ap.add_argument("--sequential", action="store_true", help="the stream in order (no shuffle)")
    ap.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="niceness of the S3 server's and proxy's scheduling group (19: they yield a core to the loop)",
    )
    ap.add_argument(
        "--server-cpu",
        type=int,
        default=None,
        help="pin the servers to this CPU and this process (the loop) to the others",
    )
    args = ap.parse_args(argv)
    KW.update(sequence_length=args.sequence_length, local_batch_size=args.batch, prefetch=args.prefetch)
    if args.sequential:
        KW.update(shuffle=False)
        del KW["shuffle_block_size"], KW["shuffle_seed"]
    global WHY  # noqa: PLW0603 - the heartbeat reads it
    from guideloom_dev.servers import proxy_process

    root = Path(tempfile.gettempdir()) / "guideloom-bench"
    folder = ensure_dataset(root, args.mib * MiB)
    head = ("case", "worst stall", "p99", "idle worst", "held back", "idle", "async", "sync", "async/sync")
    print(
        f"{head[0]:<22} {head[1]:>12} {head[2]:>8} {head[3]:>11} {head[4]:>10} {head[5]:>8}"
        f" {head[6]:>10} {head[7]:>10} {head[8]:>10}"
    )
    print(f"load average {_load()}", flush=True)
    with moto_bucket(folder) as options:
        if args.gc_freeze:
            gc.freeze()  # what docs/async.md advises a latency-bound program, once set up
        WHY = Stalls() if args.why else None
        port = int(options["endpoint"].rsplit(":", 1)[1])
        for latency in [int(x) for x in args.latency_ms.split(",")]:
            with contextlib.ExitStack() as stack:
                opts = dict(options)
                if latency:
                    proxy = stack.enter_context(proxy_process(port, delay=latency / 1000, lifetime=3600))
                    opts["endpoint"] = f"http://127.0.0.1:{proxy}"
                if args.server_nice:
                    _renice_servers(args.server_nice)
                if args.server_cpu is not None:
                    for pid in _servers():
                        os.sched_setaffinity(pid, {args.server_cpu})
                    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - {args.server_cpu})
                servers = _servers()
                if WHY is not None:
                    WHY.watch(servers)
                for workers in [int(x) for x in args.workers.split(",")]:
                    idle: Late = ([], [])
                    late: Late = ([], [])
                    rate_async: list[float] = []
                    rate_sync: list[float] = []
                    for _ in range(args.rounds):
                        if WHY is not None:
                            WHY.stalls.clear()
                            cpu, server = thread_cpu(), _cpu_of(servers)
                        seconds, n, lates = asyncio.run(_async_epoch("s3://bench/gl", opts, workers))
                        if WHY is not None:
                            used = thread_cpu() - cpu
                            print(
                                f"  epoch {seconds:.2f} s, servers' CPU {_cpu_of(servers) - server:.2f} s,"
                                " CPU s by thread:",
                                {k: round(v, 3) for k, v in used.most_common(4)},
                            )
                            WHY.report(f"{latency} ms, nw={workers}")
                        # the heartbeat alone, as long as the epoch: as many wake-ups to be late
                        alone = asyncio.run(_idle(seconds))
                        idle[0].extend(alone[0])
                        idle[1].extend(alone[1])
                        if WHY is not None:
                            WHY.report("the heartbeat alone", worst=1)
                        late[0].extend(lates[0])
                        late[1].extend(lates[1])
                        # the rate of an epoch with no heartbeat: its wake-ups read the scheduler's
                        # counts on the loop, work that neither the loader nor the sync loop does
                        seconds, n, _ = asyncio.run(_async_epoch("s3://bench/gl", opts, workers, beat=False))
                        rate_async.append(n / seconds)
                        seconds, n = _sync_epoch("s3://bench/gl", opts, workers)
                        rate_sync.append(n / seconds)
                    a, s = statistics.median(rate_async), statistics.median(rate_sync)
                    print(
                        f"{f'{latency} ms, nw={workers}':<22} {_ms(late[0]):>10.1f}ms"
                        f" {_ms(late[0], 0.99):>6.1f}ms {_ms(idle[0]):>9.1f}ms {_ms(late[1]):>8.1f}ms"
                        f" {_ms(idle[1]):>6.1f}ms {a / 1e6:>7.1f}M/s {s / 1e6:>7.1f}M/s {a / s:>10.2f}",
                        flush=True,
                    )

    print(f"load average {_load()}", flush=True)


if __name__ == "__main__":
    main()
