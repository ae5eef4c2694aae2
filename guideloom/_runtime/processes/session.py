"""One iterator's use of a process worker pool (:class:`Session`): it sends the workers its
epoch and its groups, and takes in their batches as they come back."""

from __future__ import annotations

import asyncio
import ctypes
import math
import pickle
import weakref
from typing import Any, Protocol

from guideloom._core.delivery import Delivery
from guideloom._core.plan import BatchSpec
from guideloom._errors import WorkerError
from guideloom._runtime.processes.pack import Segment, pack_samples
from guideloom._runtime.processes.proc import Group, Proc
from guideloom._runtime.processes.shm import release
from guideloom._runtime.processes.wire import End, GroupDone, PickleEntry, Samples, Task

__all__ = ["AHEAD_BYTES", "GROUP_MOST", "GROUP_WORK_S", "Pool", "Session", "detach"]


class Pool(Protocol):
    """The pool as its sessions see it (:class:`~guideloom._runtime.processes.pool.WorkerPool`)."""

    #: What the workers reported last (a session's moving averages), for the next session.
    measured: tuple[float | None, float | None, float | None]
    dataset: Any

    def live(self) -> list[Proc]: ...

    def mark_dead(self, p: Proc) -> None: ...


#: The workers' work (a batch's read and collate, as they measure it) a task of cheap batches
#: holds (:meth:`Processes.credit_batches`): a round trip through the pipes, two wake-ups, costs
#: about a millisecond on a busy machine.
GROUP_WORK_S = 0.002
#: What the credits' tasks of cheap batches hold at most together (the batches' bytes, as the
#: workers wrote them): what is made ahead stays small however cheap the batches are, and within
#: the caches the workers and the consumer share (measured: tasks of 2 MiB at 7 credits cost the
#: workers twice the CPU of tasks of 1 MiB).
AHEAD_BYTES = 8 << 20
#: The batches a task of cheap batches holds at most, however small and cheap: a task's batches
#: are timed together where the collate's place is measured.
GROUP_MOST = 32


def _moving(average: float | None, value: float) -> float:
    """An exponential moving average of what the workers report, group by group."""
    return value if average is None else 0.8 * average + 0.2 * value


