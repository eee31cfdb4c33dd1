"""Cache space: the free space every cache leaves on its disk, a cache folder's quota, and a
dataset's own budget.

A GPU node's local disk is shared by every job on it. Without a quota, a cache writes a
chunk only while the filesystem keeps at least a *reserve* free after it:
``RESERVE_FRACTION`` (10%) of the filesystem's size, or ``$GPULOAD_CACHE_RESERVE`` (bytes
with an optional K/M/G/T suffix, or a percentage such as ``"5%"``). A chunk that does not
fit is served from Parquet as any uncached chunk is, with one warning, and later chunks are
written again once space is freed: the cache never fills the disk another job needs. A
*quota* (``gpuload cache quota 500G``: a small file ``quota`` in the cache folder, read
when a dataset opens and every :data:`RETRY_S` seconds after) budgets the whole folder for every process that uses it, in place
of the reserve. ``max_cache_bytes`` budgets one dataset's chunks within that: it counts
only the dataset's own chunk files, is never met by evicting (not others', which do not
count against it, nor its own), and the quota or reserve still hold.

:class:`Space` applies these to each chunk write. When a chunk does not fit the quota or
reserve, the writer takes the folder's budget lock and makes room by evicting the least
recently used chunks no live reader needs (:func:`gpuload.cache.evict.make_room`); only if
that is not enough is the chunk left uncached, and the folder is then not surveyed again
for :data:`RETRY_S` seconds. An eviction makes room for several chunks at once (eight of
this one's size, at most a sixteenth of a quota), so the surveys come once per several
writes, not per write. Under a quota or ``max_cache_bytes`` the check and the write happen
under the lock, so they hold exactly; with the reserve the common case takes no lock, and
racing writers may each go at most one chunk below it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from .admin import chunk_files
from .chunkfile import LAYOUT_DIR
from .evict import make_room, usage
from .fs import CacheRoot, Lock
from ..errors import flag, setting
from ..memory import size_text

log = logging.getLogger("gpuload")

__all__ = ["warn_short_room", "RESERVE_FRACTION", "RETRY_S", "QUOTA_FILE", "Space", "parse_size", "reserve_bytes", "free_bytes",
           "read_quota", "write_quota", "used_bytes"]

RESERVE_FRACTION = 0.10
RETRY_S = 30.0
_SLACK = 8  # an eviction frees room for this many chunks, so the next ones need no survey
QUOTA_FILE = "quota"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"500G"``, ``"1.5T"``, ``"123456"`` (bytes; K/M/G/T are powers of 1024, an optional
    trailing B or iB ignored) as bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _fs(path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def free_bytes(path) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem."""
    return _fs(path)[1]


def reserve_bytes(path) -> int:
    """The free space caches leave on ``path``'s filesystem (see the module doc); ValueError
    naming ``GPULOAD_CACHE_RESERVE`` when it is set to something else than a size or percentage."""
    text = os.environ.get("GPULOAD_CACHE_RESERVE", "").strip()
    size = _fs(path)[0]
    if not text:
        return int(size * RESERVE_FRACTION)
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0 <= share <= 1:
                raise ValueError
            return int(size * share)
        return parse_size(text)
    except ValueError:
        raise ValueError(f"GPULOAD_CACHE_RESERVE={text!r} in the environment: give bytes (e.g. 20G) or a share "
                         "of the filesystem (e.g. 5%)") from None


_said_quota: set = set()  # damaged quota files warned of (path, text): once each per process


def read_quota(root: CacheRoot) -> int | None:
    """The cache folder's quota in bytes, or None (no quota; a quota file that cannot be read or
    says no size is warned of, once, and counts as none)."""
    try:
        fd = root.open_read((), QUOTA_FILE)
    except FileNotFoundError:
        return None
    except OSError as e:
        text = f"cannot be read ({e.strerror or e})"
    else:
        with open(fd, "rb") as f:
            raw = f.read(64).decode("ascii", "replace")
        try:
            return parse_size(raw)
        except ValueError:
            text = f"says {raw.strip()[:20]!r}, not a size"
    where = root.where((), QUOTA_FILE)
    if (where, text) not in _said_quota:
        _said_quota.add((where, text))
        log.warning("gpuload: the cache folder's quota file %s %s: no quota holds (the disk's reserve does); "
                    "`gpuload cache quota SIZE` writes it again, `gpuload cache quota none` removes it", where, text)
    return None


def write_quota(root: CacheRoot, nbytes: int | None) -> None:
    """Set the cache folder's quota to ``nbytes`` (None: remove it)."""
    if nbytes is None:
        root.unlink((), QUOTA_FILE, re.compile(re.escape(QUOTA_FILE)))
        return
    root.write((), QUOTA_FILE, lambda fd: os.write(fd, f"{int(nbytes)}\n".encode()))


