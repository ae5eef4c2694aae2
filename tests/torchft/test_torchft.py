"""Exactly once through replica failures: torchft's own Lighthouse on 127.0.0.1, three replica
groups as processes (gloo on CPU, a tiny model, :class:`~guideloom.torchft.FaultTolerantLoader`),
one joining late, replicas SIGKILLed at random steps and started again. Every replica records
the samples of each step it committed; each sample of the epoch is committed exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

coordination = pytest.importorskip(
    "torchft.coordination", reason="needs torchft: pip install 'guideloom[torchft]'"
)

from guideloom.torchft import FaultTolerantLoader  # noqa: E402
from tests.support.zygote import Child, Zygote  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: A replica group's program, run as ``python -m``: each replica is forked from a zygote that
#: imported it (torch, torchft and guideloom) once for the job (``tests/support/zygote.py``).
REPLICA = "tests.torchft.replica"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_job(
    tmp: Path, *, samples: int, kills: int, seed: int, deadline_s: float, **replica: Any
) -> tuple[list[list[Any]], int]:
    """Run the job until two replicas have finished the epoch; the records, and the kills."""
    rng = random.Random(seed)
    lighthouse = coordination.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=300, quorum_tick_ms=20, heartbeat_timeout_ms=1000
    )
    out = tmp / "records.jsonl"
    procs: dict[int, Child] = {}
    done_kills = 0
    armed: int | None = None
    zygote = Zygote(tmp / "zygote.log", [REPLICA], cwd=ROOT, env=_env())

    def start(r: int) -> None:
        args = ["--replica", str(r)]
        args += ["--lighthouse", lighthouse.address(), "--out", str(out), "--samples", str(samples)]
        for k, v in replica.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        args += ["--ctl", str(tmp)]
        (tmp / f"up-{r}").unlink(missing_ok=True)
        (tmp / f"manager-{r}").unlink(missing_ok=True)
        procs[r] = zygote.start(args, tmp / f"replica{r}.log", module=REPLICA)

    finished: set[int] = set()
    t0 = time.monotonic()
    try:
        start(0)
        start(1)
        while time.monotonic() - t0 < deadline_s:
            time.sleep(0.05)
            if 2 not in procs and out.exists() and out.stat().st_size > 0:
                start(2)  # joins late, once the others have committed steps
            up = [r for r in procs if (tmp / f"up-{r}").exists() and procs[r].poll() is None]
            if armed is None and done_kills < kills and len(up) >= 2 and not finished:
                # one replica at a time, once another holds the job's state too
                armed = rng.choice(up)
                point = rng.choice(["handed", "recorded"])
                # written whole, then renamed: the replica never reads a file not yet written
                (tmp / "arm.tmp").write_text(f"{rng.randint(1, 6)} {point}")
                (tmp / "arm.tmp").replace(tmp / f"arm-{armed}")
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc is None or r in finished:
                    continue
                if rc == -signal.SIGKILL:
                    done_kills += 1
                    armed = None
                    if not finished:
                        start(r)
                    else:
                        finished.add(r)
                elif rc == 0:
                    finished.add(r)
                else:
                    pytest.fail(
                        f"replica {r} exited with {rc}: {(tmp / f'replica{r}.log').read_text()[-3000:]}"
                    )
            if len(finished) >= 2 or (finished and time.monotonic() - t0 > deadline_s / 2):
                break
        else:
            pytest.fail(f"the job did not finish in {deadline_s} s ({done_kills} kills)")
        end = time.monotonic() + 10
        while time.monotonic() < end and any(p.poll() is None for p in procs.values()):
            time.sleep(0.05)  # a replica one step behind finishes or waits alone for a quorum
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        zygote.close()
        lighthouse.shutdown()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return records, done_kills


def check_exactly_once(records: list[list[Any]], samples: int, logs: Path | None = None) -> None:
    """Each sample of epoch 0 in exactly one committed batch; the ranks of a shard (tensor
    parallel) got the same batch, the replicas and shards of a step disjoint ones. A failure names,
    for each repeated sample, the records (epoch, step, replica, rank, world) that committed it,
    and where the replicas' logs are."""
    batches: dict[tuple[int, int, int], list[int]] = {}
    committed_by: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for epoch, step, replica, rank, shard, world, batch in records:
        assert epoch == 0
        key = (step, replica, shard)
        assert batches.setdefault(key, batch) == batch, f"ranks of shard {key} got other batches"
        for i in batch:
            committed_by.setdefault(i, []).append((epoch, step, replica, rank, world))
    counts = Counter(i for b in batches.values() for i in b)
    lost = sorted(set(range(samples)) - set(counts))
    repeated = sorted(i for i, c in counts.items() if c > 1)
    if lost or repeated:
        lines = [f"lost {lost[:20]} ({len(lost)}), repeated {repeated[:20]} ({len(repeated)})"]
        lines += [
            f"sample {i} committed by (epoch, step, replica, rank, world) {committed_by[i]}"
            for i in repeated[:20]
        ]
        if logs is not None:
            lines.append(f"the replicas' logs: {logs}")
        pytest.fail("\n".join(lines))
    assert sorted(counts) == list(range(samples))


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_every_sample_is_committed_once_through_kills_and_a_late_join(tmp_path: Path) -> None:
    records, kills = run_job(tmp_path, samples=150, kills=2, seed=1, deadline_s=90, step_sleep=0.02)
    assert kills == 2
    check_exactly_once(records, 150, tmp_path)
    assert len({r[5] for r in records}) > 1  # the quorum changed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("group_size", "shards"), [(1, 1), (2, 1)], ids=["one-rank", "tp2"])
