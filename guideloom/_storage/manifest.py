"""The on-disk dataset format: a JSON manifest and raw little-endian data files.

A dataset is a folder (or an object prefix) holding ``manifest.json`` and the data files it
names by relative path. Each *array* (the token stream, each metadata field, the document
offsets) is stored as one or more shard files of raw little-endian elements. The manifest is
written last and atomically, so a folder without one is an interrupted write, never a dataset.

This module is pure: it builds, serialises and checks manifests, and touches no files.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

from .._errors import DatasetFormatError

__all__ = [
    "CHECKSUM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SUPPORTED_DTYPES",
    "ArraySpec",
    "FileSpec",
    "Manifest",
    "check_field_name",
    "storage_dtype",
]

FORMAT_NAME: Final = "guideloom-dataset"
FORMAT_VERSION: Final = 1
MANIFEST_NAME: Final = "manifest.json"
CHECKSUM: Final = "sha256"
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
    except TypeError as exc:
        raise TypeError(f"unknown dtype {dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}") from exc
    if dt.name not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dt} cannot be stored; use one of {', '.join(SUPPORTED_DTYPES)}")
    little: np.dtype[Any] = dt.newbyteorder("<")
    return little


def check_field_name(name: str) -> str:
    if not isinstance(name, str) or not _FIELD_RE.match(name):
        raise ValueError(
            f"field name {name!r} is not allowed: use letters, digits, '_', '.' or '-', "
            "starting with a letter or '_' (at most 100 characters)"
        )
    return name


def _safe_relpath(path: Any, *, where: str) -> str:
    """Refuse names that could escape the dataset folder."""
    if not isinstance(path, str) or not path:
        raise DatasetFormatError(f"{where}: file path must be a non-empty string, got {path!r}")
    norm = posixpath.normpath(path)
    if (
        path.startswith(("/", "\\"))
        or "\\" in path
        or norm != path
        or norm == ".."
        or norm.startswith("../")
        or ":" in path
        or "\x00" in path
    ):
        raise DatasetFormatError(
            f"{where}: file path {path!r} is not a plain relative path inside the dataset folder"
        )
    return path


@dataclass(frozen=True, slots=True)
class FileSpec:
    """One shard file of an array."""

    path: str
    elements: int
    nbytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "elements": self.elements, "bytes": self.nbytes, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """A 1-D array stored as consecutive shard files."""

    dtype: np.dtype[Any]
    files: tuple[FileSpec, ...]

    @property
    def length(self) -> int:
        return sum(f.elements for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype.name, "files": [f.to_json() for f in self.files]}


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

    def to_json_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
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
        """Parse and check a manifest; every problem is a :class:`DatasetFormatError`."""
        where = f"{source}/{MANIFEST_NAME}"
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetFormatError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise DatasetFormatError(f"{where} is not a guideloom dataset manifest")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise DatasetFormatError(
                f"{where} has format_version {version!r}; this guideloom reads version "
                f"{FORMAT_VERSION} (upgrade guideloom to read newer datasets)"
            )
        kind = doc.get("kind")
        if kind not in ("stream", "documents"):
            raise DatasetFormatError(f"{where}: kind must be 'stream' or 'documents', got {kind!r}")
        raw_fields = doc.get("fields")
        if not isinstance(raw_fields, dict) or "tokens" not in raw_fields:
            raise DatasetFormatError(f"{where}: 'fields' must be an object with a 'tokens' entry")
        fields = {"tokens": _parse_array(raw_fields["tokens"], where=f"{where} fields.tokens")}
        for name, raw in raw_fields.items():
            if name == "tokens":
                continue
            try:
                check_field_name(name)
            except ValueError as exc:
                raise DatasetFormatError(f"{where}: {exc}") from None
            fields[name] = _parse_array(raw, where=f"{where} fields.{name}")
        length = fields["tokens"].length
        if doc.get("num_elements") != length:
            raise DatasetFormatError(
                f"{where}: num_elements {doc.get('num_elements')!r} does not match the "
                f"{length} elements its token files hold"
            )
        if doc.get("dtype") != fields["tokens"].dtype.name:
            raise DatasetFormatError(f"{where}: dtype {doc.get('dtype')!r} does not match fields.tokens")
        offsets = None
        num_documents = 0
        if kind == "stream":
            for name, spec in fields.items():
                if spec.length != length:
                    raise DatasetFormatError(
                        f"{where}: field {name!r} holds {spec.length} elements but the stream holds {length}"
                    )
        else:
            if len(fields) != 1:
                raise DatasetFormatError(f"{where}: document datasets have only a 'tokens' field")
            offsets = _parse_array(doc.get("offsets"), where=f"{where} offsets")
            num_documents = doc.get("num_documents")  # type: ignore[assignment]
            if not isinstance(num_documents, int) or num_documents < 0:
                raise DatasetFormatError(f"{where}: num_documents must be an integer >= 0")
            if offsets.dtype != np.dtype("<i8") or offsets.length != num_documents + 1:
                raise DatasetFormatError(
                    f"{where}: offsets must be {num_documents + 1} int64 values, got "
                    f"{offsets.length} of {offsets.dtype}"
                )
        seen: set[str] = set()
        for spec in [*fields.values(), *([offsets] if offsets else [])]:
            for f in spec.files:
                if f.path == MANIFEST_NAME or f.path in seen:
                    raise DatasetFormatError(f"{where}: file {f.path!r} is named twice")
                seen.add(f.path)
        extra = doc.get("info") or {}
        if not isinstance(extra, dict):
            raise DatasetFormatError(f"{where}: 'info' must be an object")
        return Manifest(kind=kind, fields=fields, offsets=offsets, num_documents=num_documents, extra=extra)


def _parse_array(raw: Any, *, where: str) -> ArraySpec:
    if not isinstance(raw, dict):
        raise DatasetFormatError(f"{where} must be an object with 'dtype' and 'files'")
    try:
        dtype = storage_dtype(raw.get("dtype"))
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
        if not (isinstance(elements, int) and elements >= 0 and isinstance(nbytes, int)):
            raise DatasetFormatError(f"{fw}: 'elements' and 'bytes' must be integers >= 0")
        if nbytes != elements * dtype.itemsize:
            raise DatasetFormatError(
                f"{fw}: {elements} elements of {dtype} need {elements * dtype.itemsize} bytes, "
                f"the manifest says {nbytes}"
            )
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise DatasetFormatError(f"{fw}: 'sha256' must be 64 lowercase hex digits")
        files.append(FileSpec(path=path, elements=elements, nbytes=nbytes, sha256=digest))
    return ArraySpec(dtype=dtype, files=tuple(files))
