"""ParquetDataset: the public loader, and build_cache to fill the cache ahead of time."""

from __future__ import annotations

import contextlib
import dataclasses
import stat
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import plan
from .config import Options
from .errors import ConfigError
from .batch import nbytes, nrows
from .handoff import DlpackHandoff, HostHandoff, resolve_device
from .metrics import Metrics
from .stats import Stats
from .pipeline import Background, epoch_batches
from .reader import ChunkReader
from .schema import BFLOAT16

__all__ = ["ParquetDataset", "build_cache", "CacheSummary"]


def _dist_defaults(rank, world_size) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}={v!r} must be an integer")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} and world_size={world_size}: need 0 <= rank < world_size")
    return rank, world_size


class ParquetDataset(torch.utils.data.IterableDataset):
    """Batches of converted Parquet columns as torch tensors, from a local cache.

    The first epoch decodes each chunk of row groups once, converts it to the output
    dtypes and writes it to the cache; later epochs read the cache only. Iterate it
    directly (or through a ``DataLoader`` with ``batch_size=None, num_workers=0``:
    gpuload batches and runs its own background threads, and refuses a DataLoader that
    would batch again).

    Parameters
    ----------
    source : a Parquet file, a directory (``*.parquet`` below it), a glob, a URL (``s3://``,
        ``gs://``, ``az://``, ``http(s)://``, ``file://`` or any fsspec protocol: an object, a
        prefix or a glob), or a list of these. Hive-style folders (``day=1/...``) add their
        partition keys as columns. Remote objects are read once, column ranges only; later
        epochs and reopenings read the cache and make no request (see :mod:`gpuload.fetch`).
    columns : None (every column of a supported type that every file has, pandas index
        columns excepted; others are skipped with one log line), a list of names, or a
        dict ``{output: column}`` / ``{output: [columns]}``; a list of same-kind scalar
        columns is stacked into one ``[rows, k]`` tensor.
    batch_size : rows per batch (default 65536).
    shuffle : permute chunk order and rows within a window of chunks, differently each
        epoch (default True). Without it rows come in file order.
    seed : shuffle seed (default 0); with the epoch it fixes the order completely.
    drop_last : drop the tail that does not fill a batch on every rank (default False:
        every row once, see :mod:`gpuload.plan` for how the tail is balanced).
    cache_dir : cache folder; None: ``$GPULOAD_CACHE_DIR``, else ``~/.cache/gpuload``.
    device : ``"auto"`` (a GPU if torch sees one, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    rank, world_size : this process's shard; default from ``torch.distributed`` when
        initialised, else 0 and 1.
    fill_nulls : None (nulls are an error), a scalar for every column, or ``{column: value}``.
        Null lists become empty lists; null fixed-size lists rows of the value.
    dtypes : ``{output: dtype}`` to cast outputs, as NumPy or torch dtypes (or their
        names), ``torch.bfloat16`` included (default: the column's own dtype; a stacked
        group: NumPy's common dtype of its columns, e.g. int64 + float32 -> float64).
        Casts happen once, when the cache is built. Casts to floats may round (as torch
        rounds); casts to integers or bool must keep every value exactly, else a
        :class:`~gpuload.ConfigError` names the column and value (at open, where the
        footers' statistics show it).
    chunk_bytes : upper bound of one chunk's converted size in bytes (default 64 MiB).
    shuffle_window : chunks whose rows are shuffled together (default 4).
    prefetch : chunks loaded ahead of the one being batched (default 2).
    num_threads : threads that read and decode chunks (default 2).
    max_cache_bytes : cache budget in bytes (default None: unbounded). When the data
        does not fit, chunks are cached until full and the rest is read from Parquet
        every epoch; nothing is evicted.
    verify_checksums : check each cache file's xxh3 checksums the first time this process
        reads it (default True), on every read (``"always"``), or never (False). On the
        GPU, files this process wrote count as checked, and a first check reads the
        file through pinned host memory once.
    decode : where the first epoch decodes Parquet on a GPU device: ``"auto"`` (cuDF
        when it imports, else the CPU), ``"gpu"`` (cuDF, an error without it) or
        ``"cpu"`` (pyarrow, then pinned memory and non-blocking copies on the loader's
        stream). Ignored on the CPU.
    max_device_bytes : refuse settings whose device memory bound
        (:attr:`device_bytes_bound`) exceeds this many bytes (default None: no limit).
    kvikio_threads, kvikio_compat : KvikIO's thread pool size (default 4) and compat
        mode (``"auto"``, the default: GPUDirect Storage where available, else POSIX;
        ``"on"``; ``"off"``), set for the whole process when a GPU dataset opens.
    filesystem : an fsspec filesystem or a ``pyarrow.fs.FileSystem``; ``source`` then
        names paths in it (default None: from each URL's protocol, or the local disk).
    storage_options : dict passed to the fsspec filesystem made from a URL, as in fsspec
        and pandas (credentials, ``endpoint_url``, ``anon``...; default None).
    remote : a :class:`gpuload.RemoteSettings` or a dict of its fields: requests and bytes
        in flight, read-ahead, retries, backoff and timeout (default: from the environment).

    Yields
    ------
    dict mapping output name to a ``torch.Tensor`` (``[rows]`` or ``[rows, k]``) or a
    :class:`gpuload.Ragged` of tensors for list columns.
    """

    def __init__(self, source, columns=None, *, batch_size: int = 65536, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, cache_dir=None, device="auto", rank: int | None = None,
                 world_size: int | None = None, fill_nulls=None, dtypes=None, chunk_bytes: int = 64 << 20,
                 shuffle_window: int = 4, prefetch: int = 2, num_threads: int = 2,
                 max_cache_bytes: int | None = None, verify_checksums: bool | str = True, decode: str = "auto",
                 max_device_bytes: int | None = None, kvikio_threads: int = 4, kvikio_compat: str = "auto",
                 filesystem=None, storage_options: dict | None = None, remote=None):
        super().__init__()
        self.options = Options(batch_size=batch_size, shuffle=bool(shuffle), seed=seed, drop_last=bool(drop_last),
                               cache_dir=cache_dir, device=device, chunk_bytes=chunk_bytes,
                               shuffle_window=shuffle_window, prefetch=prefetch, num_threads=num_threads,
                               max_cache_bytes=max_cache_bytes, verify_checksums=verify_checksums, decode=decode,
                               max_device_bytes=max_device_bytes, kvikio_threads=kvikio_threads,
                               kvikio_compat=kvikio_compat)
        self.rank, self.world_size = _dist_defaults(rank, world_size)
        self.device = resolve_device(device)
        self.metrics = Metrics()
        self._ctx, gpu_decode = _device_context(self.device, self.options, self.metrics)
        t0 = self.metrics.clock()
        self.reader = ChunkReader(source, self.options, columns, fill_nulls, dtypes, ctx=self._ctx,
                                  gpu_decode=gpu_decode, metrics=self.metrics, filesystem=filesystem,
                                  storage_options=storage_options, remote=remote)
        self.metrics.record("list", t0, self.metrics.clock(), rows=self.reader.num_rows)
        plan.check_balance(self.reader.num_rows, self.world_size, batch_size, self.options.drop_last)
        o = self.options
        if self._ctx is not None and o.max_device_bytes is not None and self.device_bytes_bound > o.max_device_bytes:
            raise ConfigError(
                f"max_device_bytes={o.max_device_bytes}: these settings may hold up to {self.device_bytes_bound} "
                f"bytes of device memory ((2 x shuffle_window + prefetch + 1) chunks of up to "
                f"{self.reader.max_chunk_bytes()} bytes, plus queued batches); lower chunk_bytes, shuffle_window "
                "or prefetch")
        self._views = {s.name: torch.bfloat16 for s in self.reader.specs if s.dtype == BFLOAT16}
        self.epoch = 0

    # -- public -------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in the whole dataset (all ranks)."""
        return self.reader.num_rows

    @property
    def outputs(self) -> list[str]:
        """Names of the tensors in each batch."""
        return [s.name for s in self.reader.specs]

    @property
    def device_bytes_bound(self) -> int:
        """Upper bound of the device memory the loader holds at once, in bytes (GPU path).

        A window's chunks and its concatenation (2 x ``shuffle_window`` chunks), the
        chunks loaded ahead (``prefetch``) and one being decoded, plus the batches
        queued for the consumer and being cut (``prefetch + 4``, with 16 bytes per row
        for the gather's index arrays). Independent of the dataset's size.
        """
        o, r = self.options, self.reader
        chunk = r.max_chunk_bytes()
        row = chunk / max(1, max((c.rows for c in r.chunks), default=1))
        return int((2 * o.shuffle_window + o.prefetch + 1) * chunk + (o.prefetch + 4) * o.batch_size * (row + 16))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (call before each epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be a non-negative integer")
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank)."""
        o = self.options
        return plan.num_batches(self.num_rows, self.world_size, o.batch_size, o.drop_last)

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 0:
            raise ConfigError("ParquetDataset runs its own loader threads: use it with DataLoader(num_workers=0, "
                              "batch_size=None), or iterate it directly")
        caller = sys._getframe(1)  # a DataLoader's fetcher calls iter() in its __init__
        # only that frame's locals are read: reading f_locals snapshots every local of the caller
        # (the training loop's own frame, most often) and keeps them alive after a `del`
        fetcher = caller.f_locals.get("self") if caller.f_code.co_name == "__init__" else None
        if type(fetcher).__name__ == "_IterableDatasetFetcher" and getattr(fetcher, "auto_collation", False):
            raise ConfigError("DataLoader(ds) would batch gpuload's batches again (a leading [1, ...] dimension): "
                              "pass DataLoader(ds, batch_size=None), or iterate the dataset directly")
        return self._iterate()

    def _iterate(self) -> Iterator[dict]:
        if self._ctx is not None:  # batches are guarded for the stream current now, on the training thread
            self._ctx.consumer = torch.cuda.current_stream(self.device)
            handoff = DlpackHandoff(self._ctx, self._views)
        else:
            handoff = HostHandoff(self._views)
        producer = Background(lambda stop: self._batches(self.epoch, handoff, stop), depth=self.options.prefetch + 2)
        m = self.metrics
        t0 = m.clock()
        try:
            for item in producer:
                batch = handoff.receive(item)
                t1 = m.clock()
                m.consumer_wait(t0, t1, rows=nrows(batch), nbytes=nbytes(batch))
                m.queue_depth(producer.depth())
                yield batch
                t0 = m.clock()
            m.consumer_end(t0, m.clock())
        except GeneratorExit:  # the loop was left early
            t = m.clock()
            m.consumer_end(t, t)
            raise
        finally:
            producer.close()

    def stats(self) -> Stats:
        """What the loader and the training loop did so far: a :class:`gpuload.Stats`.

        Per-stage busy time, bytes and rows (list, read, decode, convert, cache_write,
        cache_read, h2d, batch), queue depth, and ``starvation``: the fraction (0 to 1)
        of wall time the training thread spent waiting inside ``next()``, summed over
        the epochs iterated since the dataset was created (or :meth:`reset_stats`).
        ``gpuload.diagnose(ds.stats())`` names the stage that limits it. For a remote
        source, ``remote`` counts the requests made to the store (a :class:`gpuload.RemoteStats`).
        """
        stats = self.metrics.stats()
        remote = self.reader.remote_stats()
        return stats if remote is None else dataclasses.replace(stats, remote=remote)

    def reset_stats(self) -> None:
        """Start :meth:`stats` afresh (e.g. to look at one epoch)."""
        self.metrics.reset()
        self.reader.reset_remote()

    def close(self) -> None:
        """Stop remote fetches and release their connections (the dataset can still be iterated:
        a later epoch starts new ones)."""
        self.reader.close()

    def plan_epoch(self, epoch: int | None = None) -> tuple[list[list[plan.Segment]], list[int]]:
        """This rank's windows of chunk segments and batch sizes for ``epoch`` (pure)."""
        o, r = self.options, self.reader
        epoch = self.epoch if epoch is None else epoch
        order = plan.chunk_order(len(r.chunks), fingerprint=r.fingerprint, seed=o.seed, epoch=epoch,
                                 shuffle=o.shuffle)
        start, stop = plan.rank_range(r.num_rows, self.world_size, self.rank, o.batch_size, o.drop_last)
        segments = plan.rank_segments([c.rows for c in r.chunks], order, start, stop)
        sizes = plan.batch_sizes(r.num_rows, self.world_size, self.rank, o.batch_size, o.drop_last)
        return plan.windows(segments, o.shuffle_window), sizes

    # -- internals ----------------------------------------------------------------------
    def _batches(self, epoch: int, handoff: Callable, stop) -> Iterator:
        o, r = self.options, self.reader
        windows, sizes = self.plan_epoch(epoch)
        ctx = self._ctx
        permutation = None
        if o.shuffle:
            def permutation(w: int, n: int):
                perm = plan.window_permutation(n, fingerprint=r.fingerprint, seed=o.seed, epoch=epoch,
                                               rank=self.rank, window=w)
                return perm if ctx is None else ctx.upload_index(perm)  # the same order on both paths
        remote = r.has_remote
        yield from epoch_batches(windows, sizes, r.load, permutation, handoff, threads=o.num_threads,
                                 prefetch=o.prefetch, stop=stop, alloc=r.pool.array if ctx is None else None,
                                 enter=None if ctx is None else ctx.active, metrics=self.metrics,
                                 warm=r.warm if remote else None, forget=r.forget_ahead if remote else None)

    def __repr__(self) -> str:
        return (f"ParquetDataset({len(self.reader.files)} files, {self.num_rows} rows, "
                f"{len(self.reader.chunks)} chunks, outputs={self.outputs}, batch_size={self.options.batch_size}, "
                f"rank={self.rank}/{self.world_size}, device={self.device}, cache_dir={str(self.options.cache_dir)!r})")