class Session:
    """One iterator's use of a pool: it sends its epoch, then groups, and reads their batches."""

    def __init__(self, pool: Pool, token: int) -> None:
        self.pool = pool
        self.token = token
        self.groups: dict[int, Group] = {}
        #: The segments of the samples sent with groups, by gid, until the worker answers.
        self.inputs: dict[int, tuple[Proc, Segment]] = {}
        self._gid = 0
        self._ended = False
        # Moving averages of what the workers report, or None before any group came back (to
        # this session, or to the pool's last one: the same dataset and collate):
        #: seconds a batch's read takes in the workers: what reading it inline would cost once
        #: pages are mapped;
        self.read_per_batch: float | None = pool.measured[0]
        #: seconds a batch's read and collate take in the workers: about what making it inline
        #: would cost;
        self.work_per_batch: float | None = pool.measured[1]
        #: bytes a batch takes in its group's slot and message.
        self.bytes_per_batch: float | None = pool.measured[2]
        #: The last answer of :meth:`credit_batches`, with what it was worked out from.
        self._credit: tuple[tuple[float | None, float | None, int], int] = ((None, None, -1), 1)

    def credit_batches(self, credits: int) -> int:
        """Batches a credit stands for: 1, or once the workers have reported that a batch's work
        is cheap, a task of about :data:`GROUP_WORK_S` of it (a round trip through the pipes,
        a wake-up of each process, then costs less than the batches it brings), of
        :data:`GROUP_MOST` batches at most, and of no more than the ``credits`` tasks' share of
        :data:`AHEAD_BYTES` (the batches' bytes as the workers wrote them)."""
        key = (self.work_per_batch, self.bytes_per_batch, credits)
        work, nbytes, _ = key
        if key == self._credit[0]:  # asked at each fill: the measures move once a group is back
            return self._credit[1]
        if work is None or work >= GROUP_WORK_S:
            n = 1
        else:
            n = min(GROUP_MOST, math.ceil(GROUP_WORK_S / max(work, 1e-6)))
            if nbytes:
                n = min(n, int(AHEAD_BYTES // (max(1, credits) * nbytes)))
        self._credit = key, max(1, n)
        return self._credit[1]

    def members(self) -> list[Proc]:
        """The live workers sent this session's epoch (a worker still starting gets it once it
        is ready)."""
        return [p for p in self.pool.live() if p.epoch is not None and p.epoch.token == self.token]

    def end(self, tell: bool = True) -> None:
        """Tell the workers to drop what is left of this iterator's groups (``tell``: false where
        the next session's epoch, sent to every live worker, drops them). Idempotent."""
        if self._ended:
            return
        self._ended = True
        for p in self.pool.live() if tell else ():
            p.post(End(self.token))  # never blocks: a stopped worker is stopped by the close
        for gid in list(self.inputs):
            self._free_input(gid)

    def _free_input(self, gid: int) -> None:
        """The segment of the samples sent with group ``gid`` may take the worker's next ones.
        At the end of a session, a group the worker has not answered for yet is one nobody waits
        for: the worker takes its tasks in order, so the next one's samples never reach it
        before it is done with that group."""
        held = self.inputs.pop(gid, None)
        if held is not None:
            held[0].inputs.give_back(held[1])

    # -- reading results (on the loop) -----------------------------------------------------------
    def _on_readable(self, p: Proc, loop: asyncio.AbstractEventLoop) -> None:
        if not self.receive(p):
            loop.remove_reader(p.fd)

    def receive(self, p: Proc) -> bool:
        """Take in the messages that ``p``'s pipe holds now; False once the worker is gone (its
        groups then fail with a :class:`~guideloom.WorkerError` at the first batch each owed)."""
        frames = p.read_frames()
        if frames is None:
            self.pool.mark_dead(p)
            for g in self.groups.values():
                if g.proc is p and not g.done:  # a done group has all it owed
                    first, last = g.specs[g.received].step, g.specs[-1].step
                    what = f"batch {first}" if first == last else f"batches {first}-{last} (one task)"
                    g.fail(
                        WorkerError(
                            f"guideloom worker process {p.index} (pid {p.proc.pid}) died "
                            f"({p.describe_exit()}) while reading or collating {what}"
                        )
                    )
            return False
        for frame in frames:
            self._on_message(p, pickle.loads(frame))
        return True

    def _on_message(self, p: Proc, msg: GroupDone) -> None:
        token, gid, entries, slot, read_s, work_s, reads, slot_bytes = msg
        if token == self.token:
            self._free_input(gid)
        if reads != (0, 0) and (storage := self.pool.dataset.storage) is not None:
            storage.add_read_counts(*reads)  # what stats() reports counts the workers' reads
        self.read_per_batch = _moving(self.read_per_batch, read_s)
        self.work_per_batch = _moving(self.work_per_batch, work_s)
        nbytes = sum(len(e.data) for e in entries if isinstance(e, PickleEntry))
        per = (nbytes + slot_bytes) / max(1, len(entries))
        self.bytes_per_batch = _moving(self.bytes_per_batch, per)
        self.pool.measured = (self.read_per_batch, self.work_per_batch, self.bytes_per_batch)
        g = self.groups.get(gid) if token == self.token else None
        holder: Any = None
        if slot is not None:
            i, name, size = slot
            mm = p.map_slot(i, name, size)
            holder = (ctypes.c_char * size).from_buffer(mm)  # the group's arrays are views of it
            weakref.finalize(holder, release, p.state, i)  # freed with the group's last array
        if g is None or g.done:
            return  # an ended iterator's batches: dropping them frees their slot
        for entry in entries:
            spec = g.specs[g.received]
            assert spec.step == entry.step, (spec, entry.step)
            try:
                d = entry.delivery(spec, holder)
            except Exception as exc:
                d = Delivery(spec, error=exc)
            g.add(d)
        if g is not None and not g.done:
            g.fail(RuntimeError(f"guideloom bug: a worker returned {g.received} of {len(g.specs)} batches"))
        if g is not None and g.proc is not None:
            g.proc.inflight -= 1

    def submit(self, specs: list[BatchSpec], samples: list[Any] | None = None) -> Group:
        """Send consecutive batches to the least busy live worker as one group: to read and
        collate, or to collate from ``samples`` (each batch's, read by the main process)."""
        self._gid += 1
        live = [p for p in self.members() if p.running()]
        if not live:
            g = Group(self._gid, specs, None)
            g.fail(WorkerError("every guideloom worker process has died"))
            return g
        p = min(live, key=lambda q: q.inflight)
        g = self.groups[self._gid] = Group(self._gid, specs, p)
        try:
            sent = None if samples is None else self._pack(p, g.gid, samples)
        except Exception as exc:  # samples that do not pickle, or no room in /dev/shm
            self._free_input(g.gid)
            g.fail(exc)
            return g
        try:
            p.send(Task(self.token, g.gid, specs[0].step, specs[-1].step + 1, sent))
        except (OSError, ValueError) as exc:
            self._free_input(g.gid)
            g.fail(WorkerError(f"guideloom worker process {p.index} died: {exc}"))
            return g
        p.inflight += 1
        return g

    def _pack(self, p: Proc, gid: int, samples: list[Any]) -> Samples:
        """``samples`` as they travel to ``p``, in one of its input segments (given back when
        it answers for the group)."""
        sent, seg = pack_samples(samples, p.inputs.take)
        if seg is not None:
            self.inputs[gid] = (p, seg)
        return sent


def detach(loop: asyncio.AbstractEventLoop, procs: list[Proc], session: object) -> None:
    """Stop reading the pipes of ``procs`` on ``loop``, those ``session`` still reads."""
    for p in procs:
        if p.reader is not session:  # a later session reads this pipe now: not ours to remove
            continue
        p.reader = None
        try:
            loop.remove_reader(p.fd)
        except (OSError, ValueError):
            pass
