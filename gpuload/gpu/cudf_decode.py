"""Decode and convert on the GPU: Parquet row groups -> CuPy column sets, with pylibcudf.

The GPU twin of :mod:`gpuload.decode` + :mod:`gpuload.convert`, under the same
contract and producing the same bytes: nulls are filled (or refused) in the source type
before the cast, null lists become empty lists, null fixed-size lists rows of the fill
value, temporals are their raw integers (dates in days), groups are stacked, and casts
follow :func:`gpuload.casts.cast_values` (the same function, on CuPy arrays).

Only one chunk's row groups are read at a time (``set_row_groups``), so device memory
is bounded by ``chunk_bytes``. libcudf reads on the stream it is given (the loader's),
and the conversion runs on the caller's current CuPy stream (the same one), so each
step follows the last in stream order.

Where cuDF's physical result does not match what the CPU path would produce (a
dictionary column read as ``DICTIONARY32``, a temporal unit that differs from the
Arrow schema's, float16, which libcudf has no type for, decimals, which libcudf reads as
DECIMAL32/64/128 by precision, a file whose column is narrower than the type the source's
files drift to (:func:`gpuload.drift.widened`) or than a fill value needs), :class:`Unsupported` is
raised and the caller decodes that chunk on the CPU instead, so the bytes stay the same.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
from typing import Sequence

import numpy as np
import pyarrow as pa

from ..batch import Ragged
from ..categorical import ids_from_hashes, parse_key
from ..casts import cast_values
from ..convert import needed_columns, null_error
from ..errors import SourceError
from ..dtypes import storage_dtype
from ..schema import FIXED, GROUP, RAGGED, OutputSpec, ValueType

__all__ = ["Unsupported", "HostImage", "read_row_groups", "columns_to_set"]

_DAY_MS = 86_400_000


class Unsupported(Exception):
    """cuDF's result for a column would not match the CPU path's; decode this chunk on the CPU."""


def _tid():
    import pylibcudf as plc

    return plc.TypeId


def _physical(tid) -> np.dtype | None:
    """NumPy dtype of the data buffer of a fixed-width libcudf type, or None."""
    T = _tid()
    table = {T.BOOL8: np.bool_, T.INT8: np.int8, T.INT16: np.int16, T.INT32: np.int32, T.INT64: np.int64,
             T.UINT8: np.uint8, T.UINT16: np.uint16, T.UINT32: np.uint32, T.UINT64: np.uint64,
             T.FLOAT32: np.float32, T.FLOAT64: np.float64, T.TIMESTAMP_DAYS: np.int32, T.DURATION_DAYS: np.int32}
    for name in ("TIMESTAMP_SECONDS", "TIMESTAMP_MILLISECONDS", "TIMESTAMP_MICROSECONDS", "TIMESTAMP_NANOSECONDS",
                 "DURATION_SECONDS", "DURATION_MILLISECONDS", "DURATION_MICROSECONDS", "DURATION_NANOSECONDS"):
        table[getattr(T, name)] = np.int64
    dt = table.get(tid)
    return None if dt is None else np.dtype(dt)


def _unit(tid) -> str:
    """Time unit of a libcudf temporal type id: 'D', 's', 'ms', 'us', 'ns' ('' if not temporal)."""
    name = tid.name
    for suffix, unit in (("_DAYS", "D"), ("_SECONDS", "s"), ("_MILLISECONDS", "ms"), ("_MICROSECONDS", "us"),
                         ("_NANOSECONDS", "ns")):
        if name.endswith(suffix) and (name.startswith("TIMESTAMP") or name.startswith("DURATION")):
            return unit
    return ""


def _arrow_unit(t: pa.DataType) -> str:
    if pa.types.is_date32(t) or pa.types.is_date64(t):
        return "D"
    return getattr(t, "unit", "")


def _buffer(col, dtype: np.dtype, count: int):
    """CuPy view of the first ``count`` elements of a column's data buffer (kept alive by the column)."""
    import cupy

    if count == 0:
        return cupy.empty(0, dtype)
    view = col.data()
    mem = cupy.cuda.UnownedMemory(view.ptr, count * dtype.itemsize, col)
    return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(mem, 0))


def _valid(col):
    """Boolean CuPy validity of each row of ``col`` (from its bitmask; the column has nulls)."""
    import cupy

    off, n = col.offset(), col.size()
    nbytes = (off + n + 7) // 8
    mask = col.null_mask()
    raw = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(mask.ptr, nbytes, col), 0))
    i = cupy.arange(off, off + n, dtype=cupy.int64)
    return ((raw[i >> 3] >> (i & 7).astype(cupy.uint8)) & 1).astype(cupy.bool_)


