"""Column selection: which Parquet columns become which output tensors, and how.

This module turns the user's ``columns=`` / ``fill_nulls=`` / ``dtypes=`` arguments and
an Arrow schema into a list of :class:`OutputSpec`, one per tensor in a batch. It is
the only place that decides whether a type is supported, so every unsupported column
is rejected here, before any data is read.

Supported Arrow types and what they become:

==============================  ==========================================================
Arrow type                      output
==============================  ==========================================================
bool                            ``torch.bool``
int8..int64, uint8..uint64      the same integer dtype (files that drift: the type that
                                holds them all, :func:`gpuload.drift.wider`)
float16, float32, float64       the same float dtype
date32, date64                  int64, days since 1970-01-01
timestamp[unit, tz]             int64, ``unit`` since 1970-01-01 UTC (tz dropped)
INT96 timestamps (Spark, Hive)  int64, microseconds since 1970-01-01 UTC
duration[unit], time32/64[unit] int64 in ``unit`` (files in several units: the finest)
dictionary<numeric>             decoded to the value type
decimal(p, s), p <= 38          float64: ``float(unscaled) / 10**s`` (two roundings; see
                                :mod:`gpuload.convert`); with an integer ``dtypes=``: the
                                exact unscaled integer (12.34 as decimal(10, 2) is 1234;
                                files of several scales: at the largest)
fixed_size_list<numeric, k>     2-D tensor ``[rows, k]``
list / large_list<numeric>      :class:`gpuload.Ragged` (values, int64 offsets)
string, binary (large, fixed,   int64 ids from ``categorical=`` (:class:`gpuload.Hash`;
dictionary, view)               default ``Hash()``: the 64-bit hash), null 0
lists of those                  :class:`gpuload.Ragged` of int64 ids
==============================  ==========================================================

Structs, maps, lists of lists and decimals wider than 38 digits raise :class:`SchemaError`.

``dtypes=`` takes NumPy dtypes, their names, or torch dtypes; ``torch.bfloat16`` (or
``"bfloat16"``) is stored as its 16-bit pattern (:func:`gpuload.dtypes.storage_dtype`) and handed to
torch as ``torch.bfloat16``, converted once when the cache is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .categorical import Hash, Vocab, hashable
from .dtypes import BFLOAT16, numpy_dtype, parse_dtype
from .vocabulary import Vocabulary, register
from .errors import ConfigError, SchemaError, entry, flag, setting

__all__ = ["OutputSpec", "ValueType", "value_type", "list_value", "resolve_outputs", "requested_columns"]

log = logging.getLogger("gpuload")

SCALAR, GROUP, FIXED, RAGGED = "scalar", "group", "fixed", "ragged"


@dataclass(frozen=True)
class ValueType:
    """How one Arrow value type is stored: numpy dtype plus the temporal conversion."""

    dtype: str  # numpy dtype string of the converted values, e.g. "<i8"
    temporal: str = ""  # "" (plain), "date64" (ms -> days), "int" (other temporals: raw integer) or
    # "int96" (an INT96 timestamp, read in microseconds: its own name, so caches of nanoseconds are not used),
    # either with ":<unit>" where files differ in unit (converted to it first: gpuload.drift.unit_drift),
    # "decimal:<scale>" (a decimal as float64) or "unscaled:<scale>" (a decimal's exact unscaled int64)
    encode: str = ""  # a categorical encoder's key (gpuload.Hash.key): strings or bytes -> int64 ids, null 0


@dataclass(frozen=True)
class OutputSpec:
    """One output tensor of a batch.

    Attributes
    ----------
    name : output name (key of the batch dict).
    columns : source Parquet columns; several only for a stacked group.
    kind : ``"scalar"`` (1-D), ``"group"`` (stacked 2-D ``[rows, len(columns)]``),
        ``"fixed"`` (fixed-size list, 2-D ``[rows, width]``) or ``"ragged"``.
    dtype : numpy dtype string of the output values (of the values for ragged).
    width : columns per row for group/fixed, 1 otherwise.
    sources : per source column, its :class:`ValueType` (how to convert it).
    fills : per source column, the value that replaces nulls, or None (nulls are an error).
    exact : a stacked group's float dtype that no ``dtypes=`` entry chose (its columns' common
        type) while an integer column's type holds values it rounds (int64 beside a float):
        every value must then be exact in it (checked at open from the statistics, and when
        converted), so the default never rounds silently. Not part of the cache key.
    """

    name: str
    columns: tuple[str, ...]
    kind: str
    dtype: str
    width: int
    sources: tuple[ValueType, ...]
    fills: tuple[Any, ...]
    exact: bool = False

    @property
    def ndim(self) -> int:
        return 2 if self.kind in (GROUP, FIXED) else 1


def value_type(t: pa.DataType) -> ValueType | None:
    """The :class:`ValueType` of a scalar Arrow type, or None if it is not numeric."""
    if pa.types.is_dictionary(t):
        return value_type(t.value_type)
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return ValueType(numpy_dtype(t).str)
    if pa.types.is_decimal(t):  # float64 unless an integer dtypes= asks for the unscaled integers
        return ValueType("<f8", f"decimal:{t.scale}") if t.precision <= 38 else None
    if pa.types.is_date64(t):
        return ValueType("<i8", "date64")
    if pa.types.is_temporal(t):  # date32 (days), timestamp, duration, time32/64 (their unit)
        return ValueType("<i8", "int")
    return None


def list_value(t: pa.DataType) -> pa.DataType | None:
    """The value type of a list, large list or fixed-size list type; None for any other type."""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return t.value_type
    return None


def _classify(name: str, t: pa.DataType, enc: Hash | Vocab | Vocabulary | None = None) -> tuple[str, ValueType, int]:
    """Kind, value type and width of column ``name`` (``enc``: its categorical encoder, if
    given); SchemaError when unsupported, ConfigError for an encoder on a numeric column."""
    inner = list_value(t)
    if hashable(t) or (inner is not None and hashable(inner)):
        vt = ValueType("<i8", "", (Hash() if enc is None else enc).key)  # a Vocabulary's key names its digest
        if inner is None:
            return SCALAR, vt, 1
        return (FIXED, vt, t.list_size) if pa.types.is_fixed_size_list(t) else (RAGGED, vt, 1)
    if enc is not None:
        raise ConfigError(f"{setting('categorical', {name: enc})}: column {name!r} is {t}; a {type(enc).__name__} "
                          "takes strings, binary values and lists of them: leave the column out of categorical=")
    vt = value_type(t)
    if vt is not None:
        return SCALAR, vt, 1
    if inner is not None:
        ivt = value_type(inner)
        if ivt is None:
            what = "a list of lists" if list_value(inner) is not None else f"a list of {inner}"
            raise SchemaError(
                f"column {name!r} is {what} ({t}); gpuload supports lists of numbers and of strings only. "
                f"Leave it out of {flag('columns')} or convert it to numbers before writing the Parquet.")
        if pa.types.is_fixed_size_list(t):
            return FIXED, ivt, t.list_size
        return RAGGED, ivt, 1
    raise SchemaError(
        f"column {name!r} has type {t}, which gpuload cannot turn into a tensor "
        "(supported: bool, integers, floats, decimals of up to 38 digits, dates, timestamps, durations, "
        "dictionary-encoded numbers, strings and binary values as ids, lists of those). Leave it out of "
        f"{flag('columns')} or "
        "encode it as numbers first.")


def _hashable_column(t: pa.DataType) -> bool:
    """A string or binary column, or a list of them: what a :class:`gpuload.Hash` takes."""
    inner = list_value(t)
    return hashable(t) or (inner is not None and hashable(inner))


def _supported(t: pa.DataType) -> bool:
    try:
        _classify("", t)
        return True
    except SchemaError:
        return False


def _check_fill(value: Any, dtype: np.dtype, column: str) -> Any:
    """Validate a fill value for a column of ``dtype``; returns it as a Python scalar."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value) if dtype.kind == "b" else int(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{setting('fill_nulls', {column: value})}: the fill value of column {column!r} must be "
                          "a number")
    if dtype.kind in "iu":
        if not float(value).is_integer():
            raise ConfigError(f"{setting('fill_nulls', {column: value})}: column {column!r} holds integers, and {value!r} is not one")
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            raise ConfigError(f"{setting('fill_nulls', {column: value})} does not fit column {column!r} ({dtype}); "
                              f"give a value it holds, or its output a type that holds both ({flag('dtypes')}), "
                              "where the column is then filled")
        return int(value)
    if dtype.kind == "b":
        if value not in (0, 1):
            raise ConfigError(f"{setting('fill_nulls', {column: value})}: bool column {column!r} takes 0/1/True/False")
        return bool(value)
    if np.isfinite(value) and abs(float(value)) > float(np.finfo(dtype).max):
        raise ConfigError(f"{setting('fill_nulls', {column: value})} does not fit column {column!r} ({dtype})")
    return float(value)


