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

import numbers
import reprlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from guideloom._core.audit import Tally
from guideloom._core.provenance import History, check_history, parse_history
from guideloom.types import DatasetFingerprint

__all__ = [
    "CheckpointState",
    "LoaderIdentity",
    "restore_history",
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
    shuffle_block_option: int | Literal["auto"] | None = None
    """``shuffle_block_size`` as the loader was constructed with it: what messages name."""
    storage_blocks: bool = False
    """Whether the dataset has shuffle blocks of its own (a Parquet file's row groups), which
    ``"auto"`` keeps and no size reproduces: ``"auto"`` and a size are then other orders, even
    where the size is the one ``"auto"`` records."""


def _show(value: Any) -> str:
    """A checkpoint's value for a message, a few levels deep and a few dozen characters long.

    A damaged checkpoint can hold anything: ``repr()`` of a 100,000-deep list raises
    ``RecursionError``, ``str()`` of an int of 5,000 digits raises ``ValueError``, and a string of
    a megabyte is no message.
    """
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<an int of {value.bit_length()} bits>"
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxlong, short.maxother = 3, 40, 40, 40
    try:
        text = short.repr(value)
    except Exception:  # an int too long to print, an object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else f"{text[:77]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


# The optional keys of a checkpoint and what each holds, checked before any is compared or shown.
_ORDER_KEYS: dict[str, tuple[str, Any]] = {
    "shuffle": ("True or False", lambda v: isinstance(v, bool | np.bool_ | numbers.Integral)),
    "drop_last": ("True or False", lambda v: isinstance(v, bool | np.bool_ | numbers.Integral)),
    "shuffle_seed": ("an int or None", lambda v: v is None or _is_int(v)),
    "shuffle_block_size": ("an int", _is_int),
    "shuffle_window": ("an int", _is_int),
    "shuffle_block_auto": ("True or False", lambda v: isinstance(v, bool | np.bool_)),
}
_FINGERPRINT_KEYS: dict[str, tuple[str, Any]] = {
    "kind": ("a str", lambda v: isinstance(v, str)),
    "observations": ("an int", _is_int),
    "sequence_length": ("an int", _is_int),
    "digest": ("a str", lambda v: isinstance(v, str)),
}


def _check_values(values: Mapping[str, Any], expected: dict[str, tuple[str, Any]], where: str) -> None:
    for key, (what, ok) in expected.items():
        if key in values and not ok(values[key]):
            value = values[key]
            raise ValueError(
                f"checkpoint {where}{key!r} must be {what}, got {type(value).__name__} {_show(value)}; "
                "pass a dict returned by StatefulDataLoader.state_dict()"
            )


def _differences(saved: Mapping[str, Any], current: DatasetFingerprint) -> list[str]:
    out = []
    for key in ("kind", "observations", "sequence_length", "digest"):
        a, b = saved.get(key), current[key]
        if key == "digest" and (not a or not b):
            continue  # one side has no manifest (in memory): its counts are all there is
        if key == "observations" and -1 in (a, b):
            continue  # counted as read on one side: the kind, digest and length pin the count
        if a != b:
            out.append(f"{key} {_show(a)} (saved) != {_show(b)} (this loader)")
    return out


def _check_position(epoch: Any, offset: Any) -> tuple[int, int]:
    for name, value in (("epoch", epoch), ("observation_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"checkpoint {name} must be an int >= 0, got {_show(value)}")
    return epoch, offset


def _last_offset(observations: int) -> int:
    """The largest ``observation_offset`` a run over ``observations`` can save.

    With ``drop_last=False`` the final partial global batch advances the offset by a whole
    global batch ``G``: it starts before the end, so the offset stays below ``N + G``. A loader
    refuses to open with ``G > N`` (there would be no whole batch), so whatever batch size and
    world size a run had (and a resumed run may have others), it stays below ``2N``; over no
    observations, no batch is ever delivered.
    """
    return max(2 * observations - 1, 0)


def restore_position(
    state_dict: Any, current: LoaderIdentity, *, allow_dataset_change: bool = False
) -> tuple[int, int]:
    """The ``(epoch, observation_offset)`` to resume at, after checking ``state_dict``.

    Raises ``ValueError`` for a malformed checkpoint, for one counted on another dataset (unless
    ``allow_dataset_change``), and for an offset past the end of this dataset: with
    ``allow_dataset_change``, any offset past the end; otherwise (the same dataset, or a
    checkpoint without a fingerprint), one past what the padding of a final partial batch can
    reach (:func:`_last_offset`). Warns where the order after resuming will differ from the saved
    run's.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}")
    missing = {"epoch", "observation_offset"} - state_dict.keys()
    if missing:
        raise ValueError(
            f"checkpoint lacks {sorted(missing)}; pass a dict returned by StatefulDataLoader.state_dict()"
        )
    epoch, offset = _check_position(state_dict["epoch"], state_dict["observation_offset"])
    _check_values(state_dict, _ORDER_KEYS, "")
    fp = current.fingerprint
    saved_fp = state_dict.get("dataset")
    matches = False
    # No fingerprint (a checkpoint of the five position and order keys alone):
    # it loads as it is, without a warning; only the offset can be checked.
    if saved_fp is not None:
        if not isinstance(saved_fp, Mapping):
            raise ValueError(
                f"checkpoint 'dataset' must be a dict from state_dict(), got "
                f"{type(saved_fp).__name__} {_show(saved_fp)}"
            )
        _check_values(saved_fp, _FINGERPRINT_KEYS, "'dataset' field ")
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
    if saved_fp is not None and not matches:
        if offset > n:  # counted over other data: only a position inside this dataset means one
            raise ValueError(
                f"checkpoint observation_offset={_show(offset)} is past the end of this dataset "
                f"({n} observations): it was counted over other data. Resume with "
                f"the saved dataset, or load {{'epoch': {_show(epoch + 1)}, 'observation_offset': 0}} to "
                "start the next epoch"
            )
    elif n >= 0 and offset > _last_offset(n):  # -1: not counted yet (packing counted as read)
        raise ValueError(
            f"checkpoint observation_offset={_show(offset)} is past the end of this dataset "
            f"({n} observations) by more than the padding of a final partial batch: a run over "
            f"these {n} observations saves at most {_last_offset(n)}, so the checkpoint was counted "
            "over other data or is damaged. Resume from a checkpoint of this run, or load "
            f"{{'epoch': {_show(epoch + 1)}, 'observation_offset': 0}} to start the next epoch"
        )
    _warn_order_changes(state_dict, current)
    return epoch, offset


def _saved_order_value(state_dict: Mapping[str, Any], key: str, mine: Any) -> Any:
    """The saved value of ``key``; a checkpoint from before block shuffles has a global one."""
    if key in ("shuffle_block_size", "shuffle_window"):
        return state_dict.get(key, 1)
    return state_dict.get(key, mine)


def _says_blocks(state_dict: Mapping[str, Any]) -> bool:
    """Whether the checkpoint says what its shuffle blocks were: it has their keys, or it records
    its order (``shuffle``, which every ``state_dict()`` has) and so writes blocks of 1, a global
    shuffle, as no key. A position alone (``epoch`` and ``observation_offset``) says nothing of
    them, and is not compared."""
    return "shuffle_block_size" in state_dict or "shuffle" in state_dict


def _blocks(option: Any, size: Any) -> str:
    """``shuffle_block_size`` as a loader was given it, and what it came to."""
    if option == "auto":
        return f"'auto' (resolved to {_show(size)}{': a global row shuffle' if size == 1 else ''})"
    if size == 1:
        return f"{_show(option)} (a global row shuffle)"
    return _show(option)


def _block_change(state_dict: Mapping[str, Any], current: LoaderIdentity) -> tuple[str, str, str] | None:
    """Where the saved shuffle blocks differ from this loader's: each side as its loader was
    given them (``'auto'``, a size, ``None``) and the value to construct this loader with."""
    saved_size = state_dict.get("shuffle_block_size", 1)
    saved_auto = state_dict.get("shuffle_block_auto")  # None: a checkpoint of before it was kept
    mine_auto = current.shuffle_block_option == "auto"
    # over blocks of the storage's own, "auto" keeps them and a size (even the one "auto"
    # records) cuts others; elsewhere "auto" is the size it resolves to
    other_kind = saved_auto is not None and current.storage_blocks and bool(saved_auto) != mine_auto
    if saved_size == current.shuffle_block_size and not other_kind:
        return None
    saved_option = "auto" if saved_auto else (saved_size if saved_size != 1 else None)
    advice = "auto" if saved_auto and not mine_auto else saved_option
    return (
        _blocks(saved_option, saved_size),
        _blocks(current.shuffle_block_option, current.shuffle_block_size),
        "'auto'" if advice == "auto" else _show(advice),
    )


def _warn_order_changes(state_dict: Mapping[str, Any], current: LoaderIdentity) -> None:
    either_shuffles = current.shuffle or bool(state_dict.get("shuffle", False))
    keys = ("shuffle", "shuffle_seed", "drop_last", "shuffle_block_size", "shuffle_window")
    for key in keys:
        if key in ("shuffle_seed", "shuffle_block_size", "shuffle_window") and not either_shuffles:
            continue  # the seed and the blocks are ignored when neither loader shuffles
        if key in ("shuffle_block_size", "shuffle_window") and not _says_blocks(state_dict):
            continue
        mine = getattr(current, key)
        saved = _saved_order_value(state_dict, key, mine)
        if key == "shuffle_window" and not (
            current.shuffle_block_size == state_dict.get("shuffle_block_size", 1) > 1
        ):
            continue  # a window only means something between equal blocks of several samples
        if key == "shuffle_block_size":
            change = _block_change(state_dict, current)
            if change is None:
                continue
            saved_text, mine_text, advice = change
        elif saved == mine:
            continue
        else:
            saved_text, mine_text, advice = _show(saved), repr(mine), _show(saved)
        warnings.warn(
            f"the checkpoint was saved by a loader with {key}={saved_text}, this loader has "
            f"{key}={mine_text}; the saved value is not applied, so the order after resuming "
            f"differs from the saved run. Construct the loader with {key}={advice} to resume "
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
    committed: int = 0
    """The offset of the last :meth:`commit` (or of the epoch's start, or where a checkpoint
    resumed it): what :meth:`rollback` returns to. Never past ``offset``."""
    order_seed: int = 0
    fingerprint: DatasetFingerprint | None = None
    history: History = field(default_factory=History)
    """Where the batch geometry changed in this epoch and the last (see
    :mod:`guideloom._core.provenance`)."""
    tally: Tally = field(default_factory=Tally)
    """This rank's deliveries in the epoch, for the audit (never saved: it is the rank's own)."""

    def next_epoch(self) -> None:
        """The epoch's last batch was handed over: the next one starts at its offset 0."""
        self.tally.end(self.tally.owner)
        self.epoch += 1
        self.offset = self.committed = 0
        self.tally.reset(self.epoch, 0)

    def restore(self, epoch: int, offset: int, history: History) -> None:
        """Resume at ``(epoch, offset)`` with a checkpoint's history; the audit counts from here."""
        self.epoch, self.offset, self.history = epoch, offset, history
        self.committed = offset
        self.tally.reset(epoch, offset)

    def commit(self) -> None:
        """The batches handed out so far are committed: a rollback no longer takes them back."""
        self.committed = self.offset

    def rollback(self) -> int:
        """Take back the batches handed out since the last commit: the position, the geometry
        history and the audit's tally return to the committed offset, which is returned."""
        self.offset = self.committed
        self.history.truncate(self.epoch, self.committed)
        self.tally.truncate(self.committed)
        return self.committed


def restore_history(state_dict: Any, epoch: int, offset: int) -> History:
    """The history of a checkpoint already checked by :func:`restore_position`, checked as
    arithmetic against its position (:func:`check_history`); an empty one for a checkpoint that
    has none. ``ValueError`` names the entry that does not add up."""
    return check_history(parse_history(state_dict.get("history", "")), epoch, offset)
