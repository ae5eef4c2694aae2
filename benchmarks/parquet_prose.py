"""Packed and unpacked text from Parquet, on real prose: ``gl.open_parquet`` against Hugging Face
streaming and LitData's Parquet reader, in one run.

Workload: about 75 MB of real English prose and documentation (``benchmarks/prose.py``: the
Python standard library's docstrings, ``pydoc`` topics, installed packages' descriptions,
Debian change logs and copyright notices, manual pages; one file or module a document, at most
100 KB), written by Hugging Face ``datasets`` with its defaults (``Dataset.shard(12, i)
.to_parquet(...)``: 12 shards, one row group per shard) and, as a second layout, the same
files rewritten with row groups of 100 rows. A 32,768-id byte-level BPE ``tokenizer.json``
trained on it with ``tokenizers`` (made once, cached with the data), ``</s>`` after each
document.

Packed (sequences of 2,048 tokens, batch 8, 2 workers, shuffled), each over one whole epoch
(a packing loader that tokenizes each document once does most of that work early in an epoch,
when it first meets each document, so a shorter window would not compare like with like):

- ``gl-packed``: ``gl.pack(open_parquet(folder, "text", tokenizer=..., eos=..., cache_dir=...),
  2048)`` under ``StatefulDataLoader(num_workers=2, parallel_method="process")``,
  ``shuffle_block_size="auto"``; the row groups are counted before the run (``cache_dir``; the
  cold run is ``gl-packed-cold``). It also reports the tokens tokenized per token delivered
  over the epoch (``stats()``'s ``parquet_tokens_tokenized``).
- ``hf-packed``: ``load_dataset("parquet", data_files=..., streaming=True)``,
  ``.shuffle(buffer_size=1000)``, a batched ``.map`` that tokenizes, a batched ``.map`` that
  concatenates and cuts into 2,048-token sequences (``run_clm``'s ``group_texts``), under
  torchdata's ``StatefulDataLoader(num_workers=2)``.
- ``litdata-packed``: LitData's ``StreamingDataset(folder, item_loader=ParquetLoader(),
  shuffle=True)`` whose rows are tokenized (64 at a time) and cut into 2,048-token sequences in
  the workers of a ``DataLoader(num_workers=2, multiprocessing_context="spawn")`` (LitData
  refuses ``fork`` with its Parquet reader).
- ``gl-stream``: the same documents tokenized once ahead (the same tokenizer, ``</s>`` after
  each) into a prepared stream (``gl.write_stream``, made once and cached with the data), read
  by ``from_storage(open_stream(...), sequence_length=2048)`` with the same batches, workers and
  shuffle: what a loader that did the work before training holds in memory (the peak PSS
  baseline), not a peer (it tokenizes nothing).

Unpacked (documents, tokenized, batch 32, 2 workers, shuffled, ``--seconds`` after the first
batch): ``gl-docs`` (``from_storage(open_parquet(...))``, process workers tokenizing where they
collate), ``hf-docs`` (streaming, shuffle buffer, batched ``.map`` tokenize), ``litdata-docs``
(its Parquet reader, the collate tokenizes, ``StreamingDataLoader``).

``tok-floor``: not a loader: every document of the layout tokenized by the same tokenizer on one
thread, 64 at a time (as Hugging Face's ``.map`` and LitData's collate batch them), the texts
read before the clock starts. Its CPU seconds per million tokens are what tokenizing alone costs
on this machine, the floor under every packing loader's: no packed loader passes the machine's
cores over that CPU per token (printed below the table as a rate, and against Hugging Face's).

``pss-torch`` and ``pss-libs``: not loaders: the memory floor under ``gl-stream``'s and
``gl-packed``'s peak PSS. A process that imports torch and guideloom (``pss-torch``), and also
pyarrow and tokenizers with the tokenizer loaded and run once (``pss-libs``, through
``open_parquet``), with two children forked from it as the loaders' two process workers are,
idle; their PSS together, sampled as a loader's is. What a packed loader holds above
``pss-libs`` is its own (read-ahead, kept tokens, the tokenizer's working memory, the heap's
free pages); below it, the libraries'. ``pss-tok``: ``pss-libs``'s process, which then tokenizes
every document of the layout as a packed loader's process does, and keeps nothing: two threads
(a loader's reads and its thread tokenizing ahead; ``pss-tok1``: one), each reading one row group's text
at a time and tokenizing it in calls of at most ``TOKENIZE_BYTES`` through the storage's own
encoder (``tokenizers`` spreads each call over the cores); the tokens are dropped as they come.
Its peak is what tokenizing at a packed loader's rate costs with this tokenizer library,
read-ahead and kept tokens aside: the floor under any loader that tokenizes as it reads.

``gl-packed-cold``: the time to the first packed batch from a cold start (a fresh process, a new
``cache_dir``: nothing counted yet; the packing counts the row groups a window at a time as it
reads them), no workers, from the call that opens the files (``torch`` imported before it, as a
training script has it); then the rest of that cold epoch, with its tokens tokenized per token
delivered (``cold_epoch_s``, ``tokenized_per_delivered``).

Each configuration runs in a fresh process; its tokens/s is reported as a ratio to Hugging
Face's of the same kind, layout and round, beside the CPU seconds it spent per million tokens
(the process and its workers, from its first batch on: a figure the machine's load moves less
than the rate) and its peak PSS (with its workers', sampled every 200 ms from the parent). The
machine's load average is printed before and after.

    python -m benchmarks parquet            # both layouts, every configuration (~8 minutes)
    python -m benchmarks parquet --quick    # a smoke run
    python -m benchmarks parquet --rtt 20 --layouts one --only gl-packed,hf-packed
                                            # over HTTP at 20 ms (nginx on 127.0.0.1)
    python -m benchmarks parquet --rtt 20 --store s3 --layouts one --only gl-packed,hf-packed
                                            # over S3 at 20 ms (moto's server on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 2048
PACKED_BATCH = 8
DOC_BATCH = 32
WORKERS = 2
SHARDS = 12
MANY_ROWS = 100  # rows per row group in the second layout
VOCAB = 32768
LAYOUTS = ("one", "many")
PACKED = ("gl-packed", "hf-packed", "litdata-packed", "gl-stream")
FLOOR = "tok-floor"
#: Not loaders: the PSS of what a loader's processes import, with two forked children.
PSS_FLOORS = ("pss-torch", "pss-libs", "pss-tok", "pss-tok1")
DOCS = ("gl-docs", "hf-docs", "litdata-docs")
BASELINE = {"packed": "hf-packed", "docs": "hf-docs"}


# -- data ------------------------------------------------------------------------------------------------
def data_dir() -> Path:
    base = Path(os.environ.get("GUIDELOOM_BENCH_DIR", Path(tempfile.gettempdir()) / "guideloom-bench"))
    return base / "parquet-prose"


def make_data(target: int) -> Path:
    """The two layouts and the tokenizer (made once): see the module's docstring."""
    import datasets
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from benchmarks.prose import documents

    out = data_dir()
    if (out / "corpus.json").exists():
        return out
    docs = documents(target)
    ds = datasets.Dataset.from_dict({"text": docs})
    for layout in LAYOUTS:
        (out / layout).mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        name = f"train-{i:05d}-of-{SHARDS:05d}.parquet"
        ds.shard(SHARDS, i, contiguous=True).to_parquet(str(out / "one" / name))
        pq.write_table(pq.read_table(out / "one" / name), out / "many" / name, row_group_size=MANY_ROWS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(out / "tokenizer.json"))
    sizes = np.asarray([len(d.encode()) for d in docs])
    groups = {
        layout: pq.ParquetFile(out / layout / f"train-00000-of-{SHARDS:05d}.parquet").metadata.num_row_groups
        for layout in LAYOUTS
    }
    corpus = {
        "documents": len(docs),
        "mb": round(float(sizes.sum()) / 1e6, 1),
        "median_bytes": int(np.median(sizes)),
        "max_bytes": int(sizes.max()),
        "row_groups_per_shard": groups,
    }
    (out / "corpus.json").write_text(json.dumps(corpus))
    return out


