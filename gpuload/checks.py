"""Open-time checks: every input error that can be found before the first batch is found then.

An epoch that dies at 80% after hours of decoding is the worst way to learn about a
null or an out-of-range value, so a dataset checks, when it opens:

* that every file has every selected column with one (dictionary-decoded) type;
* nulls in columns without a fill value: from the footers' statistics where they can
  tell; where they cannot (list columns, whose leaf null count also counts empty
  lists and null elements, and files written without statistics), by reading just
  those columns of just those row groups once. Row groups whose chunks are already
  cached are never read (they were converted under the same spec);
* ``dtypes=`` casts to integers or bool, against the statistics' minimum and maximum,
  and every fill value against its output dtype.

The decoders still check every value, so a file without statistics is never served wrong.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .convert import cast_values
from .errors import NullValuesError, SchemaError, SourceError, setting
from .schema import BFLOAT16, FIXED, RAGGED, OutputSpec
from .source import SourceFile

__all__ = ["check_consistent", "check_nulls", "check_casts"]


def _logical(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def check_consistent(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Every file has every selected column, with the same (dictionary-decoded) type."""
    first = files[0]
    for f in files[1:]:
        for s in specs:
            for c in s.columns:
                want = _logical(first.schema.field(c).type)
                if c not in f.schema.names:
                    raise SchemaError(f"column {c!r} is in {first.path} but not in {f.path}; "
                                      "select columns every file has, or fix the files")
                got = _logical(f.schema.field(c).type)
                if got != want:
                    raise SchemaError(f"column {c!r} is {want} in {first.path} but {got} in {f.path}; "
                                      "rewrite the files with one type for it")


def _null_message(column: str, nulls: int, lists: bool, where: list[str]) -> NullValuesError:
    files = ", ".join(dict.fromkeys(where))
    if lists:
        return NullValuesError(
            f"column {column!r} has {nulls} null lists or null list elements (in {files}); pass "
            f"{setting('fill_nulls', {column: 0})} to make null lists empty and null elements 0 "
            "(fixed-size lists: rows of the fill value), or another fill value")
    return NullValuesError(f"column {column!r} has {nulls} null values (in {files}); pass "
                           f"{setting('fill_nulls', {column: 0})} (or another value, or one number for every "
                           "column) to replace them")


def _scan(f: SourceFile, column: str, groups: list[int], lists: bool) -> int:
    """Nulls (null lists plus null elements for lists) in ``column`` of row groups ``groups``."""
    try:
        reader = pq.ParquetFile(f.path, metadata=f.metadata).reader
        table = reader.read_row_groups(groups, column_indices=list(f.leaves(column)), use_threads=True)
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{f.path}: cannot be read ({e}); the file may be truncated or corrupt") from None
    col = table.column(0)
    if not lists:
        return col.null_count
    return col.null_count + pc.list_flatten(col).null_count


def check_nulls(files: Sequence[SourceFile], specs: Sequence[OutputSpec],
                cached: Callable[[int, int], bool] = lambda f, g: False) -> None:
    """Raise :class:`NullValuesError` for a column without a fill value that holds nulls.

    ``cached(file index, row group)`` says whether a row group's chunk is cached: such
    row groups are not read.
    """
    for s in specs:
        lists = s.kind in (RAGGED, FIXED)
        for c, fill in zip(s.columns, s.fills):
            if fill is not None:
                continue
            nulls, where = 0, []
            for i, f in enumerate(files):
                if c in f.partition_names:
                    if dict(f.partitions)[c] is None:
                        nulls, where = nulls + f.metadata.num_rows, where + [f.path]
                    continue
                leaf, unknown = f.leaves(c)[0], []
                for g in range(f.metadata.num_row_groups):
                    st = f.metadata.row_group(g).column(leaf).statistics
                    known = st is not None and st.has_null_count
                    if known and st.null_count and not lists:
                        nulls, where = nulls + st.null_count, where + [f.path]
                    elif (not known or (lists and st.null_count)) and not cached(i, g):
                        unknown.append(g)
                if unknown:
                    n = _scan(f, c, unknown, lists)
                    if n:
                        nulls, where = nulls + n, where + [f.path]
            if nulls:
                raise _null_message(c, nulls, lists, where)


def _plain(values: list, dtype: np.dtype) -> np.ndarray | None:
    try:
        return np.array(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        return None


def check_casts(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Raise :class:`~gpuload.ConfigError` when a cast to an integer or bool output cannot
    hold a value the statistics report (or a fill value)."""
    for s in specs:
        if s.dtype == BFLOAT16 or np.dtype(s.dtype).kind not in "biu":
            continue  # casts to floats may round; nothing to refuse
        for c, vt, fill in zip(s.columns, s.sources, s.fills):
            src = np.dtype(vt.dtype)
            if vt.temporal or np.can_cast(src, s.dtype, "safe"):
                continue
            if fill is not None:
                cast_values(np.array([fill], src), s.dtype, c, f"its fill value ({setting('fill_nulls', {c: fill})})")
            for f in files:
                if c in f.partition_names:
                    v = _plain([dict(f.partitions)[c]], src) if dict(f.partitions)[c] is not None else None
                    if v is not None:
                        cast_values(v, s.dtype, c, f"{f.path} (its partition folder)")
                    continue
                if src.kind == "f" and src.itemsize == 2:
                    continue  # float16 statistics are not plain numbers
                leaf = f.leaves(c)[0]
                for g in range(f.metadata.num_row_groups):
                    st = f.metadata.row_group(g).column(leaf).statistics
                    if st is None or not st.has_min_max:
                        continue
                    v = _plain([st.min, st.max], src)
                    if v is not None:
                        cast_values(v, s.dtype, c, f"{f.path} (row group {g}, by its statistics)")
