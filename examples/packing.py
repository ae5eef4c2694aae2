"""guideloom packing example: documents packed into sequences, a document-masked model, resume.

    python examples/packing.py                     # about 20 seconds on two CPU cores
    python examples/packing.py --mode concat --steps 40

What it does:
1. Writes the standard library's ``.py`` files as a document dataset, one document per file (a
   byte per token), with ``guideloom.write_documents``.
2. Packs them with ``guideloom.pack`` into sequences of 256 tokens (``best_fit`` by default).
3. Trains a tiny causal transformer whose attention is masked per document (torch's
   ``scaled_dot_product_attention`` with the mask built from ``segment_ids``) and whose
   positions restart at each document (``position_ids``); padding is left out of the loss.
4. Stops half-way, saves ``loader.state_dict()`` with ``torch.save``, resumes in a fresh loader
   with another batch size, and checks that the resumed run saw exactly the sequences of an
   uninterrupted one.
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

import guideloom as gl

SEQ = 256
VOCAB = 256


def documents(limit_bytes: int) -> Iterator[np.ndarray]:
    """The standard library's .py files, each one document of bytes."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        if data:
            yield np.frombuffer(data, dtype=np.uint8)
            total += len(data)
        if total >= limit_bytes:
            return


def collate(samples: gl.PackedRows) -> dict[str, torch.Tensor]:
    """Packed sequences -> tokens, positions, a (B, 1, L, L) document mask and a loss mask."""
    tokens = torch.from_numpy(samples.block("tokens").astype(np.int64))
    segments = torch.from_numpy(samples.block("segment_ids"))
    positions = torch.from_numpy(samples.block("position_ids").astype(np.int64))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
    # predict token t+1 from t only inside one document piece (and never on padding)
    same_next = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return {"tokens": tokens, "positions": positions, "mask": mask, "loss_mask": same_next}


class TinyLM(nn.Module):
    """One document-masked attention block over byte embeddings and per-document positions."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(positions)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)
        return self.head(x + self.mlp(x))


def make_loader(
    data: Path, mode: str, batch_size: int
) -> gl.StatefulDataLoader[object, dict[str, torch.Tensor]]:
    dataset = gl.pack(gl.open_documents(data), SEQ, mode)  # type: ignore[arg-type]
    return gl.StatefulDataLoader(
        dataset,
        collate,
        local_batch_size=batch_size,
        shuffle=True,
        shuffle_seed=42,
        device=torch.device("cpu"),
    )


def train(model: TinyLM, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    logits = model(batch["tokens"], batch["positions"], batch["mask"])[:, :-1]
    loss = nn.functional.cross_entropy(logits[batch["loss_mask"]], batch["tokens"][:, 1:][batch["loss_mask"]])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["best_fit", "concat"], default="best_fit")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--corpus-mb", type=float, default=2.0)
    ap.add_argument("--data", type=Path, help="where to write the documents (default: a temporary folder)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp) / "stdlib-docs"
        manifest = gl.write_documents(
            data, documents(int(args.corpus_mb * 2**20)), dtype=np.uint8, overwrite=True
        )
        print(f"{manifest.num_documents} documents, {manifest.num_elements:,} bytes written to {data}")

        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        half = args.steps // 2
        seen: list[torch.Tensor] = []
        with make_loader(data, args.mode, 8) as loader:
            packed = loader.dataset
            print(f"{len(packed)} packed sequences of {SEQ} ({args.mode}), {len(loader)} batches of 8")
            for step, batch in zip(range(half), loader, strict=False):
                loss = train(model, opt, batch)
                seen.append(batch["tokens"])
                if step % 10 == 0:
                    print(f"step {step:3d}  loss {loss:.3f}")
            ckpt = Path(tmp) / "ckpt.pt"
            torch.save({"loader": loader.state_dict(), "model": model.state_dict()}, ckpt)
        print(f"saved a checkpoint after {half} steps; resuming with local_batch_size=4")

        state = torch.load(ckpt, weights_only=True)
        with make_loader(data, args.mode, 4) as resumed:
            resumed.load_state_dict(state["loader"])
            for step, batch in zip(range(2 * (args.steps - half)), resumed, strict=False):
                loss = train(model, opt, batch)
                seen.append(batch["tokens"])
                if step % 20 == 0:
                    print(f"resumed step {step:3d}  loss {loss:.3f}")
        with make_loader(data, args.mode, 8) as whole:
            expected = torch.cat([b["tokens"] for _, b in zip(range(args.steps), whole, strict=False)])
        if not torch.equal(torch.cat(seen), expected):
            raise SystemExit("the resumed run did not see the sequences of the uninterrupted one")
        print(f"resumed run == uninterrupted run: {len(expected)} sequences, each once, in order")


if __name__ == "__main__":
    main()
