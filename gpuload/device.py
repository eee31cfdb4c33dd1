"""Device: where a dataset's chunks and batches live, chosen once when it opens.

:func:`open_device` turns ``Options.device`` into one object, :class:`Host` (the CPU
path) or :class:`Cuda` (the GPU path), which offers everything the reader, the pipeline
and the builders need from a device, so none of them asks which one it has:

* the pipeline's two sides (:class:`gpuload.pipeline.Stages`): ``reading()`` around a
  chunk's load or build, ``batching()`` around windows and batches, ``handover`` and
  ``receive`` as a chunk crosses between them (docs/architecture.md, "Threads");
* where a chunk goes after a decode on the CPU (:meth:`~Host.upload`), where a window's
  permutation goes (:meth:`~Host.upload_index`), and where window and batch arrays are
  allocated (:meth:`~Host.host_alloc`: the host pools, or CuPy on the loader's streams);
* the chunk cache's reads (:meth:`~Host.cache`: into reused host buffers, or into device
  memory), the decoder (:meth:`~Host.decoder`: pyarrow, or cuDF), and the hand-off of
  batches to torch (:meth:`~Host.handoff`: ``from_numpy``, or DLPack with a ready event).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .cache.drives import open_cache
from .cache.store import ChunkCache
from .errors import ConfigError, GpuloadError, setting
from .pipeline import Stages

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: a cache build on the CPU (``gpuload cache build``, a Dask
# worker's) opens a Host device and never needs it (its import takes seconds)

__all__ = ["Host", "Cuda", "Device", "open_device", "resolve_device", "check_device"]

log = logging.getLogger("gpuload")


def resolve_device(device) -> torch.device:
    """Turn ``"auto" | "cpu" | "cuda" | "cuda:N"`` (or a torch.device) into a torch.device.

    ``"auto"`` picks the GPU when the GPU path can run (a driver and CuPy with
    ``cupy.cuda.is_available()``: :func:`gpuload.gpu.runtime.gpu_usable`; KvikIO and cuDF are
    optional), else the CPU with one log line saying why. An explicit CUDA device without
    them raises :class:`GpuloadError` naming the missing piece (driver, cupy).
    """
    import torch

    from .gpu.runtime import gpu_usable, missing_pieces, require_gpu

    text = str(device)
    if text == "auto":
        if gpu_usable():
            return torch.device("cuda", torch.cuda.current_device())
        missing = missing_pieces()
        log.info("gpuload: loading on the CPU (GPU path unavailable: %s)",
                 "; ".join(f"{k}: {v}" for k, v in missing.items()))
        return torch.device("cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{setting('device', device)} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"{setting('device', device)}: gpuload loads to 'cpu' or 'cuda' devices only")
    require_gpu(text, "cpu")  # names the first missing piece
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise GpuloadError(f"{setting('device', device)}: only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", index)


def check_device(device) -> None:
    """Refuse a ``device=`` gpuload cannot load to, as :func:`resolve_device` does; ``"cpu"``
    without importing torch (a cache build on the CPU never needs it: its import takes seconds)."""
    if device != "cpu":
        resolve_device(device)


class Host(Stages):
    """The CPU path: chunks and batches are NumPy arrays in reused host buffers; nothing to
    wait for between the pipeline's sides (the :class:`~gpuload.pipeline.Stages` defaults)."""

    gpu_decode = False  #: whether cuDF decodes Parquet
    on_host = True  #: whether chunks and batches are in host memory

    @property
    def torch_device(self) -> torch.device:
        """Where batches are: the CPU."""
        import torch

        return torch.device("cpu")

    def upload(self, cols: dict) -> dict:
        """A chunk's column set where batches are cut from it: here, as it is."""
        return cols

    def upload_index(self, index):
        """A window's permutation (NumPy) where the gathers run: here, as it is."""
        return index

    def host_alloc(self, pool):
        """``alloc(shape, dtype)`` for batch arrays and ``alloc(shape, dtype, key, grow)`` for window arrays:
        ``pool``'s (a :class:`gpuload.memory.HostPool`)."""
        return pool.array

    def cache(self, options, metrics, read_pool) -> ChunkCache:
        """The chunk cache of ``options``, reading files into ``read_pool``'s reused buffers."""
        return open_cache(options.cache_dir, options.max_cache_bytes, options.verify_checksums, metrics=metrics,
                          alloc=read_pool.get)

    def decoder(self, cpu, metrics):
        """The decoder of first epochs: ``cpu`` (a :class:`gpuload.decode.ArrowDecoder`)."""
        return cpu

    def handoff(self, views: dict, layout, batch_pool):
        """The hand-off of an iteration beginning now: CPU tensors sharing the batches' memory,
        blocks unpacked into ``batch_pool``'s buffers."""
        from .handoff import HostHandoff

        return HostHandoff(views, layout, batch_pool.array)

    def consumer_stream(self):
        """The stream batches are used on, which loaded memory is guarded for: none here."""
        return None

    def check_bound(self, bound: int, limit: int | None, terms: str) -> None:
        """Nothing: ``max_device_bytes`` limits device memory (the host's bound is
        :attr:`gpuload.ParquetDataset.host_bytes_bound`)."""


