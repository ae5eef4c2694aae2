"""Block digests: every data file cut into blocks, each with an xxh3-64 digest, checked before
any byte of the block reaches a sample.

A file's manifest entry carries ``"blocks"``: the block size and either the digests inline (hex,
for a file of at most :data:`INLINE_BLOCKS` blocks) or the name and sha256 of a *sidecar* file
beside it holding them (raw little-endian uint64, one per block), so a manifest stays small for
a TiB dataset and a sidecar is read only when its file is first read. The last block of a file
may be short; an empty file has no block.

Readers check what they read block by block: a local dataset each block once per process on
first touch (:class:`FileBlocks`, a bitmap kept per file identity), a remote read each block it
fetches (:func:`check_range`; ranges are widened to block boundaries). The fuzzer and
``guideloom verify`` use :func:`guideloom.storage._api.check_dataset_blocks`.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom._process import remembered

__all__ = [
    "BLOCK_BYTES",
    "INLINE_BLOCKS",
    "BlockDigests",
    "BlockHasher",
    "BlockMismatch",
    "FileBlocks",
    "identity",
    "block_digests",
    "check_range",
    "digest_held",
    "local_reader",
    "parse_blocks",
    "sidecar_name",
    "widen",
]

#: Default block size: 64 KiB (a block costs ~3 us to hash; see ``python -m benchmarks integrity``).
BLOCK_BYTES: Final = 64 * 2**10
#: Files of at most this many blocks carry their digests inline in the manifest (<= 1 KiB of hex).
INLINE_BLOCKS: Final = 64
#: A local read that touches an unchecked block checks the aligned group of this many blocks it
#: lies in (1 MiB): a shuffled first epoch then leaves the per-read path after fewer misses.
CHECK_GROUP: Final = 16
ALGORITHM: Final = "xxh3_64"
SIDECAR_SUFFIX: Final = ".xxh3"
_MIN_BLOCK, _MAX_BLOCK = 4096, 2**30

U64 = npt.NDArray[np.uint64]


def distinct(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``np.unique(a)`` of integers (sorted, each once), without what ``np.unique`` costs a new
    process at its first call: an import of ``numpy.ma`` (13-35 ms on 2 shared cores), on the
    path of its first read (each process worker's first batch)."""
    s = np.sort(a)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class BlockMismatch(Exception):
    """A block's bytes do not match its digest (the reader names the file)."""


def _digest_nogil(data: Any) -> int:
    """xxh3_64 of ``data``, hashed with the GIL released (the hasher object's constructor releases
    it; the one-shot function does not): a first touch's check overlaps the consumer's work."""
    return int(xxhash.xxh3_64(data).intdigest())


def digest_held(data: Any) -> int:
    """xxh3_64 of ``data``, hashed with the GIL held (the one-shot function): for a range's
    blocks hashed one after another on an I/O thread. Hashed with the GIL released, each block
    would drop it and take it back a few microseconds later: a thread that waits for the GIL (an
    event loop waking up) loses that race at nearly every drop, and no drop request is made
    while the GIL keeps changing hands, so it waited for the whole range (15-50 ms behind a few
    4 MiB ranges of 64 KiB blocks), against the few tenths of a millisecond a 4 MiB range takes
    to hash with the GIL held."""
    return int(xxhash.xxh3_64_intdigest(data))


def sidecar_name(path: str) -> str:
    """The sidecar file of data file ``path``."""
    return path + SIDECAR_SUFFIX


