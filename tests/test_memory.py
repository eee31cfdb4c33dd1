"""HostPool reuses a buffer only once nothing (array view or tensor) refers to it."""

from __future__ import annotations

import numpy as np
import torch

from gpuload.memory import HostPool, _size_class

MiB = 1 << 20


def test_buffer_reused_after_last_reference_dies():
    pool = HostPool(max_buffers=1)  # keeps only the first buffer
    a = pool.get(3 * MiB)
    addr = a.ctypes.data
    view = a[10:20].view(np.uint16)
    t = torch.from_numpy(a[: 2 * MiB])
    del a
    b = pool.get(3 * MiB)
    assert b.ctypes.data != addr  # still referenced by a view and a tensor: not handed out
    del view
    c = pool.get(3 * MiB)
    assert c.ctypes.data != addr  # the tensor alone still pins it
    del t
    d = pool.get(2 * MiB)
    assert d.ctypes.data == addr  # nothing refers to it any more: reused
    del b, c


def test_pool_is_bounded_and_small_requests_bypass_it():
    pool = HostPool(max_buffers=2)
    held = [pool.get(2 * MiB) for _ in range(5)]
    assert pool.held_bytes <= 2 * 2 * MiB
    assert pool.get(100).base is None or pool.get(100).nbytes == 100
    arr = pool.array((MiB, 3), np.float32)
    assert arr.shape == (MiB, 3) and arr.dtype == np.float32 and arr.flags.c_contiguous
    del held


def test_size_classes_round_up_by_at_most_an_eighth():
    """Similar sizes share a class (so windows of other chunks reuse each other's buffers)."""
    mib = 1 << 20
    assert _size_class(1) == mib and _size_class(mib) == mib and _size_class(mib + 1) == 2 * mib
    for n in range(1, 3000, 7):
        got = _size_class(n * mib // 3)
        assert n * mib // 3 <= got <= max(mib, n * mib // 3 * 9 // 8 + mib)
    assert _size_class(100 * mib) == _size_class(103 * mib) == 104 * mib
    pool = HostPool()
    a = pool.get(100 * mib)
    address = a.__array_interface__["data"][0]
    del a
    assert pool.get(103 * mib).__array_interface__["data"][0] == address  # reused, not a new allocation