def _fills_wider(value: Any, vt: ValueType, dtype: str, column: str) -> bool:
    """Whether fill ``value``, which column ``column``'s own numeric type ``vt`` cannot hold, fits the
    output's ``dtype`` (a ``dtypes=`` cast, or a stacked group's common type) that holds every value of
    that type too: then the column is read in ``dtype`` and filled there (int8 nulls filled with 300 in
    an int32 output, uint8's with -1 in an int16 one)."""
    if vt.temporal or vt.encode or dtype == BFLOAT16:  # (None, bools and non-numbers: _holds says no)
        return False
    src, out = np.dtype(vt.dtype), np.dtype(dtype)
    return (src.kind in "iuf" and out.kind in "iuf" and src != out and np.can_cast(src, out, "safe")
            and not _may_round(out.str, [vt])  # every value exact there (int64 in float64 is not)
            and not _holds(value, src, column) and _holds(value, out, column))


def _holds(value: Any, dtype: np.dtype, column: str) -> bool:
    """Whether a column of ``dtype`` can take ``value`` as its fill (:func:`_check_fill` accepts it)."""
    try:
        _check_fill(value, dtype, column)
        return True
    except ConfigError:
        return False


def _normalise_request(columns, schema: pa.Schema) -> list[tuple[str, tuple[str, ...], bool]]:
    """(output name, source columns, is_group) for each requested output."""
    if columns is None:
        twice = {n for n in schema.names if schema.names.count(n) > 1}
        skipped = [f"{f.name} ({f.type})" for f in schema if not _supported(f.type)]
        if skipped:
            log.warning("gpuload: skipping columns of unsupported type: %s", ", ".join(skipped))
        if twice:
            log.warning("gpuload: skipping columns whose name appears more than once: %s", ", ".join(sorted(twice)))
        hashed = [f.name for f in schema if _hashable_column(f.type) and f.name not in twice]
        if hashed:
            log.info("gpuload: columns=None: string and binary columns %s become categorical ids (categorical= "
                     "says how; without it, the 64-bit hash)", ", ".join(hashed))
        return [(f.name, (f.name,), False) for f in schema if _supported(f.type) and f.name not in twice]
    if isinstance(columns, str):
        columns = [columns]
    if isinstance(columns, Mapping):
        out = []
        for name, cols in columns.items():
            if isinstance(cols, str):
                out.append((str(name), (cols,), False))
            elif isinstance(cols, Sequence) and cols and all(isinstance(c, str) for c in cols):
                out.append((str(name), tuple(cols), True))
            else:
                raise ConfigError(
                    f"{entry('columns', name)} must be a column name or a non-empty list of names, got {cols!r}")
        return out
    if isinstance(columns, Sequence) and all(isinstance(c, str) for c in columns):
        dup = sorted({c for c in columns if list(columns).count(c) > 1})
        if dup:
            raise ConfigError(f"{flag('columns')} names {dup} more than once")
        return [(c, (c,), False) for c in columns]
    raise ConfigError(f"{flag('columns')} must be None, a list of names or a dict, got {type(columns).__name__}")


