"""What ``StatefulDataLoader.stats()`` reports: the loader's delivery counters and the storage's
read counters since the current epoch began.

Kept apart from the loader's checkpoint state: these figures are for logging only, they are
never saved in a checkpoint, and no position depends on them.
"""

from __future__ import annotations

from typing import Any

from guideloom._datasets import DatasetAbstract

__all__ = ["LoaderFigures"]


class LoaderFigures:
    """A loader's figures: ``counts`` (batches, samples, wait seconds), which its iterators add
    to as they hand batches over, and the storage's read counters at the epoch's start."""

    __slots__ = ("counts", "reads_mark")

    def __init__(self) -> None:
        self.counts: dict[str, float] = {
            "batches": 0,
            "samples": 0,
            "wait_seconds": 0.0,
            "last_wait_seconds": 0.0,
        }
        self.reads_mark: tuple[int, int, int] | None = None

    def waited(self, seconds: float) -> None:
        """The consumer waited ``seconds`` for its last batch."""
        counts = self.counts
        counts["wait_seconds"] += seconds
        counts["last_wait_seconds"] = seconds

    def delivered(self, samples: int) -> None:
        """A batch of ``samples`` reached the consumer."""
        counts = self.counts
        counts["batches"] += 1
        counts["samples"] += samples

    def report(self, dataset: DatasetAbstract[Any], *, epoch: int, offset: int) -> dict[str, float]:
        """``loader.stats()`` at position ``(epoch, offset)``, less the order's figures."""
        out = dict(self.counts)
        reads = _storage_reads(dataset)
        if reads is not None:
            mark = self.reads_mark if self.reads_mark is not None else (epoch, 0, 0)
            out["requests"], out["bytes_read"] = reads
            out["epoch_requests"] = reads[0] - mark[1]
            out["epoch_bytes_read"] = reads[1] - mark[2]
        out.update(dataset.position_stats(epoch=epoch, offset=offset))
        return out

    def mark_epoch_reads(self, dataset: DatasetAbstract[Any], epoch: int) -> None:
        """At an iterator's start: the storage's counters, the first time in ``epoch`` (what
        ``stats()`` counts an epoch's requests and bytes from)."""
        if self.reads_mark is None or self.reads_mark[0] != epoch:
            reads = _storage_reads(dataset)
            if reads is not None:
                self.reads_mark = (epoch, *reads)


def _storage_reads(dataset: DatasetAbstract[Any]) -> tuple[int, int] | None:
    """Requests and bytes read so far by the dataset's storage, where it counts them (object
    storage); None elsewhere."""
    storage = dataset.storage
    return None if storage is None else storage.read_counts()
