"""guideloom quickstart: write a corpus, train a tiny language model, checkpoint, resume exactly.

    python examples/quickstart.py            # the whole demo, about a minute on two CPU cores

What it does:
1. Writes a small real corpus (the bytes of Python's own standard library sources) to a local
   stream dataset with ``guideloom.write_stream``.
2. Trains a tiny causal transformer on it for a few hundred steps without interruption, logging
   a fingerprint of every batch (run A).
3. Trains again, but stops half-way and saves a checkpoint with ``torch.save`` holding the model,
   the optimizer and ``loader.state_dict()`` (run B), then resumes in a *fresh process* from that
   checkpoint (run C).
4. Checks that B + C saw exactly the batches of A, in order, and reached the same loss, and prints
   the loader's and the training loop's throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

import guideloom as gl

SEQ = 128
BATCH = 16
VOCAB = 256


def corpus_chunks(limit_bytes: int) -> Iterator[np.ndarray]:
    """The standard library's .py files, as bytes (one token per byte)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        yield np.frombuffer(data, dtype=np.uint8)
        total += len(data)
        if total >= limit_bytes:
            return


def collate(samples: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(np.stack(samples).astype(np.int64))
    return {"input": tokens[:, :-1], "target": tokens[:, 1:]}


class TinyLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.blocks(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(h)


def fingerprint(batch: dict[str, torch.Tensor]) -> str:
    return hashlib.sha1(batch["input"].numpy().tobytes()).hexdigest()[:12]


def train(args: argparse.Namespace) -> None:
    """One training process (run A, B or C)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(args.data),
        collate,
        sequence_length=SEQ,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=1234,
        prefetch=4,
        device=torch.device("cpu"),
    )
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
    log = []
    t0 = time.perf_counter()
    first_step = step
    loss = torch.tensor(float("nan"))
    with loader:
        while step < args.steps:
            for batch in loader:
                logits = model(batch["input"])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["target"].reshape(-1))
                optim.zero_grad()
                loss.backward()
                optim.step()
                log.append({"step": step, "batch": fingerprint(batch), "loss": round(loss.item(), 6)})
                step += 1
                if step == args.stop_at:
                    torch.save(
                        {
                            "model": model.state_dict(),
                            "optim": optim.state_dict(),
                            "loader": loader.state_dict(),
                            "step": step,
                        },
                        args.checkpoint,
                    )
                    print(f"  checkpoint at step {step}: loader state {loader.state_dict()}")
                if step == args.steps or step == args.stop_at:
                    break
            if step == args.stop_at:
                break
    dt = time.perf_counter() - t0
    Path(args.log).write_text(json.dumps(log))
    print(
        f"  steps {first_step}..{step - 1}: loss {loss.item():.3f}, "
        f"{(step - first_step) * BATCH * SEQ / dt:,.0f} tokens/s"
    )


def loader_throughput(data: Path) -> float:
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(data),
        collate,
        sequence_length=SEQ,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=0,
        prefetch=16,
        device=torch.device("cpu"),
    )
    with loader:
        t0 = time.perf_counter()
        n = sum(1 for _ in loader)
        return n * BATCH / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="demo", choices=["demo", "train"])
    ap.add_argument("--data", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stop-at", type=int, default=-1)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    args = ap.parse_args()
    if args.command == "train":
        train(args)
        return

    with tempfile.TemporaryDirectory(prefix="guideloom-quickstart-") as tmp:
        work = Path(tmp)
        data = work / "corpus"
        t0 = time.perf_counter()
        manifest = gl.write_stream(data, corpus_chunks(int(args.corpus_mb * 2**20)), dtype=np.uint8)
        print(
            f"1. wrote {manifest.num_elements:,} tokens (stdlib sources, one per byte) to {data} "
            f"in {time.perf_counter() - t0:.2f} s"
        )
        print(
            f"   the loader reads {loader_throughput(data):,.0f} samples/s of {SEQ} tokens "
            f"(shuffled, batch {BATCH}, prefetch 16)"
        )

        def run(label: str, *extra: str) -> list[dict[str, object]]:
            print(label)
            log = work / f"log-{len(list(work.glob('log-*')))}.json"
            cmd = [
                sys.executable,
                __file__,
                "train",
                "--data",
                str(data),
                "--steps",
                str(args.steps),
                "--log",
                str(log),
                *extra,
            ]
            subprocess.run(cmd, check=True)
            return json.loads(log.read_text())

        half = args.steps // 2
        ckpt = work / "ckpt.pt"
        a = run(f"2. run A: {args.steps} steps without interruption")
        b = run(
            f"3. run B: stops at step {half} and saves a checkpoint",
            "--stop-at",
            str(half),
            "--checkpoint",
            str(ckpt),
        )
        c = run("   run C: a fresh process resumes from the checkpoint", "--resume", str(ckpt))
        same_batches = [r["batch"] for r in a] == [r["batch"] for r in b + c]
        same_loss = a[-1]["loss"] == c[-1]["loss"]
        print(
            "4. resumed run saw exactly the batches of the uninterrupted run: "
            f"{'yes' if same_batches else 'NO'}"
            f" ({len(b)} + {len(c)} = {len(a)} batches); final loss {a[-1]['loss']} vs {c[-1]['loss']}"
            f" ({'identical' if same_loss else 'different'})"
        )
        if not (same_batches and same_loss):
            sys.exit(1)


if __name__ == "__main__":
    main()
