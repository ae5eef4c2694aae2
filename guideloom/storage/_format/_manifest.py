"""The on-disk dataset format: a JSON manifest and raw little-endian data files.

A dataset is a folder (or an object prefix) holding ``manifest.json`` and the data files it
names by relative path. Each *array* (the token stream, each metadata field, the document
offsets) is stored as one or more shard files of raw little-endian elements. The manifest is
written last and atomically, so a folder without one is an interrupted write, never a dataset.

It builds, serialises and checks manifests. :func:`parse_manifest` is the one way bytes become a
:class:`Manifest` (local, remote and cached datasets alike): every problem, however the bytes are
damaged, is a :class:`DatasetFormatError` naming the file. The one function that touches a file,
:func:`read_manifest_file`, reads at most :data:`MAX_MANIFEST_BYTES` + 1 bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeGuard

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError
from guideloom.storage._format._blocks import BlockDigests, parse_blocks

__all__ = [
    "CHECKSUM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSION_BASES",
    "MANIFEST_NAME",
    "MAX_INFO_DEPTH",
    "MAX_MANIFEST_BYTES",
    "SUPPORTED_DTYPES",
    "ArraySpec",
    "FileSpec",
    "Manifest",
    "add_bases",
    "check_field_name",
    "parse_manifest",
    "read_manifest_file",
    "storage_dtype",
]

FORMAT_NAME: Final = "guideloom-dataset"
FORMAT_VERSION: Final = 1
FORMAT_VERSION_BASES: Final = 2
"""The version of a manifest whose files carry a ``base`` (a merge of prepared parts): older
readers, which would read the stored values without it, refuse it rather than misread it."""
READ_VERSIONS: Final = (FORMAT_VERSION, FORMAT_VERSION_BASES)
MANIFEST_NAME: Final = "manifest.json"
CHECKSUM: Final = "sha256"
MAX_MANIFEST_BYTES: Final = 64 * 2**20
"""The largest manifest read or parsed. A manifest holds ~200 bytes per shard file, so this is
room for ~300,000 shards; anything larger is damage or not a manifest, and is refused before it
is read whole or parsed (parsed JSON takes several times its size in memory)."""
MAX_INFO_DEPTH: Final = 64
"""The deepest nesting of objects and lists in ``info``: deeper JSON could not be written back
(a cache copy re-serialises the manifest) without risking the interpreter's recursion limit."""
_MAX_INT: Final = 2**63 - 1  # element and byte counts: what a file offset (int64) can hold
SUPPORTED_DTYPES: Final = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
)
_FIELD_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,99}$")
Kind = Literal["stream", "documents"]


