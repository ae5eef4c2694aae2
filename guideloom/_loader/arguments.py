"""The loader's constructor arguments, checked as the API reference states them: a wrong type
raises ``TypeError``, a value out of range ``ValueError``, each naming the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "resolve_collate_mode"]

CollateMode = Literal["auto", "workers", "inline"]


def resolve_collate_mode(
    collate_mode: CollateMode | None, parallel_method: str, num_workers: int
) -> CollateMode | None:
    """``collate_mode=None`` (the default): ``"workers"`` for process workers, which then
    collate in the worker processes only, unless asked otherwise (a collate may need another
    process, or a worker's own state, as torch's does); ``"auto"`` otherwise. Any other value
    is returned as it is (checked by the caller)."""
    if collate_mode is None:
        return "workers" if parallel_method == "process" and num_workers > 0 else "auto"
    return collate_mode


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
