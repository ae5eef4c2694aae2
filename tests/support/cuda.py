"""A batch with tensors at every level, and the check that a batch on the GPU is the CPU one:
what the CUDA tests compare (module level: process workers unpickle the collate by name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def nested(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """A batch with tensors at every level (a large one, a namedtuple, a list) and no-tensors."""
    block = torch.from_numpy(np.stack(samples).astype(np.int64))
    return {
        "tokens": block.repeat(1, 256),  # 8 KiB a row: a copy worth pinning
        "pair": Pair(block[:, :1].clone(), block.float() / 7),
        "list": [block.sum(dim=1), block.t().contiguous()],
        "ids": [int(s[0]) // 4 for s in samples],
        "n": len(samples),
    }


def assert_same_on_cuda(gpu: Any, cpu: Any) -> None:
    """``gpu`` is ``cpu`` with every tensor on the CUDA device: same structure and values."""
    if isinstance(cpu, torch.Tensor):
        assert gpu.device.type == "cuda" and gpu.dtype == cpu.dtype
        assert torch.equal(gpu.cpu(), cpu)
    elif isinstance(cpu, dict):
        assert type(gpu) is type(cpu) and gpu.keys() == cpu.keys()
        for k in cpu:
            assert_same_on_cuda(gpu[k], cpu[k])
    elif isinstance(cpu, list | tuple):
        assert type(gpu) is type(cpu) and len(gpu) == len(cpu)
        for g, c in zip(gpu, cpu, strict=True):
            assert_same_on_cuda(g, c)
    else:
        assert gpu == cpu
