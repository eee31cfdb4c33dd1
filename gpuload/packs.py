"""Packs: many small files read as few chunks, several consecutive files to a chunk.

A chunk costs the same few things whatever its rows: a cache file written, fsynced, renamed,
looked for, opened and checked; a place in the order; a load. Over files of a few thousand rows
(what a Spark job with many partitions writes) those costs decide an epoch. So in a source of
:data:`MIN_FILES` files or more, consecutive small files, each one chunk of less than
:func:`pack_target`'s bytes, are packed into one chunk
(:class:`gpuload.plan.Chunk` with ``parts``) and cached as one file (its key names every file:
:class:`gpuload.cache.paths.ChunkKey`'s ``members``). The reader decodes a pack's files one by
one and puts their rows one after another; nothing after it sees files.

Pure functions: nothing here does I/O. Where packs end is part of the order (and of a saved
state's chunk layout), so it depends only on what every rank and every restart sees alike: each
file's name (:func:`pack_name`: as listed, without its folders, with its rows) and
estimated bytes. ``pack_files=False`` turns packing off, and ``shard="node"`` never packs: its
nodes own whole chunks, and packs would leave too few to share out evenly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import xxhash

from .plan import Chunk

__all__ = ["MAX_PACK", "MIN_FILES", "pack_target", "pack_small", "pack_name", "members"]


MAX_PACK = 64  #: the most files packed into one chunk (its rows stay together, in file order)
MIN_FILES = 64  #: sources of fewer files are not packed: a file's own chunk costs little there


def pack_target(chunk_bytes: int) -> int:
    """The converted bytes a pack of small files aims at (:func:`pack_small`): an eighth of ``chunk_bytes``
    (8 MiB by default). A setting alone: a subset of the files, or files added, pack alike."""
    return max(chunk_bytes // 8, 1)


def pack_small(chunks: Sequence[Chunk], names: Sequence[str], chunk_bytes: int) -> list[Chunk]:
    """``chunks`` (of :func:`gpuload.plan.make_chunks`, in file order) with runs of consecutive *small* ones,
    each the only chunk of its file and of less than :func:`pack_target`'s bytes, packed into chunks of at
    most 4 times those bytes and :data:`MAX_PACK` files (a run of one stays as it is); nothing is packed
    for fewer than :data:`MIN_FILES` files (``names``: one per file).

    Where a pack ends depends on its own files alone, so that adding, removing or rewriting a file
    changes the packs beside it, not every later one (each pack is a cache file), and a subset of the
    files (some days of a partitioned dataset) packs as the whole did but at its ends: a pack ends after a
    file with probability its bytes over the target, and at least 4 in :data:`MAX_PACK` (drawn from a
    hash of ``names[file]``: packs average about the target, or 16 files), or where the next file would
    pass the bounds, or at a file that is not small."""
    if len(names) < MIN_FILES:
        return list(chunks)
    target = pack_target(chunk_bytes)
    cap = 4 * target
    least = 4 / MAX_PACK  # the chance a pack of tiny files ends after each: ends by their names, rarely by the cap
    per_file = Counter(c.file for c in chunks)
    out: list[Chunk] = []
    run: list[Chunk] = []  # the pack being made

    def close() -> None:
        if len(run) > 1:
            first = run[0]
            out.append(Chunk(first.file, first.rg_start, first.rg_stop, sum(c.rows for c in run),
                             sum(c.nbytes for c in run), tuple(run)))
        else:
            out.extend(run)
        run.clear()

    for c in chunks:
        if per_file[c.file] > 1 or c.nbytes >= target:
            close()
            out.append(c)
            continue
        if run and (sum(r.nbytes for r in run) + c.nbytes > cap or len(run) == MAX_PACK):
            close()  # (a sum per file: runs are short, at most MAX_PACK)
        run.append(c)
        if _anchor(names[c.file]) < max(c.nbytes / target, least):
            close()
    close()
    return out


def _anchor(name: str) -> float:
    """A number in [0, 1) drawn from ``name`` alone, the same on every machine."""
    return xxhash.xxh64_intdigest(name.encode()) / 2.0**64


def pack_name(f) -> str:
    """What places a file's pack boundary: its name as listed (a link's own) and rows, not its folders or
    Hive keys: the same wherever the dataset lies, however it is listed (a folder, its partition folders, a
    glob), beside files added later, and for the file rewritten with as many rows (its pack alone is
    rebuilt); apart for files of one name in many folders (``2024/01/01/data.parquet``) where their rows
    differ. ``f``: a :class:`gpuload.sources.listing.SourceFile`."""
    name = (f.path if f.remote else (f.shown or f.path)).rsplit('/', 1)[-1]
    return f"{name}/{f.metadata.num_rows}"


def members(files: Sequence, chunk: Chunk) -> tuple:
    """A pack's files as its cache key names them (:class:`gpuload.cache.paths.ChunkKey`'s ``members``):
    ``(path, size, mtime_ns, tag, rg_start, rg_stop)`` each; () for a chunk of one file."""
    return tuple((files[p.file].path, files[p.file].size, files[p.file].mtime_ns, files[p.file].tag, p.rg_start,
                  p.rg_stop) for p in chunk.parts)
