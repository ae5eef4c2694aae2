r"""guideloom as torchtitan's data loader, checkpointed by torchtitan's ``CheckpointManager``.

    torchrun --nproc-per-node 2 examples/recipes/torchtitan_resume.py \
        --data corpus --checkpoint ckpts --stop-after 5
    torchrun --nproc-per-node 1 examples/recipes/torchtitan_resume.py \
        --data corpus --checkpoint ckpts --resume --batch-size 5

torchtitan's ``Trainer`` builds its data loader from its config, ``config.dataloader.build(
dp_world_size=..., dp_rank=..., tokenizer=..., seq_len=..., local_batch_size=...,
snapshot_every_n_steps=...)``, and expects a ``BaseDataLoader``: a ``Stateful`` whose iterator
yields ``({"input": tokens}, labels)``. ``GuideloomDataLoader`` below is one, with a nested
``Config`` as torchtitan's components have, so ``dataloader=GuideloomDataLoader.Config(...)`` in a
trainer config builds it. Its checkpoint entry is guideloom's ``state_dict()``: the epoch and the
offset in samples of the whole job, the same on every rank, so the ``dataloader`` entry is saved
once and loads on any data-parallel degree. (torchtitan's own ``ParallelAwareDataloader`` saves
one state per ``dp_rank_<r>`` and refuses a checkpoint made with another degree.)

torchtitan's ``Trainer`` does not run on a CPU-only PyTorch (it imports triton, and its device
falls back to CUDA: docs/frameworks.md), so this script drives the step itself, as
``Trainer.train_step`` does, with torchtitan's own components: its ``OptimizersContainer``,
``LRSchedulersContainer`` and ``CheckpointManager`` (``<checkpoint>/step-<N>`` DCP folders, the
newest loaded on a resume). The first command trains a tiny next-token model on 2 CPU ranks
(gloo, DDP) and saves after 5 steps, as a preempted job would; the second resumes on 1 rank with
another ``local_batch_size`` and finishes the epochs: every sample of each epoch is trained on exactly once.

``--record PREFIX`` writes what each rank trained on to ``PREFIX-rank<r>.json`` (the test reads it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

import guideloom as gl

SEQ = 16  # tokens per sample: torchtitan's seq_len is 15, the input, and the labels are shifted by one
NUM_SAMPLES = 203  # not a multiple of any global batch here: each epoch ends with a partial step
VOCAB = 64


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """(batch, SEQ) int64 tokens. At drop_last=False a trailing rank's last batch is empty: (0, SEQ)."""
    return torch.from_numpy(np.asarray(samples, dtype=np.int64).reshape(len(samples), SEQ))


class GuideloomDataLoader(BaseDataLoader):
    """torchtitan's data loader over a guideloom dataset: ``({"input": x[:, :-1]}, x[:, 1:])``
    batches of ``seq_len + 1`` tokens per sample, epoch after epoch, from the epoch its state holds.

    Its state is the guideloom loader's, global: every data-parallel rank holds the same one, and
    any data-parallel degree loads it. ``state_dict()`` is a collective under ``torch.distributed``
    (every rank calls it at a save, as DCP does): it refuses to save when the ranks' states
    differ, since DCP writes such an entry from one rank only.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        epochs: int = 1
        """Epochs to iterate before the iterator ends (the Trainer's DataloaderExhaustedError)."""
        shuffle_seed: int = 1234
        """A resumed shuffle needs the seed it was saved with."""
        drop_last: bool = False
        """False: every sample of an epoch; a trailing rank's last batch may then be empty."""
        prefetch: int = 2

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,  # the samples are token ids already
        snapshot_every_n_steps: int | None = None,  # guideloom's state needs no snapshots
    ) -> None:
        if not config.dataset_path:
            raise ValueError("GuideloomDataLoader needs dataset_path: a folder written by gl.write_stream")
        self.epochs = config.epochs
        self.audits: list[gl.AuditReport] = []  # loader.audit() at each epoch's end
        self.loader = gl.StatefulDataLoader.from_storage(
            gl.open_stream(config.dataset_path),
            collate,
            sequence_length=seq_len + 1,
            local_batch_size=local_batch_size,
            rank=dp_rank,
            world_size=dp_world_size,
            device=torch.device("cpu"),  # the Trainer moves each batch to its device
            shuffle=True,
            shuffle_seed=config.shuffle_seed,
            drop_last=config.drop_last,
            prefetch=config.prefetch,
        )

    def __iter__(self) -> Generator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        with self.loader:
            for _ in range(self.loader.state_dict()["epoch"], self.epochs):
                for tokens in self.loader:
                    yield {"input": tokens[:, :-1]}, tokens[:, 1:]
                    # the epoch's last batch trained on, its iterator not ended yet: every rank
                    # asks for the next batch at the same step, so this collective lines up
                    if self.loader.remaining() == 0:
                        self.audits.append(self.loader.audit())

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.loader.state_dict())
        if dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
            if any(other != state for other in states):
                raise RuntimeError(f"the ranks' loader states differ, not saving: {states}")
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)  # type: ignore[arg-type]


