"""Pre-tokenized Parquet on the layout Hugging Face ``datasets`` writes: no workers against 2
process workers, and the first batch after ``load_state_dict``, in one run.

Workload: the real prose of ``python -m benchmarks parquet`` (``benchmarks/parquet_prose.py``),
tokenized with its 32,768-id BPE tokenizer into an ``input_ids`` ``list<int32>`` column (``</s>``
after each document) and written as 12 shards of one row group each (made once, cached with the
prose). ``from_storage(open_parquet(folder, "input_ids"))``, ``local_batch_size=32``,
``shuffle=True``, ``shuffle_block_size="auto"`` (a global shuffle on this layout: a batch touches
every row group), a collate that concatenates the documents into one int64 tensor and their
lengths.

What it measures, each configuration in a fresh process (alternated with the other trees when
``--trees`` names several, so that a pair shares the machine's load):

- ``nw0``: no workers; ``p2``: ``num_workers=2, parallel_method="process",
  persistent_workers=True``. ``--epochs`` epochs each. *Epoch 1* is timed from ``iter()`` to its
  last batch (the workers' start and every row group's first decode included); *steady* is the
  median rate of epochs 2 and after (what a run of many epochs sees: persistent workers keep
  their decoded row groups). Both rates are reported as ratios of ``p2`` to ``nw0`` of the same
  tree and round; beside them the CPU microseconds per batch of the main process and of the
  workers over the steady epochs. *read, collate*: at no workers, the CPU per batch of the
  storage's reads and of the collate, timed in a run of their own (up to 6 epochs; the rest of
  ``nw0``'s CPU is the loader's own). *1.5x budget*: what the main process and the
  workers may spend together per batch for ``p2`` to deliver 1.5x ``nw0``'s rate on 2 cores
  (2 x ``nw0``'s CPU per batch / 1.5). *p2 CPU ceiling*: the most ``p2`` could deliver, as a
  ratio to ``nw0``, were it bound by CPU alone: its main process's CPU per batch against
  ``nw0``'s (the main process is one core), and its total against 2 cores' worth
  (``min(nw0 / main, 2 x nw0 / (main + workers))``).
- ``handoff``: PyTorch's own ``DataLoader`` (``num_workers=2``, ``persistent_workers=True``,
  ``batch_size=None``) over a dataset whose items are batches made already (``nw0``'s first 256,
  cycled): no read and no collate, only the hand-off of each finished batch from a worker
  process to the main process. Its steady rate, as a ratio to ``nw0``'s, is what that hand-off
  alone allows: below 1.0, moving a batch between processes costs more than making it.
- ``resume``: a fresh loader (no workers) in a process that has opened one already, then
  ``load_state_dict`` at a random mid-epoch offset and its first batch: wall and CPU
  milliseconds (CPU: the process's, every thread), median of ``--resumes``.

    python -m benchmarks parquet-tokens [--rounds 3] [--epochs 12] [--trees /path/a,/path/b]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (see child): the benchmarks package is found here
    sys.path.append(str(ROOT))
BATCH = 32


def tokens_dir() -> Path:
    """The pre-tokenized shards (made once from the prose corpus's one-row-group layout)."""
    from benchmarks.parquet_prose import data_dir, make_data

    out = data_dir() / "tokens"
    if (out / "done").exists():
        return out
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    data = make_data(int(75e6))
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(glob.glob(str(data / "one" / "*.parquet"))):
        texts = pq.read_table(f).column("text").to_pylist()
        ids = [[*e.ids, eos] for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
        table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))})
        pq.write_table(table, out / Path(f).name, row_group_size=len(ids))  # one row group a shard
    (out / "done").touch()
    return out


def collate(samples: Sequence[Any]) -> Any:
    """Documents to one flat int64 tensor and their lengths."""
    import torch

    lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    return torch.from_numpy(np.concatenate(samples).astype(np.int64)), torch.from_numpy(lengths)


#: Thread CPU seconds of the storage's reads and of the collates, where timed (no workers).
SPENT = {"read": 0.0, "collate": 0.0}


