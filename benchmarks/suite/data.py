"""The data, generated once outside the repository and cached by its parameters.

One uint16 token stream (seeded) is written as a guideloom stream dataset; its data file is a raw
uint16 file, which is the memmap the torch, torchdata and Grain loaders read. The same tokens are
written as MDS shards (MosaicML Streaming) and with ``litdata.optimize(..., TokensLoader())``.

The "virtual epoch" for the resume at batch 1,000,000 (2**24 samples of 2048 tokens, 64 GiB) is a
sparse file for the raw and guideloom layouts, and the first real MDS shard / LitData chunk
listed over and over (symlinks) for the others: no peer reads more than it would from real data.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEQ = 2048
BATCH = 16
SEED = 0
BIG_SAMPLES = 2**24  # >= 1,000,001 batches of 16
CHUNK = 8 * 2**20


def data_root() -> Path:
    root = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class Data:
    root: Path
    tokens: int

    @property
    def samples(self) -> int:
        return self.tokens // SEQ

    @property
    def gl(self) -> Path:  # guideloom stream dataset (shared with benchmarks/local_stream.py)
        return self.root / f"stream-u16-{self.tokens}"

    @property
    def raw(self) -> Path:
        man = json.loads((self.gl / "manifest.json").read_text())
        return self.gl / man["fields"]["tokens"]["files"][0]["path"]

    @property
    def suite(self) -> Path:
        return self.root / f"suite-u16-{self.tokens}-seq{SEQ}-seed{SEED}"

    @property
    def mds(self) -> Path:
        return self.suite / "bucket" / "mds"

    @property
    def litdata(self) -> Path:
        return self.suite / "bucket" / "litdata"

    @property
    def big_gl(self) -> Path:
        return self.root / f"virtual-u16-{BIG_SAMPLES}x{SEQ}"

    @property
    def big_raw(self) -> Path:
        return self.big_gl / "tokens.bin"

    @property
    def big_mds(self) -> Path:
        return self.suite / "virtual-mds"

    @property
    def big_litdata(self) -> Path:
        return self.suite / "virtual-litdata"


def _chunks(tokens: int) -> Any:
    rng = np.random.default_rng(SEED)
    for start in range(0, tokens, CHUNK):
        yield rng.integers(0, 50_000, min(CHUNK, tokens - start), dtype=np.uint16)


def ensure_gl(d: Data) -> None:
    if (d.gl / "manifest.json").exists():
        return
    import guideloom as gl

    print(f"  writing {d.tokens:,} tokens to {d.gl}", flush=True)
    gl.write_stream(d.gl, _chunks(d.tokens), dtype=np.uint16, overwrite=True)


def ensure_big(d: Data) -> None:
    if (d.big_gl / "manifest.json").exists():
        return
    n = BIG_SAMPLES * SEQ
    d.big_gl.mkdir(parents=True, exist_ok=True)
    with open(d.big_raw, "wb") as f:
        f.truncate(2 * n)  # sparse: reads return zeros, nothing is stored
    man = {
        "format": "guideloom-dataset",
        "format_version": 1,
        "kind": "stream",
        "dtype": "uint16",
        "num_elements": n,
        "checksum": "sha256",
        "fields": {
            "tokens": {
                "dtype": "uint16",
                "files": [{"path": "tokens.bin", "elements": n, "bytes": 2 * n, "sha256": "0" * 64}],
            }
        },
    }
    (d.big_gl / "manifest.json").write_text(json.dumps(man))


def ensure_mds(d: Data) -> None:
    if (d.mds / "index.json").exists():
        return
    from streaming import MDSWriter

    print(f"  writing MDS shards to {d.mds}", flush=True)
    tmp = d.mds.with_name("mds.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    rows = np.memmap(d.raw, dtype=np.uint16, mode="r")[: d.samples * SEQ].reshape(d.samples, SEQ)
    with MDSWriter(out=str(tmp), columns={"tokens": "bytes"}, size_limit=1 << 26) as w:
        for i in range(d.samples):
            w.write({"tokens": rows[i].tobytes()})
    tmp.rename(d.mds)


def _litdata_fn(span: tuple[int, int, str]) -> Any:
    import torch

    start, stop, path = span
    yield torch.from_numpy(np.array(np.memmap(path, dtype=np.uint16, mode="r")[start:stop]))


def ensure_litdata(d: Data) -> None:
    if (d.litdata / "index.json").exists():
        return
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    print(f"  writing LitData chunks (optimize + TokensLoader) to {d.litdata}", flush=True)
    tmp = d.litdata.with_name("litdata.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    usable = d.samples * SEQ
    spans = [(s, min(s + CHUNK, usable), str(d.raw)) for s in range(0, usable, CHUNK)]
    optimize(
        fn=_litdata_fn,
        inputs=spans,
        output_dir=str(tmp),
        chunk_size=SEQ * 8192,  # tokens per chunk (32 MiB)
        item_loader=TokensLoader(),
        num_workers=1,
        mode="overwrite",
    )
    tmp.rename(d.litdata)


def ensure_big_mds(d: Data) -> None:
    if (d.big_mds / "index.json").exists():
        return
    index = json.loads((d.mds / "index.json").read_text())
    shard = index["shards"][0]
    copies = -(-BIG_SAMPLES // shard["samples"])
    tmp = d.big_mds.with_name("virtual-mds.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = []
    for k in range(copies):
        name = f"shard.{k:05d}.mds"
        os.symlink(d.mds / shard["raw_data"]["basename"], tmp / name)
        entry = json.loads(json.dumps(shard))
        entry["raw_data"]["basename"] = name
        shards.append(entry)
    index["shards"] = shards
    (tmp / "index.json").write_text(json.dumps(index))
    tmp.rename(d.big_mds)


def ensure_big_litdata(d: Data) -> None:
    if (d.big_litdata / "index.json").exists():
        return
    index = json.loads((d.litdata / "index.json").read_text())
    chunk = index["chunks"][0]
    per_chunk = chunk["dim"] // SEQ
    copies = -(-BIG_SAMPLES // per_chunk)
    tmp = d.big_litdata.with_name("virtual-litdata.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    chunks = []
    for k in range(copies):
        name = f"chunk-0-{k}.bin"
        os.symlink(d.litdata / chunk["filename"], tmp / name)
        chunks.append({**chunk, "filename": name})
    index["chunks"] = chunks
    (tmp / "index.json").write_text(json.dumps(index))
    tmp.rename(d.big_litdata)


def ensure_all(tokens: int, *, peers: bool = True) -> Data:
    d = Data(data_root(), tokens)
    ensure_gl(d)
    ensure_big(d)
    if peers:
        ensure_mds(d)
        ensure_litdata(d)
        ensure_big_mds(d)
        ensure_big_litdata(d)
    return d
