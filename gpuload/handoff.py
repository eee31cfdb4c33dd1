"""Hand-off: column sets become torch tensors on the training device.

CPU: ``torch.from_numpy`` shares the batch's memory (no copy). CUDA with host-side
batches: the batch is copied into pinned memory and sent with ``non_blocking=True`` on
the loader's own CUDA stream; the consumer's stream waits on an event recorded after
the copies, so a batch is never used before it has arrived.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .batch import Ragged
from .errors import ConfigError, GpuloadError

__all__ = ["resolve_device", "HostHandoff", "CudaHandoff", "make_handoff"]

log = logging.getLogger("gpuload")


def resolve_device(device) -> torch.device:
    """Turn ``"auto" | "cpu" | "cuda" | "cuda:N"`` (or a torch.device) into a torch.device.

    ``"auto"`` picks CUDA when torch sees a GPU, else the CPU (with one log line).
    An explicit CUDA device without a usable GPU raises :class:`GpuloadError`.
    """
    text = str(device)
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        log.info("gpuload: no CUDA device visible to torch; loading on the CPU")
        return torch.device("cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r}: gpuload loads to 'cpu' or 'cuda' devices only")
    if not torch.cuda.is_available():
        reason = ("this torch build has no CUDA support (install a CUDA build of torch)"
                  if torch.version.cuda is None else "no NVIDIA driver or GPU is visible (check nvidia-smi)")
        raise GpuloadError(f"device={device!r} needs a GPU but {reason}; use device='cpu' or 'auto'")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise GpuloadError(f"device={device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", index)


def _tensor(a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:  # e.g. zero-copy views of Arrow buffers: give torch its own memory
        a = a.copy()
    return torch.from_numpy(a)


def _map(cols: dict, fn) -> dict:
    return {k: Ragged(fn(v.values), fn(v.offsets)) if isinstance(v, Ragged) else fn(v) for k, v in cols.items()}


class HostHandoff:
    """Host column set -> CPU tensors sharing its memory."""

    def __call__(self, cols: dict) -> dict:
        return _map(cols, _tensor)

    def receive(self, batch: dict) -> dict:
        """Called on the training thread; nothing to wait for on the CPU."""
        return batch


class CudaHandoff:
    """Host column set -> CUDA tensors, copied on a dedicated stream (runs on the loader thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __call__(self, cols: dict):
        with torch.cuda.stream(self.stream):
            out = _map(cols, lambda a: _tensor(a).pin_memory().to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def receive(self, item) -> dict:
        """On the training thread: make the current stream wait for the copies."""
        batch, event = item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in _flat(batch):
            t.record_stream(current)  # memory stays reserved until the consumer's work on it is done
        return batch


def _flat(batch: dict):
    for v in batch.values():
        if isinstance(v, Ragged):
            yield v.values
            yield v.offsets
        else:
            yield v


def make_handoff(device: torch.device):
    """The hand-off for ``device``."""
    return HostHandoff() if device.type == "cpu" else CudaHandoff(device)
