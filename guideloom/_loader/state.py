"""The loader's state and its side of the checkpoint.

:class:`LoaderState` is everything a loader changes apart from its parameters: the checkpoint
position, the lifecycle, the figures. The facade makes one and hands it to each of its parts,
which see nothing else of the facade but its public parameters (:class:`~guideloom._loader.host.Loader`);
:meth:`LoaderState.plan_epoch` plans an epoch from both.

The rest: what ``state_dict()`` saves, what a checkpoint is checked against on load, and the
order of an epoch, which is built from the same resolved shuffle blocks that a checkpoint
records. The checks themselves are pure (:mod:`guideloom._core.checkpoint`)."""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass, field
from typing import Any

from guideloom._core.checkpoint import CheckpointState, LoaderIdentity
from guideloom._core.group_order import GroupPermutation
from guideloom._core.order import Order, make_order, resolve_block_size
from guideloom._core.plan import Counting, EpochPlan
from guideloom._core.provenance import History
from guideloom._loader.arguments import resolve_collate_mode
from guideloom._loader.figures import LoaderFigures
from guideloom._loader.host import Loader
from guideloom._loader.lifecycle import Lifecycle
from guideloom._runtime.config import PipelineConfig
from guideloom.types import DatasetFingerprint, StatefulDataLoaderStateDict

__all__ = [
    "LoaderState",
    "begin_run",
    "block_size",
    "epoch_order",
    "identity_to_restore",
    "save_state",
    "window",
]


@dataclass(eq=False, slots=True)
class LoaderState:
    """What a loader changes as it runs, in one object its parts are handed: the checkpoint
    position (``ckpt``), whether it is open, its active iterator and workers (``life``), and what
    ``stats()`` reports (``figures``). Holds no reference to its loader (a loader collected
    without ``close()`` is collected at once, and its finalizer stops its workers)."""

    ckpt: CheckpointState = field(default_factory=CheckpointState)
    life: Lifecycle = field(default_factory=Lifecycle)
    figures: LoaderFigures = field(default_factory=LoaderFigures)

    def begin_workers(self, loader: Loader[Any]) -> None:
        """At ``open()``: begin starting ``loader``'s persistent process workers (the zygote
        forked from this process, then each worker from it, on the pool's starter thread), so
        that they start while the dataset opens here and the first iterator plans its epoch,
        instead of after. Nothing where the loader runs none; a pool that cannot be made here is
        left to the first iterator, which raises what stops it."""
        if loader.parallel_method != "process" or loader.num_workers == 0 or not loader.persistent_workers:
            return
        if resolve_collate_mode(loader.collate_mode, loader.parallel_method, loader.num_workers) == "inline":
            return
        dataset = loader.dataset
        try:
            collate = dataset._collate_with(loader.collate_fn)
            self.life.worker_pool(loader, dataset, collate, loader.num_workers).begin()
        except Exception:
            return

    def plan_epoch(self, loader: Loader[Any]) -> PipelineConfig:
        """The pipeline of the next epoch, from ``loader``'s parameters and this position: what
        an iterator runs. The facade plans a sync ``for`` with it before its iterator starts;
        an ``async for`` plans with it at its first batch, once the loader is open."""
        # set to None between iterators: the default again
        mode = resolve_collate_mode(loader.collate_mode, loader.parallel_method, loader.num_workers)
        loader.collate_mode = mode
        # Pinned inline: batches made on request by the loader itself, as at num_workers=0 and
        # prefetch=0; no worker is started.
        inline = loader.collate_mode == "inline"
        num_workers, prefetch = (0, 0) if inline else (loader.num_workers, loader.prefetch)
        if loader.parallel_method == "process" and num_workers > 0:
            try:
                pickle.dumps(loader.collate_fn)
            except Exception as exc:
                raise TypeError(
                    "parallel_method='process' needs a picklable collate_fn (a module-level "
                    f"function or a picklable object), got {loader.collate_fn!r}: {exc}. Use "
                    "parallel_method='thread' for closures and lambdas"
                ) from exc
        dataset, ckpt = loader.dataset, self.ckpt
        self.figures.mark_epoch_reads(dataset, ckpt.epoch)
        begin_run(loader, ckpt)
        order = epoch_order(loader, ckpt, ckpt.epoch)
        # an order counted as the epoch goes (packed text, counted block by block as it is first
        # read): the plan learns the epoch's length from it, and needs it only at its end
        counting = order if isinstance(order, Counting) and order.total is None else None
        n = -1 if counting is not None else len(dataset)
        collate = dataset._collate_with(loader.collate_fn)  # a dataset's step (tokenizing) first
        return PipelineConfig(
            dataset=dataset,
            plan=EpochPlan(
                num_observations=n,
                local_batch_size=loader.local_batch_size,
                world_size=loader.world_size,
                rank=loader.rank,
                drop_last=loader.drop_last,
                start_offset=ckpt.offset,
                order=order,
                counting=counting,
            ),
            order=order,
            collate_fn=collate,
            device=loader.device,
            pin_memory=loader.pin_memory,
            num_workers=num_workers,
            parallel_method=loader.parallel_method,
            prefetch=prefetch,
            worker_pool=functools.partial(self.life.worker_pool, loader, dataset, collate, loader.num_workers)
            if loader.persistent_workers and not inline
            else None,
        )


