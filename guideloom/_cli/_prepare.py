"""``guideloom prepare``: tokenize a corpus into a stream or document dataset."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from guideloom._cli._common import (
    CLIError,
    Progress,
    UsageError,
    add_count,
    counted,
    format_bytes,
    int_at_least,
)
from guideloom._cli._inputs import FORMATS, InputFile, expand_inputs, inputs_fingerprint, iter_tasks, share_of
from guideloom._cli._parts import (
    PARTS,
    Root,
    TaskSlot,
    clear_parts,
    merge_parts,
    open_root,
    part_folder,
    part_options,
    task_from_environment,
)
from guideloom._cli._tokenizers import TokenizerSpec, resolve_tokenizer
from guideloom._cli._work import Options, Result, ordered_results
from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError
from guideloom.storage._api import _sink, write_documents, write_stream
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, parse_manifest
from guideloom.storage._write._parts import relocated
from guideloom.storage._write._writer import write_documents_to

__all__ = ["add_parser", "run"]

_META_CHUNK = 4 * 2**20  # metadata elements per chunk
_LENGTHS_BLOCK = 2**16  # document lengths read back per block

EXAMPLES = """\
examples:
  # the standard library's own sources as a corpus, byte-level tokens, 2 processes
  guideloom prepare "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \\
      --include '*.py' --output stdlib-bytes --workers 2

  # JSONL (also .jsonl.gz / .jsonl.zst), text in the "content" field, one sample per document
  guideloom prepare data/*.jsonl.zst --field content --kind documents --output docs

  # a tokenizer.json, its end-of-document token, document ids for attention masking
  guideloom prepare corpus/ --tokenizer tokenizer.json --eos '</s>' --document-ids --output ds

  # to object storage (needs guideloom[remote])
  guideloom prepare corpus/ --output s3://bucket/datasets/corpus

  # on 64 machines: a Slurm array, one task each; the last to finish writes the manifest
  sbatch --array=0-63 --wrap "guideloom prepare corpus/ --output s3://bucket/corpus"
  guideloom prepare --merge s3://bucket/corpus   # again, or after a rerun of failed tasks
"""


def _size(text: str) -> int:
    units = {
        "": 1,
        "b": 1,
        "k": 2**10,
        "kb": 2**10,
        "kib": 2**10,
        "m": 2**20,
        "mb": 2**20,
        "mib": 2**20,
        "g": 2**30,
        "gb": 2**30,
        "gib": 2**30,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abgikm")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4MiB or 1048576") from None
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4MiB or 1048576")
    return max(1, int(value * units[unit]))


def _destination(text: str) -> str:
    """``--output``: an empty one (an unset shell variable, say) would mean the current folder."""
    if not text or text.lower() == "file://":
        raise argparse.ArgumentTypeError(
            f"{text!r} is an empty path: name the dataset's folder or URL (use '.' for the current folder)"
        )
    return text


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "prepare",
        parents=[common],
        help="tokenize text files into a dataset the loader reads",
        description=(
            "Tokenize .txt (one document per file), .jsonl (one per line) and .parquet (one per "
            "row) inputs, each optionally .gz or .zst, into a stream dataset (documents "
            "concatenated, each followed by the end-of-document token) or a document dataset. "
            "Folders are read recursively, in sorted order."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files, globs or folders")
    p.add_argument(
        "-o",
        "--output",
        type=_destination,
        metavar="DEST",
        help="a folder, file:// URL, or s3:// gs:// az:// prefix (required)",
    )
    p.add_argument(
        "--kind",
        choices=("stream", "documents"),
        default="stream",
        help="stream: one token stream cut into fixed-length samples (default); "
        "documents: one sample per document",
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|PATH",
        help="'bytes' (default: one token per UTF-8 byte, ids 0-255, end-of-document 256) "
        "or a local tokenizer.json of the tokenizers library",
    )
    p.add_argument(
        "--eos", metavar="TOKEN", help="the end-of-document token of a tokenizer.json, as text ('</s>') or id"
    )
    p.add_argument("--no-eos", action="store_true", help="append no end-of-document token")
    p.add_argument(
        "--dtype",
        choices=("uint8", "uint16", "uint32", "int32", "int64"),
        help="token dtype (default: the smallest that holds the vocabulary)",
    )
    p.add_argument(
        "--field", default="text", help="the text field of JSONL objects and parquet rows (default: text)"
    )
    p.add_argument(
        "--format",
        choices=("auto", *FORMATS),
        default="auto",
        help="how to read the inputs (default: from each file's extension; unknown ones are text)",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="in folders, read the files whose name matches PATTERN (e.g. '*.py'); repeatable",
    )
    add_count(p, "--workers", 1, 1, "N", "tokenize in N processes (the output is the same for any N)")
    p.add_argument(
        "--document-ids",
        action="store_true",
        help="stream only: store doc_id and doc_pos metadata, so samples are dicts that "
        "say which document each token belongs to and where in it",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip (and count) malformed JSON lines, rows without text and non-UTF-8 files",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a dataset that exists at DEST")
    p.add_argument(
        "--shard-size",
        type=_size,
        default=256 * 2**20,
        metavar="SIZE",
        help="largest data file (default 256MiB)",
    )
    p.add_argument(
        "--task-size",
        type=_size,
        default=4 * 2**20,
        metavar="SIZE",
        help="input text per parallel task (default 4MiB)",
    )
    tasks = p.add_argument_group(
        "tasks",
        "prepare on several machines: task I of N writes its share of the inputs into "
        "DEST/parts/part-I-of-N/; the merge writes DEST's manifest over all parts without "
        "copying them (the dataset is the same for any N)",
    )
    tasks.add_argument(
        "--task",
        type=int_at_least(0),
        metavar="I",
        help="this task, from 0 (default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN in a Slurm array)",
    )
    tasks.add_argument(
        "--tasks",
        type=int_at_least(1),
        metavar="N",
        help="the number of tasks (default: SLURM_ARRAY_TASK_COUNT in a Slurm array)",
    )
    tasks.add_argument(
        "--merge",
        type=_destination,
        metavar="DEST",
        help="write DEST's manifest over its finished parts (the last task to finish does it too)",
    )
    tasks.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this machine is one task (default); ray: submit the --tasks N tasks (default: "
        "one per CPU of the cluster) to a Ray cluster, then merge (needs guideloom[ray])",
    )
    tasks.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the Ray cluster to use (default: the one this process is connected to, else a local "
        "one of 2 CPUs)",
    )
    tasks.add_argument(
        "--retries",
        type=int_at_least(0),
        default=2,
        metavar="R",
        help="--engine ray: run a task again up to R times when its worker dies or it fails to read "
        "or write (default 2)",
    )
    p.set_defaults(func=run)


def _is_local(dest: str) -> bool:
    scheme = dest.split("://", 1)[0].lower() if "://" in dest else ""
    return scheme in ("", "file")


def _local_folder(dest: str) -> Path:
    return Path(dest[len("file://") :] if dest.startswith("file://") else dest).expanduser()


class _Counter:
    """Totals of the run, and the document lengths spilled to a temporary file."""

    def __init__(self, lengths_file: IO[bytes] | None) -> None:
        self.documents = 0
        self.tokens = 0
        self.invalid = 0
        self.max_length = 0
        self.lengths_file = lengths_file


def _doc_dtype(counter: _Counter, which: str) -> type[np.integer[Any]]:
    if which == "doc_id":
        return np.uint32 if counter.documents <= 2**32 else np.int64
    return np.uint32 if counter.max_length <= 2**32 else np.int64


class _DocDtypes(Mapping[str, Any]):
    """``doc_id``/``doc_pos`` dtypes, looked up once the tokens are written and the totals known
    (so an empty dataset, or part, stores them in the same dtype as any other)."""

    def __init__(self, counter: _Counter) -> None:
        self.counter = counter

    def __getitem__(self, key: str) -> Any:
        return _doc_dtype(self.counter, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("doc_id", "doc_pos"))

    def __len__(self) -> int:
        return 2


def _doc_metadata(counter: _Counter, which: str) -> Iterator[npt.NDArray[Any]]:
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


def run(args: argparse.Namespace) -> int:
    if args.merge is not None:
        return _merge(args)
    if not args.inputs:
        raise UsageError("name the inputs to prepare (files, globs or folders), or --merge DEST")
    if args.output is None:
        raise UsageError("the following argument is required: -o/--output")
    if args.kind == "documents" and args.document_ids:
        raise UsageError("--document-ids applies to --kind stream (a document dataset keeps its boundaries)")
    if args.no_eos and args.eos is not None:
        raise UsageError("--eos and --no-eos contradict each other")
    if args.engine == "ray":
        if args.task is not None:
            raise UsageError("--engine ray runs all the tasks: name --tasks N, not --task")
        from guideloom._cli._ray_engine import run_on_ray

        spec = resolve_tokenizer(args.tokenizer, eos=args.eos, no_eos=args.no_eos, dtype=args.dtype)
        files = expand_inputs(args.inputs, include=args.include, forced=args.format)
        return run_on_ray(args, spec, files, _run_task)
    if args.ray_address is not None:
        raise UsageError("--ray-address goes with --engine ray")
    slot = _slot(args)
    spec = resolve_tokenizer(args.tokenizer, eos=args.eos, no_eos=args.no_eos, dtype=args.dtype)
    files = expand_inputs(args.inputs, include=args.include, forced=args.format)
    if slot is not None:
        return _run_task(args, spec, files, slot)
    dest: str = args.output
    if _is_local(dest):
        folder = _local_folder(dest)
        if folder.exists() and not folder.is_dir():
            raise CLIError(f"--output {dest!r} exists and is not a folder")
        if (folder / MANIFEST_NAME).exists() and not args.overwrite:
            raise CLIError(f"a dataset already exists at {dest!r}; pass --overwrite to replace it")
    root = open_root(dest)
    if not args.overwrite and root.folders():
        raise CLIError(
            f"{dest!r} holds the parts of a run of tasks ({PARTS}/); finish it with --task I --tasks N "
            "and --merge, or pass --overwrite to replace it"
        )
    manifest, counter, elapsed = prepare_files(args, spec, files, dest, overwrite=args.overwrite)
    if args.overwrite:
        clear_parts(root)  # their data went with the dataset replaced; their manifests go too
    if not args.quiet:
        _report(manifest, dest, counter, files, elapsed)
    return 0


def _slot(args: argparse.Namespace) -> TaskSlot | None:
    """``--task``/``--tasks``, else the Slurm array's task, else None (one machine)."""
    if args.task is None and args.tasks is None:
        return task_from_environment(os.environ)
    if args.task is None or args.tasks is None:
        where = (
            "inside a Slurm array, name neither (the array numbers the tasks) or both"
            if "SLURM_ARRAY_TASK_ID" in os.environ
            else "outside a Slurm array, name both"
        )
        raise UsageError(f"--task I and --tasks N go together ({where})")
    if args.task >= args.tasks:
        raise UsageError(
            f"--task {args.task} is not one of the {plural(args.tasks, 'task')} (0 to {args.tasks - 1})"
        )
    return TaskSlot(args.task, args.tasks)


def _merge(args: argparse.Namespace) -> int:
    if args.inputs or args.output is not None:
        raise UsageError("--merge DEST takes no inputs and no --output: it merges DEST's parts")
    started = time.perf_counter()
    manifest = merge_parts(args.merge, tasks=args.tasks)
    if not args.quiet:
        print(
            f"merged {counted(manifest.extra['parts']['tasks'], 'part')} into {args.merge}: "
            f"{counted(manifest.num_elements, 'token', short=True)}, "
            f"{counted(len(manifest.all_files()), 'data file')}, "
            f"in {time.perf_counter() - started:.2f} s"
        )
    return 0


def _options_record(
    args: argparse.Namespace, spec: TokenizerSpec, files: list[InputFile], tasks: int
) -> dict[str, Any]:
    """What every part of one dataset must share: the options that shape its data, and the inputs."""
    return part_options(
        {
            "kind": args.kind,
            **spec.info(),
            "dtype": np.dtype(spec.dtype).name,
            "field": args.field,
            "format": args.format,
            "include": list(args.include),
            "document_ids": bool(args.document_ids),
            "skip_invalid": bool(args.skip_invalid),
            "task_size": args.task_size,
            "tasks": tasks,
            "source_files": len(files),
            "inputs": inputs_fingerprint(files),
        }
    )


def _run_task(
    args: argparse.Namespace,
    spec: TokenizerSpec,
    files: list[InputFile],
    slot: TaskSlot,
    *,
    merge: bool = True,
    on_result: Callable[[int], object] | None = None,
) -> int:
    """Prepare task ``slot``'s share into its part; skip a part already finished with the same
    options; merge when every part is finished (unless not ``merge``: the Ray engine merges).
    ``on_result`` is called with the input bytes of each piece of work done."""
    dest: str = args.output
    root = open_root(dest)
    name = part_folder(slot.task, slot.tasks)
    record = _options_record(args, spec, files, slot.tasks)
    top = root.read(MANIFEST_NAME)
    if top is not None and not args.overwrite:
        _refuse_another_dataset(root, dest, top, slot, record)
    if args.overwrite:  # parts of runs of another N (or of a Ray write): not this run's
        clear_parts(root, keep_tasks=slot.tasks)
    existing = root.read(f"{name}/{MANIFEST_NAME}")
    if existing is not None and not args.overwrite:
        part = parse_manifest(existing, f"{dest}/{name}/{MANIFEST_NAME}").extra.get("part") or {}
        if part.get("fingerprint") != record["fingerprint"]:
            raise CLIError(
                f"{dest}/{name} was prepared with other options or inputs; pass --overwrite to "
                "prepare it again (and every other part: a dataset's parts share their options)"
            )
        if not args.quiet:
            print(f"{dest}/{name} is already prepared; skipped")
    else:
        if existing is not None:  # --overwrite: the part goes now, its files once this run's is in
            root.remove(f"{name}/{MANIFEST_NAME}")
        share = share_of(files, task_bytes=args.task_size, task=slot.task, tasks=slot.tasks)
        part = {"task": slot.task, "tasks": slot.tasks, **record}
        manifest, counter, elapsed = _prepare_part(
            args,
            spec,
            share,
            root,
            name,
            slot,
            extra={"part": part},
            desc=f"task {slot.task}/{slot.tasks}",
            on_result=on_result,
        )
        if not args.quiet:
            _report(manifest, f"{dest}/{name}", counter, share, elapsed)
    if merge and _all_done(root, slot.tasks):  # the last task to finish merges (two at once write the same)
        try:
            merged = merge_parts(dest, tasks=slot.tasks)
        except DatasetFormatError as exc:
            if not args.overwrite:  # no task of this command changes a finished part: it stays so
                raise CLIError(f"the parts are not merged yet: {exc}") from None
            # an --overwrite run: the other parts may be an earlier run's, being prepared again
            print(f"guideloom: the parts are not merged yet: {exc}", file=sys.stderr)
            return 0
        if not args.quiet:
            print(
                f"{'the part is' if slot.tasks == 1 else f'all {slot.tasks} parts are'} prepared: wrote "
                f"{dest}/{MANIFEST_NAME} ({counted(merged.num_elements, 'token', short=True)})"
            )
    return 0


def _prepare_part(
    args: argparse.Namespace,
    spec: TokenizerSpec,
    share: list[InputFile],
    root: Root,
    name: str,
    slot: TaskSlot,
    **options: Any,
) -> tuple[Manifest, _Counter, float]:
    """Prepare the part ``name`` so that two runs of one task at once (a requeued array element)
    leave one whole part: each writes into a folder of its own (``name/run-<id>/``), then
    creates the part's manifest in one atomic step that only the first to finish wins (a hard
    link locally, a conditional PUT on an object store). The winner then removes whatever else
    the part folder holds (what interrupted runs left); a run that loses removes its own folder
    and fails, saying that the part is whole."""
    run = f"run-{secrets.token_hex(6)}"
    where = f"{name}/{MANIFEST_NAME}"
    try:
        manifest, counter, elapsed = prepare_files(
            args, spec, share, root.location(f"{name}/{run}"), overwrite=False, offsets_head=True, **options
        )
        missing = {f.path for _, _, f in manifest.all_files()} - {
            p.removeprefix(f"{name}/{run}/") for p in root.files(f"{name}/{run}")
        }
        if missing:  # removed under this run by the winner of a race it lost
            raise DatasetFormatError(f"{len(missing)} of this run's files are gone")
        won = root.publish(where, relocated(manifest, run).to_json_bytes())
    except Exception:
        if root.read(where) is None:
            with contextlib.suppress(Exception):  # this run's copy, not to be left behind
                root.clear(f"{name}/{run}")
            raise
        won = False
    if not won:
        root.clear(f"{name}/{run}")
        raise CLIError(
            f"{args.output}/{name}: another run of task {slot.task} of {slot.tasks} prepared this part "
            "at the same time and finished first; its part is whole and stays (this run's copy was "
            "removed): nothing to do"
        )
    root.prune(name, run)
    return relocated(manifest, run), counter, elapsed


def _refuse_another_dataset(
    root: Root, dest: str, top: bytes, slot: TaskSlot, record: Mapping[str, Any]
) -> None:
    """Refuse, without ``--overwrite``, a dataset at ``dest`` that this run of tasks did not make:
    one prepared on one machine, or one merged from the parts of another run (another ``N``,
    other options or inputs), which this task's merge would replace. A merge of this very run
    (a rerun of its tasks) is this run's to finish."""
    try:
        merged = parse_manifest(top, f"{dest}/{MANIFEST_NAME}").extra.get("parts")
    except DatasetFormatError:
        merged = None
    if not isinstance(merged, Mapping):
        raise CLIError(f"a dataset already exists at {dest!r}; pass --overwrite to replace it")
    fingerprint = merged.get("fingerprint")
    if fingerprint is None and merged.get("tasks") == slot.tasks:  # merged before it was recorded
        first = root.read(f"{part_folder(0, slot.tasks)}/{MANIFEST_NAME}")
        try:
            part = parse_manifest(first, dest).extra.get("part") if first is not None else None
        except DatasetFormatError:
            part = None
        fingerprint = part.get("fingerprint") if isinstance(part, Mapping) else None
    if merged.get("tasks") != slot.tasks or fingerprint != record["fingerprint"]:
        parts = plural(_count(merged.get("tasks")), "part")
        raise CLIError(
            f"a dataset already exists at {dest!r} (merged from {parts} "
            f"of another run: other inputs, options or number of tasks than task {slot.task} of "
            f"{slot.tasks}); pass --overwrite to replace it"
        )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _all_done(root: Root, tasks: int) -> bool:
    done = root.part_manifests()
    return all(part_folder(i, tasks) in done for i in range(tasks))


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
) -> tuple[Manifest, _Counter, float]:
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
        counter = _Counter(lengths_file)
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


def _report(manifest: Manifest, dest: str, counter: _Counter, files: list[InputFile], elapsed: float) -> None:
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
