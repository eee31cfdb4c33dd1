"""The GPU conversion's logic, run on any machine: byte-identical to the CPU conversion.

:mod:`gpuload.gpu.cudf_decode` only needs a few CuPy functions (the NumPy API) and
libcudf columns (type id, size, offset, null count, data buffer, validity bitmask,
list offsets and child). Here CuPy is NumPy and the columns are built from pyarrow the
way libcudf lays them out after a Parquet read: int32 list offsets, null lists of length
0, null fixed-size lists as null LIST rows with no values, dates in days, garbage under
nulls, bitmasks of little-endian bits. On a GPU, ``tests/gpu/test_runtime.py`` checks the real
thing end to end.
"""

from __future__ import annotations

import enum
import sys
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuload.batch import Ragged
from gpuload.categorical import Hash, hashable
from gpuload.convert import needed_columns, table_to_columns
from gpuload.errors import NullValuesError
from gpuload.schema import resolve_outputs

from conftest import ARROW_READS_NULL_FIXED_LISTS, write_parquet
from typecases import DTYPES, FILL, NATIVE, RICH_COLUMNS, RICH_FILL, every_type, rich_table

TypeId = enum.Enum("TypeId", "BOOL8 INT8 INT16 INT32 INT64 UINT8 UINT16 UINT32 UINT64 FLOAT32 FLOAT64 "
                   "TIMESTAMP_DAYS DURATION_DAYS TIMESTAMP_SECONDS TIMESTAMP_MILLISECONDS TIMESTAMP_MICROSECONDS "
                   "TIMESTAMP_NANOSECONDS DURATION_SECONDS DURATION_MILLISECONDS DURATION_MICROSECONDS "
                   "DURATION_NANOSECONDS LIST STRING DICTIONARY32")
_PLAIN = {pa.bool_(): TypeId.BOOL8, pa.int8(): TypeId.INT8, pa.int16(): TypeId.INT16, pa.int32(): TypeId.INT32,
          pa.int64(): TypeId.INT64, pa.uint8(): TypeId.UINT8, pa.uint16(): TypeId.UINT16, pa.uint32(): TypeId.UINT32,
          pa.uint64(): TypeId.UINT64, pa.float32(): TypeId.FLOAT32, pa.float64(): TypeId.FLOAT64}


class _Memory:  # cupy.cuda.UnownedMemory: here ``ptr`` is the NumPy byte buffer itself
    def __init__(self, ptr, size, owner, device_id=-1):
        self.buf, self.size = ptr, size


class _Pointer:  # cupy.cuda.MemoryPointer
    def __init__(self, mem, offset):
        self.mem, self.offset = mem, offset


def _ndarray(shape, dtype, memptr):  # a view of the column's buffer, as on the GPU
    raw = memptr.mem.buf[memptr.offset:memptr.offset + memptr.mem.size]
    return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    cp = types.ModuleType("cupy")
    for name in dir(np):
        if not name.startswith("__"):
            setattr(cp, name, getattr(np, name))
    cp.cuda = types.SimpleNamespace(UnownedMemory=_Memory, MemoryPointer=_Pointer)
    cp.ndarray = _ndarray
    plc = types.ModuleType("pylibcudf")
    plc.TypeId = TypeId
    plc.Table = list
    plc.hashing = types.SimpleNamespace(xxhash_64=_xxhash_64)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "pylibcudf", plc)
    from gpuload.gpu import cudf_decode

    monkeypatch.setattr(cudf_decode, "_device_copy", np.copy)  # NumPy arrays have no MemoryPointer to copy from


class _Col:
    """A libcudf column as pylibcudf shows it (offset 0, as a Parquet read returns them)."""

    def __init__(self, tid, size, data=None, mask=None, nulls=0, children=()):
        self.tid, self._size, self._data, self._mask, self._nulls = tid, size, data, mask, nulls
        self._children = list(children)

    def type(self):
        return types.SimpleNamespace(id=lambda: self.tid)

    def size(self):
        return self._size

    def offset(self):
        return 0

    def null_count(self):
        return self._nulls

    def data(self):
        return types.SimpleNamespace(ptr=self._data)

    def null_mask(self):
        return types.SimpleNamespace(ptr=self._mask)

    def list_view(self):
        return types.SimpleNamespace(offsets=lambda: self._children[0], child=lambda: self._children[1])