def requested_columns(columns) -> list[str]:
    """The source columns ``columns=`` names, in order, each once (none for None: every column of a
    supported type that every file has)."""
    return [] if columns is None else list(dict.fromkeys(c for _, cols, _ in _normalise_request(columns, None)
                                                          for c in cols))


def _encoders(categorical, used: set) -> dict | Hash | Vocab | None:
    """``categorical=`` checked: None, one encoder for every string column, or ``{column: encoder}``
    (a :class:`gpuload.Vocabulary` given for a column is registered for this process's conversions)."""
    if categorical is None or isinstance(categorical, (Hash, Vocab)):
        return categorical
    if not isinstance(categorical, Mapping):
        raise ConfigError(f"{flag('categorical')} must be a gpuload.Hash, a gpuload.Vocab or a dict {{column: "
                          f"gpuload.Hash(...), gpuload.Vocab(...) or a gpuload.Vocabulary}}, got "
                          f"{type(categorical).__name__}")
    for c, enc in categorical.items():
        if isinstance(enc, Vocabulary):
            register(enc)
        elif not isinstance(enc, (Hash, Vocab)):
            raise ConfigError(f"{setting('categorical', {c: enc})}: give a gpuload.Hash(buckets=..., seed=...), a "
                              "gpuload.Vocab(min_count=..., max_size=...) or a gpuload.Vocabulary (its ids)")
    unknown = sorted(set(categorical) - used)
    if unknown:
        raise ConfigError(f"{flag('categorical')} names columns that are not loaded: {unknown}; it takes the "
                          "Parquet columns (a stacked group's members), not output names")
    return dict(categorical)


