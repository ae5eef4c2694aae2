"""``guideloom bench``: run the loader over a dataset and report its throughput."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from guideloom._cli._common import CLIError, add_count, counted, format_count, require
from guideloom._cli._inspect import open_dataset
from guideloom._core.text import plural
from guideloom.storage.base import DocumentStorageAbstract

__all__ = ["MIN_TIMED_BATCHES", "add_parser", "collate_documents", "collate_stream"]

#: Batches after the first that a rate is measured over, at least: below that, a rate would be the
#: time of one or two batches (timer noise, a page fault), not the loader's throughput.
MIN_TIMED_BATCHES = 10

EXAMPLES = """\
examples:
  guideloom bench stdlib-bytes --sequence-length 2048 --batch-size 16
  guideloom bench stdlib-bytes --shuffle --num-workers 2 --parallel-method process --batches 500
  guideloom bench docs --batch-size 32            # a document dataset: batches padded to the longest
"""


def collate_stream(samples: Sequence[Any]) -> Any:
    """Stack fixed-length samples into an int64 tensor (a dict of them for metadata streams)."""
    import torch

    if samples and isinstance(samples[0], dict):
        return {k: torch.from_numpy(np.stack([s[k] for s in samples]).astype(np.int64)) for k in samples[0]}
    return torch.from_numpy(np.stack(samples).astype(np.int64))


def collate_documents(samples: Sequence[Any]) -> Any:
    """Pad documents to the longest with zeros: ``{"tokens", "lengths"}`` int64 tensors."""
    import torch

    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    out = np.zeros((len(samples), int(lengths.max(initial=0))), dtype=np.int64)
    for row, s in enumerate(samples):
        out[row, : len(s)] = s
    return {"tokens": torch.from_numpy(out), "lengths": torch.from_numpy(lengths)}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="measure the loader on a dataset: samples/s, tokens/s, time to first batch",
        description=(
            "Run StatefulDataLoader over a dataset with the given options and print samples/s, "
            "tokens/s and the time to the first batch. Needs PyTorch."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", metavar="DEST", help="a dataset folder or URL")
    add_count(p, "--sequence-length", 1, 2048, "N", "tokens per sample of a stream dataset")
    add_count(p, "--batch-size", 1, 16, "B", "local batch size")
    add_count(p, "--num-workers", 0, 0, "N", "loader workers")
    p.add_argument("--parallel-method", choices=("thread", "process"), default="thread")
    add_count(p, "--prefetch", 0, 0, "N", "batches to prefetch")
    p.add_argument("--shuffle", action="store_true", help="shuffle the samples")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    add_count(p, "--batches", 1, 100, "K", "stop after K batches or at the end of the epoch")
    p.add_argument("--device", default="cpu", help="where batches go (default cpu; e.g. cuda)")
    p.add_argument("--pin-memory", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch = require("torch", "guideloom bench")
    from guideloom.pytorch import StatefulDataLoader

    _manifest, storage = open_dataset(args.dataset)
    documents = isinstance(storage, DocumentStorageAbstract)
    _check_sizes(args, storage, documents)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise CLIError(f"--device {args.device!r}: {exc}") from None
    loader: Any = StatefulDataLoader.from_storage(
        storage,
        collate_documents if documents else collate_stream,
        sequence_length=None if documents else args.sequence_length,
        device=device,
        local_batch_size=args.batch_size,
        num_workers=args.num_workers,
        parallel_method=args.parallel_method,
        shuffle=args.shuffle,
        shuffle_seed=args.seed,
        pin_memory=args.pin_memory,
        prefetch=args.prefetch,
    )
    batches = samples = tokens = first_samples = first_tokens = 0
    first = 0.0
    started = time.perf_counter()
    with loader:
        for batch in loader:
            if batches == 0:
                first = time.perf_counter() - started
            batches += 1
            if documents:
                samples += len(batch["lengths"])
                tokens += int(batch["lengths"].sum())
            else:
                t = batch["tokens"] if isinstance(batch, dict) else batch
                samples += t.shape[0]
                tokens += t.numel()
            if batches == 1:
                first_samples, first_tokens = samples, tokens
            if batches >= args.batches:
                break
    total = time.perf_counter() - started
    if batches == 0:
        raise CLIError(f"{args.dataset}: the loader delivered no batch")
    # Rates after the first batch (startup is reported on its own), over enough batches to mean
    # something; fewer get no rate at all, and a warning saying what to change.
    timed = batches - 1
    rate_time = total - first
    measured = timed >= MIN_TIMED_BATCHES and rate_time > 0
    if measured:
        samples_s = format_count((samples - first_samples) / rate_time) + " (after the first batch)"
        tokens_s = format_count((tokens - first_tokens) / rate_time) + " (after the first batch)"
    else:
        samples_s = tokens_s = f"not measured: {plural(timed, 'batch', 'batches')} after the first"
    kind = "documents" if documents else "stream"
    if not args.quiet:
        print(
            "\n".join(
                [
                    f"dataset:              {args.dataset} ({kind}, {storage.dtype})",
                    f"loader:               batch size {args.batch_size}, "
                    + ("" if documents else f"sequence length {args.sequence_length}, ")
                    + f"{plural(args.num_workers, 'worker')} ({args.parallel_method}), "
                    f"shuffle {args.shuffle}, "
                    f"prefetch {args.prefetch}, device {device}",
                    f"batches:              {batches:,} ({counted(samples, 'sample')}, "
                    f"{counted(tokens, 'token')}) "
                    f"in {total:.3f} s",
                    f"time to first batch:  {first * 1e3:.1f} ms",
                    f"samples/s:            {samples_s}",
                    f"tokens/s:             {tokens_s}",
                ]
            )
        )
        if not measured:
            print(_too_few(args, batches, samples, documents), file=sys.stderr)
    return 0


def _too_few(args: argparse.Namespace, batches: int, samples: int, documents: bool) -> str:
    """The warning for a run too short to measure a rate: what to change."""
    head = (
        f"guideloom: warning: {plural(batches, 'batch', 'batches')} in all, {batches - 1} after the "
        f"first: too few to measure a rate (at least {MIN_TIMED_BATCHES} after the first are timed); "
    )
    if batches >= args.batches:  # stopped by --batches
        return head + f"use --batches {MIN_TIMED_BATCHES + 1} or more"
    # the epoch ended: the dataset has too few batches of this size
    fits = samples // (MIN_TIMED_BATCHES + 1)
    smaller = f"a --batch-size of at most {fits}" if fits >= 1 else "a smaller --batch-size"
    if not documents:
        smaller += " or a smaller --sequence-length"
    return head + (
        f"the dataset gives {plural(batches, 'batch', 'batches')} of --batch-size {args.batch_size}: "
        f"use {smaller}, "
        "or a larger dataset"
    )


def _check_sizes(args: argparse.Namespace, storage: Any, documents: bool) -> None:
    """Refuse sizes that leave no batch, naming the argument to change: a stream shorter than
    one sample blames --sequence-length, fewer samples than a batch --batch-size."""
    try:
        n = len(storage)
    except Exception:  # a storage that knows its length only once open: the loader checks then
        return
    if documents:
        if n < args.batch_size:
            raise CLIError(
                f"{args.dataset}: {counted(n, 'document')}, fewer than one batch of "
                f"--batch-size "
                f"{args.batch_size}; use --batch-size {max(1, n)} or less"
            )
        return
    samples = n // args.sequence_length
    if samples == 0:
        raise CLIError(
            f"{args.dataset}: the stream holds {counted(n, 'token')}, fewer than one sample "
            f"of "
            f"--sequence-length {args.sequence_length:,}; use a --sequence-length of at most {n:,}"
        )
    if samples < args.batch_size:
        raise CLIError(
            f"{args.dataset}: {counted(n, 'token')} make "
            f"{counted(samples, 'sample')} of --sequence-length "
            f"{args.sequence_length:,}, fewer than one batch of --batch-size {args.batch_size}; use "
            f"--batch-size {samples} or less, or a smaller --sequence-length"
        )
