"""The checkpoint: what ``state_dict()`` records and how ``load_state_dict()`` checks it.

A checkpoint is a position, ``(epoch, observation_offset)``, plus what that position means: how
the order was made (``shuffle``, ``shuffle_seed``, ``drop_last``) and which data it counts
(a *fingerprint* of the dataset). A position is only meaningful over the dataset it was counted
on: loaded into another one it silently skips or repeats data, so a fingerprint that does not
match is refused unless the caller says the change is on purpose. Everything is plain ints,
bools, strings and None (``torch.load(..., weights_only=True)`` and
``torch.distributed.checkpoint`` take it as is) and nothing depends on the rank.

Pure: the loader's side (what it saves, what it checks a checkpoint against) is
:mod:`guideloom._loader.state`; each dataset computes its own fingerprint.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from guideloom.types import DatasetFingerprint

__all__ = [
    "CheckpointState",
    "LoaderIdentity",
    "restore_position",
]


@dataclass(frozen=True, slots=True)
class LoaderIdentity:
    """What the loading side compares a checkpoint against."""

    shuffle: bool
    shuffle_seed: int | None
    drop_last: bool
    fingerprint: DatasetFingerprint
    shuffle_block_size: int = 1
    """Samples per shuffle block, resolved (``"auto"`` is recorded as the size it chose)."""
    shuffle_window: int = 1
    """Blocks per mixing window (1 for a global shuffle)."""


def _differences(saved: Mapping[str, Any], current: DatasetFingerprint) -> list[str]:
    out = []
    for key in ("kind", "observations", "sequence_length", "digest"):
        a, b = saved.get(key), current[key]
        if key == "digest" and (not a or not b):
            continue  # one side has no manifest (in memory): its counts are all there is
        if a != b:
            out.append(f"{key} {a!r} (saved) != {b!r} (this loader)")
    return out


def _check_position(epoch: Any, offset: Any) -> tuple[int, int]:
    for name, value in (("epoch", epoch), ("observation_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"checkpoint {name} must be an int >= 0, got {value!r}")
    return epoch, offset


def restore_position(
    state_dict: Any, current: LoaderIdentity, *, allow_dataset_change: bool = False
) -> tuple[int, int]:
    """The ``(epoch, observation_offset)`` to resume at, after checking ``state_dict``.

    Raises ``ValueError`` for a malformed checkpoint, for one counted on another dataset (unless
    ``allow_dataset_change``), and for an offset past the end of this dataset. Warns where the
    order after resuming will differ from the saved run's.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}")
    missing = {"epoch", "observation_offset"} - state_dict.keys()
    if missing:
        raise ValueError(
            f"checkpoint lacks {sorted(missing)}; pass a dict returned by StatefulDataLoader.state_dict()"
        )
    epoch, offset = _check_position(state_dict["epoch"], state_dict["observation_offset"])
    fp = current.fingerprint
    saved_fp = state_dict.get("dataset")
    matches = False
    # No fingerprint (the reference page's five keys, or a checkpoint of guideloom before 0.2):
    # it loads as it is, without a warning; only the offset can be checked.
    if saved_fp is not None:
        if not isinstance(saved_fp, Mapping):
            raise ValueError(f"checkpoint 'dataset' must be a dict from state_dict(), got {saved_fp!r}")
        diffs = _differences(saved_fp, fp)
        matches = not diffs
        if diffs and not allow_dataset_change:
            raise ValueError(
                "this checkpoint was saved over another dataset: " + "; ".join(diffs) + ". Its "
                "position would skip or repeat data here. Load it into a loader over the saved "
                "dataset (same files, same sequence_length), or, if the data changed on purpose, "
                "call load_state_dict(state, allow_dataset_change=True) to resume at the saved "
                "position anyway"
            )
    n = fp["observations"]
    if offset > n and not matches and (saved_fp is not None or offset >= 2 * max(n, 1)):
        # Over the saved dataset an offset may pass the end by the padding of a final partial
        # batch (less than one global batch: less than the dataset, which a batch of several
        # ranks may exceed only in a dataset too small to matter); anywhere else it is a
        # position this dataset does not have.
        raise ValueError(
            f"checkpoint observation_offset={offset} is past the end of this dataset "
            f"({n} observations): it was counted over other data. Resume with "
            f"the saved dataset, or load {{'epoch': {epoch + 1}, 'observation_offset': 0}} to "
            "start the next epoch"
        )
    _warn_order_changes(state_dict, current)
    return epoch, offset


def _saved_order_value(state_dict: Mapping[str, Any], key: str, mine: Any) -> Any:
    """The saved value of ``key``; a checkpoint from before block shuffles has a global one."""
    if key in ("shuffle_block_size", "shuffle_window"):
        return state_dict.get(key, 1)
    return state_dict.get(key, mine)


def _warn_order_changes(state_dict: Mapping[str, Any], current: LoaderIdentity) -> None:
    either_shuffles = current.shuffle or bool(state_dict.get("shuffle", False))
    keys = ("shuffle", "shuffle_seed", "drop_last", "shuffle_block_size", "shuffle_window")
    for key in keys:
        if key in ("shuffle_seed", "shuffle_block_size", "shuffle_window") and not either_shuffles:
            continue  # the seed and the blocks are ignored when neither loader shuffles
        mine = getattr(current, key)
        saved = _saved_order_value(state_dict, key, mine)
        if key == "shuffle_window" and not (
            current.shuffle_block_size == state_dict.get("shuffle_block_size", 1) > 1
        ):
            continue  # a window only means something between equal blocks of several samples
        if saved != mine:
            warnings.warn(
                f"the checkpoint was saved by a loader with {key}={saved!r}, this loader has "
                f"{key}={mine!r}; the saved value is not applied, so the order after resuming "
                f"differs from the saved run. Construct the loader with {key}={saved!r} to resume "
                "it exactly",
                UserWarning,
                stacklevel=4,
            )


@dataclass(slots=True)
class CheckpointState:
    """What a loader's checkpoint is made of, apart from its parameters: its position (advanced by
    its iterators as they hand batches over), the seed its orders are drawn from, and its
    dataset's fingerprint once computed."""

    epoch: int = 0
    offset: int = 0
    """``observation_offset``: observations of the epoch delivered, across all ranks."""
    order_seed: int = 0
    fingerprint: DatasetFingerprint | None = None