def block_count(nbytes: int, size: int) -> int:
    return -(-nbytes // size)


def block_digests(data: Any, size: int) -> U64:
    """The digest of each ``size``-byte block of ``data`` (bytes-like)."""
    view = memoryview(data).cast("B")
    out = np.empty(block_count(view.nbytes, size), dtype=np.uint64)
    digest = _digest_nogil
    for i in range(len(out)):
        out[i] = digest(view[i * size : (i + 1) * size])
    return out


@dataclass(frozen=True, slots=True, eq=True)
class BlockDigests:
    """A file's block digests as its manifest entry gives them: inline, or in a sidecar."""

    size: int
    inline: str | None = None  # hex, 16 digits a block
    sidecar: str | None = None  # relative path of the sidecar file
    sidecar_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "algorithm": ALGORITHM}
        if self.inline is not None:
            out["digests"] = self.inline
        else:
            out["file"] = self.sidecar
            out["sha256"] = self.sidecar_sha256
        return out

    def moved(self, prefix: str) -> BlockDigests:
        if self.sidecar is None:
            return self
        return BlockDigests(self.size, None, f"{prefix}/{self.sidecar}", self.sidecar_sha256)

    def inline_digests(self) -> U64 | None:
        if self.inline is None:
            return None
        return np.frombuffer(bytes.fromhex(self.inline), dtype=">u8").astype(np.uint64)

    def load(self, read: Callable[[str], bytes], nbytes: int, where: str) -> U64:
        """The digests: inline, or read with ``read(sidecar path)`` and checked against the
        sidecar's sha256 (:class:`DatasetIntegrityError` naming it when it does not match)."""
        count = block_count(nbytes, self.size)
        inline = self.inline_digests()
        if inline is not None:
            return inline
        assert self.sidecar is not None
        data = read(self.sidecar)
        if len(data) != 8 * count or hashlib.sha256(data).hexdigest() != self.sidecar_sha256:
            raise DatasetIntegrityError(
                f"{where}: the block digests file {self.sidecar!r} does not match its checksum in the "
                "manifest; the dataset is damaged: write or copy it again (or run `guideloom verify "
                "--add-block-digests` after checking it)"
            )
        return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def make_blocks(digests: U64, size: int, sidecar_path: str) -> tuple[BlockDigests, bytes | None]:
    """The manifest entry for ``digests``, and the sidecar's bytes where they do not go inline."""
    if len(digests) <= INLINE_BLOCKS:
        return BlockDigests(size, inline=digests.astype(">u8").tobytes().hex()), None
    data = digests.astype("<u8").tobytes()
    return BlockDigests(size, sidecar=sidecar_path, sidecar_sha256=hashlib.sha256(data).hexdigest()), data


