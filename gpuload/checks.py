"""Open-time checks: every input error that can be found before the first batch is found then.

An epoch that dies at 80% after hours of decoding is the worst way to learn about a
null or an out-of-range value, so a dataset checks, when it opens:

* that every file has every selected column with one (dictionary-decoded) type, or types
  that one type holds exactly (:mod:`gpuload.drift`: schema drift between writers);
* nulls in columns without a fill value: from the footers' statistics where they can
  tell; where they cannot (list columns, whose leaf null count also counts empty
  lists and null elements, and files written without statistics), from the footers'
  definition-level histograms where the writer kept them (pyarrow does:
  :mod:`gpuload.sources.levels`), else by reading just those columns of just those row
  groups once. Row groups whose chunks are already
  cached are never read (they were converted under the same spec);
* ``dtypes=`` casts to integers or bool, against the statistics' minimum and maximum,
  and every fill value against its output dtype.

The decoders still check every value, so a file without statistics is never served wrong.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .categorical import Hash, parse_key
from .vocabulary import registered
from .casts import cast_values, may_overflow
from .convert import nulls_error
from .errors import ConfigError, SourceError, flag, setting
from .dtypes import BFLOAT16
from .schema import FIXED, RAGGED, OutputSpec
from .sources.levels import null_counts
from .sources.listing import SourceFile

__all__ = ["check_nulls", "check_casts", "check_partition_keys",
           "stored_key_error", "stats_agree", "old_arrow_error", "files_text", "column_names"]


def files_text(where: list[str], shown: int = 3) -> str:
    """``(in a, b, c and 2 more files)``: the first ``shown`` distinct files of ``where``, for messages."""
    files = list(dict.fromkeys(where))
    more = f" and {len(files) - shown} more files" if len(files) > shown else ""
    return f"(in {', '.join(files[:shown])}{more})"


# pyarrow before 26 cannot read a fixed-size list column with null rows (apache/arrow#35692)
_OLD_ARROW = int(pa.__version__.split(".")[0]) < 26


def column_names(columns: list[str]) -> str:
    """``column 'a'`` or ``columns 'a', 'b'``, for messages."""
    return f"column{'s' if len(columns) > 1 else ''} " + ", ".join(repr(c) for c in columns)


def old_arrow_error(where: str, columns: list[str], error) -> SourceError | None:
    """The error for pyarrow < 26 failing on a fixed-size list with null rows (which pyarrow
    itself writes), naming the pyarrow to install; None for any other ``error``."""
    if not (_OLD_ARROW and str(error).startswith("Expected all lists to be of size=")):
        return None
    return SourceError(f"{where}: {column_names(columns)} cannot be read: pyarrow {pa.__version__} cannot read "
                       f"fixed-size lists that hold null rows, which pyarrow writes (apache/arrow#35692, fixed in "
                       f"pyarrow 26): upgrade pyarrow (pip install 'pyarrow>=26'), or rewrite the column without "
                       f"null rows")


def _scan(f: SourceFile, column: str, groups: list[int], lists: bool) -> int:
    """Nulls (null lists plus null elements for lists) in ``column`` of row groups ``groups``
    of local file ``f``, read one row group at a time (memory: one row group of one column)."""
    nulls = 0
    try:
        reader = pq.ParquetFile(f.path, metadata=f.metadata).reader
        for g in groups:
            col = reader.read_row_groups([g], column_indices=list(f.leaves(column)), use_threads=False).column(0)
            flat = lists and not pa.types.is_null(col.type)  # a null-typed column: null lists only (wider)
            nulls += col.null_count + (pc.list_flatten(col).null_count if flat else 0)
    except (OSError, pa.ArrowException) as e:
        raise (old_arrow_error(str(f.path), [column], e) or
               SourceError(f"{f.path}: cannot be read ({e}); the file may be truncated or corrupt")) from None
    return nulls


#: a footer byte walked in Python (sources.levels) costs about what this many bytes of column data cost to
#: decode (measured: 5 MB of footer in 1.05 s, list columns at about 1 GB/s)
_WALK_COST = 200
_WALK_FREE = 256 << 10  # footer bytes walked whatever the data: about 50 ms
_SCAN_GROUPS = 4  # row groups per scan job: enough jobs to keep every thread busy, few files opened


def _scan_all(jobs: list[tuple], threads: int) -> list[int]:
    """:func:`_scan` of each ``(file, column, groups, lists)`` job, split into jobs of at most
    ``_SCAN_GROUPS`` row groups run on ``threads`` threads (pyarrow decodes without the GIL);
    the null count of each job, in order."""
    parts = [(j, (f, c, gs[k:k + _SCAN_GROUPS], lists)) for j, (f, c, gs, lists) in enumerate(jobs)
             for k in range(0, len(gs), _SCAN_GROUPS)]
    if threads <= 1 or len(parts) <= 1:
        counts = [_scan(*p) for _, p in parts]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(parts)), thread_name_prefix="gpuload-check") as pool:
            counts = list(pool.map(lambda p: _scan(*p), [p for _, p in parts]))
    out = [0] * len(jobs)
    for (j, _), n in zip(parts, counts):
        out[j] += n
    return out


def check_nulls(files: Sequence[SourceFile], specs: Sequence[OutputSpec],
                cached: Callable[[int, int], bool] = lambda f, g: False, threads: int = 1) -> None:
    """Raise :class:`NullValuesError` naming every column without a fill value that holds
    nulls, with the one ``fill_nulls`` that covers them all.

    ``cached(file index, row group)`` says whether a row group's chunk is cached: such
    row groups are not checked (their chunks were converted under these outputs and fill
    values, which refuse nulls). Remote objects' row groups are not read either (that would
    fetch their columns twice): where their footers cannot tell, the first epoch's
    conversion raises the same :class:`NullValuesError`, naming the chunk. The columns
    that are read are read on ``threads`` threads (default 1; a dataset passes its
    ``num_threads``), a few row groups per job.
    """
    found: dict[str, list] = {}  # column -> [nulls, is a list, files holding them], in spec order
    jobs, todo = [], {}  # todo: file index -> (column, leaf, row groups the statistics cannot clear, is a list)
    for s in specs:
        lists = s.kind in (RAGGED, FIXED)
        for c, vt, fill in zip(s.columns, s.sources, s.fills):
            if fill is not None or vt.encode or c in found:  # categorical ids: a null is id 0
                continue
            entry = found[c] = [0, lists, []]
            for i, f in enumerate(files):
                if c in f.partition_names:
                    if dict(f.partitions)[c] is None:
                        entry[0] += f.metadata.num_rows
                        entry[2].append(f.path)
                    continue
                leaf, unknown = f.leaves(c)[0], []
                for g in range(f.metadata.num_row_groups):
                    if cached(i, g):  # converted under these outputs and fills: no null it refuses
                        continue
                    st = f.metadata.row_group(g).column(leaf).statistics
                    known = st is not None and st.has_null_count
                    if known and st.null_count and not lists:
                        entry[0] += st.null_count
                        entry[2].append(f.path)
                    elif not known or (lists and st.null_count):
                        unknown.append(g)
                if unknown:
                    todo.setdefault(i, []).append((c, leaf, unknown, lists))
    for i, wanted in todo.items():  # list columns: the footer's definition-level histograms, one walk a file
        f, md = files[i], files[i].metadata
        list_columns = [w for w in wanted if w[3]]
        data = sum(md.row_group(g).column(leaf).total_uncompressed_size
                   for _, leaf, groups, _ in list_columns for g in groups)
        # a small footer is walked (tens of ms); a large one only where reading the columns would cost more
        walk = md.serialized_size <= _WALK_FREE or md.serialized_size * _WALK_COST < data
        counted = iter(null_counts(md, f.schema, list_columns) if walk else [None] * len(list_columns))
        for (c, _, unknown, lists) in wanted:
            n = next(counted) if lists else None
            if n is None and not f.remote:  # remote: not fetched twice, the conversion raises the same error
                jobs.append((f, c, unknown, lists))
            elif n:
                found[c][0] += n
                found[c][2].append(f.path)
    if jobs:
        for (f, c, _, _), n in zip(jobs, _scan_all(jobs, threads)):
            if n:
                found[c][0] += n
                found[c][2].append(f.path)
        pa.default_memory_pool().release_unused()  # what Arrow's allocator kept of the columns read goes back
    order = {f.path: i for i, f in enumerate(files)}  # messages name files in the order given
    bad = [(c, nulls, lists, files_text(sorted(where, key=order.__getitem__)) + _lacking(files, c))
           for c, (nulls, lists, where) in found.items() if nulls]
    if bad:  # every such column at once: one run finds them all
        raise nulls_error(bad)


def _lacking(files: Sequence[SourceFile], column: str) -> str:
    """Where files lack ``column`` (read as nulls there: :func:`gpuload.drift.absent_as_nulls`), how many."""
    n = sum(column in f.absent for f in files)
    return f" ({n} {'file lacks' if n == 1 else 'files lack'} the column, added later: its rows there are null)" if n \
        else ""


def _bounds(st, vt, src: np.dtype) -> np.ndarray | None:
    """The statistics' minimum and maximum as the values gpuload converts (``src`` dtype),
    or None where they cannot be had exactly (then only the decoders check)."""
    try:
        if vt.temporal:  # timestamps, times, durations, date32: the stored integers, as converted
            if vt.temporal != "int" or st.physical_type not in ("INT32", "INT64"):
                return None
            values = [st.min_raw, st.max_raw]
        elif src.kind == "f" and src.itemsize == 2:  # float16: two bytes each
            raw = st.min_raw + st.max_raw
            return np.frombuffer(raw, "<f2").astype(src) if len(raw) == 4 else None
        else:
            values = [st.min, st.max]
        if not all(isinstance(v, (bool, int, float, np.generic)) for v in values):
            return None
        return np.array(values, dtype=src)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def check_casts(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Raise :class:`~gpuload.ConfigError` when a cast to an integer or bool output cannot
    hold a value the statistics report (or a fill value), when a cast to a narrower float would
    make one an infinity, and where a stacked group's common float type would round one of its
    integers (:attr:`OutputSpec.exact`)."""
    for s in specs:
        for c, vt in zip(s.columns, s.sources):
            if vt.encode:
                _check_ids_fit(s, c, parse_key(vt.encode), vt.encode)
        if s.dtype == BFLOAT16 or (np.dtype(s.dtype).kind not in "biu" and not s.exact and not any(
                np.dtype(vt.dtype).kind in "iuf" and may_overflow(np.dtype(vt.dtype), np.dtype(s.dtype))
                for vt in s.sources if not vt.encode)):
            continue  # casts to floats may round where dtypes= chose them: nothing to refuse but infinities
        exact = s.name if s.exact else ""
        for c, vt, fill in zip(s.columns, s.sources, s.fills):
            src = np.dtype(vt.dtype)
            if vt.encode or (np.can_cast(src, s.dtype, "safe") and not (exact and src.kind in "iu")):
                continue
            if fill is not None:
                cast_values(np.array([fill], src), s.dtype, c, f"its fill value ({setting('fill_nulls', {c: fill})})",
                            exact)
            for f in files:
                if c in f.partition_names:
                    value = dict(f.partitions)[c]
                    if value is not None and not vt.temporal:
                        cast_values(np.array([value], src), s.dtype, c, f"{f.path} (its partition folder)", exact)
                    continue
                leaf = f.leaves(c)[0]
                for g in range(f.metadata.num_row_groups):
                    st = f.metadata.row_group(g).column(leaf).statistics
                    v = _bounds(st, vt, src) if st is not None and st.has_min_max else None
                    if v is not None:
                        cast_values(v, s.dtype, c, f"{f.path} (row group {g}, by its statistics)", exact)