class Cuda:
    """The GPU path on one CUDA device: the loader's streams and memory (``ctx``, a
    :class:`gpuload.gpu.streams.DeviceContext`), cache reads into device memory, and cuDF
    decoding when ``gpu_decode``."""

    on_host = False  #: whether chunks and batches are in host memory

    def __init__(self, ctx, gpu_decode: bool):
        self.ctx, self.gpu_decode = ctx, gpu_decode
        self.torch_device = ctx.device  #: where batches are
        self.reading, self.batching = ctx.reading, ctx.batching
        self.handover, self.receive = ctx.handover, ctx.receive
        self.upload, self.upload_index = ctx.upload, ctx.upload_index

    def host_alloc(self, pool):
        """None: window and batch arrays are CuPy's, in the loader's device memory."""
        return None

    def cache(self, options, metrics, read_pool) -> ChunkCache:
        """The chunk cache of ``options``, reading files into device memory on the read stream
        (:mod:`gpuload.gpu.kvikio_read`); a chunk decoded on the device is copied back to be
        written, and files this process wrote count as checked."""
        from .gpu.kvikio_read import read_chunk_device

        ctx = self.ctx
        return open_cache(options.cache_dir, options.max_cache_bytes, options.verify_checksums,
                          read=lambda fd, p, want, verify, seen: read_chunk_device(fd, p, want, ctx, verify, seen),
                          to_host=ctx.to_host, trust_writes=True, metrics=metrics)

    def decoder(self, cpu, metrics):
        """cuDF (:class:`gpuload.gpu.decoder.GpuDecoder`, falling back to ``cpu`` per chunk) where
        ``gpu_decode``, else ``cpu``."""
        if not self.gpu_decode:
            return cpu
        from .gpu.decoder import GpuDecoder

        return GpuDecoder(self.ctx, cpu, metrics)

    def handoff(self, views: dict, layout, batch_pool):
        """The hand-off of an iteration beginning now, on the training thread: batches are
        guarded for (and waited on by) the stream current now."""
        import torch

        from .handoff import DlpackHandoff

        self.ctx.consumer = torch.cuda.current_stream(self.torch_device)
        return DlpackHandoff(self.ctx, views, layout)

    def consumer_stream(self):
        """The stream batches are used on (set by :meth:`handoff`), which loaded memory is guarded for."""
        return self.ctx.consumer

    def hold(self, made_on):
        """``hold(tensor, reader)``: ``tensor``, made on stream ``made_on`` by torch's allocator,
        kept from reuse until stream ``reader`` is done with it (a :class:`gpuload.Mix`'s steps)."""
        from .gpu.streams import held_for

        rmm = self.ctx.rmm
        return lambda tensor, reader: held_for(tensor, made_on, [reader], rmm)

    def check_bound(self, bound: int, limit: int | None, terms: str) -> None:
        """Refuse settings whose device memory bound (``bound`` bytes, made of ``terms``) is over ``limit``."""
        if limit is not None and bound > limit:
            raise ConfigError(f"max_device_bytes={limit}: these settings may hold up to {bound} bytes of device "
                              f"memory ({terms}); lower chunk_bytes, shuffle_window or prefetch")


Device = Host | Cuda


def open_device(options, metrics=None) -> Device:
    """The device of ``options`` (a :class:`gpuload.config.Options`), opened: ``device`` resolved
    (:func:`resolve_device`); for CUDA the pieces checked, KvikIO configured and the loader's
    streams made (:func:`gpuload.gpu.runtime.open_device`)."""
    if options.device == "cpu":
        return Host()  # without torch's import (check_device)
    where = resolve_device(options.device)
    if where.type != "cuda":
        return Host()
    from .gpu.runtime import open_device as open_cuda

    ctx, gpu_decode = open_cuda(where, options, metrics)
    return Cuda(ctx, gpu_decode)
