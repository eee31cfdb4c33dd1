"""What-if: the waiting a measured gpuload loop would have with other settings, from its stage costs.

A model of the steady state, fitted to one measured run (:class:`gpuload.Stats`):

* the training thread needs ``S = wall_s - wait_s`` seconds of its own (steps and hand-off);
* the loader needs ``L = max(P / min(threads, cores), B, C)`` seconds: ``P`` the busy seconds of
  the stages its pool of ``threads`` threads runs (read, decode, convert, cache_read), spread over
  at most the cores the process may use (:func:`gpuload.machine.cores`); ``B`` the batches' (``batch``, ``h2d``): gathered on
  :func:`gpuload.pipeline.cut_threads` threads at once on the CPU, on one on a GPU; ``C`` the cache writer's (``cache_write``), one thread;
* the waiting is then ``startup + max(0, L - S) + rest``: ``startup`` the first ``next()`` of each
  pass (the first shuffle window, loaded by the pool: it scales as the pool's time does),
  ``rest`` what the measured waiting holds beyond the model (bursts that the queue did not
  absorb), kept as measured. Where the model needs more than was measured (busy seconds that
  overlapped more than it assumes: the next epoch's first loads run on threads of their own),
  ``max(0, L - S)`` is scaled down to the measured waiting instead: the model with nothing
  changed gives the measured waiting either way, and no estimate is above it (each change
  takes work away, or starts it earlier).

:func:`what_if` changes one thing at a time and recomputes: more loader threads (up to the
cores); where a later epoch's cache reads were measured, a warm cache (the first epoch's
read, decode, convert and cache writes replaced by those reads); where a block-shuffled gather
was timed against a row-shuffled one (``gpuload profile`` does), ``shuffle="block"`` (the
producer's gathers scaled by that ratio); where the training thread waited while no stage ran
at all (``Stats.during_waits["idle"]``: nothing was in flight), twice the ``prefetch``, which
starts that work earlier (that waiting hidden, down to what the stage costs need). The GPU
path's costs are not measured on a CPU: it is not estimated. Each estimate is a
:class:`WhatIf`; the best first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..machine import cores as usable_cores
from ..pipeline import cut_threads
from .stats import Stats

__all__ = ["WhatIf", "what_if", "loader_seconds"]

_POOL = ("read", "decode", "convert", "cache_read")
_PRODUCER = ("batch", "h2d")


@dataclass(frozen=True)
class WhatIf:
    """One estimate: the ``change`` in words, the ``settings`` it means (keyword arguments of
    :class:`gpuload.ParquetDataset`, empty for a step such as building the cache), the expected
    ``waiting_s`` and ``starvation`` of the same loop, and ``basis``: how it was computed."""

    change: str
    settings: dict
    waiting_s: float
    starvation: float
    basis: str


def _busy(stats: Stats, names) -> float:
    return sum(stats.stages[n].seconds for n in names if n in stats.stages)


def _gatherers(stats: Stats, threads: int, cores: int) -> int:
    """Threads the batches are gathered on: the CPU path's cut threads, a GPU's producer alone."""
    on_cpu = (stats.loader_settings or {}).get("device", "cpu") == "cpu"
    return cut_threads(threads, cores) if on_cpu else 1


def _producer(stats: Stats, threads: int, cores: int) -> float:
    """``B`` of the module doc."""
    return _busy(stats, _PRODUCER) / _gatherers(stats, threads, cores)


def loader_seconds(stats: Stats, threads: int, cores: int | None = None) -> float:
    """``L`` of the module doc: the seconds the loader needs with ``threads`` pool threads."""
    cores = cores or usable_cores()
    return max(_busy(stats, _POOL) / max(1, min(threads, cores)), _producer(stats, threads, cores),
               _busy(stats, ("cache_write",)))


def what_if(stats: Stats, threads: int, *, cores: int | None = None, cached: Stats | None = None,
            block_gather: float | None = None) -> list[WhatIf]:
    """Estimates for the loop measured in ``stats``, run with ``threads`` loader threads, best
    (least waiting) first. ``cached``: the stats of a later epoch that read the cache (for the
    warm-cache estimate of a first epoch). ``block_gather``: a block-shuffled gather's time over
    a row-shuffled one's, measured (for the ``shuffle="block"`` estimate: the producer's gathers
    scaled by it). Empty for stats without stage timings or waiting."""
    if not stats.stages or stats.wall_s <= 0 or stats.wait_s <= 0:
        return []
    cores = cores or usable_cores()
    own = max(0.0, stats.wall_s - stats.wait_s)  # the training thread's own seconds
    startup = min(stats.wait_s, stats.first_wait_s or 0.0)
    now = loader_seconds(stats, threads, cores)
    excess, measured = max(0.0, now - own), stats.wait_s - startup
    # the model with nothing changed gives the measured waiting: what it lacks kept as `rest`, what it has
    # too much of scaled away (`scale`)
    scale, rest = (measured / excess, 0.0) if excess > measured else (1.0, measured - excess)

    pool_now = _busy(stats, _POOL) / max(1, min(threads, cores))

    def estimate(change: str, settings: dict, loader_s: float, basis: str, pool_s: float) -> WhatIf:
        first = startup * (pool_s / pool_now if pool_now > 0 else 1.0)
        wait = min(stats.wait_s, first + scale * max(0.0, loader_s - own) + rest)
        return WhatIf(change, settings, wait, wait / (own + wait) if own + wait > 0 else 0.0, basis)

    out = []
    for more in sorted({min(cores, threads * 2), cores} - {threads}):
        if more > threads:
            out.append(estimate(f"num_threads={more}", {"num_threads": more}, loader_seconds(stats, more, cores),
                                f"the pool stages' {_busy(stats, _POOL):.2f} busy s over {min(more, cores)} "
                                f"threads instead of {min(threads, cores)}", _busy(stats, _POOL) / min(more, cores)))
    if cached is not None and "decode" in stats.stages and "cache_read" in cached.stages and cached.rows:
        pool = cached.stages["cache_read"].seconds * stats.rows / cached.rows
        loader_s = max(pool / max(1, min(threads, cores)), _producer(stats, threads, cores))
        out.append(estimate("a warm cache (gpuload cache build ahead of training)", {}, loader_s,
                            f"the first epoch's read, decode, convert and cache writes replaced by the cache reads "
                            f"a later epoch measured ({pool:.2f} busy s for these rows)",
                            pool / max(1, min(threads, cores))))
    idle = (stats.during_waits or {}).get("idle", 0.0)
    prefetch = (stats.loader_settings or {}).get("prefetch")
    if idle > 0 and isinstance(prefetch, int):  # waiting with nothing in flight: work started earlier hides it
        floor = startup + scale * excess
        wait = min(stats.wait_s, max(floor, stats.wait_s - idle))
        out.append(WhatIf(f"prefetch={2 * prefetch}", {"prefetch": 2 * prefetch}, wait,
                          wait / (own + wait) if own + wait > 0 else 0.0,
                          f"the {idle:.2f} s of waiting during which no stage ran (nothing in flight) hidden by "
                          f"work started earlier, down to what the stage costs need"))
    if block_gather is not None and "batch" in stats.stages:
        gathers = stats.stages["batch"].seconds
        producer = (gathers * block_gather + _busy(stats, ("h2d",))) / _gatherers(stats, threads, cores)
        loader_s = max(_busy(stats, _POOL) / max(1, min(threads, cores)), producer, _busy(stats, ("cache_write",)))
        out.append(estimate("shuffle='block'", {"shuffle": "block"}, loader_s,
                            f"the producer's {gathers:.2f} s of gathers at {block_gather:.2f}x, as a block-shuffled "
                            f"gather of one window measured against a row-shuffled one (the cache is rebuilt with "
                            f"rows permuted in each chunk)", pool_now))
    return sorted(out, key=lambda w: w.waiting_s)
