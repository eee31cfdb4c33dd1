"""Reader: an opened dataset's chunks, each loaded from the cache or decoded once.

:class:`ChunkReader` is what the pipeline calls to get a chunk's column set. It holds
the listed files, the resolved outputs, the chunk plan and the cache, and routes every
chunk load through the cache: read it if cached, else decode, convert and write it.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .batch import Ragged, _xp, take
from .cache.store import ChunkKey
from .cache.chunkfile import spec_hash
from .checks import check_casts, check_consistent, check_nulls, check_partition_keys
from .config import Options, Source
from .convert import needed_columns
from .decode import ArrowDecoder
from .device import Device, open_device
from .errors import SourceError
from .sources.fetch import Fetcher, Job, RemoteStats
from .sources.ranges import RangeFile, column_ranges
from .memory import HostBudget, HostPool, host_budget
from .layout import Layout
from .plan import Chunk, chunk_row_permutation, make_chunks
from .schema import OutputSpec, desc_outputs, resolve_outputs, spec_description
from .sources.listing import SourceFile, common_columns, fingerprint, list_files, row_group_sizes
from .sources.opening import open_files
from .sources.remote import same_version

log = logging.getLogger("gpuload")

__all__ = ["ChunkReader", "LoadCounters", "open_reader"]


@dataclass
class LoadCounters:
    """How chunks were obtained since the counters were last reset (thread-safe)."""

    from_cache: int = 0
    decoded: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, cached: bool) -> None:
        with self._lock:
            if cached:
                self.from_cache += 1
            else:
                self.decoded += 1


class ChunkReader:
    """The chunks of ``source`` under ``opts``, and how to load each one.

    Opening lists the files, reads their footers and runs the checks of
    :mod:`gpuload.checks`; column data is read only where the footers cannot rule out
    nulls, and never for cached chunks. Raises the :class:`~gpuload.GpuloadError`
    subclasses of :mod:`gpuload.sources.listing`, :mod:`gpuload.schema` and :mod:`gpuload.checks`.
    """

    def __init__(self, source: Source, opts: Options, device: Device, metrics=None, decoder: Callable | None = None,
                 scan_nulls: bool = True):
        self.source, self.opts, self.device, self.metrics = source, opts, device, metrics
        self.remote = source.remote
        self._fetchers: dict[int, Fetcher] = {}
        self._lock = threading.Lock()
        self._ahead: dict[tuple, Job] = {}  # remote fetches started ahead of decoding, by (file, rg start, rg stop)
        self._ahead_bytes = 0
        self.ahead_used = 0  # chunks whose fetch had been started ahead when decoding asked for it
        self.read_pool = HostPool(max_buffers=opts.shuffle_window + opts.prefetch + opts.num_threads + 2)
        self.cache = device.cache(opts, metrics, self.read_pool)  # on a GPU, chunks are read into device memory
        self.open_counts: dict[str, int] = {}  # footers_cached / footers_read at open
        self.files: list[SourceFile] = open_files(
            list_files(source.source, source.filesystem, source.storage_options, self.remote), self.cache.root,
            self._fetcher, self.open_counts)
        self.has_remote = any(f.remote for f in self.files)  #: some file is a remote object
        first = self.files[0]
        schema = first.schema
        if source.columns is None:  # the columns every file has, whatever the files' order
            schema, left_out = common_columns(self.files)
            if left_out:
                log.warning("gpuload: columns=None: leaving out %s (not in every file); name columns to load "
                            "only what every file has, or fix the files", ", ".join(left_out))
        self.specs: list[OutputSpec] = resolve_outputs(schema, source.columns, source.fill_nulls, source.dtypes, file=first.path,
                                                       int96=frozenset().union(*(f.int96 for f in self.files)))
        check_consistent(self.files, self.specs)
        check_casts(self.files, self.specs)
        self.spec_desc = spec_description(self.specs, opts.layout, permuted=opts.block is not None)
        self.layout = Layout(self.spec_desc)
        self.spec_hash = spec_hash(self.spec_desc)
        self._outputs = desc_outputs(self.spec_desc)
        self.chunks: list[Chunk] = make_chunks([row_group_sizes(f, self.specs) for f in self.files],
                                               opts.chunk_bytes)
        self.num_rows = sum(c.rows for c in self.chunks)
        self.fingerprint = fingerprint(self.files)
        stored = len(self._outputs) + sum(1 for s in self.specs if s.kind == "ragged")  # arrays per chunk
        self.arrays_per_chunk = stored
        # each pool keeps at most its term of the host memory bound (gpuload.memory.host_budget)
        budget = self.host_budget()
        self.read_pool.max_bytes = budget.chunks
        self.pool = HostPool(max_buffers=4 * stored + 4, max_bytes=budget.windows)  # shuffle windows: 2 per array
        # batches gathered or joined, and blocks unpacked: those queued, held by the consumer and being cut
        self.batch_pool = HostPool(max_buffers=(opts.prefetch + 6) * (stored + len(self.layout.blocks)),
                                   max_bytes=budget.batches)
        self.decode = device.decoder(decoder or ArrowDecoder(metrics, fetch=self.fetch), metrics)
        self._footer_ranges = device.gpu_decode  # libcudf reads the footer from the staged file
        self.cached_at_open = {i for i in range(len(self.chunks)) if self.cache.exists(self.key(i))}
        cached = {(self.chunks[i].file, g) for i in self.cached_at_open
                  for g in range(self.chunks[i].rg_start, self.chunks[i].rg_stop)}
        if scan_nulls:  # else (a cluster worker: its caller checked these files) conversion still refuses nulls
            check_nulls(self.files, self.specs, cached=lambda f, g: (f, g) in cached)
            check_partition_keys(self.files, self.specs, cached=lambda f, g: (f, g) in cached)
        self.cache.touch_spec(self.spec_hash, self.spec_desc)
        self.counters = LoadCounters()

    def key(self, i: int) -> ChunkKey:
        """Cache key of chunk ``i``."""
        c = self.chunks[i]
        f = self.files[c.file]
        return ChunkKey(f.path, f.size, f.mtime_ns, self.spec_hash, c.rg_start, c.rg_stop, c.rows, self._outputs,
                        self.spec_desc, f.tag)

    def max_chunk_bytes(self) -> int:
        """Estimated converted bytes of the largest chunk."""
        return max((c.nbytes for c in self.chunks), default=0)

    def host_budget(self) -> HostBudget:
        """What the CPU path of this dataset can hold at once, term by term (see
        :func:`gpuload.memory.host_budget`)."""
        o = self.opts
        row = max((c.nbytes / c.rows for c in self.chunks if c.rows), default=0.0)
        return host_budget(self.max_chunk_bytes(), row, self.arrays_per_chunk, batch_size=o.batch_size,
                           shuffle_window=o.shuffle_window, prefetch=o.prefetch, num_threads=o.num_threads,
                           shuffle=o.shuffled, block=o.block is not None,
                           remote=self.remote if self.has_remote else None,
                           trace_bytes=self.metrics.max_trace_nbytes() if self.metrics is not None else 0)

    def load(self, i: int) -> dict:
        """Column set of chunk ``i``: from the cache, else decoded (and cached if the budget allows).

        On the GPU path, call it inside ``device.reading()``; the columns are then CuPy arrays, ordered on the read stream.
        """
        c = self.chunks[i]
        f = self.files[c.file]
        # without shuffling, batches are views of the chunk: protect the cache writer from in-place changes
        cols, cached = self.cache.load(self.key(i), lambda: self._convert(i), shared=not self.opts.shuffled)
        self.counters.add(cached)
        if cached and f.remote:  # cached meanwhile (another rank or process): its fetch started ahead is not needed
            self._drop_ahead((c.file, c.rg_start, c.rg_stop))
        return self.device.upload(cols)  # a chunk decoded on the CPU is cached from its host arrays, then sent once

    def build(self, i: int, check: bool = False) -> bool:
        """Make sure chunk ``i`` is in the cache, decoding it if it is not; True if this call
        decoded it. A chunk cached already is not read (``check=True``: it is read and
        verified, and rebuilt if corrupt); one cached by another process meanwhile is not
        decoded. What became of the file is in ``cache.outcomes`` when that is on.

        On the GPU path, call it inside ``device.reading()``.
        """
        c = self.chunks[i]
        if not check and self.is_cached(i):
            self.cache.note(self.key(i), "cached")
            cached = True
        else:
            _, cached = self.cache.load(self.key(i), lambda: self._convert(i), shared=False)
        self.counters.add(cached)
        if cached and self.files[c.file].remote:  # a fetch started ahead is not needed
            self._drop_ahead((c.file, c.rg_start, c.rg_stop))
        return not cached

    def _convert(self, i: int) -> dict:
        """Stored column set of chunk ``i``, decoded from its source: its outputs packed into
        the layout's blocks, and for block shuffling its rows permuted (once, here)."""
        c = self.chunks[i]
        f = self.files[c.file]
        cols = self.layout.pack(self.decode(f, c, self.specs))
        if self.opts.block is not None:
            perm = chunk_row_permutation(c.rows, f"{f.path}:{f.size}:{f.mtime_ns}:{f.tag}:{c.rg_start}:{c.rg_stop}")
            first = next(iter(cols.values()))
            xp = _xp(first.values if isinstance(first, Ragged) else first)
            cols = take(cols, perm if xp is np else xp.asarray(perm))
        return cols

    def is_cached(self, i: int) -> bool:
        """Whether chunk ``i`` has a file in the cache (not verified)."""
        return self.cache.exists(self.key(i))

    def cached_file(self, i: int) -> os.stat_result | None:
        """The ``lstat`` of chunk ``i``'s cache file, None where it has none (a link, or a
        folder gpuload cannot read, counts as none)."""
        k = self.key(i)
        try:
            st = self.cache.root.lstat(k.parts, k.name)
        except OSError:
            return None
        return st if st is not None and stat.S_ISREG(st.st_mode) else None

    # -- remote sources -----------------------------------------------------------------------
    def _fetcher(self, store) -> Fetcher:
        with self._lock:
            got = self._fetchers.get(id(store))
            if got is None:
                clock = self.metrics.clock if self.metrics is not None else time.perf_counter
                got = self._fetchers[id(store)] = Fetcher(store, self.remote, clock)
            return got

    def _leaves(self, f: SourceFile) -> list[int]:
        return [i for c in needed_columns(self.specs) if c not in f.partition_names for i in f.leaves(c)]

    def _start(self, f: SourceFile, groups, leaves, footer: bool) -> Job:
        ranges = [r for g in groups for r in column_ranges(f.metadata, g, g + 1, leaves)]
        if footer:  # for libcudf, which reads the file itself: magic, page indexes and footer
            meta = f.metadata
            data_end = max((e for g in range(meta.num_row_groups)
                            for _, e in column_ranges(meta, g, g + 1, range(meta.num_columns))), default=4)
            ranges += [(0, 4), (min(data_end, f.size - meta.serialized_size - 8), f.size)]

        def unchanged() -> None:
            size, mtime, tag = f.store.identity(f.key)
            if not same_version((f.size, f.mtime_ns, f.tag), (size, mtime, tag)):
                raise SourceError(f"{f.path} changed after the dataset was opened (size {f.size:,} -> {size:,}, "
                                  f"version {f.tag or '-'} -> {tag or '-'}, last modified {f.mtime_ns} -> {mtime} "
                                  "ns); open the dataset again to pick up the new object")

        return self._fetcher(f.store).start(f.key, ranges, check=unchanged)

    def warm(self, i: int) -> bool:
        """Start fetching remote chunk ``i``'s column ranges ahead of its decoding (nothing for
        a local or cached chunk). False when the read-ahead budget is spent: call again later."""
        c = self.chunks[i]
        f = self.files[c.file]
        if not f.remote:
            return True
        k = (c.file, c.rg_start, c.rg_stop)
        with self._lock:
            if k in self._ahead:
                return True
            if self._ahead and self._ahead_bytes >= self.remote.readahead_bytes:
                return False
        if self.cache.exists(self.key(i)):
            return True
        job = self._start(f, range(c.rg_start, c.rg_stop), self._leaves(f), self._footer_ranges)
        with self._lock:
            self._ahead[k] = job
            self._ahead_bytes += job.nbytes
        return True

    def _take_ahead(self, k: tuple) -> Job | None:
        """The fetch started ahead for chunk key ``k`` (file, rg start, rg stop), now no longer ahead."""
        with self._lock:
            job = self._ahead.pop(k, None)
            if job is not None:
                self._ahead_bytes -= job.nbytes
        return job

    def _drop_ahead(self, k: tuple) -> None:
        job = self._take_ahead(k)
        if job is not None:
            job.cancel()

    def forget_ahead(self) -> None:
        """Drop the fetches started ahead that were not used (an epoch left early)."""
        with self._lock:
            jobs, self._ahead, self._ahead_bytes = list(self._ahead.values()), {}, 0
        for job in jobs:
            job.cancel()

    def fetch(self, f: SourceFile, chunk: Chunk, leaves, footer: bool = False) -> RangeFile:
        """The decoders' hook: a readable file of remote ``f`` holding the chunk's column
        chunks of ``leaves`` (and, for libcudf, its magic and footer), from the fetch started
        ahead (which covers every leaf the decoders ask for, and the footer whenever the GPU
        decoder is in use) or fetched now; the wait is timed as a ``read`` span."""
        job = self._take_ahead((chunk.file, chunk.rg_start, chunk.rg_stop))
        if job is not None:
            with self._lock:
                self.ahead_used += 1
        else:
            job = self._start(f, range(chunk.rg_start, chunk.rg_stop), leaves, footer)
        m = self.metrics
        t0 = m.clock() if m is not None else 0.0
        fetcher = self._fetcher(f.store)
        out = RangeFile(f.path, f.size, job.result(), lambda a, b: fetcher.get(f.key, a, b))
        if m is not None:
            m.record("read", t0, m.clock(), nbytes=sum(len(b) for b in out.parts.values()))
        return out

    def remote_stats(self) -> RemoteStats | None:
        """Requests made to remote stores since open or :meth:`reset_remote` (None: no remote file)."""
        if not self.has_remote:
            return None
        with self._lock:
            all_stats = [f.stats() for f in self._fetchers.values()]
        if not all_stats:
            return RemoteStats(0, 0, 0, 0, None, None, None)
        if len(all_stats) == 1:
            return all_stats[0]
        best = max(all_stats, key=lambda s: s.requests)  # percentiles of the busiest store
        return RemoteStats(sum(s.requests for s in all_stats), sum(s.bytes for s in all_stats),
                           sum(s.retried for s in all_stats), sum(s.failed for s in all_stats),
                           best.latency_p50_s, best.latency_p90_s, best.latency_p99_s)

    def reset_remote(self) -> None:
        self._each_fetcher("reset")

    def _each_fetcher(self, call: str) -> None:
        with self._lock:
            fetchers = list(self._fetchers.values())
        for f in fetchers:
            getattr(f, call)()

    def interrupt(self) -> None:
        """Abandon remote fetches in flight and queued, and refuse new ones until :meth:`resume`
        (an epoch left early: its loads must not wait on a stalled store)."""
        self.forget_ahead()
        self._each_fetcher("interrupt")

    def resume(self) -> None:
        """Fetch again after :meth:`interrupt` or :meth:`close` (an epoch begins)."""
        self._each_fetcher("resume")

    def close(self) -> None:
        """:meth:`interrupt`, and close the stores' open files."""
        self.forget_ahead()
        self._each_fetcher("close")


def open_reader(source: Source, options: Options, metrics=None, *, scan_nulls: bool = True) -> ChunkReader:
    """Open ``source`` under ``options``: the device chosen and opened
    (:func:`gpuload.device.open_device`), then the files listed, checked and planned into
    chunks (:class:`ChunkReader`). ``scan_nulls=False``: the null checks that read column
    data are left out (a cluster worker: its caller checked these very files)."""
    return ChunkReader(source, options, open_device(options, metrics), metrics, scan_nulls=scan_nulls)
