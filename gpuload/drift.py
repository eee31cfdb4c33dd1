"""Schema drift: the files of one source whose types for a column differ (int32 in one, int64 in
the next; pandas' nanosecond timestamps beside Spark's microseconds; decimals of two scales).

Where one type holds every file's values exactly (:func:`wider`), the source is read in it
(:func:`widened`) and each file's values are converted to it exactly when its chunks are (a file's
timestamps in the finest unit: :func:`unit_drift`, which the cache key names); where none does, the
dataset is refused at open, naming the files (:func:`check_consistent`), and so is a file whose
values the finer unit cannot hold, by its statistics (:func:`check_units`). A selected column some
files lack (added later) is read as nulls in them (:func:`absent_as_nulls`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import pyarrow as pa

from .categorical import hashable
from .errors import SchemaError, SourceError, flag
from .schema import OutputSpec, list_value
from .sources.listing import SourceFile, all_columns

log = logging.getLogger("gpuload")

__all__ = ["wider", "widened", "unit_drift", "check_units", "check_consistent", "absent_as_nulls"]


def _logical(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _same_ids(a: pa.DataType, b: pa.DataType) -> bool:
    """Both strings or bytes (of any width), or lists of them of one kind: the same categorical ids."""
    if hashable(a) and hashable(b):
        return True
    fixed = pa.types.is_fixed_size_list
    inner_a, inner_b = list_value(a), list_value(b)
    return (inner_a is not None and inner_b is not None and fixed(a) == fixed(b)
            and (not fixed(a) or a.list_size == b.list_size) and hashable(inner_a) and hashable(inner_b))


_SIGNED = {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}
_FLOATS = ((16, 11, pa.float16()), (32, 24, pa.float32()), (64, 53, pa.float64()))  # width, significand bits


def wider(*types: pa.DataType) -> pa.DataType | None:
    """The one type that holds every value of all ``types`` exactly, where the files of one
    source disagree (schema drift: int32 here, int64 there; a float column where another
    writer kept integers; ``list`` against ``large_list``), else None; the same whatever their
    order. Integers of one signedness take the widest; signed and unsigned a signed type of
    the widest signed width and at least twice the widest unsigned one (none past int64);
    with floats, the narrowest float at least as wide as each whose significand holds every
    integer (int8/16 in float32, int32 in float64, int64 in none); lists of such values their
    list (``large_list`` if any is), fixed-size lists only of one size; timestamps, durations and
    times the finest unit (timestamps all with a time zone or all without), decimals the largest
    scale and integer digits (:func:`_wider_unit`). Arrow's ``null`` type (a file whose column
    holds only nulls, as pandas and pyarrow write it) combines with any type."""
    types = list(dict.fromkeys(_logical(t) for t in types))
    types = [t for t in types if not pa.types.is_null(t)] or types
    if len(types) == 1:
        return types[0]
    inner = [list_value(t) for t in types]
    if any(v is not None for v in inner):
        fixed = {pa.types.is_fixed_size_list(t) and t.list_size for t in types}
        if any(v is None for v in inner) or len(fixed) > 1:
            return None
        v = wider(*inner)
        if v is None:
            return None
        if fixed != {False}:
            return pa.list_(v, types[0].list_size)
        return pa.large_list(v) if any(pa.types.is_large_list(t) for t in types) else pa.list_(v)
    if any(pa.types.is_temporal(t) or pa.types.is_decimal(t) for t in types):
        return _wider_unit(types)
    if not all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in types):
        return None
    ints = [t for t in types if pa.types.is_integer(t)]
    signed = max((t.bit_width for t in ints if pa.types.is_signed_integer(t)), default=0)
    unsigned = max((t.bit_width for t in ints if not pa.types.is_signed_integer(t)), default=0)
    floats = [t.bit_width for t in types if pa.types.is_floating(t)]
    if not floats:
        if not signed:
            return max(ints, key=lambda t: t.bit_width)
        return _SIGNED.get(max(signed, 2 * unsigned))
    magnitude = max(signed - 1, unsigned)  # bits an integer needs in a float's significand
    return next((f for width, bits, f in _FLOATS if width >= max(floats) and bits >= magnitude), None)


_UNITS = ("s", "ms", "us", "ns")


def _wider_unit(types: list) -> pa.DataType | None:
    """Timestamps (all with a time zone, or none), durations, or times in several units: the finest
    unit (the values then converted exactly, an overflow refused when read); decimals of several
    scales: the scale and the integer digits of the largest (at most 38 digits). Else None."""
    kinds = {"timestamp" if pa.types.is_timestamp(t) else "duration" if pa.types.is_duration(t)
             else "time" if pa.types.is_time(t) else "decimal" if pa.types.is_decimal(t) else "other" for t in types}
    if len(kinds) > 1 or kinds == {"other"}:
        return None
    (kind,) = kinds
    if kind == "decimal":
        scale = max(t.scale for t in types)
        digits = max(t.precision - t.scale for t in types) + scale
        return pa.decimal128(digits, scale) if digits <= 38 and scale >= 0 else None
    unit = max((t.unit for t in types), key=_UNITS.index)
    if kind == "timestamp":
        zones = {t.tz for t in types}  # with a zone, UTC instants whatever the zone (the first by name is kept)
        return None if len({z is None for z in zones}) > 1 else pa.timestamp(unit, min(zones, key=str))  # vs wall time
    if kind == "duration":
        return pa.duration(unit)
    return pa.time32(unit) if unit in ("s", "ms") else pa.time64(unit)


def unit_drift(files: Sequence[SourceFile], schema: pa.Schema) -> dict[str, str]:
    """``{column: unit}`` of the timestamp, duration and time columns (and lists of them) whose
    files disagree on the unit: the finest, which the widened ``schema`` has; their values are
    converted to it (and the cache key says so: :func:`gpuload.schema.resolve_outputs`)."""
    out = {}
    for field in schema:
        t = list_value(field.type) or field.type
        if not hasattr(t, "unit") or not all(field.name in f.schema.names for f in files):
            continue
        units = set()
        for f in files:
            ft = _logical(f.schema.field(field.name).type)
            units.add(getattr(list_value(ft) or ft, "unit", None))
        if len(units - {None}) > 1:  # (None: a file's column of Arrow's null type, nulls of any unit)
            out[field.name] = t.unit
    return out


def absent_as_nulls(files: Sequence[SourceFile], names: Sequence[str]) -> list[SourceFile]:
    """``files``, each lacking a column of ``names`` that another file has (a column added later: a
    Delta table's schema evolution, an older writer's files) given it as nulls: a Hive key whose
    value is null (:attr:`SourceFile.absent`), of the type of the first file that has it. Every
    stage then reads it as it reads a null key: no fill value, a :class:`NullValuesError` naming the
    files (categorical ids 0); a filter sees nulls there, as pyarrow's would (a comparison keeps none of
    those rows, ``is_null`` all of them). A name no file has is :func:`gpuload.schema.resolve_outputs`'
    to refuse."""
    has = all_columns(files)
    wanted = [has.field(n) for n in dict.fromkeys(names) if n in has.names]
    out = []
    for f in files:
        present = set(f.schema.names)  # (a list made anew on each call)
        lack = [field for field in wanted if field.name not in present]
        if lack:
            lack = [pa.field(field.name, _logical(field.type)) for field in lack]
            f = dataclasses.replace(f, schema=pa.schema(list(f.schema) + lack, metadata=f.schema.metadata),
                                    partitions=f.partitions + tuple((field.name, None) for field in lack),
                                    absent=f.absent | {field.name for field in lack})
        out.append(f)
    counts = collections.Counter(n for f in out for n in f.absent)
    for name, n in sorted(counts.items()):
        log.info("gpuload: column %r is not in %d of the %d files (added later?): read as nulls there", name, n,
                 len(files))
    return out


def check_units(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Refuse, at open, a file whose timestamps, durations or times the finer unit of the other files
    cannot hold in int64 (microseconds past 2262 as nanoseconds), by the footers' statistics; files
    without them are checked as they are converted (:func:`gpuload.convert._in_unit`)."""
    for s in specs:
        for c, vt in zip(s.columns, s.sources):
            if not vt.temporal.startswith(("int:", "int96:")):
                continue
            unit = vt.temporal.split(":")[1]
            for f in files:
                t = _logical(f.schema.field(c).type) if c in f.schema.names else None
                t = list_value(t) or t
                if getattr(t, "unit", unit) == unit or c in f.partition_names:
                    continue
                scale = 1000 ** (_UNITS.index(unit) - _UNITS.index(t.unit))
                leaf = f.leaves(c)[0]
                for g in range(f.metadata.num_row_groups):
                    st = f.metadata.row_group(g).column(leaf).statistics
                    if st is None or not st.has_min_max or st.physical_type not in ("INT32", "INT64"):
                        continue
                    worst = max(abs(int(st.min_raw)), abs(int(st.max_raw)))
                    if worst * scale >= 2**63:
                        raise SourceError(f"column {c!r} is {t} in {f.path} (row group {g}, by its statistics), and "
                                          f"other files have it in {unit}: a value there is beyond what int64 holds "
                                          f"in {unit}; rewrite the files in one unit, or leave the column out of "
                                          f"{flag('columns')}")