def storage_dtype(dtype: Any) -> np.dtype[Any]:
    """The canonical little-endian dtype for ``dtype``, or a ``TypeError`` naming the choices."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:  # numpy parses some strings as Python syntax
        raise TypeError(f"unknown dtype {_show(dtype)}; use one of {', '.join(SUPPORTED_DTYPES)}") from exc
    if dt.name not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dt} cannot be stored; use one of {', '.join(SUPPORTED_DTYPES)}")
    little: np.dtype[Any] = dt.newbyteorder("<")
    return little


def check_field_name(name: str) -> str:
    if not isinstance(name, str) or not _FIELD_RE.match(name):
        raise ValueError(
            f"field name {_show(name)} is not allowed: use letters, digits, '_', '.' or '-', "
            "starting with a letter or '_' (at most 100 characters)"
        )
    return name


def _show(value: Any) -> str:
    """``repr(value)``, cut short: a damaged manifest can hold megabytes where a name belongs."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _has_surrogates(text: str) -> bool:
    """JSON can spell lone surrogates (``"\\ud800"``), which no file system path can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _safe_relpath(path: Any, *, where: str) -> str:
    """Refuse names that could escape the dataset folder."""
    if not isinstance(path, str) or not path:
        raise DatasetFormatError(f"{where}: file path must be a non-empty string, got {_show(path)}")
    norm = posixpath.normpath(path)
    if (
        path.startswith(("/", "\\"))
        or "\\" in path
        or norm != path
        or norm == ".."
        or norm.startswith("../")
        or ":" in path
        or "\x00" in path
        or not path.isprintable()
        or _has_surrogates(path)
    ):
        raise DatasetFormatError(
            f"{where}: file path {_show(path)} is not a plain relative path inside the dataset folder"
        )
    return path


@dataclass(frozen=True, slots=True)
class FileSpec:
    """One shard file of an array."""

    path: str
    elements: int
    nbytes: int
    sha256: str
    base: int = 0
    """Added to every stored value when it is read (integer arrays only): a merge of prepared
    parts references each part's document offsets and ``doc_id`` files as they are, their values
    counted from the part's start, and says here where the part starts."""
    blocks: BlockDigests | None = None
    """The digest of each block of the file (see :mod:`guideloom.storage._format._blocks`); None for a
    dataset written without them."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "elements": self.elements,
            "bytes": self.nbytes,
            "sha256": self.sha256,
        }
        if self.base:
            out["base"] = self.base
        if self.blocks is not None:
            out["blocks"] = self.blocks.to_json()
        return out

    def moved(self, prefix: str, base: int = 0) -> FileSpec:
        """This file as a dataset that holds it under ``prefix`` names it, its values shifted by ``base``."""
        blocks = None if self.blocks is None else self.blocks.moved(prefix)
        return FileSpec(
            f"{prefix}/{self.path}", self.elements, self.nbytes, self.sha256, self.base + base, blocks
        )


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """A 1-D array stored as consecutive shard files."""

    dtype: np.dtype[Any]
    files: tuple[FileSpec, ...]

    @property
    def length(self) -> int:
        return sum(f.elements for f in self.files)

    @property
    def has_bases(self) -> bool:
        return any(f.base for f in self.files)

    def bases(self) -> Bases | None:
        """``(bounds, bases)`` of the non-empty files when any has a base, else None: element
        ``i`` of the array is its stored value plus ``bases[k]``, ``k`` the file whose
        ``[bounds[k], bounds[k+1])`` holds ``i`` (see :func:`add_bases`)."""
        if not self.has_bases:
            return None
        files = [f for f in self.files if f.elements]
        bounds = np.cumsum([0, *(f.elements for f in files)], dtype=np.int64)
        return bounds, np.asarray([f.base for f in files], dtype=np.int64)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype.name, "files": [f.to_json() for f in self.files]}


Bases = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def add_bases(
    values: npt.NDArray[Any], positions: npt.NDArray[np.int64], bases: Bases | None
) -> npt.NDArray[Any]:
    """``values`` read at ``positions`` (any shape, the same), with their files' bases added in
    place (see :meth:`ArraySpec.bases`); ``values`` unchanged when there are none."""
    if bases is None or not values.size:
        return values
    bounds, per_file = bases
    shard = np.searchsorted(bounds, positions, side="right") - 1
    shard = np.clip(shard, 0, len(per_file) - 1)
    values += per_file[shard].astype(values.dtype, copy=False)
    return values


@dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed, self-consistent manifest."""

    kind: Kind
    fields: dict[str, ArraySpec]
    """``"tokens"`` first, then metadata fields in the order they were written."""
    offsets: ArraySpec | None = None
    """Documents only: ``num_documents + 1`` int64 offsets into ``tokens``."""
    num_documents: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form user information (``info=`` on the writers), kept as written."""

    @property
    def tokens(self) -> ArraySpec:
        return self.fields["tokens"]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.tokens.dtype

    @property
    def num_elements(self) -> int:
        return self.tokens.length

    def all_files(self) -> list[tuple[str, ArraySpec, FileSpec]]:
        out = [(name, spec, f) for name, spec in self.fields.items() for f in spec.files]
        if self.offsets is not None:
            out += [("offsets", self.offsets, f) for f in self.offsets.files]
        return out

    def sidecars(self) -> list[str]:
        """The block digests files its data files name (beside them)."""
        return [f.blocks.sidecar for _, _, f in self.all_files() if f.blocks and f.blocks.sidecar]

    def stored_paths(self) -> set[str]:
        """Every file the manifest names: data files and their block digests files."""
        return {f.path for _, _, f in self.all_files()} | set(self.sidecars())

    @property
    def has_blocks(self) -> bool:
        """Whether every data file carries block digests."""
        return all(f.blocks is not None for _, _, f in self.all_files())

    def digest(self) -> str:
        """A short digest of the dataset's content: its kind, dtype, fields, and every data
        file's length and checksum in order (not its name, which each write draws afresh), so the
        same data written twice, or copied to a bucket, has the same digest."""
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.kind}:{self.dtype.name}:{self.num_elements}:{self.num_documents}".encode())
        for name, spec, f in self.all_files():
            h.update(f"\n{name}:{spec.dtype.name}:{f.elements}:{f.sha256}".encode())
            if f.base:
                h.update(f"+{f.base}".encode())
        return h.hexdigest()

    def to_json_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION_BASES
            if any(f.base for _, _, f in self.all_files())
            else FORMAT_VERSION,
            "kind": self.kind,
            "dtype": self.dtype.name,
            "num_elements": self.num_elements,
            "checksum": CHECKSUM,
            "fields": {name: spec.to_json() for name, spec in self.fields.items()},
        }
        if self.kind == "documents":
            assert self.offsets is not None
            doc["num_documents"] = self.num_documents
            doc["offsets"] = self.offsets.to_json()
        if self.extra:
            doc["info"] = self.extra
        return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode()

    @staticmethod
    def from_json_bytes(data: bytes, *, source: str) -> Manifest:
        """``parse_manifest(data, f"{source}/manifest.json")``: ``source`` is the dataset's folder or URL."""
        return parse_manifest(data, f"{source}/{MANIFEST_NAME}")


