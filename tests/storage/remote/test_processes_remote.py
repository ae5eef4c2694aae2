"""Process workers over object storage: the main process reads, as for thread workers, and the
workers collate."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import guideloom
from guideloom._runtime.processes import RemoteTraceback
from guideloom._runtime.processes.session import GROUP_MOST, GROUP_WORK_S
from guideloom_dev.servers import MotoS3
from tests.support.data import Boom
from tests.support.loader import assert_same
from tests.support.processes import (
    SEQ,
    collated_where,
    exits_at_40,
    fails_at_40,
    ids,
    run_script,
    write_positions,
)
from tests.support.remote import BUCKET, Copies, all_batches, loader_over, unique

pytestmark = pytest.mark.slow


def test_process_workers_over_s3_read_as_threads_do(stream_copies: Copies, s3: MotoS3) -> None:
    with loader_over(guideloom.open_stream(stream_copies.local)) as local:
        expected = [list(local), list(local)]  # two epochs
    threads = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    with loader_over(threads, num_workers=2, prefetch=4) as loader:
        before = loader.stats()["requests"]
        [list(loader), list(loader)]
        thread_requests = loader.stats()["requests"] - before
    storage = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    loader = loader_over(storage, num_workers=2, parallel_method="process", prefetch=4)
    with loader:
        before = loader.stats()["requests"]
        got = [list(loader), list(loader)]  # epoch 2 on the same workers and their connections
        # A read window at a time, its requests coalesced (not a request per sample), as with
        # thread workers.
        worker_requests = loader.stats()["requests"] - before
    assert 0 < worker_requests <= 1.25 * thread_requests + 2, (worker_requests, thread_requests)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert multiprocessing.active_children() == []


def test_process_workers_over_s3_collate_in_the_workers(
    plain_copies: Copies, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    """With ``collate_mode="auto"``, asked for, the batches read while the workers start are
    collated here (the first epoch need not wait for them), and the loader measures from then on
    where the collate is cheaper, as over local files; ``stats()`` counts each batch where it
    was really collated."""
    expected = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=40, local_batch_size=4)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    loader = loader_over(
        storage,
        collate_fn=collated_where,
        sequence_length=40,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
        collate_mode="auto",  # asked for: the batches read while the workers start are made here
    )
    epochs = []
    with loader:
        start = loader.state_dict()
        for _ in range(10):  # until the loader has measured (a few epochs of 250 batches)
            if "chooser_verdicts" in loader.stats():
                break
            before = loader.stats()
            batches = list(loader)
            after = loader.stats()
            epochs.append(
                (batches, {k: after[k] - before[k] for k in ("collated_inline", "collated_processes")})
            )
            loader.load_state_dict(start)  # the same epoch again, its workers up (they persist)
            assert loader._state.life.pool is not None
            loader._state.life.pool.start()  # an epoch may end before they are: they are waited for here
        it = iter(loader)  # an epoch left early: the samples sent for its groups are freed
        next(it)
        it.close()
        stats = loader.stats()
    for batches, counted in epochs:
        assert len(batches) == len(expected) > 0
        assert all(torch.equal(b["tokens"], e) for b, e in zip(batches, expected, strict=True))
        here = sum(b["pid"] == os.getpid() for b in batches)
        assert counted == {"collated_inline": here, "collated_processes": len(batches) - here}
    # Measured: a choice was made (a collate this cheap is made inline once that is measured).
    assert stats["chooser_verdicts"] >= 1, stats
    assert own_segments() == []
    assert multiprocessing.active_children() == []


def test_process_workers_over_s3_take_several_batches_a_group_when_the_collate_is_cheap(
    plain_copies: Copies, s3: MotoS3
) -> None:
    """Once the workers have reported what a batch costs them, a cheap collate's batches go in
    tasks of several (about GROUP_WORK_S of their work, a credit each), one round trip through
    the pipes per task; the batches are the same."""
    expected = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=200, local_batch_size=4)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    loader = loader_over(
        storage,
        collate_fn=collated_where,
        sequence_length=200,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
    )
    with loader:
        start = loader.state_dict()
        list(loader)  # the workers report what a batch costs them
        loader.load_state_dict(start)  # the same epoch again
        it = iter(loader)
        got = list(it)
        assert it._driver.procs is not None
        procs = it._driver.procs
        work = procs.session.work_per_batch
        assert work is not None and work < GROUP_WORK_S / 3, work  # a cheap collate
        per = it._driver.flow.per  # batches a credit stood for: a task's
        assert procs.credit_batches(7) >= 3 and 3 <= per <= GROUP_MOST, (per, work)
    assert all(torch.equal(b["tokens"], e) for b, e in zip(got, expected, strict=True))
    runs = [len(list(run)) for _, run in itertools.groupby(b["pid"] for b in got)]
    assert os.getpid() not in {b["pid"] for b in got}
    assert sum(n for n in runs if n >= 2) >= len(got) // 2, runs  # most batches in groups


_STANDBY_SCRIPT = """
import json, os, sys
from multiprocessing import forkserver
import torch
import guideloom as gl
from guideloom._runtime.processes.zygote import fork_is_safe

def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])

def before(samples):
    return [os.getpid(), *(int(s[0]) for s in samples)]

