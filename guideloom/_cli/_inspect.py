"""``guideloom inspect`` and ``guideloom verify``."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from guideloom._cli._common import Progress, UsageError, add_count, counted, format_bytes
from guideloom._cli._tokenizers import Tokenizer, tokenizer_for_decoding
from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError
from guideloom.storage._api import local_folder, open_documents, open_stream, verify_dataset
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._local._storage import read_local_manifest
from guideloom.storage._parquet import ParquetStorage, open_parquet, parquet_columns
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract

__all__ = ["add_parsers", "open_dataset"]

_SAMPLE_WINDOW = 2**20  # stream elements read to find the first documents

INSPECT_EXAMPLES = """\
examples:
  guideloom inspect stdlib-bytes
  guideloom inspect stdlib-bytes --tokenizer bytes --samples 5
  guideloom inspect ds --tokenizer tokenizer.json --chars 500
  guideloom inspect hub-dataset/data                       # a folder of Parquet files
  guideloom inspect 'data/train-*.parquet' --column input_ids --tokenizer tokenizer.json
"""

VERIFY_EXAMPLES = """\
examples:
  guideloom verify stdlib-bytes
  guideloom verify ds --progress     # a progress bar even when stderr is not a terminal
"""

Storage = StreamStorageAbstract[Any, Any] | DocumentStorageAbstract[Any, Any]


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="describe a dataset: kind, dtype, counts, files, decoded samples",
        description="Describe a dataset. With --tokenizer, also decode its first documents.",
        epilog=INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dataset", metavar="DEST", help="a dataset folder or URL, or Parquet files (a folder, a glob, a file)"
    )
    p.add_argument(
        "--column",
        metavar="NAME",
        help="Parquet: the column to count and show (default: the first text or token-id column)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="bytes|PATH|auto",
        help="decode samples with it ('auto': the tokenizer the dataset records)",
    )
    add_count(p, "--samples", 0, 3, "K", "documents to decode")
    add_count(p, "--chars", 0, 200, "C", "show at most C characters of each")
    p.set_defaults(func=run_inspect)

    v = sub.add_parser(
        "verify",
        parents=[common],
        help="re-read every file and check sizes and checksums against the manifest",
        description="Re-read every data file of a dataset and check its size and SHA-256 checksum "
        "against the manifest.",
        epilog=VERIFY_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("dataset", metavar="DEST", help="a dataset folder or URL")
    v.add_argument(
        "--add-block-digests",
        action="store_true",
        help="a dataset written without block digests gets them once every file matched its "
        "checksum (reads then check every block before using it); the manifest is replaced atomically",
    )
    v.set_defaults(func=run_verify)


def open_dataset(dest: str) -> tuple[Manifest | None, Storage]:
    """The dataset's manifest (when the storage exposes it) and a storage of the right kind."""
    folder = local_folder(dest)
    if folder is not None:
        manifest = read_local_manifest(folder)
        storage: Storage = open_stream(dest) if manifest.kind == "stream" else open_documents(dest)
        return manifest, storage
    try:
        storage = open_stream(dest)
    except DatasetFormatError:
        storage = open_documents(dest)
    return storage._written_manifest(), storage


def _describe(dest: str, manifest: Manifest | None, storage: Storage) -> list[str]:
    lines = [f"dataset:    {dest}"]
    if manifest is None:
        kind = "stream" if isinstance(storage, StreamStorageAbstract) else "documents"
        lines += [f"kind:       {kind}", f"dtype:      {storage.dtype}", f"length:     {len(storage):,}"]
        return lines
    lines += [
        f"kind:       {manifest.kind}",
        f"dtype:      {manifest.dtype.name}",
        f"elements:   {counted(manifest.num_elements, 'token')}",
    ]
    documents = manifest.num_documents if manifest.kind == "documents" else manifest.extra.get("documents")
    if documents is not None:
        lines.append(f"documents:  {documents:,}")
    if manifest.kind == "stream" and len(manifest.fields) > 1:
        meta = ", ".join(f"{n} ({s.dtype.name})" for n, s in manifest.fields.items() if n != "tokens")
        lines.append(f"metadata:   {meta}")
    files = manifest.all_files()
    total = sum(f.nbytes for _, _, f in files)
    lines.append(f"files:      {len(files)} ({format_bytes(total)}, {total:,} bytes)")
    width = max(len(f.path) for _, _, f in files)
    for name, spec, f in files:
        lines.append(
            f"  {f.path:<{width}}  {name:<8} {spec.dtype.name:<7} "
            f"{plural(f.elements, 'element', shown=f'{f.elements:>14,}'):<23} {f.nbytes:>15,} B"
        )
    if manifest.extra:
        lines.append("info:")
        lines += [f"  {k}: {v}" for k, v in manifest.extra.items()]
    return lines


