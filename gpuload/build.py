"""Build: fill the cache ahead of training (``build_cache``, ``gpuload cache build``)."""

from __future__ import annotations

import dataclasses
import errno
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .cluster import build_on_cluster
from .config import BUILD_DEVICE, Options, Source
from .errors import CacheError, ConfigError, flag, setting
from .memory import size_text
from .reader import ChunkReader, open_reader

__all__ = ["build_cache", "CacheSummary"]


@dataclass(frozen=True)
class CacheSummary:
    """What :func:`build_cache` did. Sizes in bytes, time in seconds.

    ``files`` counts the files the chunks come from (a row filter may rule whole files out).
    Every chunk counts once: ``built`` (decoded and written by this build),
    ``already_cached`` (in the cache when this build looked), ``built_elsewhere``
    (written meanwhile by another build of the same cache, run at the same time), or
    ``not_cached`` (decoded but not written: ``over_budget`` of them did not fit the budget
    (``max_cache_bytes``, or the folder's quota when ``quota``), ``over_reserve`` would have left
    less free disk than caches keep (:mod:`gpuload.cache.space`), and ``held`` of them were
    locked by another process for over a minute).
    A chunk that could not be written for another reason fails the build
    (:class:`~gpuload.CacheError` naming the reason), so it is never in a summary.
    """

    cache_dir: str
    files: int
    rows: int
    chunks: int
    built: int
    already_cached: int
    not_cached: int
    cached_bytes: int
    seconds: float
    outputs: tuple[str, ...]
    built_elsewhere: int = 0
    over_budget: int = 0
    held: int = 0
    max_cache_bytes: int | None = None
    over_reserve: int = 0
    quota: bool = False  # the budget was the cache folder's quota (gpuload cache quota), not max_cache_bytes

    def __str__(self) -> str:
        elsewhere = f", {self.built_elsewhere} built meanwhile by another build" if self.built_elsewhere else ""
        text = (f"{self.chunks} chunks ({self.rows:,} rows) from {self.files} files: {self.built} built, "
                f"{self.already_cached} already cached{elsewhere}; {size_text(self.cached_bytes)} in {self.cache_dir} "
                f"({self.seconds:.1f} s)")
        if self.over_budget:
            budget = (f"the cache folder's quota of {size_text(self.max_cache_bytes)}" if self.quota else
                      setting('max_cache_bytes', self.max_cache_bytes))
            text += f"; {self.over_budget} chunks did not fit {budget} and will be read from Parquet"
        if self.over_reserve:
            text += (f"; {self.over_reserve} chunks would have left less free disk than caches keep for other jobs "
                     "($GPULOAD_CACHE_RESERVE) and will be read from Parquet")
        if self.held:
            text += (f"; {self.held} chunks were locked by another process for over a minute and are not cached "
                     "(build again once it is done)")
        return text


def _tally(outcomes: list, at_open) -> tuple[dict, list]:
    """Counts of what became of each chunk, and the failures: ``outcomes`` holds
    ``(chunk, outcome)``, outcome as :attr:`gpuload.cache.store.ChunkCache.outcomes` says it
    (an ``OSError`` or its ``(errno, text, path)``), plus ``"ours"`` for a chunk this build wrote
    before a worker was lost; ``at_open(chunk)``: it was cached when this build looked first."""
    n = dict(built=0, already_cached=0, built_elsewhere=0, over_budget=0, held=0, over_reserve=0)
    failed = []
    for i, outcome in outcomes:
        if outcome in ("written", "ours"):
            n["built"] += 1
        elif outcome == "cached" and at_open(i):
            n["already_cached"] += 1
        elif outcome in ("cached", "other"):
            n["built_elsewhere"] += 1
        elif outcome == "budget":
            n["over_budget"] += 1
        elif outcome == "held":
            n["held"] += 1
        elif outcome == "reserve":
            n["over_reserve"] += 1
        else:
            failed.append((i, outcome))
    return n, failed


def _unwritable(cache_dir: str, failed: list, counts: dict, chunks: int, path_of) -> CacheError:
    """The error of a build whose chunk files could not be written: the first reason, where."""
    i, e = failed[0]
    if isinstance(e, OSError):
        e = (e.errno, e.strerror or str(e), e.filename)
    code, text, path = e
    path = path if path and not isinstance(failed[0][1], OSError) else path_of(i)  # a worker's: its own path
    cached = counts["built"] + counts["already_cached"] + counts["built_elsewhere"]
    name = errno.errorcode.get(code, "") if code else ""
    return CacheError(
        f"cannot write cache files in {cache_dir}: {text}{f' ({name})' if name else ''}, at {path}; "
        f"{cached} of {chunks} chunks cached ({counts['built']} built, {counts['already_cached']} already there); "
        f"make the folder writable or free space on its disk, or pass another {flag('cache_dir')}")