def used_bytes(root: CacheRoot) -> int:
    """Bytes of the chunk files of the current format in ``root``."""
    return sum(st.st_size for *_, st in chunk_files(root))


class Space:
    """The room a cache folder has for one dataset's chunks (see the module doc).

    Parameters
    ----------
    root : the cache folder.
    max_bytes : this dataset's budget in this folder (``max_cache_bytes``), counting the chunk
        files of its groups (:attr:`groups`; all the folder's until it registers); None (default):
        no budget of its own. Never met by evicting: other datasets do not count against it,
        and its own chunks stay.
    patience : seconds to wait for the budget lock another writer holds (default 60).

    Whatever ``max_bytes`` says, the folder's quota (``gpuload cache quota``), else the reserve
    of its disk, holds too, made room for by evicting what no live reader needs.
    """

    def __init__(self, root: CacheRoot, max_bytes: int | None = None, patience: float = 60.0):
        self.root, self.patience = root, patience
        self.limit = max_bytes  #: this dataset's budget here, or None
        self.quota = read_quota(root)  #: the folder's budget for every process (read at open), or None
        try:  #: bytes the filesystem keeps free (0 under a quota); ValueError for a bad $GPULOAD_CACHE_RESERVE
            self.reserve = reserve_bytes(root.path) if self.quota is None else 0
        except OSError:  # no statvfs here: no reserve kept
            self.reserve = 0
        self.groups: set | None = None  #: this dataset's chunk groups (set when it registers)
        self._refused: tuple[float, str] | None = None  # (monotonic time, why) of the last refusal
        self._checked = time.monotonic()  # when the quota file was last read
        self._rereading = threading.Lock()

    def _reread(self) -> None:
        """Read the folder's quota again every :data:`RETRY_S` seconds: one set, changed or removed
        while this dataset runs binds it then."""
        with self._rereading:  # the writer threads: none may go on with the old quota while another reads it
            if time.monotonic() - self._checked < RETRY_S:
                return
            quota = read_quota(self.root)
            if quota != self.quota:
                with contextlib.suppress(ValueError, OSError):
                    self.reserve = reserve_bytes(self.root.path) if quota is None else 0
                self.quota, self._refused = quota, None
            self._checked = time.monotonic()  # once the quota read is in place

    @property
    def max_bytes(self) -> int | None:
        """The budget that binds this dataset first: ``max_bytes``, else the quota, else None (the reserve)."""
        return self.limit if self.limit is not None else self.quota

    def _usage(self) -> tuple[int, int]:
        """(bytes of every chunk file here, bytes of this dataset's)."""
        used = own = 0
        for parts, name, st in chunk_files(self.root):
            used += st.st_size
            own += st.st_size if self.groups is None or (parts[1], name[:16]) in self.groups else 0
        return used, own

    def short(self, nbytes: int, used: int = 0) -> int:
        """Bytes the folder must free before a chunk of ``nbytes`` fits its quota (``used``: its chunk
        files' bytes) or reserve (<= 0: it fits now)."""
        if self.quota is not None:
            return used + nbytes - self.quota
        return self.reserve - (free_bytes(self.root.path) - nbytes) if self.reserve else 0

    def room_for(self, groups, need: int) -> tuple[int, int]:
        """(bytes the chunks of ``groups`` may take here: ``max_bytes`` at most, and the quota, or the
        chunk files and the free space above the reserve, less what other live readers keep; those
        bytes kept). Without a quota, when ``need`` bytes fit in the free space alone, that free
        space (no survey)."""
        above = None if self.quota is not None else free_bytes(self.root.path) - self.reserve
        if above is not None and above >= need:
            return (above if self.limit is None else min(above, self.limit)), 0
        others, used = usage(self.root, groups)
        room = (self.quota if above is None else used + above) - others
        return (room if self.limit is None else min(room, self.limit)), others

    @contextmanager
    def room(self, nbytes: int) -> Iterator[str | OSError | None]:
        """Yields None when a chunk of ``nbytes`` may be written now (write it inside the
        block), else why not: ``"budget"`` (``max_bytes`` or the quota), ``"reserve"``, ``"held"``
        (another process held the budget lock ``patience`` seconds) or the ``OSError`` that kept
        it from the lock."""
        self._reread()
        if self.limit is None and self.quota is None and self.short(nbytes) <= 0:
            yield None  # the common case: no lock
            return
        if self._refused is not None and time.monotonic() - self._refused[0] < RETRY_S:
            yield self._refused[1]
            return
        lock = Lock(self.root, (LAYOUT_DIR,), ".budget.lock")
        try:
            got = lock.acquire(timeout=self.patience)
        except OSError as e:
            yield e
            return
        if not got:
            yield "held"
            return
        try:
            why = self._make_room(nbytes)
            self._refused = None if why is None else (time.monotonic(), why)
            yield why
        finally:
            lock.release()

    def _make_room(self, nbytes: int) -> str | None:
        """Holding the budget lock: None when ``nbytes`` more fit (after evicting for the quota or
        reserve), else ``"budget"`` or ``"reserve"``."""
        used, own = self._usage() if self.limit is not None or self.quota is not None else (0, 0)
        if self.limit is not None and own + nbytes > self.limit:
            return "budget"  # its own budget: never met by evicting
        short = self.short(nbytes, used)
        if short > 0:  # room for this chunk and the next few: an eviction surveys the whole folder
            slack = _SLACK * nbytes if self.quota is None else min(_SLACK * nbytes, self.quota // 16)
            freed = make_room(self.root, max(short, slack))
            # under a quota every write happens under this lock: the usage only fell by what was freed;
            # without, ask the disk (a file still open elsewhere frees nothing yet)
            short = short - freed if self.quota is not None else self.short(nbytes)
        if short > 0:
            return "budget" if self.quota is not None else "reserve"
        return None

    def refusal(self, why) -> str:
        """What to tell the user when :meth:`room` said ``why`` (not ``"budget"``: a budget's
        refusals are counted, not warned about)."""
        if why == "reserve":
            return (f"the disk of cache {self.root.path} has {size_text(free_bytes(self.root.path))} free, and "
                    f"caches keep {size_text(self.reserve)} free for other jobs ($GPULOAD_CACHE_RESERVE, default "
                    "10% of the disk), even after evicting what no live reader needs: chunks are read from Parquet "
                    "until space is freed (or set a quota: `gpuload cache quota`)")
        if why == "held":
            return (f"the cache budget has been locked by another process for {self.patience:g} s; chunks are not "
                    "cached meanwhile")
        return f"cannot lock the cache budget ({why}); chunks are not cached meanwhile"


def warn_short_room(cache, groups: set, files: list[int], max_cache_bytes: int | None, where: str,
                    building: bool = False) -> None:
    """Warn at a dataset's open when ``cache`` (a :class:`gpuload.cache.store.ChunkCache` or
    :class:`gpuload.cache.drives.Drives`) has room (its budget, or its disk's free space above
    the reserve, less what other live readers keep) for only part of the dataset's chunk
    ``files`` (their sizes in bytes; ``groups``: its column sets), with the numbers; the rest
    is read from Parquet each epoch (nothing thrashes: a reader's own chunks are never evicted
    for its own). ``max_cache_bytes`` and ``where`` (the cache folders) as the dataset has them; ``building``:
    a cache build's open (no ``cache_io="off"`` to advise: a build without a cache builds nothing)."""
    need = sum(files)
    try:
        room, others = cache.room(groups, need)
    except OSError:
        return
    if room >= need or need == 0:
        return
    if max_cache_bytes == 0 and building:
        log.warning("gpuload: %s leaves no room for this dataset's chunks: the build caches none of them; give "
                    "it a budget, or leave it out", setting("max_cache_bytes", 0))
        return
    if max_cache_bytes == 0:  # asked for: say how to ask for it plainly
        log.warning("gpuload: %s leaves no room for this dataset's chunks: those not cached already are decoded "
                    "from Parquet every epoch; %s decodes them all without a budget (nothing locked or registered)",
                    setting("max_cache_bytes", 0), setting("cache_io", "off"))  # as said: --max-gib 0 in the command
        return
    per = need / len(files)
    fit = min(max(0, int(room // per)), len(files) - 1)
    spaces = [c.space for c in getattr(cache, "caches", [cache])]  # a Drives' folders (each its share), or the one
    quotas, shares = [s.quota for s in spaces], [s.limit for s in spaces]
    given = flag("max_cache_bytes").rstrip("=")
    binds = max_cache_bytes is not None and None not in shares and room >= sum(shares)
    limit = (given if binds else  # else something tighter binds
             ("the cache folder's quota (`gpuload cache quota`)" if None not in quotas else
              "the free disk above the reserve ($GPULOAD_CACHE_RESERVE)")
             + (f", below {given}" if max_cache_bytes is not None else ""))
    log.warning("gpuload: the cache in %s has space for about %d of this dataset's %d chunks (%s of %s: %s, "
                "less %s other live readers keep): the other %d are read from Parquet every epoch. Cache it "
                "whole with %s more space, or use fewer columns%s", where, fit, len(files), size_text(max(room, 0)),
                size_text(need), limit, size_text(others), len(files) - fit, size_text(need - room),
                "" if building else f" ({setting('cache_io', 'off')} for a job of one epoch)")  # room < 0: below reserve