def test_every_sample_is_committed_once_through_twenty_kills(
    tmp_path: Path, group_size: int, shards: int
) -> None:
    records, kills = run_job(
        tmp_path,
        samples=2400,
        kills=20,
        seed=5 + group_size,
        deadline_s=800,
        step_sleep=0.05,
        group_size=group_size,
        shards=shards,
    )
    assert kills >= 20
    check_exactly_once(records, 2400, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dp_shards_within_groups_read_disjoint_data(tmp_path: Path) -> None:
    records, _ = run_job(tmp_path, samples=300, kills=3, seed=3, deadline_s=500, group_size=2, shards=2)
    check_exactly_once(records, 300, tmp_path)


def test_a_failed_check_names_the_records_that_committed_a_sample_twice(tmp_path: Path) -> None:
    records = [[0, 0, 0, 0, 0, 2, [0, 1]], [0, 0, 1, 0, 0, 2, [2, 3]], [0, 1, 1, 0, 0, 1, [3, 5]]]
    with pytest.raises(pytest.fail.Exception) as failed:
        check_exactly_once(records, 6, tmp_path)
    message = str(failed.value)
    assert "lost [4] (1), repeated [3] (1)" in message
    assert (
        "sample 3 committed by (epoch, step, replica, rank, world) [(0, 0, 1, 0, 2), (0, 1, 1, 0, 1)]"
        in message
    )
    assert str(tmp_path) in message
    check_exactly_once([*records[:2], [0, 1, 1, 0, 0, 1, [4, 5]]], 6)


def test_the_module_names_bad_shards() -> None:
    with pytest.raises(ValueError, match=r"shard_rank must be an int in \[0, num_shards=2\)"):
        FaultTolerantLoader(None, None, shard_rank=2, num_shards=2)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_a_replica_heals_from_one_that_healed_the_step_before(tmp_path: Path) -> None:
    """Replica 0 is killed and heals from replica 1; replica 2 joins as soon after as it can and
    heals from a live peer, which may be replica 0 (torchft picks the first up-to-date replica):
    each sample is still committed once, and no replica fails."""
    lighthouse = coordination.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=300, quorum_tick_ms=20, heartbeat_timeout_ms=1000
    )
    out, samples = tmp_path / "records.jsonl", 48
    procs: dict[int, Child] = {}
    zygote = Zygote(tmp_path / "zygote.log", [REPLICA], cwd=ROOT, env=_env())

    def start(r: int, *extra: str) -> None:
        args = ["--replica", str(r), "--ctl", str(tmp_path)]
        args += ["--lighthouse", lighthouse.address(), "--out", str(out), "--samples", str(samples)]
        args += ["--step-sleep", "1", *extra]  # time to hold the others after a step
        procs[r] = zygote.start(args, tmp_path / f"replica{r}.log", module=REPLICA)

    def wait_for(what: Any, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not what():
            assert time.monotonic() < end, "the job did not get there in time"
            for r, p in procs.items():
                if p.poll() not in (None, 0):
                    pytest.fail(f"replica {r} failed: {(tmp_path / f'replica{r}.log').read_text()[-1500:]}")
            time.sleep(0.005)

    try:
        start(0)
        start(1)
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 6, 60)
        procs[0].kill()
        procs.pop(0).wait()
        log0 = tmp_path / "replica0.log"
        mark = log0.stat().st_size
        start(2, "--hold", str(tmp_path / "go-2"))
        wait_for((tmp_path / "held-2").exists, 60)  # replica 2 is ready to ask for a quorum
        start(0)
        wait_for(lambda: b"participating False" in log0.read_bytes()[mark:], 60)  # replica 0 healed
        (tmp_path / "pause").touch()  # replicas 0 and 1 wait before the next step
        (tmp_path / "go-2").touch()
        time.sleep(3)  # replica 2 asks for a quorum, which waits for the others
        (tmp_path / "pause").unlink()
        wait_for(lambda: sum(p.poll() == 0 for p in procs.values()) >= 2, 90)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        zygote.close()
        lighthouse.shutdown()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    check_exactly_once(records, samples, tmp_path)
