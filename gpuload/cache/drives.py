"""Several drives: one cache striped over several folders, each on its own disk.

One NVMe drive cannot feed eight GPUs; ``cache_dir=[...]`` (or ``$GPULOAD_CACHE_DIR``
and ``--cache-dir`` with absolute folders separated by ``os.pathsep``) spreads the chunks
over several. Each chunk has an order of the folders of its own, drawn from its file name
and each folder's path (rendezvous hashing), so every process, rank and epoch looks for
it first where it was written, whatever order the folders are listed in, and adding or
removing a folder moves only the chunks that folder takes or held. Each folder is a whole
:class:`gpuload.cache.store.ChunkCache` with its own writer thread (and up to two chunks
waiting for it: the host memory bound counts them per folder), lock files, reserve,
quota and eviction; a chunk's reads run where it lives, so the loader's threads
(``num_threads``: at least one per drive) read several drives at once. A quota is per
folder; ``max_cache_bytes`` is split evenly over the folders that open.

A folder that fails (a file cannot be written in it: read-only, an I/O error, gone, no
permission; probed at open and after any write or lock error) is left out of later
writes, with one warning naming it; a folder that is full (its reserve, quota or budget,
after eviction), or whose error concerns one chunk only (a subfolder another user made,
too many open files), hands that chunk to the next folder in the chunk's order. Reads look in the first
folder the chunk would be written to, then in the others (chunks routed around a full
or failed one are found there; a corrupt copy there is deleted). The small files
(footers, vocabularies, column-set records) live in the first folder that opened.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Callable

import xxhash

from .chunkfile import LAYOUT_DIR
from .fs import CHUNK
from .paths import ChunkKey
from .store import ChunkCache
from ..errors import CacheError

__all__ = ["Drives", "open_cache"]

log = logging.getLogger("gpuload")


def open_cache(cache_dir, max_bytes: int | None = None, *args, **kwargs):
    """A :class:`ChunkCache` for one folder, a :class:`Drives` for a tuple of several (same arguments)."""
    if isinstance(cache_dir, tuple):
        return Drives(cache_dir, max_bytes, *args, **kwargs)
    return ChunkCache(cache_dir, max_bytes, *args, **kwargs)


def _every_folder(name: str) -> property:
    """A flag of :class:`ChunkCache` over every folder: true if one folder's is; set on all."""

    def get(self) -> bool:
        return any(getattr(c, name) for c in self.caches)

    def put(self, value: bool) -> None:
        for c in self.caches:
            setattr(c, name, value)

    return property(get, put)


