"""Direct I/O: cache files written and read around the page cache (``cache_io=``).

A buffered write copies every byte of a chunk into the page cache, which the kernel then
writes back; the first epoch pays for it (the copy, the page allocations, the writeback, and
the other files' pages it pushes out: the Parquet sources', the training job's) while each
chunk waits for the disk at its fsync anyway, and a cache larger than the memory the page
cache can keep gains nothing from those pages later (they are evicted before the next epoch
reads them). With ``O_DIRECT`` the disk reads and writes the process's own buffers.

* **Writes** of a page-aligned region (the host pools' arrays, which a chunk is packed
  into) go straight from it, whole :data:`BLOCK` s at a time; the region's last partial
  block, and regions elsewhere, go through one page-aligned bounce buffer per thread
  (:data:`BOUNCE` bytes, kept for the thread's life), padded with zeros, so the file's
  bytes are exactly a buffered write's (the format's regions start on 4096-byte
  boundaries and its padding is zeros). Regions that follow one another in the file go to
  the disk together, one ``pwritev`` each time the bounce buffer fills.
* **Reads** go straight into the caller's buffer when it and the offset are aligned (the
  host pools' buffers are, :class:`gpuload.memory.HostPool`); the last partial block
  comes through a small aligned buffer.
* A file system that refuses ``O_DIRECT`` (``EINVAL``), or a buffer that is not
  aligned, gets buffered I/O instead: the functions here return False / None and the
  caller does what it always did.

Which datasets use it is decided by :func:`gpuload.memory.cache_io_modes` (by default the CPU
path's writes and reads, the reads turning buffered after a pass they limited).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading

import numpy as np

__all__ = ["BLOCK", "BOUNCE", "pwrite_all", "pread_all", "write", "read_into", "resident_share"]

BLOCK = 4096  #: alignment of offsets, lengths and buffers (the largest logical block size in use)
BOUNCE = 8 << 20  #: bytes of each thread's bounce buffer for writes
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)  #: buffers in one pwritev
_IOV_MAX = _IOV_MAX if _IOV_MAX > 0 else 1024  # sysconf says -1 where the system does not tell its limit
_local = threading.local()


def _bounce() -> np.ndarray:
    """This thread's page-aligned bounce buffer (anonymous memory: always aligned)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = np.frombuffer(mmap.mmap(-1, BOUNCE), np.uint8)
    return buf


def _direct(fd: int) -> int | None:
    """Turn on ``O_DIRECT`` for ``fd``; its previous flags, or None if the file system (or the
    platform: Linux has it) refuses."""
    if not hasattr(os, "O_DIRECT"):
        return None
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    return flags


def _bytes(data) -> np.ndarray:
    return np.frombuffer(memoryview(data).cast("B"), np.uint8)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (any buffer) to ``fd`` at ``offset``, however many calls it takes
    (each at most 1 GiB: a multiple of :data:`BLOCK`, as direct writes need)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


def pread_all(fd: int, buf, offset: int, direct: bool = False) -> int:
    """Read into ``buf`` (a writable buffer) from ``offset`` until full or end of file; bytes
    read. ``direct``: around the page cache where it can (:func:`read_into`)."""
    if direct:
        got = read_into(fd, buf, offset)
        if got is not None:
            return got
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:got + (1 << 30)]], offset + got)
        if n == 0:
            break
        got += n
    return got


