"""Decode: read one chunk's row groups from Parquet and convert them.

A decoder turns a :class:`~gpuload.plan.Chunk` of a :class:`~gpuload.sources.listing.SourceFile`
into a column set (see :mod:`gpuload.convert`). The CPU decoder here uses pyarrow; the GPU
decoder (:class:`gpuload.gpu.decoder.GpuDecoder`, cuDF) returns the same column set in device
memory, behind the same call, and falls back to this one per chunk.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.compute as pc

from .batch import nbytes
from .categorical import hashable
from .checks import column_names, old_arrow_error, stored_key_error
from .convert import needed_columns, table_to_columns
from .errors import GpuloadError, SourceError, flag
from .layout import merge_pieces
from .rowfilter import filter_table, keep
from .sources.ranges import ReadOnlyFile
from .plan import Chunk
from .schema import GROUP, SCALAR, OutputSpec
from .sources.listing import SourceFile

__all__ = ["ArrowDecoder", "read_columns", "kept_positions", "chunk_where", "check_unchanged"]

log = logging.getLogger("gpuload")


def chunk_where(f: SourceFile, chunk: Chunk) -> str:
    """The chunk's name in messages; also refuses a file that changed since it was opened."""
    check_unchanged(f)
    return f"{f.path} (row groups {chunk.rg_start}-{chunk.rg_stop - 1})"


def check_unchanged(f: SourceFile, during: bool = False) -> None:
    """Refuse a local file that changed since it was opened (before a chunk is read) or while it
    was read (after): a chunk is cached only under an identity checked after it was read."""
    if not f.stat_matches():
        raise SourceError(f"{f.path} changed or disappeared {'while a chunk was read' if during else 'after'} "
                          "the dataset was opened; open the dataset again to pick up the new file")


_POOLED_READ = 1 << 20  # reads from this size up go into reused buffers: new ones are faulted in page by page
_HELD_BYTES = 64 << 20  #: Arrow bytes of a pack's files read before they are converted at once


class _TimedFile(ReadOnlyFile):
    """A read-only local file whose reads are recorded as ``read`` spans (Parquet I/O apart from decoding)."""

    def __init__(self, path: str, metrics, buffer: Callable | None = None):
        self._fd = os.open(path, os.O_RDONLY)
        super().__init__(os.fstat(self._fd).st_size)
        self.metrics, self.seconds = metrics, 0.0
        self._buffer = buffer  # buffer(nbytes): a writable uint8 array to read into (a pool's); None: new bytes

    def read_at(self, start: int, end: int) -> bytes:
        t0 = self.metrics.clock()
        data = self._pread(start, end)
        t1 = self.metrics.clock()
        self.seconds += t1 - t0
        self.metrics.record("read", t0, t1, nbytes=len(data))
        return data

    def _pread(self, start: int, end: int):
        if self._buffer is None or end - start < _POOLED_READ:
            return os.pread(self._fd, end - start, start)
        out = self._buffer(end - start)
        # a view: pyarrow holds it (and with it the pool's buffer) for as long as it uses the bytes
        return out[:os.preadv(self._fd, [out], start)]

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
            self.closed = True


def read_columns(src, f: SourceFile, chunk: Chunk, leaves: list[int], int96_unit: str = "us",
          dictionary: Sequence[str] = ()) -> pa.Table:
    """The chunk's row groups of Parquet leaf columns ``leaves`` of ``f`` (read from ``src``), on
    the calling thread; INT96 timestamps in ``int96_unit``; columns ``dictionary`` as
    dictionary arrays (strings to hash: each distinct value once, from the file's dictionary pages)."""
    dictionary = [c for c in dictionary if _dictionary_readable(f, chunk, c)]
    # remote: one read per fetched column chunk (pre-buffering would merge reads across holes)
    reader = pq.ParquetFile(src, metadata=f.metadata, pre_buffer=not f.remote, coerce_int96_timestamp_unit=int96_unit,
                            read_dictionary=list(dictionary) or None).reader
    table = reader.read_row_groups(list(range(chunk.rg_start, chunk.rg_stop)), column_indices=leaves,
                                   use_threads=False)
    misread = [c for c in dictionary if c in table.column_names and not _indices_in_range(table.column(c))]
    if misread:  # pyarrow reads some writers' dictionary pages short (DuckDB's ENUM columns): those columns'
        log.debug("gpuload: %s: dictionary indices of %s beyond their dictionary; read as values", f.path, misread)
        values = read_columns(src, f, chunk, [i for c in misread for i in f.leaves(c)], int96_unit)  # values alone
        for c in misread:
            table = table.set_column(table.column_names.index(c), c, values.column(c))
    return table


