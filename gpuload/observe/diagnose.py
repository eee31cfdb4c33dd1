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

Whatever the rule, where the utilisation sampler measured this process's threads waiting for
a core at least ``CONTENDED`` (25%) as long as they ran (over at least 0.5 CPU seconds) (:attr:`gpuload.Stats.cpu_contention`,
from Linux's schedstat), the message and the action add that the cores are oversubscribed.

The advice fits the loader measured (:attr:`gpuload.Stats.loader`): ``gpuload cache
build``, ``shuffle_window`` and the other gpuload settings only for gpuload's datasets;
``num_workers``, ``pin_memory`` and ``persistent_workers`` for a torch DataLoader.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import statistics

from ..memory import cores as _cores
from .stats import StageStats, Stats
from .whatif import what_if

__all__ = ["diagnose", "Diagnosis", "STARVED", "SATURATED", "DISK_NEAR", "STARTUP", "STRAGGLER"]

#: Starvation (fraction of wall time) below which the step, not the loader, limits.
STARVED = 0.05
#: Run-queue seconds per CPU second of the process's threads that mean oversubscribed cores.
CONTENDED = 0.25
#: Busy fraction of the wall time per worker below which no stage counts as saturated.
SATURATED = 0.5
#: Fraction of the disk's speed from which cache reads count as disk-bound.
DISK_NEAR = 0.8
#: Share of the waiting that, spent in the longest next() of each pass, makes start-up the limit.
STARTUP = 0.6
#: a rank waiting this much more (fraction of its time) than the median rank is a straggler
STRAGGLER = 0.05

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


def _rate(rows_per_s: float) -> str:
    return f"{rows_per_s / 1e6:.2f} M" if rows_per_s >= 1e6 else f"{rows_per_s:,.0f}"


def _workers(s: StageStats, threads: int | None) -> int:
    """Threads the stage's time is shared by: the pool (or more, if more were seen running it)."""
    return max(threads, s.threads) if threads and s.name in _POOL and not s.training_thread else max(1, s.threads)


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


def _kind(stats: Stats) -> str | None:
    """The loader the stats measured: as they say, else gpuload's when they have stage timings."""
    return stats.loader if stats.loader is not None else ("gpuload" if stats.stages else None)


def _startup(stats: Stats, kind: str | None) -> tuple[str, str]:
    """(what the first next() of a pass waits for, what to do about it), for the loader ``kind``."""
    steady = "nothing to fix in steady state, and longer epochs amortise it"
    if kind == "gpuload" and stats.remote is not None and stats.remote.requests and stats.stages.get("read"):
        return (f", while the loader fills its first shuffle window from the object store ({stats.remote}; "
                f"{stats.stages['read'].seconds:.2f} s of reads)",
                "build the cache ahead (`gpuload cache build URL`) so that epochs read the local cache and make no "
                "request, or keep more requests in flight (remote={'max_requests': 64}); a smaller shuffle_window "
                "or chunk_bytes makes the first window smaller")
    if kind == "gpuload":
        decoded = any(n in stats.stages for n in ("decode", "convert"))  # from the cache already: nothing to build
        decoded = decoded and (stats.loader_settings or {}).get("cache_io") != "off"  # nor when nothing is cached
        return (", while the loader fills its first shuffle window",
                f"{steady}; to shorten it, use a smaller shuffle_window or chunk_bytes"
                + (", and build the cache ahead (`gpuload cache build`) so the first window is read rather than "
                   "decoded" if decoded else ""))
    if kind == "DataLoader":
        workers = (stats.loader_settings or {}).get("num_workers") or 0
        what = (f", while the DataLoader starts its {workers} worker processes and they load their first batches"
                if workers else ", while the DataLoader loads its first batch")
        return what, (f"{steady}; to shorten it, persistent_workers=True (with num_workers > 0) keeps the workers, "
                      "and what they opened, from one epoch to the next; a dataset that opens its files and "
                      "connections lazily, once per worker, starts faster")
    return (": the loader's own start-up (opening files or connections, starting workers, filling buffers)",
            f"{steady}; to shorten it, keep what the loader opens at the start of each pass open across passes, "
            "if it can")


def _no_stages(stats: Stats, kind: str | None, waited: str) -> tuple[str, str]:
    """(message, action) for a loader that cannot keep up, measured without stage timings."""
    cpu = f"; process CPU {stats.cpu_percent:.0f}%" if stats.cpu_percent is not None else ""
    gpu = f", GPU {stats.gpu_percent:.0f}%" if stats.gpu_percent is not None else ""
    settings = stats.loader_settings or {}
    message = f"the loader cannot keep up with the step: {waited}{cpu}{gpu}"
    if kind == "gpuload":
        threads, prefetch = settings.get("num_threads", "?"), settings.get("prefetch", "?")
        return (message + "; these stats (of a watch() around a gpuload dataset) have no per-stage timings: the "
                "dataset's own have",
                "run gpuload.diagnose(ds.stats()) on the dataset itself to name the stage that limits it; until "
                f"then: raise prefetch (now {prefetch}) and num_threads (now {threads}), and build the cache ahead "
                "with `gpuload cache build` so that no epoch decodes")
    if kind == "DataLoader":
        workers, cores = settings.get("num_workers") or 0, _cores()
        pin = "" if settings.get("pin_memory") else ", pin_memory=True when batches go to a GPU"
        keep = "" if settings.get("persistent_workers") else ", persistent_workers=True to keep the workers " \
                                                              "between epochs"
        parquet = ("; for Parquet data, gpuload.ParquetDataset converts each chunk once, caches the converted "
                   "columns and loads them on background threads")
        if not workers:
            return (message + "; the DataLoader loads every batch on the training thread (num_workers=0), "
                    "inside next()",
                    f"set num_workers (this machine has {cores} CPU cores) so that worker processes load batches "
                    f"while the step runs{pin}{keep}{parquet}")
        factor = settings.get("prefetch_factor")
        message += f"; its {workers} worker processes do not load batches as fast as the step takes them" + (
            " (process CPU is the training process's alone)" if cpu else "")
        if workers >= cores:  # a user's trial: 4 busy workers on 2 cores were told to add workers
            return (message + f", and they are as many as the machine's {cores} CPU cores or more",
                    f"more workers would only share the same cores: what each worker does per batch (reading, "
                    f"decoding, converting, collating) is the cost; make it cheaper{pin}{keep}{parquet}")
        return (message,
                f"raise num_workers (now {workers}, of {cores} CPU cores) and prefetch_factor (now {factor}){pin}"
                f"{keep}; if the workers are busy converting (each near a whole core in top), the conversion "
                f"is the cost{parquet}")
    return (message + "; these stats have no per-stage timings to name the stage that limits it",
            "load ahead of the step on background threads or processes (for instance a torch DataLoader with "
            "num_workers > 0 and prefetch_factor; a ParquetDataset's num_threads and prefetch), or load Parquet "
            "with gpuload.ParquetDataset, which caches converted columns and loads them on background threads")


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
    ValueError
        When ``stats`` timed no ``next()`` call at all.
    """
    if not isinstance(stats, Stats):  # every rank's figures (gpuload.observe.ranks.RankStats)
        return _straggler(stats, disk_gbps, threads)
    d = _diagnose(stats, disk_gbps, threads)
    pool = threads or (stats.loader_settings or {}).get("num_threads")
    if stats.loader == "gpuload" and d.limiting not in ("step", "startup") and isinstance(pool, int):
        est = tuple(what_if(stats, pool, cached=cached, block_gather=block_gather))
        if est and est[0].waiting_s <= 0.8 * stats.wait_s:
            d = replace(d, what_if=est, message=f"{d.message}; what would help most (estimated from the stage "
                        f"costs): {est[0].change}, waiting about {est[0].starvation:.0%} of the time instead of "
                        f"{stats.starvation:.0%} ({est[0].basis})")
        elif est:
            d = replace(d, what_if=est)
    share = stats.cpu_contention
    if share is None or share < CONTENDED:
        return d
    g, o = stats.cpu_queue.get("gpuload", (0.0, 0.0)), stats.cpu_queue.get("other", (0.0, 0.0))
    return replace(d, message=f"{d.message}; the cores are oversubscribed (measured): this process's threads "
                   f"waited for a core {share:.0%} as long as they ran (gpuload's {g[1]:.2f} s, the training "
                   f"thread's and torch's {o[1]:.2f} s) on {_cores()} cores",
                   action=f"{d.action}; and run fewer threads at once: torch.set_num_threads() in the training "
                   "process, a smaller num_threads or a nice= for the loader, or fewer processes per node")


def _diagnose(stats: Stats, disk_gbps: float | None, threads: int | None) -> Diagnosis:
    if stats.wall_s <= 0:
        raise ValueError("these stats timed no batch: iterate the watched loader before diagnosing it")
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
    if stats.batches > 1 and stats.wait_s > 0 and first >= STARTUP * stats.wait_s:
        what, action = _startup(stats, kind)
        each = "of each pass" if stats.passes > 1 else "of the pass"
        return Diagnosis(st, "startup", f"most of the waiting ({first:.2f} of {stats.wait_s:.2f} s) is the first "
                         f"next() {each}{what}; in between it keeps up with the step; {waited}", action)
    if not stats.stages:
        return Diagnosis(st, "loader", *_no_stages(stats, kind, waited))
    s = max(_candidates(stats), key=lambda s: s.seconds / _workers(s, threads))
    n = _workers(s, threads)
    busy = min(1.0, s.seconds / n / wall)  # work outside the passes (listing at open) can exceed the wall time
    total_gbps = s.gbps * n
    if s.training_thread:  # inside next(): the time it can use is the wait, not the wall
        share = (f"{s.seconds:.2f} s of its {stats.wait_s:.2f} s of waiting" if s.seconds <= stats.wait_s else
                 f"{s.seconds:.2f} s in all, more than the {stats.wait_s:.2f} s it waited inside next()")
        where = f"{s.name} runs on the training thread, {share} ({s.gbps:.2f} GB/s, {_rate(s.rows_per_s)} rows/s)"
    else:
        where = (f"{s.name} kept {n} thread{'s' * (n != 1)} busy {busy:.0%} of the {wall:.2f} s run "
                 f"({s.seconds:.2f} s in all, {s.gbps:.2f} GB/s and {_rate(s.rows_per_s)} rows/s per thread)")
    message, action = _stage_advice(s, stats, kind, where, total_gbps, disk_gbps)
    message += f"; {waited}"
    if stats.during_waits:  # what ran while it waited: the waiting prefetch did not hide, by stage
        message += f"; during those waits: {stats.waits_text().split('; ', 1)[1]}"
    if s.training_thread:
        action += ("; and move the loading off the training thread (gpuload loads on background threads)"
                   if kind == "gpuload" else "; and move the loading off the training thread (DataLoader "
                   "num_workers > 0, or a background thread)")
    elif busy < SATURATED and not (s.name == "batch" and (stats.loader_settings or {}).get("batch_transform")):
        message += (f"; no stage is busy more than {SATURATED:.0%} of the run per thread, so the loader is not "
                    "keeping enough work in flight")
        action = (f"raise prefetch first; then: {action}" if kind == "gpuload" else
                  f"keep more work in flight first (more workers, a deeper prefetch); then: {action}")
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
    if slow.decoded > decoded:
        causes.append(f"its cache is cold: it decoded {slow.decoded:,} chunks from Parquet where the median "
                      f"other rank decoded {decoded:g} (build the cache on its node ahead: `gpuload cache build`)")
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


def _stage_advice(s: StageStats, stats: Stats, kind: str | None, where: str, total_gbps: float,
                  disk_gbps: float | None) -> tuple[str, str]:
    """(message, action) for the limiting stage ``s``; gpuload's commands only for gpuload's loaders."""
    ours = kind == "gpuload"
    settings = stats.loader_settings or {}
    on_gpu = settings.get("device") == "cuda"  # not said: advise as for the CPU
    if s.name == "batch" and settings.get("batch_transform"):
        return (f"batches are made at {_rate(s.rows_per_s)} rows/s, with the batch_transform "
                f"'{settings['batch_transform']}' on the producer thread (one thread, in order): {where}",
                "time the batch_transform alone and make it cheaper, or do its work in the training step (on the "
                "GPU); work that is the same in every epoch belongs in transform=, computed once per chunk and "
                "cached")
    if s.name in ("decode", "convert") and settings.get("transform"):
        return (f"first epoch is bound by decoding and converting, which includes the transform "
                f"'{settings['transform']}' (timed as conversion): {where}",
                "time the transform alone and make it cheaper (it runs once per chunk, in the first epoch only: "
                "later epochs read its cached result), raise num_threads, or build the cache ahead with "
                "`gpuload cache build`")
    if s.name in ("decode", "convert") and ours and (stats.loader_settings or {}).get("decode") == "gpu":
        return (f"first epoch is decode-bound, with cuDF decoding on the GPU: {where}",
                "raise num_threads (each loader thread reads, decodes and converts one chunk at a time), or build "
                "the cache ahead with `gpuload cache build`")
    if s.name in ("decode", "convert") and ours and settings.get("cache_io") == "off":
        return (f"epochs are decode-bound: with cache_io='off' each one decodes Parquet: {where}",
                "over more than one epoch of this data, leave out cache_io='off' so that later epochs read the "
                "converted chunks from the cache; else raise num_threads" + ("" if on_gpu else " or use device=cuda"))
    if s.name in ("decode", "convert"):
        return (f"first epoch is decode-bound on the CPU: {where}" if ours else f"decoding is the limit: {where}",
                "build the cache ahead with `gpuload cache build`, or " + (
                    "install cuDF (the gpu extra: see gpuload.gpu_status()) so that decode='auto' decodes on "
                    "the GPU" if on_gpu else "use device=cuda") if ours else
                "decode ahead of the step on more workers, or cache the converted columns: gpuload.ParquetDataset "
                "converts each chunk once and reads its cache in later epochs")
    if s.name == "cache_read":
        if disk_gbps:
            return (f"cache reads run at {total_gbps:.2f} GB/s against {disk_gbps:.2f} GB/s the disk gives: {where}",
                    "the disk is the limit: put the cache on faster local NVMe" if total_gbps >= DISK_NEAR * disk_gbps
                    else f"raise prefetch (and num_threads): the disk has {disk_gbps - total_gbps:.2f} GB/s to spare")
        return (f"cache reads run at {total_gbps:.2f} GB/s (the disk's speed was not measured: pass disk_gbps= "
                f"from fio or dd): {where}",
                "raise prefetch (and num_threads); if reads do not get faster, the disk is the limit")
    if s.name == "read" and stats.remote is not None and stats.remote.requests:
        return (f"first epoch is remote-bound: decoding waits on the object store ({stats.remote}): {where}",
                "keep more requests in flight (remote={'max_requests': 64, 'readahead_bytes': 1 << 30}), run "
                "the job in the store's region, or build the cache ahead with `gpuload cache build URL`: later "
                "epochs read only the local cache and make no request" if ours else
                "keep more requests in flight, run the job in the store's region, or cache the data locally")
    if s.name == "read":
        return (f"the Parquet source reader is throttled at {total_gbps:.2f} GB/s: {where}",
                "copy the source to local NVMe, raise num_threads for more reads in flight, or build the cache "
                "ahead with `gpuload cache build` so that epochs read the cache instead" if ours else
                "copy the source to local NVMe, or keep more reads in flight")
    if s.name == "cache_write":
        around = ("pass cache_io='direct' (`--cache-io direct`), which writes the cache around the page cache (no "
                  "copy into newly allocated page-cache pages; later epochs then read the disk, not memory), "
                  if settings.get("cache_io") == "buffered" else "")
        return (f"first-epoch cache writes are the limit at {total_gbps:.2f} GB/s"
                f"{' through the page cache' if around else ''}: {where}",
                f"{around}build the cache ahead with `gpuload cache build`, or put the cache on faster local disk"
                if ours else "put the cache on faster local disk")
    if s.name == "h2d":
        return (f"host-to-device copies are the limit at {total_gbps:.2f} GB/s: {where}",
                "copy batches from pinned memory with non_blocking=True on a side stream (gpuload's CUDA "
                "hand-off does), or keep the whole pipeline on the GPU (device=cuda with the gpu extra: "
                "GPU decode and cache reads into device memory), so that no per-batch copy remains")
    if s.name == "batch":
        return (f"the shuffle gather is the limit at {_rate(s.rows_per_s)} rows/s: {where}",
                ("use a smaller shuffle_window (fewer rows gathered per window)" + ("" if on_gpu else
                 ", more num_threads (the CPU path gathers batches on them), or device=cuda to shuffle on the GPU"))
                if ours
                else "assemble batches in the workers (DataLoader collate_fn runs there), or on the GPU")
    return (f"listing the source files is the limit: {where}",
            "pass a list of files instead of a directory or glob on slow storage")
