"""diagnose: name what limits a training loop, from its :class:`~gpuload.Stats`, and what to do.

The rules, in order (thresholds are the module constants below):

1. ``starvation < STARVED`` (5%): the step is the bottleneck (``limiting="step"``):
   the training thread almost never waits, so a faster loader would not help.
2. The longest ``next()`` of each pass holds ``STARTUP`` (60%) of the waiting or more:
   ``limiting="startup"``: the loader keeps up once running, and the wait is the start
   of the pass (the first shuffle window being filled).
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
     the CPU: build the cache ahead, or decode on the GPU;
   * cache_read: its rate (per-thread GB/s x workers) against ``disk_gbps``; within
     ``DISK_NEAR`` (80%) of it the disk is the limit, below it raise ``prefetch``;
   * read: the Parquet source reader is throttled (remote or slow storage);
   * cache_write: first-epoch cache writes; h2d: host-to-device copies (pinned
     memory, or build batches on the GPU); batch: the shuffle gather (a smaller
     ``shuffle_window``, or the GPU); list: listing the source files.

   When even that stage is busy less than ``SATURATED`` (50%) of the wall time per
   worker, no stage is saturated: the loader is not keeping enough work in flight,
   and the advice starts with raising ``prefetch``. A stage that ran on the training
   thread itself (inside ``next()``, as in a hand-written loop) is measured against
   the waiting time instead, and the advice adds moving it off that thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .stats import StageStats, Stats

__all__ = ["diagnose", "Diagnosis", "STARVED", "SATURATED", "DISK_NEAR", "STARTUP"]

#: Starvation (fraction of wall time) below which the step, not the loader, limits.
STARVED = 0.05
#: Busy fraction of the wall time per worker below which no stage counts as saturated.
SATURATED = 0.5
#: Fraction of the disk's speed from which cache reads count as disk-bound.
DISK_NEAR = 0.8
#: Share of the waiting that, spent in the longest next() of each pass, makes start-up the limit.
STARTUP = 0.6

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
    """

    starvation: float
    limiting: str
    message: str
    action: str

    def __str__(self) -> str:
        return (f"starvation {self.starvation:.1%}; limited by: {self.limiting}\n"
                f"{self.message}\naction: {self.action}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _rate(rows_per_s: float) -> str:
    return f"{rows_per_s / 1e6:.2f} M" if rows_per_s >= 1e6 else f"{rows_per_s:,.0f}"


def _workers(s: StageStats, threads: int | None) -> int:
    return threads if threads and s.name in _POOL and not s.training_thread else max(1, s.threads)


def _candidates(stats: Stats) -> list[StageStats]:
    """The stages to compare; decode and convert of one chunk run back to back on one
    pool thread, so they count as one CPU job, named ``decode``."""
    stages = dict(stats.stages)
    d, c = stages.pop("decode", None), stages.pop("convert", None)
    if d is not None and c is not None:
        sec = d.seconds + c.seconds
        d = replace(d, seconds=sec, threads=max(d.threads, c.threads), share=d.share + c.share,
                    gbps=c.nbytes / sec / 1e9 if sec > 0 else 0.0, nbytes=c.nbytes,
                    rows_per_s=d.rows / sec if sec > 0 else 0.0)
    return [x for x in (*stages.values(), d or c) if x is not None]


def diagnose(stats: Stats, *, disk_gbps: float | None = None, threads: int | None = None) -> Diagnosis:
    """Name the bottleneck of a measured loop and the action that addresses it.

    Parameters
    ----------
    stats : from :meth:`gpuload.Watched.stats` or :meth:`gpuload.Metrics.stats`.
    disk_gbps : sequential read speed of the cache's disk in GB/s (1e9 bytes/s), e.g.
        from ``fio``; None (default): not measured, and said so.
    threads : loader threads available to the pool stages (the dataset's
        ``num_threads``); None (default): the threads seen running each stage.

    Returns
    -------
    Diagnosis

    Raises
    ------
    ValueError
        When ``stats`` timed no ``next()`` call at all.
    """
    if stats.wall_s <= 0:
        raise ValueError("these stats timed no batch: iterate the watched loader before diagnosing it")
    st, wall = stats.starvation, stats.wall_s
    waited = (f"the training thread waited {st:.1%} of {wall:.2f} s ({_ms(stats.wait_mean_s)} per next() "
              f"against {_ms(stats.step_mean_s)} of step per batch)")
    if st < STARVED:
        return Diagnosis(st, "step", f"the step itself is the bottleneck: the loader is not; {waited}",
                         "nothing to gain in the loader; to go faster, profile the step (torch.profiler, nsys)")
    if stats.batches > 1 and stats.wait_max_s * max(stats.passes, 1) >= STARTUP * stats.wait_s:
        first = stats.wait_max_s * max(stats.passes, 1)
        return Diagnosis(st, "startup", f"most of the waiting ({first:.2f} of {stats.wait_s:.2f} s) is the first "
                         f"next() of each pass, while the loader fills its first shuffle window; in between it keeps "
                         f"up with the step; {waited}",
                         "nothing to fix in steady state, and longer epochs amortise it; to shorten it, use a smaller "
                         "shuffle_window or chunk_bytes, and build the cache ahead (`gpuload cache build`) so the "
                         "first window is read rather than decoded")
    if not stats.stages:
        cpu = f"; process CPU {stats.cpu_percent:.0f}%" if stats.cpu_percent is not None else ""
        gpu = f", GPU {stats.gpu_percent:.0f}%" if stats.gpu_percent is not None else ""
        return Diagnosis(st, "loader", f"the loader cannot keep up with the step: {waited}{cpu}{gpu}; "
                         "these stats have no per-stage timings to name the stage that limits it",
                         "give the loader more workers and prefetch (DataLoader num_workers and prefetch_factor; "
                         "ParquetDataset num_threads and prefetch), or load with gpuload.ParquetDataset, which "
                         "caches converted columns and loads them on background threads")
    s = max(_candidates(stats), key=lambda s: s.seconds / _workers(s, threads))
    n = _workers(s, threads)
    busy = s.seconds / n / wall
    total_gbps = s.gbps * n
    if s.training_thread:  # inside next(): the time it can use is the wait, not the wall
        where = (f"{s.name} runs on the training thread, {s.seconds:.2f} s of its {stats.wait_s:.2f} s of "
                 f"waiting ({s.gbps:.2f} GB/s, {_rate(s.rows_per_s)} rows/s)")
    else:
        where = (f"{s.name} kept {n} thread{'s' * (n != 1)} busy {busy:.0%} of the {wall:.2f} s run "
                 f"({s.seconds:.2f} s in all, {s.gbps:.2f} GB/s and {_rate(s.rows_per_s)} rows/s per thread)")
    if s.name in ("decode", "convert"):
        message = f"first epoch is decode-bound on the CPU: {where}"
        action = "build the cache ahead with `gpuload cache build`, or use device=cuda"
    elif s.name == "cache_read":
        if disk_gbps:
            message = f"cache reads run at {total_gbps:.2f} GB/s against {disk_gbps:.2f} GB/s the disk gives: {where}"
            action = ("the disk is the limit: put the cache on faster local NVMe" if total_gbps >= DISK_NEAR * disk_gbps
                      else f"raise prefetch (and num_threads): the disk has {disk_gbps - total_gbps:.2f} GB/s to spare")
        else:
            message = (f"cache reads run at {total_gbps:.2f} GB/s (the disk's speed was not measured: pass "
                       f"disk_gbps= from fio or dd): {where}")
            action = "raise prefetch (and num_threads); if reads do not get faster, the disk is the limit"
    elif s.name == "read" and stats.remote is not None and stats.remote.requests:
        message = (f"first epoch is remote-bound: decoding waits on the object store ({stats.remote}): {where}")
        action = ("keep more requests in flight (remote={'max_requests': 64, 'readahead_bytes': 1 << 30}), run "
                  "the job in the store's region, or build the cache ahead with `gpuload cache build URL`: "
                  "later epochs read only the local cache and make no request")
    elif s.name == "read":
        message = f"the Parquet source reader is throttled at {total_gbps:.2f} GB/s: {where}"
        action = ("copy the source to local NVMe, raise num_threads for more reads in flight, or build the "
                  "cache ahead with `gpuload cache build` so that epochs read the cache instead")
    elif s.name == "cache_write":
        message = f"first-epoch cache writes are the limit at {total_gbps:.2f} GB/s: {where}"
        action = "build the cache ahead with `gpuload cache build`, or put the cache on faster local disk"
    elif s.name == "h2d":
        message = f"host-to-device copies are the limit at {total_gbps:.2f} GB/s: {where}"
        action = ("copy batches from pinned memory with non_blocking=True on a side stream (gpuload's CUDA "
                  "hand-off does), or keep the whole pipeline on the GPU (device=cuda with the gpu extra: "
                  "GPU decode and cache reads into device memory), so that no per-batch copy remains")
    elif s.name == "batch":
        message = f"the shuffle gather is the limit at {_rate(s.rows_per_s)} rows/s on the producer thread: {where}"
        action = "use a smaller shuffle_window (fewer rows gathered per window), or device=cuda to shuffle on the GPU"
    else:  # list
        message = f"listing the source files is the limit: {where}"
        action = "pass a list of files instead of a directory or glob on slow storage"
    message += f"; {waited}"
    if s.training_thread:
        action += "; and move the loading off the training thread (gpuload loads on background threads)"
    elif busy < SATURATED:
        message += (f"; no stage is busy more than {SATURATED:.0%} of the run per thread, so the loader is not "
                    "keeping enough work in flight")
        action = f"raise prefetch first; then: {action}"
    return Diagnosis(st, s.name, message, action)