def _flat(col, vt: ValueType, atype: pa.DataType, fill, column: str, where: str, stream=None):
    """Values of a non-list column as CuPy ``vt.dtype``: nulls filled, temporals as int64.

    Always in new memory (the caller's allocator), never a view of ``col``'s buffer: the
    column set outlives the libcudf columns it was read from."""
    import cupy

    tid = col.type().id()
    if vt.encode:
        return _hashed(col, vt, column, stream)
    phys = _physical(tid)
    if phys is None:
        raise Unsupported(f"column {column!r} is read by cuDF as {tid.name}")
    off, n = col.offset(), col.size()
    raw = vals = _buffer(col, phys, off + n)[off:]
    if vt.temporal:
        unit = _unit(tid)
        if vt.temporal == "date64" and unit == "ms":
            vals = vals.astype(cupy.int64) // _DAY_MS
        elif unit == _arrow_unit(atype):
            vals = vals.astype(cupy.int64)
        else:
            raise Unsupported(f"column {column!r}: cuDF unit {unit!r}, Arrow schema {atype}")
    elif phys != np.dtype(vt.dtype):
        raise Unsupported(f"column {column!r} is read by cuDF as {tid.name}, expected {vt.dtype}")
    nulls = col.null_count()
    if nulls:
        if fill is None:
            raise null_error(column, nulls, where)
        vals = cupy.where(_valid(col), vals, vals.dtype.type(fill))
    if vals is raw and raw.dtype == np.dtype(vt.dtype):
        return _device_copy(raw)
    return vals.astype(vt.dtype, copy=vals is raw)


def _device_copy(a):
    """A new contiguous device array holding ``a``'s bytes, by ``cudaMemcpyAsync`` on CuPy's
    current stream (the decode's). Not ``astype(copy=True)``: that is a CuPy kernel, whose first
    use on a loader thread loads a CUDA module, which waited for the training step's kernel to
    end (an H200, 2026-11-27)."""
    import cupy

    out = cupy.empty(a.shape, a.dtype)
    if a.nbytes:
        out.data.copy_from_device_async(a.data, a.nbytes)
    return out


def _hashed(col, vt: ValueType, column: str, stream=None):
    """Categorical ids of a STRING column, as the CPU makes them (:mod:`gpuload.categorical`):
    libcudf's XXH64 of each value's bytes (on ``stream``, the decode's, so that the CuPy work
    after it, on the same stream, reads its result), then the same mapping to ids, null 0."""
    import pylibcudf as plc

    if col.type().id() != _tid().STRING:
        raise Unsupported(f"column {column!r} is read by cuDF as {col.type().id().name}, not as strings")
    enc = parse_key(vt.encode)  # a Hash: chunks with vocabulary ids go to the CPU before they are read
    hashes = plc.hashing.xxhash_64(plc.Table([col]), enc.seed, stream=stream)
    h = _buffer(hashes, np.dtype(np.uint64), hashes.offset() + hashes.size())[hashes.offset():]
    return ids_from_hashes(h, _valid(col) if col.null_count() else None, enc.buckets)


def _list_parts(col, spec: OutputSpec, atype: pa.DataType, where: str, stream=None):
    """(values, int64 offsets from 0, validity or None) of a LIST column, nulls resolved as on the CPU."""
    import cupy

    if col.type().id() != _tid().LIST:
        raise Unsupported(f"column {spec.columns[0]!r} is read by cuDF as {col.type().id().name}, not a list")
    view = col.list_view()
    off_col, child = view.offsets(), view.child()
    n, o = col.size(), col.offset()
    off = _buffer(off_col, _physical(off_col.type().id()), o + n + 1)[o:].astype(cupy.int64)
    vt = spec.sources[0]
    elem_type = atype.value_type
    values = _flat(child, vt, elem_type, spec.fills[0], spec.columns[0], where, stream)
    lo, hi = int(off[0]), int(off[-1])
    values, off = values[lo:hi], off - lo
    if not col.null_count():
        return values, off, None
    if spec.fills[0] is None and not vt.encode:  # categorical ids: a null list becomes empty, with no fill
        raise null_error(spec.columns[0], col.null_count(), where, lists=True)
    return values, off, _valid(col)


def _ragged(col, spec: OutputSpec, atype: pa.DataType, where: str, stream=None) -> Ragged:
    import cupy

    values, off, valid = _list_parts(col, spec, atype, where, stream)
    if valid is not None:  # null lists become empty lists
        lengths = cupy.diff(off)
        row = cupy.searchsorted(off[1:], cupy.arange(len(values), dtype=cupy.int64), side="right")
        values = values[valid[row]]
        lengths[~valid] = 0
        off = cupy.concatenate([cupy.zeros(1, cupy.int64), cupy.cumsum(lengths)])
    return Ragged(cupy.ascontiguousarray(cast_values(values, spec.dtype, spec.columns[0], where)), off)


