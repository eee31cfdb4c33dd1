"""RMM on the GPU path: the opt-in pool shared with torch, and stream-ordered memory per device.

Two things here, both per CUDA device (RMM keeps one memory resource per device):

* :func:`share_rmm_pool` (opt-in): torch, CuPy and cuDF allocate from one RMM pool. torch can
  change its allocator only before its CUDA state is initialised, so this must run before
  anything touches ``torch.cuda`` beyond availability checks (``torch.cuda.set_device``
  included, see :func:`share_rmm_pool`); the device is given as an argument, never read from
  torch. A dataset later opened on another device gets a pool there too, where that is safe
  (:func:`prepare_device`).
* :func:`stream_ordered` (cuDF decoding): libcudf allocates its decode temporaries from RMM's
  resource for the device; RMM's default (``cudaMalloc``/``cudaFree``) synchronises the device
  on every free, i.e. waits for the training step, so the first GPU decode on a device makes it
  CUDA's stream-ordered pool unless the process chose a resource already.

RMM is imported only here and only when one of these runs: ``device="cuda", decode="cpu"``
needs no RMM.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from . import INSTALL_HINT
from ..errors import GpuloadError

__all__ = ["share_rmm_pool", "stream_ordered", "prepare_device", "torch_uses_rmm", "shared_device"]

log = logging.getLogger("gpuload")

_state: dict = {"device": None, "initial": None}  # the device share_rmm_pool made its pool on, and its size
_lock = threading.Lock()
_ORDERED: set[int] = set()  # devices whose RMM resource was checked (and made stream-ordered) for decoding


def _index(device) -> int | None:
    """A device index from an int, ``"cuda:N"`` or a ``torch.device``; None for no index given."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GpuloadError(f"share_rmm_pool(device={device!r}): not a CUDA device (give an index or 'cuda:N')") \
            from None
    if dev.type != "cuda":
        raise GpuloadError(f"share_rmm_pool(device={device!r}): not a CUDA device (give an index or 'cuda:N')")
    return dev.index


def default_device(count: int, local_rank: str | None) -> int:
    """The device :func:`share_rmm_pool` uses when none is given: ``LOCAL_RANK`` (set by torchrun
    and most launchers) where the process sees that many devices, 0 where it sees only one (a
    launcher that sets ``CUDA_VISIBLE_DEVICES`` per rank), else 0 without ``LOCAL_RANK``.

    ``count``: the visible devices; ``local_rank``: ``$LOCAL_RANK`` or None. Raises
    :class:`GpuloadError` when ``LOCAL_RANK`` names no visible device and several are visible.
    """
    if local_rank is None or local_rank == "":
        return 0
    try:
        rank = int(local_rank)
    except ValueError:
        raise GpuloadError(f"share_rmm_pool(): LOCAL_RANK={local_rank!r} is not an integer; pass device=") from None
    if 0 <= rank < count:
        return rank
    if count == 1:
        return 0
    raise GpuloadError(f"share_rmm_pool(): LOCAL_RANK={rank} but {count} CUDA devices are visible; pass device=")


def share_rmm_pool(initial_pool_bytes: int | None = None, device=None) -> None:
    """Make torch, CuPy and cuDF allocate from one RMM pool on ``device`` (opt-in).

    Call it once per process, **before anything initialises torch's CUDA state**: first thing
    in the training script, and under DDP *before* ``torch.cuda.set_device(local_rank)``::

        gpuload.share_rmm_pool(device=local_rank)   # first
        torch.cuda.set_device(local_rank)            # then the rest
        model = model.to("cuda")

    ``torch.cuda.set_device``, ``torch.cuda.current_device()``, any CUDA tensor or stream
    initialise torch's caching allocator, and torch then refuses another allocator
    (``change_current_allocator``: "Can't swap an already initialized allocator"), even with
    nothing allocated yet. So this raises :class:`GpuloadError` whenever
    ``torch.cuda.is_initialized()``, and changes nothing then.

    Parameters
    ----------
    initial_pool_bytes : the pool's first size in bytes (default None: half the device's free
        memory, RMM's default); it grows on demand.
    device : the CUDA device for the pool: an index, ``"cuda:N"`` or a ``torch.device``.
        Default: ``$LOCAL_RANK`` when set (0 where the process sees one device only), else 0.
        It is selected with the CUDA runtime (``cudaSetDevice`` through CuPy), never through
        torch, and stays the current device, as after ``torch.cuda.set_device(device)``: going
        back to device 0 would create a CUDA context there, in every rank of a DDP job.

    Without it, torch and RAPIDS keep separate pools (both bounded; gpuload's own buffers
    always come from torch's). A second call with the same device does nothing; with another
    device it raises. A dataset opened later on another device gets its own pool there when
    nothing has run on that device yet (:func:`prepare_device`).
    """
    try:
        import rmm
        import rmm.mr
        from rmm.allocators.cupy import rmm_cupy_allocator
        from rmm.allocators.torch import rmm_torch_allocator
    except Exception as e:
        raise GpuloadError(f"share_rmm_pool needs rmm: {type(e).__name__}: {e}; {INSTALL_HINT}") from None
    if rmm_torch_allocator is None:  # rmm leaves it None where torch has no CUDA or sees no GPU
        raise GpuloadError("share_rmm_pool(): rmm has no torch allocator here (this torch build has no CUDA, or no "
                           "GPU is visible: check torch.cuda.is_available())")
    index = _index(device)
    with _lock:
        if index is None:
            index = default_device(torch.cuda.device_count(), os.environ.get("LOCAL_RANK"))
        if _state["device"] is not None:
            if _state["device"] == index:
                return
            raise GpuloadError(f"share_rmm_pool(device={index}): the pool is already on cuda:{_state['device']} "
                               "(one call per process; a dataset on another device gets a pool of its own)")
        if torch.cuda.is_initialized():
            raise GpuloadError(
                "share_rmm_pool() came after torch initialised CUDA (torch.cuda.set_device, a CUDA tensor or "
                "stream, torch.cuda.current_device()...), and torch cannot change allocators after that; call "
                "gpuload.share_rmm_pool(device=local_rank) first thing in the script, before "
                "torch.cuda.set_device(local_rank)")
        try:  # first, so that nothing is changed when torch refuses
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        except RuntimeError as e:
            raise GpuloadError(f"share_rmm_pool(): torch refused the RMM allocator ({e}); call it before anything "
                               "initialises torch's CUDA state") from None
        import cupy

        # what rmm.reinitialize(pool_allocator=True, devices=index) does, but without going back
        # to the previous device (0) afterwards, which would make a CUDA context there
        cupy.cuda.runtime.setDevice(index)  # RMM makes a device's resource with that device current
        rmm.mr.set_per_device_resource(index, rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                                       initial_pool_size=initial_pool_bytes))
        cupy.cuda.set_allocator(rmm_cupy_allocator)
        _state.update(device=index, initial=initial_pool_bytes)
        _ORDERED.add(index)  # the pool is stream-ordered already
    log.info("gpuload: torch, CuPy and cuDF allocate from one RMM pool on cuda:%d", index)


