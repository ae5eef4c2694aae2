"""Following a fault-tolerant quorum: samples lost and repeated, and the consumer's cost per step.

    python -m benchmarks torchft [--samples 6000] [--kills 24] [--seed 0]
    python -m benchmarks torchft --replan [--changes 200]   # next() after set_geometry, per worker kind

Three replica groups train one epoch step by step, as torchft runs them. One failure schedule
(drawn from ``--seed``) is run by both loaders: at random steps a live replica dies during the
step (no replica commits it), stays down a few steps, comes back, and heals for one step (not
participating: torchft zeroes its gradients) before it takes part again.

- torchft's ``torchft.data.DistributedSampler`` under torchdata's ``StatefulDataLoader``, one
  per replica over its own shard (``num_replica_groups=3``), as torchft's DDP example has it, with
  each replica's loader state saved at every committed step (what torchft's maintainers advise):
  a replica that comes back resumes its own shard from its last save. A step's batches count
  when it commits; the job ends when a live replica's shard ends.
- guideloom: one loader per replica, :meth:`set_geometry` each step to the quorum's rank and
  size, :meth:`commit` or :meth:`rollback` at its end, and a replica that comes back loading a
  live peer's ``state_dict(committed=True)`` (as :class:`guideloom.torchft.FaultTolerantLoader`
  does through the Manager). ``prefetch=4`` and 2 thread workers.

Prints samples lost (never committed in the epoch) and repeated (committed more than once) by
each, and guideloom's cost on the consumer's side of following the quorum: the time in
``set_geometry``, ``commit`` and ``rollback`` a step (the re-plan at a change of quorum
included), mean and worst, and mean over the steps where the quorum changed.

``--replan`` measures the consumer's wait at a change of quorum alone, for each kind of worker:
one loader over a stream of 10M tokens on local disk (``sequence_length=2048``,
``local_batch_size=8``, shuffle on, ``prefetch=4``, 2 thread or 2 process workers), each step
holding the consumer 5 ms (its training step: the read-ahead is full when the geometry changes),
changes its geometry (rank and world size 1 to 4, drawn from ``--seed``) ``--changes`` times,
two steps between changes. Prints ``set_geometry``, the first ``next()`` after it, both, and
``next()`` on the steps between, median and p90 (ms), for thread and process workers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import guideloom as gl
from benchmarks import summary

REPLICAS = 3
BATCH = 4


@dataclass
class Schedule:
    """Per step: the live replicas, the healing one (if any), and whether the step commits."""

    steps: list[tuple[frozenset[int], int | None, bool]] = field(default_factory=list)


def draw(kills: int, seed: int, steps: int) -> Schedule:
    """``kills`` deaths at random steps among the first ``steps`` (an epoch's at full strength);
    each replica down 1 to 5 steps; then as many steps again without one (the epoch's end)."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(3, steps - 10), kills))
    steps *= 2
    down: dict[int, int] = {}  # replica -> the step it comes back at
    out = Schedule()
    for step in range(steps):
        back = [r for r, s in down.items() if s == step]
        for r in back:
            del down[r]
        heal = back[0] if back else None
        live = frozenset(r for r in range(REPLICAS) if r not in down)
        commits = True
        # a death drawn for a step with too few live replicas happens at the next step that has them
        if at and at[0] <= step and len(live) - (heal is not None) >= 2:
            at.pop(0)
            victim = rng.choice(sorted(r for r in live if r != heal))
            down[victim] = step + rng.randint(1, 5)
            commits = False  # it dies during the step: the step fails everywhere
        out.steps.append((live, heal, commits))
    return out


def _ids(samples: Any) -> list[int]:
    return [int(s[0]) // 4 for s in samples]


def run_guideloom(
    n: int, schedule: Schedule, waits: list[tuple[float, bool]]
) -> tuple[Counter[int], list[float], list[float]]:
    """The schedule through guideloom's loaders; committed samples, cost per step (the slowest
    replica's), cost at the steps that change the quorum; ``waits`` gets each ``next()``'s time
    and whether a re-plan came before it."""
    storage = gl.MemoryStreamStorage(np.arange(n * 4, dtype=np.int64))
    loaders = [
        gl.StatefulDataLoader.from_storage(
            storage,
            _ids,
            sequence_length=4,
            local_batch_size=BATCH,
            shuffle=True,
            shuffle_seed=3,
            drop_last=False,
            prefetch=4,
            num_workers=2,
            device=torch.device("cpu"),
        )
        for _ in range(REPLICAS)
    ]
    its: list[Any] = [None] * REPLICAS
    committed: Counter[int] = Counter()
    costs: list[float] = []
    at_changes: list[float] = []
    prev: tuple[int, ...] = ()
    changed = True  # the next step's batch follows a re-plan
    for ld in loaders:
        ld.open()
    try:
        for step, (live, heal, commits) in enumerate(schedule.steps):
            for r in sorted(live):
                if its[r] is None or r == heal:  # (re)joins: the committed state of a live peer
                    if its[r] is not None:
                        its[r].close()
                    peer = next(
                        (p for p in sorted(live) if its[p] is not None and p != r and p != heal), None
                    )
                    if peer is not None and step:
                        loaders[r].load_state_dict(loaders[peer].state_dict(committed=True))
                    its[r] = iter(loaders[r])
            for r in range(REPLICAS):
                if r not in live and its[r] is not None:  # died: its process is gone
                    its[r].close()
                    its[r] = None
            participants = [r for r in sorted(live) if r != heal]
            spent = dict.fromkeys(live, 0.0)
            ended = False
            got: dict[int, list[int]] = {}
            for r in sorted(live):
                rank = participants.index(r) if r in participants else 0
                t0 = time.perf_counter()
                loaders[r].set_geometry(rank=rank, world_size=len(participants))
                t1 = time.perf_counter()
                batch = next(its[r], None)
                waits.append((time.perf_counter() - t1, changed))
                spent[r] += t1 - t0
                if batch is None:
                    ended = True
                    continue
                got[r] = batch
            if ended:
                break
            for r in sorted(live):
                t0 = time.perf_counter()
                loaders[r].commit() if commits else loaders[r].rollback()
                spent[r] += time.perf_counter() - t0
                if commits and r in participants:
                    committed.update(got[r])
            worst = max(spent.values())
            costs.append(worst)
            key = tuple(participants)
            changed = key != prev or not commits
            if changed:
                at_changes.append(worst)
            prev = key
    finally:
        for it in its:
            if it is not None:
                it.close()
        for ld in loaders:
            ld.close()
    return committed, costs, at_changes


def run_torchft_sampler(n: int, schedule: Schedule) -> Counter[int]:
    """The schedule through torchft's DistributedSampler under torchdata's StatefulDataLoader."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchft.data import DistributedSampler

    data = list(range(n))
    samplers = [
        DistributedSampler(
            data,
            replica_rank=r,
            num_replica_groups=REPLICAS,
            group_rank=0,
            num_replicas=1,
            shuffle=True,
            seed=3,
        )
        for r in range(REPLICAS)
    ]

    def loader(r: int) -> Any:
        return StatefulDataLoader(data, batch_size=BATCH, sampler=samplers[r], collate_fn=list)

    loaders = [loader(r) for r in range(REPLICAS)]
    its: list[Any] = [iter(ld) for ld in loaders]
    saved: list[Any] = [ld.state_dict() for ld in loaders]
    committed: Counter[int] = Counter()
    for live, heal, commits in schedule.steps:
        for r in range(REPLICAS):
            if r not in live and its[r] is not None:
                its[r] = None
            elif r in live and its[r] is None:  # comes back: its own last save
                loaders[r] = loader(r)
                loaders[r].load_state_dict(saved[r])
                its[r] = iter(loaders[r])
        got = {r: next(its[r], None) for r in sorted(live)}
        if any(b is None for b in got.values()):
            break
        if commits:
            for r in sorted(live):
                if r != heal:
                    committed.update(got[r])  # type: ignore[arg-type]
                saved[r] = loaders[r].state_dict()
    return committed


def lost_repeated(committed: Counter[int], n: int) -> tuple[int, int]:
    return n - len(set(committed) & set(range(n))), sum(c - 1 for c in committed.values() if c > 1)


REPLAN_SEQ = 2048
REPLAN_BATCH = 8
REPLAN_TOKENS = 10_000_000


def _rows(samples: Any) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def replan_waits(
    path: Any, method: str, changes: int, seed: int, step_s: float = 0.005, steady: int = 2
) -> tuple[list[float], list[float], list[float]]:
    """``changes`` changes of geometry of one loader with 2 ``method`` workers; the seconds of
    each ``set_geometry``, of the first ``next()`` after it, and of ``next()`` on steady steps.
    Each step holds the consumer ``step_s`` (its training step: the read-ahead fills meanwhile)."""
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        _rows,
        sequence_length=REPLAN_SEQ,
        local_batch_size=REPLAN_BATCH,
        shuffle=True,
        shuffle_seed=0,
        prefetch=4,
        num_workers=2,
        parallel_method=method,  # type: ignore[arg-type]
        device=torch.device("cpu"),
    )
    rng = random.Random(seed)
    sets: list[float] = []
    firsts: list[float] = []
    steadies: list[float] = []
    loader.open()
    it = iter(loader)

    def step() -> float | None:
        """One training step: its ``next()``'s seconds (None at an epoch's end: the next epoch's
        first batch, not counted)."""
        nonlocal it
        t0 = time.perf_counter()
        batch = next(it, None)
        dt: float | None = time.perf_counter() - t0
        if batch is None:
            it.close()
            it = iter(loader)
            next(it)
            dt = None
        loader.commit()
        time.sleep(step_s)
        return dt

    try:
        for _ in range(8):  # the workers up, warm
            step()
        geometry = (loader.rank, loader.world_size)
        while len(firsts) < changes:
            for _ in range(steady):
                if (dt := step()) is not None:
                    steadies.append(dt)
            world = rng.randint(1, 4)
            new = (rng.randrange(world), world)
            if new == geometry:
                continue
            geometry = new
            t0 = time.perf_counter()
            loader.set_geometry(rank=new[0], world_size=new[1])
            spent = time.perf_counter() - t0
            if (dt := step()) is not None:
                sets.append(spent)
                firsts.append(dt)
    finally:
        it.close()
        loader.close()
    return sets, firsts, steadies


def _median_p90(xs: list[float]) -> str:
    ms = sorted(x * 1e3 for x in xs)
    return f"{statistics.median(ms):.3f} / {ms[int(0.9 * (len(ms) - 1))]:.3f}"


def replan_main(changes: int, seed: int) -> None:
    from benchmarks.local_stream import ensure_dataset

    path = ensure_dataset(REPLAN_TOKENS)
    print(
        f"{REPLAN_TOKENS:,} tokens, sequence_length={REPLAN_SEQ}, local_batch_size={REPLAN_BATCH}, "
        f"prefetch=4, 2 workers, {changes} changes of geometry (ms, median / p90)"
    )
    print(f"{'workers':<10} {'set_geometry':>14} {'next() after':>14} {'both':>14} {'next() between':>15}")
    for method in ("thread", "process"):
        sets, firsts, steadies = replan_waits(path, method, changes, seed)
        both = [a + b for a, b in zip(sets, firsts, strict=True)]
        print(
            f"{method:<10} {_median_p90(sets):>14} {_median_p90(firsts):>14} {_median_p90(both):>14} "
            f"{_median_p90(steadies):>15}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks torchft", description=summary(__doc__))
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replan", action="store_true", help="only next() after set_geometry, per worker kind")
    ap.add_argument("--changes", type=int, default=200, help="changes of geometry with --replan")
    args = ap.parse_args(argv)
    if args.replan:
        replan_main(args.changes, args.seed)
        return
    n = args.samples
    schedule = draw(args.kills, args.seed, steps=n // (BATCH * REPLICAS))
    kills = sum(1 for _, _, c in schedule.steps if not c)
    print(f"{REPLICAS} replica groups, {n} samples, local batch {BATCH}, {kills} kills and rejoins")
    t0 = time.perf_counter()
    sampler = lost_repeated(run_torchft_sampler(n, schedule), n)
    waits: list[tuple[float, bool]] = []
    committed, costs, changes = run_guideloom(n, schedule, waits)
    mine = lost_repeated(committed, n)
    print(f"{'loader':<52} {'lost':>6} {'repeated':>9}")
    print(
        f"{'torchft DistributedSampler + torchdata StatefulDataLoader':<52} {sampler[0]:>6} {sampler[1]:>9}"
    )
    print(f"{'guideloom (set_geometry, commit/rollback)':<52} {mine[0]:>6} {mine[1]:>9}")
    ms = [c * 1e3 for c in costs]
    at = [c * 1e3 for c in changes]
    print(
        f"guideloom, following the quorum: {statistics.mean(ms):.3f} ms a step (worst {max(ms):.3f} ms, "
        f"{len(ms)} steps); at a change of quorum {statistics.mean(at):.3f} ms ({len(at)} changes); "
        f"prefetch=4, 2 thread workers; {time.perf_counter() - t0:.1f} s in all"
    )
    steady = [w * 1e3 for w, c in waits if not c]
    after = [w * 1e3 for w, c in waits if c]
    print(
        f"next() waited {statistics.mean(steady):.3f} ms on steady steps, {statistics.mean(after):.3f} ms "
        "right after a re-plan (the read-ahead of the old geometry dropped)"
    )
    print("target < 1 ms a step: " + ("met" if statistics.mean(ms) < 1 else "NOT met"))
