"""The guideloom internals that benchmarks measure on purpose, in one place.

Every other import of a benchmark goes through the public face (``guideloom``'s ``__all__``,
``python -m guideloom``). What a benchmark measures beneath it (the order's shuffle quality, a
packing layout, the mixture schedule, the manifest reader under fuzzing, a writer's block size,
the store the remote reads go through) it imports from here, one name a line with why, so that
a rename inside guideloom fails ``tests/test_benchmarks_internals.py`` (which imports this
module) rather than a benchmark run later, and this file is the one place to fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# The file layout of ``prepare --task``'s parts, and the merge timed without the CLI's start.
from guideloom._cli._parts import merge_parts, part_folder, part_options

# The orders a loader reads in: the baselines follow the loader's own shuffled order (the same
# samples for every loader), and shuffle_quality measures the orders themselves.
from guideloom._core.group_order import GroupPermutation  # Parquet's row-group order (quality)
from guideloom._core.mixture import Layout  # the mixture schedule's prefix error
from guideloom._core.order import (
    DEFAULT_WINDOW,  # blocks per mixing window by default (quality)
    BlockPermutation,  # the order over storage blocks (quality)
    default_block_size,  # the block size "auto" picks (quality)
)
from guideloom._core.pack_layout import best_fit_layout  # packing's padding over a whole dataset
from guideloom._core.plan import Permutation  # the loader's global order, which the baselines follow

# Process-wide memory of the block checks made: forgotten so an epoch reads as a new process's.
from guideloom._process import reset as forget_block_checks
from guideloom._runtime.processes.pool import WorkerPool

# The manifest reader and its types, which fuzz_manifest feeds generated and mutated manifests.
from guideloom.storage._format._manifest import (
    MANIFEST_NAME,
    SUPPORTED_DTYPES,
    ArraySpec,
    FileSpec,
    Kind,
    Manifest,
    parse_manifest,
    storage_dtype,
)
from guideloom.storage._parquet._tokens import TOKENIZE_BYTES  # a packed loader's calls (pss-tok)
from guideloom.storage._remote._held import HeldBlocks

# The store guideloom's remote reads go through, which first_batch times with bare range GETs.
from guideloom.storage._remote._locations import parse_location
from guideloom.storage._remote._objstore import make_store
from guideloom.storage._remote._options import split_options

# The writer's verification block size (a module global), which integrity varies.
from guideloom.storage._write import _writer

DEFAULT_BLOCK_BYTES: int = _writer.BLOCK_BYTES  # fails at import if the writer's knob moves


@contextlib.contextmanager
def written_block_bytes(block: int) -> Iterator[None]:
    """Datasets written inside the block write digests over ``block`` bytes (not the default)."""
    _writer.BLOCK_BYTES = block  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _writer.BLOCK_BYTES = DEFAULT_BLOCK_BYTES  # type: ignore[attr-defined]


def held_blocks(storage: Any) -> HeldBlocks:
    """The verified blocks a remote storage holds for the later reads of a mixing window:
    remote_stream reports their peak against the storage's ``read_window_bytes``."""
    held: HeldBlocks = storage._remote.fetcher.held
    return held


def copies_whole(storage: Any) -> bool:
    """Whether a remote storage was opened with ``cache_dir`` (the whole copy made as it reads):
    remote_cache waits for the copy before the epoch it times over it."""
    return getattr(storage, "_cache", None) is not None


def worker_pool(loader: Any) -> WorkerPool | None:
    """An open process-worker loader's pool (None before it starts one, and for thread workers):
    worker_start reads its workers' pids, and whether they are still starting."""
    pool: WorkerPool | None = loader._state.life.pool
    return pool


__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_WINDOW",
    "MANIFEST_NAME",
    "TOKENIZE_BYTES",
    "SUPPORTED_DTYPES",
    "ArraySpec",
    "BlockPermutation",
    "FileSpec",
    "GroupPermutation",
    "HeldBlocks",
    "Kind",
    "Layout",
    "Manifest",
    "Permutation",
    "WorkerPool",
    "best_fit_layout",
    "copies_whole",
    "default_block_size",
    "forget_block_checks",
    "held_blocks",
    "make_store",
    "merge_parts",
    "parse_location",
    "parse_manifest",
    "part_folder",
    "part_options",
    "split_options",
    "storage_dtype",
    "worker_pool",
    "written_block_bytes",
]
