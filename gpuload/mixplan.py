"""Mix plan: which source each step of a mixed epoch takes its batches from, as pure functions.

A mix (:class:`gpuload.Mix`) builds each of its batches (a *step*) from whole batches of its
sources, so that every guarantee of a source (its order, every row once per pass, equal batch
counts on every rank, exact and elastic resume) carries over. Everything here is a function
of numbers that are the same on every rank, so every rank takes the same sources in the same
order and yields the same number of steps.

Modes
-----
``"proportion"``: each step joins ``per_step`` source batches (all sources have one batch size
``b``, so a step holds ``per_step * b`` rows). An epoch of ``N`` steps takes exactly
``N_i = apportion(N * per_step, weights)[i]`` batches from source ``i`` (largest remainders:
within one batch of ``N * per_step * w_i``), in a random arrangement drawn from
``(seed, epoch, the sources' fingerprints, weights)``: a step's composition varies, an
epoch's totals do not.

``"composition"``: each step joins one batch of every source, in the order the sources were
given: a step holds exactly ``b_i`` rows of source ``i`` (its batch size).

What an epoch is (``exhausted``)
--------------------------------
``R_i`` is the number of batches a pass through source ``i`` gives each rank (``len`` of the
source: equal on every rank).

* ``"end"`` (default): the epoch ends before any source would run out: ``N`` is the most
  steps for which every ``N_i <= R_i``. The source that runs out first is read whole with
  ``batches_per_step=1`` and in composition mode (to within ``batches_per_step - 1`` batches
  otherwise: a step is never cut short); of the others, the first ``N_i`` batches of their
  pass (the rest of that pass is not delivered; the next epoch is their next pass, in a new
  order).
* ``"repeat"``: the epoch ends when every source has been read whole at least once: ``N`` is
  the fewest steps for which every ``N_i >= R_i``; a source that runs out starts its next
  pass (a new order) and goes on, ``ceil(N_i / R_i)`` passes in all.
* ``steps=N`` fixes the epoch's steps instead; with ``"end"`` no source may run out
  (refused otherwise), with ``"repeat"`` sources repeat as needed.

Source ``i``'s passes in mix epoch ``e`` are its epochs ``e * PASS_STRIDE + k`` for pass
``k = 0, 1, ...`` with ``"repeat"`` (``PASS_STRIDE = 2**20``: however many passes an epoch
takes, on whatever number of ranks, no two passes of a run share a source epoch, so none
repeats another's order), and its epoch ``e`` with ``"end"`` (one pass: the mix's epoch ``e``
is every source's epoch ``e``).

Resuming on another number of ranks
-----------------------------------
Each source resumes its own pass on the new ranks (its rest shared among them, every row
once, the same number of batches on every rank). The rest of the mix's epoch is a new run
of steps drawn for the new ranks (:func:`rest_labels`: the same weights, a new arrangement,
each source its exact share of the rest's steps, as in a whole epoch) and ended by the epoch's
own rule, applied to what is left (:func:`rest_steps`): with ``"end"``, before any
source needs more batches than its pass has left (so the source that runs out is read
whole, exactly once, across the runs, to within ``batches_per_step - 1`` batches as above); with ``"repeat"``, once every source still in its
first pass has finished it (each of those exactly once; sources past their first pass go
on with further passes, each row at most once per pass). With ``steps=N`` the epoch is ``N``
steps on its first ranks: the rest is the steps of those not yet taken (on every rank of
every run so far), shared by the new ranks, each taking the same number (with ``"end"``
never past a source's pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from .errors import ConfigError, setting

__all__ = ["MODES", "EXHAUSTED", "PASS_STRIDE", "MixPlan", "apportion", "plan_mix", "labels", "rest_labels", "rest_steps"]

MODES = ("proportion", "composition")
PASS_STRIDE = 1 << 20  # source epochs per mix epoch with exhausted="repeat" (see the module doc)
EXHAUSTED = ("end", "repeat")


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (positive): largest remainders, ties to the
    earlier source; each share is within one of ``total * w_i / sum(w)`` and they sum to ``total``."""
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    out = [math.floor(x) for x in exact]
    left = total - sum(out)
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))[:left]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class MixPlan:
    """One epoch's shape: ``steps`` steps of ``per_step`` source batches; ``counts[i]`` batches
    from source ``i`` in ``passes[i]`` passes of ``sizes[i]`` batches each."""

    mode: str
    per_step: int
    steps: int
    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    passes: tuple[int, ...]


def _counts(mode: str, steps: int, per_step: int, weights: Sequence[float], k: int) -> list[int]:
    return [steps] * k if mode == "composition" else apportion(steps * per_step, weights)