def widened(files: Sequence[SourceFile], schema: pa.Schema) -> pa.Schema:
    """``schema`` (the first file's, or the columns every file has) with each column every file
    has as the type :func:`wider` makes of all the files' types where they differ; columns
    whose types cannot be combined are left as they are (:func:`check_consistent` refuses them)."""
    if all(f.schema.equals(schema) for f in files):  # no drift: the usual case, and a fast one
        return schema
    names = [collections.Counter(f.schema.names) for f in files]
    fields = []
    for field in schema:
        t = None
        if all(n.get(field.name) == 1 for n in names):  # missing, or twice: refused later
            got = [f.schema.field(field.name).type for f in files]
            t = _logical(field.type) if all(_same_ids(g, field.type) for g in got) else wider(field.type, *got)
        fields.append(field if t is None or t == _logical(field.type) else field.with_type(t))
    return pa.schema(fields)


def check_consistent(files: Sequence[SourceFile], specs: Sequence[OutputSpec], schema: pa.Schema) -> None:
    """Every file's selected columns (each file has them all: :func:`absent_as_nulls`) have the
    (dictionary-decoded) type of ``schema`` (from :func:`widened`), or one it widens exactly."""
    passed: set = set()  # a file whose fields and absent columns another file had passes as that one did
    for f in files:
        key = (tuple(f.schema), f.absent)  # fields, not the schema: pandas' metadata differs file by file
        try:
            if key in passed:
                continue
            passed.add(key)
        except TypeError:  # an extension type pyarrow cannot hash: checked on its own
            pass
        for s in specs:
            for c in s.columns:
                if c in f.absent:  # nulls, of whatever type the others have
                    continue
                want = _logical(schema.field(c).type)
                got = _logical(f.schema.field(c).type)
                if got != want and not _same_ids(got, want) and wider(got, want) != want:
                    seen: dict = {}  # each type the column has, with the first file that has it
                    for g in files:
                        if c not in g.absent:
                            seen.setdefault(str(_logical(g.schema.field(c).type)), g.path)
                    kinds = ", ".join(f"{t} in {p}" for t, p in list(seen.items())[:4])
                    raise SchemaError(f"column {c!r} is {kinds}{' and more' if len(seen) > 4 else ''}, and no type "
                                      f"holds all of them exactly (integers and floats of any width combine, and "
                                      f"lists of them, and timestamps, durations or times of any unit, decimals of "
                                      f"any scale; not int64 with floats, uint64 with signed integers, timestamps "
                                      f"with a time zone and without, or numbers with other types); rewrite the "
                                      f"files with one type for it")
