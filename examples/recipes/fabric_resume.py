r"""guideloom with Lightning Fabric: save mid-epoch with ``fabric.save``, resume on another number of ranks.

    torchrun --nproc-per-node 2 examples/recipes/fabric_resume.py \
        --data corpus --checkpoint ckpt.pt --stop-after 5
    torchrun --nproc-per-node 3 examples/recipes/fabric_resume.py \
        --data corpus --checkpoint ckpt.pt --resume --batch-size 3

The first command trains a tiny next-token model on 2 CPU ranks (gloo) and stops after 5 steps,
as a preempted job would, having saved the model, the optimizer and the loader with
``fabric.save``. The second resumes from that file on 3 ranks with another ``local_batch_size``
and finishes the epochs: every sample of each epoch is trained on exactly once.

What is particular to Fabric:

- ``fabric.setup_dataloaders(loader)`` accepts only a ``torch.utils.data.DataLoader`` and raises
  ``TypeError`` for any other iterable. guideloom needs none of what it adds (a distributed
  sampler, a device move): build the loader with ``rank=fabric.global_rank``,
  ``world_size=fabric.world_size`` and ``device=fabric.device`` and iterate it as it is.
- ``fabric.save`` / ``fabric.load`` call ``state_dict()`` / ``load_state_dict()`` on any object
  that has both, so the loader goes into the checkpoint's state beside the model. The DDP strategy
  writes the file from rank 0 only, which is right because every rank's loader state is the
  same (the offset counts the samples of the whole job, not of one rank).

``--record PREFIX`` writes what each rank trained on to ``PREFIX-rank<r>.json`` (the test reads it).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import lightning as L  # noqa: N812 - Lightning's own convention
import numpy as np
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import guideloom as gl

SEQ = 16  # tokens per sample
NUM_SAMPLES = 203  # not a multiple of any global batch here: each epoch ends with a partial step
VOCAB = 64


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """(batch, SEQ) int64 tokens. At drop_last=False a trailing rank's last batch is empty: (0, SEQ)."""
    return torch.from_numpy(np.asarray(samples, dtype=np.int64).reshape(len(samples), SEQ))


class TinyLM(nn.Module):
    """Predicts the next token from the current one (the corpus counts up, so it can learn +1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def exactly_once(audits: Sequence[gl.AuditReport], world_size: int) -> str:
    """The run's verdict in one line, from ``loader.audit()`` at each epoch's end and at the save:
    whether the ranks were handed every position this run trained on exactly once (after a
    resume, the positions before the checkpoint's offset are the checkpoint's)."""
    wrong = [audit.message for audit in audits if not audit.ok]
    if wrong:
        return f"exactly once: NO: {wrong[0]}"
    spans = ", ".join(
        f"epoch {a.epoch} positions {a.start}-{a.start + a.delivered - 1}" for a in audits if a.delivered
    )
    return f"exactly once: yes ({spans}, across {world_size} rank{'s' * (world_size != 1)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the dataset folder (written if missing)")
    ap.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint file")
    ap.add_argument("--resume", action="store_true", help="load the checkpoint first")
    ap.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps")
    ap.add_argument("--batch-size", type=int, default=4, help="local_batch_size: samples per rank and step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--record", default=None, help="write the sample ids each rank trained on here")
    args = ap.parse_args()

    # torchrun starts the processes; Fabric joins them (gloo on CPU).
    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("WORLD_SIZE", "1")))
    fabric.launch()
    if fabric.global_rank == 0 and not (args.data / "manifest.json").exists():
        gl.write_stream(args.data, np.arange(NUM_SAMPLES * SEQ, dtype=np.uint32))
    fabric.barrier()

    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)

    # Not fabric.setup_dataloaders(loader): the loader splits the data across ranks itself.
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(args.data),
        collate,
        sequence_length=SEQ,
        local_batch_size=args.batch_size,
        rank=fabric.global_rank,
        world_size=fabric.world_size,
        device=fabric.device,
        shuffle=True,
        shuffle_seed=1234,  # a resumed shuffle needs the same seed
        drop_last=False,  # every sample of the epoch; a trailing rank's last batch may be empty
        prefetch=2,
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if args.resume:
        fabric.load(args.checkpoint, state)  # calls loader.load_state_dict(...)

    seen: list[tuple[int, int]] = []  # (epoch, sample id), for --record
    audits: list[gl.AuditReport] = []  # at each epoch's end and at the save
    step = 0
    loss = torch.tensor(float("nan"))  # the last step's, for the log line
    with loader:
        # The loader's state holds the epoch: a resumed job goes on mid-epoch, then runs the rest.
        for epoch in range(loader.state_dict()["epoch"], args.epochs):
            for tokens in loader:
                seen += [(epoch, i) for i in (tokens[:, 0] // SEQ).tolist()]
                logits = model(tokens[:, :-1] % VOCAB)
                # A sum over the batch, over the local batch size: an empty batch adds a zero
                # gradient, and the rank still takes part in DDP's all-reduce.
                loss = cross_entropy(
                    logits.reshape(-1, VOCAB), (tokens[:, 1:] % VOCAB).reshape(-1), reduction="sum"
                ) / (args.batch_size * (SEQ - 1))
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                step += 1
                if step == args.stop_after or loader.remaining() == 0:
                    audits.append(loader.audit())  # a collective: every rank, at the same step
                if step == args.stop_after:
                    fabric.save(args.checkpoint, state)  # calls loader.state_dict(), rank 0 writes
                    break
            if step == args.stop_after:
                break
    fabric.print(f"{step} steps, loss {loss.item():.3f}, loader state {loader.state_dict()}")
    if args.record:
        record = {"seen": seen, "state": dict(loader.state_dict())}
        Path(f"{args.record}-rank{fabric.global_rank}.json").write_text(json.dumps(record))
    fabric.print(exactly_once(audits, fabric.world_size))
    if not all(audit.ok for audit in audits):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
