"""The CPU hand-off."""

from __future__ import annotations

import numpy as np

from gpuload.batch import Ragged
from gpuload.handoff import HostHandoff


def test_host_handoff_shares_memory_and_copies_read_only_arrays():
    a = np.arange(10, dtype=np.float32)
    ro = np.arange(5, dtype=np.int64)
    ro.flags.writeable = False
    out = HostHandoff()({"a": a, "r": Ragged(ro, np.array([0, 2, 5], np.int64))})
    assert out["a"].data_ptr() == a.ctypes.data  # zero copy
    assert isinstance(out["r"], Ragged) and out["r"].values.tolist() == [0, 1, 2, 3, 4]
    assert out["r"].values.data_ptr() != ro.ctypes.data  # read-only input: torch gets its own copy
