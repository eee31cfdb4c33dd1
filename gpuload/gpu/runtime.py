"""GPU runtime: what the node has, what ``device="cuda"`` needs, and how a device is opened.

Nothing here runs at import time: CuPy, KvikIO, RMM and pylibcudf are imported on first
use, so the package imports (and the CPU path runs) on machines without them.

What the GPU path needs (:func:`require_gpu`):

* ``device="cuda"``: an NVIDIA driver, a CUDA build of torch and CuPy. That is all for
  ``decode="cpu"``: cache reads into device memory, the GPU shuffle and gather, the DLPack
  hand-off, the streams and events run on torch and CuPy alone.
* KvikIO is optional: used only where GPUDirect Storage really works
  (:func:`configure_kvikio`); everywhere else cache reads go through pinned host memory
  and a copy on gpuload's stream, so KvikIO would move no byte.
* ``decode="gpu"`` needs pylibcudf (which brings RMM and KvikIO's library with it);
  ``decode="auto"`` uses it where it imports.

The streams of one dataset (:class:`gpuload.gpu.streams.DeviceContext`; docs/architecture.md, Invariants 7 and Threads):

* the **read stream** carries each chunk's cache read (a pinned-memory copy, or a
  GPUDirect Storage read), the upload of a chunk decoded on the CPU, and libcudf's
  decode and its conversion. The loader threads run on it. When a chunk is loaded, an
  event is recorded on it: the chunk's **ready event**;
* the **batch stream** carries the window concatenation, the permutation gathers, the
  batch slices and the storage-layout unpacking. Before it touches a chunk it waits for
  that chunk's ready event (on the GPU: the host does not block), so a batch's event,
  recorded on the batch stream and waited on by the consumer's stream, covers the work of
  batches and windows and the read-stream work queued up to its chunks' events (one read
  stream serves every loader thread), never reads or decodes queued after them;
* the consumer's stream (the one current when iteration began) waits on each batch's
  event before it can see the batch.

A block allocated on the read stream is marked for the batch stream and the consumer's
stream, one on the batch stream for the consumer's (``record_stream``, or by hand with
RMM's torch allocator), so no block is reused before every stream that reads it is done.
Host waits wait for one chunk's event, never for a whole stream.

RMM (:mod:`gpuload.gpu.rmm_pool`): the opt-in shared pool (:func:`share_rmm_pool`) and the
stream-ordered resource libcudf decodes with, both per device.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from . import INSTALL_HINT
from ..errors import ConfigError, GpuloadError, setting
from .rmm_pool import prepare_device, share_rmm_pool
from .streams import DeviceContext

__all__ = ["gpu_status", "require_gpu", "gpu_usable", "missing_pieces", "configure_kvikio", "share_rmm_pool",
           "DeviceContext", "open_device", "REQUIRED"]

log = logging.getLogger("gpuload")

_COMPAT = {"auto": "AUTO", "on": "ON", "off": "OFF"}
REQUIRED = ("driver", "cupy")  #: the pieces of :func:`gpu_status` that ``device="cuda"`` cannot run without
_PIECE_NAMES = {"driver": "a CUDA GPU that torch can use", "cupy": "CuPy"}  #: each as errors name it
KVIKIO_OPTIONAL = "optional, only for GPUDirect Storage reads of the cache"


def _importable(name: str) -> str | None:
    """None if ``name`` imports, else a one-line reason."""
    try:
        importlib.import_module(name)
        return None
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"{type(e).__name__}: {e}"


def gpu_status() -> dict:
    """What this process can use for the GPU path: ``{piece: None (usable) or reason}``.

    Pieces: ``driver`` (a CUDA build of torch that sees a device) and ``cupy`` (imports and
    ``cupy.cuda.is_available()``), which ``device="cuda"`` needs (:data:`REQUIRED`);
    ``kvikio``, optional (its reason then starts with "optional, only for GPUDirect
    Storage"); ``cudf`` (pylibcudf, for ``decode="gpu"``).
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
    kvikio = _importable("kvikio")
    status["kvikio"] = None if kvikio is None else f"{KVIKIO_OPTIONAL} (not importable: {kvikio})"
    # pylibcudf is what gpuload uses; importing `cudf` would switch CuPy's allocator to RMM
    # for the whole process, a side effect a status check must not have
    status["cudf"] = _importable("pylibcudf")
    return status


def missing_pieces(status: dict | None = None) -> dict:
    """``{piece: reason}`` of the :data:`REQUIRED` pieces missing from ``status`` (default:
    :func:`gpu_status` now); empty where ``device="cuda"`` can run."""
    status = gpu_status() if status is None else status
    return {k: status[k] for k in REQUIRED if status.get(k) is not None}


def gpu_usable() -> bool:
    """True when the GPU path can run here: a driver and CuPy (KvikIO and cuDF are optional)."""
    if torch.version.cuda is None or not torch.cuda.is_available() or _importable("cupy") is not None:
        return False
    import cupy

    return bool(cupy.cuda.is_available())


def require_gpu(device: str, decode: str) -> bool:
    """Check the pieces ``device`` needs; returns whether cuDF decodes on the GPU.

    Raises :class:`GpuloadError` naming the first missing piece: the driver or CuPy for
    any CUDA device; pylibcudf (with the RMM and KvikIO it brings) when ``decode="gpu"``.
    With ``decode="auto"`` and no pylibcudf, chunks are decoded on the CPU (one log
    line) and copied to the GPU through pinned memory. KvikIO is never required.
    """
    s = gpu_status()
    for piece, reason in missing_pieces(s).items():
        advice = f"use {setting('device', 'cpu')} (or 'auto')" if piece == "driver" else INSTALL_HINT
        raise GpuloadError(f"{setting('device', device)} needs {_PIECE_NAMES[piece]}: {reason}; {advice}")
    if decode == "cpu":
        return False
    if s["cudf"] is not None:
        if decode == "gpu":
            raise GpuloadError(f"decode='gpu' needs pylibcudf (and, through it, RMM and KvikIO): {s['cudf']}; "
                               f"{INSTALL_HINT}, or pass decode='cpu' (pyarrow decodes, the rest runs on the GPU)")
        log.info("gpuload: pylibcudf is not importable (%s); decoding Parquet on the CPU and copying to the GPU",
                 s["cudf"])
        return False
    return True


def kvikio_mode(compat: str, gds: bool) -> str:
    """KvikIO's compat mode (``KVIKIO_COMPAT_MODE``) for the setting ``kvikio_compat``:
    ``"on"`` -> ``ON``, ``"off"`` -> ``OFF``, ``"auto"`` -> ``AUTO`` only where GPUDirect
    Storage really works (``gds``), else ``ON``.

    KvikIO's own AUTO turns cuFile on whenever libcufile loads (the wheels ship it), and
    libcudf's device reads through cuFile without GDS first synchronise the legacy default
    stream, i.e. wait for the training step: POSIX reads (compat mode) never do.
    """
    if compat not in _COMPAT:
        raise ConfigError(f"kvikio_compat={compat!r} must be 'auto', 'on' or 'off'")
    if compat == "auto":
        return "AUTO" if gds else "ON"
    return _COMPAT[compat]


def configure_kvikio(threads: int, compat: str) -> bool:
    """Set KvikIO's thread pool size and compat mode for this process (:func:`kvikio_mode`);
    returns whether gpuload reads the cache by GPUDirect Storage.

    Set through the environment first (``KVIKIO_COMPAT_MODE``, ``KVIKIO_NTHREADS``), which
    libcudf reads at its first Parquet read (it would otherwise pick compat ON and 4
    threads), then, where the ``kvikio`` module imports, through ``kvikio.defaults.set`` for
    the defaults already loaded (the same ones libcudf uses, after its first read too).
    Without the ``kvikio`` module only the environment is set, and GPUDirect Storage is not
    used. Overrides those variables when the user set them.
    """
    if compat not in _COMPAT:
        raise ConfigError(f"kvikio_compat={compat!r} must be 'auto', 'on' or 'off'")
    have = _importable("kvikio") is None
    gds = have and compat != "on" and _gds_usable()
    mode = kvikio_mode(compat, gds)
    os.environ["KVIKIO_COMPAT_MODE"] = mode
    os.environ["KVIKIO_NTHREADS"] = str(threads)
    if have:
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set({"compat_mode": getattr(kvikio.CompatMode, mode), "num_threads": threads})
    return gds


def _gds_usable() -> bool:
    """Whether KvikIO can read into device memory by GPUDirect Storage, on a stream (call
    only where ``kvikio`` imports).

    KvikIO's AUTO mode only asks whether libcufile loads, so this asks the cuFile driver
    whether GDS is available, and requires cuFile's configuration file
    (``$CUFILE_ENV_PATH_JSON`` or ``/etc/cufile.json``): without it KvikIO's stream-ordered
    reads fall back to synchronous ones that first wait for the legacy default stream,
    i.e. for the training step.
    """
    import kvikio.cufile_driver

    if not (os.environ.get("CUFILE_ENV_PATH_JSON") or os.path.exists("/etc/cufile.json")):
        return False
    try:
        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # noqa: BLE001 - no driver, no nvidia-fs: no GDS
        return False


def open_device(device: torch.device, options, metrics=None) -> tuple[DeviceContext | None, bool]:
    """(DeviceContext, decode on the GPU) for a CUDA device; (None, False) on the CPU.

    ``options``: a :class:`gpuload.config.Options` (``decode``, ``kvikio_threads``,
    ``kvikio_compat``). Checks the pieces (:func:`require_gpu`), sets KvikIO's mode before
    any libcudf read (:func:`configure_kvikio`), gives the device an RMM pool where
    :func:`share_rmm_pool` asks for one (before the device's first stream), then makes the
    loader's streams: the first device calls.
    """
    if device.type != "cuda":
        return None, False
    gpu_decode = require_gpu(str(device), options.decode)
    gds = configure_kvikio(options.kvikio_threads, options.kvikio_compat)
    index = device.index if device.index is not None else torch.cuda.current_device()
    prepare_device(index)
    return DeviceContext(torch.device("cuda", index), metrics=metrics, gds=gds), gpu_decode
