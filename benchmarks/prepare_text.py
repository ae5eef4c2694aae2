"""Benchmark: ``guideloom prepare`` of JSONL text with the byte tokenizer, against a plain loop.

The plain loop is the limit: it reads the same lines, parses them with ``json.loads``, and writes
the same uint16 tokens (each document's UTF-8 bytes, then the end-of-document id 256) with numpy,
in one process, with no checksums, no sharding and no manifest. ``guideloom prepare`` is timed
end to end (a fresh ``python -m guideloom`` process) with ``--workers 1`` and ``--workers 2``.

    python benchmarks/prepare_text.py --size-mb 256

The JSONL is generated under a temporary folder (``--tmp``, default /tmp) and removed afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "can",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "only",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "naïve",
    "café",
    "façade",
    "über",
    "straße",
    "東京",
    "데이터",
    "données",
    '"quoted"',
    "tab\there",
    "back\\slash",
]


def generate(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Write JSONL documents of 100-8000 words until ``size_bytes``; return the documents count."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS, dtype=object)
    docs = 0
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            lines = []
            for n in rng.integers(100, 1500, size=256):
                text = " ".join(words[rng.integers(0, len(words), size=n)])
                if rng.random() < 0.3:
                    text = text.replace(" and ", "\n\nand ", 3)
                lines.append(json.dumps({"id": docs, "text": text, "meta": {"source": "bench"}}) + "\n")
                docs += 1
            block = "".join(lines)
            f.write(block)
            written += len(block.encode())
    return docs


def plain_loop(src: Path, dst: Path, *, checksum: bool = False) -> tuple[float, str]:
    """The limit: read lines, parse, write tokens with numpy. Returns (seconds, sha256 of tokens).

    ``checksum=True`` also hashes the tokens as it writes them, as guideloom's writer must.
    """
    start = time.perf_counter()
    running = hashlib.sha256()
    with open(src, "rb") as f, open(dst, "wb") as out:
        for line in f:
            text = json.loads(line)["text"]
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            tokens = np.empty(len(raw) + 1, dtype=np.uint16)
            tokens[:-1] = raw
            tokens[-1] = 256
            data = tokens.tobytes()
            out.write(data)
            if checksum:
                running.update(data)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    with open(dst, "rb") as fh:
        while block := fh.read(8 * 2**20):
            digest.update(block)
    return seconds, digest.hexdigest()


def guideloom_prepare(src: Path, dst: Path, workers: int) -> tuple[float, str]:
    """``guideloom prepare`` in a fresh process. Returns (seconds, sha256 of the token stream)."""
    cmd = [sys.executable, "-m", "guideloom", "prepare", str(src), "--output", str(dst), "--quiet"]
    cmd += ["--workers", str(workers), "--overwrite"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - start
    manifest = json.loads((dst / "manifest.json").read_text())
    digest = hashlib.sha256()
    for f in manifest["fields"]["tokens"]["files"]:
        with open(dst / f["path"], "rb") as fh:
            while block := fh.read(8 * 2**20):
                digest.update(block)
    return seconds, digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=1024, help="JSONL to generate, in MB (default 1024)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, the best is reported")
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where to put the data (default /tmp)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="guideloom-bench-", dir=args.tmp))
    try:
        src = root / "corpus.jsonl"
        t = time.perf_counter()
        docs = generate(src, int(args.size_mb * 1e6))
        size = src.stat().st_size
        took = time.perf_counter() - t
        print(f"corpus: {size / 1e6:.1f} MB of JSONL, {docs:,} documents (generated in {took:.1f} s)")
        print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, numpy {np.__version__}")
        # Warm the page cache so every contender reads from memory.
        with open(src, "rb") as f:
            while f.read(64 * 2**20):
                pass
        best = min(plain_loop(src, root / "plain.bin") for _ in range(args.repeat))
        (root / "plain.bin").unlink()
        base_rate = size / best[0] / 1e6
        print(f"plain loop (limit):       {best[0]:7.2f} s  {base_rate:7.1f} MB/s")
        hashed = min(plain_loop(src, root / "plain.bin", checksum=True) for _ in range(args.repeat))
        (root / "plain.bin").unlink()
        print(f"plain loop + sha256:      {hashed[0]:7.2f} s  {size / hashed[0] / 1e6:7.1f} MB/s")
        rates = {}
        for workers in args.workers:
            run = min(guideloom_prepare(src, root / "ds", workers) for _ in range(args.repeat))
            rate = size / run[0] / 1e6
            rates[workers] = rate
            same = "same tokens" if run[1] == best[1] else "DIFFERENT TOKENS"
            print(
                f"guideloom --workers {workers}:    {run[0]:7.2f} s  {rate:7.1f} MB/s  "
                f"{rate / base_rate:.2f}x the loop, {rate / base_rate / workers:.2f}x per worker ({same})"
            )
            shutil.rmtree(root / "ds")
        if 1 in rates and 2 in rates:
            print(f"scaling 1 -> 2 workers: {rates[2] / rates[1]:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
