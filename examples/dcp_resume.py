"""Save the loader with torch.distributed.checkpoint on N ranks, resume it on M ranks.

    torchrun --nproc-per-node 2 examples/dcp_resume.py --data corpus --checkpoint ckpt --steps 5
    torchrun --nproc-per-node 3 examples/dcp_resume.py --data corpus --checkpoint ckpt --resume

The loader is a DCP ``Stateful`` (it has ``state_dict()`` and ``load_state_dict()``), so it goes
into the checkpoint beside the model and the optimizer. Its state is rank-independent: every
rank returns the same plain Python values (the epoch and the *global* sample offset), so
DCP stores it once, and any number of ranks can load it. The second command resumes the epoch
on 3 ranks where 2 ranks stopped it, and every sample of the epoch is seen exactly once.

Each rank appends the sample ids it saw to ``<checkpoint>.seen-<run>-rank<r>.json`` (run ``save``
or ``resume``), which ``tests/loader/test_dcp.py`` checks. Without ``--data`` present, rank 0 writes a
small dataset there first.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver  # dcp.load, dcp.save (typed)

import guideloom as gl

SEQUENCE_LENGTH = 16
NUM_SAMPLES = 1_001  # not a multiple of any global batch here: the last step is partial


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """Sample ids (the stream is 0, 1, 2, ...: a sample's first token / SEQUENCE_LENGTH).

    A plain stream's empty batch (a trailing rank at drop_last=False) is a (0, L) block, so this
    returns an empty tensor for it.
    """
    return torch.from_numpy(np.asarray(samples)[:, 0].astype(np.int64) // SEQUENCE_LENGTH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, required=True, help="a DCP checkpoint folder")
    ap.add_argument("--steps", type=int, default=5, help="steps before saving (without --resume)")
    ap.add_argument("--resume", action="store_true", help="load the checkpoint, finish the epoch")
    ap.add_argument("--batch-size", type=int, default=4, help="local_batch_size")
    args = ap.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by torchrun
    dist.init_process_group("gloo")
    if rank == 0 and not (args.data / "manifest.json").exists():
        tokens = np.arange(NUM_SAMPLES * SEQUENCE_LENGTH, dtype=np.uint32)
        gl.write_stream(args.data, tokens, overwrite=True)
    dist.barrier()

    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(args.data),
        collate,
        sequence_length=SEQUENCE_LENGTH,
        local_batch_size=args.batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=True,
        shuffle_seed=1234,
        drop_last=False,  # trailing ranks get an empty batch, so every rank takes len(loader) steps
        prefetch=2,
        device=torch.device("cpu"),
    )
    seen: list[int] = []
    with loader:
        if args.resume:
            # DCP calls loader.state_dict() for the structure, reads the saved values into it,
            # then calls loader.load_state_dict(...) with them.
            state_dict_loader.load({"loader": loader}, checkpoint_id=str(args.checkpoint))
        for step, batch in enumerate(loader):
            seen += batch.tolist()  # the training step goes here
            dist.barrier()  # every rank takes the same number of steps, empty batch or not
            if not args.resume and step + 1 == args.steps:
                state_dict_saver.save({"loader": loader}, checkpoint_id=str(args.checkpoint))
                break
    state = loader.state_dict()
    run = "resume" if args.resume else "save"
    out = args.checkpoint.parent / f"{args.checkpoint.name}.seen-{run}-rank{rank}.json"
    out.write_text(json.dumps({"seen": seen, "state": dict(state)}))
    print(f"rank {rank}/{world_size}: {len(seen)} samples, loader state {dict(state)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
