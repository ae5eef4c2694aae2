"""ShardedArray: a read-only 1-D array over a dataset's shard files, memory-mapped or read with
``preadv``, each block checked at first touch and each file watched for changes while open."""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._format._blocks import FileBlocks, distinct, file_blocks, identity
from guideloom.storage._format._manifest import ArraySpec, add_bases
from guideloom.storage._local._check import check_sha256
from guideloom.storage._memory import gather_windows

__all__ = ["ShardedArray"]

Array = npt.NDArray[Any]


#: Mapped pages a storage's maps may hold before they are dropped (see ShardedArray). Maps no
#: larger than this in all are never dropped: the whole map then fits the budget.
MAPPED_BUDGET = 256 * 2**20
#: Shard files no larger than this are read into memory when an array is opened, not mapped: a
#: map keeps a file descriptor open (Python's mmap holds a duplicate), and a dataset of many
#: parts has many small files (each part's document offsets), which would use up the limit.
SMALL_FILE_BYTES = 64 * 2**10
#: An array of at most this many mapped files keeps a descriptor of each besides its map, to
#: compare the file with what was last seen by ``fstat`` (a third of a ``stat``'s cost) at every
#: read; one of more files (a merge's many parts) looks by path, to keep within the limit of
#: descriptors a process may hold.
WATCHED_FDS = 64
#: A page fault maps the page-cached pages around the one it needs too (Linux maps 64 KiB), so
#: a read of scattered rows maps about this much more per row than it reads.
FAULT_AROUND = 64 * 2**10


def _slicer(data: memoryview) -> Callable[[int, int], memoryview]:
    """``data[a:b]`` as a function of ``a`` and ``b`` (a block check's reader)."""
    return lambda a, b: data[a:b]


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


