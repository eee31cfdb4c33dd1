"""Device resolution and the CPU hand-off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.handoff import HostHandoff, resolve_device


@pytest.mark.auto_device
def test_auto_is_cpu_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "banana"])
def test_bad_device_names_the_setting(bad):
    with pytest.raises(gpuload.ConfigError, match="device="):
        resolve_device(bad)


def test_cuda_without_gpu_says_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(gpuload.GpuloadError, match="needs driver"):
        resolve_device("cuda")


def test_host_handoff_shares_memory_and_copies_read_only_arrays():
    a = np.arange(10, dtype=np.float32)
    ro = np.arange(5, dtype=np.int64)
    ro.flags.writeable = False
    out = HostHandoff()({"a": a, "r": Ragged(ro, np.array([0, 2, 5], np.int64))})
    assert out["a"].data_ptr() == a.ctypes.data  # zero copy
    assert isinstance(out["r"], Ragged) and out["r"].values.tolist() == [0, 1, 2, 3, 4]
    assert out["r"].values.data_ptr() != ro.ctypes.data  # read-only input: torch gets its own copy
