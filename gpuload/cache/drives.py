"""Several drives: one cache striped over several folders, each on its own disk.

One NVMe drive cannot feed eight GPUs; ``cache_dir=[...]`` (or ``$GPULOAD_CACHE_DIR``
with folders separated by ``os.pathsep``) spreads the chunks over several. Each chunk
has an order of the folders of its own, drawn from its file name (rendezvous hashing),
so every process, rank and epoch looks for it first where it was written, and adding a
folder moves only the chunks the new one takes. Each folder is a whole
:class:`gpuload.cache.store.ChunkCache` with its own writer thread, lock files, reserve,
quota and eviction; a chunk's reads run where it lives, so the loader's threads read
several drives at once. ``max_cache_bytes`` is split evenly over the folders.

A folder that fails (a write or lock error: read-only, I/O error, gone) is left out of
later writes, with one warning naming it; a folder that is full (its reserve, quota or
budget, after eviction) passes the chunk to the next folder in the chunk's order. Reads
look in every folder in that order, so chunks written elsewhere meanwhile are found, and
a chunk a failed folder cannot serve is decoded again and written to the next one. The
small files (footers, vocabularies, column-set records) live in the first folder.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterator

import xxhash

from .paths import ChunkKey
from .store import ChunkCache

__all__ = ["Drives", "open_cache"]

log = logging.getLogger("gpuload")

_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full drive is routed around for one chunk, not left out


def open_cache(cache_dir, max_bytes: int | None = None, *args, **kwargs):
    """A :class:`ChunkCache` for one folder, a :class:`Drives` for a tuple of several (same arguments)."""
    if isinstance(cache_dir, tuple):
        return Drives(cache_dir, max_bytes, *args, **kwargs)
    return ChunkCache(cache_dir, max_bytes, *args, **kwargs)


class Drives:
    """Chunks striped over ``roots`` (see the module doc); a :class:`ChunkCache`'s interface.

    Parameters
    ----------
    roots : the folders, one per drive, in order (the first holds the small files).
    max_bytes : the budget of all folders together (None: each folder's quota or reserve).
    Other arguments are :class:`ChunkCache`'s, given to each folder's.
    """

    def __init__(self, roots, max_bytes: int | None = None, *args, **kwargs):
        share = None if max_bytes is None else max_bytes // len(roots)
        self.caches = [ChunkCache(r, share, *args, **kwargs) for r in roots]
        self.root = self.caches[0].root  #: the first folder: footers, vocabularies, column-set records
        self._failed: dict[int, str] = {}  # folder index -> why it is left out of writes
        self._lock = threading.Lock()
        for cache in self.caches:
            cache.spill = self._spill

    # -- where a chunk goes --------------------------------------------------------------
    def order(self, key: ChunkKey) -> list[int]:
        """The folders' indices in ``key``'s own order (rendezvous hashing on its file name)."""
        name = key.relpath()
        return sorted(range(len(self.caches)), key=lambda i: xxhash.xxh64_intdigest(f"{i}/{name}".encode()))

    def _writable(self, key: ChunkKey) -> list[int]:
        return [i for i in self.order(key) if i not in self._failed]

    def _fail(self, i: int, why: OSError) -> None:
        with self._lock:
            if i in self._failed:
                return
            self._failed[i] = str(why)
        left = [str(c.root.path) for j, c in enumerate(self.caches) if j not in self._failed]
        log.warning("gpuload: cache folder %s failed (%s); chunks go to %s from now on", self.caches[i].root.path,
                    why.strerror or why, ", ".join(left) or "no folder: they are read from Parquet")

    def _spill(self, cache: ChunkCache, key: ChunkKey, cols: dict, why) -> bool:
        """A folder could not take ``key`` (``why``: no room, or an ``OSError``): write it to the
        next folder of its order that can; True if one did."""
        src = self.caches.index(cache)
        if isinstance(why, OSError) and why.errno not in _FULL:
            self._fail(src, why)
        order = self._writable(key)
        for i in order[order.index(src) + 1:] if src in order else order:
            other = self.caches[i]
            if other._write(key, cols, spill=False):
                log.debug("gpuload: %s went to %s instead of %s (%s)", key.name, other.root.path, cache.root.path, why)
                return True
        return False

    # -- a ChunkCache's interface ---------------------------------------------------------
    def load(self, key: ChunkKey, build: Callable[[], dict], shared: bool = True) -> tuple[dict, bool]:
        """:meth:`ChunkCache.load`, the chunk looked for in every folder in its order, built
        and written in the first that has not failed."""
        order = self.order(key)
        for i in order[1:]:  # the first folder is looked at by its own load below
            if self.caches[i].exists(key):
                cols, _ = self.caches[i].look(key)
                if cols is not None:
                    self.caches[i].note(key, "cached")
                    return cols, True
        writable = self._writable(key)
        return self.caches[writable[0] if writable else order[0]].load(key, build, shared)

    def exists(self, key: ChunkKey) -> bool:
        return any(c.exists(key) for c in self.caches)

    def stat(self, key: ChunkKey) -> os.stat_result | None:
        return next((st for st in (self.caches[i].stat(key) for i in self.order(key)) if st is not None), None)

    def path(self, key: ChunkKey) -> Path:
        """Where ``key``'s file is, else where it would be written."""
        for i in self.order(key):
            if self.caches[i].exists(key):
                return self.caches[i].path(key)
        writable = self._writable(key)
        return self.caches[(writable or self.order(key))[0]].path(key)

    def probe(self, key: ChunkKey) -> None:
        """Raise the ``OSError`` writing ``key`` would meet in every folder (one that can write: none)."""
        error = None
        for i in self.order(key):
            try:
                return self.caches[i].probe(key)
            except OSError as e:
                error = error or e
        raise error

    def note(self, key: ChunkKey, outcome) -> None:
        self.caches[0].note(key, outcome)

    @property
    def outcomes(self) -> dict | None:
        return self.caches[0].outcomes

    @outcomes.setter
    def outcomes(self, value: dict | None) -> None:
        for c in self.caches:  # one dict: a chunk's outcome wherever it went
            c.outcomes = value

    @property
    def max_bytes(self) -> int | None:
        budgets = [c.max_bytes for c in self.caches]
        return None if None in budgets else sum(budgets)

    @property
    def reserve(self) -> int:
        return self.caches[0].reserve

    @property
    def full(self) -> bool:
        return all(c.full for c in self.caches)

    @property
    def failed(self) -> dict[int, str]:
        """The folders left out of writes (index -> why)."""
        return dict(self._failed)

    def flush(self) -> None:
        for c in self.caches:
            c.flush()

    def register(self, groups) -> None:
        for c in self.caches:
            c.register(groups)

    def release(self) -> None:
        for c in self.caches:
            c.release()

    def room(self, groups, need: int) -> tuple[int, int]:
        """:meth:`ChunkCache.room` added up over the folders that have not failed."""
        parts = [c.room(groups, need) for i, c in enumerate(self.caches) if i not in self._failed]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def touch_spec(self, key_spec: str, desc: list) -> None:
        for c in self.caches:  # each folder describes its own column sets (`gpuload cache info`)
            c.touch_spec(key_spec, desc)

    def entries(self) -> Iterator[Path]:
        for c in self.caches:
            yield from c.entries()