def _parse_array(raw: Any, *, where: str, version: int | None = FORMAT_VERSION) -> ArraySpec:
    if not isinstance(raw, dict):
        raise DatasetFormatError(f"{where} must be an object with 'dtype' and 'files'")
    name = raw.get("dtype")
    try:
        if not isinstance(name, str) or len(name) > 32:
            raise TypeError(f"dtype must be a name such as 'uint16', got {_show(name)}")
        dtype = storage_dtype(name)
    except TypeError as exc:
        raise DatasetFormatError(f"{where}: {exc}") from None
    files_raw = raw.get("files")
    if not isinstance(files_raw, list):
        raise DatasetFormatError(f"{where}: 'files' must be a list")
    files = []
    for i, f in enumerate(files_raw):
        fw = f"{where} files[{i}]"
        if not isinstance(f, dict):
            raise DatasetFormatError(f"{fw} must be an object")
        path = _safe_relpath(f.get("path"), where=fw)
        elements, nbytes, digest = f.get("elements"), f.get("bytes"), f.get("sha256")
        if not (_is_count(elements) and _is_count(nbytes)):
            raise DatasetFormatError(f"{fw}: 'elements' and 'bytes' must be integers >= 0 (and < 2**63)")
        if nbytes != elements * dtype.itemsize:
            raise DatasetFormatError(
                f"{fw}: {plural(elements, 'element')} of {dtype} need "
                f"{plural(elements * dtype.itemsize, 'byte')}, "
                f"the manifest says {nbytes}"
            )
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise DatasetFormatError(f"{fw}: 'sha256' must be 64 lowercase hex digits")
        base = f.get("base", 0)
        if not _is_count(base) or (base and dtype.kind not in "iu"):
            raise DatasetFormatError(f"{fw}: 'base' must be an integer >= 0 (< 2**63), of an integer array")
        if base and (version or 0) < FORMAT_VERSION_BASES:
            raise DatasetFormatError(
                f"{fw}: 'base' needs format_version {FORMAT_VERSION_BASES}; the manifest says {version}"
            )
        blocks = parse_blocks(f.get("blocks"), nbytes, where=fw, path=path)
        files.append(
            FileSpec(path=path, elements=elements, nbytes=nbytes, sha256=digest, base=base, blocks=blocks)
        )
    return ArraySpec(dtype=dtype, files=tuple(files))


def _is_count(value: Any) -> TypeGuard[int]:
    """An element or byte count: an int (not a bool) that a file offset (int64) can hold."""
    return type(value) is int and 0 <= value <= _MAX_INT


