"""Footers: Parquet footers kept in the cache, so that reopening a dataset reads no Parquet.

A dataset whose chunks are cached (a restarted job, another rank, a new notebook
kernel) still needs each file's footer: its schema, row groups and statistics make
the plan. gpuload keeps the footer's raw bytes beside the file's chunks, under the
file's identity (path, size, mtime and, for remote objects, the store's version
marker): an unchanged file is then not even opened, and a remote one costs no GET.
A changed file has another identity, so its footer is read again.

File format (``<cache>/v3/<source folder>/<version>.footer``), little-endian::

    offset 0   8 bytes   magic b"GPULFTR\\0"
    offset 8   u32       format version (1)
    offset 12  u32       header length H
    offset 16  u64       xxh3-64 of the header and footer bytes
    offset 24  H bytes   header: UTF-8 JSON {"source": {"path", "size", "mtime_ns", "tag"}}
    ...                  the footer as it ends the Parquet file (metadata, length, b"PAR1")

A footer file that does not check out is ignored (and rewritten), never trusted.
"""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .chunkfile import LAYOUT_DIR, version_token
from .fs import CacheRoot
from .smallfile import SMALL_PREFIX, read_small_file, write_small_file
from ..errors import SourceError

__all__ = ["footer_name", "load_footer", "save_footer", "read_footer", "parse_footer"]

MAGIC = b"GPULFTR\0"
VERSION = 1
TAIL = 64 << 10  # bytes read from a file's end in one request: most footers fit
_MAX_FOOTER = 1 << 30


def _folder(path: str) -> tuple[str, str]:
    return LAYOUT_DIR, xxhash.xxh64_hexdigest(path.encode())


def footer_name(size: int, mtime_ns: int, tag: str = "") -> str:
    """The footer file's name for one version of a source file."""
    return f"{version_token(size, mtime_ns, tag)}.footer"


def _source(path: str, size: int, mtime_ns: int, tag: str) -> dict:
    return {"path": path, "size": size, "mtime_ns": mtime_ns, "tag": tag}


def _read_file(root: CacheRoot, parts, name: str) -> tuple[dict, bytes]:
    """(header's source, footer bytes) of footer file ``name`` in ``parts``; a ValueError says
    what is wrong with it, an OSError that it cannot be read."""
    hlen, body = read_small_file(root, parts, name, MAGIC, VERSION, "footer", _MAX_FOOTER + SMALL_PREFIX.size + (1 << 20))
    try:
        given = json.loads(body[:hlen])["source"]
        src = {k: given[k] for k in ("path", "size", "mtime_ns", "tag")}
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"malformed header ({type(e).__name__}: {e})") from None
    return src, body[hlen:]


def load_footer(root: CacheRoot | None, path: str, size: int, mtime_ns: int, tag: str = "") -> bytes | None:
    """The cached footer bytes of this version of ``path``, or None (absent, unreadable or not checking out)."""
    if root is None:
        return None
    try:
        src, raw = _read_file(root, _folder(path), footer_name(size, mtime_ns, tag))
    except (OSError, ValueError):
        return None
    return raw if src == _source(path, size, mtime_ns, tag) else None


def save_footer(root: CacheRoot | None, path: str, size: int, mtime_ns: int, tag: str, raw: bytes,
                durable: bool = False) -> None:
    """Keep ``raw`` footer bytes for this version of ``path`` (best effort: a read-only or full cache is
    skipped). Not fsynced unless ``durable`` (default False): a local file's copy lost or torn by a crash
    of the machine is read from the file again; a remote object's is fsynced, since an offline open
    (its store down) has no other."""
    if root is None:
        return
    header = json.dumps({"source": _source(path, size, mtime_ns, tag)}, separators=(",", ":")).encode()
    with contextlib.suppress(OSError):
        write_small_file(root, _folder(path), footer_name(size, mtime_ns, tag), MAGIC, VERSION, header, raw,
                         durable=durable)


def read_footer(read: Callable[[int, int], bytes], size: int, where: str) -> bytes:
    """The footer bytes at the end of a Parquet file of ``size`` bytes, through ``read(start,
    end)``: one read of the last 64 KiB, and one more when the footer is longer."""
    if size < 12:
        raise SourceError(f"{where}: {size} bytes is too small for a Parquet file; remove it or narrow the source")
    start = max(0, size - TAIL)
    tail = read(start, size)
    if tail[-4:] != b"PAR1":
        raise SourceError(f"{where}: does not end with the Parquet magic bytes; not a Parquet file (or truncated)")
    n = struct.unpack("<I", tail[-8:-4])[0]
    if n + 12 > size:
        raise SourceError(f"{where}: its footer claims {n:,} bytes in a {size:,}-byte file; the file is corrupt")
    need = n + 8
    if need > len(tail):
        tail = read(size - need, start) + tail
    return tail[-need:]


def parse_footer(raw: bytes, where: str) -> pq.FileMetaData:
    """The :class:`pyarrow.parquet.FileMetaData` of raw footer bytes."""
    try:
        return pq.read_metadata(pa.BufferReader(raw))
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{where}: not a readable Parquet file ({e}); remove it or narrow the source") from None


def check_footer_file(root: CacheRoot, parts, name: str) -> str | None:
    """What is wrong with footer file ``name`` in source folder ``parts`` (None: nothing)."""
    try:
        src, raw = _read_file(root, parts, name)
    except ValueError as e:
        return str(e)
    if _folder(src["path"]) != tuple(parts) or footer_name(src["size"], src["mtime_ns"], src["tag"]) != name:
        return f"its header names {src['path']}, another source file than its name"
    try:
        parse_footer(raw, name)
    except SourceError as e:
        return str(e)
    return None