def prepared_stream(data: Path) -> Path:
    """The documents tokenized once into a stream (``</s>`` after each), made on first use."""
    out = data / "stream"
    if (out / "manifest.json").exists():
        return out
    import pyarrow.parquet as pq

    import guideloom as gl

    tok = str(data / "tokenizer.json")
    texts = [t for f in shards(data, "one") for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
    flat = np.concatenate([np.asarray(d, dtype=np.uint16) for d in encode(texts, tok)])  # 32,768 ids
    gl.write_stream(out, flat, overwrite=True)
    return out


def shards(data: Path, layout: str) -> list[str]:
    return sorted(glob.glob(str(data / layout / "*.parquet")))


def source(data: Path, layout: str, base: str | None, *, http: bool = False) -> Any:
    """What the loaders read: the layout's folder, or its shards' URLs under ``base`` (served by
    nginx or moto's S3, see :func:`serve`). Over S3, ``http`` gives the same objects' plain HTTP
    URLs on the same server, for a reader without an S3 client."""
    if base is None:
        return data / layout
    names = [Path(f).name for f in shards(data, layout)]
    if base.startswith(S3_BASE):
        if http:
            return [f"{base[len(S3_BASE) :]}/{BUCKET}/{layout}/{n}" for n in names]
        return [f"s3://{BUCKET}/{layout}/{n}" for n in names]
    return [f"{base}/prose/{layout}/{n}" for n in names]


#: ``--base`` over S3: this prefix, then the endpoint (the latency proxy in front of moto).
S3_BASE = "s3:"
BUCKET = "prose"


@contextlib.contextmanager
def serve(data: Path, rtt: float, store: str = "http") -> Iterator[str]:
    """The data over HTTP (nginx over the data folder, as ``/prose/``) or S3 (moto's server, the
    layouts' shards in a bucket, public-read, the credentials in the AWS environment variables
    the children inherit), behind the loopback latency proxy adding ``rtt`` seconds to every
    request's round trip where it is not 0; yields the base to pass to :func:`source`."""
    from guideloom_dev.servers import MotoS3, Nginx, nginx_binary, proxy_process

    @contextlib.contextmanager
    def behind(port: int, url: str) -> Iterator[str]:
        if rtt == 0:
            yield url
        else:
            with proxy_process(port, delay=rtt / 2, lifetime=3600) as near:
                yield f"http://127.0.0.1:{near}"

    if store == "s3":
        s3 = MotoS3()
        try:
            s3.create_bucket(BUCKET)
            client = s3.client()
            for layout in LAYOUTS:
                for f in shards(data, layout):
                    key = f"{layout}/{Path(f).name}"  # readable by plain HTTP too (Hugging Face)
                    client.upload_file(f, BUCKET, key, ExtraArgs={"ACL": "public-read"})
            with behind(s3.port, s3.endpoint) as endpoint:
                os.environ.update(s3.env(endpoint))
                yield S3_BASE + endpoint
        finally:
            s3.stop()
        return
    if nginx_binary() is None:
        raise SystemExit("nginx is not installed (.ci/install-servers.sh)")
    with tempfile.TemporaryDirectory(prefix="guideloom-prose-www-") as www:
        os.symlink(data, Path(www) / "prose")
        nginx = Nginx(Path(www))
        try:
            with behind(nginx.port, nginx.url) as url:
                yield url
        finally:
            nginx.stop()


# -- collates and peers' steps (module level: picklable for spawned workers) ------------------------------
def collate_packed(rows: Any) -> Any:
    import torch

    return torch.from_numpy(rows.block("tokens").astype(np.int64))


def collate_docs(samples: Sequence[Any]) -> Any:
    """Documents to one flat int64 tensor and their lengths."""
    import torch

    lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    return torch.from_numpy(np.concatenate(samples).astype(np.int64)), torch.from_numpy(lengths)


def collate_hf_packed(samples: Sequence[dict[str, Any]]) -> Any:
    import torch

    return torch.tensor([s["input_ids"] for s in samples], dtype=torch.int64)


def collate_hf_docs(samples: Sequence[dict[str, Any]]) -> Any:
    return collate_docs([np.asarray(s["input_ids"], dtype=np.int64) for s in samples])


_TOKENIZERS: dict[str, Any] = {}  # one per process, loaded on first use


def _tokenizer(path: str) -> Any:
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[path] = Tokenizer.from_file(path)
    return _TOKENIZERS[path]


def encode(texts: list[str], path: str) -> list[list[int]]:
    tok = _tokenizer(path)
    eos = tok.token_to_id("</s>")
    return [[*e.ids, eos] for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def hf_tokenize(batch: dict[str, list[str]], path: str) -> dict[str, list[list[int]]]:
    return {"input_ids": encode(batch["text"], path)}


def hf_group(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """``run_clm``'s ``group_texts``: the batch's documents concatenated and cut every ``SEQ``
    tokens, the rest dropped."""
    flat = np.concatenate([np.asarray(x, dtype=np.int32) for x in batch["input_ids"]])
    whole = len(flat) // SEQ * SEQ
    return {"input_ids": flat[:whole].reshape(-1, SEQ).tolist()}


class LitCollate:
    """LitData's rows (dicts) to tokens, in its workers: one tokenizer call per batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, rows: Sequence[dict[str, Any]]) -> Any:
        return collate_docs(
            [np.asarray(x, dtype=np.int64) for x in encode([r["text"] for r in rows], self.path)]
        )


def collate_lit_packed(rows: Sequence[Any]) -> Any:
    import torch

    return torch.from_numpy(np.stack(rows))


# -- one configuration, in a process of its own ------------------------------------------------------------
def make_loader(config: str, data: Path, layout: str, base: str | None = None) -> Any:
    import torch

    import guideloom as gl

    cpu = torch.device("cpu")
    tok = str(data / "tokenizer.json")
    folder = data / layout
    where = source(data, layout, base)
    if config.startswith("gl-packed"):
        storage = gl.open_parquet(
            where, "text", tokenizer=tok, eos="</s>", cache_dir=data / f"cache-{layout}"
        )
        return gl.StatefulDataLoader(
            gl.pack(storage, SEQ), collate_packed, local_batch_size=PACKED_BATCH,
            num_workers=WORKERS, parallel_method="process",
            shuffle=True, shuffle_block_size="auto", device=cpu,
        )  # fmt: skip
    if config == "gl-stream":
        return gl.StatefulDataLoader.from_storage(
            gl.open_stream(prepared_stream(data)), collate_lit_packed, sequence_length=SEQ,
            local_batch_size=PACKED_BATCH, num_workers=WORKERS, parallel_method="process",
            shuffle=True, device=cpu,
        )  # fmt: skip
    if config == "gl-docs":
        storage = gl.open_parquet(where, "text", tokenizer=tok, eos="</s>")
        return gl.StatefulDataLoader.from_storage(
            storage, collate_docs, local_batch_size=DOC_BATCH, num_workers=WORKERS,
            parallel_method="process", shuffle=True, shuffle_block_size="auto", device=cpu,
        )  # fmt: skip
    if config.startswith("hf-"):
        import datasets
        from torchdata.stateful_dataloader import StatefulDataLoader

        files = shards(data, layout) if base is None else source(data, layout, base, http=True)
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        ds = ds.shuffle(seed=0, buffer_size=1000)
        ds = ds.map(
            functools.partial(hf_tokenize, path=tok), batched=True, batch_size=64, remove_columns=["text"]
        )
        if config == "hf-packed":
            ds = ds.map(hf_group, batched=True, batch_size=64)
            return StatefulDataLoader(
                ds, batch_size=PACKED_BATCH, num_workers=WORKERS, collate_fn=collate_hf_packed
            )
        return StatefulDataLoader(ds, batch_size=DOC_BATCH, num_workers=WORKERS, collate_fn=collate_hf_docs)
    if config.startswith("litdata-"):
        import litdata as ld
        from litdata.streaming.item_loader import ParquetLoader

        if not (folder / "index.json").exists():
            ld.index_parquet_dataset(str(folder))
        if config == "litdata-packed":
            from benchmarks._lit_packed import LitPacked

            return torch.utils.data.DataLoader(
                LitPacked(str(folder), tok), batch_size=PACKED_BATCH, num_workers=WORKERS,
                multiprocessing_context="spawn", collate_fn=collate_lit_packed,
            )  # fmt: skip
        ds = ld.StreamingDataset(str(folder), item_loader=ParquetLoader(), shuffle=True)
        return ld.StreamingDataLoader(
            ds, batch_size=DOC_BATCH, num_workers=WORKERS, multiprocessing_context="spawn",
            collate_fn=LitCollate(tok),
        )  # fmt: skip
    raise ValueError(config)


def batch_tokens(batch: Any) -> tuple[int, int]:
    """Samples and tokens in a batch."""
    if isinstance(batch, tuple):
        flat, lengths = batch
        return len(lengths), int(flat.numel())
    return int(batch.shape[0]), int(batch.numel())


def run_child(config: str, layout: str, seconds: float, base: str | None = None) -> dict[str, float]:
    import torch  # noqa: F401  (imported before any clock starts: a training script has it already)

    from benchmarks.parquet import measured

    data = data_dir()
    if config == "gl-index":  # the length index built (or found) ahead of the measured run
        import guideloom as gl

        tok = str(data / "tokenizer.json")
        gl.open_parquet(
            source(data, layout, base), "text", tokenizer=tok, eos="</s>", cache_dir=data / f"cache-{layout}"
        ).build_length_index()
        return {}
    if config.startswith("gl-packed") and config != "gl-packed-cold":
        import guideloom as gl

        tok = str(data / "tokenizer.json")
        gl.open_parquet(
            source(data, layout, base), "text", tokenizer=tok, eos="</s>", cache_dir=data / f"cache-{layout}"
        ).build_length_index()
    if config == FLOOR:
        return tokenize_alone(data, layout)
    if config in PSS_FLOORS:
        return libraries_alone(config, data, layout)
    if config == "gl-packed-cold":
        with tempfile.TemporaryDirectory() as tmp:
            import guideloom as gl

            tok = str(data / "tokenizer.json")
            t0 = time.perf_counter()
            where = source(data, layout, base)
            storage = gl.open_parquet(where, "text", tokenizer=tok, eos="</s>", cache_dir=tmp)
            loader = gl.StatefulDataLoader(
                gl.pack(storage, SEQ), collate_packed, local_batch_size=PACKED_BATCH, shuffle=True,
                shuffle_block_size="auto", device=__import__("torch").device("cpu"),
            )  # fmt: skip
            with loader:
                it = iter(loader)
                batch = next(it)
                first = time.perf_counter() - t0
                tokens = batch_tokens(batch)[1]
                for batch in it:  # the rest of the cold epoch: each document tokenized once?
                    tokens += batch_tokens(batch)[1]
                epoch = time.perf_counter() - t0
                made = loader.stats().get("parquet_tokens_tokenized", 0.0)
                measured()
        per = made / max(1, tokens)
        return {"first_batch_s": first, "cold_epoch_s": epoch, "tokenized_per_delivered": per}
    t0 = time.perf_counter()
    loader = make_loader(config, data, layout, base)
    cpu0 = cpu1 = 0.0
    batches = counted = 0
    samples = tokens = 0
    first = start = None
    out: dict[str, float] = {}
    with loader if hasattr(loader, "__enter__") else _Null():
        epoch = config in PACKED and config != "gl-stream"  # one whole epoch, however long
        while start is None or (not epoch and time.perf_counter() - start < seconds):
            for batch in loader:
                if start is None:
                    start = time.perf_counter()
                    first = start - t0
                    cpu0 = tree_cpu()
                    continue
                s, t = batch_tokens(batch)
                samples, tokens = samples + s, tokens + t
                batches += 1
                if batches % 16 == 0:  # workers that end with the epoch take their CPU time along
                    cpu1, counted = tree_cpu(), tokens
                if not epoch and time.perf_counter() - start > seconds:
                    break
            if epoch:
                break
        assert start is not None
        elapsed = time.perf_counter() - start
        now = tree_cpu()
        cpu, cpu_tokens = (now - cpu0, tokens) if now >= cpu1 else (cpu1 - cpu0, counted)
        if config == "gl-packed":
            made = loader.stats().get("parquet_tokens_tokenized", 0.0)
            out["tokenized_per_delivered"] = made / max(1, tokens + PACKED_BATCH * SEQ)
        measured()
    return {
        "samples_s": samples / elapsed,
        "tokens_s": tokens / elapsed,
        "first_batch_s": first or 0.0,
        "cpu_s_per_mtok": cpu / max(1, cpu_tokens) * 1e6,
        **out,
    }


def tokenize_alone(data: Path, layout: str) -> dict[str, float]:
    """The floor: the layout's documents (its local shards, also under ``--rtt``) tokenized on
    this thread, 64 at a time, with nothing else (the texts read first, off the clock); CPU
    seconds per million tokens."""
    import pyarrow.parquet as pq

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the CPU a loader's worker spends
    texts = [t for f in shards(data, layout) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()]
    path = str(data / "tokenizer.json")
    encode(texts[:64], path)  # the tokenizer built, off the clock
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 64):
        tokens += sum(map(len, encode(texts[i : i + 64], path)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"cpu_s_per_mtok": cpu / tokens * 1e6, "one_thread_tokens_s": tokens / wall}


def libraries_alone(config: str, data: Path, layout: str) -> dict[str, float]:
    """The memory floor: this process with what a loader's process imports (``pss-torch``: torch
    and guideloom, as ``gl-stream``'s; ``pss-libs``: pyarrow, tokenizers and the tokenizer
    loaded and run once too, as ``gl-packed``'s), and two children forked from it, as the
    loaders' two process workers are, idle while the parent samples their PSS. Nothing read."""
    step: Any = None
    if config != "pss-torch":
        import guideloom as gl

        storage = gl.open_parquet(data / layout, "text", tokenizer=str(data / "tokenizer.json"), eos="</s>")
        step = storage.deferred_step()  # the storage's own tokenizer, run once
        assert step is not None
        step[1](["the tokenizer built and run once"])
    else:
        import guideloom  # noqa: F401
    children = []
    for _ in range(WORKERS):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child sleeps until the parent has sampled it
            time.sleep(30)
            os._exit(0)
        children.append(pid)
    out: dict[str, float] = {}
    if config.startswith("pss-tok"):
        out = tokenize_as_a_loader(step[1], shards(data, layout), 1 if config == "pss-tok1" else 2)
    time.sleep(2.0)  # ten samples of the tree
    from benchmarks.parquet import measured

    measured()
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return out


def tokenize_as_a_loader(encode: Any, files: list[str], threads: int) -> dict[str, float]:
    """Every row group of ``files`` tokenized by ``encode`` on ``threads`` threads, one row
    group's text at a time each, in calls of at most ``TOKENIZE_BYTES`` of text; nothing kept.
    Its rate and CPU seconds per million tokens."""
    import threading

    import pyarrow.parquet as pq

    from benchmarks._internals import TOKENIZE_BYTES

    groups = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
    lock = threading.Lock()
    tokens = [0]

    def work() -> None:
        while True:
            with lock:
                if not groups:
                    return
                f, g = groups.pop(0)
            texts = pq.ParquetFile(f).read_row_group(g, columns=["text"])["text"].to_pylist()
            call: list[str] = []
            held = 0
            for t in [*texts, None]:
                size = 0 if t is None else len(t.encode())
                if call and (t is None or held + size > TOKENIZE_BYTES):
                    made = sum(map(len, encode(call)))  # the tokens, dropped
                    with lock:
                        tokens[0] += made
                    call, held = [], 0
                if t is not None:
                    call.append(t)
                    held += size
            del texts

    running = [threading.Thread(target=work) for _ in range(threads)]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in running:
        t.start()
    for t in running:
        t.join()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"tokens_s": tokens[0] / wall, "cpu_s_per_mtok": cpu / tokens[0] * 1e6}


def tree_cpu() -> float:
    """CPU seconds (user and system) of this process and its live descendants: what a loader
    spends per token, a figure the machine's load moves less than its rate."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- the run ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks parquet", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 s a configuration")
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per configuration")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--bytes", type=float, default=75e6, help="bytes of prose to assemble")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--only", default="", help="comma-separated configurations")
    parser.add_argument(
        "--rtt",
        type=float,
        default=None,
        help="read the shards over HTTP (nginx on 127.0.0.1) with this many ms added to each round "
        "trip (LitData, which reads local folders, is left out)",
    )
    parser.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="with --rtt: nginx over HTTP, or moto's S3 server (guideloom reads s3:// URLs; Hugging "
        "Face streaming the same objects by their HTTP URLs on that server)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="one", help=argparse.SUPPRESS)
    parser.add_argument("--base", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.layout, args.seconds, args.base)))
        return
    seconds = 3.0 if args.quick else args.seconds
    data = make_data(int(args.bytes))
    corpus = json.loads((data / "corpus.json").read_text())
    load = os.getloadavg()[0]
    print(f"corpus: {corpus}; load average {load:.1f}", flush=True)
    configs = [*PACKED, FLOOR, *PSS_FLOORS, *DOCS, "gl-packed-cold"]
    if args.only:
        configs = [c for c in configs if c in args.only.split(",")]
    if "gl-stream" in configs:
        prepared_stream(data)  # made once, before any clock
    served = contextlib.nullcontext(None) if args.rtt is None else serve(data, args.rtt / 1e3, args.store)
    with served as base:
        if base is not None:
            configs = [c for c in configs if not c.startswith("litdata")]
            server = "moto's S3 server" if args.store == "s3" else "nginx"
            print(
                f"over {args.store.upper()}: {server} on 127.0.0.1, {args.rtt:g} ms added to each round trip",
                flush=True,
            )
        results = run_all(configs, args, seconds, base)
        report(results, load, args.rounds)


def run_all(
    configs: list[str], args: argparse.Namespace, seconds: float, base: str | None
) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Every configuration of every layout, in a fresh process each, ``args.rounds`` times."""
    from benchmarks.parquet import ROOT, measured_child

    extra = [] if base is None else ["--base", base]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for layout in args.layouts.split(","):
            if any(c.startswith("gl-packed") and c != "gl-packed-cold" for c in configs):
                # built in a process of its own: the measured one reads it from the cache, over
                # HTTP too (the cache's key names the URLs, whose port is new in every run)
                subprocess.run(
                    [sys.executable, "-m", "benchmarks.parquet_prose", "--child", "gl-index",
                     "--layout", layout, *extra],
                    cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
            for config in configs:
                got = measured_child(
                    "benchmarks.parquet_prose",
                    config,
                    ["--layout", layout, "--seconds", str(seconds), *extra],
                )
                results.setdefault((layout, config), []).append(got)
                print(
                    f"{layout:5} {config:18} {json.dumps({k: round(v, 3) for k, v in got.items()})}",
                    flush=True,
                )
    return results


def report(results: dict[tuple[str, str], list[dict[str, float]]], load: float, rounds: int) -> None:
    """The table of medians, each rate as a ratio to Hugging Face's of the same kind and round."""
    print(f"\nload average {load:.1f} before, {os.getloadavg()[0]:.1f} after; medians over {rounds} round(s)")
    print(
        "| layout | configuration | tokens/s | / Hugging Face | CPU s per M tokens | first batch s "
        "| peak PSS MiB | tokenized / delivered |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (layout, config), runs in results.items():
        kind = "packed" if "packed" in config else "docs"
        base = results.get((layout, BASELINE[kind]))

        def med(key: str, rs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r.get(key, float("nan")) for r in rs)

        ratio = (
            statistics.median(r["tokens_s"] / b["tokens_s"] for r, b in zip(runs, base, strict=False))
            if base and "tokens_s" in runs[0]
            else float("nan")
        )
        print(
            f"| {layout} | {config} | {med('tokens_s'):,.0f} | {ratio:.2f} | {med('cpu_s_per_mtok'):.2f} | "
            f"{med('first_batch_s'):.2f} | "
            f"{med('peak_pss_mb'):,.0f} | {med('tokenized_per_delivered'):.3f} |"
        )
    for layout in dict.fromkeys(layout for layout, _ in results):
        packed, stream = results.get((layout, "gl-packed")), results.get((layout, "gl-stream"))
        if packed and stream:
            pss = statistics.median(
                p["peak_pss_mb"] / s["peak_pss_mb"] for p, s in zip(packed, stream, strict=False)
            )
            print(f"peak PSS, {layout}: gl-packed / gl-stream (the prepared stream loader) {pss:.2f}")
        for name, threads in (("pss-tok", 2), ("pss-tok1", 1)):
            tok = results.get((layout, name))
            if tok and stream:
                at = statistics.median(r["peak_pss_mb"] for r in tok)
                pairs = zip(tok, stream, strict=False)
                ratio = statistics.median(t["peak_pss_mb"] / s["peak_pss_mb"] for t, s in pairs)
                print(
                    f"tokenizing alone on {threads} thread(s), nothing kept, {layout}: {at:,.0f} MiB, "
                    f"{ratio:.2f}x gl-stream"
                )
        libs, bare = results.get((layout, "pss-libs")), results.get((layout, "pss-torch"))
        if libs and bare:
            low = statistics.median(r["peak_pss_mb"] for r in libs)
            under = statistics.median(r["peak_pss_mb"] for r in bare)
            line = (
                f"memory floor, {layout}: 3 processes (2 forked) with torch and guideloom {under:,.0f} MiB, "
                f"with pyarrow, tokenizers and the tokenizer too {low:,.0f} MiB"
            )
            if packed and stream:
                above_stream = statistics.median(s["peak_pss_mb"] for s in stream) - under
                line += (
                    f"; gl-packed holds {statistics.median(p['peak_pss_mb'] for p in packed) - low:,.0f} "
                    f"MiB above its floor, gl-stream {above_stream:,.0f} above its own"
                )
            print(line)
        floor, hf = results.get((layout, FLOOR)), results.get((layout, "hf-packed"))
        if floor and hf:
            cores = os.cpu_count() or 1
            per_token = statistics.median(f["cpu_s_per_mtok"] for f in floor) / 1e6
            ceiling = cores / per_token
            print(
                f"tokenizing alone, {layout}: {per_token * 1e6:.2f} CPU s per M tokens: on {cores} "
                f"cores no packed loader passes {ceiling:,.0f} tokens/s, "
                f"{ceiling / statistics.median(h['tokens_s'] for h in hf):.2f}x Hugging Face's rate"
            )


if __name__ == "__main__":
    main()
