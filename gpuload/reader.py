"""Reader: an opened dataset's chunks, each loaded from the cache or decoded once.

:class:`ChunkReader` is what the pipeline calls to get a chunk's column set. It holds
the listed files, the resolved outputs, the chunk plan and the cache, and routes every
chunk load through the cache: read it if cached, else decode, convert and write it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from .cache import ChunkCache, ChunkKey
from .cachefile import spec_hash
from .checks import check_casts, check_consistent, check_nulls
from .config import Options
from .decode import ArrowDecoder
from .memory import HostPool
from .plan import Chunk, make_chunks
from .schema import OutputSpec, desc_outputs, resolve_outputs, spec_description
from .source import SourceFile, common_columns, fingerprint, list_files, open_files, row_group_sizes

log = logging.getLogger("gpuload")

__all__ = ["ChunkReader", "LoadCounters"]


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
    subclasses of :mod:`gpuload.source`, :mod:`gpuload.schema` and :mod:`gpuload.checks`.
    """

    def __init__(self, source, opts: Options, columns=None, fill_nulls=None, dtypes=None,
                 decoder: Callable | None = None, ctx=None, gpu_decode: bool = False, metrics=None):
        self.opts = opts
        self.files: list[SourceFile] = open_files(list_files(source))
        first = self.files[0]
        schema = first.schema
        if columns is None:  # the columns every file has, whatever the files' order
            schema, left_out = common_columns(self.files)
            if left_out:
                log.warning("gpuload: columns=None: leaving out %s (not in every file); name columns to load "
                            "only what every file has, or fix the files", ", ".join(left_out))
        self.specs: list[OutputSpec] = resolve_outputs(schema, columns, fill_nulls, dtypes, file=first.path)
        check_consistent(self.files, self.specs)
        check_casts(self.files, self.specs)
        self.spec_desc = spec_description(self.specs)
        self.spec_hash = spec_hash(self.spec_desc)
        self._outputs = desc_outputs(self.spec_desc)
        self.chunks: list[Chunk] = make_chunks([row_group_sizes(f, self.specs) for f in self.files],
                                               opts.chunk_bytes)
        self.num_rows = sum(c.rows for c in self.chunks)
        self.fingerprint = fingerprint(self.files)
        self.pool = HostPool(max_buffers=4 * len(self.specs) + 4)  # shuffle windows: 2 per output
        self.read_pool = HostPool(max_buffers=opts.shuffle_window + opts.prefetch + opts.num_threads + 2)
        self.ctx = ctx
        self.metrics = metrics
        if ctx is None:
            self.cache = ChunkCache(opts.cache_dir, opts.max_cache_bytes, opts.verify_checksums, metrics=metrics,
                                    alloc=self.read_pool.get)
            self.decode = decoder or ArrowDecoder(metrics)
        else:  # GPU path: chunks live in device memory (see gpuload.gpu)
            from .cache_gpu import read_chunk_device
            from .decode import GpuDecoder

            self.cache = ChunkCache(opts.cache_dir, opts.max_cache_bytes, opts.verify_checksums,
                                    read=lambda fd, p, want, verify, seen: read_chunk_device(fd, p, want, ctx, verify,
                                                                                              seen),
                                    to_host=ctx.to_host, trust_writes=True, metrics=metrics)
            cpu = decoder or ArrowDecoder(metrics)
            self.decode = GpuDecoder(ctx, cpu, metrics) if gpu_decode else cpu
        self.cached_at_open = {i for i in range(len(self.chunks)) if self.cache.exists(self.key(i))}
        cached = {(self.chunks[i].file, g) for i in self.cached_at_open
                  for g in range(self.chunks[i].rg_start, self.chunks[i].rg_stop)}
        check_nulls(self.files, self.specs, cached=lambda f, g: (f, g) in cached)
        self.cache.touch_spec(self.spec_hash, self.spec_desc)
        self.counters = LoadCounters()

    def key(self, i: int) -> ChunkKey:
        """Cache key of chunk ``i``."""
        c = self.chunks[i]
        f = self.files[c.file]
        return ChunkKey(f.path, f.size, f.mtime_ns, self.spec_hash, c.rg_start, c.rg_stop, c.rows, self._outputs,
                        self.spec_desc)

    def max_chunk_bytes(self) -> int:
        """Estimated converted bytes of the largest chunk."""
        return max((c.nbytes for c in self.chunks), default=0)

    def load(self, i: int) -> dict:
        """Column set of chunk ``i``: from the cache, else decoded (and cached if the budget allows).

        On the GPU path, call it inside ``ctx.active()``; the columns are then CuPy arrays.
        """
        c = self.chunks[i]
        f = self.files[c.file]

        def build():
            return self.decode(f, c, self.specs)

        # without shuffling, batches are views of the chunk: protect the cache writer from in-place changes
        cols, cached = self.cache.load(self.key(i), build, shared=not self.opts.shuffle)
        self.counters.add(cached)
        if self.ctx is not None:  # a chunk decoded on the CPU is cached from its host arrays, then sent once
            cols = self.ctx.upload(cols)
        return cols

    def is_cached(self, i: int) -> bool:
        """Whether chunk ``i`` has a file in the cache (not verified)."""
        return self.cache.exists(self.key(i))
