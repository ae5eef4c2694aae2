"""Why an event loop's heartbeat woke late: what ``python -m benchmarks async-loop --why`` prints.

A heartbeat on the loop calls :meth:`Stalls.before` before each 1 ms sleep and :meth:`Stalls.after`
once awake. For every wake-up later than the threshold, the loop thread's own scheduler counts
(``/proc/self/task/<tid>/schedstat``) split the delay into the time the thread ran (the loop's
own work), waited in the kernel's run queue (no core free: the machine's load), and neither
(blocked: waiting for the GIL, or a collection's stop); the CPU time that this process's other
threads and the servers it reads from (:meth:`Stalls.watch`) used meanwhile says who held the
cores (the rest of the cores' time: other processes, or idle); the garbage collections that
overlapped it are listed, and a watchdog thread records the stacks of the loop thread and of every busy
thread while the wake-up is overdue (it needs the GIL to do so: a thread that holds it without
a break is seen once it lets go).
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import time
import traceback
from typing import Any

#: Stack frames at which a thread is idle (waiting for work or for an object store's answer).
IDLE = ("_worker", "_work", "wait", "get", "select", "get_checked", "sleep")


def _schedstat(tid: int) -> tuple[int, int]:
    """(ns on a CPU, ns waiting in the run queue) of thread ``tid`` of this process."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            ran, waited, _ = f.read().split()
        return int(ran), int(waited)
    except OSError:
        return 0, 0


def process_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (Linux's ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``,
    what ``clock_getcpuclockid`` returns): readable for any process, in nanoseconds."""
    return ((~pid) << 3) | 2


def _cpu_ns(clock: int) -> int:
    try:
        return time.clock_gettime_ns(clock)
    except OSError:  # the process ended
        return 0


def thread_cpu() -> collections.Counter[str]:
    """CPU seconds of this process's live threads, by name with the number cut off."""
    names = {t.native_id: t.name.rstrip("0123456789_") for t in threading.enumerate()}
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        out[names.get(int(tid), "other")] += _schedstat(int(tid))[0] / 1e9  # type: ignore[assignment]  # seconds: a Counter of floats
    return out