class Drives:
    """Chunks striped over ``roots`` (see the module doc); a :class:`ChunkCache`'s interface.

    Parameters
    ----------
    roots : the folders, one per drive, in order (the first holds the small files).
    max_bytes : the budget of all folders together (None: each folder's quota or reserve).
    Other arguments are :class:`ChunkCache`'s, given to each folder's.
    """

    def __init__(self, roots, max_bytes: int | None = None, *args, **kwargs):
        self.caches: list[ChunkCache] = []
        for r in roots:
            try:
                self.caches.append(ChunkCache(r, None, *args, **kwargs))
            except CacheError as e:  # a folder that cannot be made: left out while another works
                if r is roots[-1] and not self.caches:
                    raise
                log.warning("gpuload: cache folder %s left out: %s", r, e)
        if max_bytes is not None:  # split over the folders that opened
            for c in self.caches:
                c.space.limit = max_bytes // len(self.caches)
        self.root = self.caches[0].root  #: the first folder that opened: footers, vocabularies, column-set records
        self._failed: dict[int, str] = {}  # folder index -> why it is left out of writes
        self._full: set[int] = set()  # folders found full once (warned about)
        self._lock = threading.Lock()
        self._names = [str(c.root.path) for c in self.caches]
        for i in range(len(self.caches)):  # a folder that cannot be written (read-only...) is left out now
            error = self._broken(i)
            if error is not None:
                self._fail(i, error)
        spill = weakref.WeakMethod(self._spill)  # no cycle: the folders (and their records) go with this object

        def spill_on(*args) -> bool:
            method = spill()
            return method is not None and method(*args)

        for cache in self.caches:
            cache.spill = spill_on

    # -- where a chunk goes --------------------------------------------------------------
    def order(self, key: ChunkKey) -> list[int]:
        """The folders' indices in ``key``'s own order (rendezvous hashing of its file name with
        each folder's path: the same whatever order the folders are listed in)."""
        name = key.relpath()
        return sorted(range(len(self.caches)),
                      key=lambda i: xxhash.xxh64_intdigest(f"{self._names[i]}/{name}".encode()))

    def _writable(self, key: ChunkKey) -> list[int]:
        return [i for i in self.order(key) if i not in self._failed]

    def _broken(self, i: int) -> OSError | None:
        """The ``OSError`` that writing a file in folder ``i``'s layout folder meets, None if it can be written."""
        try:
            self.caches[i].root.probe_write((LAYOUT_DIR,), "probe")
        except OSError as e:
            return None if e.errno in (errno.ENOSPC, errno.EDQUOT) else e  # full: routed around, not left out
        return None

    def _fail(self, i: int, why: OSError) -> None:
        with self._lock:
            if i in self._failed:
                return
            self._failed[i] = str(why)
        log.warning("gpuload: cache folder %s failed (%s); chunks go to %s from now on", self.caches[i].root.path,
                    why.strerror or why, self.where)

    def _spill(self, cache: ChunkCache, key: ChunkKey, cols: dict, why) -> bool:
        """A folder could not take ``key`` (``why``: no room, or an ``OSError``): write it to the
        next folder of its order that can; True if one did."""
        src = self.caches.index(cache)
        if isinstance(why, OSError):  # the folder itself, or only this chunk's path?
            error = self._broken(src)
            if error is not None:
                self._fail(src, error)
        order = self._writable(key)
        for i in order[order.index(src) + 1:] if src in order else order:
            other = self.caches[i]
            if other._write(key, cols, spill=False):
                full = why in ("budget", "reserve") or getattr(why, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                with self._lock:
                    first = full and src not in self._full
                    if first:
                        self._full.add(src)
                if first:
                    log.warning("gpuload: cache folder %s is full (%s); its chunks go to the next folders (%s here) "
                                "while it is", cache.root.path, why if isinstance(why, str) else why.strerror,
                                other.root.path)
                log.debug("gpuload: %s went to %s instead of %s (%s)", key.name, other.root.path, cache.root.path, why)
                return True
        return False

    # -- a ChunkCache's interface ---------------------------------------------------------
    def load(self, key: ChunkKey, build: Callable[[], dict], shared: bool = True) -> tuple[dict, bool]:
        """:meth:`ChunkCache.load`, the chunk looked for in every folder in its order, built
        and written in the first that has not failed."""
        order = self.order(key)
        writable = self._writable(key)
        first = writable[0] if writable else order[0]
        cols = self.caches[first].look(key)[0]
        if cols is None:  # routed around a full or failed folder: elsewhere
            for i in order:
                c = self.caches[i]
                if i != first and c.exists(key):
                    cols, unreadable, _ = c.look(key)
                    if cols is not None:
                        first = i
                        break
                    if unreadable is None:  # corrupt (logged): the rebuilt copy goes to the first folder
                        with contextlib.suppress(OSError):
                            c.root.unlink(key.parts, key.name, CHUNK)
        if cols is not None:
            self.caches[first].note(key, "cached")
            return cols, True
        return self.caches[first].load(key, build, shared)  # looks once more, then locks and builds

    def exists(self, key: ChunkKey) -> bool:
        return any(c.exists(key) for c in self.caches)

    def stat(self, key: ChunkKey) -> os.stat_result | None:
        return next((st for st in (self.caches[i].stat(key) for i in self.order(key)) if st is not None), None)

    def path(self, key: ChunkKey) -> Path:
        """Where ``key``'s file is, else where it would be written."""
        return self.root_of(key).where(key.parts, key.name)

    def root_of(self, key: ChunkKey):
        """The folder (a :class:`gpuload.cache.fs.CacheRoot`) holding ``key``'s file, else the one it would go to."""
        for i in self.order(key):
            if self.caches[i].exists(key):
                return self.caches[i].root
        return self.caches[(self._writable(key) or self.order(key))[0]].root

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
    def where(self) -> str:
        """The folders chunks go to now, for messages (those left out not named)."""
        left = [str(c.root.path) for j, c in enumerate(self.caches) if j not in self._failed]
        return ", ".join(left) or "no folder: they are read from Parquet"

    @property
    def max_bytes(self) -> int | None:
        budgets = [c.max_bytes for c in self.caches]
        return None if None in budgets else sum(budgets)

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
        """:meth:`ChunkCache.room` added up over the folders that have not failed (folders on one
        filesystem without a budget share its free space: counted once)."""
        rooms: dict = {}
        for i, c in enumerate(self.caches):
            if i not in self._failed:
                room, others = c.room(groups, need)
                where = (i,) if c.max_bytes is not None else ("fs", os.stat(c.root.path).st_dev)
                rooms[where] = max(rooms.get(where, (0, 0)), (room, others))
        return sum(r for r, _ in rooms.values()), sum(o for _, o in rooms.values())

    #: whether some folder writes (reads) around the page cache; set on every folder (:class:`ChunkCache`)
    direct_writes = _every_folder("direct_writes")
    direct_reads = _every_folder("direct_reads")

    @property
    def pending_writes(self) -> int:
        """Chunks that may wait for the folders' writers at once."""
        return sum(c.pending_writes for c in self.caches)

    def touch_spec(self, key_spec: str, desc: list) -> None:
        for c in self.caches:  # each folder describes its own column sets (`gpuload cache info`)
            c.touch_spec(key_spec, desc)