if __name__ == "__main__":
    storage = gl.open_stream(sys.argv[1], **json.loads(sys.argv[2]))  # the standby forks here
    print(fork_is_safe())  # obstore's runtime runs now: no fork from this process

def later(samples):  # defined after the standby was forked: not in its __main__
    return [os.getpid(), *(int(s[0]) for s in samples)]

if __name__ == "__main__":
    for collate in (before, later):
        kw = dict(sequence_length=200, local_batch_size=4, device=torch.device("cpu"))
        with gl.StatefulDataLoader.from_storage(storage, collate, **kw) as inline:
            want = [b[1:] for b in inline]
        with gl.StatefulDataLoader.from_storage(
            storage, collate, num_workers=2, parallel_method="process", **kw
        ) as ld:
            got = list(ld)
            pool = ld._state.life.pool
            ctx = pool.ctx
            server = getattr(ctx, "server", None) or forkserver._forkserver
            spid = server._forkserver_pid
            workers = {p.proc.pid for p in pool.procs if p is not None}  # one may be starting still
            parents = {parent(w) for w in workers}
        print(type(ctx).__name__, getattr(ctx, "shared", None), parent(spid) == os.getpid(),
              parents == {spid}, {b[0] for b in got} <= workers,
              [b[1:] for b in got] == want)
"""


def test_process_workers_over_s3_fork_from_a_standby_zygote(
    tmp_path: Path, plain_copies: Copies, s3: MotoS3
) -> None:
    """The first object store of a process forks a standby zygote before obstore's runtime
    starts its threads: a pool made later forks its workers from it (children of this process's
    zygote, no fresh interpreter), unless its collate is a ``__main__`` function defined after
    that fork, which the workers would not find there: the fork server then serves. The same
    batches either way, every one made by a worker."""
    script = tmp_path / "standby.py"
    script.write_text(_STANDBY_SCRIPT)
    r = run_script(script, plain_copies.s3_url, json.dumps(s3.options()), check=False)
    assert r.stdout.splitlines() == [
        "False",
        "ZygoteContext True True True True True",
        "ForkServerContext None True True True True",
    ], r.stderr[-3000:]


_CHILDREN_SCRIPT = """
import json, os, sys
import guideloom as gl
storage = gl.open_stream(sys.argv[1], **json.loads(sys.argv[2]))
pid = os.getpid()
print(len(open(f"/proc/{pid}/task/{pid}/children").read().split()))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="children are listed in /proc (Linux)")
def test_a_process_that_will_not_use_process_workers_can_go_without_the_standby(
    tmp_path: Path, plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GUIDELOOM_STANDBY_ZYGOTE=0``: opening an object store forks no standby zygote."""
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN_SCRIPT)
    args = (plain_copies.s3_url, json.dumps(s3.options()))
    with_standby = int(run_script(script, *args).stdout)
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("GUIDELOOM_STANDBY_ZYGOTE", off)
        without = int(run_script(script, *args).stdout)
        assert without < with_standby, (off, without, with_standby)


@pytest.fixture(scope="module")
def positions_on_s3(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> str:
    """A stream whose sample ``i`` starts with ``i * SEQ``, on S3."""
    folder = write_positions(tmp_path_factory.mktemp("positions") / "ds")
    prefix = unique("positions")
    s3.upload_folder(folder, BUCKET, prefix)
    return f"s3://{BUCKET}/{prefix}"


def _on_s3(url: str, s3: MotoS3, collate: Any, **kw: Any) -> guideloom.StatefulDataLoader[Any, Any]:
    return guideloom.StatefulDataLoader.from_storage(
        guideloom.open_stream(url, **s3.options()),
        collate,
        sequence_length=SEQ,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
        device=torch.device("cpu"),
        **kw,
    )


@pytest.mark.usefixtures("workers_up_first")
def test_a_collate_error_over_s3_reaches_the_consumer_at_its_batch(
    positions_on_s3: str, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    with _on_s3(positions_on_s3, s3, fails_at_40) as loader:
        got = []
        with pytest.raises(Boom, match="sample 40") as info:
            for batch in loader:
                got.append(batch)
        assert len(got) == 10  # batches 0-9: samples 0-39
        assert all(torch.equal(b[:, 0], torch.arange(4 * k, 4 * k + 4) * SEQ) for k, b in enumerate(got))
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert loader.state_dict()["observation_offset"] == 40
    assert own_segments() == []
    assert multiprocessing.active_children() == []


@pytest.mark.asyncio
async def test_async_for_over_s3_with_process_workers_delivers_every_batch(
    positions_on_s3: str, s3: MotoS3
) -> None:
    got = []
    async with _on_s3(positions_on_s3, s3, ids, shuffle=True, shuffle_seed=3) as loader:
        async for batch in loader:
            got.extend(batch)
    assert sorted(got) == list(range(200))
    assert got != sorted(got)


@pytest.mark.usefixtures("workers_up_first")
def test_a_worker_that_dies_over_s3_is_a_worker_error(
    positions_on_s3: str, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    with (
        _on_s3(positions_on_s3, s3, exits_at_40) as loader,
        pytest.raises(guideloom.WorkerError, match="died"),
    ):
        for _ in loader:
            pass
    assert own_segments() == []
    assert multiprocessing.active_children() == []
