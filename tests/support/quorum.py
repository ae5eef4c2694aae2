"""A scripted quorum: the part of a ``torchft.Manager`` a ``FaultTolerantLoader`` uses, driven by
a test as torchft drives it (step, rank in the quorum, participants, the state dict callbacks)."""

from __future__ import annotations

from typing import Any


class ScriptedManager:
    """The part of a ``torchft.Manager`` a :class:`FaultTolerantLoader` uses, driven by the test."""

    def __init__(self) -> None:
        self.step = 0
        self.rank: int | None = None
        self.participants = 0
        self.fns: dict[str, tuple[Any, Any]] = {}
        self.pending: dict[str, Any] | None = None

    def participating_rank(self) -> int | None:
        return self.rank

    def num_participants(self) -> int:
        return self.participants

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        self.fns[key] = (load_state_dict, state_dict)