def refuse_no_cache(cache_io: str) -> None:
    """A build with ``cache_io="off"`` (nothing cached) is refused, before anything is opened or started."""
    if cache_io == "off":
        raise ConfigError(f"{setting('cache_io', cache_io)} caches nothing, so there is no cache to build: leave it "
                          f"out (or pass 'auto', 'direct' or 'buffered')")


def build_cache(source, cache_dir=Options.cache_dir, columns=Source.columns, *, fill_nulls=Source.fill_nulls,
                dtypes=Source.dtypes, categorical=Source.categorical, transform=Source.transform, filters=Source.filters,
                chunk_bytes: int = Options.chunk_bytes, pack_files: bool = Options.pack_files,
                num_threads: int = Options.num_threads,
                max_cache_bytes: int | None = Options.max_cache_bytes, cache_io: str = Options.cache_io,
                progress: Callable[[int], None] | bool | None = None, device=BUILD_DEVICE, decode: str = Options.decode,
                filesystem=Source.filesystem, storage_options: dict | None = Source.storage_options,
                remote=Source.remote, client=None, nodes=None, seed: int = Options.seed, layout: str = Options.layout,
                shuffle: bool | str = Options.shuffle, block_rows: int = Options.block_rows) -> CacheSummary:
    """Convert ``source`` into the cache ahead of training; returns a :class:`CacheSummary`.

    Takes the same ``columns``, ``fill_nulls``, ``dtypes``, ``categorical``, ``transform``, ``chunk_bytes``,
    ``pack_files``, ``layout``
    and ``cache_io`` as :class:`ParquetDataset` (a dataset opened with the same values finds every chunk
    cached); ``shuffle="block"`` (with ``block_rows``) builds the row-permuted chunks that
    block shuffling reads, any other ``shuffle`` the plain ones. ``progress(n)`` is called with each finished chunk's row count
    (``progress=True``: a progress bar, a widget in Jupyter where ipywidgets is installed,
    text elsewhere). Safe to
    run from several processes at once: each chunk is built once. ``device`` (default
    ``"cpu"``; ``"cuda"`` or ``"auto"`` to decode with cuDF) and ``decode`` mean what
    they mean for :class:`ParquetDataset`; the files are the same either way. A remote
    ``source`` (with ``filesystem``, ``storage_options`` and ``remote`` as for
    :class:`ParquetDataset`) is fetched ahead of decoding, column ranges only.

    ``client``: a ``distributed.Client`` (``gpuload[dask]``; on GPU nodes a
    ``dask_cuda.LocalCUDACluster``'s, with ``device="cuda"``) whose workers build the
    chunks, one task each (:mod:`gpuload.cluster`); ``num_threads`` then applies per worker.
    With ``nodes`` (a number of hosts, numbered in sorted host order, or a list of each
    node's worker names, hosts or addresses) each chunk is built on the node that owns it
    under ``ParquetDataset(shard="node", seed=seed)`` with that many nodes, node ``n``
    being the training's ``GROUP_RANK`` ``n``: give each node's workers its local
    ``cache_dir`` (``None``: each worker's ``$GPULOAD_CACHE_DIR``). A node's workers
    restarted on other ports (a nanny, a job scheduler) are found again by host or name;
    a node left with no worker for 60 s fails the build, keeping what was built.
    """
    if nodes is not None and client is None:
        raise ConfigError("nodes= says where chunks are built on a cluster: pass client= too")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):  # else it fails after a chunk
        raise ConfigError(f"{setting('progress', progress)} must be True (a progress bar), False or None (none), or a "
                          "function progress(rows) called with each finished chunk's row count")
    if client is not None and not all(callable(getattr(client, m, None)) for m in ("submit", "scheduler_info")):
        raise ConfigError(f"client= is a {type(client).__name__}: pass a distributed.Client (pip install -e "
                          "'.[dask]'), or None to build in this process")
    refuse_no_cache(cache_io)
    given = dict(locals(), device=str(device))
    src, opts = Source.of(given), Options.of(given)
    if nodes is not None:  # for shard="node", which never packs small files: the chunks it will ask for
        opts = dataclasses.replace(opts, pack_files=False)
    # with a cluster this process only lists the source: the workers decode, on their own devices
    reader = open_reader(src, opts if client is None else dataclasses.replace(opts, device="cpu"), building=True)
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=reader.num_rows, unit="row", unit_scale=True, desc="building cache")
        progress = bar.update
    elif progress is False:  # no progress reports
        progress = None
    try:
        return _build(reader, src, opts, progress, client, nodes, explicit_dir=cache_dir is not None)
    finally:
        if bar is not None:
            bar.close()


