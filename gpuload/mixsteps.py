"""The mix's thread: whole source batches taken in the order of a mix plan's labels and
joined into steps (:func:`mix_steps`), and the training thread's side of each step (:func:`receive`).

Each source is iterated by this thread alone: a source restored from a state goes on from it
when first needed, any other starts its pass from the first batch; a pass that ends starts
the next (``exhausted="repeat"``) or ends the epoch (``"end"``). After each step the sources'
states are taken as they stand, but for a source restored and not read since, whose restored
state is kept. See :mod:`gpuload.mix` for the streams on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .batch import Ragged, nrows
from .errors import ConfigError
from .handoff import join_batches
from .mixplan import PASS_STRIDE, MixPlan

__all__ = ["mix_steps", "receive"]


def mix_steps(mix, p: MixPlan, lab, states: dict, epoch: int, stream, stop) -> Iterator:
    """The mix thread of :class:`gpuload.Mix` ``mix``: the steps of labels ``lab`` of ``epoch``,
    each with the sources' states after it (a source restored but not read yet keeps its
    restored state) and, on a GPU, the event after its kernels.

    On a GPU the sources' hand-offs and the joins run on the mix's own ``stream`` (the
    sources guard their memory for it); every step is a new tensor of the mix's, made there,
    and the training thread's stream waits for its event when it takes it (:func:`receive`)."""
    passes = {i: (states[n]["epoch"], states[n]["pass"]) for i, n in enumerate(mix.names) if n in states}
    restored = {i: states[n] for i, n in enumerate(mix.names) if n in states}
    iters: dict = {}

    def start(i: int, ep: int, k: int, restore: dict | None) -> None:
        d = mix.sources[i]
        if restore is not None:
            d.load_state_dict(restore)  # its pass goes on where the last step left it
            d.set_epoch(ep)
        else:
            d._cursor.fresh(ep)  # from its first batch, whatever position it held
        iters[i], passes[i] = iter(d), (ep, k)

    def pass_epoch(i: int, k: int) -> int:  # see "Source i's passes" in gpuload.mixplan
        return epoch if mix.exhausted == "end" else epoch * PASS_STRIDE + k

    def next_batch(i: int):
        """Source ``i``'s next batch; its next pass when one ends (``"repeat"``), None with ``"end"``."""
        fresh = False
        while True:
            if i not in iters:
                if i in restored:  # its pass goes on where the state left it
                    start(i, *passes[i], restored.pop(i)["state"])
                else:  # not read yet in this epoch (a pass that ends starts the next below)
                    start(i, pass_epoch(i, 0), 0, None)
            b = next(iters[i], None)
            if b is not None:
                return b
            del iters[i]
            if fresh:
                raise ConfigError(f"source {mix.names[i]!r} gave no batch in its pass (epoch {passes[i][0]})")
            if mix.exhausted == "end":
                return None
            k = passes[i][1] + 1
            start(i, pass_epoch(i, k), k, None)
            fresh = True

    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for j in range(len(lab) // p.per_step):
                if stop.is_set():
                    return
                pieces = []
                for i in lab[j * p.per_step:(j + 1) * p.per_step]:
                    b = next_batch(int(i))
                    if b is None:  # exhausted='end': a source ran out; the epoch ends
                        return
                    pieces.append((int(i), b))
                with mix.metrics.span("batch", rows=sum(nrows(b) for _, b in pieces)):
                    batch = join_batches(pieces, mix.provenance, mix.device, copy=stream is not None)
                ready = None
                if stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                after = {mix.names[i]: restored[i] if i in restored else
                         {"state": mix.sources[i].state_dict(), "epoch": passes[i][0], "pass": passes[i][1]}
                         for i in passes}
                yield batch, after, ready
    finally:
        for it in iters.values():
            it.close()


def receive(batch: dict, ready, device, hold) -> dict:
    """On the training thread: on a GPU, make the current stream wait for the step's kernels and
    keep the step's memory (the mix's own tensors) from reuse until that stream is done with it:
    ``hold(tensor, reader)`` returns the tensor so kept (:meth:`gpuload.device.Cuda.hold`:
    ``record_stream``, or with RMM's allocator, which ignores it, an owner that waits)."""
    if ready is None:
        return batch
    s = torch.cuda.current_stream(device)
    s.wait_event(ready)
    return {k: Ragged(hold(v.values, s), hold(v.offsets, s)) if isinstance(v, Ragged) else hold(v, s)
            for k, v in batch.items()}