def block_size(loader: Loader[Any]) -> int:
    """Samples per shuffle block, ``shuffle_block_size`` resolved (``"auto"``: the storage's).

    Without shuffle the order is the identity, and a dataset that makes its own order (a
    mixture) ignores blocks: 1 for both, whatever was asked (nothing to record or warn about).
    """
    if not loader.shuffle or loader.dataset._own_order():
        return 1
    if loader.shuffle_block_size != "auto":  # the storage is asked only for "auto"
        return resolve_block_size(loader.shuffle_block_size, block_bytes=None, sample_nbytes=0)
    natural = loader.dataset._natural_blocks()
    if natural is not None and len(natural):  # recorded as their mean size; the files pin them
        return max(2, round(int(natural.sum()) / len(natural)))
    hints = loader.dataset.read_hints
    return resolve_block_size(
        "auto", block_bytes=hints.shuffle_block_bytes, sample_nbytes=hints.sample_nbytes
    )


def window(loader: Loader[Any]) -> int:
    """Blocks per mixing window that the order uses (1 where blocks are single samples)."""
    return loader.shuffle_window if block_size(loader) > 1 else 1


def epoch_order(loader: Loader[Any], ckpt: CheckpointState, epoch: int) -> Order:
    """The order of ``epoch``: the dataset's own where it makes one (a mixture), otherwise
    identity, global row shuffle or block shuffle."""
    own = loader.dataset._loader_order(shuffle=loader.shuffle, seed=ckpt.order_seed, epoch=epoch)
    if own is not None:
        return own
    natural = (
        loader.dataset._natural_blocks() if loader.shuffle and loader.shuffle_block_size == "auto" else None
    )
    if natural is not None and len(natural):  # blocks of the storage's own (row groups)
        return GroupPermutation(natural, seed=ckpt.order_seed, epoch=epoch, window=window(loader))
    return make_order(
        len(loader.dataset),
        shuffle=loader.shuffle,
        seed=ckpt.order_seed,
        epoch=epoch,
        block_size=block_size(loader),
        window=window(loader),
    )


def _loader_fingerprint(loader: Loader[Any], state: LoaderState) -> DatasetFingerprint:
    """The dataset's fingerprint, computed once while open (a manifest digest walks every
    file entry; a storage may know its length only once open)."""
    ckpt = state.ckpt
    if ckpt.fingerprint is not None:
        return ckpt.fingerprint
    fp = loader.dataset._fingerprint()
    if state.life.state != "closed" and fp["observations"] >= 0:
        ckpt.fingerprint = fp  # (one counted as read, -1, is asked again: its count completes)
    return fp


def save_state(
    loader: Loader[Any], state: LoaderState, *, committed: bool = False
) -> StatefulDataLoaderStateDict:
    """``loader.state_dict()``: its position and what the position means; ``committed``: the
    position of the last commit, the history cut there."""
    ckpt = state.ckpt
    offset, history = ckpt.offset, ckpt.history
    if committed:
        offset, history = ckpt.committed, History(history.segments, dropped=history.dropped)
        history.truncate(ckpt.epoch, offset)
    saved = StatefulDataLoaderStateDict(
        epoch=ckpt.epoch,
        observation_offset=offset,
        shuffle=loader.shuffle,
        shuffle_seed=loader.shuffle_seed,
        drop_last=loader.drop_last,
        dataset=_loader_fingerprint(loader, state),
    )
    # always there, "" before the first iterator: torch.distributed.checkpoint loads the keys of
    # the loading side's state_dict() only, so a fresh loader's must have it too
    saved["history"] = history.encode()
    counts = loader.dataset._count_state()
    if counts is not None:  # a dataset counted as it reads: a resume elsewhere need not count again
        saved["counts"] = counts
    block = block_size(loader)
    if block > 1:  # a global shuffle's checkpoint stays as it was: no key means blocks of 1
        saved["shuffle_block_size"] = block
        saved["shuffle_window"] = window(loader)
        # what the loader was given: over a storage's own blocks (row groups), "auto" is another
        # order than any size, and a message names what the user passed
        saved["shuffle_block_auto"] = loader.shuffle_block_size == "auto"
    return saved


def identity_to_restore(loader: Loader[Any], state: LoaderState) -> LoaderIdentity:
    """What ``loader.load_state_dict()`` checks a checkpoint against (under the loader's lock;
    refused while an iterator is active). The method calls :func:`restore_position` itself, so
    that its warnings point at the caller's line."""
    if state.life.active.get() is not None:
        raise RuntimeError(
            "load_state_dict() was called while an iterator on this loader is active; "
            "exhaust or close the iterator first, then load the checkpoint"
        )
    return LoaderIdentity(
        loader.shuffle,
        loader.shuffle_seed,
        loader.drop_last,
        _loader_fingerprint(loader, state),
        shuffle_block_size=block_size(loader),
        shuffle_window=window(loader),
        shuffle_block_option=loader.shuffle_block_size,
        storage_blocks=_has_storage_blocks(loader),
    )


def _has_storage_blocks(loader: Loader[Any]) -> bool:
    """Whether the loader's dataset has shuffle blocks of its own, which ``"auto"`` keeps."""
    if not loader.shuffle or loader.dataset._own_order():
        return False
    natural = loader.dataset._natural_blocks()
    return natural is not None and len(natural) > 0


def begin_run(loader: Loader[Any], ckpt: CheckpointState) -> None:
    """An iterator starts at the loader's position: its batch geometry joins the history (a new
    segment where it differs from the last), and a tally of another epoch starts afresh."""
    ckpt.history.begin(ckpt.epoch, ckpt.offset, loader.local_batch_size, loader.world_size)
    if ckpt.tally.epoch != ckpt.epoch:
        ckpt.tally.reset(ckpt.epoch, ckpt.offset)
