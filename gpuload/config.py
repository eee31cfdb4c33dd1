"""Configuration: what a dataset reads (:class:`Source`) and how it loads it (:class:`Options`).

Both are frozen, validated once when made, and each default is written once, here, on
the dataclass: the flat keyword APIs (:class:`gpuload.ParquetDataset`,
:func:`gpuload.build_cache`, the command) take their defaults from these classes and only
build the two objects (:meth:`Source.of`, :meth:`Options.of`). Dask workers receive them
pickled. ``cache_dir=None`` becomes ``$GPULOAD_CACHE_DIR``, else ``~/.cache/gpuload``;
``remote=None`` becomes the :class:`gpuload.RemoteSettings` of the environment. The
meaning of each setting is in the docstring of :class:`gpuload.ParquetDataset`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .cache.paths import cache_dirs, default_cache_dir
from .errors import ConfigError, counted, setting
from .machine import cores
from .plan import MAX_KEY
from .sources.settings import RemoteSettings
from .rowfilter import RowFilter
from .transforms import check_transform

__all__ = ["Source", "Options", "MiB", "BUILD_DEVICE", "warn_settings"]

log = logging.getLogger("gpuload")

MiB = 1 << 20
THREADS_PER_CORE = 4  #: loader threads per usable core above which :func:`warn_settings` warns
DEFAULT_WINDOW = 4  #: chunks a shuffle window holds at least when ``shuffle_window`` is not given
MAX_WINDOW = 256  #: chunks a default shuffle window holds at most (its first batch waits for them all)
SMALL_CHUNKS = 8  #: a window given that holds this many times less than the default's is warned about
BUILD_DEVICE = "cpu"  #: where build_cache decodes unless asked (training defaults to ``Options.device``, "auto")


class _Settings:
    """What :class:`Source` and :class:`Options` share: made from the keyword arguments of a flat API."""

    @classmethod
    def of(cls, given: Mapping[str, Any]):
        """The settings among ``given`` (a flat API's keyword arguments; other names are
        ignored), the rest at their defaults."""
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


@dataclass(frozen=True)
class Source(_Settings):
    """What to read: the files and the outputs made of their columns.

    ``source``: a path, directory, glob or URL, or a list of these; ``columns``, ``fill_nulls``,
    ``dtypes``, ``categorical`` and ``transform`` shape the outputs, ``filters`` selects rows; ``filesystem``, ``storage_options`` and ``remote`` say
    how remote objects are reached (see :class:`gpuload.ParquetDataset` for each).
    """

    source: Any
    columns: Any = None
    fill_nulls: Any = None
    dtypes: Any = None
    categorical: Any = None  # None, a gpuload.Hash or Vocab for every string column, or {column: Hash or Vocab}
    filesystem: Any = None
    storage_options: dict | None = None
    remote: RemoteSettings | None = None  # None: RemoteSettings() from the environment; a dict of its fields
    transform: Any = None  # None, or a gpuload.Transform applied to each chunk when it is cached
    filters: Any = None  # None, a pyarrow.compute expression or its DNF list: the rows kept (a RowFilter once made)

    def __post_init__(self):
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(f"{setting('storage_options', self.storage_options)} must be a dict (or None)")
        object.__setattr__(self, "remote", RemoteSettings.of(self.remote))
        check_transform(self.transform)
        object.__setattr__(self, "filters", RowFilter.of(self.filters))


@dataclass(frozen=True)
class Options(_Settings):
    """How to load: batches, order, ranks, cache, device and threads (see :class:`gpuload.ParquetDataset`).

    ``shuffle`` is as given (True, False, ``"block"`` or ``"chunks"``); read :attr:`shuffled` (rows are
    permuted) and :attr:`block` (the block size of block shuffling, else None).
    """

    batch_size: int = 65536
    shuffle: bool | str = True
    block_rows: int = 256
    seed: int = 0
    drop_last: bool = False
    layout: str = "auto"
    shuffle_window: int | None = None  # None: DEFAULT_WINDOW chunks, more where chunks are small (window_chunks)
    chunk_bytes: int = 64 * MiB
    pack_files: bool = True  # small files packed several to a chunk (gpuload.packs); never with shard="node"
    rank: int | None = None
    world_size: int | None = None
    shard: str = "global"
    local_world_size: int | None = None
    cache_dir: Path | tuple[Path, ...] | None = None  # None: $GPULOAD_CACHE_DIR, else ~/.cache/gpuload
    max_cache_bytes: int | None = None
    cache_io: str = "auto"
    verify_checksums: bool | str = True
    device: str = "auto"
    decode: str = "auto"
    max_device_bytes: int | None = None
    kvikio_threads: int = 4
    kvikio_compat: str = "auto"
    prefetch: int = 2
    num_threads: int = 2
    nice: int = 0

    @property
    def cache_where(self) -> str:
        """The cache folder (or folders, one per drive) for messages."""
        return ", ".join(map(str, self.cache_dir)) if isinstance(self.cache_dir, tuple) else str(self.cache_dir)

    @property
    def shuffled(self) -> bool:
        """Whether rows are permuted (``shuffle=True`` or ``"block"``)."""
        return self.shuffle is True or self.shuffle == "block"

    @property
    def stored_layout(self) -> str:
        """The layout chunks are stored in: ``layout``, or for ``"auto"`` ``"rows"``, except
        ``"columns"`` where no row is gathered (``shuffle=False`` or ``"chunks"``): batches are
        then views of the chunks' columns, no block to unpack (cached epochs at 0.55x the CPU
        on 2 cores, docs/benchmarks.md). Where the cache holds more of the dataset as row
        blocks, the reader reads those (:meth:`gpuload.reader.ChunkReader._reuse_rows`)."""
        if self.layout != "auto":
            return self.layout
        return "rows" if self.shuffled else "columns"

    @property
    def chunks_shuffled(self) -> bool:
        """Whether each epoch permutes the chunk order (every mode but ``shuffle=False``)."""
        return self.shuffle is not False

    @property
    def packed(self) -> bool:
        """Whether small files are packed several to a chunk (:mod:`gpuload.packs`): ``pack_files``, but
        never with ``shard="node"``, whose nodes own whole chunks (packs would leave few to share out)."""
        return self.pack_files and self.shard != "node"

    @property
    def block(self) -> int | None:
        """Rows per block with ``shuffle="block"``, else None."""
        return self.block_rows if self.shuffle == "block" else None

    def __post_init__(self):
        if isinstance(self.shuffle, np.bool_):
            object.__setattr__(self, "shuffle", bool(self.shuffle))
        if not (isinstance(self.shuffle, bool) or (isinstance(self.shuffle, str) and self.shuffle in ("block", "chunks"))):
            raise ConfigError(f"shuffle={self.shuffle!r} must be True (rows permuted in windows), 'block', 'chunks' "
                              f"or False")
        ints = [("batch_size", 1, None), ("prefetch", 0, None), ("num_threads", 1, None),
                ("nice", 0, 19), ("chunk_bytes", 4096, None), ("kvikio_threads", 1, None)]
        ints += [("shuffle_window", 1, None)] if self.shuffle_window is not None else []
        ints += [("block_rows", 1, None)] if self.shuffle == "block" else []
        ints += [("max_cache_bytes", 0, None)] if self.max_cache_bytes is not None else []
        ints += [("max_device_bytes", 1, None)] if self.max_device_bytes is not None else []
        for name, low, high in ints:  # kept as Python ints: NumPy's would reach JSON headers and keys
            object.__setattr__(self, name, counted(name, getattr(self, name), low, high))
        # seeds and epochs key the order's generators on 63 bits (gpuload.plan): larger ones would wrap
        object.__setattr__(self, "seed", counted("seed", self.seed, 0, MAX_KEY))
        for name in ("drop_last", "pack_files"):  # bool("no") is True: rows dropped unasked, files packed
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ConfigError(f"{setting(name, getattr(self, name))} must be True or False")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.verify_checksums not in (True, False, "always"):
            raise ConfigError(f"verify_checksums={self.verify_checksums!r} must be True, False or 'always'")
        if self.decode not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"decode={self.decode!r} must be 'auto', 'gpu' or 'cpu'")
        if self.kvikio_compat not in ("auto", "on", "off"):
            raise ConfigError(f"kvikio_compat={self.kvikio_compat!r} must be 'auto', 'on' or 'off'")
        if self.cache_io not in ("auto", "direct", "buffered", "off"):
            raise ConfigError(f"{setting('cache_io', self.cache_io)} must be 'auto', 'direct', 'buffered' or 'off'")
        if self.layout not in ("auto", "rows", "columns"):
            raise ConfigError(f"{setting('layout', self.layout)} must be 'auto', 'rows' or 'columns'")
        if self.shard not in ("global", "node"):
            raise ConfigError(f"shard={self.shard!r} must be 'global' or 'node'")
        cache = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        if not isinstance(cache, (str, os.PathLike, list, tuple)):
            raise ConfigError(f"{setting('cache_dir', cache)} must be a folder, or a list of folders (one per drive)")
        object.__setattr__(self, "cache_dir", cache_dirs(cache))
        if not isinstance(self.device, str):  # a torch.device
            object.__setattr__(self, "device", str(self.device))


def warn_settings(opts: Options) -> None:
    """Warn (a log line each) about settings given that do nothing with the others, or that work
    against the training step: ``block_rows`` without ``shuffle="block"``, ``local_world_size``
    without ``shard="node"``, more than :data:`THREADS_PER_CORE` loader threads per usable core."""
    if opts.block is None and opts.block_rows != Options.block_rows:  # given, and nothing uses it
        log.warning("gpuload: %s has no effect with %s: it sizes the blocks of shuffle='block'",
                    setting("block_rows", opts.block_rows), setting("shuffle", opts.shuffle))
    if opts.local_world_size is not None and opts.shard != "node":
        log.warning("gpuload: %s has no effect with %s: it places the ranks on nodes for shard='node' (each node "
                    "caching its share)", setting("local_world_size", opts.local_world_size), setting("shard", opts.shard))
    here = cores()
    if opts.num_threads > THREADS_PER_CORE * here:
        log.warning("gpuload: %s is more than %d per core of the %d cores here: loader threads beyond them only "
                    "compete with each other and the training step for the cores",
                    setting("num_threads", opts.num_threads), THREADS_PER_CORE, here)


def window_chunks(opts: Options, chunks: int, largest: int) -> int:
    """The chunks a shuffle window holds: ``shuffle_window`` where given; else as many chunks of the
    largest one (``largest`` converted bytes) as take half the memory of :data:`DEFAULT_WINDOW` chunks
    of ``chunk_bytes``, at least :data:`DEFAULT_WINDOW` (what chunks of half ``chunk_bytes`` or more
    get) and at most :data:`MAX_WINDOW` and ``chunks``. So files smaller than ``chunk_bytes`` (a chunk
    spans several only where they are packed: :mod:`gpuload.packs`) are not shuffled in windows of few
    rows: 2M click-log rows as 400 files of 5,000 rows, unpacked, get 129 chunks, 645,000 rows, where as
    4 files they get 4 chunks of 262,144. Without a row or
    block shuffle, :data:`DEFAULT_WINDOW` (nothing is shuffled within windows: the order is the same)."""
    return opts.shuffle_window if opts.shuffle_window is not None else _default_window(opts, chunks, largest)


def _default_window(opts: Options, chunks: int, largest: int) -> int:
    """:func:`window_chunks` where ``shuffle_window`` is not given."""
    if not opts.shuffled or largest <= 0:
        return DEFAULT_WINDOW
    return max(DEFAULT_WINDOW, min(chunks, MAX_WINDOW, DEFAULT_WINDOW * opts.chunk_bytes // (2 * largest)))


def warn_small_windows(opts: Options, chunk_rows: list[int], largest: int) -> None:
    """Warn (a log line) where the row or block shuffle's windows, of a ``shuffle_window`` given,
    hold far fewer rows than the same rows in larger files would get: that many chunks of the
    largest one (``largest`` converted bytes) are :data:`SMALL_CHUNKS` times or more below
    :data:`DEFAULT_WINDOW` chunks of ``chunk_bytes``, and do not cover every chunk. Names the
    window the default takes (:func:`window_chunks`), where it is wider."""
    n, w, full = len(chunk_rows), opts.shuffle_window, DEFAULT_WINDOW * opts.chunk_bytes
    if not opts.shuffled or w is None or n <= w or largest <= 0 or w * largest * SMALL_CHUNKS > full:
        return
    per_chunk = sorted(chunk_rows)[n // 2]
    wider = _default_window(opts, n, largest)
    if wider <= w:
        return
    log.warning("gpuload: the shuffle's windows of %s hold about %s rows here: the files are small (about %s rows "
                "a chunk, and a chunk spans several files only where they are packed), so rows are shuffled among far fewer than the same "
                "rows in larger files would be; %s (the default's here) shuffles about %s rows together, its windows "
                "taking at most half the memory of %d chunks of %s", setting("shuffle_window", w),
                f"{w * per_chunk:,}", f"{per_chunk:,}", setting("shuffle_window", wider), f"{wider * per_chunk:,}",
                DEFAULT_WINDOW, setting("chunk_bytes", opts.chunk_bytes))
