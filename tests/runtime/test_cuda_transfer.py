"""The copy to a CUDA device (``move_to_device``): every tensor of a nested batch moved, pinned
first where asked and not pinned yet, nothing else touched. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guideloom._runtime.config import move_to_device
from tests.support.cuda import assert_same_on_cuda, nested

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_move_to_device_pins_what_is_not_pinned_and_keeps_the_structure() -> None:
    cpu = nested([np.arange(4) * 4, np.arange(4, 8) * 4])
    moved = move_to_device(cpu, torch.device("cuda"), pin_memory=True)
    torch.cuda.synchronize()
    assert_same_on_cuda(moved, cpu)
    pinned = torch.arange(10).pin_memory()
    assert torch.equal(move_to_device(pinned, torch.device("cuda"), pin_memory=True).cpu(), pinned)
    on_gpu = torch.arange(3, device="cuda")
    assert move_to_device(on_gpu, torch.device("cuda"), pin_memory=True) is on_gpu
