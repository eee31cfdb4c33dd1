"""Reader: an opened dataset's chunks, each loaded from the cache or decoded once.

:func:`open_reader` opens a :class:`gpuload.config.Source` under its
:class:`gpuload.config.Options`: the device, the files (listed, footers read and checked),
the outputs, the chunks. :class:`ChunkReader` is then what the pipeline and the builders
call for a chunk: its one job is to route every load through the cache, reading the
chunk if cached, else making it as the cache stores it (decoded, packed into the
layout's blocks, rows permuted for block shuffling) and writing it; with
``cache_io="off"``, making it at every load and writing nothing. Remote chunks'
bytes come through the read-ahead (:class:`gpuload.sources.readahead.ReadAhead`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from typing import Callable


from .batch import RUN_ROWS, permute_rows
from .cache.paths import ChunkKey
from .cache.space import warn_short_room
from .cache.chunkfile import header_bound, spec_hash
from .checks import check_casts, check_nulls, check_partition_keys, files_text
from .drift import absent_as_nulls, check_consistent, check_units, unit_drift, widened
from .config import Options, Source, warn_settings, warn_small_windows, window_chunks
from .errors import ConfigError, SourceError, flag
from .convert import needed_columns
from .counting import counted, kept_groups
from .decode import ArrowDecoder
from .device import Device, open_device
from .sources.settings import RemoteStats
from .sources.readahead import ReadAhead
from .observe.stats import LoadCounters
from .memory import HostBudget, HostPool, cache_io_modes, device_bound, file_bytes, host_budget, reads_limited
from .layout import Layout, joined, merge_pieces, spec_description, stored_outputs
from .packs import members, pack_name, pack_small
from .plan import Chunk, chunk_row_permutation, make_chunks
from .schema import OutputSpec, requested_columns, resolve_outputs
from .transforms import apply_transform, transform_outputs
from .sources.listing import SourceFile, all_columns, common_columns, fingerprint, list_files, row_group_sizes
from .sources.offline import Offline, check_offline, warn_offline
from .sources.opening import open_files

log = logging.getLogger("gpuload")

__all__ = ["ChunkReader", "open_reader"]


class ChunkReader:
    """The chunks of ``source`` under ``opts``, and how to load each one.

    Opening lists the files, reads their footers and runs the checks of
    :mod:`gpuload.checks`; column data is read only where the footers cannot rule out
    nulls, and never for cached chunks. Raises the :class:`~gpuload.GpuloadError`
    subclasses of :mod:`gpuload.sources.listing`, :mod:`gpuload.schema` and :mod:`gpuload.checks`.
    """

    def __init__(self, source: Source, opts: Options, device: Device, metrics=None, decoder: Callable | None = None,
                 scan_nulls: bool = True, record: bool = True, building: bool = False):
        self.source, self.opts, self.device, self.metrics = source, opts, device, metrics
        self.remote = source.remote
        self._loading = threading.BoundedSemaphore(opts.num_threads)  # loads at once (:meth:`load`)
        self.remote_reads = ReadAhead(source.remote, metrics)  #: remote chunks' fetches (a local source makes none)
        self.read_pool = HostPool()  # its caps: _make_pools, once the chunks' arrays are known
        self.cache = device.cache(opts, metrics, self.read_pool)  # on a GPU, chunks are read into device memory
        self.open_counts: dict[str, int] = {}  # footers_cached / footers_read at open
        offline: list[Offline] = []  # remote items listed from the cache: their store cannot be reached
        self.files: list[SourceFile] = open_files(
            list_files(source.source, source.filesystem, source.storage_options, self.remote,
                       None if opts.cache_io == "off" else self.cache.root, offline),
            self.cache.root, self.remote_reads.fetcher, self.open_counts)
        self.has_remote = any(f.remote for f in self.files)  #: some file is a remote object
        #: the columns the row filter reads (its kept rows are counted over them, and Vocab columns' values)
        self.filter_columns: list[str] = [] if source.filters is None else \
            source.filters.columns(all_columns(self.files))
        # a selected column some files lack (added later) is nulls there, as a null Hive key is
        self.files = absent_as_nulls(self.files, requested_columns(source.columns) + self.filter_columns)
        self.specs: list[OutputSpec] = self._resolve_outputs()  #: what is decoded and converted
        t = source.transform
        #: what is cached and delivered: ``specs``, or what ``transform`` makes of them
        self.outputs: list[OutputSpec] = self.specs if t is None else transform_outputs(t, self.specs)
        flt = source.filters
        self._marks = {}  # in the cache key besides the outputs: the transform (its key and inputs), the filter
        if t is not None:
            self._marks["transform"] = {"key": t.key, "inputs": spec_hash(spec_description(self.specs))}
        if flt is not None:
            self._marks["filter"] = flt.key
            checked = sorted({k for f in self.files for k, _ in f.file_keys} & set(self.filter_columns))
            if checked:  # Hive keys the files store, which must hold their folders' values: not the file's alone
                self._marks["filter_keys"] = checked
        self._store_as(opts.stored_layout)
        warn_settings(opts)
        sizes = [row_group_sizes(f, self.specs, None if t is None else self.outputs) for f in self.files]
        if flt is not None:  # chunks hold the kept rows only
            sizes = self._filtered(sizes, flt)
        self.chunks: list[Chunk] = make_chunks(sizes, opts.chunk_bytes)
        if opts.packed:  # small files several to a chunk, its ends placed by each file's own name (gpuload.packs)
            self.chunks = pack_small(self.chunks, [pack_name(f) for f in self.files], opts.chunk_bytes)
            packed = [c for c in self.chunks if c.parts]
            log.debug("gpuload: %d small files packed into %d chunks", sum(len(c.parts) for c in packed), len(packed))
        if not self.chunks and flt is not None:
            raise SourceError(f"{flag('filters')} {flt.text} keeps no row of the {len(self.files)} files "
                              f"({sum(f.metadata.num_rows for f in self.files):,} rows); loosen the filter")
        if not self.chunks:  # every file is empty: say which (a dataset of no rows has no epochs)
            many = len(self.files) > 1
            raise SourceError(f"the {len(self.files)} file{'s' if many else ''} of the source hold{'' if many else 's'} "
                              f"no rows {files_text([str(f.path) for f in self.files])}: check that it names the "
                              f"files you mean")
        largest = self.max_chunk_bytes()
        warn_small_windows(opts, [c.rows for c in self.chunks], largest)
        #: the settings, with the shuffle window's chunks as chosen for these chunks (:func:`window_chunks`)
        self.opts = opts = dataclasses.replace(opts, shuffle_window=window_chunks(opts, len(self.chunks), largest))
        if opts.layout == "auto" and self.stored_layout == "columns" and opts.cache_io != "off":
            self._reuse_rows()
        self.num_rows = sum(c.rows for c in self.chunks)
        self.fingerprint = fingerprint(self.files)
        #: arrays per stored chunk
        self.arrays_per_chunk = len(self._outputs) + sum(1 for s in self.outputs if s.kind == "ragged")
        self._make_pools()
        # chunk files written and read around the page cache or through it (``cache_io``)
        header = header_bound(self.spec_desc, self.arrays_per_chunk, max((f.path for f in self.files), key=len))
        files = [file_bytes(c.nbytes, self.arrays_per_chunk, header + self._members_bytes(c))  # each chunk's cache file
                 for c in self.chunks]
        modes = cache_io_modes(opts.cache_io, min(sum(files), opts.max_cache_bytes or sum(files)),
                               host=device.on_host)
        self.cache.direct_writes, self.cache.direct_reads = modes.writes, modes.reads
        #: whether chunks go through the cache (``cache_io="off"``: every load decodes, nothing is written)
        self.caching = opts.cache_io != "off"
        #: whether the cache's reads turn buffered after a pass they limited (:meth:`pass_ended`)
        self.adapts_reads = modes.adapts and self.caching
        # flat outputs come as Pieces of their row groups, which `_stored` packs into the read pool's buffers
        self.decode = device.decoder(decoder or ArrowDecoder(metrics, fetch=self.remote_reads.fetch,
                                                             row_filter=flt, filter_columns=self.filter_columns,
                                                             alloc=self.read_pool.array, pieces=True,
                                                             buffer=self.source_pool.get),
                                     metrics)
        #: this dataset's chunk groups: kept from eviction while it is open (:mod:`gpuload.cache.evict`)
        self.groups = {(self.key(i).folder, self.spec_hash) for i in range(len(self.chunks))}
        self.cached_at_open = {i for i in range(len(self.chunks)) if self.is_cached(i)}
        if offline:  # opened without the store: only if the epochs will not need it (checked again once registered)
            check_offline(offline, len(self.chunks) - len(self.cached_at_open), len(self.chunks))
        scan = scan_nulls and flt is None  # else (a cluster worker: its caller checked these files; a filter:
        if scan:  # nulls in rows it drops do not count) conversion still refuses nulls, naming the chunk
            self._check_data()
        self._records = self.caching and record  # this reader's use is told to the cache (open_reader)
        if self._records:  # once the data is known to load: a refused open leaves no record
            self.cache.register(self.groups)
        if scan or offline:
            # a chunk the scan skipped as cached and that was evicted meanwhile is built again, from the very
            # row groups its key names (so they load): it counts as not cached at open
            self.cached_at_open = {i for i in self.cached_at_open if self.is_cached(i)}
        if offline:
            if len(self.cached_at_open) < len(self.chunks) and self._records:  # evicted before it was registered
                self.cache.release()
            check_offline(offline, len(self.chunks) - len(self.cached_at_open), len(self.chunks))
            warn_offline(offline)
        if self._records:  # the column set's record; a warning where the cache has room for part of it only
            self.cache.touch_spec(self.spec_hash, self.spec_desc)
            warn_short_room(self.cache, self.groups, files, opts.max_cache_bytes, opts.cache_where, building)
        self.counters = LoadCounters()

    def _filtered(self, sizes: list, flt) -> list:
        """``sizes`` (per file, per row group, (rows, bytes)) over the rows ``flt`` keeps: a row group
        with none becomes None (never read), the others their kept rows and as many bytes per row."""
        kept = kept_groups(self.files, flt, self.filter_columns, self.opts.num_threads, self.remote_reads.fetch,
                           self.cache.root)
        return [[(n, size * n // max(rows, 1)) if n else None for (rows, size), n in zip(groups, k)]
                for groups, k in zip(sizes, kept)]

    def _resolve_outputs(self) -> list[OutputSpec]:
        """The outputs of the source's ``columns``, ``fill_nulls`` and ``dtypes`` over the opened
        files, refused where the files' types disagree or a cast cannot hold their values."""
        src, first = self.source, self.files[0]
        schema = first.schema
        left_out = []
        if src.columns is None:  # the columns every file has, whatever the files' order
            schema, left_out = common_columns(self.files)
        # columns left out: said once the outputs resolve, else in their error (a command prints one line)
        why = (f"{', '.join(left_out)} left out: not in every file; name them in {flag('columns')} to read them as "
               f"nulls where they are missing, with {flag('fill_nulls')}")
        schema = widened(self.files, schema)  # int32 in one file and int64 in another: int64
        try:
            specs = resolve_outputs(schema, src.columns, src.fill_nulls, src.dtypes, file=first.path,
                                    int96=frozenset().union(*(f.int96 for f in self.files)),
                                    units=unit_drift(self.files, schema), categorical=src.categorical)
        except ConfigError as e:  # one naming a column left out (fill_nulls=, dtypes=, categorical=): say why
            if any(repr(c) in str(e) for c in left_out):
                raise ConfigError(f"{e}; {why}") from None
            raise
        if left_out:
            log.warning("gpuload: %s", why)
        check_consistent(self.files, specs, schema)
        check_units(self.files, specs)
        #: every Vocab column's vocabulary, and each one given whole (:func:`gpuload.counting.counted`)
        specs, self.vocabularies = counted(specs, self.files, self.cache.root, self.opts.num_threads,
                                           self.remote_reads.fetch, src.filters, self.filter_columns)
        check_casts(self.files, specs)
        return specs

    def _make_pools(self) -> None:
        """The host pools, each keeping at most its term of the host memory bound
        (:func:`gpuload.memory.host_budget`): cache reads, shuffle windows (2 per array),
        batches gathered or joined and blocks unpacked (queued, held by the consumer, being cut),
        and the Parquet bytes of the chunks being decoded."""
        o, stored, budget = self.opts, self.arrays_per_chunk, self.host_budget()
        # a block shuffle's windows are not joined (gpuload.batch.Parts): their chunks are held
        # instead, in the read pool, which keeps the windows' term too
        runs = o.block is not None and o.block > RUN_ROWS
        self.read_pool.max_bytes = budget.chunks + (budget.windows if runs else 0)
        # a cached chunk is one buffer (its file's span), a decoded one an array per stored array (and
        # with block shuffling as many again, permuted): a count of chunks alone would leave a first
        # epoch's arrays unkept, each chunk's in fresh pages, while the byte cap had room for them
        chunks = o.shuffle_window + o.prefetch + o.num_threads + 2 + (2 * o.shuffle_window if runs else 0)
        self.read_pool.max_buffers = chunks * ((2 if o.block is not None else 1) * stored + 1)
        self.pool = HostPool(max_buffers=4 * stored + 4, max_bytes=0 if runs else budget.windows)
        self.batch_pool = HostPool(max_buffers=(o.prefetch + 6 + o.num_threads) * (stored + len(self.layout.blocks)),
                                   max_bytes=budget.batches)
        # the Parquet bytes a loader thread reads for a chunk: at most a chunk's, part of its decode term
        self.source_pool = HostPool(max_buffers=8 * o.num_threads + 4, max_bytes=budget.decode // 3)

    def _check_data(self) -> None:
        """The checks that may read column data (nulls the footers cannot rule out, partition keys
        stored in files), skipping the row groups of chunks cached already."""
        cached = {(p.file, g) for i in self.cached_at_open for p in self.chunks[i].pieces
                  for g in range(p.rg_start, p.rg_stop)}
        check_nulls(self.files, self.specs, cached=lambda f, g: (f, g) in cached, threads=self.opts.num_threads)
        check_partition_keys(self.files, self.specs, cached=lambda f, g: (f, g) in cached)

    def _store_as(self, layout: str) -> None:
        """Store chunks in ``layout`` (``"rows"`` or ``"columns"``): the description of what is
        stored, its hash (in every chunk's key), the stored outputs and the :class:`Layout`."""
        self.stored_layout = layout
        self.spec_desc = [{**d, **self._marks} for d in spec_description(self.outputs, layout,
                                                                         permuted=self.opts.block is not None)]
        self.layout = Layout(self.spec_desc)
        self.spec_hash = spec_hash(self.spec_desc)
        self._outputs = stored_outputs(self.spec_desc)

    def _reuse_rows(self) -> None:
        """``layout="auto"`` stores columns where no row is gathered; where the cache holds more
        of this dataset's chunks as row blocks (built for a row shuffle, by ``gpuload cache
        build`` before it or meanwhile, or a node's share of them) than as columns, row blocks
        are read instead: the same batches, and only the chunks missing from that set decoded."""
        def cached() -> int:
            return sum(self.cache.exists(self.key(i)) for i in range(len(self.chunks)))

        columns = cached()
        self._store_as("rows")
        if cached() <= columns:
            self._store_as("columns")

    def key(self, i: int) -> ChunkKey:
        """Cache key of chunk ``i``."""
        c = self.chunks[i]
        f = self.files[c.file]
        return ChunkKey(f.path, f.size, f.mtime_ns, self.spec_hash, c.rg_start, c.rg_stop, c.rows, self._outputs,
                        self.spec_desc, f.tag, f.footer_version, members(self.files, c))

    def _members_bytes(self, c: Chunk) -> int:
        """What a pack's cache file header holds beyond a chunk of one file's: its files' names and versions."""
        return sum(len(json.dumps(self.files[p.file].path)) + len(self.files[p.file].tag) + 96 for p in c.parts)

    def where(self, i: int) -> str:
        """Chunk ``i`` in messages: its file and row groups, or a pack's first file and how many follow."""
        c = self.chunks[i]
        text = f"{self.files[c.file].path} (row groups {c.rg_start}-{c.rg_stop - 1})"
        return text if not c.parts else f"{text} and the {len(c.parts) - 1} small files packed with it"

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
                           remote=self.remote if self.has_remote else None, pending_writes=self.cache.pending_writes,
                           trace_bytes=self.metrics.max_trace_nbytes() if self.metrics is not None else 0)

    def device_bound(self) -> int:
        """What the GPU path of this dataset can hold in device memory at once (see
        :func:`gpuload.memory.device_bound`)."""
        o = self.opts
        return device_bound(self.max_chunk_bytes(), max((c.rows for c in self.chunks), default=0),
                            batch_size=o.batch_size, shuffle_window=o.shuffle_window, prefetch=o.prefetch,
                            num_threads=o.num_threads, gpu_decode=self.device.gpu_decode, shuffled=o.shuffled)

    def load(self, i: int) -> dict:
        """Column set of chunk ``i``: from the cache, else decoded (and cached if the budget allows).

        On the GPU path, call it inside ``device.reading()``; the columns are then CuPy arrays, ordered on the read stream.
        At most ``num_threads`` loads run at once, whichever threads ask (an epoch's loader threads,
        and the next epoch's preload while its last chunks load: :mod:`gpuload.preload`).
        """
        with self._loading:
            return self._load(i)

    def _load(self, i: int) -> dict:
        if not self.caching:  # cache_io="off": decoded every time, never written
            self.counters.add(False)
            return self.device.upload(self._stored(i))
        # without shuffling, batches are views of the chunk: protect the cache writer from in-place changes
        cols, cached = self.cache.load(self.key(i), lambda: self._stored(i), shared=not self.opts.shuffled)
        self.counters.add(cached)
        if cached:  # cached meanwhile (another rank or process): its fetches started ahead are not needed
            self._drop_ahead(i)
        return self.device.upload(cols)  # a chunk decoded on the CPU is cached from its host arrays, then sent once

    def build(self, i: int, check: bool = False) -> bool:
        """Make sure chunk ``i`` is in the cache, decoding it if it is not; True if this call
        decoded it. A chunk cached already is not read (``check=True``: it is read and
        verified, and rebuilt if corrupt); one cached by another process meanwhile is not
        decoded. What became of the file is in ``cache.outcomes`` when that is on.

        On the GPU path, call it inside ``device.reading()``.
        """
        if not check and self.is_cached(i):
            self.cache.note(self.key(i), "cached")
            cached = True
        else:
            _, cached = self.cache.load(self.key(i), lambda: self._stored(i), shared=False)
        self.counters.add(cached)
        if cached:  # a fetch started ahead is not needed
            self._drop_ahead(i)
        return not cached

    def _drop_ahead(self, i: int) -> None:
        """Cancel the fetches started ahead for chunk ``i``'s remote files (it was cached meanwhile)."""
        for p in self.chunks[i].pieces:
            if self.files[p.file].remote:
                self.remote_reads.drop(p)

    def _stored(self, i: int) -> dict:
        """Chunk ``i`` as the cache stores it: decoded from its source (:attr:`decode`), its
        outputs packed into the layout's blocks, and for block shuffling its rows permuted
        (once, here: :func:`gpuload.plan.chunk_row_permutation`)."""
        c = self.chunks[i]
        if i in self.cached_at_open:  # cached at open and made again: the cache was cleared meanwhile, and
            self.cache.touch_spec(self.spec_hash, self.spec_desc)  # with it the record of this column set
        try:
            if c.parts and self.has_remote:  # a pack's remote files: every request in flight before the first decodes
                self.warm(i, urgent=True)
            pack = getattr(self.decode, "pack", None)  # the CPU decoder converts a pack's files at once
            if c.parts and pack is not None:
                cols = pack(self.files, c.parts, self.specs)
            else:  # a pack's files decoded one by one (on a GPU), their rows one after another
                cols = merge_pieces([self.decode(self.files[p.file], p, self.specs) for p in c.pieces],
                                    self.read_pool.array)
        except BaseException:
            self._drop_ahead(i)  # a pack's files not decoded yet: their fetches are not needed
            raise
        if self.source.transform is not None:  # timed as conversion; it is given whole arrays
            with self.metrics.span("convert", rows=c.rows) if self.metrics is not None else contextlib.nullcontext():
                cols = apply_transform(self.source.transform, {k: joined(v) for k, v in cols.items()}, self.specs,
                                       self.outputs, self.where(i))
        # host blocks from the read pool: the first epoch's chunks reuse the pages of those cached
        # and joined before them (as cache reads do), instead of faulting in fresh ones
        cols = self.layout.pack(cols, self.read_pool.array)
        if self.opts.block is None:
            return cols
        return permute_rows(cols, chunk_row_permutation(  # wherever the files lie (as the order: its fingerprint)
            c.rows, ";".join(f"{self.files[p.file].size}:{self.files[p.file].tag or self.files[p.file].mtime_ns}:"
                             f"{p.rg_start}:{p.rg_stop}" for p in c.pieces)), self.read_pool.array)

    @property
    def cache_io(self) -> str:
        """How chunk files are written and read now: ``"direct"``, ``"buffered"`` (also after a file
        system refused direct I/O), ``"direct writes, buffered reads"`` (``"auto"`` after a pass
        its direct reads limited: :meth:`pass_ended`) or ``"off"`` (none are)."""
        if not self.caching:
            return "off"
        writes, reads = self.cache.direct_writes, self.cache.direct_reads
        return "direct" if writes and reads else "direct writes, buffered reads" if writes else "buffered"

    def pass_ended(self, wall: float, waited: float, read_busy: float) -> None:
        """A pass that read every chunk from the cache took the training thread ``wall`` seconds,
        ``waited`` of them inside ``next()`` after its first batch, while cache reads kept the
        loader threads busy ``read_busy`` seconds. With ``cache_io="auto"``, where its direct
        reads were the limit (:func:`gpuload.memory.reads_limited`: a disk slower than the
        epochs need), later reads go through the page cache, which keeps the files between
        epochs (only caches that fit in half the memory adapt)."""
        if self.adapts_reads and self.cache.direct_reads and reads_limited(wall, waited, read_busy):
            self.cache.direct_reads = False
            log.warning("gpuload: the cache's direct reads kept the step waiting %.0f%% of a %.2f s pass: later "
                     "passes read it through the page cache (cache_io='buffered' does from the start)",
                     100 * waited / wall, wall)

    def is_cached(self, i: int) -> bool:
        """Whether chunk ``i`` has a file in the cache (not verified; never with ``cache_io="off"``)."""
        return self.caching and self.cache.exists(self.key(i))

    def cached_file(self, i: int) -> os.stat_result | None:
        """The ``lstat`` of chunk ``i``'s cache file, None where it has none (a link, or a
        folder gpuload cannot read, counts as none)."""
        return self.cache.stat(self.key(i))

    # -- remote sources: the read-ahead (gpuload.sources.readahead) ---------------------------
    def _leaves(self, f: SourceFile) -> list[int]:
        """The Parquet leaf columns of ``f`` that the outputs read (partition keys are not in the file)."""
        wanted = dict.fromkeys(needed_columns(self.specs) + self.filter_columns)
        return [i for c in wanted if c not in f.partition_names for i in f.leaves(c)]

    def warm(self, i: int, urgent: bool = False) -> bool:
        """Start fetching remote chunk ``i``'s column ranges ahead of its decoding (nothing for
        a local or cached chunk). False when the read-ahead budget is spent: call again later.
        ``urgent``: whatever the budget, before what is queued ahead (default False)."""
        known: list[bool] = [False] if urgent else []  # urgent: about to be built; else looked for once a chunk

        def cached() -> bool:
            if not known:
                known.append(self.is_cached(i))
            return known[0]

        for p in self.chunks[i].pieces:
            f = self.files[p.file]
            if f.remote and not self.remote_reads.warm(f, p, self._leaves(f), self.device.gpu_decode, cached, urgent):
                return False  # a pack's files fetched ahead so far stay so: the next call goes on
        return True

    def forget_ahead(self) -> None:
        """Drop the fetches started ahead that were not used (an epoch left early)."""
        self.remote_reads.forget()

    def remote_stats(self) -> RemoteStats | None:
        """Requests made to remote stores since open or :meth:`reset_remote` (None: no remote file)."""
        return self.remote_reads.stats() if self.has_remote else None

    def reset_remote(self) -> None:
        self.remote_reads.reset()

    def interrupt(self) -> None:
        """Abandon remote fetches in flight and queued, and refuse new ones until :meth:`resume`
        (an epoch left early: its loads must not wait on a stalled store)."""
        self.remote_reads.interrupt()

    def resume(self) -> None:
        """Fetch again after :meth:`interrupt` or :meth:`close`, and date this dataset's use
        in the cache (an epoch begins)."""
        self.remote_reads.resume()
        if self._records:
            self.cache.register(self.groups)

    def close(self) -> None:
        """:meth:`interrupt`, close the stores' open files, let this dataset's chunks be evicted
        (:meth:`resume` registers them again), and :meth:`release_memory`."""
        self.remote_reads.close()
        if self.caching:
            self.cache.release()
        self.release_memory()

    def release_memory(self) -> None:
        """Give the host pools' buffers back (cache reads, windows, batches, Parquet bytes): those
        not in use now, the others when their users let go. A later epoch makes new ones, in
        fresh pages."""
        for pool in (self.read_pool, self.pool, self.batch_pool, self.source_pool):
            pool.clear()


def open_reader(source: Source, options: Options, metrics=None, *, scan_nulls: bool = True,
                record: bool = True, building: bool = False) -> ChunkReader:
    """Open ``source`` under ``options``: the device chosen and opened
    (:func:`gpuload.device.open_device`), then the files listed, checked and planned into
    chunks (:class:`ChunkReader`). ``scan_nulls=False``: the null checks that read column
    data are left out (a cluster worker: its caller checked these very files). ``record=False``:
    the cache is not told of this reader (no use of its column set dated, no reader's record:
    ``gpuload cache info SOURCE``, which loads nothing). ``building``: a cache build's (its warnings advise
    what a build can do)."""
    return ChunkReader(source, options, open_device(options, metrics), metrics, scan_nulls=scan_nulls, record=record,
                       building=building)
