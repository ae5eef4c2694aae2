"""What block verification costs: one epoch read with block digests against the same read
without them, locally and over S3 (moto), in one run.

    python -m benchmarks integrity [--mb 96] [--rounds 3] [--block-sizes 16,64,256]

(a) local, ``num_workers=0``, the README's collate (uint16 stream, sequence_length=2048,
local_batch_size=16, shuffle=True): a fresh process state each round (every block is checked on
first touch, as in a first epoch); (b) S3 on a local moto server with
``shuffle_block_size="auto"``. "off" is the same dataset with its block digests removed from the
manifest (the reads as before). Prints the throughput of each and the ratio on/off; with
``--block-sizes`` the local and remote reads are timed for each block size (KiB).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary


def _collate(samples: Any) -> Any:
    import torch

    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def _write(folder: Path, mb: int, block: int) -> None:
    import guideloom as gl
    from benchmarks._internals import written_block_bytes

    with written_block_bytes(block):
        rng = np.random.default_rng(1)
        n = mb * 2**20 // 2
        gl.write_stream(folder, (rng.integers(0, 50_000, n // 8, dtype=np.uint16) for _ in range(8)))


def _strip(src: Path, dst: Path) -> None:
    """``dst``: ``src``'s data files (linked) under a manifest without block digests."""
    dst.mkdir()
    doc = json.loads((src / "manifest.json").read_text())
    for spec in doc["fields"].values():
        for f in spec["files"]:
            f.pop("blocks", None)
            (dst / f["path"]).hardlink_to(src / f["path"])
    (dst / "manifest.json").write_text(json.dumps(doc))


def _epoch(storage: Any, fresh: bool = True, **kw: Any) -> float:
    """Tokens per second over one epoch (``fresh``: as a new process's first epoch)."""
    import torch

    import guideloom as gl
    from benchmarks._internals import forget_block_checks

    if fresh:
        forget_block_checks()  # as a fresh process: every block checked on first touch
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        _collate,
        sequence_length=2048,
        local_batch_size=16,
        shuffle=True,
        shuffle_seed=1234,
        prefetch=8,
        device=torch.device("cpu"),
        **kw,
    )
    t0 = time.perf_counter()
    n = 0
    with loader:
        for batch in loader:
            n += batch.numel()
    return n / (time.perf_counter() - t0)


def _compare(name: str, on: Any, off: Any, rounds: int, **kw: Any) -> float:
    """Best of ``rounds`` for each, interleaved, of a first epoch (every block checked) and of a
    later one (checked already); prints them and returns the first epoch's on/off."""
    best_on = best_off = later_on = later_off = 0.0
    for _ in range(rounds):
        best_off = max(best_off, _epoch(off(), **kw))
        best_on = max(best_on, _epoch(on(), **kw))
        later_off = max(later_off, _epoch(off(), fresh=False, **kw))
        later_on = max(later_on, _epoch(on(), fresh=False, **kw))
    ratio = best_on / best_off
    print(
        f"{name:<32} first epoch: verified {best_on / 1e6:7.1f} plain {best_off / 1e6:7.1f} Mtok/s "
        f"ratio {ratio:.3f} | later: verified {later_on / 1e6:7.1f} plain {later_off / 1e6:7.1f} "
        f"ratio {later_on / later_off:.3f}",
        flush=True,
    )
    return ratio


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks integrity", description=summary(__doc__))
    ap.add_argument("--mb", type=int, default=96, help="dataset size in MiB (over 64: not hashed on open)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-sizes", default="64", help="block sizes to time, KiB, comma-separated")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import guideloom as gl
    from guideloom_dev.servers import MotoS3

    s3 = MotoS3()
    try:
        s3.create_bucket("integrity")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for kib in [int(x) for x in args.block_sizes.split(",")]:
                on_dir, off_dir = root / f"on-{kib}", root / f"off-{kib}"
                _write(on_dir, args.mb, kib * 1024)
                _strip(on_dir, off_dir)
                _compare(
                    f"local nw=0, {kib} KiB blocks",
                    lambda d=on_dir: gl.open_stream(d),
                    lambda d=off_dir: gl.open_stream(d),
                    args.rounds,
                )
                s3.upload_folder(on_dir, "integrity", f"on-{kib}")
                s3.upload_folder(off_dir, "integrity", f"off-{kib}")
                opts = s3.options()
                _compare(
                    f"S3 (moto) auto blocks, {kib} KiB",
                    lambda k=kib, o=opts: gl.open_stream(f"s3://integrity/on-{k}", **o),
                    lambda k=kib, o=opts: gl.open_stream(f"s3://integrity/off-{k}", **o),
                    args.rounds,
                    shuffle_block_size="auto",
                )
    finally:
        s3.stop()


if __name__ == "__main__":
    main()
