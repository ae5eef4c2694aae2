"""``guideloom prepare --task I --tasks N``: one task's share prepared into its part, a part
already finished skipped, a race between two runs of one task settled, and the merge once every
part is finished."""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from guideloom._cli._common import CLIError, counted
from guideloom._cli._inputs import InputFile, inputs_fingerprint, share_of
from guideloom._cli._parts import (
    Root,
    TaskSlot,
    clear_parts,
    merge_parts,
    open_root,
    part_folder,
    part_options,
)
from guideloom._cli._prepare_write import Counter, prepare_files, report
from guideloom._cli._tokenizers import TokenizerSpec
from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, parse_manifest
from guideloom.storage._write._parts import relocated

__all__ = ["run_task"]


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


def run_task(
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
            report(manifest, f"{dest}/{name}", counter, share, elapsed)
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
) -> tuple[Manifest, Counter, float]:
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