def _timed(key: str, fn: Any) -> Any:
    def run(arg: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(arg)
        finally:
            SPENT[key] += time.thread_time() - c0

    return run


def make_loader(folder: Path, workers: int, timed: bool = False) -> Any:
    """The loader measured; ``timed`` (no workers): its reads and collates timed in ``SPENT``."""
    import torch

    import guideloom as gl

    kw: dict[str, Any] = {}
    if workers:
        kw = {"num_workers": workers, "parallel_method": "process", "persistent_workers": True}
    storage = gl.open_parquet(folder, "input_ids")
    fn: Any = collate
    if timed and not workers:
        storage.read_many_sync = _timed("read", storage.read_many_sync)  # type: ignore[method-assign]
        fn = _timed("collate", collate)
    return gl.StatefulDataLoader.from_storage(
        storage, fn, local_batch_size=BATCH, shuffle=True, shuffle_block_size="auto",
        device=torch.device("cpu"), **kw,
    )  # fmt: skip


def cpu_split() -> tuple[float, float]:
    """CPU seconds of this process and of its descendants (the workers, their fork server)."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    rest = 0.0
    for p in me.children(recursive=True):
        try:
            rest += sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    return own, rest


def run_epochs(folder: Path, workers: int, epochs: int, timed: bool = False) -> dict[str, float]:
    rates, batches = [], 0
    with make_loader(folder, workers, timed=timed) as loader:
        for epoch in range(epochs):
            if epoch == 1:
                c0 = cpu_split()
                SPENT.update(read=0.0, collate=0.0)
            tokens, t0 = 0, time.perf_counter()
            for flat, _ in loader:
                tokens += int(flat.numel())
                batches += epoch > 0
            rates.append(tokens / (time.perf_counter() - t0))
        c1 = cpu_split()
    return {
        "epoch1_tok_s": rates[0],
        "steady_tok_s": statistics.median(rates[1:]),
        "main_us_batch": (c1[0] - c0[0]) / max(1, batches) * 1e6,
        "workers_us_batch": (c1[1] - c0[1]) / max(1, batches) * 1e6,
        "read_us_batch": SPENT["read"] / max(1, batches) * 1e6,
        "collate_us_batch": SPENT["collate"] / max(1, batches) * 1e6,
    }


class _Made:
    """Batches made already, cycled to ``n`` items: a map-style dataset for ``run_handoff``."""

    def __init__(self, batches: list[Any], n: int) -> None:
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]


def run_handoff(folder: Path, epochs: int) -> dict[str, float]:
    """PyTorch's DataLoader, 2 persistent process workers, handing over batches made already."""
    from torch.utils.data import DataLoader

    with make_loader(folder, 0) as loader:
        made = [b for _, b in zip(range(256), loader, strict=False)]
        n = len(loader)
    dl: Any = DataLoader(_Made(made, n), batch_size=None, num_workers=2, persistent_workers=True)  # type: ignore[arg-type]
    rates, walls = [], []
    for _ in range(epochs):
        tokens, t0 = 0, time.perf_counter()
        for flat, _ in dl:
            tokens += int(flat.numel())
        walls.append(time.perf_counter() - t0)
        rates.append(tokens / walls[-1])
    return {"steady_tok_s": statistics.median(rates[1:]), "us_batch": 1e6 * statistics.median(walls[1:]) / n}


def run_resumes(folder: Path, repeats: int) -> dict[str, float]:
    with make_loader(folder, 0) as warm:
        n = len(warm.dataset)
        saved = warm.state_dict()
    rng = np.random.default_rng(1)
    wall, cpu = [], []
    for _ in range(repeats):
        state = {**saved, "observation_offset": int(rng.integers(1, n // BATCH)) * BATCH}
        t0, p0 = time.perf_counter(), time.process_time()
        with make_loader(folder, 0) as fresh:
            fresh.load_state_dict(state)
            next(iter(fresh))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - p0)
    return {"resume_ms": 1e3 * statistics.median(wall), "resume_cpu_ms": 1e3 * statistics.median(cpu)}


def child(tree: str, config: str, args: argparse.Namespace) -> dict[str, float]:
    # run as a file from the tree's root: ``-m`` would put the working directory (whose
    # guideloom that is) ahead of PYTHONPATH
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", config,
         "--epochs", str(args.epochs), "--resumes", str(args.resumes)],
        cwd=tree, env={**os.environ, "PYTHONPATH": f"{tree}:{ROOT}"}, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{config} on {tree} exited with {out.returncode}:\n{out.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(got.pop("guideloom")).resolve() != Path(tree).resolve() / "guideloom" / "__init__.py":
        raise RuntimeError(f"the run meant for {tree} imported another guideloom")
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks parquet-tokens", description=summary(__doc__))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=12, help="epochs per run (the first is reported alone)")
    ap.add_argument("--resumes", type=int, default=5, help="first batches after load_state_dict per run")
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated guideloom checkouts to alternate")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    folder = tokens_dir()
    if args.child:
        import guideloom

        got: dict[str, Any] = {"guideloom": guideloom.__file__}
        if args.child == "resume":
            got.update(run_resumes(folder, args.resumes))
        elif args.child == "handoff":
            got.update(run_handoff(folder, max(3, min(args.epochs, 6))))
        elif args.child == "parts":  # no workers, the reads and collates timed (a run of its own)
            got.update(run_epochs(folder, 0, min(args.epochs, 6), timed=True))
        else:
            got.update(run_epochs(folder, 0 if args.child == "nw0" else 2, args.epochs))
        print(json.dumps(got))
        return
    trees = args.trees.split(",")
    print(f"{len(glob.glob(str(folder / '*.parquet')))} shards in {folder}; load average {os.getloadavg()}")
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            got = {c: child(tree, c, args) for c in ("nw0", "p2", "handoff", "resume", "parts")}
            row = {
                "epoch1_x": got["p2"]["epoch1_tok_s"] / got["nw0"]["epoch1_tok_s"],
                "steady_x": got["p2"]["steady_tok_s"] / got["nw0"]["steady_tok_s"],
                "nw0_epoch1_Mtok_s": got["nw0"]["epoch1_tok_s"] / 1e6,
                "p2_epoch1_Mtok_s": got["p2"]["epoch1_tok_s"] / 1e6,
                "nw0_us_batch": got["nw0"]["main_us_batch"],
                "nw0_read_us": got["parts"]["read_us_batch"],
                "nw0_collate_us": got["parts"]["collate_us_batch"],
                "p2_main_us_batch": got["p2"]["main_us_batch"],
                "p2_workers_us_batch": got["p2"]["workers_us_batch"],
                "handoff_x": got["handoff"]["steady_tok_s"] / got["nw0"]["steady_tok_s"],
                "handoff_us_batch": got["handoff"]["us_batch"],
                **got["resume"],
                "load": os.getloadavg()[0],
            }
            rows[tree].append(row)
            print(f"round {r + 1} {tree}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(f"\nmedians over {args.rounds} round(s); load average after {os.getloadavg()}")
    print("| tree | p2 / nw0 epoch 1 | p2 / nw0 steady | CPU us/batch nw0 (read, collate) | p2 main "
          "| p2 workers | 1.5x budget | p2 CPU ceiling | torch hand-off alone / nw0 (us/batch) "
          "| first batch after resume ms (CPU ms) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tree, rs in rows.items():

        def med(key: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        nw0, main_us, workers_us = med("nw0_us_batch"), med("p2_main_us_batch"), med("p2_workers_us_batch")
        ceiling = min(nw0 / max(main_us, 1e-9), 2 * nw0 / max(main_us + workers_us, 1e-9))
        print(
            f"| {tree} | {med('epoch1_x'):.2f} | {med('steady_x'):.2f} | {nw0:.0f} "
            f"({med('nw0_read_us'):.0f}, {med('nw0_collate_us'):.0f}) | {main_us:.0f} | "
            f"{workers_us:.0f} | {2 * nw0 / 1.5:.0f} | {ceiling:.2f} | "
            f"{med('handoff_x'):.2f} ({med('handoff_us_batch'):.0f}) | "
            f"{med('resume_ms'):.0f} ({med('resume_cpu_ms'):.0f}) |"
        )


if __name__ == "__main__":
    main()
