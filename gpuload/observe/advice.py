"""What to do about the limit :func:`gpuload.observe.diagnose.diagnose` names: the message and the
action for each limiting stage, for the start of a pass, and for a loader timed without stages,
each fitted to the loader measured (gpuload's settings and commands only for gpuload's datasets;
``num_workers`` and the rest for a torch DataLoader)."""

from __future__ import annotations

from ..machine import cores as _cores
from ..pipeline import cut_threads
from .stats import StageStats, Stats

__all__ = ["DISK_NEAR", "CONTENDED", "rate", "startup", "no_stages", "stage_advice"]

#: Fraction of the disk's speed from which cache reads count as disk-bound.
DISK_NEAR = 0.8
#: a dataset's ``cache_io`` whose reads go through the page cache (:attr:`gpuload.reader.ChunkReader.cache_io`)
BUFFERED_READS = ("buffered", "direct writes, buffered reads")
#: Run-queue seconds per CPU second of the process's threads that mean oversubscribed cores.
CONTENDED = 0.25


def rate(rows_per_s: float) -> str:
    return f"{rows_per_s / 1e6:.2f} M" if rows_per_s >= 1e6 else f"{rows_per_s:,.0f}"


def startup(stats: Stats, kind: str | None) -> tuple[str, str]:
    """(what the first next() of a pass waits for, what to do about it), for the loader ``kind``."""
    steady = "nothing to fix in steady state, and longer epochs amortise it"
    settings = stats.loader_settings or {}
    off = settings.get("cache_io") == "off"  # every epoch decodes: no cache to build
    windowed = settings.get("shuffle", True) in (True, "block")  # else batches are cut from the first chunk
    if kind == "gpuload" and stats.remote is not None and stats.remote.requests and stats.stages.get("read"):
        return (f", while the loader fills its first shuffle window, from the object store in the passes that "
                f"read it ({stats.remote}; {stats.stages['read'].seconds:.2f} s of reads)",
                ("" if off else "build the cache ahead (`gpuload cache build URL`) so that first epochs read the "
                 "local cache too and make no request, or ") + "keep more requests in flight (remote={'max_requests': 64}); "
                "a smaller shuffle_window or chunk_bytes makes the first window smaller")
    if kind == "gpuload":
        decoded = any(n in stats.stages for n in ("decode", "convert"))  # from the cache already: nothing to build
        decoded = decoded and not off  # nor when nothing is cached
        first = "first shuffle window" if windowed else "first chunk"
        return (f", while the loader fills its {first}",
                ("nothing to fix in steady state" if off and stats.passes == 1 else steady)
                + f"; to shorten it, use a smaller {'shuffle_window or ' if windowed else ''}chunk_bytes"
                + (f", and build the cache ahead (`gpuload cache build`) so the {first} is read rather than "
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


def _gathers_on_more(settings: dict) -> bool:
    """Whether one more loader thread would gather batches on the CPU: the cut threads run only
    where the cores leave room beside the loader's and the training thread
    (:func:`gpuload.pipeline.cut_threads`); on 2 cores they never do, so more threads gather nothing."""
    more = (settings.get("num_threads") or 2) + 1
    return cut_threads(more, _cores()) > 1


def no_stages(stats: Stats, kind: str | None, waited: str) -> tuple[str, str]:
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
                f"then: raise prefetch (now {prefetch}) and num_threads (now {threads}), and where an epoch decodes "
                "Parquet, build the cache ahead with `gpuload cache build`")
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
        busy = stats.worker_cpu_percent
        message += f"; its {workers} worker processes do not load batches as fast as the step takes them" + (
            " (process CPU is the training process's alone)" if cpu else "") + (
            f"; each worker used {busy:.0f}% of a core" if busy is not None else "")
        if busy is not None and busy < 50:  # a new user's trial: workers sleeping on I/O were told not to add any
            return (message + ": they mostly wait (on a disk, a store, a lock), not compute",
                    f"raise num_workers (now {workers}; waiting workers share the {cores} CPU cores well) and "
                    f"prefetch_factor (now {factor}) so that more loads wait at once{pin}{keep}{parquet}")
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


def _decode_or_convert(stats: Stats, transform: str | None = None) -> str:
    """What of a chunk's decode-and-convert job took most of its time, in words (``transform``: the key of
    the user's transform, timed as conversion and named first): a user's trial with hashed string columns
    was told its first epoch was decode-bound, with 0.52 s converting and 0.03 s decoding."""
    d, c = (stats.stages[n].seconds if n in stats.stages else 0.0 for n in ("decode", "convert"))
    if c > d:
        work = (f"the transform '{transform}', " if transform else "") + "casts, categorical hashing or vocabularies, "
        return f"bound by converting ({work}fill values: {c:.2f} s, against {d:.2f} s decoding)"
    return "decode-bound" + (f", the transform '{transform}' included" if transform else "")


def stage_advice(s: StageStats, stats: Stats, kind: str | None, where: str, total_gbps: float,
                  disk_gbps: float | None) -> tuple[str, str]:
    """(message, action) for the limiting stage ``s``; gpuload's commands only for gpuload's loaders."""
    ours = kind == "gpuload"
    settings = stats.loader_settings or {}
    on_gpu = settings.get("device") == "cuda"  # not said: advise as for the CPU
    # cores measured oversubscribed: more loader threads would only wait for them too (a user's trial was told to
    # raise num_threads and to lower it in one sentence)
    full = stats.cpu_contention is not None and stats.cpu_contention >= CONTENDED
    cuda = "on a node with a GPU, device=cuda"
    if s.name == "batch" and settings.get("batch_transform"):
        return (f"batches are made at {rate(s.rows_per_s)} rows/s, with the batch_transform "
                f"'{settings['batch_transform']}' on the producer thread (one thread, in order): {where}",
                "time the batch_transform alone and make it cheaper, or do its work in the training step (on the "
                "GPU); work that is the same in every epoch belongs in transform=, computed once per chunk and "
                "cached")
    off = ours and settings.get("cache_io") == "off"
    keep = ("over more than one epoch of this data, leave out cache_io='off' so that later epochs read the converted "
            "chunks from the cache")
    if s.name in ("decode", "convert") and off:
        extra = ", with cuDF decoding on the GPU" if settings.get("decode") == "gpu" else ""
        more = [t for t, helps in (("raise num_threads", not full), (cuda, not on_gpu)) if helps]
        return (f"epochs are {_decode_or_convert(stats, settings.get('transform'))}{extra}: with cache_io='off' each "
                f"one decodes Parquet: {where}",
                keep + (f"; else {' or '.join(more)}" if more else ""))
    if (s.name in ("decode", "convert") and ours and not off and stats.passes > 1 and "cache_read" in stats.stages
            and s.rows <= 1.05 * stats.rows / stats.passes):  # one pass's rows decoded, not each pass's (evictions)
        # a user's trial: three passes, two of them cached, were told to build the cache ahead
        where += (f" (these stats add up {stats.passes} passes since the dataset opened or reset_stats(): the "
                  "decoding was the first epoch's, later passes read the cache; ds.reset_stats() after the first "
                  "epoch measures the cached ones alone)")
    if s.name in ("decode", "convert") and settings.get("transform"):
        return (f"first epoch is bound by decoding and converting, which includes the transform "
                f"'{settings['transform']}' (timed as conversion): {where}",
                "time the transform alone and make it cheaper (it runs once per chunk, in the first epoch only: "
                "later epochs read its cached result), " + ("" if full else "raise num_threads, ") + "or build the "
                "cache ahead with `gpuload cache build`")
    if s.name in ("decode", "convert") and ours and (stats.loader_settings or {}).get("decode") == "gpu":
        return (f"first epoch is decode-bound, with cuDF decoding on the GPU: {where}",
                ("" if full else "raise num_threads (each loader thread reads, decodes and converts one chunk at a "
                 "time), or ") + "build the cache ahead with `gpuload cache build`")
    if s.name in ("decode", "convert"):
        return (f"first epoch is {_decode_or_convert(stats)} on the CPU: {where}" if ours else
                f"decoding is the limit: {where}",
                "build the cache ahead with `gpuload cache build`, or " + (
                    "install cuDF (the gpu extra: see gpuload.gpu_status()) so that decode='auto' decodes on "
                    "the GPU" if on_gpu else cuda) if ours else
                "decode ahead of the step on more workers, or cache the converted columns: gpuload.ParquetDataset "
                "converts each chunk once and reads its cache in later epochs")
    if s.name == "cache_read":
        if disk_gbps and total_gbps > disk_gbps:  # a user's trial was told the disk limited such reads
            where_from = (", so they come from the page cache" if settings.get("cache_io") in BUFFERED_READS and not on_gpu
                          else " (measured as one stream: several threads can read faster)")
            return (f"cache reads run at {total_gbps:.2f} GB/s, faster than the {disk_gbps:.2f} GB/s measured for the "
                    f"disk{where_from}; the disk is not what limits them: {where}",
                    f"raise prefetch{'' if full else ' (and num_threads)'}: the disk is not the limit")
        if disk_gbps:
            return (f"cache reads run at {total_gbps:.2f} GB/s against {disk_gbps:.2f} GB/s the disk gives: {where}",
                    "the disk is the limit: put the cache on faster local NVMe" if total_gbps >= DISK_NEAR * disk_gbps
                    else f"raise prefetch{'' if full else ' (and num_threads)'}: the disk has "
                         f"{disk_gbps - total_gbps:.2f} GB/s to spare")
        return (f"cache reads run at {total_gbps:.2f} GB/s (the disk's speed was not measured: pass disk_gbps= "
                f"from fio or dd): {where}",
                f"raise prefetch{'' if full else ' (and num_threads)'}; if reads do not get faster, the disk is the "
                "limit")
    if s.name == "read" and stats.remote is not None and stats.remote.requests:
        threads = settings.get("num_threads")
        # fewer requests in all than may be in flight at once: a deeper queue of requests cannot help, more
        # chunks fetched and decoded at once can (a helper's trial: 8 requests; max_requests=64 changed nothing,
        # num_threads 2 -> 4 cut the epoch by 31%)
        few = ours and isinstance(threads, int) and stats.remote.requests <= settings.get("max_requests", 0)
        more = (f"raise num_threads (now {threads}) so that more chunks are fetched and decoded at once" if few else
                "keep more requests in flight (remote={'max_requests': 64, 'readahead_bytes': 1 << 30})")
        return (f"{'every' if off else 'first'} epoch is remote-bound: decoding waits on the object store "
                f"({stats.remote}): {where}",
                f"{more}, run "
                "the job in the store's region, or " + (f"{keep} (no request)" if off else "build the cache ahead "
                "with `gpuload cache build URL`: later epochs read only the local cache and make no request")
                if ours else
                "keep more requests in flight, run the job in the store's region, or cache the data locally")
    if s.name == "read":
        return (f"the Parquet source reader is throttled at {total_gbps:.2f} GB/s: {where}",
                "copy the source to local NVMe, " + ("" if full else "raise num_threads for more reads in flight, ")
                + "or " + (
                    keep if off else "build the cache ahead with `gpuload cache build` so that epochs read the "
                    "cache instead") if ours else
                "copy the source to local NVMe, or keep more reads in flight")
    if s.name == "cache_write":
        around = (("pass cache_io='direct'" if on_gpu else "leave cache_io at 'auto' (the default) or pass "
                   "cache_io='direct'") + " (`--cache-io`), which writes the cache around the page cache (no copy "
                  "into newly allocated page-cache pages), " if settings.get("cache_io") == "buffered" else "")
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
        return (f"the shuffle gather is the limit at {rate(s.rows_per_s)} rows/s: {where}",
                ("use a smaller shuffle_window (fewer rows gathered per window)" + ("" if on_gpu else
                 ("" if full or not _gathers_on_more(settings) else
                  ", more num_threads (the CPU path gathers batches on them)") +
                 f", or, {cuda} to shuffle on the GPU"))
                if ours
                else "assemble batches in the workers (DataLoader collate_fn runs there), or on the GPU")
    return (f"listing the source files is the limit: {where}",
            "pass a list of files instead of a directory or glob on slow storage")
