"""Cache eviction: what live readers need, and the least recently used chunks deleted to make room.

Every reader of a cache folder (a dataset, a Mix's source, a ``build_cache``) registers
what it reads: the *groups* of its chunks, one ``(source folder, column set)`` pair per
source file, in a record shared by every reader of the same dataset::

    <cache_dir>/v3/uses/<key>.groups        "<source folder> <spec>" per line; its mtime is the last use
    <cache_dir>/v3/uses/<key>.groups.lock   flock'ed *shared* by each live reader of that dataset

A reader holds its shared lock for as long as it is open; the OS drops it when the
process ends or is killed, so a killed reader's registration expires at once, on every
host that shares the kernel (``flock``: the cache must be on a local filesystem, as it
should be anyway). A writer that needs room (:func:`make_room`, called holding the
folder's budget lock) lists the chunk files, then takes ``uses/.uses.lock``
exclusively and tries each record's lock *exclusively* without waiting: a record it
cannot lock has a live reader, and every chunk of its groups is kept; the others only
date their groups' last use. It deletes chunk files of the current format, least
recently used first (a group's last use, else the file's own mtime), until the room is
made, and only then lets ``.uses.lock`` go. Readers register (make or join a record and
take its shared lock) holding ``.uses.lock`` shared, so one that opens during an
eviction waits for its deletions (milliseconds) instead of losing chunks under it. A
live reader whose record cannot be read protects everything: nothing is evicted then.

What is kept is a superset of what any live reader's epochs still need (all its chunks,
not only the rest of this epoch), so a dataset larger than its budget keeps a stable part
cached and streams the rest, instead of evicting its own chunks every epoch. Only
regular files with a chunk's name are deleted (:mod:`gpuload.cache.fs`), never a file
gpuload did not write; a reader that has a chunk open keeps reading it (POSIX unlink).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import weakref
from dataclasses import dataclass, field

import xxhash

from .admin import chunk_files, drop_free_lock
from .chunkfile import LAYOUT_DIR, USES_DIR
from .directio import pwrite_all
from .fs import CHUNK, LOCK, USES, CacheRoot, Lock

__all__ = ["USES_DIR", "Registration", "register", "Survey", "survey", "make_room", "usage", "datasets"]

log = logging.getLogger("gpuload")

_PARTS = (LAYOUT_DIR, USES_DIR)
_PATIENCE = 10.0  # seconds a reader waits for an eviction that holds its record (milliseconds, normally)
_FOLDER_LOCK = ".uses.lock"  # shared by readers registering, exclusive while an eviction decides and deletes


class Registration:
    """A live reader's hold on its dataset's record (see the module doc); :meth:`touch` dates
    its use, :meth:`release` (or the object's collection, or the process's end) lets it go."""

    def __init__(self, root: CacheRoot, name: str, lock: Lock):
        self.root, self.name, self._lock = root, name, lock
        self._finalizer = weakref.finalize(self, lock.release)

    def touch(self) -> None:
        """Date the dataset's use now (the record's mtime; best effort)."""
        with contextlib.suppress(OSError):
            with self.root.folder(_PARTS) as d:
                os.utime(self.name, dir_fd=d, follow_symlinks=False)

    def release(self) -> None:
        self._finalizer()


def _text(groups) -> str:
    return "".join(f"{folder} {spec}\n" for folder, spec in sorted(set(groups)))


def register(root: CacheRoot, groups) -> Registration | None:
    """Register a live reader of ``groups`` (``(source folder, spec)`` pairs) in ``root``;
    None when the folder cannot hold its lock (read-only: nothing is written there either,
    so nothing of ours can be evicted from it). A record that cannot be written leaves the
    lock held alone: evictions then keep everything (a warning says so)."""
    text = _text(groups)
    name = xxhash.xxh64_hexdigest(text.encode()) + ".groups"
    folder = Lock(root, _PARTS, _FOLDER_LOCK, shared=True)  # no eviction between our record and its lock
    lock = Lock(root, _PARTS, name + ".lock", shared=True)
    try:
        ok = folder.acquire(timeout=_PATIENCE) and lock.acquire(timeout=_PATIENCE)
    except OSError as e:  # no lock here (a read-only folder: nothing of ours can be evicted from it either)
        ok = False
        log.debug("gpuload: cannot register this reader in %s (%s)", root.path, e)
    else:
        if not ok:
            log.warning("gpuload: %s has been locked for %g s by a process making room in the cache; this "
                        "dataset's chunks are not protected from eviction", root.where(_PARTS), _PATIENCE)
    if not ok:
        lock.release()
        folder.release()
        return None
    try:
        st = root.lstat(_PARTS, name)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != len(text):
            root.write(_PARTS, name, lambda fd: pwrite_all(fd, text.encode(), 0))
    except OSError as e:  # the lock alone keeps everything here from eviction (an unreadable live record)
        log.debug("gpuload: cannot write this reader's record in %s (%s); while it is open nothing is evicted "
                    "from this cache folder", root.where(_PARTS), e.strerror or e)
    finally:
        folder.release()
    reg = Registration(root, name, lock)
    reg.touch()
    return reg


def _groups(root: CacheRoot, name: str) -> set[tuple[str, str]] | None:
    """The groups of record ``name``, None when it cannot be read."""
    try:
        fd = root.open_read(_PARTS, name)
    except OSError:
        return None
    with open(fd, "rb") as f:
        lines = f.read().decode("ascii", "replace").splitlines()
    out = set()
    for line in lines:
        parts = line.split()
        if len(parts) != 2:
            return None
        out.add((parts[0], parts[1]))
    return out


@dataclass
class Survey:
    """The records of a cache folder, looked at once: what live readers keep, and each other
    group's last use."""

    kept: set = field(default_factory=set)  #: groups some live reader reads
    last_use: dict = field(default_factory=dict)  #: group -> latest mtime of the free records naming it
    unknown: bool = False  #: a live reader whose record cannot be read: evict nothing
    free: dict = field(default_factory=dict)  #: record name -> its groups, for records no reader holds
    records: dict = field(default_factory=dict)  #: record name -> (its groups, its mtime, live), every record file


