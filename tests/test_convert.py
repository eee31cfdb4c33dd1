"""Every supported type converts to exactly the values pyarrow holds."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload.batch import Ragged
from gpuload.convert import table_to_columns
from gpuload.schema import resolve_outputs


def convert(table, columns=None, fill_nulls=None, dtypes=None):
    return table_to_columns(table, resolve_outputs(table.schema, columns, fill_nulls, dtypes, file="t"))


INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]


@pytest.mark.parametrize("t", INTS, ids=str)
def test_integers_keep_dtype_and_extremes(t):
    info = np.iinfo(t.to_pandas_dtype())
    arr = pa.array([info.min, 0, 1, info.max], t)
    out = convert(pa.table({"x": arr}))["x"]
    assert out.dtype == np.dtype(t.to_pandas_dtype()) and out.tolist() == arr.to_pylist()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floats_bit_exact(dtype):
    vals = np.array([0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, np.finfo(dtype).tiny], dtype)
    out = convert(pa.table({"x": pa.array(vals)}))["x"]
    assert out.dtype == dtype and out.tobytes() == vals.tobytes()


def test_bool():
    out = convert(pa.table({"b": pa.array([True, False, True])}))["b"]
    assert out.dtype == np.bool_ and out.tolist() == [True, False, True]


def test_temporal_types_as_int64_in_their_unit():
    d = [datetime.date(1969, 12, 31), datetime.date(1970, 1, 1), datetime.date(2024, 2, 29)]
    t = pa.table({
        "d32": pa.array(d, pa.date32()), "d64": pa.array(d, pa.date64()),
        "ts_s": pa.array([-1, 0, 2**40], pa.timestamp("s")),
        "ts_ns_tz": pa.array([-5, 0, 2**62], pa.timestamp("ns", tz="America/New_York")),
        "dur_ms": pa.array([-3, 0, 7], pa.duration("ms")),
        "t32": pa.array([0, 59, 86399], pa.time32("s")), "t64": pa.array([1, 2, 3], pa.time64("us")),
    })
    out = convert(t)
    days = [-1, 0, (datetime.date(2024, 2, 29) - datetime.date(1970, 1, 1)).days]
    assert out["d32"].tolist() == days and out["d64"].tolist() == days
    assert out["ts_s"].tolist() == [-1, 0, 2**40]
    assert out["ts_ns_tz"].tolist() == [-5, 0, 2**62]
    assert out["dur_ms"].tolist() == [-3, 0, 7]
    assert out["t32"].tolist() == [0, 59, 86399] and out["t64"].tolist() == [1, 2, 3]
    assert all(v.dtype == np.int64 for v in out.values())


def test_dictionary_columns_are_decoded():
    t = pa.table({"i": pa.array([3, 1, 3, 2]).dictionary_encode(),
                  "f": pa.array([0.5, 0.25, 0.5, 0.5], pa.float32()).dictionary_encode()})
    out = convert(t)
    assert out["i"].tolist() == [3, 1, 3, 2] and out["f"].dtype == np.float32
    assert out["f"].tolist() == [0.5, 0.25, 0.5, 0.5]


def test_fixed_size_list_is_2d():
    arr = pa.array([[1, 2, 3, 4], [5, 6, 7, 8]], pa.list_(pa.float32(), 4))
    out = convert(pa.table({"v": arr}))["v"]
    assert out.shape == (2, 4) and out.dtype == np.float32 and out.tolist() == arr.to_pylist()


@pytest.mark.parametrize("t", [pa.list_(pa.int64()), pa.large_list(pa.float32())], ids=str)
def test_variable_lists_are_ragged_including_sliced_and_chunked(t):
    lists = [[1, 2], [], [3], [4, 5, 6], [], [7]]
    chunked = pa.chunked_array([pa.array(lists[:4], t), pa.array(lists[4:], t)])
    table = pa.table({"h": chunked}).slice(1, 4)  # non-zero offset across chunks
    out = convert(table)["h"]
    assert isinstance(out, Ragged) and out.offsets.dtype == np.int64 and out.offsets[0] == 0
    got = [out.values[out.offsets[i]:out.offsets[i + 1]].tolist() for i in range(4)]
    assert got == lists[1:5]


def test_groups_stack_promote_and_cast():
    t = pa.table({"a": pa.array([1, 2], pa.int32()), "b": pa.array([0.5, 1.5], pa.float32()),
                  "c": pa.array([7, 8], pa.int64())})
    out = convert(t, {"g": ["a", "b"], "h": ["a", "c"]}, dtypes={"h": "float16"})
    assert out["g"].dtype == np.float64 and out["g"].tolist() == [[1, 0.5], [2, 1.5]]
    assert out["h"].dtype == np.float16 and out["h"].tolist() == [[1, 7], [2, 8]]
    assert out["g"].flags.c_contiguous


def test_fill_nulls_scalar_and_per_column():
    t = pa.table({"a": pa.array([1, None, 3]), "b": pa.array([None, 2.5, None])})
    out = convert(t, fill_nulls={"a": -1, "b": 0.0})
    assert out["a"].tolist() == [1, -1, 3] and out["b"].tolist() == [0.0, 2.5, 0.0]
    assert convert(t, fill_nulls=9)["a"].tolist() == [1, 9, 3]


def test_fill_nulls_in_lists():
    h = pa.array([[1, None], None, [3]], pa.list_(pa.int64()))
    f = pa.array([[1.0, None], None], pa.list_(pa.float32(), 2))
    out = convert(pa.table({"h": h}), fill_nulls=0)["h"]
    assert [out.values[out.offsets[i]:out.offsets[i + 1]].tolist() for i in range(3)] == [[1, 0], [], [3]]
    fixed = convert(pa.table({"f": f}), fill_nulls=-1)["f"]
    assert fixed.tolist() == [[1.0, -1.0], [-1.0, -1.0]]


@pytest.mark.parametrize("arr", [pa.array([1, None, None]), pa.array([[1], None, None], pa.list_(pa.int64()))],
                         ids=["scalar", "list"])
def test_nulls_without_fill_name_column_and_count(arr):
    with pytest.raises(gpuload.NullValuesError, match=r"'x' has 2 null"):
        convert(pa.table({"x": arr}))


def test_parquet_round_trip(tmp_path):
    t = pa.table({"i": pa.array([1, 2, 3], pa.uint16()), "h": pa.array([[1], [], [2, 3]]),
                  "d": pa.array([1, 2, 1]).dictionary_encode(), "ts": pa.array([1, 2, 3], pa.timestamp("us"))})
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=2)
    out = convert(pq.read_table(tmp_path / "t.parquet"))
    assert out["i"].tolist() == [1, 2, 3] and out["d"].tolist() == [1, 2, 1] and out["ts"].tolist() == [1, 2, 3]
    assert out["h"].offsets.tolist() == [0, 1, 1, 3] and out["h"].values.tolist() == [1, 2, 3]


@pytest.mark.parametrize("values,dtype", [([1, 2**40], "int32"), ([1.0, 1.5], "int8"), ([0, 2], "bool"),
                                          ([1.0, float("nan")], "int64")])
def test_lossy_integer_cast_is_refused(values, dtype):
    with pytest.raises(gpuload.ConfigError, match="'x' holds"):
        convert(pa.table({"x": pa.array(values)}), {"y": "x"}, dtypes={"y": dtype})


def test_exact_narrowing_and_float_rounding_are_allowed():
    out = convert(pa.table({"x": pa.array([1, -5, 127]), "f": pa.array([0.1, 1e300, -2.5])}),
                  {"x": "x", "f": "f"}, dtypes={"x": "int8", "f": "float32"})
    assert out["x"].dtype == np.int8 and out["x"].tolist() == [1, -5, 127]
    assert out["f"].dtype == np.float32  # floats round (1e300 -> inf), as asked
