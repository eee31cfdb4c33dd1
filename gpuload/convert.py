"""Convert: an Arrow table of one chunk -> contiguous NumPy arrays per output.

This is the CPU conversion stage (the GPU path has its own behind the same contract).
Nulls, dictionaries, temporal types, fixed-size and variable-length lists are resolved
here and only here; every later stage sees plain arrays of the output dtype.

The result of a chunk is a *column set*: ``{output name: ndarray or Ragged}`` where a
scalar output is 1-D ``[rows]``, a stacked group or fixed-size list is C-contiguous
``[rows, width]``, and a list column is ``Ragged(values[nvalues], offsets[rows + 1])``
with int64 offsets starting at 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .batch import Ragged, concat
from .casts import cast_values, quiet_nans
from .vocabulary import encode_ids
from .errors import ConfigError, NullValuesError, SourceError, flag, setting
from .layout import Pieces, stack
from .dtypes import numpy_dtype
from .schema import FIXED, GROUP, RAGGED, OutputSpec, ValueType

__all__ = ["table_to_columns", "needed_columns", "null_error", "nulls_error"]

_DAY_MS = 86_400_000


def needed_columns(specs: Sequence[OutputSpec]) -> list[str]:
    """Source columns to read for ``specs``, in first-use order."""
    return list(dict.fromkeys(c for s in specs for c in s.columns))


def _view(arr: pa.Array) -> np.ndarray | None:
    """A null-free integer or floating-point array's values: a NumPy view of its buffer, as
    pyarrow's ``to_numpy`` makes, without pyarrow loading pandas first (0.2-0.3 s, once per
    process, on the first chunk's decode); None for any other array."""
    t = arr.type
    if arr.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return None
    kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
    dtype = np.dtype(f"<{kind}{t.bit_width // 8}")
    if len(arr) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _scalar_values(arr: pa.Array, vt: ValueType, fill, column: str, where: str) -> np.ndarray:
    """Values of a flat (non-list) Arrow array as NumPy, nulls filled, temporals as int64,
    strings and bytes as categorical ids (null: 0)."""
    if isinstance(arr, np.ndarray):  # categorical ids, made chunk by chunk (table_to_columns)
        return arr
    if vt.encode:
        return encode_ids(arr, vt.encode)
    if vt.temporal.startswith(("decimal:", "unscaled:")):
        return _decimal(arr, vt, fill, column, where)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    widened = (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)) and not vt.temporal \
        and numpy_dtype(arr.type) != np.dtype(vt.dtype)  # a file of a narrower type
    if widened:  # (gpuload.drift.widened): exact, and before the fill, which the wide type holds
        widened = pa.types.is_floating(arr.type)  # whose NaNs become the positive quiet NaN, as cast_values makes
        arr = arr.cast(pa.from_numpy_dtype(np.dtype(vt.dtype)))
    if ":" in vt.temporal:  # files in several units: this one's values in the finest (gpuload.drift.unit_drift)
        arr = _in_unit(arr, vt.temporal.split(":")[1], column, where)
    if vt.temporal:  # reinterpret the stored integers, widened to int64
        arr = arr.view(pa.int32() if arr.type.bit_width == 32 else pa.int64()).cast(pa.int64())
        if vt.temporal == "date64":  # whole days, rounded down (a time before midnight is the day before)
            nulls = np.asarray(arr.is_null()) if arr.null_count else None
            ms = arr.fill_null(0).to_numpy(zero_copy_only=False)
            arr = pa.array(np.floor_divide(ms, _DAY_MS), mask=nulls)
    if arr.null_count:
        if fill is None:
            raise null_error(column, arr.null_count, where)
        arr = pc.fill_null(arr, pa.scalar(fill, type=arr.type))
    out = _view(arr)
    if out is None:
        out = arr.to_numpy(zero_copy_only=False)
    out = out.astype(vt.dtype, copy=False)
    return quiet_nans(out) if widened else out


def _in_unit(arr: pa.Array, unit: str, column: str, where: str) -> pa.Array:
    """A timestamp, duration or time array in ``unit`` (a finer one: exact), or a SourceError where a value
    is beyond what int64 holds in it (a nanosecond timestamp past 2262)."""
    t = arr.type
    if getattr(t, "unit", unit) == unit:  # (or nulls, typed as int64: a file whose column is Arrow's null type)
        return arr
    to = pa.timestamp(unit, t.tz) if pa.types.is_timestamp(t) else pa.duration(unit) if pa.types.is_duration(t) \
        else pa.time32(unit) if unit in ("s", "ms") else pa.time64(unit)
    try:
        return arr.cast(to)  # checked: an overflow raises
    except pa.ArrowInvalid as e:
        raise SourceError(f"column {column!r} is {t} in {where}, and other files have it in {unit}: a value there "
                          f"is beyond what int64 holds in {unit} ({' '.join(str(e).split())[:160]}); rewrite the "
                          f"files in one unit, or leave the column out of {flag('columns')}") from None


