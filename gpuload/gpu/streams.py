"""The loader's device, streams, events and memory (the stream model: :mod:`gpuload.gpu.runtime`).

One :class:`DeviceContext` per dataset. Two torch streams, each wrapped for CuPy:

* ``read_stream``: loader threads, inside :meth:`DeviceContext.reading` (cache reads,
  uploads, libcudf decode and conversion, storage-layout packing);
* ``batch_stream``: the window and producer threads, inside :meth:`DeviceContext.batching`
  (window concatenation, permutation gathers, batch slices, hand-off).

A chunk crosses from one to the other through :meth:`DeviceContext.handover` (an event
recorded on the read stream after the chunk's last work) and :meth:`DeviceContext.receive`
(the batch stream waits on that event before its first use of the chunk).

Memory: every device array gpuload makes comes from **torch's caching allocator**
(:meth:`DeviceContext._alloc`, CuPy's allocator inside both contexts), on the stream
current on the calling thread, and is guarded for the other streams that may read it
(:func:`guard`), so torch never reuses a block under a later reader. With RMM's torch
allocator (:func:`gpuload.share_rmm_pool`), which ignores ``record_stream``, an owner
(:class:`_ReleasedAfter`) does the same by hand.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

from ..batch import Ragged, nbytes, nrows
from .rmm_pool import stream_ordered, torch_uses_rmm

__all__ = ["DeviceContext", "guard", "held_for", "Loaded"]


class Loaded:
    """A chunk's column set on the device and its ready event (recorded on the read stream
    after the last work that made it): what a loader thread hands to the batch stream."""

    __slots__ = ("cols", "event")

    def __init__(self, cols: dict, event):
        self.cols, self.event = cols, event


def guard(tensor, stream, readers, rmm: bool):
    """The owner that keeps ``tensor`` (a block allocated on ``stream``) from reuse until the
    work that ``readers`` (the other streams that may read it) queued before its release is done.

    With torch's caching allocator: ``record_stream`` for each reader (at the block's free,
    torch records an event on each and reuses the block once they have passed); the
    tensor is the owner. With RMM's torch allocator (``rmm``), which ignores
    ``record_stream``: a :class:`_ReleasedAfter` owner.
    """
    if rmm:
        return _ReleasedAfter(tensor, stream, readers)
    for s in readers:
        tensor.record_stream(s)
    return tensor


def held_for(tensor: torch.Tensor, stream, readers, rmm: bool) -> torch.Tensor:
    """``tensor`` (made on ``stream``) kept from reuse until the work ``readers`` queued before
    its release is done (:func:`guard`): with torch's caching allocator the tensor itself;
    with RMM's (``rmm``), a view of the same memory whose owner makes ``stream`` wait for the
    readers before the free."""
    if tensor.untyped_storage().nbytes() == 0:  # no memory to guard
        return tensor
    owner = guard(tensor, stream, readers, rmm)
    if owner is tensor:
        return tensor
    import cupy

    storage, index = tensor.untyped_storage(), tensor.device.index
    with cupy.cuda.Device(index):
        raw = cupy.ndarray((storage.nbytes(),), cupy.uint8, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(storage.data_ptr(), storage.nbytes(), owner, index), 0))
    held = torch.from_dlpack(raw).untyped_storage()  # keeps raw, so the owner, so the tensor
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        held, tensor.storage_offset(), tensor.size(), tensor.stride())


class _ReleasedAfter:
    """Owner of a block when torch allocates from RMM: dropped with the last view of the block,
    it makes the allocating stream wait for the work each reader stream has queued, then
    drops the tensor, so RMM frees the block in the allocating stream's order after that work."""

    __slots__ = ("tensor", "stream", "readers")

    def __init__(self, tensor, stream, readers):
        self.tensor, self.stream, self.readers = tensor, stream, tuple(readers)

    def __del__(self):
        try:
            for s in self.readers:
                self.stream.wait_stream(s)
        except Exception:  # noqa: S110 - at interpreter exit CUDA may already be gone
            pass


