"""``guideloom prepare --engine ray``: the tasks of ``prepare --tasks N`` on a Ray cluster.

Each Ray task runs what ``prepare --task I --tasks N`` runs on a machine of its own (the same
shares, the same parts, a finished part skipped), so the dataset is the one any number of tasks
or one machine writes. The driver shows one progress bar over all tasks (each reports the input
bytes it has done to a small actor), and merges when every task is done. A task whose worker dies
or that fails to read or write is run again up to ``--retries`` times; a task runs in its own
part folder, and one run again starts its part over. Bad input fails at once, with its message.

The cluster's workers must see the inputs at the same paths (a shared file system) and the
destination (a shared folder or object storage), and have guideloom installed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from guideloom._cli._common import CLIError, Progress, counted, require
from guideloom._cli._inputs import InputFile
from guideloom._cli._parts import TaskSlot, merge_parts
from guideloom._cli._tokenizers import TokenizerSpec
from guideloom._core.text import plural

__all__ = ["run_on_ray"]

_POLL = 0.25  # seconds between progress updates
RunTask = Callable[..., int]


def _task(
    run_task: RunTask,
    args: argparse.Namespace,
    spec: TokenizerSpec,
    files: list[InputFile],
    slot: TaskSlot,
    done: Any,
) -> int:
    """One task, in a Ray worker: prepare the part (no merge: the driver merges)."""
    quiet = argparse.Namespace(**{**vars(args), "quiet": True, "progress": False})
    return run_task(quiet, spec, files, slot, merge=False, on_result=done.add.remote)


class _Done:
    """The input bytes the tasks have done (a Ray actor)."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, nbytes: int) -> None:
        self.total += nbytes

    def get(self) -> int:
        return self.total


def _get(ray: Any, refs: list[Any], retries: int) -> None:
    """Wait for ``refs``; a task's own error is raised as itself (its message, not Ray's
    traceback), a worker that died more often than retried as a :class:`CLIError`."""
    try:
        ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise CLIError(f"a Ray task failed: {exc}") from None
    except ray.exceptions.RayError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CLIError(
            f"a Ray task failed {retries + 1} time{'s' if retries else ''} ({type(exc).__name__}: "
            f"{first}); its worker was "
            "killed or ran out of memory: run the command again (finished parts are kept), with "
            "more --retries or smaller --workers"
        ) from None


def run_on_ray(
    args: argparse.Namespace, spec: TokenizerSpec, files: list[InputFile], run_task: RunTask
) -> int:
    """Run ``run_task`` (what ``prepare --task I --tasks N`` runs) for every task on Ray, then merge."""
    ray = require("ray", "--engine ray")
    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if args.ray_address:
            ray.init(address=args.ray_address, **options)
        else:
            ray.init(num_cpus=2, **options)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        tasks = args.tasks or max(1, cpus // args.workers)
        started = time.perf_counter()
        total = sum(f.size for f in files)
        progress = Progress(
            enabled=Progress.wanted(progress=args.progress, quiet=args.quiet),
            total=total,
            desc=f"prepare ({tasks} Ray tasks)",
        )
        done = ray.remote(num_cpus=0)(_Done).remote()
        retried = {"max_retries": args.retries, "retry_exceptions": [OSError]}
        task = ray.remote(num_cpus=min(args.workers, cpus), **retried)(_task)
        spec_ref, files_ref = ray.put(spec), ray.put(files)
        pending = [
            task.remote(run_task, args, spec_ref, files_ref, TaskSlot(i, tasks), done) for i in range(tasks)
        ]
        shown = 0
        try:
            while pending:
                finished, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL)
                _get(ray, finished, args.retries)  # a task's error (after its retries) ends the run
                now = ray.get(done.get.remote())
                progress.update(now - shown)
                shown = now
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            progress.close()
        manifest = merge_parts(args.output, tasks=tasks)
    finally:
        if started_here:
            ray.shutdown()
    if not args.quiet:
        elapsed = time.perf_counter() - started
        print(
            f"wrote {manifest.kind} dataset {args.output} with {plural(tasks, 'Ray task')}: "
            f"{counted(manifest.num_elements, 'token', short=True)}, "
            f"{counted(int(manifest.extra.get('documents', 0)), 'document')}, "
            f"{counted(len(manifest.all_files()), 'data file')} in {elapsed:.1f} s "
            f"({total / max(elapsed, 1e-9) / 1e6:.1f} MB/s of input)"
        )
    return 0
