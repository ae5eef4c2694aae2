"""One rank of the distributed audit test, started as its own process the way torchrun starts
ranks: joins a gloo group, reads a few steps, audits, then resumes from a checkpoint (one rank,
``BAD_RANK``, from a wrong one or taking a step more, as ``FAULT`` says) and audits again. Writes
both reports to a JSON file."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

import guideloom as gl
from guideloom._datasets import MapDataset

N, B = 120, 3


def make(rank: int, world: int) -> gl.StatefulDataLoader[int, list[int]]:
    return gl.StatefulDataLoader(
        MapDataset(list(range(N))),
        collate_fn=list,
        device=torch.device("cpu"),
        local_batch_size=B,
        rank=rank,
        world_size=world,
        shuffle=True,
        shuffle_seed=11,
        num_workers=1,
        prefetch=2,
    )


def main() -> None:
    out, fault, bad_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = B * world
    loader = make(rank, world)
    it = iter(loader)
    for _ in range(4):
        next(it)
    it.close()
    first = loader.audit()
    state = dict(loader.state_dict())
    if rank == bad_rank and fault == "skip":
        state["observation_offset"] += g
    if rank == bad_rank and fault == "repeat":
        state["observation_offset"] -= g
    resumed = make(rank, world)
    resumed.load_state_dict(state)  # type: ignore[arg-type]
    it = iter(resumed)
    for _ in range(3 if rank == bad_rank and fault == "extra" else 2):
        next(it)
    it.close()
    second = resumed.audit()
    with open(out, "w") as f:
        json.dump({"first": dataclasses.asdict(first), "second": dataclasses.asdict(second)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