def _check_ids_fit(s: OutputSpec, column: str, enc, key: str) -> None:
    """Refuse an output dtype that cannot hold every categorical id of ``column`` exactly: ids
    ``0..buckets``, or any int64 without buckets (a float holds integers exactly only up to
    2**(mantissa bits + 1); a stacked group with float columns is a float output too)."""
    dtype = BFLOAT16 if s.dtype == BFLOAT16 else np.dtype(s.dtype)
    if dtype == np.dtype(np.int64):
        return
    exact = {BFLOAT16: 2**8}.get(dtype) if dtype == BFLOAT16 else (
        2 ** (np.finfo(dtype).nmant + 1) if dtype.kind == "f" else 0 if dtype.kind == "b" else np.iinfo(dtype).max)
    if isinstance(enc, Hash):
        top = enc.buckets if enc.buckets else None  # None: ids span all of int64, negatives too
    else:  # a counted vocabulary: ids up to its size (counted by now), at most max_size
        top = len(vocabulary) if (vocabulary := registered(key)) is not None else enc.max_size or 2**31
    if top is not None and top <= exact:
        return
    name = "bfloat16" if dtype == BFLOAT16 else str(dtype)
    ids = f"ids up to {top:,}" if top is not None else "64-bit hash ids (negative ones too)"
    fewer = "choose fewer buckets, " if isinstance(enc, Hash) else "raise min_count (fewer values), "
    what = (f"output {s.name!r} ({name}, stacked with {', '.join(repr(m) for m in s.columns if m != column)})"
            if len(s.columns) > 1 and s.name not in dict.fromkeys(s.columns) else f"{name}")
    raise ConfigError(f"column {column!r} gets {ids} ({setting('categorical', {column: enc})}), which {what} cannot "
                      f"hold exactly: " + ("give the column buckets (Hash(buckets=...)) that fit, " if top is None else
                                           fewer) +
                      f"or keep the ids int64 (in {flag('dtypes')}; a categorical column stacks exactly only with "
                      "integer columns)")