def resolve_outputs(schema: pa.Schema, columns=None, fill_nulls=None, dtypes=None,
                    *, file: str = "", int96=frozenset(), units=None, categorical=None) -> list[OutputSpec]:
    """Resolve the user's column selection against ``schema`` (of ``file``).

    Parameters
    ----------
    schema : Arrow schema of the first source file, or of the columns every file has, with
        drifting types widened (:func:`gpuload.drift.widened`).
    columns : None (every supported column), a list of names, or a dict
        ``{output: column}`` / ``{output: [columns]}`` (a list stacks into ``[rows, k]``).
    fill_nulls : None (nulls are an error), a scalar for every column (but those it does not fit:
        0.5 or NaN leaves integer columns without one), or ``{column: value}``.
    dtypes : optional ``{output: dtype}`` casts; a stacked group defaults to the
        numpy result type of its members.
    file : the file the schema came from, named in errors.
    int96 : columns some file stores as INT96 timestamps (read in microseconds).
    units : ``{column: unit}`` of timestamp, duration and time columns whose files differ in unit
        (:func:`gpuload.drift.unit_drift`): their values are converted to that unit, which their
        value type (so the cache key) names.
    categorical : how string and binary columns (and lists of them) become int64 ids: a
        :class:`gpuload.Hash` for all of them, or ``{column: Hash}``; a string column not
        named gets ``Hash()`` (the full 64-bit hash). Nulls there get id 0, so such a
        column takes no ``fill_nulls``.
    """
    if isinstance(columns, (list, tuple, dict)) and not columns:
        raise ConfigError(f"{flag('columns')} is empty; name the columns to load, or leave it out for every "
                          "column of a supported type")
    if fill_nulls is not None and not isinstance(fill_nulls, (Mapping, bool, int, float, np.bool_, np.integer,
                                                              np.floating)):
        raise ConfigError(f"{setting('fill_nulls', fill_nulls)} must be a number (for every column that takes one) "
                          "or {column: number}")
    units = units or {}
    requested = _normalise_request(columns, schema)
    if not requested:
        raise SchemaError(f"no column of a supported type to load in {file}")
    names = set(schema.names)
    used = {c for _, cols, _ in requested for c in cols}
    twice = sorted(c for c in used if schema.names.count(c) > 1)
    if twice:
        raise SchemaError(f"{file} has more than one column named {twice[0]!r}, and gpuload cannot tell them apart; "
                          f"rename one of them, or leave it out of {flag('columns')}")
    missing = next((c for _, cols, _ in requested for c in cols if c not in names), None)
    if missing is not None:  # before the settings that name columns: a misspelt column is the news, not them
        raise SchemaError(f"column {missing!r} is not in {file} (columns there: {', '.join(schema.names)})")
    if isinstance(fill_nulls, Mapping):
        unknown = sorted(set(fill_nulls) - used)
        outputs = {n: list(cols) for n, cols, _ in requested if n in unknown and list(cols) != [n]}
        if outputs:  # an output's name where its columns' are wanted
            raise ConfigError(f"{flag('fill_nulls')} names outputs {sorted(outputs)}; it takes the Parquet columns "
                              f"(a stacked group's members: {outputs}), not output names")
        if unknown:
            raise ConfigError(f"{flag('fill_nulls')} names columns that are not loaded: {unknown}; load them too "
                              f"({flag('columns')}) or leave them out of {flag('fill_nulls')}")
    encoders = _encoders(categorical, used)
    if dtypes is not None and not isinstance(dtypes, Mapping):  # dict("float32") fails with a ValueError
        raise ConfigError(f"{setting('dtypes', dtypes)} must be {{output: dtype}}, e.g. {{'dense': 'float16'}} "
                          f"(one entry for each output to cast)")
    dtypes = dict(dtypes or {})
    unknown = sorted(set(dtypes) - {n for n, _, _ in requested})
    if unknown:  # a stacked group's member named where the group's output is wanted, or a misspelling
        members = {c: n for n, cols, _ in requested for c in cols if c in unknown and c != n}
        hint = f" ({', '.join(f'column {c!r} is read into output {n!r}' for c, n in members.items())})" if members else ""
        raise ConfigError(f"{flag('dtypes')} names outputs that do not exist: {unknown}{hint}; it takes the outputs "
                          f"of {flag('columns')}: {sorted(n for n, _, _ in requested)[:20]}")

    specs, unfit = [], []  # unfit: (column, value type) that a single fill_nulls number does not fit
    for name, cols, is_group in requested:
        kinds, vts, widths = [], [], []
        for c in cols:
            enc = encoders if isinstance(encoders, (Hash, Vocab)) else (encoders or {}).get(c)
            if isinstance(encoders, (Hash, Vocab)) and not _hashable_column(schema.field(c).type):
                enc = None  # one Hash for every string column: the numeric ones keep their values
            k, vt, w = _classify(c, schema.field(c).type, enc)
            if c in int96 and vt.temporal:
                vt = ValueType(vt.dtype, "int96")
            if c in units and vt.temporal in ("int", "int96"):  # files in several units: each converted to this one
                vt = ValueType(vt.dtype, f"{vt.temporal}:{units[c]}")
            kinds.append(k), vts.append(vt), widths.append(w)
        if is_group:
            if any(k != SCALAR for k in kinds):
                bad = [c for c, k in zip(cols, kinds) if k != SCALAR]
                raise SchemaError(f"output {name!r} stacks list columns {bad}; only scalar columns can be stacked")
            kind, width = GROUP, len(cols)
            dtype = np.result_type(*[np.dtype(v.dtype) for v in vts])
        else:
            kind, width, dtype = kinds[0], widths[0], np.dtype(vts[0].dtype)
        dtype = np.dtype(dtype).str
        exact = is_group and name not in dtypes and _may_round(dtype, vts)
        if name in dtypes:
            dtype = parse_dtype(dtypes[name], entry("dtypes", name))
            if dtype != BFLOAT16 and np.dtype(dtype).kind in "iu":  # decimals: exact unscaled integers
                vts = [ValueType("<i8", "unscaled:" + v.temporal[8:]) if v.temporal.startswith("decimal:") else v
                       for v in vts]
        fills = []
        for j, (c, vt) in enumerate(zip(cols, vts)):
            fv = fill_nulls.get(c) if isinstance(fill_nulls, Mapping) else fill_nulls
            if isinstance(fill_nulls, Mapping) and _fills_wider(fv, vt, dtype, c):  # read in the output's type,
                # then filled (convert._scalar_values); one number for every column fills those it fits, as before
                vt = vts[j] = ValueType(np.dtype(dtype).str, vt.temporal, vt.encode)
            if vt.encode and fv is not None:
                if isinstance(fill_nulls, Mapping):
                    raise ConfigError(f"{setting('fill_nulls', {c: fv})}: column {c!r} becomes categorical ids, "
                                      "where a null gets id 0: leave it out of fill_nulls=")
                fv = None  # one fill value for every column: the categorical ones keep id 0 for nulls
            if isinstance(fv, (int, float, np.integer, np.floating)) and not isinstance(fill_nulls, Mapping) \
                    and not _holds(fv, np.dtype(vt.dtype), c):
                unfit.append((c, vt))  # one number for every column (0.5, NaN): a column it does not fit gets none
                fv = None
            fills.append(None if fv is None else _check_fill(fv, np.dtype(vt.dtype), c))
        specs.append(OutputSpec(name, tuple(cols), kind, dtype, width, tuple(vts), tuple(fills), exact))
    if unfit and not any(f is not None for s in specs for f in s.fills):  # it fits no column: say why
        kinds = ", ".join(f"{c!r} ({np.dtype(vt.dtype)})" for c, vt in unfit[:6]) + (" and more" if len(unfit) > 6 else "")
        raise ConfigError(f"{setting('fill_nulls', fill_nulls)} fits none of the loaded columns that take a fill value "
                          f"({kinds}); give a value they hold, or {{column: value}} for the columns that have nulls")
    return specs


def _may_round(dtype: str, vts: Sequence[ValueType]) -> bool:
    """Whether float ``dtype`` rounds some value of an integer type among ``vts`` (a float holds
    integers exactly only up to 2**(mantissa bits + 1): int64 and uint64 in float64)."""
    dt = np.dtype(dtype)
    if dt.kind != "f":
        return False
    ints = [np.dtype(v.dtype) for v in vts if np.dtype(v.dtype).kind in "iu"]
    return any(i.itemsize * 8 > np.finfo(dt).nmant + 1 for i in ints)
