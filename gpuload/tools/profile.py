"""``gpuload profile``: run the loader under a training step and say what limits it.

Each epoch runs with a simulated step (``step_ms`` of work per batch) or a small real
model, under :class:`gpuload.observe.sampling.UtilSampler`, and is summarised on its own: the
first epoch of a fresh cache decodes (and is usually decode-bound), the later ones
read the cache. The disk's sequential read speed is measured once on the cache files (with
their pages dropped from the page cache first) so that cache reads can be judged
against it. All epochs go into one Chrome trace when ``trace`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..batch import Ragged
from ..cache.fs import CacheRoot
from ..dataset import ParquetDataset
from ..errors import ConfigError
from ..observe.diagnose import STARVED, Diagnosis, diagnose
from ..observe.trace import TraceFile
from ..observe.stats import Stats
from ..observe.sampling import UtilSampler
from .cache_text import chunks_text

__all__ = ["EpochReport", "MlpStep", "profile", "headspace", "block_gather_ratio", "disk_read_gbps", "HEADSPACE_NEAR"]

HEADSPACE_NEAR = 0.8  # under the step at this share of its headspace rate or more, the loader is the limit
FEW_BATCHES = 10  # an epoch of fewer batches is mostly its start: its figures are flagged as such


@dataclass(frozen=True)
class EpochReport:
    """One profiled epoch: its statistics, its diagnosis, and how many chunks it decoded."""

    epoch: int
    stats: Stats
    diagnosis: Diagnosis
    decoded_chunks: int
    cached_chunks: int
    headspace: Stats | None = None  # the same epoch with no step (profile(headspace=True)), else None
    ranks: object = None  # every rank's figures (profile(all_ranks=True) under torch.distributed), else None
    read_ahead: bool = False  # its end loaded the next epoch's first chunks (gpuload.preload), counted with it
    taken_ahead: int = 0  # chunks it took from those the epoch before it read ahead (counted with that one)

    def __str__(self) -> str:
        s = self.stats
        off = (s.loader_settings or {}).get("cache_io") == "off"
        kind = "decodes, cache_io='off'" if off else "decodes and caches" if self.decoded_chunks else "reads the cache"
        few = (f"\n  only {s.batches} batch{'es' * (s.batches != 1)} in this epoch: the figures are mostly its "
               "start; a smaller batch size (--batch-size) or more rows measures the steady state"
               if s.batches < FEW_BATCHES else "")
        ahead = ", the next epoch's first among them, read ahead" if self.read_ahead else ""
        before = f", {self.taken_ahead} read ahead by epoch {self.epoch - 1}" if self.taken_ahead else ""
        return (f"epoch {self.epoch} ({kind}: {chunks_text(self.decoded_chunks)} decoded, {self.cached_chunks} read "
                f"from the cache{ahead if self.cached_chunks else ''}{before}): {s.rows:,} rows in {s.wall_s:.2f} s, "
                f"{s.rows_per_s:,.0f} rows/s, "
                f"starvation {s.starvation:.1%}{few}\n  {self.diagnosis}"
                + (f"\n  remote source: {s.remote}" if s.remote is not None else "")
                + ("" if self.headspace is None else f"\n  {self.bound()}")
                + ("" if self.ranks is None or len(self.ranks.ranks) < 2 else
                   f"\n{self.ranks}\n  {diagnose(self.ranks)}"))

    def bound(self) -> str:
        """What the headspace run says: the loader alone against the loader under the step."""
        h, s = self.headspace, self.stats
        if h is None or not h.rows_per_s:
            return "headspace: not measured"
        share = s.rows_per_s / h.rows_per_s
        who = ("the loader is the limit: under the step it goes as fast as alone" + (
            f" or faster (alone it measured {1 / share:.0%} of that, in a run that came first, on a colder process "
            "and page cache: compare the later epochs)" if share > 1 / HEADSPACE_NEAR else "") if share >= 1 else
               "the loader is the limit: under the step it delivers {:.0%} of what it can alone".format(share)
               if share >= HEADSPACE_NEAR else
               f"the loader is the limit, slowed by the step: alone it is {1 / share:.1f}x faster, yet the step "
               f"waited {s.starvation:.0%} of the time for it: the step's own work takes the cores (or the GPU) the "
               "loader needs (fewer torch threads, OMP_WAIT_POLICY=PASSIVE, or more cores help)"
               if s.starvation > STARVED else
               "the step is the limit: the loader alone is {:.1f}x faster than the step lets it go".format(1 / share))
        return (f"headspace (the loader alone, no step, {'empty' if 'decode' in h.stages else 'full'} cache): "
                f"{h.rows_per_s:,.0f} rows/s against {s.rows_per_s:,.0f} under the step; {who}")


class MlpStep:
    """A real training step for any dataset: an MLP over every dense output, one SGD update.

    Scalar and 2-D outputs are cast to float32 and concatenated (ragged outputs are
    skipped); the loss is the mean square of the output, read with ``.item()`` as a
    training loop would. Built on the first batch, on the dataset's device.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.net = self.opt = None

    def __call__(self, batch: dict) -> None:
        dense = [v.to(self.device).float().reshape(len(v), -1) for v in batch.values() if not isinstance(v, Ragged)]
        if not dense:
            raise ConfigError("--model mlp needs at least one scalar or 2-D output; these columns are all lists "
                              "(use --step-ms instead)")
        x = torch.cat(dense, 1)
        if self.net is None:
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 256), torch.nn.ReLU(),
                                           torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                           torch.nn.Linear(256, 1)).to(self.device)
            self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-6)
        loss = self.net(torch.nan_to_num(x)).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        loss.item()