_NO_DICTIONARY = {"DELTA_BYTE_ARRAY", "DELTA_LENGTH_BYTE_ARRAY"}  # pyarrow reads these as values only


def _dictionary_readable(f: SourceFile, chunk: Chunk, column: str) -> bool:
    """Whether pyarrow can read ``column`` of the chunk's row groups as a dictionary array: not where a
    column chunk's strings are delta-encoded (Parquet v2 files: DuckDB's ``PARQUET_VERSION V2``, Spark's
    ``parquet.writer.version=v2``), which Arrow decodes into plain values alone."""
    md = f.metadata
    return not any(_NO_DICTIONARY.intersection(md.row_group(g).column(i).encodings)
                   for g in range(chunk.rg_start, chunk.rg_stop) for i in f.leaves(column))


def _indices_in_range(col: pa.ChunkedArray) -> bool:
    """Whether every index of a dictionary column points into its chunk's dictionary."""
    for a in col.chunks:
        if pa.types.is_dictionary(a.type) and len(a) > a.null_count:
            lo, hi = pc.min_max(a.indices).values()
            if lo.as_py() < 0 or hi.as_py() >= len(a.dictionary):
                return False
    return True


def kept_positions(f: SourceFile, chunk: Chunk, flt, columns: Sequence[str], fetch: Callable | None) -> np.ndarray:
    """Positions (ascending) of the rows of ``chunk``'s row groups that row filter ``flt`` keeps,
    reading only its ``columns`` (a remote object's through ``fetch``; Hive keys supplied)."""
    stored = [c for c in columns if c not in f.partition_names]
    leaves = [i for c in stored for i in f.leaves(c)]
    total = sum(f.metadata.row_group(g).num_rows for g in range(chunk.rg_start, chunk.rg_stop))
    try:
        src = fetch(f, chunk, leaves) if (f.remote and leaves) else f.path
        table = read_columns(src, f, chunk, leaves) if leaves else pa.table({})
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{chunk_where(f, chunk)}: the filter's columns cannot be read ({' '.join(str(e).split())})"
                          ) from None
    return filter_table(table, f, flt, total, chunk_where(f, chunk))


def _check_int96(micros: pa.Table, seconds: pa.Table, where: str) -> None:
    """Refuse INT96 timestamps that microseconds since 1970 in an int64 cannot hold (beyond about
    year 294,000; pyarrow wraps them around): read again in seconds, they must agree."""
    for name in seconds.column_names:
        us, s = micros.column(name).combine_chunks(), seconds.column(name).combine_chunks()
        while pa.types.is_list(us.type) or pa.types.is_large_list(us.type) or pa.types.is_fixed_size_list(us.type):
            us, s = us.flatten(), s.flatten()
        us = np.asarray(us.cast(pa.int64()).fill_null(0))
        s = np.asarray(s.cast(pa.int64()).fill_null(0))
        bad = np.flatnonzero(np.floor_divide(us, 1_000_000) != s)
        if bad.size:
            raise SourceError(f"{where}: column {name!r} holds INT96 timestamps that int64 microseconds cannot "
                              f"represent ({bad.size} values, the first {int(s[bad[0]])} s after 1970-01-01); "
                              "gpuload reads INT96 in microseconds: fix the values, or leave the column out of "
                              "columns=")


def _read_error(f: SourceFile, chunk: Chunk, stored: list[str], where: str, error: Exception,
                fetch: Callable | None) -> SourceError:
    """The error for a chunk that pyarrow cannot read: the columns that fail on their own named
    (each read alone), with the advice to leave them out."""
    bad = []
    if len(stored) > 1:
        for c in stored:
            try:
                src = fetch(f, chunk, list(f.leaves(c))) if f.remote else f.path
                read_columns(src, f, chunk, list(f.leaves(c)))
            except (OSError, pa.ArrowException, SourceError):
                bad.append(c)
    error = " ".join(str(error).split())  # one line: pyarrow's messages hold line breaks
    old_arrow = old_arrow_error(where, bad or stored, error)
    if old_arrow is not None:
        return old_arrow
    if len(stored) == 1:  # the one column read is the one that fails: say which
        return SourceError(f"{where}: {column_names(stored)} cannot be read ({error}); the file may be truncated "
                           f"or corrupt there: rewrite it")
    if not bad or len(bad) == len(stored):
        return SourceError(f"{where}: cannot be read ({error}); the file may be truncated or corrupt")
    names = ", ".join(repr(c) for c in bad)
    return SourceError(f"{where}: {column_names(bad)} cannot be read ({error}); the file "
                       f"may be corrupt there: rewrite it, or leave {names} out of {flag('columns')} to load the rest")


