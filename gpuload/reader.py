"""Reader: an opened dataset's chunks, each loaded from the cache or decoded once.

:class:`ChunkReader` is what the pipeline calls to get a chunk's column set. It holds
the listed files, the resolved outputs, the chunk plan and the cache, and routes every
chunk load through the cache: read it if cached, else decode, convert and write it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from .cache import ChunkCache, ChunkKey
from .config import Options
from .decode import ArrowDecoder
from .memory import HostPool
from .plan import Chunk, make_chunks
from .schema import OutputSpec, resolve_outputs, spec_token
from .source import (SourceFile, check_consistent, check_null_stats, fingerprint, list_files, open_files,
                     row_group_sizes)

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

    Opening lists the files, reads their footers and checks the column selection; no
    column data is read. Raises the :class:`~gpuload.GpuloadError` subclasses of
    :mod:`gpuload.source` and :mod:`gpuload.schema` for bad input.
    """

    def __init__(self, source, opts: Options, columns=None, fill_nulls=None, dtypes=None,
                 decoder: Callable | None = None, ctx=None, gpu_decode: bool = False, metrics=None):
        self.opts = opts
        self.files: list[SourceFile] = open_files(list_files(source))
        first = self.files[0]
        self.specs: list[OutputSpec] = resolve_outputs(first.schema, columns, fill_nulls, dtypes, file=first.path)
        check_consistent(self.files, self.specs)
        check_null_stats(self.files, self.specs)
        self.spec_hash = xxhash.xxh64_hexdigest(spec_token(self.specs).encode())
        self.chunks: list[Chunk] = make_chunks([row_group_sizes(f, self.specs) for f in self.files],
                                               opts.chunk_bytes)
        self.num_rows = sum(c.rows for c in self.chunks)
        self.fingerprint = fingerprint(self.files)
        self.pool = HostPool(max_buffers=4 * len(self.specs) + 4)  # shuffle windows: 2 per output
        self.ctx = ctx
        self.metrics = metrics
        if ctx is None:
            self.cache = ChunkCache(opts.cache_dir, opts.max_cache_bytes, opts.verify_checksums, metrics=metrics)
            self.decode = decoder or ArrowDecoder(metrics)
        else:  # GPU path: chunks live in device memory (see gpuload.gpu)
            from .cache_gpu import read_chunk_device
            from .decode import GpuDecoder

            self.cache = ChunkCache(opts.cache_dir, opts.max_cache_bytes, opts.verify_checksums,
                                    read=lambda p, verify, seen: read_chunk_device(p, ctx, verify, seen),
                                    to_host=ctx.to_host, trust_writes=True, metrics=metrics)
            cpu = decoder or ArrowDecoder(metrics)
            self.decode = GpuDecoder(ctx, cpu, metrics) if gpu_decode else cpu
        self.counters = LoadCounters()

    def key(self, i: int) -> ChunkKey:
        """Cache key of chunk ``i``."""
        c = self.chunks[i]
        f = self.files[c.file]
        return ChunkKey(f.path, f.version, self.spec_hash, c.rg_start, c.rg_stop)

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
            cols = self.decode(f, c, self.specs)
            return cols, {"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns,
                          "row_groups": [c.rg_start, c.rg_stop], "built": time.time()}

        # without shuffling, batches are views of the chunk: protect the cache writer from in-place changes
        cols, cached = self.cache.load(self.key(i), build, shared=not self.opts.shuffle)
        self.counters.add(cached)
        if self.ctx is not None:  # a chunk decoded on the CPU is cached from its host arrays, then sent once
            cols = self.ctx.upload(cols)
        return cols

    def is_cached(self, i: int) -> bool:
        """Whether chunk ``i`` has a file in the cache (not verified)."""
        return self.cache.path(self.key(i)).exists()