def stored_key_error(f: SourceFile, column: str, values, where: str) -> SourceError | None:
    """The error for partition key ``column`` stored in file ``f`` when its ``values`` (an Arrow
    array) are not all the value of the file's partition folder; None when they are."""
    value = dict(f.file_keys)[column]
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if value is not None and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        value = _folder_text(f, column, value)  # zip=01234 holds "01234", not the number the folder reads as
    if value is None:  # a null partition (__HIVE_DEFAULT_PARTITION__): every row null
        bad = len(values) - values.null_count
    else:
        try:
            want = pa.scalar(value).cast(values.type)
            equal = pc.equal(values, want)
        except (pa.ArrowException, TypeError, ValueError):
            bad = len(values)
        else:
            bad = len(values) - (pc.sum(equal.fill_null(False)).as_py() or 0)
    if not bad:
        return None
    return SourceError(f"{f.path}: column {column!r} holds {bad} of {len(values)} values other than its partition "
                       f"folder's ({column}={value}) in {where}; the file and the folder disagree: rewrite the file, "
                       "move it to the right folder, or leave the column out of columns=")


def _folder_text(f: SourceFile, column: str, value) -> str:
    """The text of partition folder ``column=...`` above ``f`` (URL-decoded), as a file storing the
    key as a string holds it; ``str(value)`` where no such folder is named."""
    from urllib.parse import unquote

    for part in reversed((f.shown or f.path).split("/")[:-1]):
        if part.startswith(column + "="):
            return unquote(part[len(column) + 1:])
    return str(value)


