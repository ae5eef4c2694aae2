"""One replica group of a fault-tolerant job: a torchft Manager over gloo on CPU, a tiny model,
guideloom's :class:`~guideloom.torchft.FaultTolerantLoader`; run as
``python -m tests.torchft.replica ARGS`` by ``test_torchft.py``, forked from a zygote that has
imported it (``tests/support/zygote.py``).

Each committed step appends one line per rank to ``--out``: ``[epoch, step, replica, rank,
shard, world size, [sample, ...]]`` (JSON), written before anything else happens after
``should_commit()``. Once it has committed a step it creates ``--ctl/up-R``; when the test
writes ``--ctl/arm-R`` (``steps point``), the replica SIGKILLs itself that many steps later,
at the point drawn: right after the batch was handed out (the peers' step then fails and is
taken back), or once every rank of the group has written the step's record. Never between
``should_commit()`` and the record: a kill there would lose the record of a sample the job
trained on, not the sample. A kill waits while another replica is healing or joining (has made
its Manager, ``--ctl/manager-R``, and not yet committed a step as a participant): a source
killed while a peer fetches its state leaves torchft without a consistent job, which no loader
can follow. With one rank a group, the peer's heal fails, and if no other replica with the
job's state joins the next quorum in time, torchft forms one of replicas at step 0 that commits
step 0 again before a late up-to-date replica heals them back (step 0's samples are then
committed twice, on a branch the job drops). With several ranks a group, torchft heals each rank
from a source of its own and takes the group's step from whichever rank asks for the quorum
last, so the group's ranks end at different steps (guideloom refuses the state then:
``test_healing.py``). With ``--hold FILE`` it creates ``--ctl/held-R`` and waits for
FILE before its first step; while ``--ctl/pause`` exists, it waits before each step.

Ranks of a group (``--group-size``) run as threads, each with its own Manager, as torchft's own
tests run them; ``--shards`` of them are data-parallel shards (``dp_shard``), the others
tensor-parallel ranks that get the same batch as their shard.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

import guideloom as gl
from guideloom.torchft import FaultTolerantLoader

_write = threading.Lock()
#: Ranks of the group done with each step (its record written, where it committed): a kill at
#: "recorded" waits for every rank of the group, whose threads the kill ends too.
_recorded: dict[int, int] = {}
_recorded_cond = threading.Condition()


def _wait_recorded(step: int, ranks: int) -> None:
    """Until every rank of the group is done with its ``step``-th step (10 s at most)."""
    with _recorded_cond:
        _recorded_cond.wait_for(lambda: _recorded.get(step, 0) >= ranks, timeout=10)


def _healing(ctl: str, me: int) -> bool:
    """Whether another replica has made its Manager and not yet committed a step as a participant
    (it is healing or joining: a peer may be the source it is fetching a state from)."""
    names = set(os.listdir(ctl))
    return any(
        n.startswith("manager-") and n != f"manager-{me}" and f"up-{n.split('-', 1)[1]}" not in names
        for n in names
    )


def collate(samples: Any) -> list[int]:
    """The sample indexes of an identity stream of sequence length 4 (an empty list gives [])."""
    return [int(s[0]) // 4 for s in samples]


def rank_main(args: argparse.Namespace, rank: int, store_port: int, out: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_model(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def save_model() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    if rank == 0:
        open(os.path.join(args.ctl, f"manager-{args.replica}"), "w").close()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_model,
        state_dict=save_model,
        replica_id=f"replica_{args.replica}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=rank,
        world_size=args.group_size,
        lighthouse_addr=args.lighthouse,
        hostname="localhost",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
    )
    storage = gl.MemoryStreamStorage(np.arange(args.samples * 4, dtype=np.int64))
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=4,
        local_batch_size=args.batch,
        shuffle=True,
        shuffle_seed=7,
        drop_last=False,
        prefetch=args.prefetch,
        num_workers=args.workers,
        device=torch.device("cpu"),
    )
    tp = args.group_size // args.shards
    ft = FaultTolerantLoader(loader, manager, shard_rank=rank // tp, num_shards=args.shards)
    taken, kill_at, point = 0, -1, ""
    if args.hold:  # the test starts this replica's first step
        open(os.path.join(args.ctl, f"held-{args.replica}"), "w").close()
    while args.hold and not os.path.exists(args.hold):
        time.sleep(0.005)
    arm, up = os.path.join(args.ctl, f"arm-{args.replica}"), os.path.join(args.ctl, f"up-{args.replica}")
    try:
        with loader:
            while True:
                while os.path.exists(os.path.join(args.ctl, "pause")):  # the test holds the step
                    time.sleep(0.005)
                opt.zero_grad()
                manager.start_quorum()
                batch = ft.next()
                taken += 1
                if rank == 0 and os.path.exists(arm):
                    with open(arm) as f:
                        steps, point = f.read().split()
                    os.unlink(arm)
                    kill_at = taken + int(steps)
                if rank == 0 and taken == kill_at:
                    kill_at += _healing(args.ctl, args.replica)  # not while a peer may fetch from it
                if rank == 0 and taken == kill_at and point == "handed":
                    os.kill(os.getpid(), signal.SIGKILL)
                x = torch.tensor(batch, dtype=torch.float32).reshape(-1, 1) / args.samples
                model(x).sum().backward() if len(batch) else model(torch.zeros(1, 1)).sum().mul(0).backward()
                for p in model.parameters():
                    assert p.grad is not None
                    manager.allreduce(p.grad).wait()
                step = manager.current_step()
                ok = manager.should_commit()
                print(
                    f"step {step} replica {args.replica} rank {rank} participating {ft.participating} "
                    f"world {loader.world_size} epoch {ft.epoch} batch {batch} committed {ok}",
                    flush=True,
                )
                if ok:
                    opt.step()
                    if ft.participating and ft.epoch == 0:
                        line = [ft.epoch, step, args.replica, rank, rank // tp, loader.world_size, batch]
                        with _write:
                            out.write(json.dumps(line) + "\n")
                            out.flush()
                    if ft.epoch >= 1:  # the next epoch's first step committed: done
                        return
                    if rank == 0 and ft.participating and not os.path.exists(up):
                        open(up, "w").close()
                with _recorded_cond:
                    _recorded[taken] = _recorded.get(taken, 0) + 1
                    _recorded_cond.notify_all()
                if rank == 0 and taken == kill_at and point == "recorded":
                    _wait_recorded(taken, args.group_size)
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
    finally:
        ft.close()
        manager.shutdown(wait=False)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--ctl", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold", default="", help="wait for this file before the first quorum")
    args = p.parse_args(argv)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with open(args.out, "a") as out, ThreadPoolExecutor(args.group_size) as pool:
        futures = [pool.submit(rank_main, args, r, store.port, out) for r in range(args.group_size)]
        for f in futures:
            f.result()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
