"""Host memory: buffers reused across chunks, and the bound of what the CPU path holds.

:class:`HostPool`: host buffers reused across chunks, so steady-state epochs do not
fault in fresh pages.

Reading a 64 MiB chunk into a newly allocated buffer costs more in page faults than in
copying (we measured 4-5 GB/s into fresh buffers against 14 GB/s into reused ones on
our CI machine). :class:`HostPool` hands out views of buffers it keeps, and takes a
buffer back only once nothing refers to it any more: every view (and every
``torch.from_numpy`` tensor made from one) holds a reference to the buffer, so a
buffer whose reference count is back to the pool's own is free. Batches a user keeps
therefore stay valid; the pool simply allocates another buffer meanwhile. A request
takes a free buffer of about its size, else a new one while the pool's caps allow, so
arrays of other sizes in use together keep buffers of their own. A pool keeps at most
``max_buffers`` buffers and ``max_bytes`` bytes: at them, a larger free buffer serves, else
it forgets free buffers (the OS gets their memory back) or hands out buffers it does not keep.

:func:`host_budget`: what the CPU path can hold at once, term by term
(:attr:`gpuload.ParquetDataset.host_bytes_bound` is its total); the pools of a
:class:`gpuload.reader.ChunkReader` are capped at their terms, so what they keep for
reuse never adds to it.

:func:`cache_io_modes`: whether a dataset's cache files go around the page cache or through it.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from .machine import memory_bytes

__all__ = ["device_bound", "CacheIO", "cache_io_modes", "reads_limited", "file_bytes", "HostPool", "HostBudget", "host_budget", "size_text"]

ALIGN = 4096  #: where pooled arrays start: a page, as direct I/O needs (gpuload.cache.directio)
_ROUND = 1 << 20  # buffers are sized in whole MiB (and coarser: _size_class), so similar sizes share them


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole MiB and to the next of 8 steps per power of two
    (at most 12.5% more), so arrays of similar sizes (windows of other chunks, a last
    smaller batch) fit buffers made for one another."""
    n = -(-nbytes // _ROUND) * _ROUND
    step = max(_ROUND, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _aligned(buf: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of ``buf`` from its first :data:`ALIGN` boundary (a view: it
    keeps ``buf`` alive, which is what tells the pool the buffer is in use)."""
    start = -buf.ctypes.data % ALIGN
    return buf[start:start + nbytes]


class HostPool:
    """A bounded set of reusable uint8 host buffers.

    Parameters
    ----------
    max_buffers : buffers kept for reuse (default 16); beyond it, allocations are not kept.
    max_bytes : bytes of the buffers kept (default None: no limit but ``max_buffers``); where
        a new buffer would go beyond either cap, a larger free buffer serves the request, else
        free buffers are forgotten to make room, else the array is handed out without being
        kept (:meth:`get` says in which order).
    """

    def __init__(self, max_buffers: int = 16, max_bytes: int | None = None):
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._bufs: list[np.ndarray] = []
        self._keys: list = []  # each buffer's key (None: any request's), in step with _bufs
        self._lock = threading.Lock()
        probe = [np.empty(1, np.uint8)]
        self._free_refs = self._refs(probe, 0)  # the count of a buffer nobody else holds

    @staticmethod
    def _refs(bufs: list, i: int) -> int:
        return sys.getrefcount(bufs[i])

    def get(self, nbytes: int, key=None, reserve: int = 0) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` bytes (contents undefined), starting on a
        :data:`ALIGN` boundary when it is pooled (so direct I/O can read into it).

        ``reserve`` (default 0): bytes a keyed role's arrays may grow to (the largest window of
        the epoch): a new buffer for the request is made that large where it fits the caps without
        forgetting a buffer (else of the request's own size), so that a later, larger
        array of the role finds it, instead of the role's buffers being forgotten and made
        again in fresh memory as a first epoch's windows grow.

        ``key`` (default None): the role of the array (a window's column). A keyed buffer serves
        its key alone: a keyed request takes the smallest free buffer of its key that holds it;
        the key's free buffers too small for it are forgotten (its arrays grew: a larger window);
        then it goes on as an unkeyed request but never takes a free buffer more than a quarter
        larger. So each role keeps buffers of its largest size, as many as it has in use at once,
        and a small array never holds a large one's buffer while the large one goes to fresh
        memory (which also keeps the window term of :func:`host_budget` a bound).

        Unkeyed: a free unkeyed buffer serves it if it is at most a quarter (and a MiB) larger;
        else a new buffer is kept if it fits the caps as they stand; else a larger free buffer
        serves it; else free buffers (all too small for it) are forgotten to make room; else it
        is an array the pool does not keep (freed with its last user)."""
        if nbytes < _ROUND:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            if key is not None:
                mine = [i for i in range(len(self._bufs)) if self._keys[i] == key and self._free(i)]
                fit = [i for i in mine if self._bufs[i].nbytes - ALIGN >= nbytes]
                if fit:
                    return _aligned(self._bufs[min(fit, key=lambda i: self._bufs[i].nbytes)], nbytes)
                self._forget(set(mine))  # too small for the key's arrays from now on
            best = -1
            for i in range(len(self._bufs)):
                size = self._bufs[i].nbytes - ALIGN
                if size >= nbytes and self._keys[i] is None and self._free(i) and (
                        best < 0 or size < self._bufs[best].nbytes - ALIGN):
                    best = i
            if best >= 0 and self._bufs[best].nbytes - ALIGN <= nbytes * 5 // 4 + _ROUND:
                return _aligned(self._bufs[best], nbytes)
            size = _size_class(nbytes) + ALIGN
            if key is not None and reserve > nbytes:  # the role's largest, where it fits besides what is kept
                wide = _size_class(reserve) + ALIGN
                size = wide if self._fits(wide) else size
            if best >= 0 and key is None and not self._fits(size):
                return _aligned(self._bufs[best], nbytes)
            if not self._make_room(size):
                return _aligned(np.empty(nbytes + ALIGN, np.uint8), nbytes)  # not kept: freed with its last user
            buf = np.empty(size, np.uint8)
            self._bufs.append(buf)
            self._keys.append(key)
            return _aligned(buf, nbytes)

    def _free(self, i: int) -> bool:
        """Whether buffer ``i`` is held by nobody but the pool (no array of it is alive)."""
        return self._refs(self._bufs, i) <= self._free_refs

    def _forget(self, drop: set) -> None:
        if drop:
            self._bufs = [b for i, b in enumerate(self._bufs) if i not in drop]
            self._keys = [k for i, k in enumerate(self._keys) if i not in drop]

    def _fits(self, size: int) -> bool:
        """Whether one more buffer of ``size`` bytes fits both caps without forgetting any."""
        return len(self._bufs) < self.max_buffers and (
            self.max_bytes is None or sum(b.nbytes for b in self._bufs) + size <= self.max_bytes)

    def _make_room(self, size: int) -> bool:
        """Forget free buffers until one more of ``size`` bytes fits both limits (largest
        first for the bytes, smallest first for the count); False if it cannot fit."""
        free = [i for i in range(len(self._bufs)) if self._free(i)]
        drop = set()
        held = sum(b.nbytes for b in self._bufs)
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        for i in sorted(free, key=lambda i: -self._bufs[i].nbytes):
            if self.max_bytes is None or held + size <= self.max_bytes:
                break
            drop.add(i)
            held -= self._bufs[i].nbytes
        if self.max_bytes is not None and held + size > self.max_bytes:
            return False
        if len(self._bufs) - len(drop) >= self.max_buffers:
            left = [i for i in free if i not in drop]
            if not left:
                return False
            drop.add(min(left, key=lambda i: self._bufs[i].nbytes))
        self._forget(drop)
        return True

    def array(self, shape, dtype, key=None, grow: float = 1.0) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` from the pool (``key``: as for
        :meth:`get`; ``grow``: its ``reserve`` as a multiple of the array's bytes)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        n = int(math.prod(shape)) * dtype.itemsize  # math.prod: np.prod costs 3 us a call, a few dozen a batch
        return self.get(n, key, int(n * grow) if grow > 1 else 0).view(dtype).reshape(shape)

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (free or in use)."""
        return sum(b.nbytes for b in self._bufs)

    def clear(self) -> None:
        """Keep no buffer: free ones go back to the system now, those in use when their last
        user lets go (the pool still serves requests, from new buffers)."""
        with self._lock:
            self._bufs, self._keys = [], []


def _kept(nbytes: float) -> int:
    """The most a pool buffer made for ``nbytes`` bytes takes: its size class (12.5% and a MiB more
    at most). A free buffer may then serve a request up to a quarter smaller than it was made for;
    each term below counts its items at the largest one's size, which no buffer made for one of
    them exceeds, and a window's arrays each keep their own buffers (keyed: :meth:`HostPool.get`).
    Under a MiB a buffer is not pooled: exactly its size."""
    if nbytes < _ROUND:
        return int(nbytes)
    return int(nbytes * 9 / 8) + (1 << 20)


@dataclass(frozen=True)
class HostBudget:
    """What the CPU path can hold at once, in bytes, term by term (see :func:`host_budget`)."""

    windows: int  #: joined shuffle windows: the one being cut and the next one (window pool; with a block shuffle, their chunks, not joined, in the read pool)
    chunks: int  #: chunks loaded and not joined yet: the next window's and those ahead (read pool)
    batches: int  #: batches queued, held by the consumer, being cut (one per loader thread) or handed off (batch pool)
    decode: int  #: per loader thread, a chunk being decoded: its Parquet bytes, Arrow table and packed arrays
    writes: int  #: decoded chunks waiting for the cache writer
    remote: int  #: remote sources: read-ahead, requests in flight, and the ranges being decoded
    trace: int = 0  #: the events the dataset's Metrics keeps for its trace (Metrics.max_trace_nbytes)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def size_text(nbytes: float) -> str:
    """``nbytes`` for people: ``"1.25 GiB"``, ``"3.0 MiB"``, ``"12.0 KiB"``, ``"512 bytes"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} bytes"


def file_bytes(chunk_bytes: int, arrays: int, header: int = 64 << 10) -> int:
    """The most a cache file of a chunk of ``chunk_bytes`` converted bytes in ``arrays`` arrays
    takes on disk: its arrays, each 4 KiB aligned, and its header (``header`` bytes at most, default
    64 KiB; a dataset that knows its column set's description gives a closer bound)."""
    return int(chunk_bytes) + 4096 * (arrays + 2) + int(header)


def host_budget(chunk_bytes: int, row_bytes: float, arrays: int, *, batch_size: int, shuffle_window: int,
                prefetch: int, num_threads: int, shuffle: bool = True, block: bool = False, remote=None,
                pending_writes: int = 2, trace_bytes: int = 0) -> HostBudget:
    """The host memory the CPU path of a dataset can hold at once, in bytes, by term.

    Parameters
    ----------
    chunk_bytes : converted bytes of the largest chunk (``ChunkReader.max_chunk_bytes()``).
    row_bytes : converted bytes of the widest row (a chunk's bytes over its rows, largest).
    arrays : arrays stored per chunk (outputs, plus offsets of list outputs).
    batch_size, shuffle_window, prefetch, num_threads, shuffle, block : the dataset's settings
        (``block``: block shuffling, whose chunks are permuted once more when decoded).
    remote : the :class:`gpuload.RemoteSettings` of a remote source, or None (local files).
    pending_writes : chunks the cache writers may hold (``gpuload.cache.writer.PENDING`` per cache folder).
    trace_bytes : the most the dataset's :class:`gpuload.Metrics` keeps for its trace.

    Terms (C: ``chunk_bytes``; a chunk file is C plus its header and 4 KiB alignment; a
    pooled buffer is made up to 12.5% and 1 MiB larger than asked: :func:`_kept`): shuffled, 2 windows of
    ``shuffle_window`` chunks and ``shuffle_window + prefetch + 1`` chunks not joined yet;
    in file order, no windows but ``3 x prefetch + 8 + num_threads`` chunks (loaded ahead, kept
    by the batches that are views of them, and the next epoch's first ``prefetch + 2``, loaded
    while the last ones are cut: :mod:`gpuload.preload`); ``prefetch + 6 + num_threads`` batches of ``batch_size``
    rows (the CPU path gathers one per loader thread at once, in order); per
    loader thread 3 C being decoded (4 with block shuffling); ``pending_writes`` C; and for a
    remote source ``readahead_bytes + max_inflight_bytes`` plus ``num_threads + 1`` chunks'
    fetched ranges (their compressed bytes, taken as at most C).
    """
    c = int(chunk_bytes)
    file = _kept(file_bytes(c, arrays))
    batch = _kept(batch_size * row_bytes) + arrays * (1 << 20)
    if shuffle:
        windows = 2 * (_kept(shuffle_window * c) + arrays * (1 << 20))
        chunks = (shuffle_window + prefetch + 1) * file
    else:
        windows, chunks = 0, (3 * prefetch + 8 + num_threads) * file
    remote_bytes = 0 if remote is None else (remote.readahead_bytes + remote.max_inflight_bytes
                                             + (num_threads + 1) * c)
    return HostBudget(windows=windows, chunks=chunks, batches=(prefetch + 6 + num_threads) * batch,
                      decode=num_threads * (4 if block else 3) * c, writes=pending_writes * c, remote=remote_bytes,
                      trace=int(trace_bytes))


def device_bound(chunk_bytes: int, chunk_rows: int, *, batch_size: int, shuffle_window: int, prefetch: int,
                 num_threads: int, gpu_decode: bool, shuffled: bool = True) -> int:
    """Upper bound of the device memory the GPU path holds at once, in bytes.

    With C the largest chunk's converted bytes (``chunk_bytes``) and R its rows
    (``chunk_rows``): the window being cut (``shuffle_window`` C), the next one's chunks and
    their concatenation (2 x ``shuffle_window`` C), the chunks loaded ahead (``prefetch`` C)
    and one being decoded (C), plus the batches queued for the consumer and being cut
    (``prefetch + 4`` of ``batch_size`` rows, with 16 bytes per row for the gather's index
    arrays). While cuDF decodes (``gpu_decode``, the first epoch), two more chunks per loader
    thread (``num_threads``) for the converted columns packed into the storage layout, and
    24 bytes per row for the index arrays of null masks; cuDF's own decode buffers come from
    RMM and are not counted. In file order (not ``shuffled``) no window is joined, and the
    chunks are ``3 x prefetch + 8`` C instead: the one being cut and the one taken after it,
    those loaded ahead, those the queued batches are views of (``prefetch + 4``), and the next
    epoch's first ``prefetch + 2``, loaded while the last ones are cut (:mod:`gpuload.preload`).
    Independent of the dataset's size.
    """
    row = chunk_bytes / max(1, chunk_rows)
    decoding = num_threads * (2 * chunk_bytes + 24 * chunk_rows) if gpu_decode else 0
    chunks = 3 * shuffle_window + prefetch + 1 if shuffled else 3 * prefetch + 8
    return int(chunks * chunk_bytes + decoding + (prefetch + 4) * batch_size * (row + 16))


class CacheIO(NamedTuple):
    """How a dataset's chunk files go to and from the disk (:func:`cache_io_modes`).

    ``writes`` / ``reads``: around the page cache (``O_DIRECT``, :mod:`gpuload.cache.directio`)
    or through it; ``adapts``: the reads may turn buffered after a pass they limited
    (:meth:`gpuload.reader.ChunkReader.pass_ended`)."""

    writes: bool
    reads: bool
    adapts: bool


def cache_io_modes(cache_io: str, cache_bytes: int, memory: int | None = None, host: bool = True) -> CacheIO:
    """How a dataset whose chunk files take ``cache_bytes`` writes and reads them:
    ``cache_io="direct"`` around the page cache, ``"buffered"`` through it, ``"auto"`` on the
    CPU path (``host``):

    * writes direct: a buffered write copies each chunk into newly allocated page-cache pages
      (``dd`` of 2.9 GB on the 2-core VM of docs/benchmarks.md: 1.3 CPU seconds, 6.9 where
      the VM backs the pages afresh, against 0.4 direct) and the chunk still waits for the
      disk at the fsync it gets before its rename;
    * reads direct, so cached epochs cost no page-cache copies either; where the files fit in
      half of ``memory`` (default :func:`memory_bytes`) the reads may turn buffered, from the
      next pass on, once a pass shows the disk is slower than the epochs need: the page
      cache then keeps the files between epochs. Files that do not fit would be evicted
      before the next epoch read them.

    On a GPU (``host=False``), whose reads go their own way (pinned copies or GPUDirect
    Storage: :mod:`gpuload.gpu.kvikio_read`), ``"auto"`` writes direct only files that do not
    fit in half the memory (not measured on a GPU otherwise: docs/gpu-testing.md); buffered
    writes leave the next epoch's reads in memory there.

    The reader passes all of a dataset's chunk files (at most its ``max_cache_bytes``); with
    ``shard="node"``, every node's share counts, as ranks are known only when an epoch begins."""
    if cache_io != "auto":
        direct = cache_io == "direct"
        return CacheIO(direct, direct, False)
    fits = cache_bytes <= (memory_bytes() if memory is None else memory) // 2
    return CacheIO(True, True, fits) if host else CacheIO(not fits, not fits, False)


#: a pass whose training thread waited at least this share of its time after its first batch ...
READS_WAITED = 0.1
#: ... while cache reads kept at least this many loader threads busy all along (summed over threads,
#: as a share of the pass) was limited by its direct reads; shorter passes than :data:`READS_PASS_S`
#: seconds are not judged
READS_BUSY = 0.75
READS_PASS_S = 2.0


def reads_limited(wall: float, waited: float, read_busy: float) -> bool:
    """Whether a pass of ``wall`` seconds whose training thread waited ``waited`` of them after its
    first batch (the start-up, every loader thread reading the first window, does not count) was
    limited by cache reads that kept the loader threads busy ``read_busy`` seconds, summed over
    threads: it waited :data:`READS_WAITED` of its time or more while the reads took
    :data:`READS_BUSY` of it or more, as if one thread read all along (a disk that answers no
    faster than the loader asks). On the 2-core VM of docs/benchmarks.md a cached epoch's direct
    reads took 0.93 of its wall on 2 threads with the step waiting 3-7%: not limited."""
    return wall >= READS_PASS_S and waited >= READS_WAITED * wall and read_busy >= READS_BUSY * wall
