"""The loader's constructor arguments, checked as the reference page states them: a wrong type
raises ``TypeError``, a value out of range ``ValueError``, each naming the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guideloom._core.checks import check_block_size, check_bool, check_int, check_optional_int
from guideloom._datasets import DatasetAbstract
from guideloom._loader.host import Loader

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "check_loader_arguments"]


def check_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that this process can use.

    A CUDA device on a machine without CUDA (or an index past the visible devices) fails here,
    at construction, rather than with torch's assertion at the first batch.
    """
    import torch

    if isinstance(device, str | int) and not isinstance(device, bool):
        try:
            device = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"device {device!r} is not a device torch knows: {exc}") from None
    if not isinstance(device, torch.device):
        raise TypeError(
            f"device must be a torch.device (or a string such as 'cpu'), got {type(device).__name__}"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r} but CUDA is not available in this process (a CPU build of "
                "torch, no GPU visible, or CUDA_VISIBLE_DEVICES is empty); pass device='cpu' or "
                "leave device unset to use the default device"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device={str(device)!r} but this process sees {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); under torchrun use cuda:LOCAL_RANK"
            )
    return device


def check_loader_arguments(loader: Loader[Any]) -> None:
    """Refuse ``StatefulDataLoader`` constructor arguments of the wrong type or range; a device
    given as a str or an int becomes a ``torch.device``."""
    if not isinstance(loader.dataset, DatasetAbstract):
        raise TypeError(
            f"dataset must be a DatasetAbstract (StreamDataset or DocumentDataset), got "
            f"{type(loader.dataset).__name__}; StatefulDataLoader.from_storage wraps a storage for you"
        )
    if not callable(loader.collate_fn):
        raise TypeError(f"collate_fn must be callable, got {type(loader.collate_fn).__name__}")
    loader.device = check_device(loader.device)
    for name, minimum in (
        ("local_batch_size", 1),
        ("world_size", 1),
        ("rank", 0),
        ("num_workers", 0),
        ("prefetch", 0),
    ):
        setattr(loader, name, check_int(name, getattr(loader, name), minimum))
    if loader.rank >= loader.world_size:
        raise ValueError(f"rank must be in [0, world_size={loader.world_size}), got {loader.rank}")
    if loader.parallel_method not in ("thread", "process"):
        raise ValueError(f"parallel_method must be 'thread' or 'process', got {loader.parallel_method!r}")
    for name in ("shuffle", "pin_memory", "drop_last", "persistent_workers"):
        setattr(loader, name, check_bool(name, getattr(loader, name)))
    loader.shuffle_seed = check_optional_int("shuffle_seed", loader.shuffle_seed)
    loader.shuffle_block_size = check_block_size(loader.shuffle_block_size)
    loader.shuffle_window = check_int("shuffle_window", loader.shuffle_window, 1)
