"""``guideloom prepare``'s writing: the inputs tokenized into one dataset (a whole dataset, or a
task's part), the document ids rebuilt from the spilled document lengths, and the report."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from guideloom._cli._common import Progress, counted, format_bytes
from guideloom._cli._inputs import InputFile, iter_tasks
from guideloom._cli._tokenizers import TokenizerSpec
from guideloom._cli._work import Options, Result, ordered_results
from guideloom._core.text import plural
from guideloom.storage._api import _sink, write_documents, write_stream
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._write._writer import write_documents_to

__all__ = ["Counter", "prepare_files", "report"]

_META_CHUNK = 4 * 2**20  # metadata elements per chunk
_LENGTHS_BLOCK = 2**16  # document lengths read back per block


class Counter:
    """Totals of the run, and the document lengths spilled to a temporary file."""

    def __init__(self, lengths_file: IO[bytes] | None) -> None:
        self.documents = 0
        self.tokens = 0
        self.invalid = 0
        self.max_length = 0
        self.lengths_file = lengths_file


def _doc_dtype(counter: Counter, which: str) -> type[np.integer[Any]]:
    if which == "doc_id":
        return np.uint32 if counter.documents <= 2**32 else np.int64
    return np.uint32 if counter.max_length <= 2**32 else np.int64


class _DocDtypes(Mapping[str, Any]):
    """``doc_id``/``doc_pos`` dtypes, looked up once the tokens are written and the totals known
    (so an empty dataset, or part, stores them in the same dtype as any other)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def __getitem__(self, key: str) -> Any:
        return _doc_dtype(self.counter, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("doc_id", "doc_pos"))

    def __len__(self) -> int:
        return 2


def _doc_metadata(counter: Counter, which: str) -> Iterator[npt.NDArray[Any]]:
    """``doc_id`` or ``doc_pos`` for every token, rebuilt from the spilled document lengths.

    Runs after the tokens are written (the writer consumes one field at a time), so the totals
    are known and pick the dtype; memory stays bounded by the block sizes.
    """
    fh = counter.lengths_file
    assert fh is not None
    dtype = _doc_dtype(counter, which)
    fh.seek(0)
    base_doc = 0
    while block := fh.read(8 * _LENGTHS_BLOCK):
        lengths = np.frombuffer(block, dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        total = int(ends[-1])
        for a in range(0, total, _META_CHUNK):
            pos = np.arange(a, min(total, a + _META_CHUNK), dtype=np.int64)
            doc = np.searchsorted(ends, pos, side="right")
            if which == "doc_id":
                yield (doc + base_doc).astype(dtype)
            else:
                yield (pos - starts[doc]).astype(dtype)
        base_doc += len(lengths)


def prepare_files(
    args: argparse.Namespace,
    spec: TokenizerSpec,
    files: list[InputFile],
    dest: str,
    *,
    overwrite: bool,
    extra: dict[str, Any] | None = None,
    offsets_head: bool = False,
    desc: str = "prepare",
    on_result: Callable[[int], object] | None = None,
) -> tuple[Manifest, Counter, float]:
    """Tokenize ``files`` into a dataset at ``dest``: its manifest, totals and seconds taken."""
    options = Options(tokenizer=spec, field=args.field, skip_invalid=args.skip_invalid)
    info: dict[str, Any] = {
        **spec.info(),
        "eos_appended": spec.eos_id is not None,
        "source_files": len(files),
        "documents": 0,
        "created_by": "guideloom prepare",
        **(extra or {}),
    }
    total_disk = sum(_disk(f) for f in files)
    progress = Progress(
        enabled=Progress.wanted(progress=args.progress, quiet=args.quiet),
        total=total_disk,
        desc=desc,
        counters=("docs", "tokens"),
    )
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        lengths_file = (
            stack.enter_context(tempfile.TemporaryFile(prefix="guideloom-lengths-"))
            if args.document_ids
            else None
        )
        counter = Counter(lengths_file)
        results = ordered_results(
            iter_tasks(files, field_name=args.field, task_bytes=args.task_size), options, args.workers
        )

        def counting() -> Iterator[Result]:
            for r in results:
                counter.documents += len(r.lengths)
                counter.tokens += len(r.tokens)
                counter.invalid += r.invalid
                if len(r.lengths):
                    counter.max_length = max(counter.max_length, int(r.lengths.max()))
                if counter.lengths_file is not None:
                    counter.lengths_file.write(r.lengths.tobytes())
                progress.update(r.disk_bytes, docs=len(r.lengths), tokens=len(r.tokens))
                if on_result is not None:
                    on_result(r.disk_bytes)
                yield r
            info["documents"] = counter.documents
            info["tokens"] = counter.tokens
            if args.skip_invalid:
                info["skipped_invalid"] = counter.invalid

        write_options: dict[str, Any] = {
            "dtype": np.dtype(spec.dtype),
            "shard_bytes": args.shard_size,
            "overwrite": overwrite,
            "info": info,
        }
        try:
            if args.kind == "stream":
                metadata = (
                    {"doc_id": _doc_metadata(counter, "doc_id"), "doc_pos": _doc_metadata(counter, "doc_pos")}
                    if args.document_ids
                    else None
                )
                manifest = write_stream(
                    dest,
                    (r.tokens for r in counting()),
                    metadata=metadata,
                    metadata_dtypes=_DocDtypes(counter) if args.document_ids else None,
                    **write_options,
                )
            else:
                manifest = _write_documents(
                    dest, _split_documents(counting()), offsets_head=offsets_head, **write_options
                )
        finally:
            results.close()
            progress.close()
    return manifest, counter, time.perf_counter() - started


def _disk(f: InputFile) -> int:
    return f.size if f.span is None else f.span[1] - f.span[0]


def _write_documents(
    dest: str, documents: Iterator[npt.NDArray[Any]], *, offsets_head: bool, **options: Any
) -> Manifest:
    if not offsets_head:
        return write_documents(dest, documents, **options)
    return write_documents_to(_sink(dest, {}), documents, offsets_head=True, **options)


def report(manifest: Manifest, dest: str, counter: Counter, files: list[InputFile], elapsed: float) -> None:
    total_disk = sum(_disk(f) for f in files)
    nbytes = sum(f.nbytes for _, _, f in manifest.all_files())
    print(
        f"wrote {manifest.kind} dataset {dest}: {counted(manifest.num_elements, 'token', short=True)} "
        f"({manifest.dtype.name}), {counted(counter.documents, 'document')} from "
        f"{counted(len(files), 'file')}, "
        f"{counted(len(manifest.all_files()), 'data file')} ({format_bytes(nbytes)}) "
        f"in {elapsed:.1f} s "
        f"({total_disk / max(elapsed, 1e-9) / 1e6:.1f} MB/s of input)"
    )
    if counter.invalid:
        n = counter.invalid
        skipped = plural(n, "invalid line, row or file", "invalid lines, rows or files", shown=f"{n:,}")
        print(f"skipped {skipped} (--skip-invalid)")


def _split_documents(results: Iterator[Result]) -> Iterator[npt.NDArray[Any]]:
    for r in results:
        if len(r.lengths):
            yield from np.split(r.tokens, np.cumsum(r.lengths[:-1]))
