"""Cache file system: every open, write, rename, lock and delete inside the cache root.

gpuload deletes only files it wrote, only inside the cache root, and never follows a
symbolic link out of it (docs/architecture.md, Invariants 10). This module is the only place that
touches paths below the root, and it keeps that promise by construction:

* The root itself is resolved once (it may be a link to an NVMe mount). Every folder
  below it is opened one component at a time with ``O_NOFOLLOW | O_DIRECTORY`` and
  used as ``dir_fd`` for the next step, so a link or a file planted where gpuload
  expects its own folder is never entered (:class:`ForeignEntry`).
* Cache files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only if ``fstat``
  says they are regular files: a FIFO, a device, a folder or a link at a chunk's
  name is never read, and never blocks a reader.
* A name is deleted only if ``lstat`` says it is a regular file and it is one of the
  names gpuload writes (:data:`CHUNK`, :data:`TEMP`, :data:`LOCK`, ...). Unlinking a
  name never touches the file another name (a hard link) keeps.
* Files are written to a new temporary name (``O_EXCL``), fsynced and renamed over
  the final name only if that name is absent or a regular file.
* Locks are ``flock`` on a lock file opened the same way; a lock counts only while
  the lock file's name still points to the locked file (a ``cache clear`` that
  removed it meanwhile makes the taker retry with a fresh one).

Every failure is an ``OSError`` (``ForeignEntry`` for something gpuload did not put
there), so callers can degrade with one ``except OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["CacheRoot", "Lock", "ForeignEntry", "CHUNK", "FOOTER", "VOCAB", "USES", "TEMP", "LOCK", "FOLDER", "LAYOUT",
           "SPEC", "kind_of"]

_HEX = r"[0-9a-f]{16}"
CHUNK = re.compile(rf"{_HEX}-{_HEX}-\d+-\d+\.glc")  #: a chunk file: <spec>-<version>-<rg start>-<rg stop>.glc
FOOTER = re.compile(rf"{_HEX}\.footer")  #: a source file's Parquet footer: <version>.footer
#: in ``vocab/``: a counted vocabulary <key>.vocab, a filter's kept rows <key>.kept, or a remote source's
#: last listing <key>.listing
VOCAB = re.compile(rf"{_HEX}\.(?:vocab|kept|listing)")
USES = re.compile(rf"{_HEX}\.groups")  #: in ``uses/``: the source folders and column set a dataset reads (mtime: last use)
TEMP = re.compile(rf"(?:{CHUNK.pattern}|{_HEX}\.json|{FOOTER.pattern}|{VOCAB.pattern}|{USES.pattern})"
                  rf"\.tmp\.\d+\.[0-9a-f]{{8}}")  #: a writer's temporary file
#: a chunk's, vocabulary's or the budget's lock, a dataset's live readers' (``uses/<key>.groups.lock``), or
#: the records' own (``uses/.uses.lock``)
LOCK = re.compile(rf"(?:{CHUNK.pattern}|{VOCAB.pattern}|{USES.pattern}|\.budget|\.uses)\.lock")
SPEC = re.compile(rf"{_HEX}\.json")  #: a column-set description in ``specs/``
FOLDER = re.compile(_HEX)  #: one source file's folder
LAYOUT = re.compile(r"v\d+")  #: one format version's folder

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RETRIES = 200  # attempts when a concurrent `cache clear` removes folders or lock files under us


class ForeignEntry(OSError):
    """Something gpuload did not create sits where it expects its own folder or file."""


def kind_of(mode: int) -> str:
    """A short name for the file type of ``mode`` ("regular file", "symbolic link", ...)."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _plain_name(name: str) -> None:
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ForeignEntry(errno.EINVAL, f"{name!r} is not a plain name inside the cache")


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


