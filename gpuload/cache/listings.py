"""Listings: what each remote source last listed, kept in the cache, so that a fully cached
source opens while its store cannot be reached.

Every open lists a remote source anew (objects added, rewritten or removed are seen then). Each
listing that succeeds is kept under the URL it lists; when a later listing fails for a reason
worth another try (the store down, throttling, no connection: :class:`gpuload.sources.retry.Unreachable`)
and every chunk of the dataset is cached, the dataset opens from the kept listing, with a
warning that gives its age (:func:`gpuload.sources.listing.list_files`,
:class:`gpuload.reader.ChunkReader`). Footers and chunks are kept under each object's identity,
so nothing of another version is served: an object the kept listing names with an identity
the cache does not hold needs the store, and the open is refused.

File format (``<cache>/v3/vocab/<key>.listing``, beside vocabularies and kept-row counts),
little-endian::

    offset 0   8 bytes   magic b"GPULLIST"
    offset 8   u32       format version (1)
    offset 12  u32       header length H
    offset 16  u64       xxh3-64 of the header bytes
    offset 24  H bytes   header: UTF-8 JSON {"key", "url", "place" (the store: its filesystem and
                         options, credentials left out: :func:`gpuload.sources.offline.place`),
                         "at" (seconds since the epoch), "base"
                         (the Hive partition base, or null), "table" (whether a Delta table's log
                         chose the objects), "objects": [[path, size, mtime_ns, tag], ...]}

A file that does not check out is ignored (the source is then refused as if none were kept),
never trusted. A file's modification time is its listing's last use: each open with the store up
writes it anew, and one that opens from it marks it (:func:`note_use`). ``gpuload cache clear``
removes these files with a full clear, and with ``--unused-since`` those not used since (with
``--spec`` alone, none: a listing serves every column set of its source).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import NamedTuple

import xxhash

from .chunkfile import LAYOUT_DIR
from .fs import CacheRoot
from .smallfile import read_json_file, write_json_file
from .vocabs import VOCAB_DIR

__all__ = ["Kept", "listing_key", "load_listing", "save_listing", "note_use", "read_listing_file",
           "check_listing_file", "LISTING_SUFFIX"]

LISTING_SUFFIX = ".listing"
MAGIC = b"GPULLIST"
VERSION = 1
_PARTS = (LAYOUT_DIR, VOCAB_DIR)
_LIMIT = 1 << 30  # bytes: a listing of millions of objects still fits


class Kept(NamedTuple):
    """A kept listing: when it was made (seconds since the epoch), its Hive partition base,
    whether a table's log chose its objects, and the objects as ``(path, size, mtime_ns, tag)``."""

    at: float
    base: str | None
    table: bool
    objects: list[tuple[str, int, int, str]]

    def age_text(self, now: float | None = None) -> str:
        """How long ago it was made, in words (``"3 h 5 min"``)."""
        s = max(0, int((time.time() if now is None else now) - self.at))
        d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
        parts = [f"{d} d"] * bool(d) + [f"{h} h"] * bool(h) + [f"{m} min"] * bool(m and not d)
        return " ".join(parts) or f"{s} s"


def listing_key(url: str, place: str) -> str:
    """The name (16 hex digits) a listing of ``url`` (a source item, as the store names it) from the
    store at ``place`` is kept under: the same names at another endpoint are another listing."""
    return xxhash.xxh64_hexdigest(json.dumps(["listing", VERSION, url, place]).encode())


def _check(header: dict) -> None:
    objects = header["objects"]
    if not isinstance(objects, list) or not all(
            isinstance(o, list) and len(o) == 4 and isinstance(o[0], str) and isinstance(o[3], str)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in o[1:3]) for o in objects):
        raise ValueError("its objects are not (path, size, mtime_ns, tag)")
    if not (isinstance(header["place"], str) and isinstance(header["at"], (int, float))
            and isinstance(header["table"], bool) and (header["base"] is None or isinstance(header["base"], str))):
        raise ValueError("its store, time, base or table mark is not of the right type")


def read_listing_file(root: CacheRoot, name: str) -> dict:
    """The header of listing file ``name`` (see the format above); a ValueError says what is wrong
    with it, an OSError that it cannot be read."""
    return read_json_file(root, _PARTS, name, MAGIC, VERSION, "listing", _LIMIT, _check)


def load_listing(root: CacheRoot | None, url: str, place: str) -> Kept | None:
    """The listing kept for ``url`` at ``place``, or None (none kept); a ValueError says why a kept
    one cannot be used (unreadable, damaged, or another listing's)."""
    if root is None:
        return None
    key = listing_key(url, place)
    try:
        header = read_listing_file(root, key + LISTING_SUFFIX)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"unreadable ({e.strerror or e})") from None
    if header.get("key") != key or header.get("url") != url or header.get("place") != place:
        raise ValueError("it names another listing than its file name")
    return Kept(float(header["at"]), header["base"], header["table"], [tuple(o) for o in header["objects"]])


def save_listing(root: CacheRoot, url: str, place: str, base: str | None, table: bool, objects) -> None:
    """Keep the listing of ``url`` from the store at ``place``: ``objects`` (each with ``path``,
    ``size``, ``mtime_ns``, ``tag``), ``base`` and ``table`` as :class:`Kept` describes them, made
    now (written atomically; an OSError says why not)."""
    key = listing_key(url, place)
    write_json_file(root, _PARTS, key + LISTING_SUFFIX, MAGIC, VERSION,
                    {"key": key, "url": url, "place": place, "at": time.time(), "base": base, "table": bool(table),
                     "objects": [[o.path, int(o.size), int(o.mtime_ns), o.tag] for o in objects]})


def note_use(root: CacheRoot, url: str, place: str) -> None:
    """Mark the listing kept for ``url`` at ``place`` as used now (its file's modification time, which
    ``gpuload cache clear --unused-since`` reads); best effort: a read-only cache is left as it is."""
    with contextlib.suppress(OSError):
        fd = root.open_read(_PARTS, listing_key(url, place) + LISTING_SUFFIX)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def check_listing_file(root: CacheRoot, name: str) -> str | None:
    """What is wrong with listing file ``name`` (None: nothing)."""
    try:
        header = read_listing_file(root, name)
    except ValueError as e:
        return str(e)
    if str(header.get("key")) + LISTING_SUFFIX != name or \
            listing_key(str(header.get("url")), header["place"]) != header["key"]:
        return "its header names another listing than its name"
    return None
