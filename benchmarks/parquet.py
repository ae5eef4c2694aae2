"""Training on Parquet where it lies: ``gl.open_parquet`` against its peers, in one run.

Workload: a folder of Parquet shards (``train-0000k-of-0000n.parquet``, zstd, row groups of
1,000 rows) with a ``text`` column (Zipf-distributed pseudo-words, about 900 characters a row)
and an ``input_ids`` column (``list<int32>``: the same texts tokenized), and a BPE
``tokenizer.json`` (``tokenizers``, 8,192 ids) trained on them. Every configuration runs in a
fresh process of its own, one after the other, in alternating rounds; its peak PSS (its own and
its worker processes', sampled every 200 ms from the parent, so that no sampling thread runs in
the measured process) is reported beside its speed, and each figure as a ratio to its baseline
of the same round (this machine is shared and noisy).

Text, tokenized with 2 process workers (local_batch_size 32, shuffled, one epoch):

- ``gl-parquet-text``: ``open_parquet(folder, "text", tokenizer=..., eos=...)``,
  ``shuffle_block_size="auto"`` (row-group blocks), 2 process workers tokenizing where they
  collate.
- ``hf-streaming``: Hugging Face ``datasets``: ``load_dataset("parquet", data_files=...,
  streaming=True)``, ``.shuffle(buffer_size=1000)``, ``split_dataset_by_node``, ``.map`` of the
  same tokenizer (batched), under torchdata's ``StatefulDataLoader(num_workers=2)``.
- ``gl-stream-prepared``: the same texts prepared with ``guideloom prepare`` (same tokenizer and
  end-of-document id) read by guideloom's stream loader (sequence_length 1024, 2 process
  workers): tokens/s against tokens/s.
- ``tokenize-ceiling``: the tokenizer alone, ``encode_batch_fast`` of batches of 32 of the same
  texts on 2 processes, no loader: both loaders are reported as fractions of it.

``gl-stream-prepared+libs`` and ``gl-stream-tokens+libs``: the stream loaders in a process that
has also imported pyarrow's Parquet reader and ``tokenizers`` and loaded the tokenizer, what any
reader of Parquet that tokenizes loads: beside them, the memory that guideloom's Parquet reading
adds (a window of decoded row groups, its own state) is told from the libraries' own.

Pre-tokenized ``list<int32>``, no workers (local_batch_size 32, shuffled): ``gl-parquet-tokens``
against ``gl-stream-tokens``, the same tokens as a guideloom stream dataset (sequence_length
1024), and ``gl-stream-tokens-doclen``, the same stream cut into samples as long as the mean
document (so that a batch carries as many tokens as a batch of rows): tokens/s.

Also: pyarrow's decode of the ``input_ids`` row groups alone (one thread), as a fraction of the
stream loaders' tokens/s (what reading rows decoded once an epoch can reach); the time to the
first batch after ``load_state_dict`` at a mid-epoch offset (a loader
already open, and a fresh one that opens the files first), the time to open 1,000 files, the
length index's cost per GB of text (what ``pack`` needs over a text column), and the shuffle
quality of the row-group order against a global shuffle (``benchmarks/shuffle_quality.py``'s
figures).

    python -m benchmarks parquet-synthetic            # the full run (~6 minutes once the data exists)
    python -m benchmarks parquet-synthetic --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 32
SEQ = 1024
ROW_GROUP = 1000
VOCAB = 8192
#: Decoded row groups kept: a mixing window's (16 row groups of about 1 MB) but not the whole
#: data set, so that every epoch decodes every row group again, as it would at scale.
DECODED = 20 * 2**20
TEXT_CONFIGS = (
    "gl-parquet-text",
    "hf-streaming",
    "gl-stream-prepared",
    "gl-stream-prepared+libs",
    "tokenize-ceiling",
)
TOKEN_CONFIGS = ("gl-parquet-tokens", "gl-stream-tokens", "gl-stream-tokens+libs", "gl-stream-tokens-doclen")
#: A configuration ending in this runs the stream loader in a process that has also imported
#: pyarrow's Parquet reader and ``tokenizers`` and loaded the tokenizer: the libraries any reader
#: of Parquet that tokenizes must load, so that the memory guideloom adds can be told from theirs.
LIBS = "+libs"


# -- data ----------------------------------------------------------------------------------------------
def data_dir(rows: int, files: int) -> Path:
    base = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    return base / f"parquet-{rows}-{files}"


def make_data(rows: int, files: int) -> Path:
    """The Parquet folder, the tokenizer and the prepared stream datasets (made once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import guideloom as gl

    out = data_dir(rows, files)
    if (out / "done").exists():
        return out
    (out / "data").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, int(rng.integers(2, 9)))) for _ in range(20_000)
    ]
    counts = rng.integers(60, 260, rows)
    ids = np.minimum(rng.zipf(1.2, int(counts.sum())), len(words)) - 1
    ends = np.cumsum(counts)
    texts = [
        " ".join(words[i] for i in ids[e - c : e])
        for e, c in zip(ends.tolist(), counts.tolist(), strict=True)
    ]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts[:5000], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]", "</s>"])
    )
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    encoded = [[*e.ids, eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
    for f, part in enumerate(np.array_split(np.arange(rows), files)):
        table = pa.table(
            {
                "text": [texts[i] for i in part],
                "input_ids": pa.array([encoded[i] for i in part], pa.list_(pa.int32())),
            }
        )
        pq.write_table(
            table,
            out / "data" / f"train-{f:05d}-of-{files:05d}.parquet",
            row_group_size=ROW_GROUP,
            compression="zstd",
        )
    flat = np.concatenate([np.asarray(e, np.int32) for e in encoded])
    gl.write_stream(out / "tokens-stream", flat, overwrite=True)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "guideloom", "prepare", str(out / "data"), "-o", str(out / "prepared"),
         "--field", "text",
         "--tokenizer", str(out / "tokenizer.json"), "--eos", "</s>", "--overwrite", "-q", "--workers", "2"],
        check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    (out / "prepare.json").write_text(
        json.dumps({"prepare_s": time.perf_counter() - t0, "tokens": len(flat)})
    )
    (out / "done").write_text("")
    return out


# -- one configuration, in a process of its own ---------------------------------------------------------
def tree_pss(pid: int) -> int:
    """PSS of process ``pid`` and its descendants, in bytes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


#: The file a configuration's process creates once its measurement is over (before it closes
#: its loader): the parent stops sampling PSS there. While processes exit, a sample may count
#: a page twice: in a worker read before it exits, and in the main process read after (a
#: shared page's PSS moves to the processes left).
MEASURED = "GUIDELOOM_BENCH_MEASURED"


def measured() -> None:
    """In a configuration's process: its measurement is over."""
    path = os.environ.get(MEASURED)
    if path:
        Path(path).touch()


#: Seconds between two samples of a configuration's PSS. A sample costs the kernel a walk of
#: every mapping of every process of the tree: 14-19 ms of CPU for a process with torch and two
#: workers. Every 50 ms, the sampler took a quarter of a core from the loader it measured on 2
#: cores; every 200 ms, a fifteenth.
PSS_EVERY_S = 0.2


def peak_pss(proc: subprocess.Popen[str], marker: Path) -> int:
    """The peak PSS of ``proc`` and its descendants (bytes), sampled every :data:`PSS_EVERY_S`
    until it has created ``marker`` (its measurement is over) or exited."""
    peak = 0
    while proc.poll() is None and not marker.exists():
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(PSS_EVERY_S)
    return peak


def collate_docs(samples: Sequence[Any]) -> Any:
    """Documents to one flat int64 tensor and their lengths (what a packing collate starts from)."""
    import torch

    lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    return torch.from_numpy(np.concatenate(samples).astype(np.int64)), torch.from_numpy(lengths)


def collate_hf(samples: Sequence[dict[str, Any]]) -> Any:
    return collate_docs([s["input_ids"] for s in samples])


def collate_stream(samples: Sequence[Any]) -> Any:
    import torch

    return torch.from_numpy(np.stack(samples).astype(np.int64))


_HF_TOKENIZER: dict[str, Any] = {}  # one per worker process, loaded on first use


def hf_tokenize(batch: dict[str, list[str]], path: str, eos: int) -> dict[str, list[list[int]]]:
    if path not in _HF_TOKENIZER:
        from tokenizers import Tokenizer

        _HF_TOKENIZER[path] = Tokenizer.from_file(path)
    enc = _HF_TOKENIZER[path].encode_batch_fast(batch["text"], add_special_tokens=False)
    return {"input_ids": [[*e.ids, eos] for e in enc]}


def make_loader(config: str, data: Path, decoded: int = DECODED) -> Any:
    import torch

    import guideloom as gl

    cpu = torch.device("cpu")
    tok = str(data / "tokenizer.json")
    if config == "gl-parquet-text":
        storage = gl.open_parquet(data / "data", "text", tokenizer=tok, eos="</s>", max_decoded_bytes=decoded)
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, num_workers=2, parallel_method="process",
            shuffle=True, shuffle_block_size="auto", device=cpu,
        )  # fmt: skip
    if config == "gl-stream-prepared":
        return gl.StatefulDataLoader.from_storage(
            gl.open_stream(data / "prepared"), collate_stream, sequence_length=SEQ, local_batch_size=BATCH,
            num_workers=2, parallel_method="process", shuffle=True, device=cpu,
        )  # fmt: skip
    if config == "gl-parquet-tokens":
        storage = gl.open_parquet(data / "data", "input_ids", max_decoded_bytes=decoded)
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, shuffle=True, shuffle_block_size="auto", device=cpu
        )
    if config == "gl-stream-tokens-doclen":  # samples as long as the mean document
        mean = len(gl.open_stream(data / "tokens-stream")) // len(gl.open_parquet(data / "data", "input_ids"))
        return gl.StatefulDataLoader.from_storage(
            gl.open_stream(data / "tokens-stream"), collate_stream, sequence_length=mean,
            local_batch_size=BATCH, shuffle=True, device=cpu,
        )  # fmt: skip
    if config == "gl-stream-tokens":
        return gl.StatefulDataLoader.from_storage(
            gl.open_stream(data / "tokens-stream"), collate_stream, sequence_length=SEQ,
            local_batch_size=BATCH,
            shuffle=True, device=cpu,
        )  # fmt: skip
    if config == "hf-streaming":
        import functools

        import datasets
        from datasets.distributed import split_dataset_by_node
        from tokenizers import Tokenizer
        from torchdata.stateful_dataloader import StatefulDataLoader

        eos = Tokenizer.from_file(tok).token_to_id("</s>")
        files = sorted(glob.glob(str(data / "data" / "*.parquet")))
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        ds = ds.shuffle(seed=0, buffer_size=1000)
        ds = split_dataset_by_node(ds, rank=0, world_size=1)
        ds = ds.map(
            functools.partial(hf_tokenize, path=tok, eos=eos),
            batched=True,
            batch_size=BATCH,
            remove_columns=["text", "input_ids"],
        )
        return StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=collate_hf)
    raise ValueError(config)


