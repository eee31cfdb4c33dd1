"""Build: fill the cache ahead of training (``build_cache``, ``gpuload cache build``)."""

from __future__ import annotations

import contextlib
import errno
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .cluster import build_on_cluster
from .config import Options
from .errors import CacheError, ConfigError, flag, setting
from .gpu.runtime import open_device
from .handoff import resolve_device
from .reader import ChunkReader

__all__ = ["build_cache", "CacheSummary"]


@dataclass(frozen=True)
class CacheSummary:
    """What :func:`build_cache` did. Sizes in bytes, time in seconds.

    Every chunk counts once: ``built`` (decoded and written by this build),
    ``already_cached`` (in the cache when this build looked), ``built_elsewhere``
    (written meanwhile by another build of the same cache, run at the same time), or
    ``not_cached`` (decoded but not written: ``over_budget`` of them did not fit
    ``max_cache_bytes``; ``held`` of them were locked by another process for over a minute).
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

    def __str__(self) -> str:
        gib = self.cached_bytes / 2**30
        elsewhere = f", {self.built_elsewhere} built meanwhile by another build" if self.built_elsewhere else ""
        text = (f"{self.chunks} chunks of {self.rows:,} rows from {self.files} files: {self.built} built, "
                f"{self.already_cached} already cached{elsewhere}; {gib:.2f} GiB in {self.cache_dir} "
                f"({self.seconds:.1f} s)")
        if self.over_budget:
            text += (f"; {self.over_budget} chunks did not fit {setting('max_cache_bytes', self.max_cache_bytes)} "
                     "and will be read from Parquet")
        if self.held:
            text += (f"; {self.held} chunks were locked by another process for over a minute and are not cached "
                     "(build again once it is done)")
        return text


_UNSET = object()


def _tally(outcomes: list, at_open) -> tuple[dict, list]:
    """Counts of what became of each chunk, and the failures: ``outcomes`` holds
    ``(chunk, outcome)``, outcome as :attr:`gpuload.cache.store.ChunkCache.outcomes` says it
    (an ``OSError`` or its ``(errno, text, path)``), plus ``"ours"`` for a chunk this build wrote
    before a worker was lost; ``at_open(chunk)``: it was cached when this build looked first."""
    n = dict(built=0, already_cached=0, built_elsewhere=0, over_budget=0, held=0)
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


def build_cache(source, cache_dir=None, columns=None, *, fill_nulls=None, dtypes=None, chunk_bytes: int = 64 << 20,
                num_threads: int = 2, max_cache_bytes: int | None = None,
                progress: Callable[[int], None] | bool | None = None, device="cpu", decode: str = "auto",
                filesystem=None, storage_options: dict | None = None, remote=None, client=None, nodes=None,
                seed: int = 0, layout: str = "rows", shuffle=True, block_rows: int = 256) -> CacheSummary:
    """Convert ``source`` into the cache ahead of training; returns a :class:`CacheSummary`.

    Takes the same ``columns``, ``fill_nulls``, ``dtypes``, ``chunk_bytes`` and ``layout``
    as :class:`ParquetDataset` (a dataset opened with the same values finds every chunk
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
    ``cache_dir`` (``None``: each worker's ``$GPULOAD_CACHE_DIR``).
    """
    if nodes is not None and client is None:
        raise ConfigError("nodes= says where chunks are built on a cluster: pass client= too")
    _, block = Options.shuffle_mode(shuffle, block_rows)
    opts = Options(cache_dir=cache_dir, chunk_bytes=chunk_bytes, num_threads=num_threads,
                   max_cache_bytes=max_cache_bytes, device=str(device), decode=decode, layout=layout,
                   block_rows=block)
    # with a cluster this process only lists the source: the workers decode, on their own devices
    ctx, gpu_decode = open_device(resolve_device("cpu" if client is not None else device), opts)
    reader = ChunkReader(source, opts, columns, fill_nulls, dtypes, ctx=ctx, gpu_decode=gpu_decode,
                         filesystem=filesystem, storage_options=storage_options, remote=remote)
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=reader.num_rows, unit="row", unit_scale=True, desc="building cache")
        progress = bar.update
    try:
        return _build(reader, opts, ctx, progress, client, nodes, seed,
                      spec={"source": source, "columns": columns, "fill_nulls": fill_nulls, "dtypes": dtypes,
                            "filesystem": filesystem, "storage_options": storage_options, "remote": remote,
                            "options": {"cache_dir": cache_dir, "chunk_bytes": chunk_bytes,
                                        "num_threads": num_threads, "max_cache_bytes": max_cache_bytes,
                                        "device": str(device), "decode": decode, "layout": layout,
                                        "block_rows": block}})
    finally:
        if bar is not None:
            bar.close()


def _build(reader: ChunkReader, opts: Options, ctx, progress, client, nodes, seed: int, spec: dict) -> CacheSummary:
    """build_cache's work on an opened reader: on ``client``'s workers, else on threads here.
    Raises :class:`CacheError` when chunk files could not be written (the reason, where)."""
    enter = contextlib.nullcontext if ctx is None else ctx.reading
    cache_dir = spec["options"]["cache_dir"]
    t0 = time.perf_counter()
    n = len(reader.chunks)
    at_open = set(reader.cached_at_open)
    shared = client is None or (cache_dir is not None and nodes is None)  # one cache, seen from here too
    where = str(opts.cache_dir) if shared else "each worker's $GPULOAD_CACHE_DIR"
    todo = [i for i in range(n) if i not in at_open]
    if todo and shared:  # a cache this build cannot write fails now, not after decoding everything
        try:
            reader.cache.probe(reader.key(todo[0]))
        except OSError as e:
            reader.close()
            raise _unwritable(where, [(todo[0], e)], dict(built=0, already_cached=len(at_open), built_elsewhere=0),
                              n, lambda i: reader.cache.path(reader.key(i))) from None
    if client is not None:
        started = time.time()
        try:
            done = build_on_cluster(client, spec, reader, progress, nodes=nodes, seed=seed)
        finally:
            reader.close()
        mtimes = {i: mtime for i, _, _, mtime in done}
        # node-local caches: as each worker found them (its file older than this build), not as seen from here
        found = at_open.__contains__ if shared else (lambda i: mtimes[i] is not None and mtimes[i] < started)
        outcomes = [(i, outcome) for i, outcome, _, _ in done]
        sizes = [size for _, _, size, _ in done if size is not None]
    else:
        reader.cache.outcomes = {}

        def one(i: int) -> None:
            with enter():
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
        found = at_open.__contains__
        sizes = []
        for i, outcome in outcomes:
            k = reader.key(i)
            with contextlib.suppress(OSError):  # a folder gpuload cannot read, or a link: not cached
                st = reader.cache.root.lstat(k.parts, k.name)
                if st is not None and stat.S_ISREG(st.st_mode) and outcome in ("written", "cached", "other"):
                    sizes.append(st.st_size)
    counts, failed = _tally(outcomes, found)
    if failed:
        raise _unwritable(where, failed, counts, n, lambda i: reader.cache.path(reader.key(i)) if shared
                          else f"chunk {i} on a worker")
    return CacheSummary(
        cache_dir=where, files=len(reader.files), rows=reader.num_rows, chunks=n,
        not_cached=n - counts["built"] - counts["already_cached"] - counts["built_elsewhere"],
        cached_bytes=sum(sizes), seconds=time.perf_counter() - t0, outputs=tuple(s.name for s in reader.specs),
        max_cache_bytes=opts.max_cache_bytes, **counts)
