"""What the loader's parts see of the loader: its parameters and the three objects that hold
its changing state (position, lifecycle, figures).

A protocol, so that the parts depend on this shape and not on the facade above them;
:class:`~guideloom.pytorch.StatefulDataLoader` is the one implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from guideloom._core.checkpoint import CheckpointState
from guideloom._datasets import DatasetAbstract

if TYPE_CHECKING:
    import torch

    from guideloom._loader.figures import LoaderFigures
    from guideloom._loader.lifecycle import Lifecycle

__all__ = ["Loader"]

BatchT_co = TypeVar("BatchT_co", covariant=True)


class Loader(Protocol[BatchT_co]):
    """A loader's parameters and state, as its iterators, lifecycle and checkpoint see them."""

    dataset: DatasetAbstract[Any]
    device: torch.device
    local_batch_size: int
    rank: int
    world_size: int
    num_workers: int
    parallel_method: Literal["thread", "process"]
    shuffle: bool
    shuffle_seed: int | None
    pin_memory: bool
    drop_last: bool
    prefetch: int
    shuffle_block_size: int | Literal["auto"] | None
    shuffle_window: int
    persistent_workers: bool
    _ckpt: CheckpointState
    _life: Lifecycle
    _figures: LoaderFigures

    @property
    def collate_fn(self) -> Callable[[Sequence[Any]], BatchT_co]: ...

    @property
    def global_batch_size(self) -> int: ...

    def remaining(self) -> int: ...

    def open(self) -> None: ...

    def close(self) -> None: ...

    async def aopen(self) -> None: ...
