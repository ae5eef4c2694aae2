"""One rank of the distributed test, started as its own process the way torchrun starts ranks.

Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment, joins a gloo process
group on 127.0.0.1, iterates the loader with a barrier every step, and writes what it saw to a
JSON file for the test to check.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

import guideloom as gl

SEQ = 8


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    ids = [int(s[0]) // SEQ for s in samples]
    return torch.tensor(ids, dtype=torch.int64)


def main() -> None:
    dataset, out, checkpoint_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(dataset),
        collate,
        sequence_length=SEQ,
        local_batch_size=3,
        rank=rank,
        world_size=world,
        shuffle=True,
        shuffle_seed=17,
        drop_last=False,
        num_workers=1,
        prefetch=2,
        device=torch.device("cpu"),
    )
    steps: list[list[int]] = []
    overlaps = 0
    states = None
    with loader:
        for step, batch in enumerate(loader):
            mine = batch.tolist()
            everyone: list[list[int] | None] = [None] * world
            dist.all_gather_object(everyone, mine)
            flat = [i for ids in everyone for i in (ids or [])]
            overlaps += len(flat) - len(set(flat))
            steps.append(mine)
            if step == checkpoint_step:
                states = [None] * world
                dist.all_gather_object(states, loader.state_dict())
            dist.barrier()
        epoch_after = loader.state_dict()["epoch"]
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"steps": steps, "overlaps": overlaps, "states": states, "epoch_after": epoch_after}, f)


if __name__ == "__main__":
    main()
