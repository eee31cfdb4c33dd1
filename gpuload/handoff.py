"""Hand-off: column sets become torch tensors on the training device.

CPU: ``torch.from_numpy`` shares the batch's memory (no copy). GPU: the batch is a set
of CuPy arrays in the loader's device memory (see :mod:`gpuload.gpu.runtime`);
``torch.from_dlpack`` wraps them without a copy, on the producer thread, and an event
recorded on the batch stream after the kernels that made the batch travels with it (the
batch stream has waited for each chunk's read or decode already: see
:mod:`gpuload.gpu.runtime`).
On the training thread :meth:`DlpackHandoff.receive` makes the current stream wait on
that event, so the batch is never visible before it is complete.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import Ragged, nrows

__all__ = ["HostHandoff", "DlpackHandoff", "join_batches"]


def _tensor(a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:  # e.g. zero-copy views of Arrow buffers: give torch its own memory
        a = a.copy()
    return torch.from_numpy(a)


def _map(cols: dict, fn, views: dict | None = None) -> dict:
    """``fn`` applied to every array of ``cols``; outputs named in ``views`` are then viewed
    as that torch dtype (bfloat16 outputs are stored as their uint16 bit patterns)."""
    out = {}
    for k, v in cols.items():
        view = (views or {}).get(k)
        if isinstance(v, Ragged):
            values = fn(v.values)
            out[k] = Ragged(values if view is None else values.view(view), fn(v.offsets))
        else:
            t = fn(v)
            out[k] = t if view is None else t.view(view)
    return out


def _tensors(batch: dict):
    """Every tensor of a batch (a Ragged output's values and offsets)."""
    for v in batch.values():
        if isinstance(v, Ragged):
            yield from (v.values, v.offsets)
        elif isinstance(v, torch.Tensor):
            yield v


def _swap(batch: dict, new: dict) -> dict:
    """``batch`` with each tensor ``t`` replaced by ``new[id(t)]`` where there is one."""
    def one(t):
        return new.get(id(t), t)

    return {k: Ragged(one(v.values), one(v.offsets)) if isinstance(v, Ragged) else one(v) for k, v in batch.items()}


class HostHandoff:
    """Host column set -> CPU tensors sharing its memory.

    ``views``: ``{output: torch dtype}`` to reinterpret (default none; see :func:`_map`);
    ``layout``: the :class:`gpuload.layout.Layout` whose stored column sets come in
    (default None: they hold the outputs already); ``alloc(shape, dtype)``: where it
    unpacks blocks (default: new arrays). ``transform``: a batch -> batch function
    (:class:`gpuload.transforms.BatchTransform`) applied to the tensors last, or None.
    """

    def __init__(self, views: dict | None = None, layout=None, alloc=None):
        self.views = views or {}
        self.layout = layout
        self.alloc = alloc
        self.transform = None

    def __call__(self, cols: dict) -> dict:
        return self.finish(self.prepare(cols))

    def prepare(self, cols: dict) -> dict:
        """The tensors of ``cols`` (blocks unpacked): safe on several threads at once."""
        if self.layout is not None:
            cols = self.layout.unpack(cols, self.alloc)
        return _map(cols, _tensor, self.views)

    def finish(self, batch: dict) -> dict:
        """``batch`` after :attr:`transform`, which numbers the batches it sees: call it in order."""
        return batch if self.transform is None else self.transform(batch)

    def receive(self, batch: dict) -> dict:
        """Called on the training thread; nothing to wait for on the CPU."""
        return batch


class DlpackHandoff:
    """Device column set (CuPy) -> CUDA tensors through DLPack, with a ready event.

    Called on the producer thread inside ``ctx.batching()`` (a
    :class:`gpuload.gpu.streams.DeviceContext`); ``views``, ``layout`` and ``transform`` as
    for :class:`HostHandoff`. The transform runs on the batch stream, before the event; the
    tensors it makes are guarded for the consumer's stream (:meth:`DeviceContext.hand_out`).
    """

    def __init__(self, ctx, views: dict | None = None, layout=None):
        self.ctx = ctx
        self.views = views or {}
        self.layout = layout
        self.transform = None

    def __call__(self, cols: dict):
        if self.layout is not None:  # kernels on the batch stream (CuPy's current one), before the event
            cols = self.layout.unpack(cols)
        out = _map(cols, torch.from_dlpack, self.views)  # CuPy's and torch's current stream: both the batch stream
        if self.transform is not None:
            ours = {t.untyped_storage().data_ptr() for t in _tensors(out)}  # guarded already
            out = self.transform(out)
            new = {id(t): self.ctx.hand_out(t) for t in _tensors(out) if t.is_cuda
                   and t.untyped_storage().data_ptr() not in ours}
            out = _swap(out, new) if new else out
        event = torch.cuda.Event()
        event.record(self.ctx.batch_stream)  # after every kernel that made the batch
        return out, event

    def receive(self, item) -> dict:
        """On the training thread: make the current stream wait until the batch is complete."""
        batch, event = item
        torch.cuda.current_stream(self.ctx.device).wait_event(event)
        return batch


def join_batches(pieces: list, provenance: str | None, device, copy: bool = False) -> dict:
    """One batch of the ``(source index, batch)`` pieces' rows, in order (a :class:`gpuload.Mix`'s
    step; one piece is handed on as it is unless ``copy``), plus an int64 ``provenance`` output of
    each row's source index when named; new tensors on the current stream."""
    first = pieces[0][1]
    if len(pieces) == 1:
        out = {k: (Ragged(v.values.clone(), v.offsets.clone()) if isinstance(v, Ragged) else v.clone()) if copy
               else v for k, v in first.items()}
    else:
        out = {}
        for k, v in first.items():
            if isinstance(v, Ragged):
                offs, base = [v.offsets], v.offsets[-1]
                for _, b in pieces[1:]:
                    offs.append(b[k].offsets[1:] + base)
                    base = base + b[k].offsets[-1]
                out[k] = Ragged(torch.cat([b[k].values for _, b in pieces]), torch.cat(offs))
            else:
                out[k] = torch.cat([b[k] for _, b in pieces])
    if provenance is not None:
        out[provenance] = torch.cat([torch.full((nrows(b),), i, dtype=torch.int64, device=device)
                                     for i, b in pieces])
    return out