class RunQueue:
    """The time the thread that makes it has waited in the kernel's run queue so far, from its
    scheduler counts: a wake-up's lateness less what it waited there meanwhile is what this
    process held it back by (its own work, the GIL, a collection), whatever the machine's load."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()

    def waited(self) -> float:
        """Seconds waited for a core so far."""
        return _schedstat(self.tid)[1] / 1e9


class Stalls:
    """The late wake-ups of a heartbeat on one loop, each with its causes (see the module)."""

    def __init__(self, threshold: float = 0.005) -> None:
        self.threshold = threshold
        self.stalls: list[dict[str, Any]] = []
        self._loop_ident = 0
        self._loop_tid = 0
        self._asleep: tuple[float, tuple[int, int], tuple[int, int, int]] | None = None
        #: Processes whose CPU is counted during each stall (the servers the loader reads from).
        self.servers: list[int] = []
        self._server_clocks: list[int] = []
        self._watch_clock = 0
        self._samples: list[tuple[float, str, collections.Counter[str]]] = []
        self._gcs: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=256)
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)
        watchdog = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        watchdog.start()
        assert watchdog.ident is not None
        self._watch_clock = time.pthread_getcpuclockid(watchdog.ident)

    def watch(self, servers: list[int]) -> None:
        """Count the CPU of processes ``servers`` during each stall from now on."""
        self.servers = servers
        self._server_clocks = [process_clock(p) for p in servers]

    def _cpu(self) -> tuple[int, int, int]:
        """(this process's CPU, the watchdog's, the servers') in ns."""
        return (
            time.process_time_ns(),
            _cpu_ns(self._watch_clock),
            sum(_cpu_ns(c) for c in self._server_clocks),
        )

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gcs.append((self._gc_start, time.perf_counter(), info["generation"]))

    def before(self) -> None:
        """The heartbeat goes to sleep (on the loop thread)."""
        if not self._loop_ident:
            self._loop_ident, self._loop_tid = threading.get_ident(), threading.get_native_id()
        self._samples = []
        self._asleep = (time.perf_counter(), _schedstat(self._loop_tid), self._cpu())

    def after(self, late: float) -> None:
        """The heartbeat woke ``late`` seconds late."""
        asleep, self._asleep = self._asleep, None
        if asleep is None or late <= self.threshold:
            return
        t0, (ran0, queued0), (proc0, watch0, serv0) = asleep
        ran1, queued1 = _schedstat(self._loop_tid)
        proc1, watch1, serv1 = self._cpu()
        t1 = time.perf_counter()
        ran, queued = (ran1 - ran0) / 1e6, (queued1 - queued0) / 1e6
        # meanwhile: this process's other threads (the watchdog left out), and the servers
        others = max(0.0, (proc1 - proc0 - (watch1 - watch0)) / 1e6 - ran)
        self.stalls.append(
            {
                "late": late * 1e3,
                "ran": ran,
                "queued": queued,
                "blocked": max(0.0, late * 1e3 - ran - queued),
                "span": (t1 - t0) * 1e3,
                "others": others,
                "servers": (serv1 - serv0) / 1e6,
                "gcs": [(g, (b - a) * 1e3) for a, b, g in list(self._gcs) if b > t0 and a < t1],
                "samples": list(self._samples),
            }
        )

    def _watch(self) -> None:
        me = threading.get_ident()
        while True:
            time.sleep(0.001)
            asleep = self._asleep
            if asleep is None or time.perf_counter() - asleep[0] < 0.001 + self.threshold:
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            loop, busy = "", collections.Counter[str]()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-3:]
                where = " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)
                )
                if ident == self._loop_ident:
                    loop = where
                elif stack and stack[-1].name not in IDLE:
                    busy[f"{names.get(ident, '?').rstrip('0123456789_')}: {where}"] += 1
            self._samples.append(((time.perf_counter() - asleep[0]) * 1e3, loop, busy))
            time.sleep(0.002)

    def report(self, label: str, worst: int = 3) -> None:
        """Print the stalls since the last report (the ``worst`` latest, and those most blocked and
        longest run by the loop), and forget them."""
        st, self.stalls = self.stalls, []
        keys = ("late", "ran", "queued", "blocked", "span", "others", "servers")
        total = {k: sum(s[k] for s in st) for k in keys}
        cores = os.cpu_count() or 1
        print(
            f"  {label}: {len(st)} wake-ups > {self.threshold * 1e3:.0f} ms late,"
            f" {total['late']:.0f} ms in all: loop ran {total['ran']:.0f},"
            f" run queue {total['queued']:.0f}, blocked {total['blocked']:.0f};"
            f" meanwhile of {cores} x {total['span']:.0f} core-ms: this process's other threads"
            f" {total['others']:.0f}, the servers {total['servers']:.0f},"
            f" the rest {cores * total['span'] - total['ran'] - total['others'] - total['servers']:.0f}"
            " (other processes, idle)"
        )
        shown = sorted(st, key=lambda s: -s["late"])[:worst]
        for key in ("blocked", "ran"):  # and the stall most of this process's own making, each way
            most = max(st, key=lambda s: s[key], default=None)
            if most is not None and most[key] >= 2.0 and all(most is not s for s in shown):
                shown.append(most)
        for s in shown:
            gcs = ", ".join(f"gen{g} {ms:.1f}" for g, ms in s["gcs"] if ms >= 0.5) or "-"
            rest = cores * s["span"] - s["ran"] - s["others"] - s["servers"]
            print(
                f"    {s['late']:.1f} ms: loop ran {s['ran']:.1f}, run queue {s['queued']:.1f},"
                f" blocked {s['blocked']:.1f}; collections {gcs}; meanwhile other threads"
                f" {s['others']:.1f}, servers {s['servers']:.1f}, rest {rest:.1f} core-ms"
            )
            for at, loop, busy in s["samples"][:1]:
                print(f"      at {at:.0f} ms the loop: {loop}")
                for where, n in busy.most_common(3):
                    print(f"      {n}x {where}")