def parse_blocks(raw: Any, nbytes: int, *, where: str, path: str) -> BlockDigests | None:
    """A file entry's ``"blocks"``, checked (None when absent: a dataset written without them)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("algorithm") != ALGORITHM:
        raise DatasetFormatError(f"{where}: 'blocks' must be an object with 'algorithm': {ALGORITHM!r}")
    size = raw.get("size")
    if type(size) is not int or not _MIN_BLOCK <= size <= _MAX_BLOCK or size & (size - 1):
        raise DatasetFormatError(f"{where}: 'blocks.size' must be a power of two in [4096, 2**30]")
    count = block_count(nbytes, size)
    if "digests" in raw:
        hexes = raw["digests"]
        if not (isinstance(hexes, str) and len(hexes) == 16 * count and re.fullmatch(r"[0-9a-f]*", hexes)):
            raise DatasetFormatError(
                f"{where}: 'blocks.digests' must be {16 * count} lowercase hex digits ({count} blocks)"
            )
        return BlockDigests(size, inline=hexes)
    side, sha = raw.get("file"), raw.get("sha256")
    if side != sidecar_name(path):
        raise DatasetFormatError(f"{where}: 'blocks.file' must be {sidecar_name(path)!r}")
    if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise DatasetFormatError(f"{where}: 'blocks.sha256' must be 64 lowercase hex digits")
    return BlockDigests(size, sidecar=side, sidecar_sha256=sha)


class BlockHasher:
    """Digests of a file's blocks as its bytes stream by (the writer's)."""

    def __init__(self, size: int = BLOCK_BYTES) -> None:
        self.size = size
        self._digests: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos, size = 0, self.size
        while pos < view.nbytes:
            take = min(size - self._filled, view.nbytes - pos)
            if self._filled == 0 and take == size:
                self._digests.append(xxhash.xxh3_64_intdigest(view[pos : pos + take]))
            else:
                self._hasher.update(view[pos : pos + take])
                self._filled += take
                if self._filled == size:
                    self._digests.append(self._hasher.intdigest())
                    self._hasher.reset()
                    self._filled = 0
            pos += take

    def digests(self) -> U64:
        """Every block's digest, the last (short) block's included."""
        out = list(self._digests)
        if self._filled:
            out.append(self._hasher.intdigest())
        return np.asarray(out, dtype=np.uint64)


def widen(start: int, end: int, size: int, nbytes: int) -> tuple[int, int]:
    """``[start, end)`` widened to the blocks it touches (the last one may end at ``nbytes``)."""
    if end <= start:
        return start, end
    return start // size * size, min(nbytes, -(-end // size) * size)


def check_range(digests: U64, size: int, start: int, data: Any) -> None:
    """Check bytes at ``start`` (block-aligned) of a file, whole blocks (or up to its end):
    :class:`BlockMismatch` naming the first block that does not match."""
    view = memoryview(data).cast("B")
    if start % size:
        raise BlockMismatch(f"a read at byte {start} is not aligned to the {size}-byte blocks")
    first = start // size
    digest = digest_held  # many blocks in a row: see digest_held
    for i in range(block_count(view.nbytes, size)):
        if digest(view[i * size : (i + 1) * size]) != int(digests[first + i]):
            lo = (first + i) * size
            raise BlockMismatch(
                f"block {first + i} (bytes {lo}-{lo + min(size, view.nbytes - i * size) - 1}) does not "
                "match its digest in the manifest"
            )


#: A file changed this recently (its ``st_ctime``) may change again within the same tick of the
#: kernel's coarse clock with no new ``st_ctime``: blocks checked then are checked again on every
#: read until the change is this old (as git treats a "racily clean" file).
RACY_NS: Final = 50_000_000


def identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells a local file's bytes changed: device, inode, size, modification time and status
    change time (any write changes ``st_ctime``, whatever a tool does to ``st_mtime``)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class FileBlocks:
    """One local file's blocks checked so far in this process (a bitmap), for the file as it was
    last seen (:meth:`observe`): a file changed or replaced has its bitmap cleared, so its blocks
    are checked again as they are touched.

    :meth:`ensure` checks the blocks of a byte range not checked yet, reading them with
    ``read(start, end)``; a block once checked is not hashed again while the file is unchanged.
    """

    def __init__(self, digests: U64, size: int, nbytes: int, label: str) -> None:
        self.digests = digests
        self.size = size
        self.nbytes = nbytes
        self.label = label
        self.checked = np.zeros(len(digests), dtype=np.bool_)
        self.complete = len(digests) == 0
        self.identity: tuple[int, int, int, int, int] | None = None
        self._racy = False  # changed within ``RACY_NS``: nothing checked is remembered
        self._lock = threading.Lock()

    def observe(self, st: os.stat_result) -> bool:
        """Compare the file as it is now (``st``, from ``fstat``) with the one whose blocks were
        checked: where it changed, forget every check (True). A file shorter than its digests
        cover is refused (:class:`DatasetIntegrityError` naming it) before any of it is read: a
        map past a file's end would kill the process."""
        now = identity(st)
        if now == self.identity:
            return False
        if st.st_size < self.nbytes:
            raise DatasetIntegrityError(
                f"{self.label}: the file has {st.st_size} bytes, {self.nbytes} expected: it was "
                "truncated or replaced after it was written; write or copy the dataset again"
            )
        with self._lock:
            if now != self.identity:
                self.checked[:] = False
                self.complete = len(self.digests) == 0
                self.identity = now
                self._racy = time.time_ns() - st.st_ctime_ns < RACY_NS
        return True

    def ensure(self, start: int, end: int, read: Callable[[int, int], Any]) -> None:
        """Check the blocks of bytes ``[start, end)`` not checked yet (raises
        :class:`DatasetIntegrityError` naming the file)."""
        if self.complete or end <= start:
            return
        size = self.size
        lo, hi = start // size, (end - 1) // size + 1
        todo = np.flatnonzero(~self.checked[lo:hi])
        if len(todo):
            self._check((todo + lo).tolist(), read)

    def ensure_many(self, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64], read: Any) -> None:
        """:meth:`ensure` for many byte ranges at once (vectorised; ranges of any length)."""
        if self.complete or not len(starts):
            return
        size = self.size
        lo = starts // size
        hi = (np.maximum(ends, starts + 1) - 1) // size
        checked = self.checked
        if bool(checked[lo].all()) and bool(checked[hi].all()) and int((hi - lo).max()) <= 1:
            return
        span = hi - lo + 1
        blocks = np.repeat(lo, span) + (np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span))
        todo = distinct(blocks[~checked[blocks]])
        if len(todo):  # with the rest of their group: fewer, larger first touches
            group = distinct(todo // CHECK_GROUP)
            todo = (group[:, None] * CHECK_GROUP + np.arange(CHECK_GROUP)).reshape(-1)
            todo = todo[todo < len(checked)]
            self._check(todo[~checked[todo]].tolist(), read)

    def _check(self, blocks: list[int], read: Callable[[int, int], Any]) -> None:
        size, digest = self.size, _digest_nogil
        seen = self.identity  # a check of the file as it was: not remembered once it changed
        if self._racy and seen is not None:
            self._racy = time.time_ns() - seen[4] < RACY_NS
        remember = not self._racy
        for b in blocks:
            lo, hi = b * size, min(self.nbytes, (b + 1) * size)
            data = read(lo, hi)
            if memoryview(data).nbytes != hi - lo:
                raise DatasetIntegrityError(
                    f"{self.label}: the file is shorter than when it was opened (it was truncated or "
                    "replaced); open the dataset again"
                )
            if digest(data) != int(self.digests[b]):
                raise DatasetIntegrityError(
                    f"{self.label}: block {b} (bytes {lo}-{hi - 1}) does not match its digest: the "
                    "file was damaged or changed after it was written; write or copy the dataset again"
                )
            if remember:
                with self._lock:
                    if self.identity == seen:
                        self.checked[b] = True
        with self._lock:
            if remember and self.identity == seen and not self.complete and bool(self.checked.all()):
                self.complete = True


#: Per-process bitmaps, by path, inode and digests: shared by every open of a file.
_FILES: MutableMapping[tuple[str, int, int, int, str], FileBlocks] = remembered(1 << 16)
_FILES_LOCK = threading.Lock()


def local_reader(folder: Path) -> Callable[[str], bytes]:
    """``read(path)``: a block digests file of a local dataset, whole (a missing one is a
    :class:`DatasetIntegrityError` naming it)."""

    def read(rel: str) -> bytes:
        try:
            return (folder / rel).read_bytes()
        except FileNotFoundError:
            raise DatasetIntegrityError(
                f"{folder}: the block digests file {rel!r} named by the manifest is missing"
            ) from None

    return read


def file_blocks(path: str, st: os.stat_result, blocks: BlockDigests, folder: Path, label: str) -> FileBlocks:
    """The bitmap of local file ``path``, its digests loaded (a sidecar read from ``folder`` and
    checked) the first time, compared with the file as it is now (``st``: see
    :meth:`FileBlocks.observe`)."""
    # One bitmap per inode: an open that still reads a file replaced since (its map or its
    # descriptor) checks the old inode's bytes, which must not count for the new file's.
    key = (path, st.st_dev, st.st_ino, blocks.size, blocks.inline or blocks.sidecar_sha256 or "")
    with _FILES_LOCK:
        found = _FILES.get(key)
    if found is None:
        # the digests cover the size the manifest gives (the caller checked it at open)
        made = FileBlocks(
            blocks.load(local_reader(folder), st.st_size, str(folder)), blocks.size, st.st_size, label
        )
        with _FILES_LOCK:
            found = _FILES.setdefault(key, made)
    found.observe(st)
    return found
