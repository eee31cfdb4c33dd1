"""Row filters (``filters=``): which rows a dataset keeps, decided once, before anything is cached.

A filter is a ``pyarrow.compute`` expression, or the disjunctive normal form pandas and
pyarrow accept (``[("day", ">=", 20260101), ("country", "in", ["DE", "FR"])]``: a list of
conditions all of which hold, or a list of such lists any of which holds), over any columns of
the files, loaded or not, Hive partition keys included. It is applied in three places:

* at open, the footers' statistics (and the Hive keys) exclude row groups
  (:func:`candidate_groups`): those are never read, and remote ones never fetched;
* at open, the filter's columns of the remaining row groups are read and the kept rows of
  each counted (:func:`gpuload.counting.kept_groups`, kept in the cache), so that chunks,
  batches, ranks and resume are planned over the kept rows only;
* at decode, each chunk's rows are filtered (:func:`filter_table`, :func:`keep`) before they
  are converted and cached.

The filter's key (:attr:`RowFilter.key`: its text and a digest of the expression) is part of
the cache key: cached chunks hold only the kept rows.
"""

from __future__ import annotations

import re
import pickle
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from .errors import ConfigError, SchemaError, flag, setting

__all__ = ["RowFilter", "candidate_groups", "filter_table", "keep"]

_ROW = "__gpuload_row__"  # a column name no file uses: row positions through a filter


@dataclass(frozen=True)
class RowFilter:
    """A dataset's row filter: ``expr`` (a ``pyarrow.compute.Expression``) and ``key``: its text and
    a digest of the expression (what the cache key and a state's signature hold)."""

    expr: pc.Expression
    key: str

    @property
    def text(self) -> str:
        """The filter as people read it (the key without its digest)."""
        return self.key.rsplit(" #", 1)[0]

    @classmethod
    def of(cls, filters) -> RowFilter | None:
        """The filter ``filters`` (an expression, its DNF list, or None) stands for; a
        :class:`ConfigError` naming the setting where it is neither."""
        if filters is None or isinstance(filters, RowFilter):
            return filters
        if isinstance(filters, pc.Expression):
            expr = filters
        elif isinstance(filters, (list, tuple)) and filters and isinstance(filters[0], str):  # ("day", ">=", 1)
            raise ConfigError(f"{setting('filters', filters)} is one condition, not a list of them: give "
                              f"[{tuple(filters)!r}] (a list of (column, op, value) conditions, all of which hold)")
        elif isinstance(filters, (list, tuple)) and filters:
            nested = all(isinstance(c, (list, tuple)) and c and isinstance(c[0], (list, tuple)) for c in filters)
            try:
                dnf = [[tuple(c) for c in conj] for conj in filters] if nested else [tuple(c) for c in filters]
                expr = pq.filters_to_expression(dnf)
            except (TypeError, ValueError, IndexError, pa.ArrowException) as e:
                raise ConfigError(f"{setting('filters', filters)} is not a filter ({e}); give a pyarrow.compute expression "
                                  "or conditions such as [('day', '>=', 20260101), ('country', 'in', ['DE'])]"
                                  ) from None
        else:
            raise ConfigError(f"{setting('filters', filters)} must be a pyarrow.compute expression, a non-empty list of "
                              "(column, op, value) conditions (all hold), or a list of such lists (any holds)")
        # the text for people; the serialized expression's digest so that texts pyarrow abbreviates
        # (long value sets, whitespace, float32 against float64) never name two filters alike
        return cls(expr, f"{' '.join(str(expr).split())} #{xxhash.xxh64_hexdigest(_serialized(expr))}")

    def columns(self, schema: pa.Schema) -> list[str]:
        """The columns of ``schema`` the filter reads; a :class:`SchemaError` naming the filter when
        it refers to a column no file has (or cannot be evaluated over these types)."""
        empty = {f.name: pa.array([], f.type) for f in schema}
        try:
            pa.table(empty).filter(self.expr)
        except (pa.ArrowException, TypeError, ValueError) as e:
            missing = re.search(r"No match for FieldRef\.Name\((.*?)\) in ", str(e))
            if missing:  # pyarrow's text goes on with the whole schema: the column alone is said
                raise SchemaError(f"{flag('filters')} {self.text} names column {missing.group(1)!r}, which the "
                                  f"files do not have; name columns they have ({', '.join(schema.names)})") from None
            kinds = re.search(r"no kernel matching input types \((.*?)\)", str(e))
            if kinds:  # a value of another type than its column's (a string for an integer Hive key)
                named = [f"{f.name} is {f.type}" for f in schema if re.search(rf"\b{re.escape(f.name)}\b", self.text)]
                raise SchemaError(f"{flag('filters')} {self.text} compares values of different types "
                                  f"({kinds.group(1)}); give each condition a value of its column's type"
                                  f"{' (' + ', '.join(named) + ')' if named else ''}") from None
            named = [f"{f.name} is {f.type}" for f in schema if re.search(rf"\b{re.escape(f.name)}\b", self.text)]
            raise SchemaError(f"{flag('filters')} {self.text} cannot be applied to the files' columns "
                              f"({' '.join(str(e).split())}); give each condition a value its column's type "
                              f"holds (" + (", ".join(named) if named else f"the columns: {', '.join(schema.names)}")
                              + "), or an operator that takes it (a non-empty list for 'in')") from None
        used = []
        for name in schema.names:  # those whose absence breaks it
            try:
                pa.table({k: v for k, v in empty.items() if k != name}).filter(self.expr)
            except (pa.ArrowException, TypeError, ValueError):
                used.append(name)
        return used


