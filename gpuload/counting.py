"""Counting over the source files at open: the vocabulary of a :class:`gpuload.Vocab` column,
and the rows a row filter keeps in each row group.

:func:`kept_groups` gives, per row group of each file, the rows a :class:`gpuload.rowfilter.RowFilter`
keeps: row groups the statistics and Hive keys rule out are not read; of the others only the
filter's columns are read (remote objects: only their byte ranges), on ``threads`` threads.

:func:`vocabulary_for` returns the vocabulary kept in the cache under the column's and the
files' identity (:mod:`gpuload.cache.vocabs`), or counts it: only that column is read
(remote objects: only its byte ranges), one row group at a time on ``threads`` threads
(with a row filter, over the rows it keeps: the filter's columns are read too, and row
groups the statistics rule out are not read),
string columns as dictionaries (each row group's distinct values counted through their
indices). Values are counted as bytes (a string and the same bytes as binary are one
value); nulls are not counted. The vocabulary orders the values seen at least
``min_count`` times by count, most frequent first, then by their bytes, so the same data
gives the same ids everywhere. Concurrent openers (DDP ranks, Dask workers) sharing a
cache count once: the first takes the vocabulary's lock, the others read its file.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .cache.fs import CacheRoot
from .cache.kept import kept_key, load_kept, save_kept
from .cache.vocabs import load_vocabulary, save_vocabulary, vocab_key, vocab_lock
from .categorical import Vocab, parse_key
from .vocabulary import Vocabulary, register, registered
from .decode import kept_positions, read_columns
from .errors import ConfigError, SourceError, setting
from .plan import Chunk
from .rowfilter import RowFilter, candidate_groups
from .schema import OutputSpec, list_value
from .sources.listing import SourceFile

__all__ = ["counted", "vocabulary_for", "count_vocabulary", "kept_groups"]

log = logging.getLogger("gpuload")


def _counted(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(distinct values as large_binary, their counts) of a flat array, nulls left out."""
    if pa.types.is_dictionary(arr.type):
        idx = arr.indices.drop_null().to_numpy(zero_copy_only=False)
        counts = np.bincount(idx, minlength=len(arr.dictionary)) if len(idx) else np.zeros(len(arr.dictionary), int)
        seen = np.flatnonzero(counts)
        return _counted_values(arr.dictionary.take(pa.array(seen))), counts[seen].astype(np.int64)
    vc = pc.value_counts(arr.drop_null())
    return _counted_values(vc.field("values")), vc.field("counts").to_numpy(zero_copy_only=False).astype(np.int64)


def _counted_values(values: pa.Array) -> pa.Array:
    """Values as bytes: a string and the same bytes as binary are one vocabulary entry."""
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    return values.cast(pa.large_binary())


def _count_group(f: SourceFile, index: int, group: int, column: str, fetch: Callable | None,
                 flt: RowFilter | None = None, filter_columns: Sequence[str] = ()) -> list[tuple[pa.Array, np.ndarray]]:
    """The distinct values and counts of ``column`` in row group ``group`` of file ``f`` (number
    ``index``), in the rows ``flt`` keeps where given (reading ``filter_columns``, its columns)."""
    rows = f.metadata.row_group(group).num_rows
    chunk = Chunk(index, group, group + 1, rows, 0)
    kept = None if flt is None else kept_positions(f, chunk, flt, filter_columns, fetch)
    if kept is not None and len(kept) == rows:
        kept = None  # every row: nothing to take
    if kept is not None and not len(kept):
        return []
    if column in f.partition_names:  # a Hive key: one value in every row (a null key: none counted)
        value = f.partition_scalar(column)
        return [] if not value.is_valid else [(_counted_values(pa.array([value.as_py()], value.type)),
                                               np.array([rows if kept is None else len(kept)], np.int64))]
    leaves = list(f.leaves(column))
    listed = list_value(f.schema.field(column).type) is not None
    try:
        src = fetch(f, chunk, leaves) if f.remote else f.path
        table = read_columns(src, f, chunk, leaves, dictionary=() if listed else (column,))
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{f.path} (row group {group}): column {column!r} cannot be read to count its vocabulary "
                          f"({' '.join(str(e).split())})") from None
    col = table.column(0) if kept is None else table.column(0).take(pa.array(kept))
    return [_counted(arr.flatten() if listed else arr) for arr in col.chunks]


