"""guideloom mixtures: three sources in fixed proportions, resumed exactly on another job shape.

    python examples/mixture.py [--dir DIR]    # a few seconds on two CPU cores

What it does:
1. Writes a stream dataset ("web") and a document dataset ("code") under DIR (a temporary folder
   by default) and keeps a third source in memory ("math", a ``MapDataset`` of token arrays).
2. Mixes them 60/30/10 with ``gl.mix`` and reads 300 global batches of 16 on one rank, the
   uninterrupted run, logging each sample's source and a fingerprint of its tokens.
3. Reads the first 120 batches again, saves ``loader.state_dict()`` with ``torch.save``, and
   resumes from that file as a job of 2 ranks with 4 samples each (global batch 8).
4. Checks that the two parts together are the uninterrupted run, sample for sample, that every
   prefix held each source's share within the schedule's bound, and prints the sources' counts,
   bounds and own epochs (``loader.stats()``).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import guideloom as gl

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
SEQ = 64
STEPS, STOP = 300, 120
SEED = 1234


def fingerprints(samples: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, str]]:
    """Collate: each sample's source and a short digest of its tokens (module level: picklable)."""
    return [(name, hashlib.blake2b(x.tobytes(), digest_size=6).hexdigest()) for name, x in samples]


def build(folder: Path) -> gl.Mixture:
    rng = np.random.default_rng(0)
    gl.write_stream(folder / "web", rng.integers(0, 50_000, 100_000, dtype=np.uint16), overwrite=True)
    docs = [rng.integers(0, 50_000, n, dtype=np.uint16) for n in rng.integers(20, 200, 400)]
    gl.write_documents(folder / "code", docs, overwrite=True)
    math: gl.MapDataset[np.ndarray] = gl.MapDataset(
        [rng.integers(0, 50_000, SEQ, dtype=np.uint16) for _ in range(150)]
    )
    sources: dict[str, Any] = {
        "web": gl.open_stream(folder / "web"),
        "code": gl.open_documents(folder / "code"),
        "math": math,
    }
    return gl.mix(sources, WEIGHTS, sequence_length={"web": SEQ}, num_samples=10_000, with_source=True)


def loader(mixture: gl.Mixture, batch: int, rank: int = 0, world: int = 1) -> gl.StatefulDataLoader[Any, Any]:
    return gl.StatefulDataLoader(
        mixture,
        fingerprints,
        local_batch_size=batch,
        rank=rank,
        world_size=world,
        shuffle=True,
        shuffle_seed=SEED,
        device=torch.device("cpu"),
    )


def run(folder: Path) -> None:
    mixture = build(folder)
    with loader(mixture, 16) as full:
        it = iter(full)
        uninterrupted = [x for _, batch in zip(range(STEPS), it, strict=False) for x in batch]
        it.close()
        stats = full.stats()

    with loader(mixture, 16) as first:
        it = iter(first)
        head = [x for _, batch in zip(range(STOP), it, strict=False) for x in batch]
        it.close()
        torch.save({"loader": first.state_dict()}, folder / "ckpt.pt")

    state = torch.load(folder / "ckpt.pt", weights_only=True)["loader"]
    per_rank = []
    for rank in range(2):  # the ranks of the resumed job, one after the other in this process
        with loader(mixture, 4, rank=rank, world=2) as ld:
            ld.load_state_dict(state)
            it = iter(ld)
            per_rank.append([b for _, b in zip(range((STEPS - STOP) * 2), it, strict=False)])
            it.close()
    tail = [x for step in zip(*per_rank, strict=True) for rank_batch in step for x in rank_batch]

    assert head + tail == uninterrupted, "the resumed job differs from the uninterrupted run"
    names = [name for name, _ in uninterrupted]
    bounds = mixture.discrepancy_bounds
    for source, weight in WEIGHTS.items():
        counts = np.cumsum([n == source for n in names])
        worst = float(np.abs(counts - weight * np.arange(1, len(names) + 1)).max())
        assert worst <= bounds[source] + 1e-9, (source, worst)
        epoch = stats[f"source_epoch/{source}"]
        print(
            f"{source:>5}: {counts[-1]:5d} of {len(names)} samples (weight {weight}), worst prefix "
            f"off by {worst:.2f} (bound {bounds[source]:.2f}), in its source epoch {epoch:.0f}"
        )
    print(
        f"resumed at offset {state['observation_offset']} on 2 ranks x 4: identical to the uninterrupted run"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="where to write the datasets (default: a temporary folder)")
    args = ap.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        run(args.dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp))


if __name__ == "__main__":
    main()
