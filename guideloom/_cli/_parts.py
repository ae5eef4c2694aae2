"""``prepare --task I --tasks N`` and ``prepare --merge``: a dataset prepared in parts.

Task ``I`` of ``N`` prepares its share of the inputs (:func:`guideloom._cli._inputs.share_of`)
into ``parts/part-IIIII-of-NNNNN/`` under the destination: a dataset of its own, whose manifest
records the task, the options and the inputs it was prepared from. The merge writes the
destination's ``manifest.json`` over all ``N`` parts: it names their data files where they are
(``parts/part-.../tokens-....bin``), reading only the part manifests. Where a part's values
count from the part's start (document offsets, ``doc_id``), the merged manifest gives each of
its files a ``base`` (the documents or tokens before the part), so no data file is rewritten.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from guideloom._cli._common import CLIError, UsageError
from guideloom._core.text import plural
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest
from guideloom.storage._write._parts import (
    PARTS,
    Root,
    check_present,
    clear_parts,
    commit_merged,
    merged_manifest,
    open_root,
    parse_part_name,
    part_folder,
    part_manifests_in,
    read_parts,
)

__all__ = [
    "PARTS",
    "Root",
    "TaskSlot",
    "clear_parts",
    "merge_parts",
    "open_root",
    "part_folder",
    "part_options",
    "task_from_environment",
]


@dataclass(frozen=True, slots=True)
class TaskSlot:
    task: int
    """From 0."""
    tasks: int


def task_from_environment(env: Mapping[str, str]) -> TaskSlot | None:
    """The task of a Slurm array job: ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` of
    ``SLURM_ARRAY_TASK_COUNT`` (an array ``--array=1-64`` is tasks 0..63 of 64), or None outside
    one. An array with gaps or steps (``--array=0-63:2``, ``--array=1,5,9``) has no such
    numbering: it is refused, and ``--task``/``--tasks`` name the task instead."""
    raw = env.get("SLURM_ARRAY_TASK_ID")
    if raw is None:
        return None
    try:
        task_id = int(raw)
        count = int(env["SLURM_ARRAY_TASK_COUNT"])
        low = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        high = int(env.get("SLURM_ARRAY_TASK_MAX", str(low + count - 1)))
    except (KeyError, ValueError):
        raise UsageError(
            "SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT/MIN/MAX are missing or not "
            "integers; pass --task I --tasks N"
        ) from None
    if high - low + 1 != count or not low <= task_id <= high:
        raise UsageError(
            f"the Slurm array (tasks {low}..{high}, {count} of them) is not one contiguous range of "
            "ids, so its tasks cannot be numbered 0..N-1: use --array=0-N-1 (or 1-N), or pass "
            "--task I --tasks N"
        )
    return TaskSlot(task_id - low, count)


def part_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """What a part records of how it was prepared, and its fingerprint: parts of one dataset
    must agree on all of it."""
    text = json.dumps(dict(options), sort_keys=True, default=str)
    return {
        "options": json.loads(text),
        "fingerprint": hashlib.blake2b(text.encode(), digest_size=8).hexdigest(),
    }


def merge_parts(dest: str, *, tasks: int | None = None) -> Manifest:
    """Write ``dest``'s manifest over its ``tasks`` parts (found in ``parts/`` when None).

    Refuses missing parts, parts prepared with other options or inputs, fields whose dtypes
    differ, and data files the part manifests name but ``parts/`` does not hold; reads the part
    manifests and one listing of ``parts/`` only.
    """
    root = open_root(dest)
    listing = root.files(PARTS)
    found = {
        TaskSlot(*slot): name
        for name in part_manifests_in(listing)
        if (slot := parse_part_name(name)) is not None
    }
    if tasks is None:
        counts = sorted({s.tasks for s in found})
        if not counts:
            raise CLIError(
                f"{dest} holds no prepared parts ({PARTS}/part-*-of-*/{MANIFEST_NAME}); prepare them "
                "with `guideloom prepare INPUTS --output DEST --task I --tasks N`"
            )
        if len(counts) > 1:
            raise UsageError(
                f"{dest} holds parts of runs with {', '.join(map(str, counts))} tasks; pass --tasks N "
                "to merge the run you want"
            )
        tasks = counts[0]
    missing = [i for i in range(tasks) if TaskSlot(i, tasks) not in found]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise CLIError(
            f"{dest}: {len(missing)} of the {plural(tasks, 'part')} {'is' if len(missing) == 1 else 'are'} "
            f"missing or unfinished ({'task' if len(missing) == 1 else 'tasks'} {shown}, "
            "counted from 0); run them again with --task I --tasks N (finished parts are skipped), "
            "then merge"
        )
    names = [part_folder(i, tasks) for i in range(tasks)]
    parts = read_parts(root, names)
    manifest = merged_manifest(names, parts)
    check_present(manifest, listing, dest)
    commit_merged(root, manifest)
    return manifest