_STREAM = object()  # the decode stream columns_to_set is given: libcudf's hashing must run on it


def _xxhash_64(table, seed, stream=None):
    """libcudf's ``xxhash_64`` of a one-column table of strings, as documented: XXH64 of each
    value's bytes (the ``xxhash`` package's), whatever under a null."""
    import xxhash

    assert stream is _STREAM, "hashed on another stream than the decode's"

    (col,) = table
    h = [0xDEADBEEF if v is None else xxhash.xxh64_intdigest(v, seed) for v in col.strings.to_pylist()]
    return _Col(TypeId.UINT64, col.size(), _bytes(np.array(h, np.uint64)))


def _bitmask(arr: pa.Array):
    if not arr.null_count:
        return None
    bits = np.packbits(np.asarray(arr.is_valid()), bitorder="little")
    return np.concatenate([bits, np.zeros(64, np.uint8)])  # libcudf pads masks


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).copy()


def _col(arr: pa.Array) -> _Col:
    """``arr`` laid out as libcudf returns it from a Parquet read."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        valid = np.asarray(arr.is_valid())
        if pa.types.is_fixed_size_list(t):  # read back as LIST; null rows have no values
            k = t.list_size
            keep = [arr.values.slice(i * k, k) for i in range(len(arr)) if valid[i]]
            values = pa.concat_arrays(keep) if keep else arr.values.slice(0, 0)
            off = np.concatenate([[0], np.cumsum(np.where(valid, k, 0))])
        else:
            off, values = np.asarray(arr.offsets), arr.values
        offsets = _Col(TypeId.INT32, len(off), _bytes(off.astype(np.int32)))
        return _Col(TypeId.LIST, len(arr), None, _bitmask(arr), arr.null_count, [offsets, _col(values)])
    if pa.types.is_float16(t):  # FLOAT16 is a 2-byte FIXED_LEN_BYTE_ARRAY that libcudf reads as strings
        return _Col(TypeId.STRING, len(arr))
    if hashable(t):  # strings and bytes: STRING (what the fake xxhash_64 reads is kept beside it)
        col = _Col(TypeId.STRING, len(arr), None, _bitmask(arr), arr.null_count)
        col.strings = arr.cast(pa.large_binary())
        return col
    if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_time(t):
        # Parquet TIME and Arrow durations come back as DURATION_<unit> (int64), timestamps as TIMESTAMP_<unit>
        kind = "TIMESTAMP_" if pa.types.is_timestamp(t) else "DURATION_"
        tid = getattr(TypeId, kind + {"s": "SECONDS", "ms": "MILLISECONDS", "us": "MICROSECONDS",
                                      "ns": "NANOSECONDS"}[t.unit])
        data = arr.view(pa.int32()).cast(pa.int64()) if pa.types.is_time32(t) else arr.view(pa.int64())
        data = data.fill_null(12345).to_numpy()
    elif pa.types.is_date64(t):  # Parquet DATE: days
        tid, data = TypeId.TIMESTAMP_DAYS, (arr.view(pa.int64()).fill_null(0).to_numpy() // 86_400_000).astype(np.int32)
    elif pa.types.is_date32(t):
        tid, data = TypeId.TIMESTAMP_DAYS, arr.view(pa.int32()).fill_null(777).to_numpy()
    else:
        tid = _PLAIN[t]
        garbage = pa.scalar(True if tid is TypeId.BOOL8 else 99, type=t)  # whatever lies under a null
        data = arr.fill_null(garbage).to_numpy(zero_copy_only=False)
    return _Col(tid, len(arr), _bytes(data), _bitmask(arr), arr.null_count)


def _both(tmp_path, table, columns, fill, dtypes=None, row_group_size=5000, categorical=None):
    """(CPU column set, GPU-logic column set) of each of two chunks of ``table``."""
    from gpuload.gpu.cudf_decode import columns_to_set

    path = write_parquet(tmp_path / "x.parquet", table, row_group_size=row_group_size)
    pf = pq.ParquetFile(path)
    specs = resolve_outputs(pf.schema_arrow, columns, fill, dtypes, categorical=categorical)
    out = []
    for a, b in ((0, 1), (1, pf.num_row_groups)):
        t = pf.read_row_groups(range(a, b), columns=needed_columns(specs))
        cols = {c: _col(t.column(c).combine_chunks()) for c in needed_columns(specs)}
        gpu = columns_to_set(cols, specs, pf.schema_arrow, t.num_rows, "w", stream=_STREAM)
        buffers = [b for c in cols.values() for b in _buffers(c)]
        for k, v in gpu.items():  # the column set outlives libcudf's columns: it must not view them
            for a in (v.values, v.offsets) if isinstance(v, Ragged) else (v,):
                assert not any(np.shares_memory(a, b) for b in buffers), k
        out.append((table_to_columns(t, specs, "w"), gpu))
    return out


def _buffers(col: _Col) -> list:
    return [b for b in (col._data, col._mask) if b is not None] + [b for c in col._children for b in _buffers(c)]


def _assert_identical(cpu: dict, gpu: dict):
    assert cpu.keys() == gpu.keys()
    for k, x in cpu.items():
        y = gpu[k]
        if isinstance(x, Ragged):
            assert x.offsets.dtype == y.offsets.dtype and np.array_equal(x.offsets, y.offsets), k
            assert x.values.dtype == y.values.dtype and x.values.tobytes() == y.values.tobytes(), k
        else:
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes(), k


def test_every_type_converts_to_the_same_bytes(tmp_path, numpy_as_cupy):
    for cpu, gpu in _both(tmp_path, rich_table(20_000), RICH_COLUMNS, RICH_FILL):
        _assert_identical(cpu, gpu)


def test_every_supported_type_converts_to_the_same_bytes(tmp_path, numpy_as_cupy):
    from gpuload.gpu.cudf_decode import Unsupported

    table, _ = every_type(6_000, seed=3)
    dtypes = {k: v for k, v in DTYPES.items() if k in NATIVE}
    for cpu, gpu in _both(tmp_path, table, NATIVE, FILL, dtypes, row_group_size=1_000):
        _assert_identical(cpu, gpu)
    with pytest.raises(Unsupported, match="'f16' is read by cuDF as STRING"):
        _both(tmp_path, table, {"f16": "f16"}, None)


def test_null_rows_fills_casts_and_groups_match(tmp_path, numpy_as_cupy):
    rng = np.random.default_rng(1)
    n = 9000
    table = pa.table({
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(n * 3)), 3,
                                                 mask=pa.array(rng.random(n) < 0.2 * ARROW_READS_NULL_FIXED_LISTS)),
        "b": pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.3),
        "i": pa.array(rng.integers(0, 100, n).astype(np.int32), mask=rng.random(n) < 0.3),
        "d64": pa.array(rng.integers(-5000, 5000, n) * 86_400_000, type=pa.date64()),
        "lst": pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(rng.integers(0, 4, n))]).astype(
            np.int32)), pa.array(rng.standard_normal(4 * n)), mask=pa.array(rng.random(n) < 0.3)),
    })
    columns = {"emb": "emb", "b": "b", "i": "i", "d64": "d64", "lst": "lst", "g": ["b", "i"]}
    fill = {"emb": 7.5, "b": True, "i": -3, "lst": 0}
    for cpu, gpu in _both(tmp_path, table, columns, fill, {"emb": "float32", "lst": "float16", "g": "int16"}, 3000):
        _assert_identical(cpu, gpu)


def test_nulls_without_a_fill_are_refused_alike(tmp_path, numpy_as_cupy):
    from gpuload.gpu.cudf_decode import columns_to_set

    table = pa.table({"x": pa.array([1.0, None, 3.0])})
    path = write_parquet(tmp_path / "x.parquet", table)
    schema = pq.ParquetFile(path).schema_arrow
    specs = resolve_outputs(schema, ["x"], None, None)
    with pytest.raises(NullValuesError, match="column 'x' has 1 null values in w"):
        columns_to_set({"x": _col(table.column("x").combine_chunks())}, specs, schema, 3, "w")


def test_a_type_cudf_would_give_differently_falls_back(tmp_path, numpy_as_cupy):
    from gpuload.gpu.cudf_decode import Unsupported, columns_to_set

    table = pa.table({"t": pa.array([1, 2, 3], type=pa.timestamp("us"))})
    path = write_parquet(tmp_path / "x.parquet", table)
    schema = pq.ParquetFile(path).schema_arrow
    specs = resolve_outputs(schema, ["t"], None, None)
    ms = _Col(TypeId.TIMESTAMP_MILLISECONDS, 3, _bytes(np.array([1000, 2000, 3000], np.int64)))
    with pytest.raises(Unsupported, match="unit"):  # microseconds in the file, milliseconds from the reader
        columns_to_set({"t": ms}, specs, schema, 3, "w")
    with pytest.raises(Unsupported, match="DICTIONARY32"):
        columns_to_set({"t": _Col(TypeId.DICTIONARY32, 3)}, specs, schema, 3, "w")


def test_categorical_ids_are_the_same_bytes(tmp_path, numpy_as_cupy):
    """The GPU's mapping of libcudf's hashes to ids (buckets, seeds, null 0, null lists empty,
    null fixed-size rows of 0, stacked and cast) against the CPU path's ids."""
    rng = np.random.default_rng(5)
    n = 6000
    words = [None if i % 13 == 0 else f"{x:x}" * (i % 6) for i, x in enumerate(rng.integers(0, 2**40, n))]
    lists = [None if i % 7 == 0 else [None if (i + j) % 5 == 0 else f"w{(i * j) % 40}" for j in range(i % 4)]
             for i in range(n)]
    pairs = [None if i % 9 == 0 and ARROW_READS_NULL_FIXED_LISTS else [f"a{i % 3}", None if i % 4 == 0 else f"b{i % 5}"]
             for i in range(n)]
    table = pa.table({"s": pa.array(words), "b": pa.array([None if w is None else w.encode() for w in words],
                                                          pa.binary()),
                      "l": pa.array(lists, pa.list_(pa.string())), "p": pa.array(pairs, pa.list_(pa.string(), 2))})
    columns = {"s": "s", "g": ["s", "b"], "l": "l", "p": "p"}
    categorical = {"s": Hash(1000), "b": Hash(seed=2**64 - 1), "l": Hash(37, seed=4), "p": Hash(3)}
    for cpu, gpu in _both(tmp_path, table, columns, None, {"p": "int8"}, 1_000, categorical):
        _assert_identical(cpu, gpu)


