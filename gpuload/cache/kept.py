"""Kept-row counts of a row filter, kept in the cache: counted once per filter and source file.

A dataset with ``filters=`` plans its chunks over the rows the filter keeps, counted at open
by reading the filter's columns (:func:`gpuload.counting.kept_groups`). The counts of each
file are kept under a name made of the filter's text and the file's identity (path, size,
mtime and store version), so a restart, another rank or process reads them instead of
reading Parquet again, and a changed file makes another name (a new count). Openers that
count at once each write the same file (atomically); none waits for another.

File format (``<cache>/v3/vocab/<key>.kept``, beside the vocabularies), little-endian::

    offset 0   8 bytes   magic b"GPULKEPT"
    offset 8   u32       format version (1)
    offset 12  u32       header length H
    offset 16  u64       xxh3-64 of the header bytes
    offset 24  H bytes   header: UTF-8 JSON {"key", "filter", "file": [path, size, mtime_ns, tag], "kept": [rows per row group]}

A file that does not check out is ignored (and counted again), never trusted.
"""

from __future__ import annotations

import json

import xxhash

from .chunkfile import LAYOUT_DIR
from .fs import CacheRoot
from .smallfile import read_json_file, write_json_file
from .vocabs import VOCAB_DIR

__all__ = ["kept_key", "load_kept", "save_kept", "check_kept_file", "KEPT_SUFFIX"]

KEPT_SUFFIX = ".kept"
MAGIC = b"GPULKEPT"
VERSION = 1
_PARTS = (LAYOUT_DIR, VOCAB_DIR)


def kept_key(filter_key: str, source: tuple) -> str:
    """The name (16 hex digits) of the counts of filter ``filter_key`` over file ``source``
    (``(path, size, mtime_ns, tag)``)."""
    text = json.dumps({"filter": filter_key, "file": list(source), "version": VERSION}, separators=(",", ":"))
    return xxhash.xxh64_hexdigest(text.encode())


def _check(header: dict) -> None:
    kept = header["kept"]
    if not isinstance(kept, list) or not all(isinstance(n, int) and n >= 0 for n in kept):
        raise ValueError("its counts are not row counts")


def _read(root: CacheRoot, name: str) -> dict:
    return read_json_file(root, _PARTS, name, MAGIC, VERSION, "kept-rows", 1 << 26, _check)


def load_kept(root: CacheRoot | None, key: str, groups: int) -> list[int] | None:
    """The counts kept under ``key`` for a file of ``groups`` row groups, or None (absent,
    unreadable, not checking out, or not of that many row groups)."""
    if root is None:
        return None
    try:
        header = _read(root, key + KEPT_SUFFIX)
    except (OSError, ValueError):
        return None
    kept = header["kept"]
    return kept if header.get("key") == key and len(kept) == groups else None


def save_kept(root: CacheRoot, key: str, filter_key: str, source: tuple, kept: list[int]) -> None:
    """Keep ``kept`` (rows per row group) under ``key`` (written atomically, not fsynced: counts lost or
    torn by a crash of the machine are counted again; an OSError says why not)."""
    write_json_file(root, _PARTS, key + KEPT_SUFFIX, MAGIC, VERSION,
                    {"key": key, "filter": filter_key, "file": list(source), "kept": [int(n) for n in kept]},
                    durable=False)


def check_kept_file(root: CacheRoot, name: str) -> str | None:
    """What is wrong with kept-rows file ``name`` (None: nothing)."""
    try:
        header = _read(root, name)
    except ValueError as e:
        return str(e)
    if str(header.get("key")) + KEPT_SUFFIX != name:
        return "its header names other counts than its name"
    return None
