"""Cache space: the free space every cache leaves on its disk, and a cache folder's quota.

A GPU node's local disk is shared by every job on it. Without a budget (``max_cache_bytes``
unset and no quota), a cache writes a chunk only while the filesystem keeps at least a
*reserve* free after it: ``RESERVE_FRACTION`` (10%) of the filesystem's size, or
``$GPULOAD_CACHE_RESERVE`` (bytes with an optional K/M/G/T suffix, or a percentage such as
``"5%"``). A chunk that does not fit is served from Parquet as any uncached chunk is, with one
warning, and later chunks are written again once space is freed: the cache never fills the
disk another job needs. A *quota* (``gpuload cache quota 500G``: a small file ``quota`` in the
cache folder) budgets the whole folder for every process that uses it, as ``max_cache_bytes``
budgets one dataset; ``max_cache_bytes`` given to a dataset overrides it.
"""

from __future__ import annotations

import os
import re

from .fs import CacheRoot

__all__ = ["RESERVE_FRACTION", "QUOTA_FILE", "parse_size", "reserve_bytes", "free_bytes", "read_quota",
           "write_quota"]

RESERVE_FRACTION = 0.10
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


def read_quota(root: CacheRoot) -> int | None:
    """The cache folder's quota in bytes, or None (no quota, or an unreadable quota file)."""
    try:
        fd = root.open_read((), QUOTA_FILE)
    except OSError:
        return None
    with open(fd, "rb") as f:
        text = f.read(64).decode("ascii", "replace")
    try:
        return parse_size(text)
    except ValueError:
        return None


def write_quota(root: CacheRoot, nbytes: int | None) -> None:
    """Set the cache folder's quota to ``nbytes`` (None: remove it)."""
    if nbytes is None:
        root.unlink((), QUOTA_FILE, re.compile(re.escape(QUOTA_FILE)))
        return
    root.write((), QUOTA_FILE, lambda fd: os.write(fd, f"{int(nbytes)}\n".encode()))