def _eos_of(manifest: Manifest | None) -> int | None:
    eos = manifest.extra.get("eos_id") if manifest is not None else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


async def _first_documents(storage: Storage, k: int, eos: int | None) -> list[np.ndarray[Any, Any]]:
    if k <= 0:
        return []
    await storage.open()
    try:
        if isinstance(storage, DocumentStorageAbstract):
            n = min(k, len(storage))
            return [np.asarray(d) for d in await storage.read_many(np.arange(n, dtype=np.int64))]
        length = min(len(storage), _SAMPLE_WINDOW)
        if length == 0:
            return []
        (window,) = await storage.read_many(np.zeros(1, dtype=np.int64), length)
        tokens = np.asarray(window["tokens"] if isinstance(window, dict) else window)
    finally:
        await storage.close()
    if eos is None:
        return [tokens[i * 256 : (i + 1) * 256] for i in range(min(k, -(-len(tokens) // 256)))]
    ends = np.flatnonzero(tokens == eos)[:k] + 1
    starts = np.concatenate([[0], ends[:-1]])
    docs = [tokens[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    if len(docs) < k and (not len(ends) or ends[-1] < len(tokens)):
        docs.append(tokens[int(ends[-1]) if len(ends) else 0 :])
    return docs


def _preview(tokenizer: Tokenizer, tokens: np.ndarray[Any, Any], chars: int) -> str:
    text = tokenizer.decode(tokens)
    more = "..." if len(text) > chars else ""
    return repr(text[:chars]) + more


def is_parquet(dest: str) -> bool:
    """Whether ``dest`` names Parquet files (a ``.parquet`` file or glob, or a local folder of
    them without a guideloom manifest) rather than a prepared dataset."""
    if dest.rstrip("/").endswith(".parquet") or any(c in dest for c in "*?["):
        return True
    folder = local_folder(dest)
    if folder is None or not folder.is_dir() or (folder / MANIFEST_NAME).exists():
        return False
    return next(iter(folder.rglob("*.parquet")), None) is not None


def _readable_column(columns: list[tuple[str, str]]) -> str:
    for name, kind in columns:
        if kind in ("string", "large_string") or (
            kind.startswith(("list<", "large_list<")) and "int" in kind
        ):
            return name
    shown = ", ".join(f"{n} ({k})" for n, k in columns)
    raise UsageError(f"no text or token-id column to show among {shown}; name one with --column")


def _sample_rows(storage: ParquetStorage, k: int) -> list[Any]:
    """The first ``k`` rows, each ``None`` where the row is null (the storage, opened with
    ``on_null="empty"``, counts it as it reads it as an empty document)."""
    rows = []
    for i in range(k):
        before = storage.figures()["parquet_null_rows"]
        (row,) = storage.read_many_sync(np.array([i], dtype=np.int64))
        rows.append(None if storage.figures()["parquet_null_rows"] > before else row)
    return rows


def _inspect_parquet(args: argparse.Namespace) -> list[str]:
    files, columns = parquet_columns(args.dataset)
    column = args.column or _readable_column(columns)
    # inspect looks at the data as it is: a null row is shown as one, not refused
    storage = open_parquet(args.dataset, column, on_null="empty")
    sizes = storage.row_group_sizes()
    lines = [
        f"dataset:    {args.dataset}",
        "kind:       parquet (rows read where they lie: gl.open_parquet)",
        f"rows:       {len(storage):,}",
        f"files:      {len(files)}",
        f"row groups: {len(sizes):,} (rows each: min {int(sizes.min()):,}, mean {sizes.mean():,.0f}, "
        f"max {int(sizes.max()):,})",
        "columns:    " + ", ".join(f"{n} ({k})" for n, k in columns),
        f"column:     {column} ({'text' if storage.dtype == object else f'token ids, {storage.dtype}'})",
    ]
    summary = storage.file_summary()
    # each column as wide as its widest entry, so that a listing of short files stays narrow
    width = max(len(f) for f, *_ in summary)
    n_w, g_w, b_w = (max(len(f"{row[i]:,}") for row in summary) for i in (1, 2, 3))
    for f, nrows, groups, nbytes in summary:
        rows_text = plural(nrows, "row", shown=f"{nrows:>{n_w},}")
        groups_text = plural(groups, "row group", shown=f"{groups:>{g_w},}")
        lines.append(f"  {f:<{width}}  {rows_text:<{n_w + 5}}  {groups_text:<{g_w + 11}}  {nbytes:>{b_w},} B")
    k = min(args.samples, len(storage))
    rows = _sample_rows(storage, k)
    tokenizer = tokenizer_for_decoding(args.tokenizer, {}) if args.tokenizer else None
    lines.append(f"samples (first {plural(k, 'row')} of {column!r}):")
    for i, row in enumerate(rows):
        if row is None:
            lines.append(f"  [{i}] null")
        elif isinstance(row, str):
            text = row
            more = "..." if len(text) > args.chars else ""
            lines.append(f"  [{i}] {counted(len(text), 'char')}: {text[: args.chars]!r}{more}")
        elif tokenizer is not None:
            lines.append(f"  [{i}] {counted(len(row), 'token')}: {_preview(tokenizer, row, args.chars)}")
        else:
            head = ", ".join(str(t) for t in row[:16].tolist())
            lines.append(f"  [{i}] {counted(len(row), 'token')}: [{head}{', ...' if len(row) > 16 else ''}]")
    nulls = sum(row is None for row in rows)
    if nulls:
        lines.append(
            f"nulls:      {nulls} of the {plural(k, 'row')} shown {'is' if nulls == 1 else 'are'} null: "
            "gl.open_parquet refuses a null row unless on_null='empty' (an empty document)"
            + ("; guideloom prepare skips one with --skip-invalid" if storage.dtype == object else "")
        )
    return lines


def run_inspect(args: argparse.Namespace) -> int:
    if is_parquet(args.dataset):
        print("\n".join(_inspect_parquet(args)))
        return 0
    if args.column:
        raise UsageError("--column applies to Parquet files only")
    manifest, storage = open_dataset(args.dataset)
    lines = _describe(args.dataset, manifest, storage)
    if args.tokenizer:
        tokenizer = tokenizer_for_decoding(args.tokenizer, manifest.extra if manifest is not None else {})
        docs = asyncio.run(_first_documents(storage, args.samples, _eos_of(manifest)))
        name = args.tokenizer
        if name == "auto" and manifest is not None:
            name = f"{manifest.extra.get('tokenizer')} (auto)"
        lines.append(f"samples (first {plural(len(docs), 'document')}, decoded with {name}):")
        for i, doc in enumerate(docs):
            lines.append(f"  [{i}] {counted(len(doc), 'token')}: {_preview(tokenizer, doc, args.chars)}")
    print("\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    if is_parquet(args.dataset):
        raise ValueError(
            f"{args.dataset} holds Parquet files, not a dataset guideloom wrote: verify checks a "
            "dataset's files against the checksums of its manifest, which Parquet files have not. "
            f"`guideloom inspect {args.dataset}` reads their footers and a few rows; gl.open_parquet "
            "checks each file's size and version as it reads"
        )
    folder = local_folder(args.dataset)
    total = None
    if folder is not None:
        total = sum(f.nbytes for _, _, f in read_local_manifest(Path(folder)).all_files())
    progress = Progress(
        enabled=Progress.wanted(progress=args.progress, quiet=args.quiet), total=total, desc="verify"
    )
    try:
        had_blocks = args.add_block_digests and (
            folder is None or read_local_manifest(Path(folder)).has_blocks
        )
        manifest = verify_dataset(
            args.dataset, progress=progress.update, add_block_digests=args.add_block_digests
        )
    finally:
        progress.close()
    if not args.quiet:
        files = manifest.all_files()
        nbytes = sum(f.nbytes for _, _, f in files)
        blocks = " and block digests" if manifest.has_blocks else ""
        print(
            f"ok: {args.dataset}: {plural(len(files), 'file')}, {format_bytes(nbytes)}, sizes, sha256 "
            f"checksums{blocks} match the manifest ({manifest.kind}, "
            f"{counted(manifest.num_elements, manifest.dtype.name + ' token')})"
        )
        if args.add_block_digests and not had_blocks:
            print(f"added block digests to {args.dataset}'s manifest")
    return 0
