"""The loader's side of provenance and the audit: ``explain()`` maps a step to the samples it
read through the checkpoint's history, the epoch's order and the dataset's own account of a
sample; ``audit()`` adds the ranks' tallies up (over ``torch.distributed`` where it runs) and
compares them with the plan. The arithmetic is pure (:mod:`guideloom._core.provenance`,
:mod:`guideloom._core.audit`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from guideloom._core.audit import MODULUS, AuditReport, RankTally, audit_base, compare, run_summary
from guideloom._core.checkpoint import CheckpointState
from guideloom._core.order import Order
from guideloom._core.plan import UNBOUNDED, Counting, num_batches
from guideloom._core.provenance import MAX_SEGMENTS, History, Segment, block
from guideloom._core.text import plural
from guideloom._loader.host import Loader
from guideloom._loader.state import LoaderState, epoch_order

__all__ = ["audit_ranks", "explain_step"]


def _segment(loader: Loader[Any], ckpt: CheckpointState, epoch: int, step: int) -> Segment:
    """The segment of the history that ``step`` of ``epoch`` lies in (the current epoch's steps
    not taken yet: those the loader's geometry will take from its position)."""
    b, w = loader.local_batch_size, loader.world_size
    if epoch > ckpt.epoch:
        return Segment(epoch, 0, 0, b, w)
    history = History(ckpt.history.segments, dropped=ckpt.history.dropped)
    if epoch == ckpt.epoch:
        history.begin(epoch, ckpt.offset, b, w)
    seg = history.segment(epoch, step)
    if seg is None:
        mine = history.of_epoch(epoch)
        if not mine:
            raise ValueError(
                f"the loader keeps the history of epochs {ckpt.epoch - 1} and {ckpt.epoch} only: "
                f"epoch {epoch} is before them"
            )
        if history.dropped:
            raise ValueError(
                f"epoch {epoch} has no history before step {mine[0].step}: the loader keeps the last "
                f"{MAX_SEGMENTS} changes of batch size or world size, and this epoch had more"
            )
        raise ValueError(
            f"epoch {epoch} has no history before step {mine[0].step} (the checkpoint it resumed "
            "from was saved by a loader that kept none)"
        )
    return seg


def explain_step(
    loader: Loader[Any], state: LoaderState, step: int, *, rank: int | None, epoch: int | None
) -> list[dict[str, Any]]:
    """``loader.explain()``: see :meth:`StatefulDataLoader.explain`."""
    ckpt = state.ckpt
    epoch = ckpt.epoch if epoch is None else epoch
    rank = loader.rank if rank is None else rank
    for name, value in (("step", step), ("rank", rank), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    owns_open = state.life.state == "closed"
    if owns_open:
        loader.open()
    try:
        seg = _segment(loader, ckpt, int(epoch), int(step))
        if rank >= seg.world_size:
            raise IndexError(
                f"rank {rank} outside [0, {seg.world_size}): step {step} ran on "
                f"{plural(seg.world_size, 'rank')}"
            )
        order = epoch_order(loader, ckpt, int(epoch))
        n = _observations(loader, order, seg.offset + (int(step) - seg.step + 1) * seg.global_batch_size)
        steps = seg.step + num_batches(n, seg.global_batch_size, loader.drop_last, seg.offset)
        if step >= steps:
            raise IndexError(f"step {step} outside epoch {epoch}, which has {plural(steps, 'step')}")
        start, stop = block(seg, int(step), int(rank), n)
        indices = order.take(np.arange(start, stop, dtype=np.int64)).tolist()
        dataset = loader.dataset
        out: list[dict[str, Any]] = []
        for position, index in zip(range(start, stop), indices, strict=True):
            record: dict[str, Any] = {
                "epoch": int(epoch),
                "step": int(step),
                "rank": int(rank),
                "position": position,
                "index": index,
            }
            record.update(dataset.describe(index))
            out.append(record)
        return out
    finally:
        if owns_open:
            loader.close()


def _observations(loader: Loader[Any], order: Order, end: int) -> int:
    """The epoch's observations; for an order counted as the epoch goes, counted only as far as
    position ``end`` needs (a later step's batch may be the last: past the count, the epoch's
    end is not known, and the step is taken to exist)."""
    if not isinstance(order, Counting) or order.total is not None:
        return len(loader.dataset)
    while order.total is None and order.known < end:
        order.count_sync()
    return order.total if order.total is not None else UNBOUNDED


def _distributed() -> Any:
    """``torch.distributed`` where a process group is up with more than one rank, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - exercised only without torch
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _mine(loader: Loader[Any], ckpt: CheckpointState) -> RankTally:
    """This rank's tally: its runs, and their count and digest."""
    t = ckpt.tally
    runs = t.current()
    x = audit_base(t.epoch)
    inverse = pow(x - 1, MODULUS - 2, MODULUS)
    n = len(loader.dataset)
    count = digest = 0
    for run in runs:
        c, d = run_summary(run, n, x, inverse)
        count, digest = count + c, (digest + d) % MODULUS
    return RankTally(t.epoch, t.start, ckpt.offset, count, digest, tuple(tuple(r) for r in runs))


def audit_ranks(loader: Loader[Any], state: LoaderState) -> AuditReport:
    """``loader.audit()``: see :meth:`StatefulDataLoader.audit`."""
    if not loader.track_deliveries:
        raise RuntimeError(
            "audit() needs the deliveries tallied: construct the loader with track_deliveries=True"
        )
    ckpt = state.ckpt
    mine = _mine(loader, ckpt)
    n = len(loader.dataset)
    x = audit_base(mine.epoch)

    def judge(tallies: list[RankTally]) -> AuditReport:
        return compare(
            tallies,
            num_observations=n,
            x=x,
            history=ckpt.history,
            geometry=(loader.local_batch_size, loader.world_size),
        )

    dist = _distributed()
    if dist is None:
        wider = [
            s.world_size
            for s in ckpt.history.of_epoch(mine.epoch)
            if s.world_size > 1 and s.offset >= mine.start
        ]
        if wider and loader.world_size == 1:
            raise RuntimeError(
                f"audit() of one process: this epoch was read with world_size={max(wider)} since the "
                "tally began, and the other ranks' batches are theirs to count: initialise "
                "torch.distributed over those ranks, or audit from a checkpoint taken after the change"
            )
        if loader.world_size != 1:
            raise RuntimeError(
                f"audit() of a loader with world_size={loader.world_size} needs every rank's tally: "
                "initialise torch.distributed (the ranks' group) and call audit() on every rank"
            )
        return judge([mine])
    if dist.get_world_size() != loader.world_size:
        raise RuntimeError(
            f"torch.distributed has {plural(dist.get_world_size(), 'rank')}, the loader's world_size is "
            f"{loader.world_size}: audit() sums the tallies of the loader's ranks"
        )
    import torch

    low, high = mine.digest & ((1 << 31) - 1), mine.digest >> 31
    sums = torch.tensor([mine.count, low, high], dtype=torch.int64)
    spans = torch.tensor(
        [mine.epoch, -mine.epoch, mine.start, -mine.start, mine.offset, -mine.offset], dtype=torch.int64
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(spans, op=dist.ReduceOp.MAX)
    e_max, e_min, s_max, s_min, o_max, o_min = spans.tolist()
    if (e_max, s_max, o_max) == (-e_min, -s_min, -o_min):
        count, low, high = sums.tolist()
        report = judge([RankTally(e_max, s_max, o_max, count, low + (high << 31), ())])
        if report.ok:
            return report
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return judge([t for t in gathered if isinstance(t, RankTally)])
