"""Argument checks: integral numbers accepted everywhere, bools refused as ints, only real bools
as flags, CUDA refused at construction where it is not available."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guideloom._core.checks import check_bool, check_int, check_optional_int
from guideloom._loader.arguments import check_device


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_check_int_accepts_integral_numbers(value: object) -> None:
    out = check_int("local_batch_size", value, 1)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 3.0, "3", None])
def test_check_int_refuses_non_integers(value: object) -> None:
    with pytest.raises(TypeError, match="local_batch_size must be an int"):
        check_int("local_batch_size", value, 1)


def test_check_int_minimum() -> None:
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        check_int("world_size", np.int64(0), 1)


def test_check_optional_int() -> None:
    assert check_optional_int("shuffle_seed", None) is None
    assert check_optional_int("shuffle_seed", np.int64(-5)) == -5
    with pytest.raises(TypeError, match="shuffle_seed must be an int or None"):
        check_optional_int("shuffle_seed", False)


@pytest.mark.parametrize("value", [True, False, np.bool_(True)])
def test_check_bool_accepts_bools(value: object) -> None:
    assert check_bool("shuffle", value) is bool(value)


@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None, np.int64(1)])
def test_check_bool_refuses_truthy_values(value: object) -> None:
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        check_bool("shuffle", value)


def test_check_device_parses_strings() -> None:
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


def test_check_device_unknown_string() -> None:
    with pytest.raises(ValueError, match="not a device torch knows"):
        check_device("gpu-please")


def test_check_device_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        check_device(1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_check_device_cuda_without_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        check_device("cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        check_device(torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_device_cuda_index_out_of_range() -> None:  # pragma: no cover - GPU machines
    with pytest.raises(ValueError, match="CUDA device"):
        check_device(f"cuda:{torch.cuda.device_count()}")