def _cupy_stream(cupy, stream, index: int):
    """CuPy's view of torch stream ``stream`` (call inside ``cupy.cuda.Device(index)``)."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)  # CuPy >= 14
    return cupy.cuda.ExternalStream(stream.cuda_stream, index)


class DeviceContext:
    """The loader's CUDA device, streams and memory (one per dataset).

    Parameters
    ----------
    device : the CUDA ``torch.device`` (with its index).
    consumer : the stream batches are used on (default: the current stream of the
        calling thread; a dataset sets it each time iteration begins).
    metrics : a :class:`gpuload.Metrics` recording ``h2d`` spans for uploads and
        ``cache_write`` spans for the copies back to the host (default None).
    gds : read the cache by GPUDirect Storage (:func:`gpuload.gpu.runtime.configure_kvikio`;
        default False: pinned memory and a copy on the read stream).
    """

    def __init__(self, device: torch.device, consumer=None, metrics=None, gds: bool = False):
        import cupy

        self.metrics = metrics
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        # the first device calls: the two streams (non-blocking: they never wait for the
        # legacy default stream, nor it for them)
        self.read_stream = torch.cuda.Stream(self.index)
        self.batch_stream = torch.cuda.Stream(self.index)
        self.consumer = consumer or torch.cuda.current_stream(self.index)
        with cupy.cuda.Device(self.index):  # CuPy binds a stream to the device current at its creation
            self._cp = {self.read_stream: _cupy_stream(cupy, self.read_stream, self.index),
                        self.batch_stream: _cupy_stream(cupy, self.batch_stream, self.index)}
        self.rmm = torch_uses_rmm()  #: whether torch allocates from RMM (which ignores record_stream)
        self._local = threading.local()
        self._decode = None  # the read stream for libcudf, made on first use
        self.gds = gds  #: cache reads by GPUDirect Storage: see gpuload.gpu.kvikio_read

    # -- streams ----------------------------------------------------------------------
    def reading(self):
        """Context: run the block on the read stream, CuPy allocating through :meth:`_alloc`
        (loader threads: cache reads, uploads, decoding). Re-entrant, on any thread."""
        return self._on(self.read_stream)

    def batching(self):
        """Context: run the block on the batch stream, CuPy allocating through :meth:`_alloc`
        (window and producer threads: concatenation, gathers, batches, hand-off)."""
        return self._on(self.batch_stream)

    @contextlib.contextmanager
    def _on(self, stream):
        if getattr(self._local, "stream", None) is stream:  # already there on this thread
            yield self
            return
        import cupy

        outer = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            with torch.cuda.device(self.index), torch.cuda.stream(stream), cupy.cuda.Device(self.index), \
                    self._cp[stream], cupy.cuda.using_allocator(self._alloc):
                yield self
        finally:
            self._local.stream = outer

    def handover(self, cols: dict) -> Loaded:
        """On a loader thread, inside :meth:`reading`, once chunk ``cols`` is loaded: the chunk
        with its ready event, recorded on the read stream after every kernel and copy that
        made it (all queued by now on this stream)."""
        event = torch.cuda.Event()
        event.record(self.read_stream)
        return Loaded(cols, event)

    def receive(self, item: Loaded) -> dict:
        """On a batching thread, before any use of the chunk: the batch stream waits (on the
        GPU) for the chunk's ready event, so everything it runs on the chunk from now on
        follows the chunk's read or decode. Returns the column set."""
        self.batch_stream.wait_event(item.event)
        return item.cols

    def read_done(self) -> None:
        """Block the calling thread until the work queued on the read stream so far is done:
        an event recorded now and waited for, so the read and decode work other loader
        threads queue after this call is not waited for (``stream.synchronize()`` would)."""
        event = torch.cuda.Event()
        event.record(self.read_stream)
        event.synchronize()

    # -- memory -------------------------------------------------------------------------
    def readers(self, stream) -> list:
        """The streams besides ``stream`` that may read a block allocated on it: the batch
        stream and the consumer's for the read stream (chunks are cut into batches, and
        without shuffling batches are views of chunks), the consumer's for the batch stream."""
        if stream == self.read_stream:
            return [self.batch_stream, self.consumer]
        return [self.consumer]

    def _alloc(self, size: int):
        """CuPy allocator hook: torch memory on the calling thread's stream, guarded for its readers."""
        import cupy

        stream = torch.cuda.current_stream(self.index)  # the read or the batch stream (see _on)
        t = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)  # ordered on `stream`
        owner = guard(t, stream, self.readers(stream), self.rmm)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, owner, self.index), 0)

    def hand_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor made on the batch stream outside gpuload's memory (by a ``batch_transform``),
        guarded for the consumer's stream as gpuload's own blocks are (:func:`guard`): with
        torch's caching allocator the tensor itself; with RMM's, a view of the same memory
        whose owner makes the batch stream wait for the consumer's work before the free."""
        return held_for(tensor, self.batch_stream, [self.consumer], self.rmm)

    def empty_bytes(self, nbytes: int):
        """An uninitialised CuPy uint8 array of ``nbytes`` (call inside :meth:`reading` or :meth:`batching`)."""
        import cupy

        return cupy.empty(nbytes, dtype=cupy.uint8)

    def decode_stream(self):
        """The read stream as an rmm ``Stream``, for libcudf. The first call also makes
        RMM's resource for this device stream-ordered (:func:`gpuload.gpu.rmm_pool.stream_ordered`)."""
        if self._decode is None:
            from rmm.pylibrmm.stream import Stream

            stream_ordered(self.index)
            self._decode = Stream(self._cp[self.read_stream])
        return self._decode

    # -- host <-> device ----------------------------------------------------------------
    def upload(self, cols: dict) -> dict:
        """Host column set -> device column set (inside :meth:`reading`); a device set is returned as is.

        Each array is staged in pinned memory from torch's host allocator and copied
        with ``non_blocking=True`` on the read stream; torch keeps the pinned block
        until its copy is done. The returned arrays are ordered on the read stream.
        """
        if not isinstance(_first_array(cols), np.ndarray):
            return cols  # already on the device (decoded by cuDF or read from the cache)

        def one(a: np.ndarray):
            a = np.ascontiguousarray(a)
            dst = self.empty_bytes(a.nbytes)
            if a.nbytes:
                src = torch.empty(a.nbytes, dtype=torch.uint8, pin_memory=True)  # one copy into it, as pin_memory()
                src.numpy()[:] = a.reshape(-1).view(np.uint8)  # makes (a read-only array is fine here)
                torch.from_dlpack(dst).copy_(src, non_blocking=True)
            return dst.view(a.dtype).reshape(a.shape)

        with self._span("h2d", cols):
            return {k: Ragged(one(v.values), one(v.offsets)) if isinstance(v, Ragged) else one(v)
                    for k, v in cols.items()}

    def _span(self, stage: str, cols: dict):
        if self.metrics is None:
            return contextlib.nullcontext()
        return self.metrics.span(stage, nbytes=nbytes(cols), rows=nrows(cols))

    def to_host(self, cols: dict) -> dict:
        """Device column set (made on the read stream) -> NumPy arrays in pinned memory (for
        the cache writer); a host set is returned as is. The copies are queued on the read
        stream, then the calling thread waits for one event recorded after them (not for
        the whole stream).

        The arrays are views of pinned blocks from torch's host allocator: the copies run at
        the bus's speed (into pageable memory the driver stages them, about a third of it),
        and each block goes back to torch's cache of pinned blocks, for the next chunk, when
        the writer drops its arrays. That cache keeps what the largest chunks in flight at
        once needed (the writer holds a bounded number), rounded up to powers of two."""
        import cupy

        if not isinstance(_first_array(cols), cupy.ndarray):
            return cols  # decoded on the CPU: already host arrays
        cp_read = self._cp[self.read_stream]
        queued = []  # every block a copy was queued into, held until the event: if one() fails
        # half-way, unwinding would free the blocks already queued before read_done ran (CuPy's
        # copies record nothing in torch's host allocator, which would hand them out again)

        def one(a):
            pinned = torch.empty(a.nbytes, dtype=torch.uint8, pin_memory=True).numpy()  # keeps the block
            queued.append(pinned)
            out = pinned.view(a.dtype).reshape(a.shape)
            a.get(stream=cp_read, out=out, blocking=False)  # a strided view is made contiguous on cp_read first
            return out

        with self._span("cache_write", cols):  # the device-to-host half of a cache write
            try:
                host = {k: Ragged(one(v.values), one(v.offsets)) if isinstance(v, Ragged) else one(v)
                        for k, v in cols.items()}
            finally:  # also when one fails: no block goes back to torch with a copy into it queued
                self.read_done()
        return host

    def upload_index(self, idx: np.ndarray):
        """A host index array (a window permutation) on the device, inside :meth:`batching`."""
        import cupy

        return cupy.asarray(idx)


def _first_array(cols: dict):
    """One array of a column set (a set is all on the host or all on the device)."""
    v = next(iter(cols.values()), None)
    return v.values if isinstance(v, Ragged) else v
