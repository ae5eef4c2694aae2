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

    @property
    def dataset(self) -> DatasetAbstract[Any]: ...

    @property
    def collate_fn(self) -> Callable[[Sequence[Any]], BatchT_co]: ...

    device: torch.device

    @property
    def local_batch_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def parallel_method(self) -> Literal["thread", "process"]: ...

    @property
    def shuffle(self) -> bool: ...

    shuffle_seed: int | None

    @property
    def pin_memory(self) -> bool: ...

    @property
    def drop_last(self) -> bool: ...

    @property
    def prefetch(self) -> int: ...

    shuffle_block_size: int | Literal["auto"] | None
    shuffle_window: int

    @property
    def persistent_workers(self) -> bool: ...

    _ckpt: CheckpointState
    _life: Lifecycle
    _figures: LoaderFigures

    @property
    def global_batch_size(self) -> int: ...

    def remaining(self) -> int: ...

    def open(self) -> None: ...

    def close(self) -> None: ...

    async def aopen(self) -> None: ...
