"""Writers for stream and document datasets.

They stream their input (one chunk in memory at a time), check that every value fits the stored
dtype (nothing is silently truncated), shard the data files, hash them on the way, and commit the
manifest last, atomically. New data files get fresh names, so a failed or interrupted overwrite
leaves the previous dataset readable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom.storage._format._blocks import BLOCK_BYTES, BlockHasher, make_blocks, sidecar_name
from guideloom.storage._format._manifest import ArraySpec, FileSpec, Manifest, check_field_name, storage_dtype
from guideloom.storage._write._sinks import Sink

__all__ = ["DEFAULT_SHARD_BYTES", "write_documents_to", "write_stream_to"]

DEFAULT_SHARD_BYTES = 256 * 2**20
_WRITE_BLOCK = 8 * 2**20
Array = npt.NDArray[Any]


def _one_array(data: Any) -> Array | None:
    """``data`` as one 1-D array where it is one (a list or tuple of numbers, a 1-D tensor or
    other array-like), else None (an iterable of arrays)."""
    if isinstance(data, (list, tuple)):
        if data and all(np.ndim(x) == 0 for x in data):
            return np.asarray(data)
        return None
    if hasattr(data, "__array__") and not isinstance(data, Iterator):
        whole = np.asarray(data)
        if whole.ndim == 1 and whole.dtype != object:
            return whole
    return None


def _chunks_of(name: str, data: npt.ArrayLike | Iterable[npt.ArrayLike]) -> Iterator[Array]:
    """Accept one array or an iterable of arrays; yield 1-D arrays."""
    if isinstance(data, np.ndarray):
        if data.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {data.shape}")
        yield data
        return
    if isinstance(data, (str, bytes)):
        raise TypeError(
            f"{name} must be a numpy array or an iterable of 1-D arrays, got {type(data).__name__}"
        )
    whole = _one_array(data)
    if whole is not None:  # a list of numbers or a 1-D tensor: one chunk, not chunks of scalars
        yield whole
        return
    try:
        it = iter(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be a numpy array or an iterable of 1-D arrays, got {type(data).__name__}"
        ) from None
    for i, chunk in enumerate(it):
        arr = np.asarray(chunk)
        if arr.ndim != 1:
            raise ValueError(f"{name}: chunk {i} must be 1-D, got shape {arr.shape}")
        yield arr


def _fit(name: str, index: int, chunk: Array, dtype: np.dtype[Any]) -> Array:
    """Cast ``chunk`` to ``dtype`` only if no value changes; else say which dtype would hold it.

    The check compares values, not a cast and its inverse (``int32`` -1 cast to ``uint32`` and
    back is -1 again, numpy calls ``int64`` to ``float64`` a safe cast). Floats given for an
    integer dtype must be whole numbers below ``2**53`` in magnitude (``2**24`` for float32,
    ``2**11`` for float16): beyond, a float stands for several integers (``2**53 + 1`` was
    rounded to ``2**53`` before the writer saw it), so the values cannot be trusted.
    """
    if chunk.dtype == dtype:
        return chunk
    if chunk.dtype.kind not in "biuf":
        raise TypeError(
            f"{name}: chunk {index} has dtype {chunk.dtype}; only numbers and booleans can be stored"
        )
    if chunk.size == 0 or chunk.dtype.kind == "b":  # False and True are 0 and 1 in every dtype
        return chunk.astype(dtype)
    if chunk.dtype.kind == "f" and dtype.kind in "iu":
        _check_whole_floats(name, index, chunk, dtype)
    if not _exact(chunk, dtype):
        lo, hi = chunk.min(), chunk.max()
        raise ValueError(
            f"{name}: chunk {index} holds values in [{lo}, {hi}] that {dtype} cannot represent "
            f"exactly; pass a dtype that holds them (e.g. dtype=np.{_holding(lo, hi, chunk.dtype)})"
        )
    return chunk.astype(dtype)


def _check_whole_floats(name: str, index: int, chunk: Array, dtype: np.dtype[Any]) -> None:
    """Floats for an integer dtype: finite, and below the magnitude where they skip integers."""
    if not np.isfinite(chunk).all():
        raise ValueError(
            f"{name}: chunk {index} holds NaN or infinite values that {dtype} cannot represent "
            f"exactly; pass finite whole numbers"
        )
    bits = np.finfo(chunk.dtype).nmant + 1
    largest = max(-float(chunk.min()), float(chunk.max()))
    if largest >= 2.0**bits:
        raise ValueError(
            f"{name}: chunk {index} is {chunk.dtype} with values as large as {largest:.0f} in "
            f"magnitude, for dtype {dtype}: a {chunk.dtype} holds integers exactly only below "
            f"2**{bits} (2**{bits} + 1 rounds to 2**{bits}), so these may have been rounded already; "
            f"pass an integer array (e.g. np.asarray(values, dtype=np.int64)) instead of floats"
        )


def _exact(chunk: Array, dtype: np.dtype[Any]) -> bool:
    """Whether every value of ``chunk`` (numbers, not bool) has the same value in ``dtype``."""
    src = chunk.dtype
    if np.can_cast(src, dtype, casting="safe") and not (src.kind in "iu" and dtype.kind == "f"):
        return True  # a wider dtype of the same kind (numpy's "safe" also allows int64 to float64)
    if dtype.kind == "b":
        return bool(((chunk == 0) | (chunk == 1)).all())
    if src.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min <= int(chunk.min()) and int(chunk.max()) <= info.max
    if src.kind == "f" and dtype.kind in "iu":  # finite whole-number checks come first
        info = np.iinfo(dtype)
        if not (info.min <= float(chunk.min()) and float(chunk.max()) <= info.max):
            return False
        return bool((np.trunc(chunk) == chunk).all())
    if src.kind in "iu":  # to a float: exact below 2**bits; above, only if the float casts back
        bits = np.finfo(dtype).nmant + 1
        if -(2**bits) <= int(chunk.min()) and int(chunk.max()) <= 2**bits:
            return True
        info = np.iinfo(src)
        with np.errstate(over="ignore"):
            cast = chunk.astype(dtype)
        # casting back is defined only inside the source's range ([-2**63, 2**63) for int64)
        if not (np.isfinite(cast).all() and info.min <= cast.min() and cast.max() < float(info.max) + 1):
            return False
        return bool(np.array_equal(cast.astype(src), chunk))
    # float to float: the round trip tells (a NaN stays a NaN; what overflows is inf)
    with np.errstate(over="ignore"):
        back = chunk.astype(dtype).astype(src)
    return bool(np.array_equal(back, chunk, equal_nan=True))


def _holding(lo: Any, hi: Any, given: np.dtype[Any]) -> str:
    """The smallest storable dtype that holds ``[lo, hi]`` (floats stay floats)."""
    if given.kind == "f" and not (float(lo).is_integer() and float(hi).is_integer()):
        return "float64"
    for name in ("uint8", "uint16", "uint32", "uint64") if lo >= 0 else ("int8", "int16", "int32", "int64"):
        info = np.iinfo(name)
        if info.min <= lo and hi <= info.max:
            return name
    return "float64"


class _ArrayWriter:
    """Appends chunks of one array into shard files, hashing as it goes."""

    def __init__(
        self, sink: Sink, name: str, dtype: np.dtype[Any], shard_bytes: int, written: list[str]
    ) -> None:
        self.sink, self.name, self.dtype = sink, name, dtype
        self.shard_elements = max(1, shard_bytes // dtype.itemsize)
        self.files: list[FileSpec] = []
        self._written = written
        self._fh: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._blocks = BlockHasher(BLOCK_BYTES)
        self._count = 0
        self._path = ""

    def _roll(self) -> None:
        self._finish_file()
        self._path = f"{self.name}-{self.sink.write_id}-{len(self.files):05d}.bin"
        self._written.append(self._path)
        self._fh = self.sink.open_file(self._path)
        self._hash = hashlib.sha256()
        self._blocks = BlockHasher(BLOCK_BYTES)
        self._count = 0

    def _finish_file(self) -> None:
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        blocks, sidecar = make_blocks(self._blocks.digests(), BLOCK_BYTES, sidecar_name(self._path))
        if sidecar is not None:
            self._written.append(sidecar_name(self._path))
            with self.sink.open_file(sidecar_name(self._path)) as fh:
                fh.write(sidecar)
        nbytes = self._count * self.dtype.itemsize
        self.files.append(FileSpec(self._path, self._count, nbytes, self._hash.hexdigest(), blocks=blocks))

    def append(self, chunk: Array) -> None:
        data = np.ascontiguousarray(chunk, dtype=self.dtype)
        pos = 0
        while pos < len(data):
            if self._fh is None or self._count == self.shard_elements:
                self._roll()
            assert self._fh is not None
            take = min(
                len(data) - pos, self.shard_elements - self._count, _WRITE_BLOCK // self.dtype.itemsize
            )
            view = data[pos : pos + take].data.cast("B")
            self._fh.write(view)
            self._hash.update(view)
            self._blocks.update(view)
            self._count += take
            pos += take

    def cut(self) -> None:
        """End the current file: the next element starts a new one."""
        self._finish_file()

    def discard(self) -> None:
        """Close the open file of a write that failed (the sink removes the files)."""
        if self._fh is not None:
            self.sink.discard_file(self._fh)  # an upload is dropped, not completed
            self._fh = None

    def finish(self) -> ArraySpec:
        if self._fh is None and not self.files:
            self._roll()  # an empty array still gets one (empty) file
        self._finish_file()
        return ArraySpec(dtype=self.dtype, files=tuple(self.files))


def _write_array(
    sink: Sink, name: str, data: Any, dtype: Any, shard_bytes: int, written: list[str], progress: Any = None
) -> ArraySpec:
    chunks = _chunks_of(name, data)
    first = next(chunks, None)
    target = storage_dtype(dtype if dtype is not None else (first.dtype if first is not None else np.int64))
    writer = _ArrayWriter(sink, name, target, shard_bytes, written)
    try:
        return _append_all(writer, name, first, chunks, target, progress)
    except BaseException:
        writer.discard()
        raise


def _append_all(
    writer: _ArrayWriter,
    name: str,
    first: Array | None,
    chunks: Iterator[Array],
    target: np.dtype[Any],
    progress: Any,
) -> ArraySpec:
    if first is not None:
        writer.append(_fit(name, 0, first, target))
        if progress is not None:
            progress(len(first))
        for i, chunk in enumerate(chunks, start=1):
            writer.append(_fit(name, i, chunk, target))
            if progress is not None:
                progress(len(chunk))
    return writer.finish()


def _check_shard_bytes(shard_bytes: int) -> int:
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    return shard_bytes


def write_stream_to(
    sink: Sink,
    chunks: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    dtype: Any = None,
    metadata: Mapping[str, npt.ArrayLike | Iterable[npt.ArrayLike]] | None = None,
    metadata_dtypes: Mapping[str, Any] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
    progress: Any = None,
) -> Manifest:
    """Write a stream dataset to ``sink``; see :func:`guideloom.write_stream`."""
    _check_shard_bytes(shard_bytes)
    metadata = dict(metadata or {})
    for name in metadata:
        if name == "tokens":
            raise ValueError('metadata cannot use the field name "tokens"')
        check_field_name(name)
    replaced = sink.prepare(overwrite=overwrite)
    written: list[str] = []
    try:
        fields = {"tokens": _write_array(sink, "tokens", chunks, dtype, shard_bytes, written, progress)}
        for name, data in metadata.items():
            spec = _write_array(sink, name, data, (metadata_dtypes or {}).get(name), shard_bytes, written)
            if spec.length != fields["tokens"].length:
                raise ValueError(
                    f"metadata[{name!r}] has {plural(spec.length, 'element')} but the stream has "
                    f"{fields['tokens'].length}; every metadata field must be as long as the stream"
                )
            fields[name] = spec
        manifest = Manifest(kind="stream", fields=fields, extra=dict(info or {}))
        sink.commit(manifest, replaced)
    except BaseException:
        sink.abort(written)
        raise
    return manifest


def write_documents_to(
    sink: Sink,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: Any = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
    progress: Any = None,
    offsets_head: bool = False,
) -> Manifest:
    """Write a document dataset to ``sink``; see :func:`guideloom.write_documents`.

    ``offsets_head``: the first offset (0) goes in a file of its own, so that a merge of
    prepared parts can name each part's other offset files as they are (``prepare --tasks``).
    """
    _check_shard_bytes(shard_bytes)
    if _one_array(documents) is not None:
        raise TypeError(
            "documents must be an iterable of 1-D arrays (one per document), not one 1-D array; "
            "wrap a single document in a list"
        )
    replaced = sink.prepare(overwrite=overwrite)
    written: list[str] = []
    offsets_writer = _ArrayWriter(sink, "offsets", np.dtype("<i8"), shard_bytes, written)
    pending: list[int] = [0]
    if offsets_head:
        offsets_writer.append(np.zeros(1, dtype=np.int64))
        offsets_writer.cut()
        pending.clear()
    state = {"end": 0, "count": 0}

    def counted() -> Iterator[Array]:
        for doc in _chunks_of("documents", documents):
            state["end"] += len(doc)
            state["count"] += 1
            pending.append(state["end"])
            if len(pending) >= 65536:  # offsets go out in blocks: memory stays bounded
                offsets_writer.append(np.asarray(pending, dtype=np.int64))
                pending.clear()
            yield doc

    try:
        tokens = _write_array(sink, "tokens", counted(), dtype, shard_bytes, written, progress)
        offsets_writer.append(np.asarray(pending, dtype=np.int64))
        offsets_spec = offsets_writer.finish()
        manifest = Manifest(
            kind="documents",
            fields={"tokens": tokens},
            offsets=offsets_spec,
            num_documents=state["count"],
            extra=dict(info or {}),
        )
        sink.commit(manifest, replaced)
    except BaseException:
        offsets_writer.discard()
        sink.abort(written)
        raise
    return manifest