def shared_device() -> int | None:
    """The device :func:`share_rmm_pool` made its pool on, or None."""
    return _state["device"]


def torch_uses_rmm() -> bool:
    """Whether torch's CUDA allocations come from RMM (:func:`share_rmm_pool`, or the user's own
    ``change_current_allocator``): its pluggable allocators ignore ``record_stream``."""
    return _state["device"] is not None or torch.cuda.get_allocator_backend() == "pluggable"


def _has_context(index: int) -> bool:
    """Whether device ``index`` has a CUDA context (anything ran or was allocated there); True
    where that cannot be told."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    try:
        return True if probe is None else bool(probe(index))
    except Exception:  # noqa: BLE001 - unknown: assume something ran there
        return True


def prepare_device(index: int) -> None:
    """Before a dataset opens on device ``index`` (and creates its streams there): with
    :func:`share_rmm_pool`'s pool on another device, give ``index`` a pool of the same size too.

    torch then allocates on ``index`` through RMM's resource for it; RMM's default there
    (``cudaMalloc``/``cudaFree``) would make every free of a batch wait for the whole device.
    The resource is replaced only while nothing has run on ``index`` (no CUDA context), since
    torch frees each block through the resource of the moment; otherwise this raises
    :class:`GpuloadError` saying what to do. Does nothing without :func:`share_rmm_pool`.
    """
    with _lock:
        shared = _state["device"]
        if shared is None or shared == index or index in _ORDERED:
            return
        import rmm.mr

        if type(rmm.mr.get_per_device_resource(index)) is not rmm.mr.CudaMemoryResource:
            _ORDERED.add(index)  # the process chose a resource for this device: keep it
            return
        if _has_context(index):
            raise GpuloadError(
                f"share_rmm_pool() made its pool on cuda:{shared}, and this dataset is on cuda:{index}, where CUDA "
                "ran already: torch's blocks there come from RMM's default resource, which waits for the whole "
                f"device on every free. Call share_rmm_pool(device={index}) instead (one device per process), or "
                f"load on cuda:{shared}")
        _make(index, lambda: rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                        initial_pool_size=_state["initial"]))
        _ORDERED.add(index)
    log.info("gpuload: RMM pool made on cuda:%d too (share_rmm_pool's is on cuda:%d)", index, shared)


def _make(index: int, resource) -> None:
    """Set RMM's resource for device ``index`` to ``resource()``, created with ``index`` current
    (RMM requires it) through CuPy's device context, which restores the previous device."""
    import cupy
    import rmm.mr

    with cupy.cuda.Device(index):
        rmm.mr.set_per_device_resource(index, resource())


def stream_ordered(index: int) -> None:
    """Make RMM's memory resource for device ``index`` CUDA's stream-ordered pool
    (``CudaAsyncMemoryResource``) unless the process chose one (:func:`share_rmm_pool`,
    :func:`prepare_device` or the user's own). libcudf allocates its decode temporaries from it:
    with RMM's default every free would wait for all the work on the device, the training
    step's included. Never replaced while torch allocates from RMM (torch frees its blocks
    through the resource of the moment): there :func:`prepare_device` has set a pool already,
    or the user's allocator decides."""
    with _lock:
        if index in _ORDERED:
            return
        import rmm.mr

        if type(rmm.mr.get_per_device_resource(index)) is rmm.mr.CudaMemoryResource and not torch_uses_rmm():
            _make(index, rmm.mr.CudaAsyncMemoryResource)
            log.info("gpuload: RMM's memory resource for cuda:%d is now CUDA's stream-ordered pool "
                     "(CudaAsyncMemoryResource), for decoding with cuDF", index)
        _ORDERED.add(index)
