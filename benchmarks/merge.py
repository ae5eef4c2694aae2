"""The merge of ``prepare --tasks N``: 1,000 and 10,000 synthetic parts.




``guideloom prepare --merge`` runs), its time and peak memory; the merged manifest's size; the
time to open the merged dataset (manifest parsed, every file's size checked, every file mapped);
the first read of a batch of 16 samples (random documents, or windows of 2,048 tokens) after it.

    python -m benchmarks merge                       # 1,000 and 10,000 parts, documents
    python -m benchmarks merge --kind stream [--document-ids] [--parts 1000]

A local dataset holds one file descriptor per data file while it is open: 10,000 parts of a
stream with ``--document-ids`` are 30,000 files, more than a ``ulimit -n`` of 20,000.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS_PER_PART = 40_960  # 80 KiB of uint16: over 64 MiB at 1,000 parts, so no checksum on open
_MADE: dict[bytes, tuple[Path, str]] = {}  # one file per content, hard-linked into every part
DOCS_PER_PART = 8


def _file(folder: Path, name: str, data: np.ndarray, **extra: Any) -> dict[str, Any]:
    raw = data.tobytes()
    key = hashlib.blake2b(raw).digest()
    if key not in _MADE:
        (folder / name).write_bytes(raw)
        _MADE[key] = (folder / name, hashlib.sha256(raw).hexdigest())
    else:
        os.link(_MADE[key][0], folder / name)
    return {"path": name, "elements": len(data), "bytes": len(raw), "sha256": _MADE[key][1], **extra}


def build(dest: Path, parts: int, kind: str, document_ids: bool = False) -> None:
    """``parts`` part folders as ``prepare --task I --tasks parts`` leaves them (their data files
    hard links to one file per content: the disk holds one part's data)."""
    _MADE.clear()
    from benchmarks._internals import part_folder, part_options

    record = part_options({"kind": kind, "tokenizer": "bytes", "tasks": parts, "synthetic": True})
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 257, TOKENS_PER_PART, dtype=np.uint16)
    ends = np.linspace(0, TOKENS_PER_PART, DOCS_PER_PART + 1, dtype=np.int64)[1:]
    lengths = np.diff(np.concatenate([[0], ends]))
    doc_id = np.repeat(np.arange(DOCS_PER_PART, dtype=np.uint32), lengths)
    doc_pos = np.concatenate([np.arange(n, dtype=np.uint32) for n in lengths])
    for i in range(parts):
        folder = dest / part_folder(i, parts)
        folder.mkdir(parents=True)
        doc: dict[str, Any] = {
            "format": "guideloom-dataset",
            "format_version": 1,
            "kind": kind,
            "dtype": "uint16",
            "num_elements": TOKENS_PER_PART,
            "checksum": "sha256",
            "fields": {"tokens": {"dtype": "uint16", "files": [_file(folder, "tokens-0-00000.bin", tokens)]}},
            "info": {
                "tokenizer": "bytes",
                "documents": DOCS_PER_PART,
                "tokens": TOKENS_PER_PART,
                "part": {"task": i, "tasks": parts, **record},
            },
        }
        if kind == "documents":
            doc["num_documents"] = DOCS_PER_PART
            doc["offsets"] = {
                "dtype": "int64",
                "files": [
                    _file(folder, "offsets-0-00000.bin", np.zeros(1, np.int64)),
                    _file(folder, "offsets-0-00001.bin", ends),
                ],
            }
        elif document_ids:
            ids = [_file(folder, "doc_id-0-00000.bin", doc_id)]
            doc["fields"]["doc_id"] = {"dtype": "uint32", "files": ids}
            doc["fields"]["doc_pos"] = {
                "dtype": "uint32",
                "files": [_file(folder, "doc_pos-0-00000.bin", doc_pos)],
            }
        (folder / "manifest.json").write_text(json.dumps(doc))


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_merge(dest: str) -> dict[str, float]:
    from benchmarks._internals import merge_parts

    before = _rss_mib()
    t0 = time.perf_counter()
    manifest = merge_parts(dest)
    took = time.perf_counter() - t0
    files = len(manifest.all_files())
    return {"merge_s": took, "peak_rss_mib": _rss_mib(), "rss_before_mib": before, "files": files}


def child_open(dest: str, kind: str) -> dict[str, float]:
    import guideloom as gl

    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    if kind == "documents":
        docs = gl.open_documents(dest)
        docs.open_sync()
        t1 = time.perf_counter()
        got = docs.read_many_sync(rng.integers(0, len(docs), 16))
        assert len(got) == 16
    else:
        stream = gl.open_stream(dest)
        stream.open_sync()
        t1 = time.perf_counter()
        got = stream.read_many_sync(rng.integers(0, len(stream) - 2048, 16), 2048)
        assert len(got) == 16
    t2 = time.perf_counter()
    return {"open_s": t1 - t0, "first_read_s": t2 - t1, "peak_rss_mib": _rss_mib()}


def _in_child(*argv: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.merge", "--child", *argv],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if out.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks merge", description=summary(__doc__))
    ap.add_argument("--parts", default="1000,10000", help="comma-separated part counts")
    ap.add_argument("--kind", choices=("documents", "stream"), default="documents")
    ap.add_argument("--document-ids", action="store_true", help="stream: doc_id and doc_pos fields too")
    ap.add_argument("--rounds", type=int, default=3, help="merges and opens per part count (median)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        what, *rest = args.child
        print(json.dumps(child_merge(*rest) if what == "merge" else child_open(*rest)))
        return
    ids = ", doc_id and doc_pos" if args.document_ids else ""
    print(f"loadavg {_loadavg()}, {os.cpu_count()} cpus, kind {args.kind}{ids}")
    print(
        "| parts | data files | build s | merge s (median) | merge peak RSS MiB | manifest KiB "
        "| open s | first read ms |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = Path(tempfile.mkdtemp(prefix="guideloom-merge-"))
    try:
        for parts in (int(p) for p in args.parts.split(",")):
            dest = base / f"ds-{parts}"
            t0 = time.perf_counter()
            build(dest, parts, args.kind, args.document_ids)
            built = time.perf_counter() - t0
            merges = [_in_child("merge", str(dest)) for _ in range(args.rounds)]
            opens = [_in_child("open", str(dest), args.kind) for _ in range(args.rounds)]
            med = lambda rows, key: float(np.median([r[key] for r in rows]))  # noqa: E731
            size = (dest / "manifest.json").stat().st_size
            print(
                f"| {parts:,} | {int(merges[0]['files']):,} | {built:.1f} | {med(merges, 'merge_s'):.2f} | "
                f"{med(merges, 'peak_rss_mib'):.0f} | {size / 1024:,.0f} | {med(opens, 'open_s'):.3f} | "
                f"{med(opens, 'first_read_s') * 1e3:.1f} |",
                flush=True,
            )
            shutil.rmtree(dest)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"loadavg after {_loadavg()}")


if __name__ == "__main__":
    main()
