r"""guideloom with the Lightning Trainer: a LightningDataModule that checkpoints the loader.

    torchrun --nproc-per-node 2 examples/recipes/lightning_trainer_resume.py \
        --data corpus --checkpoint ckpts --stop-after 5
    torchrun --nproc-per-node 1 examples/recipes/lightning_trainer_resume.py \
        --data corpus --checkpoint ckpts --resume --batch-size 8

The first command trains a tiny next-token model on 2 CPU ranks (gloo), a ``ModelCheckpoint``
saving every 5 steps, and stops after 5 steps as a preempted job would. The second resumes from
``ckpts/last.ckpt`` on 1 rank with ``local_batch_size=8`` (the same global batch of 8) and
finishes the epochs: every sample of each epoch is trained on exactly once.

What is particular to the Trainer:

- ``train_dataloader()`` returns the guideloom loader itself. The Trainer wraps only a
  ``torch.utils.data.DataLoader`` in a distributed sampler (``use_distributed_sampler``) and
  leaves any other iterable as it is, so the loader is built with ``self.trainer.global_rank``
  and ``self.trainer.world_size`` and splits the data across ranks itself.
- The DataModule's ``state_dict()`` / ``load_state_dict()`` hold the loader's state, which the
  Trainer writes into every checkpoint and hands back before it asks for ``train_dataloader()``.
- The Trainer ends an epoch after ``len(loader)`` batches without asking the loader's iterator
  for its end, and starts the next epoch with a new ``iter(loader)`` while that iterator is still
  open: guideloom then ends it as exhausted and starts the next epoch, but until then the
  loader's position is the end of the finished epoch, which an epoch-end checkpoint would hold.
  ``FinishLoaderEpoch`` below ends that iterator at the epoch's end and moves the loader into the
  next epoch before the epoch-end checkpoints are written.
- The Trainer also counts an epoch in steps: resumed mid-epoch, it adds the steps it had taken
  (at the old global batch size) to the new ones and ends the epoch at ``len(loader)``. Resume
  with the same global batch size (``local_batch_size * world_size``) or a smaller one; a larger
  one ends the Trainer's epoch before the loader's, short of the epoch's last batches.

``--record PREFIX`` writes what each rank trained on to ``PREFIX-rank<r>.json`` (the test reads it).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L  # noqa: N812 - Lightning's own convention
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.functional import cross_entropy

import guideloom as gl

SEQ = 16  # tokens per sample
NUM_SAMPLES = 203  # not a multiple of any global batch here: each epoch ends with a partial step
VOCAB = 64


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """(batch, SEQ) int64 tokens. At drop_last=False a trailing rank's last batch is empty: (0, SEQ)."""
    return torch.from_numpy(np.asarray(samples, dtype=np.int64).reshape(len(samples), SEQ))


class TokenData(L.LightningDataModule):
    """The guideloom loader as the Trainer's train loader, its position in the checkpoints."""

    def __init__(self, data: Path, batch_size: int) -> None:
        super().__init__()
        self.data = data
        self.batch_size = batch_size
        self.loader: gl.StatefulDataLoader[Any, torch.Tensor] | None = None
        self.loader_state: gl.StatefulDataLoaderStateDict | None = None  # from the checkpoint

    def prepare_data(self) -> None:  # the Trainer calls it on one process per node
        if not (self.data / "manifest.json").exists():
            gl.write_stream(self.data, np.arange(NUM_SAMPLES * SEQ, dtype=np.uint32))

    def train_dataloader(self) -> gl.StatefulDataLoader[Any, torch.Tensor]:
        self.loader = gl.StatefulDataLoader.from_storage(
            gl.open_stream(self.data),
            collate,
            sequence_length=SEQ,
            local_batch_size=self.batch_size,
            rank=self.trainer.global_rank,  # the loader splits the data across ranks itself
            world_size=self.trainer.world_size,
            device=self.trainer.strategy.root_device,
            shuffle=True,
            shuffle_seed=1234,  # a resumed shuffle needs the same seed
            drop_last=False,  # every sample of the epoch; a trailing rank's last batch may be empty
            prefetch=2,
        )
        if self.loader_state is not None:  # resuming: load_state_dict ran first
            self.loader.load_state_dict(self.loader_state)
        return self.loader

    def state_dict(self) -> dict[str, Any]:  # written into every checkpoint
        return {"loader": self.loader.state_dict()} if self.loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # before train_dataloader()
        self.loader_state = state_dict.get("loader")

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()  # its threads stop; its state stays readable