class CacheRoot:
    """The cache directory, and safe operations on the folders and files below it.

    ``parts`` arguments name folders below the root (e.g. ``("v3", "ab12...")``).

    Parameters
    ----------
    root : the cache directory. Resolved once: it may itself be a symbolic link.
    """

    def __init__(self, root):
        self.path = Path(os.path.realpath(Path(root).expanduser()))

    def where(self, parts, name: str = "") -> Path:
        """The path of ``name`` in folder ``parts`` (for messages)."""
        return self.path.joinpath(*parts, name) if name else self.path.joinpath(*parts)

    @contextmanager
    def folder(self, parts, create: bool = False) -> Iterator[int]:
        """A descriptor of folder ``parts``, opened without following links (created if ``create``).

        Raises ``FileNotFoundError`` if a folder is missing (and not ``create``),
        :class:`ForeignEntry` if a component is a link or not a folder.
        """
        for part in parts:  # one plain name each: never "..", never a path
            _plain_name(part)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.path, exist_ok=True)  # the whole cache was deleted meanwhile
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                for _ in range(_RETRIES):
                    try:
                        nxt = os.open(part, _DIR, dir_fd=fd)
                        break
                    except FileNotFoundError:
                        if not create:
                            raise
                    except (NotADirectoryError, OSError) as e:
                        if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                            st = _lstat(part, fd)
                            what = kind_of(st.st_mode) if st else "entry"
                            raise ForeignEntry(errno.ENOTDIR, f"{self.where(parts[:i + 1])} is a {what}, not a "
                                               "folder gpuload made; remove it") from None
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass  # made by someone else meanwhile: open it
                else:
                    raise FileNotFoundError(errno.ENOENT, f"{self.where(parts[:i + 1])} keeps disappearing")
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def open_read(self, parts, name: str) -> int:
        """A read-only descriptor of regular file ``name`` (never blocks, never follows a link).

        Raises ``FileNotFoundError`` when absent, :class:`ForeignEntry` when the name is
        not a regular file, other ``OSError`` (e.g. ``PermissionError``) as they come.
        """
        _plain_name(name)
        with self.folder(parts) as d:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise ForeignEntry(errno.ELOOP, f"{self.where(parts, name)} is a symbolic link, not a "
                                   "gpuload cache file; remove it") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise ForeignEntry(errno.EINVAL, f"{self.where(parts, name)} is a {kind_of(st.st_mode)}, not a "
                                   "gpuload cache file; remove it")
            return fd

    def lstat(self, parts, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` in folder ``parts``; None when it (or its folder) is absent."""
        _plain_name(name)
        try:
            with self.folder(parts) as d:
                return _lstat(name, d)
        except FileNotFoundError:
            return None

    def write(self, parts, name: str, fill: Callable[[int], None], durable: bool = True) -> os.stat_result:
        """Create regular file ``name`` atomically: ``fill(fd)`` writes a new temporary file,
        which is fsynced and renamed over ``name`` (then the folder fsynced). Returns the new
        file's ``fstat``. ``durable=False`` leaves out both fsyncs: for a file checked whole on
        every read and made again when it is missing or torn (a crash of the machine may lose it,
        never make a wrong one be served); default True.

        Refuses (:class:`ForeignEntry`) when ``name`` is something other than a regular file.
        """
        _plain_name(name)
        with self.folder(parts, create=True) as d:
            tmp = f"{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=d)
            try:
                try:
                    fill(fd)
                    if durable:
                        os.fsync(fd)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                old = _lstat(name, d)
                if old is not None and not stat.S_ISREG(old.st_mode):
                    raise ForeignEntry(errno.EEXIST, f"{self.where(parts, name)} is a {kind_of(old.st_mode)}, "
                                       "not a gpuload cache file; remove it")
                os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                after = _lstat(name, d)  # the rename changed its ctime, part of its identity (file_identity)
                if after is not None and (after.st_dev, after.st_ino) == (st.st_dev, st.st_ino):
                    st = after
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=d)
                except OSError:
                    pass
                raise
            if durable:
                with contextlib.suppress(OSError):
                    os.fsync(d)
            return st

    def probe_write(self, parts, name: str) -> None:
        """Raise the ``OSError`` that writing ``name`` would meet now (no permission, a
        read-only file system, no inodes, something not a folder on the way): creates the
        folders and an empty temporary file of the name :meth:`write` would use, then removes it."""
        _plain_name(name)
        with self.folder(parts, create=True) as d:
            tmp = f"{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                             dir_fd=d))
            try:
                os.unlink(tmp, dir_fd=d)
            except FileNotFoundError:  # another writer of the chunk cleared its leftover temporaries meanwhile
                pass

    def unlink(self, parts, name: str, pattern: re.Pattern) -> os.stat_result | None:
        """Delete ``name`` if it is a regular file whose name matches ``pattern``; returns
        its ``lstat`` if it was deleted, else None."""
        if not isinstance(name, str) or not pattern.fullmatch(name):
            return None
        try:
            with self.folder(parts) as d:
                st = _lstat(name, d)
                if st is None or not stat.S_ISREG(st.st_mode):
                    return None
                os.unlink(name, dir_fd=d)
                return st
        except FileNotFoundError:
            return None

    def names(self, parts) -> list[str]:
        """The names in folder ``parts`` (empty if it is absent); not ``lstat``-ed: check each
        before use (:meth:`unlink` does)."""
        try:
            with self.folder(parts) as d:
                return os.listdir(d)
        except FileNotFoundError:
            return []

    def scan(self, parts) -> list[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of each entry of folder ``parts`` (empty if it is absent)."""
        out = []
        try:
            with self.folder(parts) as d:
                for name in os.listdir(d):
                    st = _lstat(name, d)
                    if st is not None:
                        out.append((name, st))
        except FileNotFoundError:
            pass
        return out

    def rmdir(self, parts, name: str) -> bool:
        """Remove folder ``name`` of ``parts`` if it is an empty real folder; True if removed."""
        try:
            with self.folder(parts) as d:
                os.rmdir(name, dir_fd=d)  # never follows a link: a link gives ENOTDIR
            return True
        except OSError:
            return False


class Lock:
    """An exclusive ``flock`` on lock file ``name`` of folder ``parts`` (created if missing);
    ``shared=True``: a shared one (many holders at once, none while an exclusive one is held).

    Released by the OS when the process dies. Not tied to a thread: any thread may
    :meth:`release` it. Raises ``OSError`` when the lock file cannot be made or opened
    (read-only cache, no space or inodes, too many open files, a link or folder there).
    """

    def __init__(self, root: CacheRoot, parts, name: str, shared: bool = False):
        self.root, self.parts, self.name = root, tuple(parts), name
        self._mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self._fd: int | None = None

    def acquire(self, blocking: bool = True, timeout: float | None = None,
                meanwhile: Callable[[], bool] | None = None) -> bool:
        """Take the lock; returns False if it was not taken.

        ``blocking=False``: one try. ``timeout`` (seconds, with ``blocking``): give up
        after that long, polling with a growing pause; ``meanwhile()`` is called between
        tries and a True result gives up at once (e.g. the holder built the chunk).
        """
        if not blocking or timeout is None:
            return self._acquire(blocking)
        deadline, pause = time.monotonic() + timeout, 0.002
        while not self._acquire(False):
            if (meanwhile is not None and meanwhile()) or time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.1)
        return True

    def _acquire(self, blocking: bool) -> bool:
        _plain_name(self.name)
        for _ in range(_RETRIES):
            with self.root.folder(self.parts, create=True) as d:
                try:
                    fd = os.open(self.name, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                 0o666, dir_fd=d)
                except FileNotFoundError:
                    continue  # the folder was removed meanwhile
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.EISDIR):
                        raise ForeignEntry(e.errno, f"{self.root.where(self.parts, self.name)} is not a lock file "
                                           "gpuload made; remove it") from None
                    raise
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise ForeignEntry(errno.EINVAL, f"{self.root.where(self.parts, self.name)} is a "
                                           f"{kind_of(st.st_mode)}, not a lock file gpuload made; remove it")
                    try:
                        fcntl.flock(fd, self._mode | (0 if blocking else fcntl.LOCK_NB))
                    except BlockingIOError:
                        os.close(fd)
                        return False
                    now = _lstat(self.name, d)
                except BaseException:
                    os.close(fd)
                    raise
                if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    self._fd = fd
                    return True
                os.close(fd)  # removed (or replaced) while we waited: lock the current one
        raise OSError(errno.EAGAIN, f"{self.root.where(self.parts, self.name)}: could not take the lock "
                      "(its lock file keeps being removed)")

    def release(self) -> None:
        """Give the lock back (closing the descriptor drops the ``flock``)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "Lock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