def test_a_filtered_chunk_decoded_by_cudf_keeps_pyarrows_rows(tmp_path, numpy_as_cupy, monkeypatch):
    """The GPU decoder under a row filter (its logic, with stand-ins for libcudf and the device):
    pyarrow evaluates the filter on its columns, cuDF decodes every row, the kept ones are
    gathered; the column set is the CPU decoder's, byte for byte."""
    import gpuload
    import gpuload.gpu.cudf_decode as cd
    from gpuload.decode import ArrowDecoder
    from gpuload.gpu.decoder import GpuDecoder

    n = 3000
    table = pa.table({"id": np.arange(n), "day": np.arange(n) // 10, "s": pa.array([f"w{i % 7}" for i in range(n)]),
                      "l": pa.array([[i] * (i % 3) for i in range(n)], pa.list_(pa.int64())),
                      "x": np.arange(n) * 0.5})
    write_parquet(tmp_path / "d" / "a.parquet", table, row_group_size=500)
    f = [("day", ">=", 120), ("s", "in", ["w1", "w3"])]
    ds = gpuload.ParquetDataset(tmp_path / "d", ["id", "l", "x"], cache_dir=tmp_path / "c", device="cpu",
                                chunk_bytes=1 << 14, filters=f)
    r = ds.reader

    def fake_read(image, a, b, columns, stream=None):  # what libcudf returns: every row of the row groups
        t = pq.ParquetFile(pa.BufferReader(pa.py_buffer(image.getbuffer()))).read_row_groups(range(a, b),
                                                                                           columns=columns)
        return {c: _col(t.column(c).combine_chunks()) for c in columns}

    monkeypatch.setattr(cd, "read_row_groups", fake_read)
    ctx = types.SimpleNamespace(decode_stream=lambda: _STREAM, read_done=lambda: None)
    cpu = ArrowDecoder(fetch=None, row_filter=r.source.filters, filter_columns=r.filter_columns)
    gpu = GpuDecoder(ctx, ArrowDecoder(fetch=None, row_filter=r.source.filters, filter_columns=r.filter_columns))
    assert len(r.chunks) >= 2 and r.chunks[0].rg_start == 2  # row groups 0-1 ruled out by the statistics
    for c in r.chunks:
        fl = r.files[c.file]
        _assert_identical(cpu(fl, c, r.specs), gpu(fl, c, r.specs))
    assert gpu.fallbacks == 0


