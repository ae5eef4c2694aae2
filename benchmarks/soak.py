"""Soak: epochs of loading through a faulty proxy with worker processes killed; nothing lost or leaked.

    python -m benchmarks soak                  # 10 minutes
    python -m benchmarks soak --minutes 2      # a short check

A stream dataset whose tokens are their own positions (so each delivered sample names itself)
is served on 127.0.0.1 by nginx, or by moto's S3 server where nginx is not installed, behind the
test suite's fault proxy (``guideloom_dev/servers.py``): 1 request in ``--fail-every`` (5) is
reset, cut short or answered 503, and every ``--stall-every`` seconds (20) the proxy stops
answering for ``--stall-for`` seconds (3), longer than a request's ``--timeout`` (2). A thread
SIGKILLs a random collate worker process every 5-15 s. ``StatefulDataLoader`` runs with
``num_workers=2, parallel_method="process"``, shuffled; on an error (which must be a guideloom or
OS error with a message) the loader is closed, a new one is built and resumes from the last
``state_dict()``. Each epoch must deliver every sample exactly once: lost and duplicated samples
are counted. At the end: every loader closed, no guideloom thread, no worker process and no new
``/dev/shm`` entry left. The run stops by itself at ``--minutes``, even if a read hangs.

Only public API (``guideloom.*``) is used. The exit status is 0 when lost, duplicated, unclear
errors and leaks are all zero.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import guideloom as gl

SEQ = 64  # tokens per sample
BATCH = 16
SAMPLES = 4096  # 256 batches an epoch; 1 MiB of uint32 tokens
# The loader's worker processes are forked from multiprocessing's fork server (children of it,
# with its command line); the server and Python's resource tracker (one per interpreter, by
# design outliving every pool) are not workers.
_TRACKER_MARK = b"resource_tracker"
_POOL_THREADS = ("guideloom-io",)  # the process-wide obstore I/O pool: idle threads, joined at exit


def collate(samples: Sequence[np.ndarray]) -> np.ndarray:
    """The samples' ids (first token // SEQ), after checking each sample is whole and in place."""
    block = np.asarray(samples)
    if block.shape != (len(samples), SEQ):
        raise AssertionError(f"a batch of shape {block.shape}, expected ({len(samples)}, {SEQ})")
    ids = block[:, 0] // SEQ
    if np.any(block[:, 0] % SEQ) or not np.array_equal(
        block, block[:, :1] + np.arange(SEQ, dtype=block.dtype)
    ):
        raise AssertionError("a sample does not hold the tokens of its position")
    return ids.astype(np.int64)


# -- processes and leaks (Linux /proc: no dependency) --------------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(p) for p in fh.read().split()]
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids() -> list[int]:
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if server is None:
        return []
    return [p for p in _children(server) if _TRACKER_MARK not in _cmdline(p) and _alive(p)]


def guideloom_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if (t.name.startswith("guideloom") and not t.name.startswith(_POOL_THREADS))
        or t.name.startswith(("ExecutorManagerThread", "QueueFeederThread"))
    )


def shm_entries() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


# -- the servers -------------------------------------------------------------------------------------
def write_dataset(folder: Path) -> None:
    tokens = np.arange(SAMPLES * SEQ, dtype=np.uint32)
    gl.write_stream(folder, (tokens[i : i + 2**16] for i in range(0, len(tokens), 2**16)), overwrite=True)