def batch_counts(config: str, batch: Any) -> tuple[int, int]:
    """Samples and tokens in a batch."""
    if config.startswith("gl-stream"):
        return int(batch.shape[0]), int(batch.numel())
    flat, lengths = batch
    return len(lengths), int(flat.numel())


def run_one(config: str, data: Path, seconds: float, decoded: int = DECODED) -> dict[str, float]:
    """Epochs until ``seconds`` have passed; the rate counts from the first batch on (that one's
    wait is reported on its own: it holds the workers' start)."""
    if config == "tokenize-ceiling":
        return tokenize_ceiling(data, seconds)
    if config.endswith(LIBS):
        import pyarrow.parquet
        from tokenizers import Tokenizer

        libs = [pyarrow.parquet, Tokenizer.from_file(str(data / "tokenizer.json"))]  # noqa: F841
        config = config.removesuffix(LIBS)
    loader = make_loader(config, data, decoded)
    return timed_batches(loader, config, time.perf_counter(), seconds)


def timed_batches(
    loader: Any, config: str, t0: float, seconds: float, *, one_epoch: bool = False
) -> dict[str, float]:
    """Batches of ``loader`` (entered where it is a context manager) until ``seconds`` have
    passed since its first, epoch after epoch or the first epoch at most: samples/s and
    tokens/s from the first batch on, and the first batch's wait since ``t0``. The measurement
    is marked over (:func:`measured`) before the loader closes."""
    samples = tokens = 0
    first = start = None
    with loader if hasattr(loader, "__enter__") else contextlib.nullcontext():
        while start is None or time.perf_counter() - start < seconds:
            for batch in loader:
                if start is None:
                    start = time.perf_counter()
                    first = start - t0
                    continue
                s, t = batch_counts(config, batch)
                samples += s
                tokens += t
                if time.perf_counter() - start > seconds:
                    break
            if one_epoch:
                break
        assert start is not None
        elapsed = time.perf_counter() - start
        measured()
    return {
        "samples_s": samples / elapsed,
        "tokens_s": tokens / elapsed,
        "first_batch_s": first or 0.0,
        "seconds": elapsed,
    }


