"""What ``StatefulDataLoader.stats()`` reports: the loader's delivery counters (where each batch
was collated among them), the workers chooser's last verdict, and the storage's read counters
since the current epoch began.

Kept apart from the loader's checkpoint state: these figures are for logging only, they are
never saved in a checkpoint, and no position depends on them.
"""

from __future__ import annotations

from typing import Any

from guideloom._datasets import DatasetAbstract
from guideloom._runtime.chooser import Verdict

__all__ = ["PLACES", "LoaderFigures", "verdict_figures"]

#: Where a batch can be collated, as ``stats()`` counts them (``collated_<place>``).
PLACES = ("inline", "threads", "processes")


class LoaderFigures:
    """A loader's figures: ``counts`` (batches, samples, wait seconds, batches by where they were
    collated), which its iterators add to as they hand batches over, and the storage's read
    counters at the epoch's start."""

    __slots__ = ("counts", "reads_mark")

    def __init__(self) -> None:
        self.counts: dict[str, float] = {
            "batches": 0,
            "samples": 0,
            "wait_seconds": 0.0,
            "last_wait_seconds": 0.0,
            **{f"collated_{place}": 0 for place in PLACES},
        }
        self.reads_mark: tuple[int, int, int] | None = None

    def waited(self, seconds: float) -> None:
        """The consumer waited ``seconds`` for its last batch."""
        counts = self.counts
        counts["wait_seconds"] += seconds
        counts["last_wait_seconds"] = seconds

    def delivered(self, samples: int, place: str) -> None:
        """A batch of ``samples``, collated at ``place`` (one of :data:`PLACES`), reached the
        consumer."""
        counts = self.counts
        counts["batches"] += 1
        counts["samples"] += samples
        counts["collated_" + place] += 1

    def report(self, dataset: DatasetAbstract[Any], *, epoch: int, offset: int) -> dict[str, float]:
        """``loader.stats()`` at position ``(epoch, offset)``, less the order's figures."""
        out = dict(self.counts)
        reads = _storage_reads(dataset)
        if reads is not None:
            mark = self.reads_mark if self.reads_mark is not None else (epoch, 0, 0)
            out["requests"], out["bytes_read"] = reads
            out["epoch_requests"] = reads[0] - mark[1]
            out["epoch_bytes_read"] = reads[1] - mark[2]
        out.update(dataset._position_stats(epoch=epoch, offset=offset))
        return out

    def mark_epoch_reads(self, dataset: DatasetAbstract[Any], epoch: int) -> None:
        """At an iterator's start: the storage's counters, the first time in ``epoch`` (what
        ``stats()`` counts an epoch's requests and bytes from)."""
        if self.reads_mark is None or self.reads_mark[0] != epoch:
            reads = _storage_reads(dataset)
            if reads is not None:
                self.reads_mark = (epoch, *reads)


def verdict_figures(verdict: Verdict | None) -> dict[str, float]:
    """``stats()``'s figures of the workers chooser's last ``verdict`` (none before it made one):
    ``chooser_workers`` (1 the workers, 0 inline), what a batch cost each way
    (``chooser_workers_seconds``, ``chooser_inline_seconds``; NaN where not measured) and
    ``chooser_verdicts``, the number of choices made so far."""
    if verdict is None:
        return {}
    return {
        "chooser_workers": float(verdict.workers),
        "chooser_workers_seconds": verdict.workers_seconds,
        "chooser_inline_seconds": verdict.inline_seconds,
        "chooser_verdicts": verdict.made,
    }


def _storage_reads(dataset: DatasetAbstract[Any]) -> tuple[int, int] | None:
    """Requests and bytes read so far by the dataset's storage, where it counts them (object
    storage); None elsewhere."""
    storage = dataset.storage
    return None if storage is None else storage.read_counts()
