"""Vocabularies kept in the cache: counted once per source and column, read by every later open.

A :class:`gpuload.Vocab` column's ids come from counting its values over every source
file. The count is kept under a name made of everything that shapes it (the column, the
Vocab's settings, and each source file's identity: path, size, mtime and store version),
so a restarted job, another rank or process reads it instead of counting again, and a
changed, added or removed file makes another name (a new count). Builders that start at
once count once: the first takes the name's lock, the others wait for its file.

File format (``<cache>/v3/vocab/<key>.vocab``), little-endian::

    offset 0   8 bytes   magic b"GPULVOC\\0"
    offset 8   u32       format version (1)
    offset 12  u32       header length H
    offset 16  u64       xxh3-64 of the header and body bytes
    offset 24  H bytes   header: UTF-8 JSON {"column", "vocab": {"min_count", "max_size"}, "sources": n, "key"}
    ...                  body: an Arrow IPC stream of one batch {"value": large_binary, "count": int64}

A file that does not check out is ignored (and counted again), never trusted.
"""

from __future__ import annotations

import json
import os
import struct

import pyarrow as pa
import xxhash

from .chunkfile import LAYOUT_DIR
from .directio import pwrite_all
from .fs import CacheRoot, Lock
from ..categorical import Vocab
from ..vocabulary import Vocabulary

__all__ = ["VOCAB_DIR", "vocab_key", "load_vocabulary", "save_vocabulary", "vocab_lock", "read_vocab_file",
           "check_vocab_file", "vocab_files"]

VOCAB_DIR = "vocab"  #: in LAYOUT_DIR: one file per counted vocabulary
MAGIC = b"GPULVOC\0"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ")
_PARTS = (LAYOUT_DIR, VOCAB_DIR)


def vocab_key(column: str, vocab: Vocab, sources: list[tuple], filter_key: str | None = None) -> str:
    """The name (16 hex digits) of the count of ``column`` by ``vocab`` over ``sources``
    (``(path, size, mtime_ns, tag)`` of every source file, in any order), over the rows the
    row filter ``filter_key`` (:attr:`gpuload.rowfilter.RowFilter.key`) keeps where given."""
    named = {"column": column, "vocab": vocab.as_json(), "sources": sorted(map(list, sources)), "version": VERSION}
    if filter_key is not None:
        named["filter"] = filter_key
    text = json.dumps(named, separators=(",", ":"))
    return xxhash.xxh64_hexdigest(text.encode())


def _name(key: str) -> str:
    return f"{key}.vocab"


def vocab_lock(root: CacheRoot, key: str) -> Lock:
    """The lock a builder of vocabulary ``key`` holds while it counts and writes it."""
    return Lock(root, _PARTS, _name(key) + ".lock")


def read_vocab_file(root: CacheRoot, name: str) -> tuple[dict, Vocabulary]:
    """(header, :class:`Vocabulary`) of vocabulary file ``name``; a ValueError says what is wrong
    with it, an OSError that it cannot be read."""
    fd = root.open_read(_PARTS, name)
    try:
        size = os.fstat(fd).st_size
        chunks, got = [], 0
        while got < size:
            part = os.pread(fd, min(1 << 26, size - got), got)
            if not part:
                break
            chunks.append(part)
            got += len(part)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) < PREFIX.size:
        raise ValueError("too short for a vocabulary file")
    magic, version, hlen, digest = PREFIX.unpack_from(data)
    body = memoryview(data)[PREFIX.size:]
    if magic != MAGIC or version != VERSION or hlen > len(body):
        raise ValueError("not a gpuload vocabulary file of this version")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise ValueError("checksum mismatch")
    try:
        header = json.loads(bytes(body[:hlen]))
        vocab = Vocab(**header["vocab"])
        batch = pa.ipc.open_stream(pa.py_buffer(body[hlen:])).read_all()
        values, counts = batch.column("value").combine_chunks(), batch.column("count").to_numpy()
        if values.type != pa.large_binary() or values.null_count or len(values) != len(counts):
            raise ValueError("its values are not a vocabulary's")
        return header, Vocabulary(str(header["column"]), values, counts, vocab)
    except (ValueError, KeyError, TypeError, RecursionError, pa.ArrowException) as e:
        raise ValueError(f"malformed ({type(e).__name__}: {e})") from None


def load_vocabulary(root: CacheRoot | None, key: str) -> Vocabulary | None:
    """The vocabulary kept under ``key``, or None (absent, unreadable or not checking out)."""
    if root is None:
        return None
    try:
        header, vocabulary = read_vocab_file(root, _name(key))
    except (OSError, ValueError):
        return None
    return vocabulary if header.get("key") == key else None


def save_vocabulary(root: CacheRoot, key: str, vocabulary: Vocabulary, sources: int) -> None:
    """Keep ``vocabulary`` under ``key`` (written atomically; an OSError says why it could not be)."""
    header = json.dumps({"column": vocabulary.column, "vocab": vocabulary.vocab.as_json(), "sources": sources,
                         "key": key, "values": len(vocabulary)}, separators=(",", ":")).encode()
    sink = pa.BufferOutputStream()
    table = pa.table({"value": vocabulary.values, "count": pa.array(vocabulary.counts, pa.int64())})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = header + sink.getvalue().to_pybytes()
    blob = PREFIX.pack(MAGIC, VERSION, len(header), xxhash.xxh3_64_intdigest(body)) + body
    root.write(_PARTS, _name(key), lambda fd: pwrite_all(fd, blob, 0))


def check_vocab_file(root: CacheRoot, name: str) -> str | None:
    """What is wrong with vocabulary file ``name`` (None: nothing)."""
    try:
        header, _ = read_vocab_file(root, name)
    except ValueError as e:
        return str(e)
    if _name(str(header.get("key"))) != name:
        return "its header names another vocabulary than its name"
    return None


def vocab_files(root: CacheRoot) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of the vocabulary folder (missing folder: none)."""
    return root.scan(_PARTS)
