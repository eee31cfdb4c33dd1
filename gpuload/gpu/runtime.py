"""GPU runtime: what the node has, and the device-side memory and streams of the loader.

Nothing here runs at import time: CuPy, KvikIO and cuDF are imported on first use, so
the package imports (and the CPU path runs) on machines without them.

Memory and stream rules of the GPU path (invariant 7 of the design):

* every device array that a batch may view is allocated from **torch's caching
  allocator** on the loader's own stream and marked with ``record_stream`` for the
  consumer's stream (the one current when iteration began). When the last reference
  to it goes, torch reuses the block only after the consumer's work queued by then has
  finished, so a batch is never overwritten under the training step;
* CuPy runs gpuload's kernels (gather, concatenate, cumsum) on views of that memory,
  on the loader stream, through DLPack; batches reach torch with ``torch.from_dlpack``
  (no copy) and an event recorded on the loader stream, which the consumer's stream
  waits on before it can see the batch;
* libcudf decodes on the loader stream too, with a stream-ordered RMM resource (CUDA's
  own pool unless the process chose another, e.g. :func:`share_rmm_pool`), so a decode
  is ordered with the kernels that convert its output and never waits for the
  training step's kernels (as work on the legacy default stream, or ``cudaFree``, would);
* cache reads are ordered on the loader stream as well: a GPUDirect Storage read
  (KvikIO's ``raw_read_async``) or a copy from pinned memory (:mod:`gpuload.gpu.kvikio_read`).

With :func:`share_rmm_pool` torch allocates from RMM, whose torch allocator ignores
``record_stream``: each loader buffer then has an owner that does by hand what
``record_stream`` does. When the last view of the buffer goes, the loader stream waits
for the work the consumer's stream has queued, and only then is the block freed, in
loader-stream order (after gpuload's own kernels that read it).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading

import numpy as np
import torch

from ..batch import Ragged, nbytes, nrows
from ..errors import ConfigError, GpuloadError, setting

__all__ = ["gpu_status", "require_gpu", "gpu_usable", "configure_kvikio", "share_rmm_pool", "DeviceContext",
           "open_device"]

log = logging.getLogger("gpuload")

_COMPAT = {"auto": "AUTO", "on": "ON", "off": "OFF"}
_state = {"rmm": False}


def _importable(name: str) -> str | None:
    """None if ``name`` imports, else a one-line reason."""
    try:
        importlib.import_module(name)
        return None
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"{type(e).__name__}: {e}"


def gpu_status() -> dict:
    """What this process can use for the GPU path: ``{piece: None (usable) or reason}``.

    Pieces: ``driver`` (torch sees a CUDA device), ``cupy`` (imports and
    ``cupy.cuda.is_available()``), ``kvikio``, ``cudf``.
    """
    status = {}
    if torch.version.cuda is None:
        status["driver"] = "this torch build has no CUDA support (install a CUDA build of torch)"
    elif not torch.cuda.is_available():
        status["driver"] = "no NVIDIA driver or GPU is visible to torch (check nvidia-smi)"
    else:
        status["driver"] = None
    status["cupy"] = _importable("cupy")
    if status["cupy"] is None:
        import cupy

        if not cupy.cuda.is_available():
            status["cupy"] = "cupy imports but cupy.cuda.is_available() is False (driver or CUDA runtime mismatch)"
    status["kvikio"] = _importable("kvikio")
    # pylibcudf is what gpuload uses; importing `cudf` would switch CuPy's allocator to RMM
    # for the whole process, a side effect a status check must not have
    status["cudf"] = _importable("pylibcudf")
    return status


_EXTRA = "install the gpu extra (pip install 'gpuload[gpu]') or use device='cpu'"


def gpu_usable() -> bool:
    """True when the GPU path can run here (driver, CuPy and KvikIO; cuDF is optional)."""
    if torch.version.cuda is None or not torch.cuda.is_available() or _importable("cupy") is not None:
        return False
    import cupy

    return bool(cupy.cuda.is_available()) and _importable("kvikio") is None


def require_gpu(device: str, decode: str) -> bool:
    """Check the pieces ``device`` needs; returns whether cuDF decodes on the GPU.

    Raises :class:`GpuloadError` naming the first missing piece (driver, cupy, kvikio,
    or cudf when ``decode="gpu"``). With ``decode="auto"`` and no cuDF, chunks are
    decoded on the CPU (one log line) and copied to the GPU through pinned memory.
    """
    s = gpu_status()
    for piece in ("driver", "cupy", "kvikio"):
        if s[piece] is not None:
            advice = f"use {setting('device', 'cpu')} (or 'auto')" if piece == "driver" else _EXTRA
            raise GpuloadError(f"{setting('device', device)} needs {piece}: {s[piece]}; {advice}")
    if decode == "cpu":
        return False
    if s["cudf"] is not None:
        if decode == "gpu":
            raise GpuloadError(f"decode='gpu' needs cudf: {s['cudf']}; {_EXTRA}, or pass decode='cpu'")
        log.info("gpuload: cudf is not importable (%s); decoding Parquet on the CPU and copying to the GPU", s["cudf"])
        return False
    return True


def configure_kvikio(threads: int, compat: str) -> None:
    """Set KvikIO's thread pool size and compat mode for this process.

    Set through the environment first, so that libcudf's first Parquet read (which
    otherwise switches compat mode on and picks 4 threads when these are unset) keeps
    them, then through ``kvikio.defaults.set`` for KvikIO's already-loaded defaults.
    """
    if compat not in _COMPAT:
        raise ConfigError(f"kvikio_compat={compat!r} must be 'auto', 'on' or 'off'")
    os.environ["KVIKIO_COMPAT_MODE"] = _COMPAT[compat]
    os.environ["KVIKIO_NTHREADS"] = str(threads)
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"compat_mode": getattr(kvikio.CompatMode, _COMPAT[compat]), "num_threads": threads})


def share_rmm_pool(initial_pool_bytes: int | None = None) -> None:
    """Make torch, CuPy and cuDF allocate from one RMM pool (opt-in).

    Call it once per process, **before anything allocates CUDA memory through torch**:
    first thing in the training script, after ``import torch`` (and, under DDP, after
    ``torch.cuda.set_device(local_rank)``: the pool is made on the current device) and
    before building the model, moving anything ``.to("cuda")`` or creating a
    :class:`~gpuload.ParquetDataset`.
    torch cannot change its allocator once it has allocated, so a late call raises
    :class:`GpuloadError`. Without it, torch and RAPIDS keep separate pools (both
    bounded; gpuload's own buffers always come from torch's).
    """
    if _state["rmm"]:
        return
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator
        from rmm.allocators.torch import rmm_torch_allocator
    except Exception as e:
        raise GpuloadError(f"share_rmm_pool needs rmm: {type(e).__name__}: {e}; {_EXTRA}") from None
    if rmm_torch_allocator is None:  # rmm leaves it None where torch has no CUDA or sees no GPU
        raise GpuloadError("share_rmm_pool(): rmm has no torch allocator here (this torch build has no CUDA, or no "
                           "GPU is visible: check torch.cuda.is_available())")
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise GpuloadError("share_rmm_pool() came after torch allocated CUDA memory; call it at the start of the "
                           "script, before any model or tensor is moved to the GPU")
    try:  # first, so that nothing is changed when torch refuses
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    except RuntimeError as e:
        raise GpuloadError(f"share_rmm_pool(): torch refused the RMM allocator ({e}); call it before torch's first "
                           "CUDA allocation") from None
    rmm.reinitialize(pool_allocator=True, initial_pool_size=initial_pool_bytes, devices=torch.cuda.current_device())
    import cupy

    cupy.cuda.set_allocator(rmm_cupy_allocator)
    _state["rmm"] = True


class DeviceContext:
    """The loader's CUDA device, stream and memory (one per iteration of a dataset).

    Parameters
    ----------
    device : the CUDA ``torch.device``.
    consumer : the stream batches are used on (default: the current stream of the
        calling thread, which should be the training thread).
    metrics : a :class:`gpuload.Metrics` recording ``h2d`` spans for uploads and
        ``cache_write`` spans for the copies back to the host (default None).
    """

    def __init__(self, device: torch.device, consumer: torch.cuda.Stream | None = None, metrics=None):
        import cupy

        self.metrics = metrics
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.consumer = consumer or torch.cuda.current_stream(self.index)
        self.stream = torch.cuda.Stream(self.index)
        if hasattr(cupy.cuda.Stream, "from_external") and hasattr(self.stream, "__cuda_stream__"):
            self._cp_stream = cupy.cuda.Stream.from_external(self.stream)  # CuPy >= 14
        else:
            self._cp_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, self.index)
        self._rmm = _torch_uses_rmm()
        self._local = threading.local()
        self._decode = None  # the loader stream for libcudf, made on first use
        self.gds = _gds_usable()  #: cache reads by GPUDirect Storage: see gpuload.gpu.kvikio_read

    # -- memory -------------------------------------------------------------------------
    def _alloc(self, size: int):
        """CuPy allocator hook: torch memory on the loader stream, guarded for the consumer."""
        import cupy

        t = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)  # on the loader stream
        if self._rmm:  # RMM's torch allocator ignores record_stream: guard the block by hand
            owner = _ReleasedAfterConsumer(t, self.stream, self.consumer)
        else:
            t.record_stream(self.consumer)
            owner = t
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, owner, self.index), 0)

    @contextlib.contextmanager
    def active(self):
        """Run the block on the loader stream, with CuPy allocating through :meth:`_alloc`.

        Re-entrant; safe to enter from any loader thread.
        """
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield self
            finally:
                self._local.depth -= 1
            return
        import cupy

        self._local.depth = 1
        try:
            with torch.cuda.device(self.index), torch.cuda.stream(self.stream), cupy.cuda.Device(self.index), \
                    self._cp_stream, cupy.cuda.using_allocator(self._alloc):
                yield self
        finally:
            self._local.depth = 0

    def empty_bytes(self, nbytes: int):
        """An uninitialised CuPy uint8 array of ``nbytes`` on the loader's memory (call inside :meth:`active`)."""
        import cupy

        return cupy.empty(nbytes, dtype=cupy.uint8)

    def decode_stream(self):
        """The loader stream as an rmm ``Stream``, for libcudf. The first call also makes
        RMM's resource for this device stream-ordered (:func:`_stream_ordered_rmm`)."""
        if self._decode is None:
            from rmm.pylibrmm.stream import Stream

            _stream_ordered_rmm(self.index)
            self._decode = Stream(self._cp_stream)
        return self._decode

    # -- host <-> device ----------------------------------------------------------------
    def upload(self, cols: dict) -> dict:
        """Host column set -> device column set (inside :meth:`active`); a device set is returned as is.

        Each array is staged in pinned memory from torch's host allocator and copied
        with ``non_blocking=True`` on the loader stream; torch keeps the pinned block
        until its copy is done. The returned arrays are ordered on the loader stream.
        """
        if not isinstance(_first_array(cols), np.ndarray):
            return cols  # already on the device (decoded by cuDF or read by KvikIO)

        def one(a: np.ndarray):
            a = np.ascontiguousarray(a)
            dst = self.empty_bytes(a.nbytes)
            if a.nbytes:
                src = torch.from_numpy(a.reshape(-1).view(np.uint8)).pin_memory()
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
        """Device column set -> new NumPy arrays (waits for the copies); a host set is returned as is."""
        import cupy

        if not isinstance(_first_array(cols), cupy.ndarray):
            return cols  # decoded on the CPU: already host arrays

        def one(a):
            return cupy.asnumpy(a, stream=self._cp_stream, blocking=True)

        with self._span("cache_write", cols):  # the device-to-host half of a cache write
            return {k: Ragged(one(v.values), one(v.offsets)) if isinstance(v, Ragged) else one(v)
                    for k, v in cols.items()}

    def upload_index(self, idx: np.ndarray):
        """A host index array (e.g. a window permutation) on the device, on the loader stream."""
        import cupy

        return cupy.asarray(idx)