class FinishLoaderEpoch(L.Callback):
    """At the end of a whole epoch, close the iterator the Trainer stopped reading and start the
    loader's next epoch, so that the next ``iter(loader)`` starts it (and an epoch-end checkpoint
    holds it). Before that, and where training stops mid-epoch, ``loader.audit()`` checks that
    the ranks were handed each position exactly once."""

    def __init__(self) -> None:
        self.audits: list[gl.AuditReport] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.datamodule.loader
        if loader is not None and loader.remaining() == 0:  # every batch of the epoch was delivered
            self.audits.append(loader.audit())  # a collective: every rank calls it here
            loader.close()  # ends the open iterator; the position stays
            for _ in loader:  # an iterator at the epoch's end yields nothing and starts the next
                pass

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.datamodule.loader
        if loader is not None and loader.state_dict()["observation_offset"] > 0:  # stopped mid-epoch
            self.audits.append(loader.audit())


def exactly_once(audits: Sequence[gl.AuditReport], world_size: int) -> str:
    """The run's verdict in one line, from ``loader.audit()`` at each epoch's end and at the stop:
    whether the ranks were handed every position this run trained on exactly once (after a
    resume, the positions before the checkpoint's offset are the checkpoint's)."""
    wrong = [audit.message for audit in audits if not audit.ok]
    if wrong:
        return f"exactly once: NO: {wrong[0]}"
    spans = ", ".join(
        f"epoch {a.epoch} positions {a.start}-{a.start + a.delivered - 1}" for a in audits if a.delivered
    )
    return f"exactly once: yes ({spans}, across {world_size} rank{'s' * (world_size != 1)})"


class TinyLM(L.LightningModule):
    """Predicts the next token from the current one (the corpus counts up, so it can learn +1)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)
        self.seen: list[tuple[int, int]] = []  # (epoch, sample id), for --record

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen += [(self.current_epoch, i) for i in (tokens[:, 0] // SEQ).tolist()]
        logits = self.head(self.embed(tokens[:, :-1] % VOCAB))
        # A sum over the batch, over the local batch size: an empty batch adds a zero gradient,
        # and the rank still takes part in DDP's all-reduce.
        return cross_entropy(
            logits.reshape(-1, VOCAB), (tokens[:, 1:] % VOCAB).reshape(-1), reduction="sum"
        ) / (self.batch_size * (SEQ - 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the dataset folder (written if missing)")
    ap.add_argument("--checkpoint", type=Path, required=True, help="the checkpoints' folder")
    ap.add_argument("--resume", action="store_true", help="resume from <checkpoint>/last.ckpt")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--save-every", type=int, default=5, help="a checkpoint every this many steps")
    ap.add_argument("--batch-size", type=int, default=4, help="local_batch_size: samples per rank and step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--record", default=None, help="write the sample ids each rank trained on here")
    args = ap.parse_args()

    data, model = TokenData(args.data, args.batch_size), TinyLM(args.batch_size)
    finish = FinishLoaderEpoch()
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",  # gloo on CPU; torchrun starts the processes
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_epochs=args.epochs,
        max_steps=args.stop_after or -1,
        callbacks=[
            finish,
            ModelCheckpoint(dirpath=args.checkpoint, every_n_train_steps=args.save_every, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=args.checkpoint / "last.ckpt" if args.resume else None)

    assert data.loader is not None
    state = data.loader.state_dict()
    print(f"rank {trainer.global_rank}: {trainer.global_step} steps, loader state {state}")
    if args.record:
        record = {"seen": model.seen, "state": dict(state)}
        Path(f"{args.record}-rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if trainer.global_rank == 0:
        print(exactly_once(finish.audits, trainer.world_size))
    if not all(audit.ok for audit in finish.audits):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