def _device_context(device: torch.device, o: Options, metrics=None):
    """(DeviceContext, decode on the GPU) for a CUDA device; (None, False) on the CPU."""
    if device.type != "cuda":
        return None, False
    from .gpu import DeviceContext, configure_kvikio, require_gpu

    gpu_decode = require_gpu(str(device), o.decode)
    configure_kvikio(o.kvikio_threads, o.kvikio_compat)
    return DeviceContext(device, metrics=metrics), gpu_decode


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
                progress: Callable[[int], None] | None = None, device="cpu", decode: str = "auto",
                filesystem=None, storage_options: dict | None = None, remote=None) -> CacheSummary:
    """Convert ``source`` into the cache ahead of training; returns a :class:`CacheSummary`.

    Takes the same ``columns``, ``fill_nulls``, ``dtypes`` and ``chunk_bytes`` as
    :class:`ParquetDataset` (a dataset opened with the same values finds every chunk
    cached). ``progress(n)`` is called with each finished chunk's row count. Safe to
    run from several processes at once: each chunk is built once. ``device`` (default
    ``"cpu"``; ``"cuda"`` or ``"auto"`` to decode with cuDF) and ``decode`` mean what
    they mean for :class:`ParquetDataset`; the files are the same either way. A remote
    ``source`` (with ``filesystem``, ``storage_options`` and ``remote`` as for
    :class:`ParquetDataset`) is fetched ahead of decoding, column ranges only.
    """
    opts = Options(cache_dir=cache_dir, chunk_bytes=chunk_bytes, num_threads=num_threads,
                   max_cache_bytes=max_cache_bytes, device=str(device), decode=decode)
    ctx, gpu_decode = _device_context(resolve_device(device), opts)
    reader = ChunkReader(source, opts, columns, fill_nulls, dtypes, ctx=ctx, gpu_decode=gpu_decode,
                         filesystem=filesystem, storage_options=storage_options, remote=remote)
    enter = contextlib.nullcontext if ctx is None else ctx.active
    t0 = time.perf_counter()
    already = len(reader.cached_at_open)

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
