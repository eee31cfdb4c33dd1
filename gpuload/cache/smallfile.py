"""gpuload's small checked files (cached Parquet footers, kept-row counts, listings): a prefix, a
JSON header, then any bytes, written atomically and checked whole on every read.

Format, little-endian::

    offset 0   8 bytes   magic (one per kind of file)
    offset 8   u32       the kind's format version
    offset 12  u32       header length H in bytes
    offset 16  u64       xxh3-64 of everything after the prefix
    offset 24  H bytes   header: UTF-8 JSON
    ...                  the payload (a footer's bytes; none for kept-row counts)
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable

import xxhash

from .directio import pwrite_all
from .fs import CacheRoot

__all__ = ["SMALL_PREFIX", "read_small_file", "write_small_file", "read_json_file", "write_json_file"]

SMALL_PREFIX = struct.Struct("<8sIIQ")  #: magic, version, header length, xxh3-64 of what follows


def read_small_file(root: CacheRoot, parts, name: str, magic: bytes, version: int, what: str,
                    limit: int) -> tuple[int, bytes]:
    """(header length, bytes after the prefix) of a small checked file ``name`` in ``parts``
    (at most ``limit`` bytes); a ValueError names ``what`` it is not and why, an OSError says
    it cannot be read."""
    fd = root.open_read(parts, name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"too large for a {what} file")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    if len(data) < SMALL_PREFIX.size:
        raise ValueError(f"too short for a {what} file")
    got_magic, got_version, hlen, digest = SMALL_PREFIX.unpack_from(data)
    body = data[SMALL_PREFIX.size:]
    if got_magic != magic or got_version != version or hlen > len(body):
        raise ValueError(f"not a gpuload {what} file of this version")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise ValueError("checksum mismatch")
    return hlen, body


def write_small_file(root: CacheRoot, parts, name: str, magic: bytes, version: int, header: bytes,
                     payload: bytes = b"", durable: bool = True) -> None:
    """Write ``header`` (JSON bytes) and ``payload`` as small checked file ``name`` in ``parts``,
    atomically (:meth:`CacheRoot.write`; ``durable=False``: without its fsyncs, for a file that is
    only a shortcut, such as a copy of a footer); an OSError says why not."""
    body = header + payload
    blob = SMALL_PREFIX.pack(magic, version, len(header), xxhash.xxh3_64_intdigest(body)) + body
    root.write(parts, name, lambda fd: pwrite_all(fd, blob, 0), durable)


def read_json_file(root: CacheRoot, parts, name: str, magic: bytes, version: int, what: str, limit: int,
                   check: Callable[[dict], None]) -> dict:
    """The JSON header of small checked file ``name`` (one with no payload), once ``check(header)``
    passed (it raises a ValueError, KeyError or TypeError for a malformed one); a ValueError says
    what is wrong, an OSError that it cannot be read."""
    hlen, body = read_small_file(root, parts, name, magic, version, what, limit)
    if hlen != len(body):
        raise ValueError(f"not a gpuload {what} file of this version")
    try:
        header = json.loads(body)
        check(header)
        return header
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"malformed ({type(e).__name__}: {e})") from None


def write_json_file(root: CacheRoot, parts, name: str, magic: bytes, version: int, header: dict,
                    durable: bool = True) -> None:
    """Write ``header`` as small checked file ``name`` with no payload (see :func:`write_small_file`)."""
    write_small_file(root, parts, name, magic, version, json.dumps(header, separators=(",", ":")).encode(),
                     durable=durable)