def test_libcudfs_refusals_fall_back_to_pyarrow_and_running_out_of_memory_says_what_to_do(tmp_path, numpy_as_cupy,
                                                                                           monkeypatch):
    """pylibcudf 26.10 raises TypeError (cudf::data_type_error), IndexError and ArithmeticError for some of
    libcudf's refusals (a reviewer read its exception handler): the chunk is decoded by pyarrow, counted;
    an out-of-memory error while converting names chunk_bytes (stand-ins for libcudf and the device)."""
    import gpuload
    import gpuload.gpu.cudf_decode as cd
    from gpuload.decode import ArrowDecoder
    from gpuload.gpu.decoder import GpuDecoder

    write_parquet(tmp_path / "d" / "a.parquet", pa.table({"id": np.arange(1000), "x": np.arange(1000) * 0.5}),
                  row_group_size=250)
    r = gpuload.ParquetDataset(tmp_path / "d", cache_dir=tmp_path / "c", device="cpu", chunk_bytes=1 << 13).reader
    ctx = types.SimpleNamespace(decode_stream=lambda: _STREAM, read_done=lambda: None)
    for error in (TypeError("data_type_error"), IndexError("out_of_range"), OverflowError("overflow")):
        def refuse(*a, error=error, **kw):
            raise error

        monkeypatch.setattr(cd, "read_row_groups", refuse)
        gpu, cpu = GpuDecoder(ctx, ArrowDecoder(fetch=None)), ArrowDecoder(fetch=None)
        for c in r.chunks:
            _assert_identical(cpu(r.files[c.file], c, r.specs), gpu(r.files[c.file], c, r.specs))
        assert gpu.fallbacks == len(r.chunks) > 1

    def fake_read(image, a, b, columns, stream=None):
        t = pq.ParquetFile(pa.BufferReader(pa.py_buffer(image.getbuffer()))).read_row_groups(range(a, b),
                                                                                           columns=columns)
        return {c: _col(t.column(c).combine_chunks()) for c in columns}

    def no_memory(*a, **kw):
        raise MemoryError("out of memory allocating 1,048,576 bytes")

    monkeypatch.setattr(cd, "read_row_groups", fake_read)
    monkeypatch.setattr(cd, "columns_to_set", no_memory)
    with pytest.raises(gpuload.SourceError, match="out of GPU memory converting it .*lower chunk_bytes"):
        GpuDecoder(ctx, ArrowDecoder(fetch=None))(r.files[0], r.chunks[0], r.specs)
