r"""guideloom with Hugging Face Accelerate: the loader registered for ``save_state`` / ``load_state``.

    torchrun --nproc-per-node 2 examples/recipes/accelerate_resume.py \
        --data corpus --checkpoint ckpt --stop-after 5
    torchrun --nproc-per-node 3 examples/recipes/accelerate_resume.py \
        --data corpus --checkpoint ckpt --resume --batch-size 3

The first command trains a tiny next-token model on 2 CPU ranks (gloo) and stops after 5 steps,
as a preempted job would, having saved everything with ``accelerator.save_state``. The second
resumes with ``accelerator.load_state`` on 3 ranks with another ``local_batch_size`` and finishes
the epochs: every sample of each epoch is trained on exactly once.

What is particular to Accelerate:

- ``accelerator.prepare`` wraps a ``torch.utils.data.DataLoader`` (a sharding sampler, a device
  move) and returns anything else unchanged: passing the guideloom loader to it does nothing.
  Build the loader with ``rank=accelerator.process_index``,
  ``world_size=accelerator.num_processes`` and ``device=accelerator.device`` instead, and
  prepare only the model and the optimizer.
- ``accelerator.register_for_checkpointing(loader)`` makes ``save_state`` write
  ``loader.state_dict()`` (``custom_checkpoint_0.pkl``, from the main process: every rank's
  state is the same) and ``load_state`` call ``loader.load_state_dict()`` on every rank.
- Don't call ``accelerator.skip_first_batches(loader, n)`` on a resume: the loader's state
  already starts after the last batch it delivered (and the helper handles DataLoaders only).

``--record PREFIX`` writes what each rank trained on to ``PREFIX-rank<r>.json`` (the test reads it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
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
    ap.add_argument("--checkpoint", type=Path, required=True, help="the save_state folder")
    ap.add_argument("--resume", action="store_true", help="load_state from the checkpoint first")
    ap.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps")
    ap.add_argument("--batch-size", type=int, default=4, help="local_batch_size: samples per rank and step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--record", default=None, help="write the sample ids each rank trained on here")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True)  # joins the ranks torchrun started (gloo on CPU)
    if accelerator.is_main_process and not (args.data / "manifest.json").exists():
        gl.write_stream(args.data, np.arange(NUM_SAMPLES * SEQ, dtype=np.uint32))
    accelerator.wait_for_everyone()

    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: prepare would return it as is

    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(args.data),
        collate,
        sequence_length=SEQ,
        local_batch_size=args.batch_size,
        rank=accelerator.process_index,  # the loader splits the data across ranks itself
        world_size=accelerator.num_processes,
        device=accelerator.device,
        shuffle=True,
        shuffle_seed=1234,  # a resumed shuffle needs the same seed
        drop_last=False,  # every sample of the epoch; a trailing rank's last batch may be empty
        prefetch=2,
    )
    accelerator.register_for_checkpointing(loader)  # save_state / load_state include it
    if args.resume:
        accelerator.load_state(args.checkpoint)  # calls loader.load_state_dict(...)

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
                accelerator.backward(loss)
                optimizer.step()
                step += 1
                if step == args.stop_after or loader.remaining() == 0:
                    audits.append(loader.audit())  # a collective: every rank, at the same step
                if step == args.stop_after:
                    accelerator.save_state(args.checkpoint)  # calls loader.state_dict()
                    break
            if step == args.stop_after:
                break
    accelerator.print(f"{step} steps, loss {loss.item():.3f}, loader state {loader.state_dict()}")
    if args.record:
        record = {"seen": seen, "state": dict(loader.state_dict())}
        Path(f"{args.record}-rank{accelerator.process_index}.json").write_text(json.dumps(record))
    # Release the DDP model before end_training() destroys the process group: a gloo group whose
    # last holder is DDP's reducer is destroyed without releasing the GIL, which can deadlock.
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()
    accelerator.print(exactly_once(audits, accelerator.num_processes))
    if not all(audit.ok for audit in audits):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