def _encode_for(
    texts: list[str], path: str, seconds: float, start: Any, out: Any, k: int
) -> None:  # pragma: no cover - runs in a forked process
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    order = np.random.default_rng(k).permutation(len(texts)).tolist()
    batches = [[texts[i] for i in order[a : a + BATCH]] for a in range(0, len(order), BATCH)]
    start.wait()
    rows = tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for batch in batches:
            enc = tok.encode_batch_fast(batch, add_special_tokens=False)
            rows += len(enc)
            tokens += sum(len(e) for e in enc) + len(enc)  # and an end-of-document id each
            if time.perf_counter() - t0 >= seconds:
                break
    out.put((rows, tokens, time.perf_counter() - t0))


def tokenize_ceiling(data: Path, seconds: float, processes: int = 2) -> dict[str, float]:
    """The tokenizer alone: ``encode_batch_fast`` of batches of 32 of the same texts on
    ``processes`` processes (each its share of the rows, in a shuffled order, for ``seconds``),
    no loader, no Parquet: what tokenizing on the fly can reach on this machine."""
    import multiprocessing

    import pyarrow.parquet as pq

    files = sorted(glob.glob(str(data / "data" / "*.parquet")))
    texts: list[str] = pq.read_table(files, columns=["text"]).column("text").to_pylist()
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_encode_for,
            args=(texts[k::processes], str(data / "tokenizer.json"), seconds, start, out, k),
        )
        for k in range(processes)
    ]
    for p in procs:
        p.start()
    start.wait()
    got = [out.get() for _ in procs]
    measured()
    for p in procs:
        p.join()
    return {
        "samples_s": sum(r / t for r, _, t in got),
        "tokens_s": sum(n / t for _, n, t in got),
        "first_batch_s": 0.0,
        "seconds": max(t for _, _, t in got),
    }


