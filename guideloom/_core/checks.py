"""Argument checks shared by the loader and the datasets: one place that says what a valid
option is, so every option is checked the same way (and the error says how to fix it)."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

if TYPE_CHECKING:
    import torch

    from guideloom.pytorch import StatefulDataLoader

__all__ = [
    "check_block_size",
    "check_bool",
    "check_device",
    "check_int",
    "check_loader_arguments",
    "check_optional_int",
]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int`` of at least ``minimum``.

    Any integral number is accepted (``int``, numpy integers: ``numbers.Integral``), a ``bool``
    is not (``True`` as a batch size is a bug, not a request for one sample).
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = int(value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def check_optional_int(name: str, value: Any) -> int | None:
    """``None``, or ``value`` as an ``int`` (any sign; see :func:`check_int`)."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    return int(value)


def check_block_size(value: Any) -> int | Literal["auto"] | None:
    """``shuffle_block_size``: ``None`` (global row shuffle), ``"auto"`` (the storage's
    default) or an ``int`` of at least 1 samples per block."""
    if value is None or value == "auto":
        return cast('Literal["auto"] | None', value)
    if isinstance(value, str):
        raise ValueError(
            f"shuffle_block_size must be an int >= 1 (samples per block), 'auto' (the storage's "
            f"default: ~4 MiB blocks on object storage, a global shuffle elsewhere) or None (a "
            f"global row shuffle), got {value!r}"
        )
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"shuffle_block_size must be an int, 'auto' or None, got {type(value).__name__} {value!r}"
        )
    return check_int("shuffle_block_size", value, 1)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: ``True``/``False`` (or numpy's), nothing merely truthy.

    ``shuffle="no"`` is truthy; taking it as ``True`` would shuffle a run that asked not to.
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


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


def check_loader_arguments(loader: StatefulDataLoader[Any, Any]) -> None:
    """Refuse ``StatefulDataLoader`` constructor arguments of the wrong type or range; a device
    given as a str or an int becomes a ``torch.device``."""
    from guideloom._datasets.base import DatasetAbstract  # the datasets check their options here too

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
