"""Cache read on the GPU: each chunk file's column regions into device memory, in stream order.

The GPU twin of :func:`gpuload.cache.chunkfile.read_chunk`, for the same files. The small header
is read on the host; the column regions (one contiguous, 4 KiB-aligned span) go into
one device buffer of the loader's memory, and the columns are CuPy views of that
buffer by offset. Every read is ordered on the loader's read stream, so it neither waits for
nor holds up the training step's kernels:

* with GPUDirect Storage (see :func:`gpuload.gpu.runtime._gds_usable`), one KvikIO
  ``raw_read_async`` on the read stream reads the span from disk straight into
  device memory;
* otherwise the span is read into pinned host memory and copied with one
  ``non_blocking`` copy on the read stream. (KvikIO's compat mode would also go
  through host memory, but its copies are ordered with the legacy default stream, that
  is behind, and ahead of, the training step's kernels on torch's default stream.)

Checksums are xxh3 on the host. A file this process has not checked yet (and did not
write itself) therefore takes the pinned path and is checked there, whatever the node
has; every later read of it takes the path above. ``verify_checksums=False`` skips the
check, ``"always"`` makes it on every read.
"""

from __future__ import annotations

import errno

import torch

from ..cache.chunkfile import columns_from_buffer, open_chunk
from ..cache.directio import pread_all
from ..errors import CorruptCacheError

__all__ = ["read_chunk_device"]


def read_chunk_device(fd: int, path, want, ctx, verify: bool = True, verified: set | None = None) -> dict:
    """Read the open cache file ``fd`` into device memory; returns its CuPy column set.

    Call inside ``ctx.reading()`` (a :class:`gpuload.gpu.streams.DeviceContext`). ``want`` (the
    :class:`gpuload.cache.chunkfile.Identity` the header must state), ``verify`` and
    ``verified`` mean what they mean for :func:`gpuload.cache.chunkfile.read_regions`. KvikIO
    opens the same file through ``/proc/self/fd``, so it reads exactly the file whose
    header was checked, even if the name is replaced meanwhile. Raises
    :class:`CorruptCacheError` when a check fails, ``OSError`` when the file cannot be read.
    """
    header, start, span, verify, ident = open_chunk(fd, path, want, verify, verified)
    buf = ctx.empty_bytes(span)
    if span and ctx.gds and not verify:
        _gds_read(fd, path, buf, span, start, ctx)
    elif span:
        staged = torch.empty(span, dtype=torch.uint8, pin_memory=True)
        host = staged.numpy()
        if pread_all(fd, host, start) != span:
            raise CorruptCacheError(f"{path}: truncated cache file")
        if verify:
            columns_from_buffer(host, header, path, True, base=start)  # raises on a mismatch
        torch.from_dlpack(buf).copy_(staged, non_blocking=True)  # on the read stream; torch keeps `staged` till done
    if verify and verified is not None:
        verified.add(ident)
    return columns_from_buffer(buf, header, path, False, base=start)


def _gds_read(fd: int, path, buf, span: int, start: int, ctx) -> None:
    """``span`` bytes at ``start`` into ``buf``, by GPUDirect Storage, ordered on the read stream."""
    import kvikio

    try:
        cf = kvikio.CuFile(f"/proc/self/fd/{fd}", "r")
        try:
            got = cf.raw_read_async(buf, ctx.read_stream.cuda_stream, span, start).check_bytes_done()  # waits for it
        finally:
            cf.close()
    except RuntimeError as e:  # KvikIO's I/O errors: the cache falls back to decoding, like any OSError
        raise OSError(errno.EIO, f"{path}: KvikIO could not read it ({e})") from None
    if got != span:
        raise CorruptCacheError(f"{path}: truncated cache file ({got} of {span} bytes read)")
