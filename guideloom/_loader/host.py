"""What the loader's parts see of the loader: the parameters that fix an epoch's order, the
next epoch's pipeline, and the three objects that hold its changing state (position, lifecycle,
figures).

A protocol, so that the parts depend on this shape and not on the facade above them;
:class:`~guideloom.pytorch.StatefulDataLoader` is the one implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from guideloom._core.checkpoint import CheckpointState
from guideloom._datasets import DatasetAbstract
from guideloom._runtime.config import PipelineConfig

if TYPE_CHECKING:
    from guideloom._loader.figures import LoaderFigures
    from guideloom._loader.lifecycle import Lifecycle

__all__ = ["Loader"]

BatchT_co = TypeVar("BatchT_co", covariant=True)


class Loader(Protocol[BatchT_co]):
    """A loader's parameters and state, as its iterators, lifecycle and checkpoint see them."""

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
    _ckpt: CheckpointState
    _life: Lifecycle
    _figures: LoaderFigures

    def _epoch(self) -> PipelineConfig:
        """The pipeline of the next epoch (from every other parameter and the position)."""
        ...

    @property
    def collate_fn(self) -> Callable[[Sequence[Any]], BatchT_co]: ...

    @property
    def global_batch_size(self) -> int: ...

    def remaining(self) -> int: ...

    def open(self) -> None: ...

    def close(self) -> None: ...

    async def aopen(self) -> None: ...