def count_vocabulary(files: Sequence[SourceFile], column: str, vocab: Vocab, threads: int = 1,
                     fetch: Callable | None = None, flt: RowFilter | None = None,
                     filter_columns: Sequence[str] = ()) -> Vocabulary:
    """Count ``column`` over every row group of ``files`` (see the module) into a :class:`Vocabulary`;
    with ``flt``, over the rows it keeps (``filter_columns``: its columns).

    Raises :class:`~gpuload.ConfigError` when more than ``vocab.max_size`` values are seen at
    least ``vocab.min_count`` times, naming the ``min_count`` that would fit.
    """
    jobs = [(f, i, g) for i, f in enumerate(files)
            for g in (range(f.metadata.num_row_groups) if flt is None else candidate_groups(f, flt, filter_columns))]
    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="gpuload-count") as pool:
            parts = [p for ps in pool.map(lambda j: _count_group(*j, column, fetch, flt, filter_columns), jobs)
                     for p in ps]
    else:
        parts = [p for j in jobs for p in _count_group(*j, column, fetch, flt, filter_columns)]
    if parts:
        table = pa.table({"value": pa.concat_arrays([v for v, _ in parts]),
                          "count": pa.array(np.concatenate([c for _, c in parts]), pa.int64())})
        table = table.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])
    else:
        table = pa.table({"value": pa.array([], pa.large_binary()), "count": pa.array([], pa.int64())})
    table = table.filter(pc.greater_equal(table.column("count"), vocab.min_count))
    table = table.take(pc.sort_indices(table, [("count", "descending"), ("value", "ascending")]))
    counts = table.column("count").to_numpy()
    if vocab.max_size is not None and len(counts) > vocab.max_size:
        fits = int(counts[vocab.max_size]) + 1  # leaves out every value as rare as the first that does not fit
        kept = int((counts >= fits).sum())
        rarer = (f", or min_count to {fits} (a vocabulary of {kept:,} value{'' if kept == 1 else 's'})" if kept else
                 f" (no min_count keeps at most {vocab.max_size:,}: the {vocab.max_size + 1:,} most frequent values "
                 f"are each seen {fits - 1:,} times)")
        raise ConfigError(f"{setting('categorical', {column: vocab})}: column {column!r} has {len(counts):,} values "
                          f"seen at least {vocab.min_count} times, more than max_size={vocab.max_size:,}; raise "
                          f"max_size to {len(counts):,}{rarer}, or use gpuload.Hash(buckets=...)")
    if not len(counts) and vocab.min_count > 1:  # every value would be id 0: a min_count past every count
        log.warning("gpuload: %s: no value of column %r is seen %d times or more: every row's id is 0 (the "
                    "out-of-vocabulary id); lower min_count", setting("categorical", {column: vocab}), column,
                    vocab.min_count)
    return Vocabulary(column, table.column("value").combine_chunks(), counts, vocab)


def counted(specs: list[OutputSpec], files: Sequence[SourceFile], root: CacheRoot | None, threads: int = 1,
            fetch: Callable | None = None, flt: RowFilter | None = None, filter_columns: Sequence[str] = ()
            ) -> tuple[list[OutputSpec], dict[str, Vocabulary]]:
    """``specs`` with each :class:`gpuload.Vocab` column's vocabulary (:func:`vocabulary_for`, over
    the rows ``flt`` keeps) named in its encoder key, so that the cache key follows the
    vocabulary; and the vocabularies by column, those given whole too (their keys name them)."""
    vocabularies: dict[str, Vocabulary] = {}
    out = []
    for s in specs:
        sources = []
        for c, vt in zip(s.columns, s.sources):
            given = registered(vt.encode) if vt.encode.startswith("vocab:") else None
            if given is not None:  # a vocabulary given whole (its key names its digest): nothing to count
                vocabularies[c] = given
            elif vt.encode.startswith("vocab:"):
                if c not in vocabularies:
                    vocabularies[c] = vocabulary_for(files, c, parse_key(vt.encode), root, threads, fetch, flt,
                                                     filter_columns)
                vt = dataclasses.replace(vt, encode=vocabularies[c].key)
            sources.append(vt)
        out.append(dataclasses.replace(s, sources=tuple(sources)))
    return out, vocabularies