class TinyLM(nn.Module):
    """Predicts the next token from the current one (the corpus counts up, so it can learn +1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class TrainState(Stateful):
    """The step, as the Trainer saves itself under ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


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
    ap.add_argument("--checkpoint", type=Path, required=True, help="the folder of the step-<N> checkpoints")
    ap.add_argument("--resume", action="store_true", help="load the newest checkpoint first")
    ap.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps")
    ap.add_argument("--batch-size", type=int, default=4, help="local_batch_size: samples per rank and step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--record", default=None, help="write the sample ids each rank trained on here")
    args = ap.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not (args.data / "manifest.json").exists():
        gl.write_stream(args.data, np.arange(NUM_SAMPLES * SEQ, dtype=np.uint32))
    dist.barrier()

    # What the Trainer does with config.dataloader, config.optimizer, config.lr_scheduler and
    # config.checkpoint; here data parallelism is the whole world (no tensor or pipeline ranks).
    loader = GuideloomDataLoader.Config(dataset_path=str(args.data), epochs=args.epochs).build(
        dp_world_size=world_size,
        dp_rank=rank,
        tokenizer=None,
        seq_len=SEQ - 1,
        local_batch_size=args.batch_size,
        snapshot_every_n_steps=args.stop_after,
    )
    model = DistributedDataParallel(TinyLM())
    optimizers = default_adamw(lr=1e-2, weight_decay=0.0).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=100
    )
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=str(args.checkpoint),
        interval=args.stop_after or 10**9,
        keep_latest_k=0,  # keep every step folder
        initial_load_model_only=False,  # (only read with an initial_load_path)
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )
    if args.resume and not checkpointer.load():  # the newest step-<N>: loader.load_state_dict(...)
        raise SystemExit(f"no checkpoint to resume from in {args.checkpoint}")

    seen: list[tuple[int, int]] = []  # (epoch, sample id), for --record
    audits: list[gl.AuditReport] = []  # at the save; the loader adds one at each epoch's end
    loss = torch.tensor(float("nan"))  # the last step's, for the log line
    batches = iter(loader)  # from the checkpoint's epoch and offset to the last epoch's end
    for inputs, labels in batches:
        epoch = loader.loader.state_dict()["epoch"]
        seen += [(epoch, i) for i in (inputs["input"][:, 0] // SEQ).tolist()]
        logits = model(inputs["input"] % VOCAB)
        # A sum over the batch, over the local batch size: an empty batch adds a zero gradient,
        # and the rank still takes part in DDP's all-reduce.
        loss = cross_entropy(logits.reshape(-1, VOCAB), (labels % VOCAB).reshape(-1), reduction="sum") / (
            args.batch_size * (SEQ - 1)
        )
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        train_state.step += 1
        if train_state.step == args.stop_after:
            audits.append(loader.loader.audit())  # a collective: every rank, at the same step
            checkpointer.save(curr_step=train_state.step)  # <checkpoint>/step-<N>
            break
    batches.close()  # ends the loader's iterator at a save
    checkpointer.close()
    state = loader.loader.state_dict()
    print(f"rank {rank}: step {train_state.step}, loss {loss.item():.3f}, loader state {state}")
    if args.record:
        Path(f"{args.record}-rank{rank}.json").write_text(json.dumps({"seen": seen, "state": dict(state)}))
    audits = [*loader.audits, *audits]
    # DDP's reducer holds the process group: release it first. A gloo group whose last holder is
    # the reducer is destroyed without releasing the GIL, which can deadlock with gloo's threads.
    del checkpointer, optimizers, lr_schedulers, model
    dist.destroy_process_group()
    if rank == 0:
        print(exactly_once(audits, world_size))
    if not all(audit.ok for audit in audits):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
