"""One rank of the mixture's distributed test, started as its own process as torchrun starts ranks.

Joins a gloo group on 127.0.0.1, reads two epochs of a mixture of two written datasets with a
barrier every step, all-gathers each step's samples as (source, index) pairs and writes what it
saw, with the checkpoint every rank holds at a step, to a JSON file for the test to check.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import guideloom as gl

SEQ = 8


def mixture(folder: Path) -> gl.Mixture:
    """A stream of identity samples (sample i starts with i * SEQ) and documents [i, i, ...]."""
    return gl.mix(
        {"stream": gl.open_stream(folder / "stream"), "docs": gl.open_documents(folder / "docs")},
        {"stream": 2, "docs": 1},
        sequence_length=SEQ,
        num_samples=90,
        with_source=True,
    )


def source_ids(samples: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, int]]:
    return [(name, int(s[0]) // SEQ if name == "stream" else int(s[0])) for name, s in samples]


def main() -> None:
    folder, out = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = gl.StatefulDataLoader(
        mixture(folder),
        source_ids,
        local_batch_size=4,
        rank=rank,
        world_size=world,
        shuffle=True,
        shuffle_seed=5,
        num_workers=1,
        parallel_method="thread",
        prefetch=2,
        device=torch.device("cpu"),
    )
    steps: list[list[Any]] = []
    state = None
    with loader:
        for epoch in range(2):
            for step, batch in enumerate(loader):
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, batch)
                steps.append([x for b in everyone for x in b])
                if epoch == 1 and step == 3:
                    states: list[Any] = [None] * world
                    dist.all_gather_object(states, loader.state_dict())
                    assert all(s == states[0] for s in states)
                    state = states[0]
                dist.barrier()
        stats = loader.stats()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"steps": steps, "state": state, "stats": stats}, f)


if __name__ == "__main__":
    main()
