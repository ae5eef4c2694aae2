"""The loader's side of its checkpoint: what ``state_dict()`` saves, what a checkpoint is
checked against on load, and the order of an epoch, which is built from the same resolved
shuffle blocks that a checkpoint records. The checks themselves are pure
(:mod:`guideloom._core.checkpoint`)."""

from __future__ import annotations

from typing import Any

from guideloom._core.checkpoint import LoaderIdentity
from guideloom._core.group_order import GroupPermutation
from guideloom._core.order import Order, make_order, resolve_block_size
from guideloom._core.provenance import History
from guideloom._loader.host import Loader
from guideloom.types import DatasetFingerprint, StatefulDataLoaderStateDict

__all__ = ["begin_run", "block_size", "epoch_order", "identity_to_restore", "save_state", "window"]


def block_size(loader: Loader[Any]) -> int:
    """Samples per shuffle block, ``shuffle_block_size`` resolved (``"auto"``: the storage's).

    Without shuffle the order is the identity, and a dataset that makes its own order (a
    mixture) ignores blocks: 1 for both, whatever was asked (nothing to record or warn about).
    """
    if not loader.shuffle or loader.dataset.makes_own_order:
        return 1
    if loader.shuffle_block_size != "auto":  # the storage is asked only for "auto"
        return resolve_block_size(loader.shuffle_block_size, block_bytes=None, sample_nbytes=0)
    natural = loader.dataset.natural_blocks()
    if natural is not None and len(natural):  # recorded as their mean size; the files pin them
        return max(2, round(int(natural.sum()) / len(natural)))
    return resolve_block_size(
        "auto",
        block_bytes=getattr(loader.dataset.storage, "shuffle_block_bytes", None),
        sample_nbytes=loader.dataset.sample_nbytes_hint(),
    )


def window(loader: Loader[Any]) -> int:
    """Blocks per mixing window that the order uses (1 where blocks are single samples)."""
    return loader.shuffle_window if block_size(loader) > 1 else 1


def epoch_order(loader: Loader[Any], epoch: int) -> Order:
    """The order of ``epoch``: the dataset's own where it makes one (a mixture), otherwise
    identity, global row shuffle or block shuffle."""
    own = loader.dataset.order(shuffle=loader.shuffle, seed=loader._ckpt.order_seed, epoch=epoch)
    if own is not None:
        return own
    natural = (
        loader.dataset.natural_blocks() if loader.shuffle and loader.shuffle_block_size == "auto" else None
    )
    if natural is not None and len(natural):  # blocks of the storage's own (row groups)
        return GroupPermutation(natural, seed=loader._ckpt.order_seed, epoch=epoch, window=window(loader))
    return make_order(
        len(loader.dataset),
        shuffle=loader.shuffle,
        seed=loader._ckpt.order_seed,
        epoch=epoch,
        block_size=block_size(loader),
        window=window(loader),
    )


def _loader_fingerprint(loader: Loader[Any]) -> DatasetFingerprint:
    """The dataset's fingerprint, computed once while open (a manifest digest walks every
    file entry; a storage may know its length only once open)."""
    if loader._ckpt.fingerprint is not None:
        return loader._ckpt.fingerprint
    fp = loader.dataset.fingerprint()
    if loader._life.state != "closed":
        loader._ckpt.fingerprint = fp
    return fp


def save_state(loader: Loader[Any], *, committed: bool = False) -> StatefulDataLoaderStateDict:
    """``loader.state_dict()``: its position and what the position means; ``committed``: the
    position of the last commit, the history cut there."""
    ckpt = loader._ckpt
    offset, history = ckpt.offset, ckpt.history
    if committed:
        offset, history = ckpt.committed, History(history.segments, dropped=history.dropped)
        history.truncate(ckpt.epoch, offset)
    state = StatefulDataLoaderStateDict(
        epoch=ckpt.epoch,
        observation_offset=offset,
        shuffle=loader.shuffle,
        shuffle_seed=loader.shuffle_seed,
        drop_last=loader.drop_last,
        dataset=_loader_fingerprint(loader),
    )
    # always there, "" before the first iterator: torch.distributed.checkpoint loads the keys of
    # the loading side's state_dict() only, so a fresh loader's must have it too
    state["history"] = history.encode()
    block = block_size(loader)
    if block > 1:  # a global shuffle's checkpoint stays as it was: no key means blocks of 1
        state["shuffle_block_size"] = block
        state["shuffle_window"] = window(loader)
        # what the loader was given: over a storage's own blocks (row groups), "auto" is another
        # order than any size, and a message names what the user passed
        state["shuffle_block_auto"] = loader.shuffle_block_size == "auto"
    return state


def identity_to_restore(loader: Loader[Any]) -> LoaderIdentity:
    """What ``loader.load_state_dict()`` checks a checkpoint against (under the loader's lock;
    refused while an iterator is active). The method calls :func:`restore_position` itself, so
    that its warnings point at the caller's line."""
    if loader._life.active.get() is not None:
        raise RuntimeError(
            "load_state_dict() was called while an iterator on this loader is active; "
            "exhaust or close the iterator first, then load the checkpoint"
        )
    return LoaderIdentity(
        loader.shuffle,
        loader.shuffle_seed,
        loader.drop_last,
        _loader_fingerprint(loader),
        shuffle_block_size=block_size(loader),
        shuffle_window=window(loader),
        shuffle_block_option=loader.shuffle_block_size,
        storage_blocks=_has_storage_blocks(loader),
    )


def _has_storage_blocks(loader: Loader[Any]) -> bool:
    """Whether the loader's dataset has shuffle blocks of its own, which ``"auto"`` keeps."""
    if not loader.shuffle or loader.dataset.makes_own_order:
        return False
    natural = loader.dataset.natural_blocks()
    return natural is not None and len(natural) > 0


def begin_run(loader: Loader[Any]) -> None:
    """An iterator starts at the loader's position: its batch geometry joins the history (a new
    segment where it differs from the last), and a tally of another epoch starts afresh."""
    ckpt = loader._ckpt
    ckpt.history.begin(ckpt.epoch, ckpt.offset, loader.local_batch_size, loader.world_size)
    if ckpt.tally.epoch != ckpt.epoch:
        ckpt.tally.reset(ckpt.epoch, ckpt.offset)