def disk_read_gbps(files: list, limit_bytes: int = 1 << 30) -> float | None:
    """Sequential read speed of ``files`` from the disk, in GB/s (None if nothing to read).

    ``files``: paths, or ``(CacheRoot, folder parts, name)`` of cache files (opened
    through the cache root, never through a link in it). Only regular files are read,
    never through a link at the name, never blocking on a FIFO. Each file's pages are
    dropped from the page cache first (``posix_fadvise`` DONTNEED), so this measures the
    device, not memory; where the kernel keeps them anyway the result is an upper bound.
    """
    total, seconds = 0, 0.0
    buf = bytearray(8 << 20)
    for f in files:
        if total >= limit_bytes:
            break
        try:
            root, parts, name = f if isinstance(f, tuple) else (CacheRoot(Path(f).parent), (), Path(f).name)
            fd = root.open_read(parts, name)
        except OSError:
            continue  # gone, or not a regular file
        with open(fd, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while n := fh.readinto(buf):
                total += n
            seconds += time.perf_counter() - t0
    return total / seconds / 1e9 if seconds > 0 and total else None


def block_gather_ratio(ds: ParquetDataset) -> float | None:
    """Seconds of a block-shuffled gather over a row-shuffled one, timed on one shuffle window of
    ``ds``'s chunks as the cache holds them (the best of 3 each; the block side copies its runs
    from the chunks, as the pipeline does, the row side gathers from the joined window): what
    ``shuffle="block"`` would make of the gathers of a dataset with the default shuffle. None
    where it does not apply (another shuffle, a GPU device: its gathers are not the host's)."""
    from .. import plan
    from ..batch import Parts, concat, long_runs, nrows, take

    o, r = ds.options, ds.reader
    if o.block is not None or not o.shuffled or ds.device.type != "cpu" or not r.chunks:
        return None
    parts = [r.load(i) for i in range(min(len(r.chunks), o.shuffle_window))]
    cols = concat(parts)
    n = nrows(cols)
    if n < 2 * o.block_rows:
        return None
    rows = plan.window_permutation(n, fingerprint=r.fingerprint, seed=o.seed, epoch=0, rank=0, window=0)
    blocks = plan.block_permutation(n, o.block_rows, fingerprint=r.fingerprint, seed=o.seed, epoch=0, rank=0,
                                    window=0)

    def best(gather, idx) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            gather(idx)
            times.append(time.perf_counter() - t0)
        return min(times)

    row_s = best(lambda idx: take(cols, idx), rows)
    window = Parts(parts) if long_runs(blocks) else None
    block_s = best(lambda idx: take(cols, idx) if window is None else window.take(idx), blocks)
    return block_s / row_s if row_s > 0 else None


def headspace(source, columns=None, *, epochs: int = 2, warm: bool = False, **dataset_kwargs) -> list[Stats]:
    """The loader alone: ``epochs`` epochs with no step, the first on an empty cache of its own (a
    temporary folder, removed after; ``cache_dir`` is not touched), the others reading it (every
    one with ``warm``: the cache is built first, unmeasured). One :class:`gpuload.Stats` per
    epoch: its rows/s is what the loader can give on this node. A remote source is fetched again."""
    import tempfile

    kwargs = {k: v for k, v in dataset_kwargs.items() if k != "cache_dir"}
    with tempfile.TemporaryDirectory(prefix="gpuload-headspace-") as tmp:
        ds = ParquetDataset(source, columns, cache_dir=tmp, **kwargs)
        if warm:  # to compare with a run whose cache is full already
            for _ in ds:
                pass
            ds.reader.cache.flush()
        out = []
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            ds.preload_next = epoch < epochs - 1  # the last epoch reads nothing for one that will not come
            ds.reset_stats()
            for _ in ds:
                pass
            ds.reader.cache.flush()
            out.append(ds.stats())
        ds.close()
    return out


def profile(source, columns=None, *, epochs: int = 2, step_ms: float | None = 5.0, model: str | None = None,
            trace=None, headspace: bool = False, all_ranks: bool = False, opened=None,
            **dataset_kwargs) -> list[EpochReport]:
    """Run ``epochs`` epochs of ``source`` under a training step; one :class:`EpochReport` each.

    Parameters
    ----------
    source, columns, dataset_kwargs : as for :class:`gpuload.ParquetDataset`.
    epochs : epochs to run (default 2: the first decodes when the cache is empty).
    step_ms : simulated step per batch in milliseconds (default 5), when ``model`` is None.
    model : ``"mlp"``: a small real MLP on the dataset's device (its float outputs as input).
    trace : path of a Chrome trace-event JSON file covering every epoch (default None).
    headspace : also run the loader alone first (:func:`headspace`: no step, an empty cache of its
        own), so each report says whether the loader or the step is the limit (default False).
    all_ranks : under torch.distributed, gather every rank's figures after each epoch (every
        rank must call ``profile`` alike): each report then holds them (``ranks``) and names
        the straggler (default False).
    opened : ``opened(dataset)`` is called once the dataset is open, before any epoch (the
        command prints its heading then, after the source and settings are known good).
    """
    from .demo import simulated_step

    if model not in (None, "mlp"):
        raise ConfigError(f"model={model!r}: the profiler knows 'mlp' (or give step_ms)")
    ds = ParquetDataset(source, columns, **dataset_kwargs)
    if opened is not None:
        opened(ds)
    warm = headspace and all(ds.reader.is_cached(i) for i in range(len(ds.reader.chunks)))
    alone = _headspace(source, columns, epochs=epochs, warm=warm, **dataset_kwargs) if headspace else [None] * epochs
    step = MlpStep(ds.device) if model == "mlp" else simulated_step(step_ms or 0.0)
    threads = ds.options.num_threads
    reports, origin, disk = [], None, None
    with contextlib.ExitStack() as stack:
        out = None if trace is None else stack.enter_context(TraceFile(trace, {"producer": "gpuload profile"}))
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            ds.preload_next = epoch < epochs - 1  # the last epoch reads nothing for one that will not come
            ds.reset_stats()
            before = (ds.reader.counters.decoded, ds.reader.counters.from_cache)
            needed = len({seg.chunk for window in ds.plan_epoch(epoch)[0] for seg in window})
            with UtilSampler(ds.metrics):
                for batch in ds:
                    step(batch)
            ds.reader.cache.flush()
            stats = ds.stats()
            if disk is None and "cache_read" in stats.stages:  # once: it drops the files from the page cache
                keys = [ds.reader.key(i) for i in range(len(ds.reader.chunks))]
                disk = disk_read_gbps([(ds.reader.cache.root_of(k), k.parts, k.name) for k in keys])
            n_decoded = ds.reader.counters.decoded - before[0]
            n_cached = ds.reader.counters.from_cache - before[1]
            reports.append(EpochReport(epoch, stats, diagnose(stats, disk_gbps=disk, threads=threads), n_decoded,
                                       n_cached, alone[epoch], ds.stats(all_ranks=True) if all_ranks else None,
                                       ds.preload_next and ds.options.prefetch > 0 and ds.reader.caching,
                                       max(0, needed - n_decoded - n_cached)))  # the rest: taken from the read-ahead
            if out is not None:  # each epoch's events as it ends: the file, not memory, holds the trace
                origin = origin if origin is not None else ds.metrics.first_time()
                out.add(ds.metrics.iter_trace_events(origin=origin))
    ratio = block_gather_ratio(ds) if any(r.stats.stages.get("batch") for r in reports) else None
    cached = reports[-1].stats if len(reports) > 1 and not reports[-1].decoded_chunks else None
    for i, rep in enumerate(reports):  # again, with what the later epochs and a timed gather tell
        if ratio is not None or (cached is not None and rep.decoded_chunks):
            reports[i] = dataclasses.replace(rep, diagnosis=diagnose(
                rep.stats, disk_gbps=disk, threads=threads, cached=cached if rep.decoded_chunks else None,
                block_gather=ratio))
    ds.close()
    return reports


_headspace = headspace  # profile()'s own parameter of that name hides the function inside it
