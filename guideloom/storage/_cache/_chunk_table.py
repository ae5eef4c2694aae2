"""The chunk cache's table: which chunk of which object holds which bytes, how planned
reads use them, and how a read is routed to local chunks or the store. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import numpy as np
import numpy.typing as npt

from guideloom.storage._format._manifest import Manifest
from guideloom.storage._remote._ranges import Job, Layout, pieces_of, pieces_table

__all__ = ["BLOCK", "ChunkTable", "blocks_of", "route"]

I64 = npt.NDArray[np.int64]


#: Space is counted in blocks of this many bytes (a file takes whole blocks on disk).
BLOCK: Final = 4096


def blocks_of(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


class ChunkTable:
    """Every data object cut into aligned chunks; chunk ids are global across objects."""

    def __init__(self, manifest: Manifest, chunk_bytes: int) -> None:
        files: dict[str, tuple[int, str]] = {}
        for _name, _spec, f in manifest.all_files():
            files[f.path] = (f.nbytes, f.sha256)
        self.chunk = chunk_bytes
        self.paths = sorted(files)
        self.index = {p: i for i, p in enumerate(self.paths)}
        self.sizes = [files[p][0] for p in self.paths]
        self.sha256 = [files[p][1] for p in self.paths]
        counts = [-(-s // chunk_bytes) for s in self.sizes]
        self.base = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.count = int(self.base[-1])

    def span(self, gid: int) -> tuple[int, int, int]:
        """(object index, first byte, end byte) of chunk ``gid``."""
        f = int(np.searchsorted(self.base, gid, side="right")) - 1
        start = (gid - int(self.base[f])) * self.chunk
        return f, start, min(self.sizes[f], start + self.chunk)

    def nbytes(self, gid: int) -> int:
        _f, s, e = self.span(gid)
        return e - s

    def gids(self, path: str, start: int, end: int) -> range:
        """Chunks that bytes ``[start, end)`` of object ``path`` touch."""
        b = int(self.base[self.index[path]])
        return range(b + start // self.chunk, b + (end - 1) // self.chunk + 1)

    def of_rows(self, layouts: Mapping[str, Layout], starts: I64, length: int) -> I64:
        """Sorted distinct chunks that stream windows ``[s, s + length)`` (elements) touch."""
        return self.use_of_rows(layouts, starts, length)[0]

    def use_of_rows(self, layouts: Mapping[str, Layout], starts: I64, length: int) -> tuple[I64, I64]:
        """:meth:`of_rows` and the bytes the windows read from each of those chunks."""
        n = len(starts)
        parts = [
            self.use_of_spans(
                layout, starts * layout.dtype.itemsize, np.full(n, length * layout.dtype.itemsize)
            )
            for layout in layouts.values()
        ]
        return _merge([g for g, _b in parts], [b for _g, b in parts])

    def of_spans(self, layout: Layout, starts: I64, lengths: I64) -> I64:
        """Sorted distinct chunks that bytes ``[s, s + n)`` of ``layout``'s array touch."""
        return self.use_of_spans(layout, starts, lengths)[0]

    def use_of_spans(self, layout: Layout, starts: I64, lengths: I64) -> tuple[I64, I64]:
        """:meth:`of_spans` and the bytes of the spans that lie in each of those chunks."""
        lengths = np.asarray(lengths, dtype=np.int64)
        k, lo, n, _d = pieces_of(
            layout, np.asarray(starts, dtype=np.int64), lengths, np.zeros(len(lengths), np.int64)
        )
        if not len(k):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        fidx = np.asarray([self.index[p] for p in layout.paths], dtype=np.int64)[k]
        base = self.base[fidx]
        first = base + lo // self.chunk
        last = base + (lo + n - 1) // self.chunk
        one = first == last
        extra_g: list[int] = []
        extra_b: list[int] = []
        for i in np.flatnonzero(~one).tolist():  # a span across chunks: each chunk its part
            s, e = int(lo[i]), int(lo[i] + n[i])
            for g in range(int(first[i]), int(last[i]) + 1):
                cs = (g - int(base[i])) * self.chunk
                extra_g.append(g)
                extra_b.append(min(e, cs + self.chunk) - max(s, cs))
        gids = [first[one], np.asarray(extra_g, dtype=np.int64)]
        return _merge(gids, [n[one], np.asarray(extra_b, dtype=np.int64)])


def _merge(gids: list[I64], nbytes: list[I64]) -> tuple[I64, I64]:
    """Sorted distinct chunks of ``gids`` and the sum of ``nbytes`` for each."""
    if not gids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    out, inverse = np.unique(np.concatenate(gids), return_inverse=True)
    used = np.bincount(inverse.reshape(-1), weights=np.concatenate(nbytes), minlength=len(out))
    return out.astype(np.int64), used.astype(np.int64)


def route(
    table: ChunkTable, jobs: list[Job], here: Callable[[int], bool]
) -> tuple[list[Job], list[int], list[Job]]:
    """Where a read's ranges are served: each part of a chunk that is ``here`` as a one-range local
    job (listed with its chunk, to pin), the rest as remote ranges. No state of its own: apart
    from ``ChunkCache._split``, which only adds the lock and the pins around it."""
    local: list[Job] = []
    pins: list[int] = []
    far: list[Job] = []
    for job in jobs:
        rest = Job(job.path, job.dest)
        for s, e, p in zip(job.starts, job.ends, job.pieces, strict=True):
            gids = table.gids(job.path, s, e)
            # A range is cut at chunk boundaries: each chunk's part is read where that
            # chunk is; consecutive parts of absent chunks stay one remote range.
            listed: list[tuple[int, int, int]] = p.tolist()
            parts = [(s, e, listed)] if len(gids) == 1 else _cut(table, gids, s, e, listed)
            run: tuple[int, int, list[tuple[int, int, int]]] | None = None
            for g, (ps, pe, pp) in zip(gids, parts, strict=True):
                if not pp:  # a chunk the range only spans (widened to whole blocks): not read
                    if run is not None:
                        rest.starts.append(run[0])
                        rest.ends.append(run[1])
                        rest.pieces.append(pieces_table(run[2]))
                        run = None
                    continue
                if here(g):
                    local.append(Job(job.path, job.dest, [ps], [pe], [pieces_table(pp)]))
                    pins.append(g)
                    continue
                if run is not None and run[1] == ps:
                    run = (run[0], pe, run[2] + pp)
                    continue
                if run is not None:
                    rest.starts.append(run[0])
                    rest.ends.append(run[1])
                    rest.pieces.append(pieces_table(run[2]))
                run = (ps, pe, list(pp))
            if run is not None:
                rest.starts.append(run[0])
                rest.ends.append(run[1])
                rest.pieces.append(pieces_table(run[2]))
        if rest.starts:
            far.append(rest)
    return local, pins, far


def _cut(
    table: ChunkTable, gids: range, s: int, e: int, pieces: list[tuple[int, int, int]]
) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Range ``[s, e)`` and its pieces (object offset, length, destination offset), cut into
    one part per chunk of ``gids``."""
    out = []
    for g in gids:
        _f, cs, ce = table.span(g)
        lo, hi = max(s, cs), min(e, ce)
        mine = []
        for ps, pl, pd in pieces:
            a, b = max(ps, lo), min(ps + pl, hi)
            if a < b:
                mine.append((a, b - a, pd + a - ps))
        out.append((lo, hi, mine))
    return out
