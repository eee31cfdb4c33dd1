"""diagnose: name what limits a training loop, from its :class:`~gpuload.Stats`, and what to do.

The rules, in order (thresholds are the module constants below):

1. ``starvation < STARVED`` (5%): the step is the bottleneck (``limiting="step"``):
   the training thread almost never waits, so a faster loader would not help.
2. The first ``next()`` of each pass holds ``STARTUP`` (60%) of the waiting or more (summed
   over passes, :attr:`gpuload.Stats.first_wait_s`, so never more than the waiting):
   ``limiting="startup"``: the loader keeps up once running, and the wait is the start
   of the pass (the first shuffle window being filled; a DataLoader's workers starting).
3. No stage spans (a loader that is not gpuload, timed by :func:`gpuload.watch`):
   ``limiting="loader"``: the loader cannot keep up with the step.
4. Otherwise the limiting stage is the loader stage with the largest busy time per
   available worker thread: ``seconds / workers``, where ``workers`` is ``threads``
   (the loader's thread pool) for the stages run on the pool (read, decode, convert,
   cache_write, cache_read) and the number of threads seen running the stage for the
   others (list, batch, h2d: one producer thread, and every stage that ran on the
   training thread); without ``threads``, the threads seen running it. The advice depends on the stage:

   * decode / convert (one job: a chunk's decode and conversion run back to back on
     one pool thread, so their times are added): the first epoch is decode-bound on
     the CPU (or bound by converting, where that took longer: the message says which):
     build the cache ahead, or decode on the GPU;
   * cache_read: its rate (per-thread GB/s x workers) against ``disk_gbps``; within
     ``DISK_NEAR`` (80%) of it the disk is the limit, below it raise ``prefetch``;
   * read: the Parquet source reader is throttled (remote or slow storage);
   * cache_write: first-epoch cache writes; h2d: host-to-device copies (pinned
     memory, or build batches on the GPU); batch: the shuffle gather (a smaller
     ``shuffle_window``, or the GPU); list: listing the source files.

   Where the loader threads waited for the cache writer to take their chunks
   (``write_wait``) at least ``HELD_BACK`` (20%) of their time, cache_write is the limit
   whatever ran most: the threads were held back by the writes, not busy.

   When even that stage is busy less than ``SATURATED`` (50%) of the wall time per
   worker, no stage is saturated: the loader is not keeping enough work in flight,
   and the advice starts with raising ``prefetch``. A stage that ran on the training
   thread itself (inside ``next()``, as in a hand-written loop) is measured against
   the waiting time instead, and the advice adds moving it off that thread.

Whatever the rule, where the utilisation sampler measured this process's threads waiting for
a core at least ``CONTENDED`` (25%) as long as they ran (over at least 0.5 CPU seconds) (:attr:`gpuload.Stats.cpu_contention`,
from Linux's schedstat), the message and the action add that the cores are oversubscribed.

The advice fits the loader measured (:attr:`gpuload.Stats.loader`): ``gpuload cache
build``, ``shuffle_window`` and the other gpuload settings only for gpuload's datasets;
``num_workers``, ``pin_memory`` and ``persistent_workers`` for a torch DataLoader.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..machine import cores as _cores
from .advice import CONTENDED, DISK_NEAR, no_stages, rate, stage_advice, startup
from .stats import StageStats, Stats
from .whatif import what_if

__all__ = ["diagnose", "Diagnosis", "STARVED", "SATURATED", "DISK_NEAR", "STARTUP", "STRAGGLER", "HELD_BACK",
           "IN_FLIGHT"]

#: Starvation (fraction of wall time) below which the step, not the loader, limits.
STARVED = 0.05
#: Busy fraction of the wall time per worker below which no stage counts as saturated.
SATURATED = 0.5
#: Share of the waiting that, spent in the longest next() of each pass, makes start-up the limit.
STARTUP = 0.6
#: Share of the loader threads' time spent waiting for the cache writer that makes the cache writes the limit.
HELD_BACK = 0.2
#: a rank waiting this much more (fraction of its time) than the median rank is a straggler
STRAGGLER = 0.05
#: Share of the waiting with nothing in flight (``Stats.during_waits["idle"]``) below which more prefetch cannot help.
IN_FLIGHT = 0.2

_POOL = frozenset({"read", "decode", "convert", "cache_write", "cache_read"})


@dataclass(frozen=True)
class Diagnosis:
    """What limits the loop and what to do about it.

    Attributes
    ----------
    starvation : fraction (0 to 1) of wall time the training thread waited for data.
    limiting : ``"step"``, ``"startup"`` (the start of each pass), ``"loader"`` (a loader
        without stage data) or a stage of
        :data:`gpuload.observe.metrics.STAGES`.
    message : what the numbers say, with the numbers.
    action : what to change.
    source : for a :class:`gpuload.Mix`, the source whose batches the mix waited for most
        (the diagnosis is then that source's), else None.
    rank : for every rank's figures (:class:`gpuload.observe.ranks.RankStats`), the straggler
        (the diagnosis is then that rank's), else None.
    what_if : for a starved gpuload loop, :func:`gpuload.observe.whatif.what_if`'s estimates,
        best first (the message names the best where it would cut the waiting by a fifth).
    """

    starvation: float
    limiting: str
    message: str
    action: str
    source: str | None = None
    rank: int | None = None
    what_if: tuple = ()

    def __str__(self) -> str:
        return (f"starvation {self.starvation:.1%}; limited by: {self.limiting}\n"
                f"{self.message}\naction: {self.action}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _workers(s: StageStats, threads: int | None) -> int:
    """Threads the stage's time is shared by: the pool (or more, if more were seen running it)."""
    return max(threads, s.threads) if threads and s.name in _POOL and not s.training_thread else max(1, s.threads)


def _candidates(stats: Stats) -> list[StageStats]:
    """The stages to compare; decode and convert of one chunk run back to back on one
    pool thread, so they count as one CPU job, named ``decode``."""
    stages = dict(stats.stages)
    stages.pop("write_wait", None)  # not work: the loader threads blocked on the cache writer (see _held_back)
    d, c = stages.pop("decode", None), stages.pop("convert", None)
    if d is not None and c is not None:
        sec = d.seconds + c.seconds
        d = replace(d, seconds=sec, threads=max(d.threads, c.threads), share=d.share + c.share,
                    gbps=c.nbytes / sec / 1e9 if sec > 0 else 0.0, nbytes=c.nbytes,
                    rows_per_s=d.rows / sec if sec > 0 else 0.0)
    return [x for x in (*stages.values(), d or c) if x is not None]


def _held_back(stats: Stats, threads: int | None) -> float | None:
    """The seconds the loader threads waited for the cache writer, where that is at least
    ``HELD_BACK`` of their time (the wall time per pool thread) and cache writes were timed:
    the writer, not the stage the threads ran most, then limits the loader. Else None."""
    wait, write = stats.stages.get("write_wait"), stats.stages.get("cache_write")
    if wait is None or write is None:
        return None
    pool = threads or (stats.loader_settings or {}).get("num_threads") or max(wait.threads, 1)
    return wait.seconds if wait.seconds >= HELD_BACK * pool * stats.wall_s else None


def _kind(stats: Stats) -> str | None:
    """The loader the stats measured: as they say, else gpuload's when they have stage timings."""
    return stats.loader if stats.loader is not None else ("gpuload" if stats.stages else None)


def diagnose(stats: Stats, *, disk_gbps: float | None = None, threads: int | None = None,
             cached: Stats | None = None, block_gather: float | None = None) -> Diagnosis:
    """Name the bottleneck of a measured loop and the action that addresses it.

    The advice fits the loader measured (:attr:`gpuload.Stats.loader`): gpuload's settings
    and commands for gpuload's datasets, a DataLoader's for a DataLoader, and neither for
    other loaders. Every share the message prints is at most its whole.

    Parameters
    ----------
    stats : from :meth:`gpuload.Watched.stats`, :meth:`gpuload.ParquetDataset.stats` or
        :meth:`gpuload.Metrics.stats`.
    disk_gbps : sequential read speed of the cache's disk in GB/s (1e9 bytes/s), e.g.
        from ``fio``; None (default): not measured, and said so.
    threads : loader threads available to the pool stages (the dataset's
        ``num_threads``); None (default): the threads seen running each stage.
    cached : for a first epoch's stats, a later epoch's that read the cache: the estimates
        (``what_if``) then include a warm cache.
    block_gather : a block-shuffled gather's seconds over a row-shuffled one's, timed
        (:func:`gpuload.tools.profile.block_gather_ratio`): the estimates then include
        ``shuffle="block"``.

    Returns
    -------
    Diagnosis

    Raises
    ------
    gpuload.ConfigError (a ``ValueError``)
        When ``stats`` timed no ``next()`` call at all, or is not the stats of a loop.
    """
    if not isinstance(stats, Stats):  # every rank's figures (gpuload.observe.ranks.RankStats)
        if not hasattr(stats, "slowest"):
            raise ConfigError(f"gpuload.diagnose() takes the stats of a loop (ds.stats(), a watched loader's "
                              f".stats(), Metrics.stats() or ds.stats(all_ranks=True)), not a "
                              f"{type(stats).__name__}")
        return _straggler(stats, disk_gbps, threads)
    d = _diagnose(stats, disk_gbps, threads)
    pool = threads or (stats.loader_settings or {}).get("num_threads")
    share = stats.cpu_contention
    contended = share is not None and share >= CONTENDED
    if stats.loader == "gpuload" and d.limiting not in ("step", "startup") and isinstance(pool, int):
        est = tuple(what_if(stats, pool, cached=cached, block_gather=block_gather))
        if contended:  # more threads on cores already oversubscribed: the estimate assumes cores that are not free
            est = tuple(w for w in est if w.settings.get("num_threads", 0) <= pool)
        if est and est[0].waiting_s <= 0.8 * stats.wait_s:
            best = est[0]
            named = ", ".join(f"{k}={v!r}" for k, v in best.settings.items())
            action = d.action if not named or named in d.action else f"{named} first (the estimate); then: {d.action}"
            d = replace(d, what_if=est, action=action, message=f"{d.message}; what would help most (estimated from "
                        f"the stage costs): {best.change}, waiting about {best.waiting_s:.2f} s ({best.starvation:.0%} "
                        f"of the time) instead of {stats.wait_s:.2f} s ({stats.starvation:.0%}; {best.basis})")
        elif est:
            d = replace(d, what_if=est)
    if not contended:
        return d
    g, o = stats.cpu_queue.get("gpuload", (0.0, 0.0)), stats.cpu_queue.get("other", (0.0, 0.0))
    fewer = "a smaller num_threads or " if not isinstance(pool, int) or pool > 1 else ""
    return replace(d, message=f"{d.message}; the cores are oversubscribed (measured): this process's threads "
                   f"waited for a core {share:.0%} as long as they ran (gpuload's {g[1]:.2f} s, the training "
                   f"thread's and torch's {o[1]:.2f} s) on {_cores()} cores",
                   action=f"{d.action}; and run fewer threads at once: torch.set_num_threads() in the training "
                   f"process, {fewer}a nice= for the loader, or fewer processes per node" + _spinning())


def _spinning() -> str:
    """Advice on torch's OpenMP threads, which by default spin on a core for a while after each
    parallel region: with several of them and cores oversubscribed, they take the loader's cores
    (on 2 cores, a consumer cloning batches with torch's 2 threads: 1.43-1.60 M rows/s a first
    epoch with them spinning, 1.96-2.10 M with OMP_WAIT_POLICY=PASSIVE). Empty where torch runs
    one thread or the policy is set already."""
    if torch.get_num_threads() <= 1 or os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return ""
    return (f"; or keep torch's {torch.get_num_threads()} threads and set OMP_WAIT_POLICY=PASSIVE in the "
            "environment before Python starts (its OpenMP threads then sleep between parallel regions instead of "
            "spinning on the loader's cores)")


def _diagnose(stats: Stats, disk_gbps: float | None, threads: int | None) -> Diagnosis:
    if stats.wall_s <= 0:
        raise ConfigError("these stats timed no batch yet: iterate the loader (the ParquetDataset, or the loader "
                         "gpuload.watch wraps) over some batches before diagnosing its stats()")
    st, wall, kind = stats.starvation, stats.wall_s, _kind(stats)
    waited = (f"the training thread waited {st:.1%} of {wall:.2f} s ({_ms(stats.wait_mean_s)} per next() "
              f"against {_ms(stats.step_mean_s)} of step per batch)")
    if st >= STARVED and stats.sources:
        return _slowest_source(stats, disk_gbps, threads)
    if st < STARVED:
        return Diagnosis(st, "step", f"the step itself is the bottleneck: the loader is not; {waited}",
                         "nothing to gain in the loader; to go faster, profile the step (torch.profiler, nsys)")
    # the first next() of each pass, summed (Stats made by hand: the longest next(), one of them)
    first = min(stats.wait_s, stats.first_wait_s if stats.first_wait_s is not None else stats.wait_max_s)
    # the rest of the run (after each pass's first next()) must keep up too, or it is no start-up problem
    steady = (stats.wait_s - first) / (stats.wall_s - first) if stats.wall_s > first else 0.0
    if stats.batches > 1 and stats.wait_s > 0 and first >= STARTUP * stats.wait_s and steady < STARVED:
        what, action = startup(stats, kind)
        each = "of each pass" if stats.passes > 1 else "of the pass"
        return Diagnosis(st, "startup", f"most of the waiting ({first:.2f} of {stats.wait_s:.2f} s) is the first "
                         f"next() {each}{what}; in between it keeps up with the step; {waited}", action)
    candidates = _candidates(stats)
    if not candidates:  # no stage spans (or only waits for the writer)
        return Diagnosis(st, "loader", *no_stages(stats, kind, waited))
    s = max(candidates, key=lambda s: s.seconds / _workers(s, threads))
    held = _held_back(stats, threads)
    if held is not None:  # the writer's own threads (and any that copied for it), not the loader's pool
        s = stats.stages["cache_write"]
    n = max(1, s.threads) if held is not None else _workers(s, threads)
    busy = min(1.0, s.seconds / n / wall)  # work outside the passes (listing at open) can exceed the wall time
    total_gbps = s.gbps * n
    if s.training_thread:  # inside next(): the time it can use is the wait, not the wall
        share = (f"{s.seconds:.2f} s of its {stats.wait_s:.2f} s of waiting" if s.seconds <= stats.wait_s else
                 f"{s.seconds:.2f} s in all, more than the {stats.wait_s:.2f} s it waited inside next()")
        where = f"{s.name} runs on the training thread, {share} ({s.gbps:.2f} GB/s, {rate(s.rows_per_s)} rows/s)"
    else:
        where = (f"{s.name} kept {n} thread{'s' * (n != 1)} busy {busy:.0%} of the {wall:.2f} s run "
                 f"({s.seconds:.2f} s in all, {s.gbps:.2f} GB/s and {rate(s.rows_per_s)} rows/s per thread)")
        if held is not None:
            where += (f"; the loader threads waited {held:.2f} s in all for the cache writer (two threads per cache "
                      f"folder) to take the chunks they had built")
    message, action = stage_advice(s, stats, kind, where, total_gbps, disk_gbps)
    message += f"; {waited}"
    if stats.during_waits:  # what ran while it waited: the waiting prefetch did not hide, by stage
        message += f"; during those waits: {stats.waits_text().split('; ', 1)[1]}"
    if s.training_thread:
        action += ("; and move the loading off the training thread (gpuload loads on background threads)"
                   if kind == "gpuload" else "; and move the loading off the training thread (DataLoader "
                   "num_workers > 0, or a background thread)")
    elif busy < SATURATED and held is None and stats.during_waits and \
            stats.during_waits.get("idle", 0.0) < IN_FLIGHT * stats.wait_s:
        message += (f"; no stage, {s.name} included, is busy more than {SATURATED:.0%} of the run per thread, yet "
                    "some stage ran through nearly all the waits: the loader's threads share the cores (and "
                    "Python's lock) with each other and the step, and more work in flight would not help")
    elif busy < SATURATED and held is None and not (s.name == "batch" and
                                                    (stats.loader_settings or {}).get("batch_transform")):
        message += (f"; yet no stage, {s.name} included, is busy more than {SATURATED:.0%} of the run per thread, "
                    "so the loader is not "
                    "keeping enough work in flight")
        if kind != "gpuload":
            action = f"keep more work in flight first (more workers, a deeper prefetch); then: {action}"
        elif not action.startswith("raise prefetch"):  # not "raise prefetch first; then: raise prefetch..."
            action = f"raise prefetch first; then: {action}"
    return Diagnosis(st, s.name, message, action)


def _straggler(view, disk_gbps: float | None, threads: int | None) -> Diagnosis:
    """Every rank's figures: the rank that waits most, against the median, with the causes shown."""
    slow, med = view.slowest, view.median_starvation
    d = diagnose(slow.stats, disk_gbps=disk_gbps, threads=threads)
    waits = ", ".join(f"rank {r.rank} {r.stats.starvation:.1%}" for r in view.timed)
    if len(view.timed) == 1 or slow.stats.starvation - med < STRAGGLER:
        return replace(d, message=f"no straggler: the ranks wait alike ({waits}); {d.message}")
    others = [r for r in view.timed if r is not slow]
    causes = []
    decoded = statistics.median(r.decoded for r in others)
    if slow.decoded > decoded:  # with cache_io='off' every chunk is decoded: no cache to build
        cold = (slow.stats.loader_settings or {}).get("cache_io") != "off"
        causes.append(f"{'its cache is cold: ' if cold else ''}it decoded {slow.decoded:,} chunks from Parquet where "
                      f"the median other rank decoded {decoded:g}"
                      + (" (build the cache on its node ahead: `gpuload cache build`)" if cold else ""))
    requests = statistics.median(r.stats.remote.requests if r.stats.remote else 0 for r in others)
    mine = slow.stats.remote.requests if slow.stats.remote else 0
    if mine > requests:
        causes.append(f"it reads a remote source ({mine:,} requests against {requests:g} for the median other rank)")
    cpu = slow.stats.system_cpu_percent
    busy = [r.stats.system_cpu_percent for r in others if r.stats.system_cpu_percent is not None]
    if cpu is not None and cpu >= 90 and (not busy or cpu > statistics.median(busy) + 10):
        causes.append(f"its node's CPUs are busy ({cpu:.0f}% of all of {slow.host}'s cores; the rank may use "
                      f"{slow.cpus})")
    why = "; ".join(causes) + "; " if causes else ""
    return Diagnosis(slow.stats.starvation, d.limiting,
                     f"rank {slow.rank} ({slow.host}) is the straggler: it waited {slow.stats.starvation:.1%} of its "
                     f"time for data against {med:.1%} for the median rank ({waits}), and every rank steps with it; "
                     f"{why}on rank {slow.rank}: {d.message}", f"on rank {slow.rank}: {d.action}", d.source, slow.rank)


def _slowest_source(stats: Stats, disk_gbps: float | None, threads: int | None) -> Diagnosis:
    """A starved mix: the source its thread waited for most, diagnosed on its own stats."""
    name, src = max(stats.sources.items(), key=lambda kv: kv[1].wait_s)
    waits = ", ".join(f"{n!r} {s.wait_s:.2f} s" for n, s in stats.sources.items())
    head = (f"the training thread waited {stats.starvation:.1%} of {stats.wall_s:.2f} s for the mix, and the mix "
            f"waited longest for source {name!r} (waits per source: {waits})")
    if src.wall_s <= 0:
        return Diagnosis(stats.starvation, "loader", head, f"look at source {name!r} first", name)
    if src.starvation < STARVED:  # no source kept the mix thread waiting: its own work, or too little ahead
        join = stats.stages.get("batch")
        busy = f"joining source batches took {join.seconds:.2f} s of its time" if join else "it timed no join"
        return Diagnosis(stats.starvation, "batch", f"{head}; no source kept the mix thread waiting long "
                         f"({src.starvation:.0%} of its time at most), so the mix thread itself is the limit: {busy}",
                         "keep more steps ready (Mix(prefetch=...)), or join fewer batches per step (a larger "
                         "batch_size on the sources with a smaller batches_per_step)", None)
    d = diagnose(src, disk_gbps=disk_gbps, threads=threads)
    return Diagnosis(stats.starvation, d.limiting, f"{head}; in {name!r}: {d.message}",
                     f"in source {name!r}: {d.action}", name)