class ShardedArray:
    """A read-only 1-D array made of shard files, memory-mapped.

    Every read copies out. Where all the maps fit ``MAPPED_BUDGET``, samples are gathered from
    the maps: pages stay mapped once touched, so a warm epoch takes no page fault at all. Over a
    larger dataset that would make RSS grow to the dataset's size, and dropping the mapped pages
    from time to time costs more than it saves: a scattered row's fault maps the 64 KiB around it,
    and unmapping them later costs about as much again (a batch of 16 scattered rows takes about
    twice as long with drops as without). So there samples are read with ``preadv`` straight into
    the batch (one system call a row, about 1.4 µs: no mapping, RSS flat whatever the size); such
    an array holds one file descriptor per shard and no map. Arrays of small scattered reads
    (``preads=False``: document offsets) always go through the maps, whose pages are dropped
    (``MADV_DONTNEED``: they stay in the page cache) whenever what they may have mapped reaches
    the budget.
    """

    def __init__(self, folder: Path, spec: ArraySpec, *, preads: bool = True) -> None:
        self.dtype = spec.dtype
        self._bases = spec.bases()  # files' bases (a merge of prepared parts), added as read
        self._parts: list[Array] = []
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self._bytes: list[memoryview] = []
        self._mapped_estimate = 0
        files = [f for f in spec.files if f.elements]
        self._folder = folder
        self._files = files
        self._paths = [folder / f.path for f in files]
        #: each file's identity as last seen (None: read whole into memory, nothing to watch)
        self._ids: list[tuple[int, int, int, int, int] | None] = []
        self._every = list(range(len(files)))
        self._watch: list[int] = []  # a descriptor of each mapped file, see WATCHED_FDS
        self._bounds = np.cumsum([0, *(f.elements for f in files)], dtype=np.int64)
        self.length = int(self._bounds[-1])
        self._map_nbytes = sum(f.nbytes for f in files)
        #: each file's blocks checked in this process (None: a file without block digests)
        self._checks: list[FileBlocks | None] = []
        self._checked = True  # every block of every file checked: nothing left to look at
        if preads and self._map_nbytes > MAPPED_BUDGET and hasattr(os, "preadv"):
            fds = self._fds
            weakref.finalize(self, _close_all, fds)  # before the first open: none can leak
            for f, path in zip(files, self._paths, strict=True):
                fds.append(os.open(path, os.O_RDONLY))
                st = self._sized(f, path, os.fstat(fds[-1]))
                self._ids.append(identity(st))
                self._checks.append(self._blocks_of(folder, f, path, st))
            self._checked = all(c is None or c.complete for c in self._checks)
            self._setup_mirror()
            return
        watch = len(files) <= WATCHED_FDS
        if watch:
            weakref.finalize(self, _close_all, self._watch)  # before the first open: none can leak
        for f, path in zip(files, self._paths, strict=True):
            if watch:
                self._watch.append(-1)
            if f.nbytes <= SMALL_FILE_BYTES:  # read whole: a map would hold a descriptor open
                with open(path, "rb") as fh:
                    st = self._sized(f, path, os.fstat(fh.fileno()))
                    small = np.fromfile(fh, dtype=spec.dtype, count=f.elements)
                if len(small) != f.elements:
                    self._short(len(self._parts))
                small.flags.writeable = False
                check = self._blocks_of(folder, f, path, st)
                if check is not None:  # checked whole now: the bytes held are the ones read
                    check.ensure(0, f.nbytes, _slicer(small.view(np.uint8).data))
                self._checks.append(check)
                self._ids.append(None)
                self._parts.append(small)
                continue
            with open(path, "rb") as fh:
                st = self._sized(f, path, os.fstat(fh.fileno()))  # before the map: no map past the end
                mm = mmap.mmap(fh.fileno(), f.nbytes, access=mmap.ACCESS_READ)
                if watch:
                    self._watch[-1] = os.dup(fh.fileno())
                self._ids.append(identity(st))
                self._checks.append(self._blocks_of(folder, f, path, st))
            self._maps.append(mm)
            self._parts.append(np.frombuffer(mm, dtype=spec.dtype, count=f.elements))
        # byte views of the maps, for copies of many small spans (``_copy_spans``)
        self._bytes = [part.view(np.uint8).data for part in self._parts]
        self._checked = all(c is None or c.complete for c in self._checks)
        self._setup_mirror()

    def _setup_mirror(self) -> None:
        """Where every file has blocks of one size and every file but the last whole blocks (as
        written): one bitmap over the array's blocks (``_mirror``), so that the check of a read
        whose blocks were all checked is two lookups (``_seen``), with no per-file work."""
        self._mirror: npt.NDArray[np.bool_] | None = None
        self._shift = 0
        checks = self._checks
        if self._checked or not checks or any(c is None for c in checks):
            return
        size = checks[0].size  # type: ignore[union-attr]
        if any(c.size != size or (c is not checks[-1] and c.nbytes % size) for c in checks):  # type: ignore[union-attr]
            return
        self._shift = size.bit_length() - 1
        self._mirror_at = np.cumsum([0, *(len(c.checked) for c in checks)]).tolist()  # type: ignore[union-attr]
        self._mirror = np.concatenate([c.checked for c in checks])  # type: ignore[union-attr]

    def _refresh_mirror(self, shards: Sequence[int]) -> None:
        """Copy the bitmaps of ``shards`` (just checked) into the array's."""
        if self._mirror is not None:
            at = self._mirror_at
            for k in shards:
                self._mirror[at[k] : at[k + 1]] = self._checks[k].checked  # type: ignore[union-attr]

    def _seen(self, starts: npt.NDArray[np.int64], length: int) -> bool:
        """Whether the blocks of windows ``[s, s + length)`` were all checked already (False:
        look per file)."""
        mirror = self._mirror
        if mirror is None or length <= 0 or (length * self.dtype.itemsize) >> self._shift:
            return False
        item, shift = self.dtype.itemsize, self._shift
        lo = (starts * item) >> shift
        hi = ((starts + length) * item - 1) >> shift
        return bool(mirror[lo].all()) and bool(mirror[hi].all())

    @staticmethod
    def _sized(f: Any, path: Path, st: os.stat_result) -> os.stat_result:
        """``st``, where file ``f`` has the size the manifest gives; else
        :class:`DatasetIntegrityError` naming it (a map past a file's end would kill the process)."""
        if st.st_size != f.nbytes:
            raise DatasetIntegrityError(
                f"{path}: the file has {plural(st.st_size, 'byte')}, the manifest says {f.nbytes}; "
                "it was truncated or changed after the dataset was written: write or copy it again"
            )
        return st

    @staticmethod
    def _blocks_of(folder: Path, f: Any, path: Path, st: os.stat_result) -> FileBlocks | None:
        """File ``f``'s bitmap of checked blocks as the file is now (None without block digests)."""
        if f.blocks is None:
            return None
        return file_blocks(str(path), st, f.blocks, folder, f"{folder}: file {f.path!r}")

    # -- files that change while open ---------------------------------------------------------------
    def _touched(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> list[int]:
        """The shards elements ``[starts[i], stops[i])`` lie in."""
        if len(self._every) <= 1 or not len(starts):
            return self._every
        top = len(self._every) - 1  # an empty span at the very end locates past the last shard
        first = np.minimum(self._locate(starts), top)
        last = np.minimum(self._locate(np.maximum(stops - 1, starts)), top)
        if bool((first == last).all()):
            return distinct(first).tolist()  # type: ignore[no-any-return]
        return list(range(int(first.min()), int(last.max()) + 1))

    def _fresh(self, shards: Sequence[int]) -> bool:
        """Compare ``shards``' files with what was last seen (one ``fstat`` each; a ``stat``
        of a mapped one): a file that changed has its blocks checked again as they are touched
        (True); one of another size, or without block digests and of other bytes (its sha256),
        is refused before any of it is read: :class:`DatasetIntegrityError` naming it."""
        ids, fds, changed = self._ids, self._fds or self._watch, False
        for k in shards:
            seen = ids[k]
            if seen is None:
                continue
            if fds:  # the open file itself: a write, a truncation or new times move its ctime
                st = os.fstat(fds[k])
                if st.st_ctime_ns == seen[4] and st.st_size == seen[2]:  # (a coarse tick: both)
                    continue
            else:
                try:
                    st = os.stat(self._paths[k])
                except FileNotFoundError:
                    raise DatasetIntegrityError(
                        f"{self._paths[k]}: the file was deleted or moved after the dataset was opened; "
                        "write or copy the dataset again"
                    ) from None
                if identity(st) == seen:
                    continue
            self._changed(k, st)
            changed = True
        return changed

    def _changed(self, k: int, st: os.stat_result) -> None:
        """Shard ``k``'s file is not as last seen (``st``): refused where its size is not the
        manifest's, or (without block digests) its sha256; its blocks checked again on touch."""
        f, path = self._files[k], self._paths[k]
        self._sized(f, path, st)
        check = self._checks[k]
        if check is not None:
            check.observe(st)
            self._checked = False
            self._refresh_mirror([k])
        else:
            check_sha256(self._folder, "", f.path, path, st, f.sha256)
        self._ids[k] = identity(st)

    def _read(self, shards: Sequence[int], check: Callable[[], None], copy: Callable[[], Array]) -> Array:
        """``copy()`` of shards ``shards``, each file compared with what was last seen before
        (``check()`` then checks the blocks touched that are not checked yet) and after: a file
        that changed meanwhile is checked again and read again."""
        for _ in range(3):
            self._fresh(shards)
            if not self._checked:
                check()
            out = copy()
            if not self._fresh(shards):
                return out
        raise DatasetIntegrityError(
            f"{self._folder}: a data file keeps changing while it is read; open the dataset again"
        )

    def _reader(self, k: int) -> Callable[[int, int], Any]:
        """Bytes ``[a, b)`` of shard ``k`` as a buffer, for a block check."""
        if self._fds:
            fd = self._fds[k]
            return lambda a, b: os.pread(fd, b - a, a)
        return _slicer(self._bytes[k])

    def ensure(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> None:
        """Check the blocks that elements ``[starts[i], stops[i])`` lie in (each block once per
        process, on first touch): :class:`DatasetIntegrityError` before any byte of a block
        that does not match its digest is read into a sample."""
        if self._checked or not len(starts):
            return
        item = self.dtype.itemsize
        stops = np.maximum(stops, starts)
        keep = stops > starts
        starts, stops = starts[keep], stops[keep]
        if not len(starts):
            return
        first = self._locate(starts)
        last = self._locate(stops - 1)
        bounds = self._bounds
        touched = distinct(np.concatenate([first, last])).tolist()
        for k in distinct(first).tolist():
            check = self._checks[k]
            sel = first == k
            if check is None:
                continue
            lo = (starts[sel] - bounds[k]) * item
            hi = (np.minimum(stops[sel], bounds[k + 1]) - bounds[k]) * item
            check.ensure_many(lo, hi, self._reader(k))
        for row in np.flatnonzero(first != last).tolist():  # across shards: the later ones
            for k in range(int(first[row]) + 1, int(last[row]) + 1):
                check = self._checks[k]
                if check is not None:
                    hi = (min(int(stops[row]), int(bounds[k + 1])) - int(bounds[k])) * item
                    check.ensure(0, hi, self._reader(k))
        self._checked = all(c is None or c.complete for c in self._checks)
        self._refresh_mirror(touched)

    def account(self, pieces: int, nbytes: int) -> None:
        """Count a read of ``nbytes`` in ``pieces`` scattered pieces; drop the mapped pages once
        what it may have mapped reaches ``MAPPED_BUDGET``."""
        if self._map_nbytes <= MAPPED_BUDGET or not self._maps or not hasattr(mmap, "MADV_DONTNEED"):
            return
        self._mapped_estimate += nbytes + pieces * FAULT_AROUND
        if self._mapped_estimate >= MAPPED_BUDGET:
            self._mapped_estimate = 0
            for mm in self._maps:
                mm.madvise(mmap.MADV_DONTNEED)

    def __len__(self) -> int:
        return self.length

    def _locate(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.intp]:
        return np.searchsorted(self._bounds, positions, side="right") - 1

    def gather(self, starts: npt.NDArray[np.int64], length: int) -> Array:
        """Windows ``[s, s+length)`` for each start, as one ``(n, length)`` array (a copy)."""
        out = self._read(
            self._touched(starts, starts + length),
            lambda: None if self._seen(starts, length) else self.ensure(starts, starts + length),
            lambda: self._gather(starts, length),
        )
        self.account(len(out), out.nbytes)
        if self._bases is not None:
            add_bases(out, starts[:, None] + np.arange(length, dtype=np.int64), self._bases)
        return out

    def _gather(self, starts: npt.NDArray[np.int64], length: int) -> Array:
        if self._fds:
            return self._pread_windows(starts, length)
        if len(self._parts) == 1:
            return gather_windows(self._parts[0], starts, length)
        out = np.empty((len(starts), length), dtype=self.dtype)
        first = self._locate(starts)
        last = self._locate(starts + (length - 1))
        inside = first == last
        for shard in distinct(first[inside]).tolist():
            rows = np.flatnonzero(inside & (first == shard))
            out[rows] = gather_windows(self._parts[shard], starts[rows] - self._bounds[shard], length)
        for row in np.flatnonzero(~inside).tolist():
            out[row] = self._slice(int(starts[row]), int(starts[row]) + length)
        return out

    def _pread_windows(self, starts: npt.NDArray[np.int64], length: int) -> Array:
        """``_gather`` with one ``preadv`` per window piece, straight into the output rows."""
        n = len(starts)
        out = np.empty((n, length), dtype=self.dtype)
        if n == 0 or length == 0:
            return out
        item = self.dtype.itemsize
        row = length * item
        flat = out.reshape(-1).view(np.uint8).data
        first = self._locate(starts)
        inside = first == self._locate(starts + (length - 1))
        offsets = ((starts - self._bounds[first]) * item).tolist()
        shards, fds, preadv = first.tolist(), self._fds, os.preadv
        for i, (k, off, whole) in enumerate(zip(shards, offsets, inside.tolist(), strict=True)):
            if whole:
                if preadv(fds[k], (flat[i * row : (i + 1) * row],), off) != row:
                    self._short(k)
            else:  # a window across shard boundaries
                self._pread_span(flat, i * row, int(starts[i]), int(starts[i]) + length)
        return out

    def _pread_span(self, flat: memoryview, dest: int, pos: int, end: int) -> None:
        """Read elements ``[pos, end)`` into ``flat[dest:]`` (bytes), one ``preadv`` per shard."""
        item = self.dtype.itemsize
        while pos < end:
            k = int(self._locate(np.asarray([pos]))[0])
            stop = min(end, int(self._bounds[k + 1]))
            nbytes = (stop - pos) * item
            if (
                os.preadv(self._fds[k], (flat[dest : dest + nbytes],), (pos - int(self._bounds[k])) * item)
                != nbytes
            ):
                self._short(k)
            pos, dest = stop, dest + nbytes

    def spans(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> tuple[Array, list[int]]:
        """Elements ``[starts[i], stops[i])`` for each ``i``, back to back in one new buffer, and
        the bounds of each span in it."""
        bounds = [0, *np.cumsum(stops - starts).tolist()]
        buffer = np.empty(bounds[-1], dtype=self.dtype)
        self.spans_into(starts, stops, buffer, bounds)
        return buffer, bounds

    def spans_into(
        self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64], out: Array, at: Sequence[int]
    ) -> None:
        """Elements ``[starts[i], stops[i])`` copied into the flat array ``out`` (of this dtype)
        at ``at[i]``, for each ``i`` (``at`` may hold one more entry, unused)."""
        self._read(
            self._touched(starts, stops),
            lambda: self.ensure(starts, stops),
            lambda: self._spans(starts, stops, out, at),
        )
        if not self._fds:
            self.account(len(starts), int((stops - starts).sum()) * self.dtype.itemsize)

    def _spans(
        self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64], out: Array, at: Sequence[int]
    ) -> Array:
        if not self._fds:
            self._copy_spans(starts, stops, out, at)
            return out
        flat, item = out.view(np.uint8).data, self.dtype.itemsize
        for dest, pos, end in zip(at, starts.tolist(), stops.tolist(), strict=False):
            self._pread_span(flat, dest * item, pos, end)
        return out

    def _copy_spans(
        self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64], out: Array, at: Sequence[int]
    ) -> None:
        """Spans copied from the maps into ``out`` at ``at``: a ``memoryview`` slice assignment per
        span (a fraction of a microsecond, where a numpy slice and a concatenation cost several,
        and a gather through an index of every element costs more than both)."""
        if not len(starts) or not self._parts:
            return
        dest, item, base = out.view(np.uint8).data, self.dtype.itemsize, self._bounds.tolist()
        maps = self._bytes
        first = self._locate(starts).tolist()
        last = self._locate(np.maximum(stops - 1, starts)).tolist()
        spans = zip(starts.tolist(), stops.tolist(), first, last, at, strict=False)
        for a, b, k, j, to in spans:
            if b <= a:  # an empty span: nothing to copy (at the very end, k is past the last shard)
                continue
            if k == j:
                dest[to * item : (to + b - a) * item] = maps[k][(a - base[k]) * item : (b - base[k]) * item]
            else:  # across shards
                out[to : to + b - a] = self._slice(a, b)

    def _short(self, k: int) -> None:
        raise DatasetIntegrityError(
            f"{self._paths[k]}: the file is shorter than when it was opened (it was truncated or "
            "replaced); open the dataset again"
        )

    def slice(self, start: int, stop: int) -> Array:
        """Elements ``[start, stop)``: a copy where they lie in a mapped file (a view of a file
        that may change would escape every check), a view of a file read whole at open."""
        a, b = np.asarray([start], np.int64), np.asarray([stop], np.int64)
        out = self._read(
            self._touched(a, b), lambda: self.ensure(a, b), lambda: self._own(self._slice(start, stop))
        )
        if self._bases is not None:
            positions = np.arange(start, max(start, stop), dtype=np.int64)
            return add_bases(out, positions, self._bases)
        return out

    def _own(self, out: Array) -> Array:
        """``out``, copied where it may be a view of a map."""
        return out.copy() if self._maps and not out.flags.owndata else out

    def _slice(self, start: int, stop: int) -> Array:
        if self._fds:
            out = np.empty(max(0, stop - start), dtype=self.dtype)
            self._pread_span(out.view(np.uint8).data, 0, start, stop)
            return out
        if start >= stop:
            return self._parts[0][:0] if self._parts else np.empty(0, self.dtype)
        k = int(self._locate(np.asarray([start]))[0])
        base = int(self._bounds[k])
        if stop <= self._bounds[k + 1]:
            return self._parts[k][start - base : stop - base]
        pieces = []
        pos = start
        while pos < stop:
            k = int(self._locate(np.asarray([pos]))[0])
            end = min(stop, int(self._bounds[k + 1]))
            pieces.append(self._parts[k][pos - int(self._bounds[k]) : end - int(self._bounds[k])])
            pos = end
        return np.concatenate(pieces)

    def take(self, positions: npt.NDArray[np.int64]) -> Array:
        """Elements at ``positions``."""
        out = self._read(
            self._touched(positions, positions + 1),
            lambda: self.ensure(positions, positions + 1),
            lambda: self._take(positions),
        )
        if self._bases is not None:
            out = add_bases(out.copy(), positions, self._bases)
        return out

    def _take(self, positions: npt.NDArray[np.int64]) -> Array:
        if self._fds:
            return np.asarray([self._slice(p, p + 1)[0] for p in positions.tolist()], dtype=self.dtype)
        if len(self._parts) == 1:
            return self._parts[0][positions]
        shard = self._locate(positions)
        out = np.empty(len(positions), dtype=self.dtype)
        for k in distinct(shard).tolist():
            sel = shard == k
            out[sel] = self._parts[k][positions[sel] - self._bounds[k]]
        return out
