"""The public face of the Ray datasink: importing guideloom does not import Ray."""

from __future__ import annotations

from typing import Any

from guideloom.storage._format._manifest import Manifest
from guideloom.storage._write._writer import DEFAULT_SHARD_BYTES

__all__ = ["ray_datasink", "write_ray_dataset"]


def ray_datasink(
    destination: str,
    *,
    dtype: Any,
    column: str = "tokens",
    kind: str = "stream",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
) -> Any:
    """A ``ray.data.Datasink`` that writes a guideloom dataset (needs ``guideloom[ray]``).

    Each write task writes a part under ``destination/parts/``; when all are done, one manifest
    names the parts' files where they are (nothing is copied), in the write tasks' order: the
    dataset's order when Ray Data preserves it
    (``DataContext.get_current().execution_options.preserve_order = True``). ``column`` holds
    each row's token ids; ``kind="stream"`` concatenates the rows, ``"documents"`` keeps one
    sample per row. After ``dataset.write_datasink(sink)``, ``sink.manifest`` is the manifest.
    """
    from guideloom.storage._write._raysink import GuideloomDatasink

    return GuideloomDatasink(
        destination,
        dtype=dtype,
        column=column,
        kind=kind,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        info=info,
    )


def write_ray_dataset(
    dataset: Any,
    destination: str,
    *,
    dtype: Any,
    column: str = "tokens",
    kind: str = "stream",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
) -> Manifest:
    """Write a ``ray.data.Dataset`` of token ids as a guideloom dataset; see :func:`ray_datasink`."""
    sink = ray_datasink(
        destination,
        dtype=dtype,
        column=column,
        kind=kind,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        info=info,
    )
    dataset.write_datasink(sink)
    manifest: Manifest = sink.manifest
    return manifest
