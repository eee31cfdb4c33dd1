"""Cache store: converted chunks on local disk, got or built by :class:`ChunkKey`, one file per chunk.

File names and the cache folder are in :mod:`gpuload.cache.paths`, the file format in
:mod:`gpuload.cache.chunkfile`.

Writes go to a temporary name in the same folder, are fsynced and renamed into place:
a reader sees a complete file or none. Each chunk has a lock file (``flock``, released
by the OS when a process dies) so concurrent builders build it once. Reads take no
lock, so a read-only cache built by another user is served as it is.

Failure never costs data: a cache file that cannot be read, locked or written (no
permission, no space or inodes, a read-only cache, a concurrent ``cache clear``,
something foreign at its name) is decoded from Parquet and served anyway, with one
warning per kind of problem; a corrupt file is rebuilt, never served. Every path
operation goes through :mod:`gpuload.cache.fs`, which never leaves the cache root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Callable, Iterator

from ..batch import nbytes, nrows
from . import admin
from .admin import chunk_files
from .specs import record_spec
from .chunkfile import LAYOUT_DIR, encode, file_identity, read_regions, write_regions
from .fs import FOOTER, CHUNK, TEMP, CacheRoot, Lock
from .paths import ChunkKey, cache_folder, default_cache_dir
from .evict import Registration, register, survey
from .space import Space
from .writer import PENDING, Writer, Writing
from ..errors import ConfigError, CorruptCacheError

__all__ = ["ChunkCache", "ChunkKey", "Writing", "default_cache_dir"]  # all but the first from .paths and .writer, importable here too

log = logging.getLogger("gpuload")

#: seconds a chunk's lock is waited for once another lock's wait ran out (its holder likely stopped)
STALLED_PATIENCE = 5.0


class ChunkCache:
    """A cache directory: get-or-build chunks, with locking, a size budget and checks.

    Parameters
    ----------
    root : the cache directory (created if missing and ``create``).
    max_bytes : budget for chunk files in bytes; None (default): the folder's quota, else
        the disk's reserve (:mod:`gpuload.cache.space`). A chunk that does not fit makes room
        by evicting least recently used chunks no live reader needs (:mod:`gpuload.cache.evict`),
        else it is not written (it is read from Parquet every epoch instead).
    verify : ``True`` (default): compare a file's checksums the first time this
        process reads it (again whenever the file changes); ``"always"``: on every
        read; ``False``: never (the header and identity are still checked).
    read : ``read(fd, path, identity, verify, verified) -> column set`` (default:
        :func:`gpuload.cache.chunkfile.read_regions` into host memory; the GPU path passes a
        KvikIO reader into device memory).
    to_host : ``to_host(column set) -> host column set`` the writer may keep (default: the
        columns themselves; see ``shared`` in :meth:`load`).
    trust_writes : count files this process wrote as checked (default False).
    metrics : a :class:`gpuload.Metrics` recording ``cache_read``/``cache_write`` spans.
    alloc : ``alloc(nbytes) -> uint8 array`` for host reads (default: new arrays).
    create : create ``root`` if missing (default True); else a missing root is a
        :class:`CacheError` (the ``cache info/verify/clear`` commands).
    lock_patience : seconds to wait for a chunk's lock held by another process (a
        builder of the same chunk) before decoding the chunk here without caching it
        (default 60; a stopped or hung holder never blocks a reader longer). Once a wait has run
        out, a chunk whose lock is still held is decoded at once, and other held locks are
        waited for ``STALLED_PATIENCE`` seconds at most (such a holder likely holds several).

    Attributes
    ----------
    outcomes : None (default), or a dict that then receives, per chunk file (its
        :meth:`ChunkKey.relpath`), what became of it here: ``"cached"`` (read from the
        cache), ``"other"`` (another process wrote it while this one waited for its lock),
        ``"written"`` (built and written here), ``"budget"`` (built, not written: the budget
        is full), ``"held"`` (built, not written: another process held its lock too long) or
        the ``OSError`` that kept it from being written (builds count what they did with it).
    """

    def __init__(self, root, max_bytes: int | None = None, verify: bool | str = True,
                 read: Callable | None = None, to_host: Callable | None = None, trust_writes: bool = False,
                 metrics=None, alloc: Callable | None = None, create: bool = True, lock_patience: float = 60.0):
        self.root = CacheRoot(cache_folder(root, create))
        self.metrics = metrics
        self._read_fn, self._alloc = read, alloc  # (no closure over self: a dropped cache is freed at once)
        self._to_host = to_host
        self._trust_writes = trust_writes
        self._verified: set[tuple] = set()
        self._warned: set = set()
        self._held: set[str] = set()  # chunks whose lock a holder kept past our patience: not waited for again
        self._writer = Writer()  # without a budget, chunks are written on its thread
        try:  #: the room for chunks: budget, quota or reserve, and eviction (:mod:`gpuload.cache.space`)
            self.space = Space(self.root, max_bytes, lock_patience)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.verify = verify
        self.registration: Registration | None = None  # this reader's record (:meth:`register`)
        #: ``spill(cache, key, host cols, why) -> bool``: another drive's write of a chunk this one could not
        #: take (:class:`gpuload.cache.drives.Drives`); None: the chunk is not cached
        self.spill: Callable | None = None
        self.outcomes: dict | None = None
        #: write chunk files, and read them into host memory, around the page cache where the file
        #: system allows (:mod:`gpuload.cache.directio`; the reader sets them: :func:`gpuload.memory.cache_io_modes`)
        self.direct_writes = self.direct_reads = False
        if create:
            with contextlib.suppress(OSError):  # a read-only cache is still served
                with self.root.folder((LAYOUT_DIR,), create=True):
                    pass

    def path(self, key: ChunkKey) -> Path:
        """Where ``key``'s chunk file is (or would be)."""
        return self.root.where(key.parts, key.name)

    def root_of(self, key: ChunkKey) -> CacheRoot:
        """The cache folder of ``key``'s file: :attr:`root` (:class:`gpuload.cache.drives.Drives`: where it is)."""
        return self.root

    def note(self, key: ChunkKey, outcome) -> None:
        """Record what became of ``key``'s file here, when :attr:`outcomes` is on."""
        if self.outcomes is not None:
            self.outcomes[key.relpath()] = outcome

    def probe(self, key: ChunkKey) -> None:
        """Raise the ``OSError`` that writing ``key``'s file would meet now (see
        :meth:`gpuload.cache.fs.CacheRoot.probe_write`); nothing is left behind."""
        self.root.probe_write(key.parts, key.name)

    def _warn(self, kind: str, text: str) -> None:
        """Log ``text`` as a warning the first time a problem of ``kind`` happens, then at debug level."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, "gpuload: %s", text)

    # -- get or build -------------------------------------------------------------------
    def load(self, key: ChunkKey, build: Callable[[], dict], shared: bool = True) -> tuple[dict, bool]:
        """The chunk's column set, and whether it came from the cache.

        Reads the cached file if present and valid. Otherwise, holding the chunk's
        lock, calls ``build()`` -> column set and writes it if the budget allows. A
        corrupt file is rebuilt, never served; a file that cannot be read, locked or
        written is decoded and served anyway (one warning per kind of problem).

        Without a budget the write (and its fsync) happens on a background writer
        thread that keeps the chunk's lock until the file is in place, so decoding
        goes on meanwhile. :meth:`flush` waits for pending writes. ``shared=True``
        (default) says the caller may hand views of the columns to code that changes
        them in place: such a chunk being written comes back as a :class:`Writing`, and the
        caller waits for its ``written`` before anyone sees it (the writer makes no copy of it:
        less memory, ``docs/benchmarks.md``, "The writer's copy in file order").
        """
        cols, unreadable, missing = self.look(key)
        if cols is not None:
            self._held.discard(key.name)  # its holder finished it after all
            self.note(key, "cached")
            return cols, True
        lock = Lock(self.root, key.parts, key.name + ".lock")
        built: list = []  # the chunk, when another process writes it while this one waits for its lock
        before = None if missing else self._inode(key)  # what was there (corrupt or unreadable) when we looked
        patience = self._patience(key)
        try:
            got = lock.acquire(timeout=patience, meanwhile=lambda: self._built_meanwhile(key, before, built))
        except OSError as e:
            why = unreadable if unreadable is not None else e
            cols = build()
            if self.spill is None or not self.spill(self, key, self._host(cols), why):  # another drive? (written now)
                self._warn(f"lock{why.errno}", f"cannot use the cache for {self.path(key)} ({why.strerror or why}); "
                           "such chunks are decoded from Parquet every time and not cached")
                self.note(key, why)
            return cols, False
        if built or got:  # its holder finished it, or let go
            self._held.discard(key.name)
        if built:
            self.note(key, "other")
            return built[0], True
        if not got:  # a stopped or hung process holds it: do not wait for it forever, nor again
            self._warn("held", f"{self.path(key)} has been locked by another process for {patience:g} s; "
                       "decoding such chunks here without caching them")
            self._held.add(key.name)
            self.note(key, "held")
            return build(), False
        if unreadable is not None:
            self._warn(f"read{unreadable.errno}", f"cannot read cache file {self.path(key)} ({unreadable}); "
                       "rebuilding it from its source")
        return self._build_locked(key, build, shared, lock)

    def _patience(self, key: ChunkKey) -> float:
        """Seconds to wait for ``key``'s lock: none where a wait for it ran out before, ``STALLED_PATIENCE``
        at most once any wait ran out (the holder likely holds others), else ``lock_patience``."""
        if key.name in self._held:
            return 0.0
        return min(self.lock_patience, STALLED_PATIENCE) if self._held else self.lock_patience

    def look(self, key: ChunkKey) -> tuple[dict | None, OSError | None, bool]:
        """First look, without the lock: (the chunk's columns, None, False) when its file is cached
        and valid; else (None, the ``OSError`` that kept the file from being read, or None when it
        is missing or corrupt: a corrupt one is logged and rebuilt; whether it, or its folder, is missing)."""
        try:
            return self._read(key), None, False
        except FileNotFoundError:
            log.debug("gpuload: %s is not cached yet", self.path(key))
            return None, None, True
        except CorruptCacheError as e:
            log.warning("gpuload: %s; rebuilding it from its source", str(e))  # not e: a record kept (a log
            # handler's, pytest's) would keep its traceback, and with it this cache and its writer threads
        except OSError as e:  # no permission, a link or FIFO at its name, too many open files...
            return None, e, False
        return None, None, False

    def _built_meanwhile(self, key: ChunkKey, before: tuple | None, built: list) -> bool:
        """While waiting for ``key``'s lock: whether its holder finished the chunk, a new valid
        file in place of ``before`` (its ``(device, inode)`` when first looked at); its
        columns then go into ``built``."""
        now = self._inode(key)
        if now is not None and now != before:  # a new file: writers rename complete files in place
            try:
                built.append(self._read(key))
                return True
            except (CorruptCacheError, OSError):
                pass
        return False

    def _build_locked(self, key: ChunkKey, build: Callable[[], dict], shared: bool, lock: Lock
                      ) -> tuple[dict, bool]:
        """:meth:`load` holding ``key``'s ``lock``: the file another process wrote meanwhile, else
        ``build()`` written (on the background writer, which then releases ``lock``, or within
        the budget). ``lock`` is released here otherwise, whatever happens."""
        try:
            try:
                cols = self._read(key)  # another process built it meanwhile
                self.note(key, "other")
                return cols, True
            except CorruptCacheError:
                self.root.unlink(key.parts, key.name, CHUNK)
            except OSError:
                pass
            stale = self._tidy(key)
            cols = build()
            for name, pattern in stale:  # once the build succeeded: a process whose view of the file is
                with contextlib.suppress(OSError):  # out of date fails it, and must not drop the newer version's
                    self.root.unlink(key.parts, name, pattern)
            if self.max_bytes is None:  # the writer releases the lock
                written = None
                if shared and self._to_host is None:  # it writes these very arrays: not changed meanwhile
                    cols = Writing(cols)
                    written = cols.written
                self._writer.submit(self._write, key, lambda: self._host(cols), lock, self.metrics, written)
                lock = None
            else:  # written before anyone else sees ``cols``, holding the budget's lock
                self._write(key, self._host(cols))
            return cols, False
        finally:
            if lock is not None:
                lock.release()

    def _host(self, cols: dict) -> dict:
        """Host arrays of ``cols`` for the writer: ``to_host``'s (a device chunk copied back), else ``cols``."""
        return self._to_host(cols) if self._to_host is not None else cols

    def _read(self, key: ChunkKey) -> dict:
        """``key``'s columns from its file, checked as :attr:`verify` says (a ``cache_read`` span)."""
        verify, seen = (bool(self.verify), None) if self.verify == "always" or not self.verify else (True, self._verified)
        path = self.path(key)
        fd = self.root.open_read(key.parts, key.name)
        try:
            if self.metrics is None:
                return self._read_file(fd, path, key, verify, seen)
            with self.metrics.span("cache_read") as span:  # a missing or corrupt file records nothing
                cols = self._read_file(fd, path, key, verify, seen)
                span.nbytes, span.rows = nbytes(cols), nrows(cols)
            return cols
        finally:
            os.close(fd)

    def _read_file(self, fd: int, path: Path, key: ChunkKey, verify: bool, seen: set | None) -> dict:
        if self._read_fn is not None:
            return self._read_fn(fd, path, key.identity, verify, seen)
        return read_regions(fd, path, key.identity, verify, seen, self._alloc, self.direct_reads)[1]

    def _write(self, key: ChunkKey, cols: dict, spill: bool = True) -> bool:
        """Write ``key``'s file (a ``cache_write`` span) if :attr:`space` has room; else (or on an
        ``OSError``, warned about and noted) hand it to :attr:`spill` if ``spill``. True if written."""
        try:
            head, regions, arrays, total = encode(cols, key.header_fields())

            def fill(fd):
                if not write_regions(fd, head, regions, arrays, total, self.direct_writes) and self.direct_writes:
                    self.direct_writes = self.direct_reads = False  # the file system refuses direct I/O: buffered

            with self.space.room(total) as why:
                if why is None:
                    if self.metrics is None:
                        st = self.root.write(key.parts, key.name, fill)
                    else:
                        with self.metrics.span("cache_write", rows=nrows(cols)) as span:
                            st = self.root.write(key.parts, key.name, fill)
                            span.nbytes = total
            if why is not None:
                if not (spill and self.spill is not None and self.spill(self, key, cols, why)):
                    self._refused(key, why)
                return False
            if self._trust_writes:
                self._verified.add(file_identity(st))
            self.note(key, "written")
            return True
        except OSError as e:  # disk or inodes full, read-only, a clear meanwhile: the data is still served
            if spill and self.spill is not None and self.spill(self, key, cols, e):
                return False
            self._warn(f"write{e.errno}", f"could not write cache file {self.path(key)} ({e.strerror or e}); "
                       "chunks that are not cached are read from Parquet again")
            self.note(key, e)
            return False

    def _refused(self, key: ChunkKey, why) -> None:
        """Note (and warn about, once per kind) a chunk :attr:`space` had no room for."""
        self.note(key, why)
        if why != "budget":
            self._warn(why if isinstance(why, str) else f"lock{why.errno}", self.space.refusal(why))

    def flush(self) -> None:
        """Wait until every background write has finished (safe from several threads at once)."""
        self._writer.flush()

    def _tidy(self, key: ChunkKey) -> list[tuple[str, object]]:
        """Before ``key`` is built, holding its lock, in one listing of its folder: delete the
        temporaries a killed writer of it left, and return the chunks (same spec) and footers of
        other versions of its source file, ``(name, pattern)``, for the caller to delete once
        the build succeeded (each checked to be a regular file as it is deleted)."""
        try:
            names = self.root.names(key.parts)
        except OSError:  # the folder gone meanwhile (a failed drive): the write says so
            return []
        stale = []
        for name in names:
            if name.startswith(key.name + ".tmp."):
                with contextlib.suppress(OSError):
                    self.root.unlink(key.parts, name, TEMP)
            elif CHUNK.fullmatch(name) and name.startswith(key.spec + "-") and name.split("-")[1] != key.version:
                stale.append((name, CHUNK))
            elif FOOTER.fullmatch(name) and name[:16] not in (key.version, key.footer):
                stale.append((name, FOOTER))
        return stale

    def _inode(self, key: ChunkKey) -> tuple | None:
        """(device, inode) of the regular file at ``key``'s name, or None."""
        st = self.stat(key)
        return None if st is None else (st.st_dev, st.st_ino)

    def exists(self, key: ChunkKey) -> bool:
        """Whether chunk ``key`` has a regular file in the cache (not verified)."""
        return self._inode(key) is not None

    def stat(self, key: ChunkKey) -> os.stat_result | None:
        """The ``lstat`` of ``key``'s regular file, None where it has none (or it cannot be told)."""
        try:
            st = self.root.lstat(key.parts, key.name)
        except OSError:
            return None
        return st if st is not None and stat.S_ISREG(st.st_mode) else None

    # -- room and registration (gpuload.cache.space, gpuload.cache.evict) -----------------
    max_bytes = property(lambda self: self.space.max_bytes, doc="The budget in bytes, or None (the reserve).")
    where = property(lambda self: str(self.root.path), doc="The folder, for messages.")
    reserve = property(lambda self: self.space.reserve, doc="Bytes the disk keeps free (0 under a quota).")
    lock_patience = property(lambda self: self.space.patience, lambda self, s: setattr(self.space, "patience", s),
                             doc="Seconds to wait for a lock another process holds (a chunk's, the budget's).")
    pending_writes = PENDING  #: chunks that may wait for the writer thread at once

    def room(self, groups, need: int) -> tuple[int, int]:
        """(room for the chunks of ``groups``, bytes other live readers keep): :meth:`Space.room_for`."""
        return self.space.room_for(groups, need)

    def register(self, groups) -> None:
        """Keep this reader's chunks (``(source folder, spec)`` groups) from eviction while
        this cache is open (:func:`gpuload.cache.evict.register`), and count them against
        ``max_bytes``; again: the use dated anew."""
        self.space.groups = set(groups)
        if self.registration is None:
            self.registration = register(self.root, groups)
        else:
            self.registration.touch()

    def release(self) -> None:
        """Let this reader's chunks be evicted again, once its pending writes are done (:meth:`register`
        takes them back)."""
        self.flush()  # a pending write that needs room must not evict this reader's own chunks
        reg, self.registration = self.registration, None
        if reg is not None:
            reg.release()

    # -- specs --------------------------------------------------------------------------
    def touch_spec(self, key_spec: str, desc: list) -> None:
        """Record that column set ``desc`` (hash ``key_spec``) is in use now (best effort:
        :func:`gpuload.cache.specs.record_spec`)."""
        try:
            record_spec(self.root, key_spec, desc)
        except OSError as e:  # a read-only cache: nothing to record
            log.debug("gpuload: could not record the use of spec %s (%s)", key_spec, e)

    # -- inspection and maintenance (see gpuload.cache.admin) ------------------------------
    def entries(self) -> Iterator[Path]:
        """Every chunk file (regular file with a chunk's name) of the current format."""
        for parts, name, _ in chunk_files(self.root):
            yield self.root.where(parts, name)

    def temporaries(self) -> Iterator[Path]:
        """Temporary files left by writers that were killed."""
        return admin.temporaries(self.root)

    def specs(self) -> dict[str, dict]:
        """Per spec hash: ``desc``, ``last_used`` (epoch seconds), ``chunks``, ``bytes`` (:func:`gpuload.cache.admin.specs`)."""
        return admin.specs(self.root)

    def summary(self) -> dict:
        """What the cache holds (:func:`gpuload.cache.admin.summary`)."""
        return admin.summary(self.root)

    def verify_all(self, progress=None) -> list:
        """Check every chunk file; a :class:`gpuload.cache.admin.Problem` per bad one."""
        return admin.verify_all(self.root, progress)

    def delete(self, path: Path) -> int:
        """Delete one chunk file by path (:func:`gpuload.cache.admin.delete`); bytes freed."""
        return admin.delete(self.root, path)

    def clear(self, spec: str | None = None, unused_since: float | None = None, include_open: bool = False) -> dict:
        """Delete gpuload's files (:func:`gpuload.cache.admin.clear`), but a column set a live reader has
        open (a running dataset reads it), unless ``include_open``."""
        live = () if include_open else {p for _, p in survey(self.root).kept}  # (folder, spec) groups
        return admin.clear(self.root, spec, unused_since, live)