@contextlib.contextmanager
def serve(root: Path) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(dataset URL through the fault proxy, open_stream options, the proxy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from guideloom_dev.servers import FaultProxy, MotoS3, Nginx, nginx_binary

    write_dataset(root / "soak")
    with contextlib.ExitStack() as stack:
        if nginx_binary() is not None:
            nginx = Nginx(root)
            stack.callback(nginx.stop)
            port, options, path = nginx.port, {}, "soak"
            server = "nginx"
        else:
            s3 = MotoS3()
            stack.callback(s3.stop)
            s3.create_bucket("soak")
            s3.upload_folder(root / "soak", "soak", "soak")
            port, path, server = s3.port, "soak/soak", "moto S3"
        proxy = FaultProxy(port, lifetime=24 * 3600).start()
        stack.callback(proxy.stop)
        if server == "moto S3":
            options = s3.options(endpoint=proxy.url)
            url = f"s3://{path}"
        else:
            url = f"{proxy.url}/{path}"
        print(f"serving {SAMPLES} samples of {SEQ} tokens with {server} behind the fault proxy", flush=True)
        yield url, options, proxy


# -- fault injection -----------------------------------------------------------------------------------
class Chaos:
    """Stall windows on the proxy and SIGKILLed collate workers, on a daemon thread."""

    def __init__(self, proxy: Any, stall_every: float, stall_for: float, rng: random.Random) -> None:
        self.proxy, self.stall_every, self.stall_for, self.rng = proxy, stall_every, stall_for, rng
        self.kills = 0
        self.stalls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-chaos", daemon=True)

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.proxy.stall = False

    def _run(self) -> None:
        next_kill = time.monotonic() + self.rng.uniform(5, 15)
        next_stall = time.monotonic() + self.stall_every
        while not self._stop.wait(0.1):
            now = time.monotonic()
            if self.stall_every and now >= next_stall:
                self.proxy.stall = True
                self.stalls += 1
                self._stop.wait(self.stall_for)
                self.proxy.stall = False
                next_stall = time.monotonic() + self.stall_every
            if now >= next_kill:
                pids = worker_pids()
                if pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.rng.choice(pids), signal.SIGKILL)
                        self.kills += 1
                next_kill = now + self.rng.uniform(5, 15)