def _fixed(col, spec: OutputSpec, atype: pa.DataType, where: str, stream=None):
    import cupy

    values, off, valid = _list_parts(col, spec, atype, where, stream)
    k, n = spec.width, len(off) - 1
    lengths = cupy.diff(off)
    if valid is not None:  # null rows keep no values (whatever their length): rows of the fill value
        row = cupy.searchsorted(off[1:], cupy.arange(len(values), dtype=cupy.int64), side="right")
        values = values[valid[row]]
    if not bool(((lengths == k) | (False if valid is None else ~valid)).all()):
        raise SourceError(f"{where}: column {spec.columns[0]!r} has a list whose length is not {k}")
    values = cast_values(values, spec.dtype, spec.columns[0], where)
    if valid is None:
        return cupy.ascontiguousarray(values).reshape(n, k)
    out = cupy.empty((n, k), dtype=storage_dtype(spec.dtype))
    fill = 0 if spec.sources[0].encode else spec.fills[0]  # categorical ids: rows of the null id
    out[...] = cast_values(np.array([fill], np.dtype(spec.sources[0].dtype)), spec.dtype, spec.columns[0], where)[0]
    out[valid] = values.reshape(-1, k)
    return out


# reserve no memory for the whole file (only the pages read into are ever used); Linux's value
# where Python's mmap lacks the constant (before 3.13)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class HostImage(io.BytesIO):
    """A Parquet file as libcudf reads it, in host memory: ``size`` bytes of an anonymous
    mapping into which only the ranges a chunk needs are read (see
    :func:`gpuload.sources.ranges.image_ranges`); the rest is never touched, so it takes no memory.

    Why not the path: libcudf reads a file it is given by path through KvikIO, whose copies to
    the device wait for the kernels already queued, the training step's included (measured on
    an H200: a read issued during a 1 s kernel returned after it, on any stream). From host
    memory, libcudf copies on the stream it is given. pylibcudf takes a ``BytesIO`` through
    ``getbuffer()``, which here hands it the mapping, without a copy. Close it after the read.
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)

    def getbuffer(self) -> memoryview:
        return memoryview(self._map)[:self.size]

    def put(self, start: int, data) -> None:
        """Copy ``data`` (bytes-like) to offset ``start``."""
        self._map[start:start + len(data)] = data

    def read_from(self, fd: int, start: int, end: int, path: str) -> None:
        """Read bytes ``[start, end)`` of open file ``fd`` (named ``path`` in errors) into place."""
        with memoryview(self._map) as mv:
            while start < end:
                got = os.preadv(fd, [mv[start:end]], start)
                if got <= 0:
                    raise OSError(f"{path}: ended at byte {start:,}, before {end:,} (was it truncated?)")
                start += got

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view still held somewhere: the mapping goes with the last of them
            pass
        super().close()


def read_row_groups(source, rg_start: int, rg_stop: int, columns: list[str], stream=None) -> dict:
    """Read row groups ``[rg_start, rg_stop)`` of ``columns`` with libcudf: ``{name: plc.Column}``.

    ``source``: a :class:`HostImage` (what the loader passes) or a path. ``stream``: the CUDA
    stream libcudf decodes on, in stream order (an rmm ``Stream``; default libcudf's default
    stream). Memory comes from RMM's current device resource.
    """
    import pylibcudf as plc

    P = plc.io.parquet
    opts = (P.ParquetReaderOptions.builder(plc.io.SourceInfo([source])).column_names(columns)
            .use_pandas_metadata(False).build())
    opts.set_row_groups([list(range(rg_start, rg_stop))])
    got = P.read_parquet(opts, stream=stream)
    return dict(zip(got.column_names(include_children=False), got.columns))


def columns_to_set(cols: dict, specs: Sequence[OutputSpec], schema: pa.Schema, rows: int, where: str,
                   stream=None) -> dict:
    """Convert libcudf columns of one chunk into a CuPy column set following ``specs`` (libcudf's
    own calls, the hashing of categorical columns, on ``stream``: the decode's).

    Raises :class:`Unsupported` when the CPU path must convert this chunk instead.
    """
    import cupy

    for c in needed_columns(specs):
        if c not in cols:
            raise SourceError(f"{where}: column {c!r} was not returned by the GPU reader")
        if cols[c].size() != rows:
            raise SourceError(f"{where}: read {cols[c].size()} rows where the footer promises {rows}")
    out = {}
    for s in specs:
        atype = schema.field(s.columns[0]).type
        if pa.types.is_dictionary(atype):
            atype = atype.value_type
        if s.kind == RAGGED:
            out[s.name] = _ragged(cols[s.columns[0]], s, atype, where, stream)
        elif s.kind == FIXED:
            out[s.name] = _fixed(cols[s.columns[0]], s, atype, where, stream)
        elif s.kind == GROUP:
            arr = cupy.empty((rows, s.width), dtype=storage_dtype(s.dtype))
            for j, (c, vt, fill) in enumerate(zip(s.columns, s.sources, s.fills)):
                t = schema.field(c).type
                t = t.value_type if pa.types.is_dictionary(t) else t
                arr[:, j] = cast_values(_flat(cols[c], vt, t, fill, c, where, stream), s.dtype, c, where,
                                        s.name if s.exact else "")
            out[s.name] = arr
        else:
            v = _flat(cols[s.columns[0]], s.sources[0], atype, s.fills[0], s.columns[0], where, stream)
            out[s.name] = cupy.ascontiguousarray(cast_values(v, s.dtype, s.columns[0], where))
    return out
