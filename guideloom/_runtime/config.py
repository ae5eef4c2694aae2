"""What an epoch runs with: its configuration, and the sizes every way of running it shares
(read windows, worker groups) and the steps that make a read batch a delivered one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from guideloom._core.order import Order
from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import every, max_window
from guideloom._datasets import DatasetAbstract

if TYPE_CHECKING:
    import torch

    from guideloom._runtime.processes.pool import WorkerPool

__all__ = [
    "PipelineConfig",
    "group_size",
    "making_steps",
    "max_window_batches",
    "move_to_device",
    "reading_name",
    "window_bounds",
]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    dataset: DatasetAbstract[Any]
    plan: EpochPlan
    order: Order
    collate_fn: Callable[[Sequence[Any]], Any]
    device: torch.device
    pin_memory: bool
    num_workers: int
    parallel_method: Literal["thread", "process"]
    prefetch: int
    #: The loader's persistent process workers (``persistent_workers=True``); None: a pool of
    #: this iterator's own.
    worker_pool: Callable[[], WorkerPool] | None = None

    @property
    def capacity(self) -> int:
        """Batches that may be prepared ahead of the consumer's requests."""
        return self.prefetch + self.num_workers


# -- device transfer ------------------------------------------------------------------------------
def move_to_device(obj: Any, device: torch.device, pin_memory: bool) -> Any:
    """Move every tensor in a nested dict/list/tuple to ``device`` (pinned first for CUDA)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if device.type == "cuda":
            if pin_memory and obj.device.type == "cpu" and not obj.is_pinned():
                obj = obj.pin_memory()
            return obj.to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, Mapping):
        moved = {k: move_to_device(v, device, pin_memory) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(obj, tuple):
        items = [move_to_device(v, device, pin_memory) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items)
    if isinstance(obj, list):
        return [move_to_device(v, device, pin_memory) for v in obj]
    return obj


def making_steps(cfg: PipelineConfig) -> tuple[Callable[[Any], Any], ...]:
    """What makes a read batch into a delivered one: ``collate_fn``, then the copy to the device
    where there is one to make (on CPU a batch stays where it is)."""
    if cfg.device.type == "cpu":
        return (cfg.collate_fn,)
    return (cfg.collate_fn, functools.partial(move_to_device, device=cfg.device, pin_memory=cfg.pin_memory))


def max_window_batches(cfg: PipelineConfig) -> int:
    hints = cfg.dataset.read_hints
    return max_window(cfg.plan, hints.sample_nbytes, hints.read_window_bytes, hints.read_window_batches)


def window_bounds(cfg: PipelineConfig) -> Callable[[int], int] | None:
    """Where aligned read windows end, where the storage asks for blocks (object stores); None
    elsewhere (windows of 1, 2, 4, ... batches, as before).

    A block shuffle's mixing windows, at their real ends (the window holding the short block is
    shorter, and every window after it starts earlier): one read is a few large requests and no
    block is fetched twice. Any other order: the largest window, with no ramp of small windows
    in between, since a small window of a shuffled epoch is scattered samples, one request each,
    where the largest one coalesces.
    """
    hints = cfg.dataset.read_hints
    if hints.shuffle_block_bytes is None:
        return None
    if cfg.order.span > 0:
        return cfg.order.window_end
    largest = max_window_batches(cfg)
    if cfg.order.in_order:
        # A window read in order is a few long ranges however short: a share of the windows read
        # ahead together, which end one after the other, so that each one's batches are made
        # while the next ones are fetched (one window the size of them all ends with the fetch).
        largest = max(1, largest // max(1, hints.max_concurrent_reads))
    return every(largest * cfg.plan.global_batch_size)


def reading_name(cfg: PipelineConfig) -> str:
    storage = cfg.dataset.storage  # None for a dataset reading a source of its own
    return f"{type(cfg.dataset if storage is None else storage).__name__}.read_many"


def group_size(capacity: int, num_workers: int) -> int:
    """Batches per worker call: enough to amortise the hand-off, small enough to keep all busy."""
    return max(1, min(8, capacity // (2 * max(1, num_workers))))