# -- the loop -------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, url: str, options: dict[str, Any], args: argparse.Namespace) -> None:
        self.url, self.options, self.args = url, options, args
        self.deadline = time.monotonic() + args.minutes * 60
        self.errors: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()  # the first words of each error, to read them
        self.unclear: list[str] = []
        self.epochs = self.batches = self.samples = self.resumes = 0
        self.lost = self.duplicated = 0
        self.state: Any = None  # the last state_dict() after a delivered batch
        self.seen: Counter[int] = Counter()  # sample id -> deliveries in the current epoch
        self.epoch = 0
        self.loader: Any = None
        self.open_loaders = 0

    def _error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] += 1
        self.messages[re.sub(r"\d+(\.\d+)?", "N", f"{name}: {exc}")[:150]] += 1
        clear = isinstance(exc, gl.GuideloomError | OSError) and bool(str(exc).strip())
        if not clear:
            self.unclear.append(f"{name}: {exc!r}"[:300])

    def _new_loader(self) -> Any:
        storage = gl.open_stream(
            self.url, timeout=self.args.timeout, retries=self.args.retries, retry_timeout=10, **self.options
        )
        loader = gl.StatefulDataLoader.from_storage(
            storage,
            collate,
            sequence_length=SEQ,
            local_batch_size=BATCH,
            num_workers=2,
            parallel_method="process",
            shuffle=True,
            shuffle_seed=7,
            prefetch=4,
        )
        if self.state is not None:
            loader.load_state_dict(self.state)
        return loader

    def _end_epoch(self) -> None:
        lost = SAMPLES - len(self.seen)
        duplicated = sum(n - 1 for n in self.seen.values())
        self.lost += lost
        self.duplicated += duplicated
        if lost or duplicated:
            print(f"  epoch {self.epoch}: {lost} samples lost, {duplicated} duplicated", flush=True)
        self.epochs += 1
        self.epoch += 1
        self.seen = Counter()

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                self.loader = self._new_loader()
            except Exception as exc:  # opening reads the manifest through the faulty proxy too
                self._error(exc)
                time.sleep(0.2)
                continue
            self.open_loaders += 1
            try:
                with self.loader:
                    epoch = self.loader.state_dict()["epoch"]
                    if epoch != self.epoch:
                        raise AssertionError(f"resumed in epoch {epoch}, expected {self.epoch}")
                    while time.monotonic() < self.deadline:
                        for ids in self.loader:
                            self.seen.update(ids.tolist())
                            self.batches += 1
                            self.samples += len(ids)
                            self.state = self.loader.state_dict()
                            if time.monotonic() >= self.deadline:
                                return
                        self._end_epoch()
                        self.state = self.loader.state_dict()
            except AssertionError:
                raise
            except Exception as exc:
                self._error(exc)
                self.resumes += 1
            finally:
                self.open_loaders -= 1
                self.loader = None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to load (default 10)")
    ap.add_argument("--fail-every", type=int, default=5, help="1 request in N is reset, cut or 503 (5)")
    ap.add_argument("--stall-every", type=float, default=20.0, help="seconds between stalls (20; 0: none)")
    ap.add_argument("--stall-for", type=float, default=3.0, help="seconds each stall lasts (3)")
    ap.add_argument("--timeout", type=float, default=2.0, help="open_stream timeout per request (2)")
    ap.add_argument("--retries", type=int, default=3, help="open_stream retries (3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shm_before = shm_entries()
    threads_before = set(guideloom_threads())
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="guideloom-soak-") as tmp,
        serve(Path(tmp)) as (url, options, proxy),
    ):
        proxy.fail_every = args.fail_every
        proxy.fault_kinds = ("reset", "503", "truncate")
        soak = Soak(url, options, args)
        # Bounded even if a read hangs: past the deadline, close the loader from here; past a
        # grace period more, report and leave without waiting.
        done = threading.Event()

        def watchdog() -> None:
            if done.wait(args.minutes * 60 + 30):
                return
            loader = soak.loader
            print("watchdog: the loop is stuck past the deadline; closing its loader", flush=True)
            if loader is not None:
                with contextlib.suppress(Exception):
                    loader.close()
            if not done.wait(60):
                print("watchdog: still stuck 60 s after close(); exiting (a hang: a failure)", flush=True)
                os._exit(3)

        threading.Thread(target=watchdog, name="soak-watchdog", daemon=True).start()
        with Chaos(proxy, args.stall_every, args.stall_for, random.Random(args.seed)) as chaos:
            try:
                soak.run()
            finally:
                done.set()
        stats = proxy.stats
    elapsed = time.monotonic() - started
    soak.duplicated += sum(n - 1 for n in soak.seen.values())  # the epoch under way at the deadline
    # Workers and threads end as their loader closes; give the OS a moment to reap them.
    gc.collect()  # a broken pool's queues (and their named semaphores) go with their last reference
    limit = time.monotonic() + 10
    while (worker_pids() or set(guideloom_threads()) - threads_before) and time.monotonic() < limit:
        time.sleep(0.1)
    left_threads = sorted(set(guideloom_threads()) - threads_before)
    left_workers = worker_pids()
    left_shm = sorted(shm_entries() - shm_before)
    pool = sum(t.name.startswith(_POOL_THREADS) for t in threading.enumerate())
    leaks = len(left_threads) + len(left_workers) + len(left_shm) + soak.open_loaders
    print(
        f"soak: {elapsed / 60:.1f} min, {soak.epochs} epochs, {soak.batches:,} batches, "
        f"{soak.samples:,} samples, {soak.resumes} resumes from state_dict()\n"
        f"  faults injected: {stats.requests:,} requests, {stats.faults:,} failed "
        f"({', '.join(f'{k} {v}' for k, v in sorted(stats.faults_by_kind.items()))}), "
        f"{chaos.stalls} stalls of {args.stall_for:g} s, {chaos.kills} workers killed\n"
        f"  errors: {', '.join(f'{k} {v}' for k, v in soak.errors.most_common()) or 'none'}; "
        f"unclear {len(soak.unclear)}\n"
        f"  lost={soak.lost} duplicated={soak.duplicated} leaks={leaks} (threads {left_threads}, "
        f"worker processes {left_workers}, /dev/shm {left_shm}, loaders open {soak.open_loaders}; "
        f"shared I/O pool threads {pool})",
        flush=True,
    )
    for message, n in soak.messages.most_common(8):
        print(f"  {n:4d} x {message}")
    for line in soak.unclear[:10]:
        print(f"  unclear error: {line}")
    if soak.lost or soak.duplicated or soak.unclear or leaks:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
