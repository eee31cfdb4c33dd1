"""Build: fill the cache ahead of training (``build_cache``, ``gpuload cache build``)."""

from __future__ import annotations

import contextlib
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .cluster import build_on_cluster
from .config import Options
from .errors import ConfigError
from .gpu.runtime import open_device
from .handoff import resolve_device
from .reader import ChunkReader

__all__ = ["build_cache", "CacheSummary"]


@dataclass(frozen=True)
class CacheSummary:
    """What :func:`build_cache` did. Sizes in bytes, time in seconds."""

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

    def __str__(self) -> str:
        gib = self.cached_bytes / 2**30
        text = (f"{self.chunks} chunks of {self.rows:,} rows from {self.files} files: {self.built} built, "
                f"{self.already_cached} already cached; {gib:.2f} GiB in {self.cache_dir} ({self.seconds:.1f} s)")
        if self.not_cached:
            text += f"; {self.not_cached} chunks did not fit max_cache_bytes and will be read from Parquet"
        return text


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
    """build_cache's work on an opened reader: on ``client``'s workers, else on threads here."""
    enter = contextlib.nullcontext if ctx is None else ctx.active
    cache_dir = spec["options"]["cache_dir"]
    t0 = time.perf_counter()
    already = len(reader.cached_at_open)
    if client is not None:
        started = time.time()
        try:
            done = build_on_cluster(client, spec, reader, progress, nodes=nodes, seed=seed)
        finally:
            reader.close()
        sizes = [size for _, _, size, _ in done if size is not None]
        if cache_dir is not None and nodes is None:  # one cache, seen from here too: what was in it at the start
            # (a task rerun after its worker died finds its own file, and would count it as found)
            was = set(reader.cached_at_open)
        else:  # node-local caches: as each worker found them, less files written since the build began
            was = {i for i, decoded, _, mtime in done if not decoded and (mtime is None or mtime < started)}
        return CacheSummary(
            cache_dir=str(opts.cache_dir) if cache_dir is not None else "each worker's $GPULOAD_CACHE_DIR",
            files=len(reader.files), rows=reader.num_rows, chunks=len(reader.chunks),
            built=sum(1 for i, _, size, _ in done if i not in was and size is not None), already_cached=len(was),
            not_cached=len(done) - len(sizes), cached_bytes=sum(sizes), seconds=time.perf_counter() - t0,
            outputs=tuple(s.name for s in reader.specs))

    def one(i: int) -> None:
        with enter():
            reader.load(i)
        if progress is not None:
            progress(reader.chunks[i].rows)

    try:
        with ThreadPoolExecutor(max_workers=opts.num_threads, thread_name_prefix="gpuload-build") as pool:
            futures: deque = deque()
            n, submitted, warmed = len(reader.chunks), 0, 0
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
    present = []
    for k in (reader.key(i) for i in range(len(reader.chunks))):
        with contextlib.suppress(OSError):  # a folder gpuload cannot read, or a link: not cached
            st = reader.cache.root.lstat(k.parts, k.name)
            if st is not None and stat.S_ISREG(st.st_mode):
                present.append(st)
    return CacheSummary(
        cache_dir=str(opts.cache_dir), files=len(reader.files), rows=reader.num_rows, chunks=len(reader.chunks),
        built=reader.counters.decoded - (len(reader.chunks) - len(present)), already_cached=already,
        not_cached=len(reader.chunks) - len(present), cached_bytes=sum(st.st_size for st in present),
        seconds=time.perf_counter() - t0, outputs=tuple(s.name for s in reader.specs))