def _build(reader: ChunkReader, src: Source, opts: Options, progress, client, nodes,
           explicit_dir: bool) -> CacheSummary:
    """build_cache's work on an opened reader: on ``client``'s workers (which open ``src``
    under ``opts`` themselves), else on threads here; ``explicit_dir``: ``cache_dir`` was
    given (on a cluster: one folder every worker shares, unless ``nodes``). Raises
    :class:`CacheError` when chunk files could not be written (the reason, where)."""
    t0 = time.perf_counter()
    n = len(reader.chunks)
    at_open = set(reader.cached_at_open)
    shared = client is None or (explicit_dir and nodes is None)  # one cache, seen from here too
    where = opts.cache_where if shared else f"{opts.cache_where} on each node" if explicit_dir else \
        "each worker's $GPULOAD_CACHE_DIR"  # nodes= with cache_dir: that folder, on each node's own disk
    todo = [i for i in range(n) if i not in at_open]
    if todo and shared:  # a cache this build cannot write fails now, not after decoding everything
        try:
            reader.cache.probe(reader.key(todo[0]))
        except OSError as e:
            reader.close()
            raise _unwritable(where, [(todo[0], e)], dict(built=0, already_cached=len(at_open), built_elsewhere=0),
                              n, lambda i: reader.cache.path(reader.key(i))) from None
    if client is not None:
        outcomes, found, sizes = _on_cluster(reader, src, opts, progress, client, nodes, shared, explicit_dir)
    else:
        outcomes, found, sizes = _here(reader, opts, progress)
    counts, failed = _tally(outcomes, found)
    if failed:
        raise _unwritable(where, failed, counts, n, lambda i: reader.cache.path(reader.key(i)) if shared
                          else f"chunk {i} on a worker")
    return CacheSummary(
        cache_dir=reader.cache.where if shared else where, files=len({p.file for c in reader.chunks for p in c.pieces}),
        rows=reader.num_rows, chunks=n,
        not_cached=n - counts["built"] - counts["already_cached"] - counts["built_elsewhere"],
        cached_bytes=sum(sizes), seconds=time.perf_counter() - t0, outputs=tuple(s.name for s in reader.outputs),
        max_cache_bytes=reader.cache.max_bytes, quota=opts.max_cache_bytes is None and reader.cache.max_bytes is not None,
        **counts)


def _on_cluster(reader: ChunkReader, src: Source, opts: Options, progress, client, nodes, shared: bool,
                explicit_dir: bool) -> tuple[list, Callable[[int], bool], list[int]]:
    """Every chunk built on ``client``'s workers: ``(chunk, outcome)`` pairs, whether a chunk
    was cached before this build, and the cache files' sizes."""
    started = time.time()
    try:
        done = build_on_cluster(client, src, opts, reader, progress, nodes=nodes, own_dirs=not explicit_dir)
    finally:
        reader.close()
    mtimes = {i: mtime for i, _, _, mtime in done}
    # node-local caches: as each worker found them (its file older than this build), not as seen from here
    at_open = set(reader.cached_at_open)
    found = at_open.__contains__ if shared else (lambda i: mtimes[i] is not None and mtimes[i] < started)
    return [(i, outcome) for i, outcome, _, _ in done], found, [size for _, _, size, _ in done if size is not None]


def _here(reader: ChunkReader, opts: Options, progress) -> tuple[list, Callable[[int], bool], list[int]]:
    """Every chunk built on ``opts.num_threads`` threads of this process (remote chunks
    fetched ahead while others decode); what :func:`_on_cluster` returns."""
    n = len(reader.chunks)
    reader.cache.outcomes = {}

    def one(i: int) -> None:
        with reader.device.reading():
            reader.build(i, check=True)  # cached files are read and verified; corrupt ones rebuilt
        if progress is not None:
            progress(reader.chunks[i].rows)

    try:
        with ThreadPoolExecutor(max_workers=opts.num_threads, thread_name_prefix="gpuload-build") as pool:
            futures: deque = deque()
            submitted, warmed = 0, 0
            while submitted < n or futures:
                while submitted < n and len(futures) < 2 * opts.num_threads:
                    futures.append(pool.submit(one, submitted))
                    submitted += 1
                warmed = max(warmed, submitted)  # remote: fetch the next chunks while these decode
                while reader.has_remote and warmed < n and reader.warm(warmed):
                    warmed += 1
                futures.popleft().result()
    finally:
        reader.close()
    reader.cache.flush()
    recorded = reader.cache.outcomes
    outcomes = [(i, recorded.get(reader.key(i).relpath(), "cached")) for i in range(n)]
    stats = [reader.cached_file(i) for i, outcome in outcomes if outcome in ("written", "cached", "other")]
    return outcomes, set(reader.cached_at_open).__contains__, [st.st_size for st in stats if st is not None]
