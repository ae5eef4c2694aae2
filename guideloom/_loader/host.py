"""What the loader's parts see of the loader: its public parameters (those that fix an
epoch's order and how it runs) and its public methods. Its changing state (position,
lifecycle, figures) is not reached through it: the facade hands its parts that state as one
object, :class:`~guideloom._loader.state.LoaderState`.

A protocol, so that the parts depend on this shape and not on the facade above them;
:class:`~guideloom.pytorch.StatefulDataLoader` is the one implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from guideloom._datasets import DatasetAbstract

if TYPE_CHECKING:
    import torch

__all__ = ["Loader"]

BatchT_co = TypeVar("BatchT_co", covariant=True)


class Loader(Protocol[BatchT_co]):
    """A loader's public parameters and methods, as its iterators, planner and checkpoint see them."""

    dataset: DatasetAbstract[Any]
    #: What fixes the order of an epoch (and what a checkpoint records of it).
    shuffle: bool
    shuffle_seed: int | None
    drop_last: bool
    shuffle_block_size: int | Literal["auto"] | None
    shuffle_window: int
    #: Where a sync ``for`` with workers collates: measured (``"auto"``) or pinned.
    collate_mode: Literal["auto", "workers", "inline"] | None
    #: Whether each delivered batch is tallied for :meth:`audit`.
    track_deliveries: bool
    rank: int
    world_size: int
    local_batch_size: int
    #: How an epoch runs (what the planner makes a pipeline of).
    device: torch.device
    pin_memory: bool
    num_workers: int
    parallel_method: Literal["thread", "process"]
    prefetch: int
    persistent_workers: bool

    @property
    def collate_fn(self) -> Callable[[Sequence[Any]], BatchT_co]: ...

    @property
    def global_batch_size(self) -> int: ...

    def remaining(self) -> int: ...

    def open(self) -> None: ...

    def close(self) -> None: ...

    async def aopen(self) -> None: ...