def _check_depth(value: Any, *, where: str) -> None:
    """Refuse ``info`` nested deeper than :data:`MAX_INFO_DEPTH` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth >= MAX_INFO_DEPTH:
                    raise DatasetFormatError(f"{where}: 'info' is nested deeper than {MAX_INFO_DEPTH} levels")
                stack.append((child, depth + 1))


def _too_large(where: str, size: int) -> DatasetFormatError:
    return DatasetFormatError(
        f"{where} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may hold: "
        "it is not a guideloom manifest, or it is damaged"
    )


def read_manifest_file(path: str | os.PathLike[str]) -> bytes:
    """A local manifest's bytes, refused unread when larger than :data:`MAX_MANIFEST_BYTES`.

    ``FileNotFoundError`` when it does not exist (the caller says what that means). At most
    ``MAX_MANIFEST_BYTES + 1`` bytes are read, so a file that grows meanwhile is refused too.
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= MAX_MANIFEST_BYTES:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
            if len(data) <= MAX_MANIFEST_BYTES:
                return data
            size = len(data)
    raise _too_large(os.fspath(path), size)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and check a manifest's bytes; every problem is a :class:`DatasetFormatError`.

    ``where`` names the file in messages (a path or URL). The local and the remote readers both
    call it on the bytes they got, so the size bound and every check hold for both.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise _too_large(where, len(data))
    try:
        doc = json.loads(data)
    except RecursionError:
        raise DatasetFormatError(
            f"{where} is not a guideloom manifest: its JSON is nested too deeply"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"{where} is not valid JSON: {exc}") from None
    except ValueError:  # int() refuses over 4300 digits (CPython's guard against quadratic parsing)
        raise DatasetFormatError(
            f"{where} is not a guideloom manifest: it holds an integer of thousands of digits"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise DatasetFormatError(f"{where} is not a guideloom dataset manifest")
    version = doc.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise DatasetFormatError(
            f"{where} has format_version {_show(version)}; this guideloom reads versions "
            f"{FORMAT_VERSION} and {FORMAT_VERSION_BASES} (upgrade guideloom to read newer datasets)"
        )
    kind = doc.get("kind")
    if kind not in ("stream", "documents"):
        raise DatasetFormatError(f"{where}: kind must be 'stream' or 'documents', got {_show(kind)}")
    raw_fields = doc.get("fields")
    if not isinstance(raw_fields, dict) or "tokens" not in raw_fields:
        raise DatasetFormatError(f"{where}: 'fields' must be an object with a 'tokens' entry")
    fields = {"tokens": _parse_array(raw_fields["tokens"], where=f"{where} fields.tokens", version=version)}
    for name, raw in raw_fields.items():
        if name == "tokens":
            continue
        try:
            check_field_name(name)
        except ValueError as exc:
            raise DatasetFormatError(f"{where}: {exc}") from None
        fields[name] = _parse_array(raw, where=f"{where} fields.{name}", version=version)
    if fields["tokens"].has_bases:
        raise DatasetFormatError(f"{where}: fields.tokens: token files carry no 'base'")
    length = fields["tokens"].length
    num_elements = doc.get("num_elements")
    if type(num_elements) is not int or num_elements != length:
        raise DatasetFormatError(
            f"{where}: num_elements {_show(num_elements)} does not match the "
            f"{plural(length, 'element')} its token files hold"
        )
    if doc.get("dtype") != fields["tokens"].dtype.name:
        raise DatasetFormatError(f"{where}: dtype {_show(doc.get('dtype'))} does not match fields.tokens")
    offsets = None
    num_documents = 0
    if kind == "stream":
        for name, spec in fields.items():
            if spec.length != length:
                raise DatasetFormatError(
                    f"{where}: field {name!r} holds {plural(spec.length, 'element')} but the stream holds "
                    f"{length}"
                )
    else:
        if len(fields) != 1:
            raise DatasetFormatError(f"{where}: document datasets have only a 'tokens' field")
        offsets = _parse_array(doc.get("offsets"), where=f"{where} offsets", version=version)
        num_documents = doc.get("num_documents")  # type: ignore[assignment]
        if not _is_count(num_documents):
            raise DatasetFormatError(f"{where}: num_documents must be an integer >= 0 (and < 2**63)")
        if offsets.dtype != np.dtype("<i8") or offsets.length != num_documents + 1:
            raise DatasetFormatError(
                f"{where}: offsets must be {num_documents + 1} int64 values, got "
                f"{offsets.length} of {offsets.dtype}"
            )
    seen: set[str] = set()
    for spec in [*fields.values(), *([offsets] if offsets else [])]:
        for f in spec.files:
            names = [f.path] + ([f.blocks.sidecar] if f.blocks and f.blocks.sidecar else [])
            for name in names:
                if name == MANIFEST_NAME or name in seen:
                    raise DatasetFormatError(f"{where}: file {name!r} is named twice")
                seen.add(name)
    extra = doc.get("info") or {}
    if not isinstance(extra, dict):
        raise DatasetFormatError(f"{where}: 'info' must be an object")
    _check_depth(extra, where=where)
    return Manifest(kind=kind, fields=fields, offsets=offsets, num_documents=num_documents, extra=extra)