def measured_child(module: str, config: str, args: list[str]) -> dict[str, float]:
    """``python -m module --child config *args`` in a fresh process: the figures it prints (JSON,
    its last line), and its peak PSS (with its workers') sampled from here every 200 ms until its
    measurement is over. A sampling thread inside it would keep its process workers from being
    forked from it (guideloom forks them from the main process only while that has one Python
    thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "measured"
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--child", config, *args],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), MEASURED: str(marker)},
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        peak = peak_pss(proc, marker)
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait()
    if proc.returncode:
        raise RuntimeError(f"{config} failed with exit code {proc.returncode}")
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    result["peak_pss_mb"] = peak / 2**20
    return result


def in_child(config: str, data: Path, seconds: float, decoded: int = DECODED) -> dict[str, float]:
    """``run_one`` in a fresh process (:func:`measured_child`)."""
    args = ["--data", str(data), "--seconds", str(seconds), "--decoded", str(decoded)]
    return measured_child("benchmarks.parquet", config, args)


# -- the other figures ---------------------------------------------------------------------------------
def resume_times(data: Path, repeats: int) -> dict[str, float]:
    """First batch after load_state_dict at mid-epoch: on an open loader, and on a fresh one."""
    import torch

    import guideloom as gl

    def loader() -> Any:
        storage = gl.open_parquet(data / "data", "input_ids")
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, shuffle=True, shuffle_block_size="auto",
            device=torch.device("cpu"),
        )  # fmt: skip

    open_times, fresh_times = [], []
    rng = np.random.default_rng(1)
    with loader() as warm:
        n = len(warm.dataset)
        next(iter(warm))
        saved = warm.state_dict()
        for _ in range(repeats):
            state = {**saved, "observation_offset": int(rng.integers(0, n // BATCH)) * BATCH}
            t0 = time.perf_counter()
            warm.load_state_dict(state)
            next(iter(warm))
            open_times.append(time.perf_counter() - t0)
    for _ in range(repeats):
        state = {**saved, "observation_offset": int(rng.integers(0, n // BATCH)) * BATCH}
        t0 = time.perf_counter()
        with loader() as fresh:
            fresh.load_state_dict(state)
            next(iter(fresh))
            fresh_times.append(time.perf_counter() - t0)
    return {
        "resume_open_ms": 1e3 * statistics.median(open_times),
        "resume_fresh_ms": 1e3 * statistics.median(fresh_times),
    }


def decode_ceiling(data: Path) -> float:
    """Tokens/s of pyarrow decoding the ``input_ids`` row groups alone (one thread, best of 3
    passes over every row group): what reading a pre-tokenized column can reach where every
    row group is decoded once per epoch, before any loader or per-row work."""
    import pyarrow.parquet as pq

    files = [pq.ParquetFile(f) for f in sorted(glob.glob(str(data / "data" / "*.parquet")))]
    best = float("inf")
    tokens = 0
    for _ in range(3):
        tokens = 0
        t0 = time.perf_counter()
        for f in files:
            for g in range(f.num_row_groups):
                col = f.read_row_group(g, columns=["input_ids"], use_threads=False).column(0)
                tokens += len(col.combine_chunks().values)
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def open_thousand(tmp: Path) -> float:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import guideloom as gl

    table = pa.table({"input_ids": pa.array([[1, 2, 3]] * 2000, pa.list_(pa.int32()))})
    for f in range(1000):
        pq.write_table(table, tmp / f"train-{f:05d}-of-01000.parquet", row_group_size=500)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gl.open_parquet(tmp, "input_ids")
        times.append(time.perf_counter() - t0)
    return min(times)


def length_index_cost(data: Path) -> dict[str, float]:
    import guideloom as gl

    storage = gl.open_parquet(data / "data", "text")
    text_bytes = sum(len(t.encode()) for t in storage.read_many_sync(np.arange(len(storage), dtype=np.int64)))
    storage = gl.open_parquet(data / "data", "text", tokenizer=str(data / "tokenizer.json"), eos="</s>")
    t0 = time.perf_counter()
    storage.build_length_index(threads=2)
    seconds = time.perf_counter() - t0
    return {
        "length_index_s": seconds,
        "text_gb": text_bytes / 1e9,
        "length_index_s_per_gb": seconds / (text_bytes / 1e9),
    }


def shuffle_quality() -> list[str]:
    from benchmarks._internals import GroupPermutation, Permutation
    from benchmarks.shuffle_quality import metrics

    n, group = 48_000, 1000
    sizes = np.full(n // group, group)
    rows = [("global row shuffle", Permutation(n, shuffle=True, seed=0, epoch=0).range(0, n))]
    for window in (4, 16):
        rows.append(
            (
                f"row groups of {group}, window {window}",
                GroupPermutation(sizes, seed=0, epoch=0, window=window).range(0, n),
            )
        )
    out = [
        "| order | distinct row groups / batch of 32 (mean) | mean dist/N "
        "| batches with 2 rows of one group |",
        "|---|---|---|---|",
    ]
    for name, order in rows:
        m = metrics(np.asarray(order), group, batch=32)
        out.append(f"| {name} | {m['distinct_mean']:.1f} | {m['dist_mean']:.3f} | {m['same_block']:.2f} |")
    return out


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# -- the run -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks parquet-synthetic", description=summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="a smoke run: small data, one round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="at most this long per configuration")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument(
        "--decoded", type=int, default=DECODED, help="max_decoded_bytes of the Parquet configurations"
    )
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, Path(args.data), args.seconds, args.decoded)))
        return
    rows, files = (4000, 4) if args.quick else (40_000, 8)
    rounds = 1 if args.quick else args.rounds
    seconds = 5.0 if args.quick else args.seconds
    t0 = time.perf_counter()
    data = make_data(rows, files)
    text_mb = sum(os.path.getsize(p) for p in glob.glob(str(data / "data" / "*.parquet"))) / 2**20
    print(
        f"data: {rows:,} rows in {files} files ({text_mb:.1f} MiB of Parquet), "
        f"made in {time.perf_counter() - t0:.1f} s"
    )
    print(f"load average before: {loadavg()}")
    results: dict[str, list[dict[str, float]]] = {c: [] for c in TEXT_CONFIGS + TOKEN_CONFIGS}
    for r in range(rounds):
        order = list(TEXT_CONFIGS + TOKEN_CONFIGS)
        if r % 2:
            order.reverse()
        for config in order:
            got = in_child(config, data, seconds, args.decoded)
            results[config].append(got)
            print(f"  round {r + 1} {config:<20} {got['samples_s']:>9,.0f} samples/s "
                  f"{got['tokens_s']:>12,.0f} tokens/s peak PSS {got['peak_pss_mb']:>7,.0f} MiB  "
                  f"first batch {1e3 * got['first_batch_s']:.0f} ms")  # fmt: skip

    def med(config: str, key: str) -> float:
        return statistics.median(x[key] for x in results[config])

    prep = json.loads((data / "prepare.json").read_text())
    epoch_tokens = prep["tokens"]
    stream_epoch_s = epoch_tokens / med("gl-stream-prepared", "tokens_s")
    parquet_epoch_s = epoch_tokens / med("gl-parquet-text", "tokens_s")
    print(f"\nguideloom prepare of the same files: {prep['prepare_s']:.1f} s (2 workers); one epoch after it "
          f"{stream_epoch_s:.2f} s; open_parquet's epoch tokenizing as it goes: {parquet_epoch_s:.2f} s "
          f"(prepare + one epoch take {(prep['prepare_s'] + stream_epoch_s) / parquet_epoch_s:.2f}x "
          "as long)")  # fmt: skip
    print("\nratios (median over rounds):")

    def ratio_of(a: str, b: str, key: str) -> float:
        return med(a, key) / med(b, key)

    lines = [
        ("gl-parquet-text / hf-streaming, samples/s",
         ratio_of("gl-parquet-text", "hf-streaming", "samples_s"), 1.5),
        ("gl-parquet-text / gl-stream-prepared, tokens/s",
         ratio_of("gl-parquet-text", "gl-stream-prepared", "tokens_s"), 1.0),
        ("gl-parquet-tokens / gl-stream-tokens, tokens/s",
         ratio_of("gl-parquet-tokens", "gl-stream-tokens", "tokens_s"), 0.5),
        ("gl-parquet-tokens / gl-stream-tokens-doclen, tokens/s",
         ratio_of("gl-parquet-tokens", "gl-stream-tokens-doclen", "tokens_s"), 0.5),
        ("peak PSS gl-parquet-text / gl-stream-prepared",
         ratio_of("gl-parquet-text", "gl-stream-prepared", "peak_pss_mb"), 1.2),
        ("peak PSS gl-parquet-tokens / gl-stream-tokens",
         ratio_of("gl-parquet-tokens", "gl-stream-tokens", "peak_pss_mb"), 1.2),
        ("peak PSS gl-parquet-text / gl-stream-prepared+libs",
         ratio_of("gl-parquet-text", "gl-stream-prepared+libs", "peak_pss_mb"), 1.2),
        ("peak PSS gl-parquet-tokens / gl-stream-tokens+libs",
         ratio_of("gl-parquet-tokens", "gl-stream-tokens+libs", "peak_pss_mb"), 1.2),
    ]  # fmt: skip
    ceiling = med("tokenize-ceiling", "samples_s")
    print(f"  tokenizer ceiling (encode_batch_fast alone, 2 processes): {ceiling:,.0f} rows/s; "
          f"gl-parquet-text reaches {med('gl-parquet-text', 'samples_s') / ceiling:.2f} of it, "
          f"hf-streaming {med('hf-streaming', 'samples_s') / ceiling:.2f}; a ratio of 1.5 over "
          f"hf-streaming needs {1.5 * med('hf-streaming', 'samples_s') / ceiling:.2f} of it")  # fmt: skip
    for name, ratio, target in lines:
        better = ratio <= target if "PSS" in name else ratio >= target
        print(
            f"  {name:<50} {ratio:6.2f}   target {'<=' if 'PSS' in name else '>='} {target}  "
            f"{'met' if better else 'NOT met'}"
        )
    decode = decode_ceiling(data)
    print(f"  pyarrow's decode of the input_ids row groups alone: {decode:,.0f} tokens/s = "
          f"{decode / med('gl-stream-tokens', 'tokens_s'):.2f} of gl-stream-tokens, "
          f"{decode / med('gl-stream-tokens-doclen', 'tokens_s'):.2f} of gl-stream-tokens-doclen "
          "(the most gl-parquet-tokens can reach where each row group is decoded once an epoch)")  # fmt: skip
    resume = resume_times(data, 3 if args.quick else 7)
    print(f"\nfirst batch after load_state_dict at mid-epoch: {resume['resume_open_ms']:.1f} ms on an open "
          f"loader, {resume['resume_fresh_ms']:.1f} ms on a fresh one (opening {files} files' footers "
          "included); target < 100 ms")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f"open_parquet over 1,000 files (footers only): {1e3 * open_thousand(Path(tmp)):.0f} ms "
            "(best of 3)"
        )
    cost = length_index_cost(data)
    print(f"length index (tokenizing every row, 2 threads): {cost['length_index_s']:.1f} s for "
          f"{cost['text_gb'] * 1e3:.0f} MB "
          f"of text = {cost['length_index_s_per_gb']:.0f} s per GB")  # fmt: skip
    print("\nshuffle quality, 48,000 rows in row groups of 1,000 (batches of 32):")
    print("\n".join(shuffle_quality()))
    print_resume_comparison(data, rows // BATCH // 2)
    print(f"\nload average after: {loadavg()}")


# -- resuming mid-epoch, beside Hugging Face streaming ---------------------------------------------------
#: The Hugging Face pipeline with 2 workers, and with 1 (``hf-streaming-1-worker``: the same
#: dataset under ``StatefulDataLoader(num_workers=1)``).
RESUME_CONFIGS = ("gl-parquet-text", "hf-streaming", "hf-streaming-1-worker")


def resume_loader(config: str, data: Path) -> Any:
    """``make_loader``'s loader with a fixed shuffle seed (as the Hugging Face pipeline's
    ``shuffle(seed=0)``: a run that resumes must shuffle as the one it resumes did), or for
    ``hf-streaming-1-worker`` the Hugging Face dataset under 1 worker."""
    import torch

    import guideloom as gl

    if config == "gl-parquet-text":
        tok = str(data / "tokenizer.json")
        storage = gl.open_parquet(data / "data", "text", tokenizer=tok, eos="</s>", max_decoded_bytes=DECODED)
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=BATCH, num_workers=2, parallel_method="process",
            shuffle=True, shuffle_block_size="auto", shuffle_seed=0, device=torch.device("cpu"),
        )  # fmt: skip
    if config != "hf-streaming-1-worker":
        return make_loader(config, data)
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = make_loader("hf-streaming", data).dataset
    return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=1, collate_fn=collate_hf)


def _row_keys(batch: Any) -> list[str]:
    """A key per row of a (flat, lengths) batch: a digest of its token ids (the same text gives
    the same ids under both loaders)."""
    import hashlib

    flat, lengths = batch
    values = flat.numpy()
    ends = np.cumsum(lengths.numpy()).tolist()
    starts = [0, *ends[:-1]]
    pairs = zip(starts, ends, strict=True)
    return [hashlib.blake2b(values[a:b].tobytes(), digest_size=8).hexdigest() for a, b in pairs]


def resume_child(config: str, data: str, stop: str, mode: str, out: str) -> None:  # pragma: no cover
    """One leg of :func:`resume_comparison`, in a fresh process: ``full`` (one uninterrupted
    epoch), ``stop`` (``stop`` batches, then ``state_dict()`` saved to ``out + '.state'``) or
    ``resume`` (a fresh loader, ``load_state_dict`` of that state, the rest of the epoch). Writes
    the rows' keys (and, resumed, the time from the loader's creation to its first batch)."""
    import pickle

    import datasets  # noqa: F401 - imports are not part of the first batch's time
    import torchdata.stateful_dataloader  # noqa: F401

    t0 = time.perf_counter()
    loader = resume_loader(config, Path(data))
    first = None
    keys: list[str] = []
    if mode == "resume":
        loader.load_state_dict(pickle.loads(Path(out + ".state").read_bytes()))
    ctx = loader if hasattr(loader, "__enter__") else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for n, batch in enumerate(loader):
            if first is None:
                first = time.perf_counter() - t0
            keys += _row_keys(batch)
            if mode == "stop" and n + 1 == int(stop):
                Path(out + ".state").write_bytes(pickle.dumps(loader.state_dict()))
                break
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    Path(out).write_text(json.dumps({"keys": keys, "first_batch_s": first}))


def resume_comparison(data: Path, stop: int) -> dict[str, dict[str, Any]]:
    """What each loader yields after ``state_dict()`` at batch ``stop`` of an epoch and
    ``load_state_dict`` in a fresh process, against an uninterrupted run's batches after
    ``stop``: rows repeated (yielded more often than there) and skipped (less often), as
    multisets; over the whole epoch (the rows before the checkpoint and after the resume), rows
    yielded twice and rows never yielded; and the time from a fresh loader's creation (opening
    the files included) to its first batch after ``load_state_dict``."""
    from collections import Counter

    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="guideloom-resume-") as tmp:

        def leg(config: str, mode: str) -> dict[str, Any]:
            path = f"{tmp}/{config}-{mode}.json"
            done = subprocess.run(
                [sys.executable, "-c",
                 "import sys; from benchmarks.parquet import resume_child; resume_child(*sys.argv[1:])",
                 config, str(data), str(stop), mode, f"{tmp}/{config}.json" if mode != "full" else path],
                check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            if done.returncode:
                lines = [x for x in done.stderr.splitlines() if x and not x[0].isspace()]
                raise RuntimeError(lines[-1] if lines else f"exit code {done.returncode}")
            if mode != "full":
                os.replace(f"{tmp}/{config}.json", path)  # its state stays beside, for the resumed leg
            got: dict[str, Any] = json.loads(Path(path).read_text())
            return got

        for config in RESUME_CONFIGS:
            full = leg(config, "full")["keys"]
            before = leg(config, "stop")["keys"]
            try:
                resumed = leg(config, "resume")
            except RuntimeError as exc:  # a loader whose resume raises: what it raised
                out[config] = {"error": str(exc)}
                continue
            after = resumed["keys"]
            reference = Counter(full[len(before) :])
            got = Counter(after)
            epoch = Counter(before + after)
            rows = Counter(full)
            out[config] = {
                "rows_before": float(len(before)),
                "rows_after_reference": float(sum(reference.values())),
                "rows_after_resumed": float(len(after)),
                "repeated": float(sum((got - reference).values())),
                "skipped": float(sum((reference - got).values())),
                "epoch_twice": float(sum((epoch - rows).values())),
                "epoch_never": float(sum((rows - epoch).values())),
                "same_prefix": float(before == full[: len(before)]),
                "first_batch_after_resume_s": float(resumed["first_batch_s"] or 0.0),
            }
    return out


def print_resume_comparison(data: Path, stop: int) -> None:
    """The printed section of :func:`resume_comparison`."""
    print(f"\nresuming mid-epoch (state_dict() after batch {stop} of 32 rows, load_state_dict in a "
          "fresh process), against an uninterrupted epoch's rows after that batch (multisets):")  # fmt: skip
    print(
        "| loader | rows after (uninterrupted / resumed) | repeated | skipped | epoch: rows twice / never "
        "| first batch after resume (fresh process, opening included) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for config, r in resume_comparison(data, stop).items():
        if "error" in r:
            print(f"| {config} | load_state_dict, then iterating, raised {r['error']} | | | | |")
            continue
        print(f"| {config} | {r['rows_after_reference']:,.0f} / {r['rows_after_resumed']:,.0f} | "
              f"{r['repeated']:,.0f} | {r['skipped']:,.0f} | "
              f"{r['epoch_twice']:,.0f} / {r['epoch_never']:,.0f} | "
              f"{1e3 * r['first_batch_after_resume_s']:,.0f} ms |"
              + ("" if r["same_prefix"] else " (the interrupted run's first batches differ from the "
                 "uninterrupted run's)"))  # fmt: skip


if __name__ == "__main__":
    main()
