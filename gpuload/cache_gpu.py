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

import errno

import torch

from .cachefile import columns_from_buffer, open_chunk, pread_all
from .errors import CorruptCacheError

__all__ = ["read_chunk_device"]


def read_chunk_device(fd: int, path, want, ctx, verify: bool = True, verified: set | None = None) -> dict:
    """Read the open cache file ``fd`` into device memory; returns its CuPy column set.

    Call inside ``ctx.active()`` (a :class:`gpuload.gpu.DeviceContext`). ``want`` (the
    :class:`gpuload.cachefile.Identity` the header must state), ``verify`` and
    ``verified`` mean what they mean for :func:`gpuload.cachefile.read_regions`. KvikIO
    opens the same file through ``/proc/self/fd``, so it reads exactly the file whose
    header was checked, even if the name is replaced meanwhile. Raises
    :class:`CorruptCacheError` when a check fails.
    """
    import kvikio

    header, start, span, verify, ident = open_chunk(fd, path, want, verify, verified)
    buf = ctx.empty_bytes(span)
    if verify:
        staged = torch.empty(span, dtype=torch.uint8, pin_memory=True)
        host = staged.numpy()
        if pread_all(fd, host, start) != span:
            raise CorruptCacheError(f"{path}: truncated cache file")
        columns_from_buffer(host, header, path, True, base=start)  # raises on a mismatch
        if span:
            torch.from_dlpack(buf).copy_(staged, non_blocking=True)
        if verified is not None:
            verified.add(ident)
        return columns_from_buffer(buf, header, path, False, base=start)
    if span:
        ctx.before_external_write()  # KvikIO writes outside any stream
        try:
            cf = kvikio.CuFile(f"/proc/self/fd/{fd}", "r")
            try:
                got = cf.pread(buf, span, start).get()
            finally:
                cf.close()
        except RuntimeError as e:  # KvikIO's I/O errors: the cache falls back to decoding, like any OSError
            raise OSError(errno.EIO, f"{path}: KvikIO could not read it ({e})") from None
        if got != span:
            raise CorruptCacheError(f"{path}: truncated cache file ({got} of {span} bytes read)")
    return columns_from_buffer(buf, header, path, False, base=start)