def survey(root: CacheRoot) -> Survey:
    """Look at every record of ``root`` (see the module doc); never waits for a reader. What it
    says holds while ``.uses.lock`` is held exclusively (:func:`make_room`)."""
    out = Survey()
    try:
        entries = dict(root.scan(_PARTS))
    except OSError:
        entries = {}
    names = {n[:-5] for n in entries if LOCK.fullmatch(n)} | {n for n in entries if USES.fullmatch(n)}
    for name in sorted(n for n in names if USES.fullmatch(n)):
        lock = Lock(root, _PARTS, name + ".lock")
        try:
            free = lock.acquire(blocking=False)
        except OSError:  # a read-only folder: nothing can be deleted there anyway
            free = False
        finally:
            lock.release()
        groups = _groups(root, name)
        st = entries.get(name)
        when = st.st_mtime if st is not None else 0.0
        if st is not None:  # (a lock without its record: a reader writing it)
            out.records[name] = (groups or set(), when, not free)
        if free:
            for g in groups or ():
                out.last_use[g] = max(out.last_use.get(g, 0.0), when)
            out.free[name] = groups or set()
        elif groups is None:
            out.unknown = True
        else:
            out.kept |= groups
    return out


def make_room(root: CacheRoot, nbytes: int) -> int:
    """Delete unneeded chunk files of ``root``, least recently used first, until ``nbytes``
    are freed (or nothing more may go); the bytes freed. Call it holding the folder's
    budget lock. Free records whose groups have no chunk left are deleted too."""
    files = [(parts, name, st) for parts, name, st in chunk_files(root)]  # the long part, before any lock
    folder = Lock(root, _PARTS, _FOLDER_LOCK)
    try:
        if not folder.acquire(timeout=_PATIENCE):
            return 0
    except OSError:  # no records can be kept here (a read-only folder): nothing can be deleted either
        return 0
    freed = 0
    try:
        s = survey(root)
        if s.unknown:
            log.debug("gpuload: a live reader of %s has an unreadable record; nothing evicted", root.path)
            return 0
        left: dict = {}
        candidates = []
        for parts, name, st in files:
            group = (parts[1], name[:16])
            left[group] = left.get(group, 0) + 1
            if group not in s.kept:
                candidates.append((s.last_use.get(group, st.st_mtime), parts, name, group))
        for _, parts, name, group in sorted(candidates):
            if freed >= nbytes:
                break
            with contextlib.suppress(OSError):
                gone = root.unlink(parts, name, CHUNK)
                if gone is not None:
                    freed += gone.st_size
                    left[group] -= 1
                    log.debug("gpuload: evicted %s (%d bytes)", root.where(parts, name), gone.st_size)
        for name, groups in s.free.items():  # records of datasets none of whose chunks are left
            if not any(left.get(g) for g in groups):
                with contextlib.suppress(OSError):
                    root.unlink(_PARTS, name, USES)
                    drop_free_lock(root, _PARTS, name + ".lock")
    finally:
        folder.release()
    return freed


def usage(root: CacheRoot, mine) -> tuple[int, int]:
    """(bytes of chunks other live readers keep, outside the groups ``mine``; bytes of all
    chunk files) in ``root``."""
    kept = survey(root).kept - set(mine)
    others = used = 0
    for parts, name, st in chunk_files(root):
        used += st.st_size
        others += st.st_size if (parts[1], name[:16]) in kept else 0
    return others, used


def datasets(root: CacheRoot) -> list[dict]:
    """Each dataset recorded in ``root``: ``{"record", "files", "specs", "chunks", "bytes",
    "last_used" (epoch seconds), "live" (a reader has it open)}``, most recently used first."""
    per_group: dict = {}
    for parts, name, st in chunk_files(root):
        c = per_group.setdefault((parts[1], name[:16]), [0, 0])
        c[0] += 1
        c[1] += st.st_size
    out = []
    for name, (groups, when, live) in survey(root).records.items():
        out.append({"record": name[:16], "files": len({f for f, _ in groups}), "specs": sorted({p for _, p in groups}),
                    "chunks": sum(per_group.get(g, (0, 0))[0] for g in groups),
                    "bytes": sum(per_group.get(g, (0, 0))[1] for g in groups), "last_used": when, "live": live})
    return sorted(out, key=lambda d: -d["last_used"])
