"""Public types: the loader's checkpoint and the keyword arguments of ``from_storage``.

No ``from __future__ import annotations`` here: ``TypedDict`` reads ``NotRequired`` from the
evaluated annotations, so with string annotations Python 3.11 would list the optional keys of
:class:`StatefulDataLoaderStateDict` in ``__required_keys__``.
"""

from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch

__all__ = ["DatasetFingerprint", "LoaderOptions", "StatefulDataLoaderStateDict"]


class DatasetFingerprint(TypedDict):
    """What a checkpoint records of the dataset its position counts.

    ``load_state_dict`` refuses a checkpoint whose fingerprint does not match the loader's
    dataset (unless told ``allow_dataset_change=True``): a position counted over other data
    would skip or repeat observations.
    """

    kind: str
    """``"stream"``, ``"documents"``, ``"packed-concat"`` or ``"packed-best_fit"`` (a custom
    dataset: its class name)."""
    observations: int
    """Number of observations (samples) in the dataset."""
    sequence_length: int
    """Elements per stream sample; 0 for documents."""
    digest: str
    """A digest of the written dataset's manifest (files, lengths, checksums); empty for
    storages without one (in memory), which are compared by their counts alone."""


class StatefulDataLoaderStateDict(TypedDict):
    """Checkpoint returned by ``StatefulDataLoader.state_dict``.

    ``epoch`` and ``observation_offset`` identify the global sample position delivered to the
    consumer; prefetched batches that were not yielded are not included. ``shuffle``,
    ``shuffle_seed`` and ``drop_last`` record how the loader was constructed; ``load_state_dict``
    does not apply them. All values are plain ints, bools or None, so the checkpoint saves with
    ``torch.save`` and loads with ``torch.load(..., weights_only=True)``.
    """

    epoch: int
    """Epoch index. It increments when an iterator is exhausted."""
    observation_offset: int
    """Global sample position in the current epoch; advances by the global batch size per
    delivered batch, including padding in an incomplete final batch."""
    shuffle: bool
    """Whether that loader was constructed with shuffling enabled."""
    shuffle_seed: int | None
    """Seed used for shuffling. None is not reproducible."""
    drop_last: bool
    """Whether that loader drops an incomplete global batch."""
    dataset: NotRequired[DatasetFingerprint]
    """The dataset the position counts (absent in checkpoints of guideloom before 0.2)."""
    shuffle_block_size: NotRequired[int]
    """Samples per shuffle block that loader's order used (``"auto"`` resolved), present for a
    block shuffle only: absent means blocks of 1, a global row shuffle (or no shuffle)."""
    shuffle_window: NotRequired[int]
    """Blocks per mixing window that loader's order used (present with ``shuffle_block_size``)."""


class LoaderOptions(TypedDict, total=False):
    """The keyword arguments ``StatefulDataLoader.from_storage`` takes after ``sequence_length``.

    Each is optional and means what the constructor's parameter of the same name means; an
    omitted one takes the default given here.
    """

    device: "torch.device | None"
    """Device batches are moved to. Default ``None``: the current CUDA device when CUDA is
    available, otherwise CPU."""
    local_batch_size: int
    """Observations per batch on this rank. Default ``1``."""
    rank: int
    """This process's rank, in ``[0, world_size)``. Default ``0``."""
    world_size: int
    """Number of ranks the dataset is partitioned across. Default ``1``."""
    num_workers: int
    """Collate workers; ``0`` collates in the pipeline itself. Default ``0``."""
    parallel_method: Literal["thread", "process"]
    """What the collate workers are. Default ``"thread"``."""
    shuffle: bool
    """Shuffle the order every epoch. Default ``False``."""
    shuffle_seed: int | None
    """Seed of the shuffled order; ``None`` picks a random one (not reproducible). Default
    ``None``."""
    pin_memory: bool
    """Pin batches before a CUDA copy. Default ``False``."""
    drop_last: bool
    """Drop an incomplete final global batch. Default ``True``."""
    prefetch: int
    """Batches prepared ahead of the consumer's requests. Default ``0``."""
    shuffle_block_size: int | Literal["auto"] | None
    """Samples per contiguous shuffle block. ``None`` or ``1``: a global row shuffle, the same
    order over every storage. ``"auto"``: the storage's default, blocks of about 4 MiB on object
    storage (a few large range requests instead of one per sample) and a global shuffle on
    memory and local files. An int: that many samples per block. Default ``None``."""
    shuffle_window: int
    """Blocks per mixing window of a block shuffle: samples are shuffled among this many
    consecutive blocks of the shuffled block order (ignored for a global shuffle). Default
    ``16``."""
    persistent_workers: bool
    """Keep process workers running between iterators (epochs), until ``close()``. Default
    ``True``."""
