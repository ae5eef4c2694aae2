"""``guideloom prepare``: tokenize a corpus into a stream or document dataset.

The command: its arguments, and what each form runs (one machine: :mod:`._prepare_write`;
task ``I`` of ``N``: :mod:`._prepare_task`; ``--merge``: the parts merged)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from guideloom._cli._common import CLIError, UsageError, add_count, counted, int_at_least
from guideloom._cli._inputs import FORMATS, expand_inputs
from guideloom._cli._parts import PARTS, TaskSlot, clear_parts, merge_parts, open_root, task_from_environment
from guideloom._cli._prepare_task import run_task
from guideloom._cli._prepare_write import prepare_files, report
from guideloom._cli._tokenizers import resolve_tokenizer
from guideloom._core.text import plural
from guideloom.storage._format._manifest import MANIFEST_NAME

__all__ = ["add_parser", "run"]

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
        return run_on_ray(args, spec, files, run_task)
    if args.ray_address is not None:
        raise UsageError("--ray-address goes with --engine ray")
    slot = _slot(args)
    spec = resolve_tokenizer(args.tokenizer, eos=args.eos, no_eos=args.no_eos, dtype=args.dtype)
    files = expand_inputs(args.inputs, include=args.include, forced=args.format)
    if slot is not None:
        return run_task(args, spec, files, slot)
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
        report(manifest, dest, counter, files, elapsed)
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