def vocabulary_for(files: Sequence[SourceFile], column: str, vocab: Vocab, root: CacheRoot | None,
                   threads: int = 1, fetch: Callable | None = None, flt: RowFilter | None = None,
                   filter_columns: Sequence[str] = ()) -> Vocabulary:
    """The vocabulary of ``column`` by ``vocab`` over ``files`` (over the rows ``flt`` keeps, where
    given: ``filter_columns`` are its columns): read from the cache (``root``), else counted
    (under the vocabulary's lock, so that concurrent openers count once) and kept there;
    registered for this process's conversions either way."""
    key = vocab_key(column, vocab, [_identity(f) for f in files], None if flt is None else flt.key)
    count = functools.partial(count_vocabulary, files, column, vocab, threads, fetch, flt, filter_columns)
    got = load_vocabulary(root, key)
    if got is None and root is not None:
        try:
            lock = vocab_lock(root, key)
            lock.acquire()
        except OSError as e:  # a read-only cache: count here, keep nothing
            log.warning("gpuload: cannot lock the vocabulary of %r in %s (%s); counting it without keeping it",
                        column, root.path, e)
            lock = None
        try:
            got = load_vocabulary(root, key)  # counted by another opener while this one waited
            if got is None:
                got = count()
                try:
                    save_vocabulary(root, key, got, len(files))
                except OSError as e:
                    log.warning("gpuload: cannot keep the vocabulary of %r in %s (%s); it is counted again at the "
                                "next open", column, root.path, e)
        finally:
            if lock is not None:
                lock.release()
    elif got is None:
        got = count()
    return register(got)


def _identity(f: SourceFile) -> tuple:
    """What names a source file's counts in the cache: path, size, mtime and store version, and the
    Hive keys it also stores with their folders' values (a filter reading one checks it: the same
    file given alone, where the column is only the file's, or counted before that check, is counted
    apart)."""
    keys = [[k, None if v is None else str(v)] for k, v in f.file_keys]
    return (f.path, f.size, f.mtime_ns, f.tag) + ((keys,) if keys else ())


def _kept_in(f: SourceFile, index: int, group: int, flt: RowFilter, columns: list[str], fetch: Callable | None) -> int:
    """Rows of row group ``group`` of ``f`` (number ``index``) that ``flt`` keeps, reading ``columns``."""
    chunk = Chunk(index, group, group + 1, f.metadata.row_group(group).num_rows, 0)
    return len(kept_positions(f, chunk, flt, columns, fetch))


def kept_groups(files: Sequence[SourceFile], flt: RowFilter, columns: list[str], threads: int = 1,
                fetch: Callable | None = None, root: CacheRoot | None = None) -> list[list[int]]:
    """Per file, per row group, the rows ``flt`` keeps (0 for a row group the statistics or Hive
    keys rule out, which is not read); ``columns``: the filter's (:meth:`RowFilter.columns`).
    Counts kept in the cache ``root`` (:mod:`gpuload.cache.kept`) are read, not counted again;
    new counts are kept there (a cache that cannot be written only loses that)."""
    out, todo = [], set()
    for i, f in enumerate(files):
        got = load_kept(root, kept_key(flt.key, _identity(f)), f.metadata.num_row_groups)
        out.append(got if got is not None else [0] * f.metadata.num_row_groups)
        if got is None:
            todo.add(i)
    jobs = [(f, i, g) for i, f in enumerate(files) if i in todo for g in candidate_groups(f, flt, columns)]
    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="gpuload-count") as pool:
            counts = list(pool.map(lambda j: _kept_in(*j, flt, columns, fetch), jobs))
    else:
        counts = [_kept_in(*j, flt, columns, fetch) for j in jobs]
    for (f, i, g), n in zip(jobs, counts):
        out[i][g] = n
    for i in sorted(todo) if root is not None else ():  # keep the new counts
        if not files[i].stat_matches():  # counted from another version than the one opened: not kept
            raise SourceError(f"{files[i].path} changed or disappeared while the filter's rows were counted; "
                              "open the dataset again to pick up the new file")
        try:
            save_kept(root, kept_key(flt.key, _identity(files[i])), flt.key, _identity(files[i]), out[i])
        except OSError as e:
            log.warning("gpuload: cannot keep the filter's counts of %s in the cache (%s); they are counted "
                        "again at the next open", files[i].path, e)
    return out