def _decimal(arr: pa.Array, vt: ValueType, fill, column: str, where: str) -> np.ndarray:
    """A decimal array as float64 ``float(unscaled) / 10**scale`` (the unscaled integer rounded
    to the nearest float64, then divided, correctly rounded: at most two roundings), or with
    ``"unscaled:"`` as its exact unscaled int64 (refusing values beyond int64); nulls filled."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    t = arr.type
    scale = int(vt.temporal.split(":")[1])
    if t.scale != scale:  # files of several scales: this one's values in the largest (gpuload.drift.wider), exactly
        arr = arr.cast(pa.decimal128(min(t.precision - t.scale + scale, 38), scale))
    elif t.bit_width != 128:  # decimal32/64 widen exactly; a decimal256 of at most 38 digits narrows exactly
        arr = arr.cast(pa.decimal128(min(t.precision, 38), t.scale))
    n = len(arr)
    words = np.frombuffer(arr.buffers()[1], "<i8")[2 * arr.offset:2 * (arr.offset + n)].reshape(n, 2)
    lo, hi = words[:, 0], words[:, 1]
    valid = None if arr.null_count == 0 else np.asarray(arr.is_valid())
    if valid is not None and fill is None:
        raise null_error(column, arr.null_count, where)
    small = hi == (lo >> 63)  # the unscaled value fits int64 (hi only extends lo's sign)
    wide = np.flatnonzero(~small if valid is None else ~small & valid)
    if vt.temporal.startswith("unscaled:"):
        if wide.size:
            v = arr[int(wide[0])].as_py()
            raise ConfigError(f"column {column!r} holds {v} in {where}, whose unscaled integer int64 cannot hold; "
                              f"choose a float dtype in {flag('dtypes')} (or none: float64)")
        out = lo.copy()
    else:
        out = lo.astype(np.float64)
        for i in wide:  # beyond int64 (rare): Python rounds the 128-bit integer to the nearest float64
            out[i] = float((int(hi[i]) << 64) | int(lo[i].view(np.uint64)))
        out = out / float(10**scale) if scale >= 0 else out * float(10**-scale)
    if valid is not None:
        out[~valid] = fill
    return out


def null_error(column: str, count: int, where: str, lists: bool = False) -> NullValuesError:
    """The error for ``count`` nulls in ``column`` (in ``where``) with no fill value."""
    return nulls_error([(column, count, lists, f"in {where}")])


def nulls_error(found: Sequence[tuple[str, int, bool, str]]) -> NullValuesError:
    """One error for every column that holds nulls and has no fill value, with the one
    ``fill_nulls`` that covers them all. ``found``: ``(column, nulls, is a list column,
    where: "in ...")`` per column, in the order to report them."""
    fix = setting("fill_nulls", {c: 0 for c, *_ in found})
    parts = [f"{c!r} has {n} {'null lists or null list elements' if lists else 'null values'} {where}"
             for c, n, lists, where in found]
    any_lists = any(lists for _, _, lists, _ in found)
    if len(found) == 1:
        text = f"column {parts[0]}; pass {fix}" + (
            " to make null lists empty and null elements 0 (fixed-size lists: rows of the fill value), or another "
            "fill value" if any_lists else " (or another value, or one number for every column) to replace them")
    else:
        text = (f"{len(found)} columns hold nulls and have no fill value: {'; '.join(parts)}; pass {fix} (or other "
                "values, or one number for every column) to replace them")
        if any_lists:
            text += "; null lists become empty, null list elements the value (fixed-size lists: rows of it)"
    return NullValuesError(text, columns={c: n for c, n, _, _ in found})


def _null_counts(arrays: dict, specs: Sequence[OutputSpec]) -> list[tuple[str, int, bool]]:
    """``(column, nulls, is a list)`` of every source column without a fill value that holds
    nulls (for lists: null lists, and null elements of the other lists)."""
    found: dict[str, tuple[str, int, bool]] = {}
    for s in specs:
        lists = s.kind in (RAGGED, FIXED)
        for c, vt, fill in zip(s.columns, s.sources, s.fills):
            if fill is not None or vt.encode or c in found:  # categorical ids: a null is id 0
                continue
            n = sum(p.null_count + (pc.list_flatten(p).null_count if lists else 0) for p in arrays[c])
            if n:
                found[c] = (c, n, lists)
    return list(found.values())


def _list_parts(arr: pa.Array, spec: OutputSpec, where: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """(child values, int64 offsets from 0, validity mask or None) of a list array."""
    col = spec.columns[0]
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        off = (np.arange(len(arr) + 1, dtype=np.int64) + arr.offset) * k
    else:
        off = _view(arr.offsets).astype(np.int64, copy=False)  # offsets: int32 or int64, never null
    values = arr.values.slice(off[0], off[-1] - off[0])
    off = off - off[0]
    if arr.null_count == 0:
        return values, off, None
    if spec.fills[0] is None and not spec.sources[0].encode:
        raise null_error(col, arr.null_count, where, lists=True)
    valid = np.asarray(arr.is_valid())
    return values, off, valid


def _ragged(parts: list, spec: OutputSpec, where: str, alloc=None) -> Ragged:
    """A list column's Arrow chunks as one Ragged (values and offsets joined into ``alloc``'s arrays)."""
    return concat([{"r": _ragged_part(p, spec, where)} for p in parts], alloc)["r"]


def _ragged_part(arr: pa.Array, spec: OutputSpec, where: str) -> Ragged:
    values, off, valid = _list_parts(arr, spec, where)
    vals = _scalar_values(values, spec.sources[0], spec.fills[0], spec.columns[0], where)
    if valid is not None:  # null lists become empty lists
        lengths = np.diff(off)
        vals = vals[np.repeat(valid, lengths)]
        lengths[~valid] = 0
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Ragged(np.ascontiguousarray(cast_values(vals, spec.dtype, spec.columns[0], where)), off)


def _fixed(arr: pa.Array, spec: OutputSpec, where: str) -> np.ndarray:
    values, _, valid = _list_parts(arr, spec, where)
    vals = _scalar_values(values, spec.sources[0], spec.fills[0], spec.columns[0], where)
    out = np.ascontiguousarray(cast_values(vals, spec.dtype, spec.columns[0], where)).reshape(len(arr), spec.width)
    if valid is not None:  # null rows become rows of the fill value (categorical ids: of 0, the null id)
        out = out.copy()
        fill = 0 if spec.sources[0].encode else spec.fills[0]
        out[~valid] = cast_values(np.array([fill], vals.dtype), spec.dtype, spec.columns[0], where)[0]
    return out


def _typed_nulls(spec: OutputSpec, vt: ValueType) -> pa.DataType:
    """The Arrow type a column of ``spec`` whose values ``vt`` describes is read as where a file
    holds only nulls in it, typed ``null`` (:func:`gpuload.drift.wider` lets that type combine
    with the others'): its nulls, so typed, take the path of every other null."""
    if vt.encode:
        inner = pa.string()
    elif vt.temporal.startswith(("decimal:", "unscaled:")):
        inner = pa.decimal128(38, int(vt.temporal.split(":")[1]))
    else:  # numbers, and temporals as their int64
        inner = pa.from_numpy_dtype(np.dtype(vt.dtype))
    return pa.list_(inner, spec.width) if spec.kind == FIXED else pa.list_(inner) if spec.kind == RAGGED else inner


def table_to_columns(table: pa.Table, specs: Sequence[OutputSpec], where: str = "", alloc=None,
                     pieces: bool = False) -> dict:
    """Convert ``table`` (one chunk) into a column set following ``specs``.

    Columns are converted one Arrow chunk (row group) at a time, never joined in Arrow first
    (but fixed-size lists): each value is copied once, into the output (or, with ``pieces``,
    by the layout).

    Parameters
    ----------
    table : Arrow table holding at least every source column of ``specs``.
    specs : the outputs to build, from :func:`gpuload.schema.resolve_outputs`.
    where : the file and row groups, named in null-value errors.
    alloc : ``alloc(shape, dtype)`` for the arrays made here (NumPy; default: new arrays).
    pieces : scalar outputs as :class:`gpuload.layout.Pieces`, not joined (default False), for
        :meth:`gpuload.layout.Layout.pack`, which copies them once into the stored arrays.
    """
    cols = {}
    arrays = {}  # source column: its Arrow chunks (a fixed-size list's joined: one)
    fixed = {c for s in specs if s.kind == FIXED for c in s.columns}
    lists = {c for s in specs if s.kind in (RAGGED, FIXED) for c in s.columns}
    reads = {c: (s, vt) for s in specs for c, vt in zip(s.columns, s.sources)}
    for c in needed_columns(specs):
        col = table.column(c)
        if pa.types.is_null(col.type):  # a file where the column holds only nulls
            col = col.cast(_typed_nulls(*reads[c]))
        encode = reads[c][1].encode
        if encode and c not in lists:  # ids chunk by chunk: strings never joined
            arrays[c] = [encode_ids(ch, encode) for ch in col.chunks] or [np.zeros(0, np.int64)]
            continue
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        arrays[c] = [col.combine_chunks()] if c in fixed or not col.chunks else col.chunks
    nulls = _null_counts(arrays, specs)
    if nulls:  # every column of the chunk at once, not one per run
        raise nulls_error([(c, k, lists, f"in {where}" if where else "") for c, k, lists in nulls])

    def flat(c: str, vt: ValueType, fill, dtype: str, exact: str = "") -> Pieces:
        return Pieces([cast_values(_scalar_values(p, vt, fill, c, where), dtype, c, where, exact) for p in arrays[c]])

    for s in specs:
        if s.kind == RAGGED:
            cols[s.name] = _ragged(arrays[s.columns[0]], s, where, alloc)
        elif s.kind == FIXED:
            cols[s.name] = _fixed(arrays[s.columns[0]][0], s, where)
        elif s.kind == GROUP:
            cols[s.name] = stack([flat(c, vt, fill, s.dtype, s.name if s.exact else "")
                                  for c, vt, fill in zip(s.columns, s.sources, s.fills)],
                                 alloc)
        else:
            v = flat(s.columns[0], s.sources[0], s.fills[0], s.dtype)
            cols[s.name] = v if pieces else v.join(alloc)
    return cols
