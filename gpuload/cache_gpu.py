"""Cache read on the GPU: one KvikIO ``pread`` per chunk file into device memory.

The GPU twin of :func:`gpuload.cache.read_chunk`, for the same files. The small header
is read on the host; the column regions (one contiguous, 4 KiB-aligned span) go in one
``pread`` straight into a device buffer of the loader's memory (GPUDirect Storage where
the node has it, else KvikIO's bounce buffers), and the columns are CuPy views of that
buffer by offset: no host copy on the way.

Checksums are xxh3 on the host. A file this process has not checked yet (and did not
write itself) is therefore read once into pinned host memory, checked, and copied to
the device with ``non_blocking=True`` on the loader stream; every later read of it is
the direct KvikIO path. ``verify_checksums=False`` skips that first pass, ``"always"``
takes it on every read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .cache import columns_from_buffer, file_identity, read_header, region_span
from .errors import CorruptCacheError

__all__ = ["read_chunk_device"]


def read_chunk_device(path: Path, ctx, verify: bool = True, verified: set | None = None) -> dict:
    """Read a cache file into device memory; returns its CuPy column set.

    Call inside ``ctx.active()`` (a :class:`gpuload.gpu.DeviceContext`). ``verify``
    and ``verified`` mean what they mean for :func:`gpuload.cache.read_chunk`. Raises
    ``FileNotFoundError`` when absent and :class:`CorruptCacheError` when a check fails.
    """
    import kvikio

    with open(path, "rb", buffering=0) as f:
        header, start = read_header(f, path)
        end = region_span(header, start)
        st = os.fstat(f.fileno())
        ident = file_identity(st)
        if verified is not None and ident in verified:
            verify = False
        if st.st_size < end:
            raise CorruptCacheError(f"{path}: truncated cache file ({st.st_size} of {end} bytes)")
        span = end - start
        buf = ctx.empty_bytes(span)
        if verify:
            staged = torch.empty(span, dtype=torch.uint8, pin_memory=True)
            host = staged.numpy()
            f.seek(start)
            view, got = memoryview(host), 0
            while got < span:  # one read returns at most ~2 GiB
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptCacheError(f"{path}: truncated cache file")
                got += n
            columns_from_buffer(host, header, path, True, base=start)  # raises on a mismatch
            if span:
                torch.from_dlpack(buf).copy_(staged, non_blocking=True)
            if verified is not None:
                verified.add(ident)
            return columns_from_buffer(buf, header, path, False, base=start)
    if span:
        ctx.before_external_write()  # KvikIO writes outside any stream
        cf = kvikio.CuFile(path, "r")
        try:
            got = cf.pread(buf, span, start).get()
        finally:
            cf.close()
        if got != span:
            raise CorruptCacheError(f"{path}: truncated cache file ({got} of {span} bytes read)")
        try:
            same = file_identity(os.stat(path)) == ident
        except FileNotFoundError:
            same = False
        if not same:  # replaced between the header read and the data read
            raise CorruptCacheError(f"{path}: changed while it was read")
    return columns_from_buffer(buf, header, path, False, base=start)