_ORDERED: set[int] = set()
_ORDERED_LOCK = threading.Lock()


def _stream_ordered_rmm(index: int) -> None:
    """Make RMM's memory resource for device ``index`` CUDA's stream-ordered pool
    (``CudaAsyncMemoryResource``), unless one was chosen already (:func:`share_rmm_pool`,
    or the user's own). libcudf allocates its decode temporaries from it: with RMM's
    default (plain ``cudaMalloc``/``cudaFree``) every free would wait for all the work on
    the device, the training step's included."""
    with _ORDERED_LOCK:
        if index in _ORDERED or _torch_uses_rmm():  # never when torch's blocks come from RMM: torch
            return  # frees them through RMM's resource of the moment
        import rmm.mr

        with torch.cuda.device(index):
            if type(rmm.mr.get_current_device_resource()) is rmm.mr.CudaMemoryResource:
                rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
                log.info("gpuload: RMM's memory resource for cuda:%d is now CUDA's stream-ordered pool "
                         "(CudaAsyncMemoryResource), for decoding with cuDF", index)
        _ORDERED.add(index)


def _gds_usable() -> bool:
    """Whether KvikIO will read into device memory by GPUDirect Storage, on a stream.

    KvikIO's AUTO mode only asks whether libcufile loads (the wheels ship it), so this
    also asks the cuFile driver whether GDS is available, and requires cuFile's
    configuration file (``$CUFILE_ENV_PATH_JSON`` or ``/etc/cufile.json``): without it
    KvikIO's stream-ordered reads fall back to synchronous ones that first wait for the
    legacy default stream, i.e. for the training step.
    """
    import kvikio.cufile_driver
    import kvikio.defaults

    if kvikio.defaults.is_compat_mode_preferred():
        return False
    if not (os.environ.get("CUFILE_ENV_PATH_JSON") or os.path.exists("/etc/cufile.json")):
        return False
    try:
        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # noqa: BLE001 - no driver, no nvidia-fs: no GDS
        return False