def stats_agree(st, value, num_rows: int) -> bool:
    """Whether a row group's statistics show every value of a column equal to ``value``
    (False: they cannot tell, or show otherwise; the values are then read)."""
    if st is None or not st.has_null_count:
        return False
    if value is None:
        return st.null_count == num_rows
    if st.null_count or not st.has_min_max:
        return False
    try:
        return bool(st.min == value and st.max == value)
    except (TypeError, ValueError):
        return False


def check_partition_keys(files: Sequence[SourceFile], specs: Sequence[OutputSpec],
                         cached: Callable[[int, int], bool] = lambda f, g: False) -> None:
    """Raise :class:`SourceError` naming the file and key when a partition key that a file also
    stores as a column (and that is loaded) holds another value than its folder says.

    The footers' statistics answer for most files; where they cannot, the column is read
    (local files; row groups whose chunks are cached are skipped). A remote object's
    column is checked by the decoder instead (:func:`stored_key_error`), as it is converted.
    """
    needed = {c for s in specs for c in s.columns}
    for i, f in enumerate(files):
        for column, value in f.file_keys:
            if column not in needed:
                continue
            leaves = list(f.leaves(column))
            unknown = [g for g in range(f.metadata.num_row_groups) if not cached(i, g) and not stats_agree(
                f.metadata.row_group(g).column(leaves[0]).statistics, value, f.metadata.row_group(g).num_rows)]
            if not unknown or f.remote:
                continue
            try:
                reader = pq.ParquetFile(f.path, metadata=f.metadata).reader
                for g in unknown:
                    col = reader.read_row_groups([g], column_indices=leaves, use_threads=False).column(0)
                    err = stored_key_error(f, column, col.combine_chunks(), f"row group {g}")
                    if err is not None:
                        raise err
            except (OSError, pa.ArrowException) as e:
                raise SourceError(f"{f.path}: cannot be read ({e}); the file may be truncated or corrupt") from None
