"""The files of a local dataset checked against its manifest: none missing, outside the folder
or of the wrong size, and (for a small dataset) each matching its checksum; the manifest read
and checked."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

from guideloom._core.text import plural
from guideloom._errors import DatasetIntegrityError
from guideloom._process import remembered
from guideloom.storage._format._blocks import identity
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, read_manifest_file

__all__ = ["check_local_files", "check_sha256", "file_sha256", "read_local_manifest"]


def file_sha256(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """The hex sha256 of a file, read in 8 MiB blocks (``progress`` gets each block's size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 * 2**20):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def read_local_manifest(folder: Path) -> Manifest:
    """Read and check ``folder``'s manifest and its files' sizes (no data is read)."""
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise FileNotFoundError(f"no dataset at {str(folder)!r}: the folder does not exist")
    try:
        data = read_manifest_file(path)  # bounded: a huge file is refused unread
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no dataset at {str(folder)!r}: it has no {MANIFEST_NAME} (an unfinished or "
            "interrupted write leaves none; write the dataset again)"
        ) from None
    manifest = Manifest.from_json_bytes(data, source=str(folder))
    check_local_files(folder, manifest)
    return manifest


#: A dataset whose data files hold at most this many bytes in all has every file's checksum
#: checked when it is opened (~40 ms for 64 MiB, once per file and process): a file damaged in
#: place, its size unchanged, is refused rather than read as garbage. A larger dataset is checked
#: by its files' sizes, and in full by ``guideloom verify`` (``verify_dataset``).
VERIFY_ON_OPEN_BYTES = 64 * 2**20
#: Files whose checksum matched, by path and identity (:func:`identity`): each is hashed once
#: per process while it is unchanged.
_VERIFIED: MutableMapping[tuple[str, tuple[int, int, int, int, int]], str] = remembered(1 << 16)


def check_local_files(folder: Path, manifest: Manifest) -> None:
    """Refuse a manifest whose files are missing, outside the folder, or of the wrong size, and
    (for a dataset of at most :data:`VERIFY_ON_OPEN_BYTES`) whose bytes do not match their
    checksums."""
    root = str(folder.resolve())
    files = list(manifest.all_files())
    verify = sum(f.nbytes for _, _, f in files) <= VERIFY_ON_OPEN_BYTES
    dirs: dict[str, str | None] = {}  # each subfolder resolved once: a merge names thousands
    for name, _spec, f in files:
        inside = _inside(root, f.path, dirs)
        if inside is None:
            raise DatasetIntegrityError(
                f"{folder}: file {f.path!r} of field {name!r} lies outside the dataset folder"
            )
        try:
            st = os.stat(inside)
        except FileNotFoundError:
            raise DatasetIntegrityError(
                f"{folder}: file {f.path!r} of field {name!r} named by the manifest is missing"
            ) from None
        if st.st_size != f.nbytes:
            raise DatasetIntegrityError(
                f"{folder}: file {f.path!r} of field {name!r} has {plural(st.st_size, 'byte')}, the manifest "
                f"says {f.nbytes}; the dataset is damaged or was not copied completely"
            )
        if verify:
            check_sha256(folder, name, f.path, Path(inside), st, f.sha256)


def _within(root: str, path: str) -> str | None:
    """``path`` with its symbolic links resolved, or None when that lies outside ``root``."""
    real = os.path.realpath(path)
    return real if real == root or real.startswith(root + os.sep) else None


def _folder_in(root: str, sub: str, dirs: dict[str, str | None]) -> str | None:
    """Subfolder ``sub`` of the resolved ``root``, resolved (None: it leads outside), one
    ``lstat`` per folder not seen before."""
    if not sub:
        return root
    if sub not in dirs:
        head, _, leaf = sub.rpartition("/")
        parent = _folder_in(root, head, dirs)
        path = None if parent is None else f"{parent}/{leaf}"
        dirs[sub] = _within(root, path) if path is not None and os.path.islink(path) else path
    return dirs[sub]


def _inside(root: str, relpath: str, dirs: dict[str, str | None]) -> str | None:
    """Where ``relpath`` (checked by the manifest: relative, normalised) lies under the resolved
    ``root``, or None when a symbolic link (of a subfolder or of the file) leads outside it."""
    sub, _, leaf = relpath.rpartition("/")
    parent = _folder_in(root, sub, dirs)
    if parent is None:
        return None
    path = f"{parent}/{leaf}"
    return _within(root, path) if os.path.islink(path) else path


def check_sha256(folder: Path, field: str, rel: str, path: Path, st: os.stat_result, want: str) -> None:
    key = (str(path), identity(st))
    if _VERIFIED.get(key) == want:
        return
    got = file_sha256(path)
    if got != want:
        raise DatasetIntegrityError(
            f"{folder}: file {rel!r}{f' of field {field!r}' if field else ''} does not match its checksum "
            "in the manifest "
            f"(sha256 {got[:16]}..., expected {want[:16]}...): the file was damaged or changed "
            "after the dataset was written; write or copy the dataset again"
        )
    _VERIFIED[key] = got
