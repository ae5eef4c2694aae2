"""The length index: every document's length in tokens, what packing lays sequences out by.
Built by one pass over the row groups (tokenizing a text column), kept in ``cache_dir`` in a
folder named by the digest of all it derives from, each file checked against the digest of its
bytes when read back; documents read later are checked against it."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import itertools
import json
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._parquet._decode import I64
from guideloom.storage._parquet._tokens import _TokenRows
from guideloom.storage.base import BlockCounter

_LENGTHS_VERSION = 2  # the length index's files and their key


class _LengthIndex(_TokenRows):
    """Row groups with the length index over them (element access for packing)."""

    def _lengths_of(self, group: int, lo: int = 0, hi: int | None = None) -> I64:
        """The lengths of row group ``group``'s rows ``[lo, hi)`` (all by default)."""
        decoded = self._decode(group)
        hi = int(self._sizes[group]) if hi is None else hi
        if not decoded.text:
            lengths = decoded.lengths()
            if decoded.nulls is not None:
                self._nulls(group, decoded, np.flatnonzero(decoded.nulls).astype(np.int64))
                lengths = np.where(decoded.nulls, 0, lengths)  # a null row: an empty document
            out: I64 = lengths.astype(np.int64)[lo:hi]
            return out
        if self._encoder is None:
            raise TypeError(
                f"column {self.column!r} holds texts: pass tokenizer= to open_parquet to pack or count tokens"
            )
        rows = np.arange(lo, hi, dtype=np.int64)
        self._nulls(group, decoded, rows)
        # a null row (on_null="empty"): bos/eos only; a count of some rows leaves the others to
        # the reads (which tokenize the rest of a row group they touch ahead of them)
        tokens = self._token_rows(group, decoded, rows, ahead=len(rows) == int(self._sizes[group]))
        return np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))

    def _tokenizer_identity(self) -> str | None:
        """What names the tokenizing in the files derived from the rows (and in the
        fingerprint): the tokenizer's contents (a digest of a ``tokenizers.Tokenizer``'s or a
        ``tokenizer.json``'s serialisation), ``bos``/``eos`` and ``dtype``, and ``tokenizer_key``
        where given; ``None`` for a tokenizer that cannot be identified by its contents (a
        callable) and has no ``tokenizer_key``; ``""`` where nothing is tokenized."""
        if self._encoder is None:
            return ""
        described = self._encoder.describe()
        if self._tokenizer_key is not None:
            return f"key={self._tokenizer_key}|{described}"
        return described if described.startswith("sha256:") else None

    def _length_key(self) -> dict[str, Any] | None:
        """What the length index derives from, all of it: each file's name, size, version
        (modification time; an object's ETag) and footer digest, the column, ``on_null`` and the
        tokenizing; ``None`` where the tokenizer cannot be identified (nothing is cached then)."""
        tokenizer = self._tokenizer_identity()
        if tokenizer is None:
            return None
        files = [[self._shown(e.path), e.size, e.version, e.footer] for e in self._entries]
        return {
            "format": _LENGTHS_VERSION,
            "column": self.column,
            "kind": self._kind,
            "on_null": self.on_null,
            "tokenizer": tokenizer,
            "files": files,
        }

    def _length_folder(self) -> Path | None:
        """Where ``cache_dir`` keeps the length index: a folder named by the digest of
        :meth:`_length_key` (``None``: not cached)."""
        key = self._length_key()
        if self._cache_dir is None or key is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return Path(self._cache_dir) / f"lengths-{digest}"

    def _cached_lengths(self, folder: Path, key: dict[str, Any]) -> I64 | None:
        """The whole length index saved in ``folder``, checked: its record names the same key
        and the digest of its bytes, and it holds one non-negative integer per row. A file that
        fails a check is named in a warning, removed and built again (``None``)."""
        whole, record = folder / "lengths.npy", folder / "lengths.json"
        if not whole.exists() and not record.exists():
            return None
        try:
            meta = json.loads(record.read_text())
            if not isinstance(meta, dict) or meta.get("key") != key:
                raise _Stale(f"{record} does not record what the index derives from")
            return _load_checked(whole, str(meta.get("sha256")), len(self))
        except _Stale as exc:
            _rebuilt(str(exc), whole, record)
        except (OSError, ValueError) as exc:
            _rebuilt(f"{record}: cannot be read ({exc})", whole, record)
        return None

    def _cached_groups(self, folder: Path) -> dict[int, I64]:
        """The row groups' lengths saved by a build that did not finish (``group-G-<digest>.npy``,
        the digest of its bytes in its name), checked; one that fails a check is named in a
        warning, removed and built again."""
        done: dict[int, I64] = {}
        for part in sorted(folder.glob("group-*.npy")):
            try:
                _, group, digest = part.stem.split("-")
                g = int(group)
                if not 0 <= g < len(self._sizes):
                    raise _Stale(f"{part}: no row group {g} here")
                done[g] = _load_checked(part, digest, int(self._sizes[g]))
            except _Stale as exc:
                _rebuilt(str(exc), part)
            except (OSError, ValueError):
                _rebuilt(f"{part}: not a row group's lengths of this index", part)
        return done

    def build_length_index(
        self, *, threads: int | None = None, progress: Callable[[int], object] | None = None
    ) -> I64:
        """Every document's length in tokens (one pass over the files, decoding and, for texts,
        tokenizing every row group, on ``threads`` threads). With ``cache_dir`` each row group's
        lengths are saved as they are done, in a folder named by the digest of what they derive
        from (:meth:`_length_key`), each file with the digest of its bytes: a build that was
        interrupted goes on where it stopped, a later open reads them back, and a file that does
        not match its digest is built again. A tokenizer that cannot be identified by its
        contents (a callable) is not cached without ``tokenizer_key``."""
        if self._offsets is not None:
            return self._offsets
        folder, key = self._length_folder(), self._length_key()
        if self._cache_dir is not None and key is None:
            _not_cached()
        done: dict[int, I64] = {}
        if folder is not None and key is not None:
            folder.mkdir(parents=True, exist_ok=True)
            cached = self._cached_lengths(folder, key)
            if cached is not None:
                self._offsets = _offsets_of(cached)
                return self._offsets
            done = self._cached_groups(folder)

        def one(group: int) -> I64:
            got = done.get(group)
            if got is not None:
                return got
            lengths = self._lengths_of(group)
            if folder is not None:
                data = _npy_bytes(lengths.astype(np.int32 if lengths.max(initial=0) < 2**31 else np.int64))
                _write_atomic(folder / f"group-{group}-{hashlib.sha256(data).hexdigest()[:32]}.npy", data)
            if progress is not None:
                progress(1)
            return lengths

        n = len(self._sizes)
        workers = threads or min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            parts = list(pool.map(one, range(n)))
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if folder is not None:
            data = _npy_bytes(lengths)
            _write_atomic(folder / "lengths.npy", data)
            record = {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "documents": len(lengths)}
            _write_atomic(folder / "lengths.json", json.dumps(record).encode())
            for part in folder.glob("group-*.npy"):
                part.unlink(missing_ok=True)
        self._offsets = _offsets_of(lengths)
        return self._offsets

    # -- the lengths of one row group at a time (packing that counts as it reads) ----------------
    def counts_by_block(self) -> bool:
        """Whether packing counts this storage's documents row group by row group as it first
        reads them (a text column tokenized at read: its lengths cost a tokenizer pass), rather
        than from the whole length index built at open."""
        return self._kind == "text" and self._encoder is not None and self._tokenize

    def block_counter(self) -> BlockCounter | None:
        """This storage, where packing counts it row group by row group (:meth:`counts_by_block`):
        its blocks are its row groups (:meth:`natural_blocks`)."""
        return self if self.counts_by_block() else None

    def block_nbytes(self) -> I64:
        """Uncompressed bytes of the column in each row group (from the footers)."""
        return np.asarray([n for e in self._entries for n in e.nbytes], dtype=np.int64)

    def _block_table(self) -> dict[int, I64]:
        """The row groups' lengths known in this process (made on first use: what ``cache_dir``
        holds, the whole index or the row groups counted so far, each file checked)."""
        table: dict[int, I64] | None = getattr(self, "_block_lengths", None)
        if table is not None:
            return table
        table = {}
        if self._cache_dir is not None and self._length_key() is None:
            _not_cached()
        if self._offsets is not None:
            lengths = np.diff(self._offsets)
            starts = self._gstarts.tolist()
            table = {g: lengths[starts[g] : starts[g + 1]] for g in range(len(self._sizes))}
        else:
            folder, key = self._length_folder(), self._length_key()
            if folder is not None and key is not None and folder.exists():
                whole = self._cached_lengths(folder, key)
                if whole is not None:
                    starts = self._gstarts.tolist()
                    table = {g: whole[starts[g] : starts[g + 1]] for g in range(len(self._sizes))}
                else:
                    table = self._cached_groups(folder)
        with self._lock:  # counts on several threads: the first table made is the one kept
            kept: dict[int, I64] = self.__dict__.setdefault("_block_lengths", table)
        return kept

    def known_block_lengths(self, group: int) -> I64 | None:
        """Row group ``group``'s documents' lengths in tokens where known without tokenizing (in
        this process, or saved in ``cache_dir`` and checked); ``None`` otherwise."""
        return self._block_table().get(int(group))

    def block_lengths(self, group: int, lo: int = 0, hi: int | None = None) -> I64:
        """The lengths in tokens of row group ``group``'s rows ``[lo, hi)`` (all by default):
        known, or counted now by decoding the row group and tokenizing those rows, whose tokens
        the row group keeps for the reads that follow (each row tokenized once). Once every row
        of the row group is counted its lengths are saved in ``cache_dir`` (as the length
        index's row groups are, each file named by the digest of its bytes), so a later open
        counts it no more."""
        g = int(group)
        hi = int(self._sizes[g]) if hi is None else int(hi)
        table = self._block_table()
        got = table.get(g)
        if got is not None:
            return got[lo:hi]
        with self._lock:  # blocks of one row group may be counted on several threads at once
            parts: dict[int, dict[tuple[int, int], I64]] = self.__dict__.setdefault("_block_parts", {})
            known = parts.get(g, {}).get((lo, hi))
        if known is not None:
            return known
        lengths = self._lengths_of(g, lo, hi)
        whole = None
        with self._lock:
            mine = parts.setdefault(g, {})
            mine[(lo, hi)] = lengths
            spans = sorted(mine)
            size = int(self._sizes[g])
            if (
                spans[0][0] == 0
                and spans[-1][1] == size
                and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            ):
                whole = np.concatenate([mine[k] for k in spans]).astype(np.int64)
                table[g] = whole
                parts.pop(g, None)
        if whole is not None:
            self._save_group(g, whole)
        return lengths

    def _save_group(self, group: int, lengths: I64) -> None:
        if "_block_folder" not in self.__dict__:  # its key digests the tokenizer: once
            self.__dict__["_block_folder"] = self._length_folder()
        folder: Path | None = self.__dict__["_block_folder"]
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        data = _npy_bytes(lengths.astype(np.int32 if lengths.max(initial=0) < 2**31 else np.int64))
        _write_atomic(folder / f"group-{group}-{hashlib.sha256(data).hexdigest()[:32]}.npy", data)

    def _check_block_lengths(self, indices: I64, docs: Sequence[Any]) -> None:
        """Refuse documents whose length differs from what their row group was counted with (the
        packing's layout follows from it), as :meth:`_check_lengths` does for the whole index."""
        table: dict[int, I64] | None = getattr(self, "_block_lengths", None)
        parts: dict[int, dict[tuple[int, int], I64]] = getattr(self, "_block_parts", {})
        if (not table and not parts) or not len(docs):
            return
        groups = np.searchsorted(self._gstarts, indices, side="right") - 1
        got = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        want = np.full(len(docs), -1, dtype=np.int64)
        for g in np.unique(groups).tolist():
            at = np.flatnonzero(groups == g)
            local = indices[at] - self._gstarts[g]
            lengths = None if table is None else table.get(g)
            if lengths is not None:
                want[at] = lengths[local]
                continue
            for (lo, hi), part in list(parts.get(g, {}).items()):
                inside = (local >= lo) & (local < hi)
                want[at[inside]] = part[local[inside] - lo]
        bad = np.flatnonzero((want >= 0) & (got != want))
        if len(bad):
            self._refuse_length(int(indices[bad[0]]), int(got[bad[0]]), int(want[bad[0]]))

    def _check_lengths(self, indices: I64, docs: Sequence[Any]) -> None:
        """Refuse documents whose length differs from the length index the packing is laid out
        by (a tokenizer that changed under its ``tokenizer_key``, one that does not encode a
        text alike twice, a file rewritten in place with its size, footer and modification time
        kept, or an index that is wrong), naming the first one's file, row group
        and row."""
        offsets = self._offsets
        if offsets is None or not len(docs):
            return
        got = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        want = offsets[indices + 1] - offsets[indices]
        bad = np.flatnonzero(got != want)
        if not len(bad):
            return
        i = int(bad[0])
        self._refuse_length(int(indices[i]), int(got[i]), int(want[i]))

    def _refuse_length(self, index: int, got: int, want: int) -> None:
        file, group, row = self._row_place(index)
        folder = self._length_folder()
        fix = (
            "open the files again"
            if folder is None
            else f"remove {folder} and open the files again (with a new tokenizer_key if the "
            "tokenizer changed)"
        )
        raise DatasetIntegrityError(
            f"{file}: {group}, {row} (document {index}) has {plural(got, 'token')}, the length "
            f"index says {want}: the documents do not tokenize as when the index was built "
            f"(a tokenizer changed under the same tokenizer_key, one that encodes a text "
            f"differently from one call to the next, or a file rewritten in place with its size, "
            f"footer and modification time kept); {fix}"
        )

    def document_offsets_sync(self, positions: I64) -> I64:
        return self.build_length_index()[np.asarray(positions, dtype=np.int64)]

    def _row_of(self, index: int) -> tuple[int, int]:
        group = int(np.searchsorted(self._gstarts, index, side="right")) - 1
        return group, index - int(self._gstarts[group])

    def document_place(self, index: int) -> list[Any]:
        """Document ``index``'s file, row group and row: ``[file, "row group G", "row R"]``."""
        return self._row_place(index)

    def _row_place(self, index: int) -> list[Any]:
        group, row = self._row_of(index)
        e = self._entries[int(self._file_of[group])]
        return [self._shown(e.path), f"row group {int(self._group_in_file[group])}", f"row {row}"]

    def locate(self, start: int, stop: int) -> list[list[Any]]:
        """The rows holding elements ``[start, stop)``: ``[file, "row group G", "row R"]`` each
        (known once the length index is built, as for packing; ``[]`` before)."""
        offsets = self._offsets
        if offsets is None or stop <= start:
            return []
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        return [self._row_place(i) for i in range(first, last + 1) if offsets[i + 1] > offsets[i]]

    def _all_offsets_sync(self) -> I64:
        return self.build_length_index()