def plan_mix(names: Sequence[str], sizes: Sequence[int], weights: Sequence[float] | None, *, mode: str,
             per_step: int, exhausted: str, steps: int | None = None) -> MixPlan:
    """The epoch's :class:`MixPlan` for sources ``names`` giving ``sizes[i]`` batches per pass on
    each rank (see the module doc). Raises :class:`~gpuload.ConfigError` for an epoch of no step,
    or a fixed ``steps`` that ``exhausted="end"`` cannot give."""
    k = len(sizes)
    if mode == "composition":
        per_step, weights = k, [1.0] * k
    for n, r in zip(names, sizes):
        if r < 1:
            raise ConfigError(f"source {n!r} gives no batch per pass on this rank; a mix needs at least one from "
                              "every source (fewer ranks, or a smaller batch_size on that source)")

    def fits(n: int) -> bool:  # no source runs out within n steps
        return all(c <= r for c, r in zip(_counts(mode, n, per_step, weights, k), sizes))

    def covers(n: int) -> bool:  # every source read whole within n steps
        return all(c >= r for c, r in zip(_counts(mode, n, per_step, weights, k), sizes))

    s = float(sum(weights))
    if steps is not None:
        n = steps
        if exhausted == "end" and not fits(n):
            most = _most(fits, min(r * s / (w * per_step) for r, w in zip(sizes, weights)))
            raise ConfigError(f"{setting('steps_per_epoch', steps)} would run a source out within the epoch, which "
                              f"exhausted='end' does not allow: at most {most} steps here (or exhausted='repeat')")
    elif exhausted == "end":
        n = _most(fits, min(r * s / (w * per_step) for r, w in zip(sizes, weights)))
    else:  # the fewest steps that read every source whole, searched from the exact quotient
        n = max(1, math.ceil(max(r * s / (w * per_step) for r, w in zip(sizes, weights))))
        while n > 1 and covers(n - 1):
            n -= 1
        while not covers(n):
            n += 1
    if n < 1:
        raise ConfigError(f"the mix would have no step per epoch: its sources give {dict(zip(names, sizes))} "
                          f"batches per pass on each rank, too few for {per_step} per step at these weights")
    counts = _counts(mode, n, per_step, weights, k)
    return MixPlan(mode, per_step, n, tuple(counts), tuple(sizes),
                   tuple(max(1, -(-c // r)) for c, r in zip(counts, sizes)))


def _most(fits, guess: float) -> int:
    """The most steps ``n >= 0`` with ``fits(n)`` (and not ``fits(n + 1)``), searched from ``guess``."""
    n = max(0, int(guess))
    while fits(n + 1):
        n += 1
    while n > 0 and not fits(n):
        n -= 1
    return n


def _rng(*key) -> np.random.Generator:
    # keys of any type (the mix's key, "rest"), hashed: not :func:`gpuload.plan.seeded_rng`, whose keys are integers;
    # changing either would change the orders of existing runs (and their resumes)
    digest = xxhash.xxh64_intdigest(":".join(map(str, key)).encode())
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([digest])))


def _arrange(mode: str, counts: Sequence[int], rng_key: tuple) -> np.ndarray:
    k = len(counts)
    if mode == "composition":
        return np.tile(np.arange(k, dtype=np.int32), counts[0] if k else 0)
    return _rng(*rng_key).permutation(np.repeat(np.arange(k, dtype=np.int32), counts))


def labels(p: MixPlan, key: str, seed: int, epoch: int) -> np.ndarray:
    """The source index of each of the epoch's ``steps * per_step`` source batches, in order
    (step ``j`` takes ``labels[j * per_step:(j + 1) * per_step]``); ``key`` identifies the mix
    (its sources' fingerprints and weights)."""
    return _arrange(p.mode, p.counts, (key, seed, epoch))


def rest_labels(p: MixPlan, weights: Sequence[float] | None, steps: int, key: str, seed: int, epoch: int,
                run: int) -> np.ndarray:
    """The labels of ``steps`` steps left of an epoch resumed on other ranks (its ``run``-th
    run): the same weights, drawn again (see the module doc)."""
    k = len(p.counts)
    counts = _counts(p.mode, steps, p.per_step, weights if weights is not None else [1.0] * k, k)
    return _arrange(p.mode, counts, (key, seed, epoch, "rest", run))


def rest_steps(p: MixPlan, weights: Sequence[float] | None, left: Sequence[int], first_pass: Sequence[bool],
               exhausted: str) -> int:
    """Steps of an epoch's rest on other ranks where source ``i`` has ``left[i]`` batches of its pass
    left: the epoch's own rule on what is left, with the counts of :func:`rest_labels` (the weights'
    exact shares): with ``"end"``, the most steps in which no source needs more than its ``left``;
    with ``"repeat"``, the fewest in which every source still in its ``first_pass`` has its ``left``
    (the others may start further passes; 0 when none is)."""
    k = len(left)
    w = list(weights) if weights is not None else [1.0] * k
    s = float(sum(w))
    per = k if p.mode == "composition" else p.per_step

    def counts(n: int) -> list[int]:
        return _counts(p.mode, n, p.per_step, w, k)

    if exhausted == "end":
        return _most(lambda n: all(c <= r for c, r in zip(counts(n), left)),
                     min(r * s / (wi * per) for r, wi in zip(left, w)))
    need = [i for i in range(k) if first_pass[i]]
    if not need:
        return 0
    n = max(0, math.ceil(max(left[i] * s / (w[i] * per) for i in need)))
    while n > 0 and all(counts(n - 1)[i] >= left[i] for i in need):
        n -= 1
    while not all(counts(n)[i] >= left[i] for i in need):
        n += 1
    return n