def write(fd: int, pieces: list, total: int) -> bool:
    """Write ``pieces`` (``(offset, buffer)``, each offset a multiple of :data:`BLOCK`) to
    ``fd`` with ``O_DIRECT``, then truncate it to ``total`` bytes (a multiple of
    :data:`BLOCK` at least the end of every piece's last block). Pieces that follow one
    another in the file go to the disk in one ``pwritev`` (each direct write waits for the
    disk: a chunk of 40 small regions was 80 writes). False if the file system refused direct
    I/O before or during the writes (nothing is promised of the file's contents then: write
    it again, buffered). Other ``OSError`` s are raised."""
    flags = _direct(fd)
    if flags is None:
        return False
    try:
        run = _Run(fd, _bounce())
        for offset, data in pieces:
            view = _bytes(data)
            # a page-aligned buffer (the host pools' arrays: a chunk packed for the cache) gives its whole
            # blocks to the disk itself; the rest, and any other buffer, comes through the bounce buffer
            body = len(view) // BLOCK * BLOCK if view.ctypes.data % BLOCK == 0 else 0
            run.seek(offset)
            if body:
                run.add(memoryview(view)[:body])
            for pos in range(body, len(view), BOUNCE):
                run.copy(view[pos:pos + BOUNCE])
        run.flush()
        os.ftruncate(fd, total)
    except OSError as e:
        if e.errno == errno.EINVAL:  # accepted at open, refused at the write (some FUSE and network file systems)
            return False
        raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return True


class _Run:
    """Consecutive bytes of a file to write with one ``pwritev``: whole blocks of the callers'
    buffers and padded copies in the bounce buffer, flushed when the next piece does not follow
    on, when the bounce buffer is full or at :data:`_IOV_MAX` buffers."""

    def __init__(self, fd: int, bounce: np.ndarray):
        self.fd, self.bounce = fd, bounce
        self.iov: list[memoryview] = []
        self.start = self.end = 0  # the file's bytes [start, end) are pending in iov
        self.used = 0  # bytes of the bounce buffer they hold

    def seek(self, offset: int) -> None:
        if offset != self.end:
            self.flush()
            self.start = self.end = offset

    def add(self, buf: memoryview) -> None:
        self.iov.append(buf)
        self.end += len(buf)
        if len(self.iov) >= _IOV_MAX:
            self.flush()

    def copy(self, data: np.ndarray) -> None:
        """``data`` (at most :data:`BOUNCE` bytes) through the bounce buffer, padded with zeros to a
        whole block: the zeros a buffered write leaves as a hole."""
        n = len(data)
        m = -(-n // BLOCK) * BLOCK
        if self.used + m > BOUNCE:
            self.flush()
        b = self.bounce[self.used:self.used + m]
        b[:n] = data
        b[n:] = 0
        self.used += m
        self.add(memoryview(b))

    def flush(self) -> None:
        iov, offset, i = self.iov, self.start, 0
        while i < len(iov):  # a short write (at most about 2 GiB go at once) goes on where it stopped
            n = os.pwritev(self.fd, iov[i:] if i else iov, offset)
            offset += n
            while i < len(iov) and n >= len(iov[i]):
                n -= len(iov[i])
                i += 1
            if n:
                iov[i] = iov[i][n:]
        self.iov, self.start, self.used = [], self.end, 0


def read_into(fd: int, buf, offset: int) -> int | None:
    """Read into ``buf`` from ``offset`` of ``fd`` with ``O_DIRECT`` until full or the end of
    the file; bytes read, or None when it cannot (``buf`` or ``offset`` not aligned, or the
    file system refuses): read it buffered then."""
    view = _bytes(buf)
    if offset % BLOCK or view.ctypes.data % BLOCK or not view.flags.writeable:
        return None
    flags = _direct(fd)
    if flags is None:
        return None
    try:
        body = len(view) // BLOCK * BLOCK
        got = 0
        while got < body:
            n = os.preadv(fd, [memoryview(view)[got:body]], offset + got)
            if n == 0:
                return got
            got += n
        if got < len(view):  # the last partial block, through an aligned block
            tail = _bounce()[:BLOCK]
            n = os.preadv(fd, [memoryview(tail)], offset + got)
            k = min(n, len(view) - got)
            view[got:got + k] = tail[:k]
            got += k
        return got
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def resident_share(path) -> float:
    """The share of ``path``'s pages that are in the page cache now (``mincore`` over a
    read-only mapping; Linux): what buffered I/O left there and direct I/O did not."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(m, np.uint8)
        vec = ctypes.create_string_buffer(pages)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec)
        del view
        if rc != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(path))
        return sum(b & 1 for b in vec.raw) / pages
    finally:
        m.close()