def _torch_uses_rmm() -> bool:
    """Whether torch's CUDA allocations come from RMM (share_rmm_pool, or the user's own
    ``change_current_allocator``): its pluggable allocators ignore ``record_stream``."""
    return _state["rmm"] or torch.cuda.get_allocator_backend() == "pluggable"


class _ReleasedAfterConsumer:
    """Owner of a loader buffer when torch allocates from RMM (whose torch allocator ignores
    ``record_stream``): dropped with the last view of the buffer, it makes the loader stream
    wait for the consumer's queued work before the block is freed in loader-stream order."""

    __slots__ = ("tensor", "loader", "consumer")

    def __init__(self, tensor: torch.Tensor, loader, consumer):
        self.tensor, self.loader, self.consumer = tensor, loader, consumer

    def __del__(self):
        try:
            self.loader.wait_stream(self.consumer)
        except Exception:  # noqa: S110 - at interpreter exit CUDA may already be gone
            pass


def open_device(device: torch.device, options, metrics=None) -> tuple[DeviceContext | None, bool]:
    """(DeviceContext, decode on the GPU) for a CUDA device; (None, False) on the CPU.

    ``options``: a :class:`gpuload.config.Options` (``decode``, ``kvikio_threads``, ``kvikio_compat``).
    """
    if device.type != "cuda":
        return None, False
    gpu_decode = require_gpu(str(device), options.decode)
    configure_kvikio(options.kvikio_threads, options.kvikio_compat)
    return DeviceContext(device, metrics=metrics), gpu_decode


def _first_array(cols: dict):
    """One array of a column set (a set is all on the host or all on the device)."""
    v = next(iter(cols.values()), None)
    return v.values if isinstance(v, Ragged) else v
