r"""guideloom in a torchtitan-style checkpoint: torch.distributed.checkpoint, one global loader state.

    torchrun --nproc-per-node 2 examples/recipes/dcp_train_state.py \
        --data corpus --checkpoint ckpts --stop-after 5
    torchrun --nproc-per-node 3 examples/recipes/dcp_train_state.py \
        --data corpus --checkpoint ckpts --resume --batch-size 3

Like torchtitan's checkpoint manager, each checkpoint is a DCP folder ``<checkpoint>/step-<N>``
holding a dict of ``Stateful`` objects: the model and the optimizer (through
``get_state_dict`` / ``set_state_dict``), the training state (the step) and the loader. A resumed
job loads the newest folder. The first command trains a tiny next-token model on 2 CPU ranks
(gloo, DDP) and stops after 5 steps, as a preempted job would; the second resumes on 3 ranks with
another ``local_batch_size`` and finishes the epochs: every sample of each epoch is trained on
exactly once.

torchtitan saves one loader state per data-parallel rank (``dp_rank_<r>``), because a
``torch.utils.data`` loader's position is the rank's own. guideloom's is global: the epoch and
the offset in samples of the whole job, the same on every rank. So the checkpoint holds it once,
as the plain ``loader`` Stateful, and any number of ranks can load it. ``check_ranks_agree``
gathers every rank's ``state_dict()`` and stops the save if they differ (ranks built with other
seeds, datasets or batch sizes), since DCP writes such an entry from one rank only.

``--record PREFIX`` writes what each rank trained on to ``PREFIX-rank<r>.json`` (the test reads it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel

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


class ModelAndOptimizer(Stateful):
    """The model's and the optimizer's state, as torchtitan's ModelWrapper and OptimizersContainer
    give it to DCP."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def check_ranks_agree(loader: gl.StatefulDataLoader[Any, Any]) -> None:
    """Every rank must hold the same loader state: DCP writes it from one rank."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())
    if any(state != states[0] for state in states):
        raise RuntimeError(f"the ranks' loader states differ, not saving: {states}")


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

    model = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(args.data),
        collate,
        sequence_length=SEQ,
        local_batch_size=args.batch_size,
        rank=rank,
        world_size=world_size,
        device=torch.device("cpu"),
        shuffle=True,
        shuffle_seed=1234,  # a resumed shuffle needs the same seed
        drop_last=False,  # every sample of the epoch; a trailing rank's last batch may be empty
        prefetch=2,
    )
    train_state = TrainState()
    # One entry per Stateful; "loader" is the loader itself: one global state, not one per rank.
    states = {
        "model_and_optimizer": ModelAndOptimizer(model, optimizer),
        "train_state": train_state,
        "loader": loader,
    }
    if args.resume:
        newest = max(args.checkpoint.glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))
        dcp.load(states, checkpoint_id=newest)  # calls loader.load_state_dict(...) on every rank

    seen: list[tuple[int, int]] = []  # (epoch, sample id), for --record
    audits: list[gl.AuditReport] = []  # at each epoch's end and at the save
    stopped = False
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
                loss.backward()
                optimizer.step()
                train_state.step += 1
                if train_state.step == args.stop_after or loader.remaining() == 0:
                    audits.append(loader.audit())  # a collective: every rank, at the same step
                if train_state.step == args.stop_after:
                    check_ranks_agree(loader)
                    dcp.save(states, checkpoint_id=args.checkpoint / f"step-{train_state.step}")
                    stopped = True
                    break
            if stopped:
                break
    state = loader.state_dict()
    print(f"rank {rank}: step {train_state.step}, loss {loss.item():.3f}, loader state {state}")
    if args.record:
        Path(f"{args.record}-rank{rank}.json").write_text(json.dumps({"seen": seen, "state": dict(state)}))
    # DDP's reducer holds the process group: release it first. A gloo group whose last holder is
    # the reducer is destroyed without releasing the GIL, which can deadlock with gloo's threads.
    del states, model
    dist.destroy_process_group()
    if rank == 0:
        print(exactly_once(audits, world_size))
    if not all(audit.ok for audit in audits):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