def _serialized(expr: pc.Expression) -> bytes:
    """Arrow's serialization of ``expr`` (what pickling it carries), whatever Python's pickle protocol."""
    reduced = expr.__reduce__()
    args = reduced[1] if isinstance(reduced, tuple) and len(reduced) > 1 else ()
    if args and isinstance(args[0], pa.Buffer):
        return args[0].to_pybytes()
    return pickle.dumps(expr, protocol=4)


def candidate_groups(f, flt: RowFilter, columns: Sequence[str]) -> list[int]:
    """Row groups of ``f`` (a :class:`gpuload.sources.listing.SourceFile`) whose statistics and
    Hive keys do not rule the filter out (no read: the footer ``f`` holds is used); ``columns``:
    the filter's (:meth:`RowFilter.columns`)."""
    import pyarrow.dataset as pds  # here, not at import: it loads pandas too (0.1-0.2 s), for filters only

    sink = pa.BufferOutputStream()
    f.metadata.write_metadata_file(sink)  # a footer-only file: what pyarrow needs to prune by statistics
    part = pc.scalar(True)
    for name, _ in f.partitions:
        value = f.partition_scalar(name)
        part = part & (pc.field(name).is_null() if not value.is_valid else pc.field(name) == value)
    frag = pds.ParquetFileFormat().make_fragment(pa.BufferReader(sink.getvalue()), partition_expression=part)
    try:
        groups = [p.row_groups[0].id for p in frag.split_by_row_group(flt.expr, schema=f.schema)]
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise _unfit(f, flt, e) from None
    return sorted(set(groups).union(_unproven_keys(f, columns)))


def _unproven_keys(f, columns: Sequence[str]) -> list[int]:
    """Row groups where a partition key the file also stores, and the filter reads, is not shown
    by the statistics to hold the folder's value in every row: read, so that :func:`filter_table`
    checks them (the statistics pruned them by the file's values, which may disagree)."""
    from .checks import stats_agree

    md, keys = f.metadata, [(c, v) for c, v in f.file_keys if c in columns]
    if not keys:  # the usual case
        return []
    return [g for g in range(md.num_row_groups) if not all(
        stats_agree(md.row_group(g).column(f.leaves(c)[0]).statistics, v, md.row_group(g).num_rows) for c, v in keys)]


def _unfit(f, flt: RowFilter, e: Exception) -> SchemaError:
    return SchemaError(f"{f.path}: {flag('filters')} {flt.text} cannot be evaluated on its columns "
                       f"({' '.join(str(e).split())}); compare each column with values of its type")


def filter_table(table: pa.Table, f, flt: RowFilter, rows: int, where: str) -> np.ndarray:
    """Positions (int64, ascending) of the rows of ``table`` (``rows`` rows of the filter's
    stored columns, maybe none of them) that ``flt`` keeps, Hive keys of ``f`` supplied.
    A partition key the file also stores must hold its folder's value in every row (the
    :class:`gpuload.SourceError` of :func:`gpuload.checks.stored_key_error` names ``where``)."""
    from .checks import stored_key_error

    cols = {name: table.column(name) for name in table.column_names}
    for name, _ in f.file_keys:
        if name in cols:
            err = stored_key_error(f, name, cols[name].combine_chunks(), where)
            if err is not None:
                raise err
    for name in f.partition_names:  # one value in every row
        value = f.partition_scalar(name)
        cols[name] = pa.repeat(value, rows) if value.is_valid else pa.nulls(rows, value.type)
    for name, col in cols.items():  # string columns read as dictionaries (to hash them): compared as values
        if pa.types.is_dictionary(col.type):
            cols[name] = pc.cast(col, col.type.value_type)
    cols[_ROW] = pa.array(np.arange(rows, dtype=np.int64))
    try:
        return pa.table(cols).filter(flt.expr).column(_ROW).to_numpy()
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise _unfit(f, flt, e) from None


def keep(table: pa.Table, positions: np.ndarray) -> pa.Table:
    """The rows ``positions`` of ``table``."""
    return table if len(positions) == table.num_rows else table.take(pa.array(positions))
