"""Public types: the loader's checkpoint."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = ["DatasetFingerprint", "StatefulDataLoaderStateDict"]


class DatasetFingerprint(TypedDict):
    """What a checkpoint records of the dataset its position counts.

    ``load_state_dict`` refuses a checkpoint whose fingerprint does not match the loader's
    dataset (unless told ``allow_dataset_change=True``): a position counted over other data
    would skip or repeat observations.
    """

    kind: str
    """``"stream"`` or ``"documents"`` (a custom dataset: its class name)."""
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