# -- the length index's files ----------------------------------------------------------------------
class _Stale(Exception):
    """A saved file of the length index that fails a check (the message names it and says why)."""


def _not_cached() -> None:
    warnings.warn(
        "the length index is not cached in cache_dir: a tokenizer callable cannot be "
        "identified by its contents; pass open_parquet(tokenizer_key=...) naming exactly "
        "this tokenizer (and its version) to cache it",
        RuntimeWarning,
        stacklevel=3,
    )


def _rebuilt(why: str, *paths: Path) -> None:
    """Say that a saved file of the length index is not used (and is built again), and remove it."""
    warnings.warn(f"{why}; the length index is built again", RuntimeWarning, stacklevel=4)
    for path in paths:
        path.unlink(missing_ok=True)


def _npy_bytes(array: npt.NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_checked(path: Path, digest: str, count: int) -> I64:
    """The lengths saved in ``path``, if its bytes have ``digest`` (a prefix of their sha256)
    and it holds ``count`` non-negative integers; :class:`_Stale` naming it otherwise."""
    data = path.read_bytes()
    if len(digest) < 16 or not hashlib.sha256(data).hexdigest().startswith(digest):
        raise _Stale(f"{path}: its bytes do not match the digest recorded for them (damaged or edited)")
    try:
        lengths = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _Stale(f"{path}: not an array numpy reads ({exc})") from None
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or len(lengths) != count:
        raise _Stale(f"{path}: holds {lengths.dtype} of shape {lengths.shape}, not {count} lengths")
    if len(lengths) and int(lengths.min()) < 0:
        raise _Stale(f"{path}: holds a negative length")
    out: I64 = lengths.astype(np.int64)
    return out


def _offsets_of(lengths: I64) -> I64:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