def _joined(table: pa.Table) -> pa.Table:
    """``table`` with each column of numbers, times or lists of them in one Arrow array (converted with
    one call, not one per file), the others as they are: strings and bytes (plain or dictionaries) become
    ids chunk by chunk anyway, and joining them would copy every string once more (and unify the
    dictionaries: hash every distinct string again)."""
    return pa.table([c if hashable(_innermost(c.type)) else c.combine_chunks() for c in table.columns],
                    schema=table.schema)


def _innermost(t: pa.DataType) -> pa.DataType:
    """The values' type of (lists of) lists of ``t``."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t


def _hashed_strings(specs: Sequence[OutputSpec], stored: list[str]) -> list[str]:
    """The stored scalar columns that become categorical ids: read as dictionaries."""
    return [c for s in specs if s.kind in (SCALAR, GROUP) for c, vt in zip(s.columns, s.sources)
            if vt.encode and c in stored and "." not in c]


class ArrowDecoder:
    """CPU decoder: pyarrow reads the row groups, :func:`table_to_columns` converts.

    Each call reads only the chunk's row groups and selected columns, on the calling
    thread (pyarrow's own thread pool is not used: gpuload runs several chunks at once).
    With ``metrics`` (a :class:`gpuload.Metrics`) the file reads are recorded as
    ``read`` spans, the rest of pyarrow's work as ``decode`` and the conversion as ``convert``.
    ``alloc`` and ``pieces`` go to :func:`gpuload.convert.table_to_columns` (defaults: new
    arrays, every output joined); with ``buffer(nbytes)`` (a writable uint8 array, default
    None: new bytes), a local file's reads of a MiB or more go into its arrays.
    """

    name = "cpu"

    def __init__(self, metrics=None, fetch: Callable | None = None, row_filter=None, filter_columns=(),
                 alloc: Callable | None = None, pieces: bool = False, buffer: Callable | None = None):
        self.metrics = metrics
        self.alloc, self.pieces = alloc, pieces  # table_to_columns' (the reader's: its read pool, and Pieces it packs)
        self.buffer = buffer  # local files' reads go into buffer(nbytes) (the reader's source pool)
        self.fetch = fetch  # remote objects: fetch(f, chunk, leaves) -> RangeFile (see ChunkReader.fetch)
        self.row_filter = row_filter  # a gpuload.rowfilter.RowFilter: only the rows it keeps are converted
        self.filter_columns = list(filter_columns)  # the columns it reads

    def __call__(self, f: SourceFile, chunk: Chunk, specs: Sequence[OutputSpec]) -> dict:
        where = chunk_where(f, chunk)
        return self._convert(self._read(f, chunk, specs, where), specs, where)

    def pack(self, files: Sequence[SourceFile], pieces: Sequence[Chunk], specs: Sequence[OutputSpec]) -> dict:
        """The column set of a pack of small files (:mod:`gpuload.packs`): each piece (of
        ``files[piece.file]``) read as by a call, their Arrow tables put one after another and
        converted at once (:meth:`_at_once`), :data:`_HELD_BYTES` of them at most: the conversion's
        costs per column and row group (about 0.6-1 ms a file of 42 columns, more than decoding it)
        are paid once for many files, and Arrow's form of the rows (strings much larger than their
        ids) is held for a few of them only."""
        groups: list[dict] = []
        tables: list[pa.Table] = []
        wheres: list[str] = []
        held = 0
        for p in pieces:
            wheres.append(chunk_where(files[p.file], p))
            tables.append(self._read(files[p.file], p, specs, wheres[-1]))
            held += tables[-1].nbytes
            if held >= _HELD_BYTES:
                groups.append(self._at_once(tables, wheres, specs))
                tables, wheres, held = [], [], 0
        if tables:
            groups.append(self._at_once(tables, wheres, specs))
        return merge_pieces(groups, self.alloc)

    def _at_once(self, tables: list[pa.Table], wheres: list[str], specs: Sequence[OutputSpec]) -> dict:
        """Files' tables (``wheres``: each one's name in messages) joined and converted once; where their
        schemas differ, one by one. A value that fails conversion (a null) is named in its own file."""
        if len(tables) == 1:
            return self._convert(tables[0], specs, wheres[0])
        try:
            table = _joined(pa.concat_tables(tables))
        except pa.ArrowException:  # schemas that differ (a column widened, nullability), or too much to join
            return merge_pieces([self._convert(t, specs, w) for t, w in zip(tables, wheres)], self.alloc)
        rows = [t.num_rows for t in tables]
        tables.clear()  # held by the joined table where not joined
        try:
            return self._convert(table, specs, f"{wheres[0]} and the {len(rows) - 1} small files packed with it")
        except GpuloadError:
            at = 0
            for n, w in zip(rows, wheres):  # the file that fails on its own, named
                self._convert(table.slice(at, n), specs, w)
                at += n
            raise

    def _read(self, f: SourceFile, chunk: Chunk, specs: Sequence[OutputSpec], where: str) -> pa.Table:
        """The chunk's rows of the columns ``specs`` read (Hive keys added, the row filter applied,
        the stored keys and INT96 ranges checked), as an Arrow table; a ``decode`` span recorded."""
        m = self.metrics
        t0 = m.clock() if m is not None else 0.0
        needed = needed_columns(specs)
        stored = [c for c in needed if c not in f.partition_names]
        extra = [c for c in self.filter_columns if c not in f.partition_names and c not in stored]
        leaves = [i for c in stored + extra for i in f.leaves(c)]
        try:
            if f.remote:  # the column ranges, fetched (or started ahead) by the reader; its wait is `read`
                src = self.fetch(f, chunk, leaves)
                t0 = m.clock() if m is not None else 0.0
            else:
                src = f.path if m is None else _TimedFile(f.path, m, self.buffer)
            try:  # by leaf index: a name with dots never selects a struct's child
                table = read_columns(src, f, chunk, leaves, dictionary=_hashed_strings(specs, stored))
                kept = None
                if self.row_filter is not None:  # the rows it keeps, then only the outputs' columns
                    kept = filter_table(table.select([c for c in self.filter_columns if c in table.column_names]),
                                        f, self.row_filter, table.num_rows, where)
                    table = keep(table, kept).drop_columns(extra)
                int96 = [c for c in stored if c in f.int96]
                if int96:  # microseconds may not hold them all: seconds always do
                    seconds = read_columns(src, f, chunk, [i for c in int96 for i in f.leaves(c)], "s")
                    _check_int96(table, seconds if kept is None else keep(seconds, kept), where)
            finally:
                if m is not None and not f.remote:
                    src.close()
        except (OSError, pa.ArrowException) as e:
            raise _read_error(f, chunk, stored, where, e, self.fetch) from None
        check_unchanged(f, during=True)
        if table.num_rows != chunk.rows:
            promised = "the filter kept when counted at open" if self.row_filter is not None else "the footer promises"
            raise SourceError(f"{where}: read {table.num_rows} rows where {promised} {chunk.rows}")
        for c in needed:
            if c in f.partition_names:  # a Hive partition key (or a column the file lacks: nulls), in every row
                table = table.append_column(c, pa.repeat(f.partition_scalar(c), chunk.rows))
            elif c in dict(f.file_keys) and not (self.row_filter is not None and c in self.filter_columns):
                # a key the file stores too: it must hold the folder's value (filter_table checked the filter's)
                err = stored_key_error(f, c, table.column(c).combine_chunks(), where)
                if err is not None:
                    raise err
        if m is not None:  # pyarrow's time apart from I/O
            m.record("decode", t0 + (0.0 if f.remote else src.seconds), m.clock(), nbytes=table.nbytes,
                     rows=table.num_rows)
        return table

    def _convert(self, table: pa.Table, specs: Sequence[OutputSpec], where: str) -> dict:
        """``table`` converted into a column set (:func:`table_to_columns`); a ``convert`` span recorded."""
        if self.metrics is None:
            return table_to_columns(table, specs, where, self.alloc, self.pieces)
        with self.metrics.span("convert", rows=table.num_rows) as span:
            cols = table_to_columns(table, specs, where, self.alloc, self.pieces)
            span.nbytes = nbytes(cols)
        return cols
