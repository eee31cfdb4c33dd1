"""Convert: every supported Arrow type against values computed independently of gpuload."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload.batch import Ragged
from gpuload.convert import table_to_columns
from gpuload.schema import resolve_outputs

from conftest import ARROW_READS_NULL_FIXED_LISTS


def convert(table, columns=None, fill_nulls=None, dtypes=None, where="file.parquet rg 0-1"):
    specs = resolve_outputs(table.schema, columns, fill_nulls, dtypes, file="x")
    out = table_to_columns(table, specs, where)
    for v in out.values():  # the cache writes these buffers as they are
        for a in (v.values, v.offsets) if isinstance(v, Ragged) else (v,):
            assert isinstance(a, np.ndarray) and a.flags.c_contiguous
    return out


def lists(r: Ragged) -> list[list]:
    assert r.offsets.dtype == np.int64 and r.offsets[0] == 0 and r.offsets[-1] == len(r.values)
    return [r.values[r.offsets[i]:r.offsets[i + 1]].tolist() for i in range(len(r.offsets) - 1)]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: np.dtype(d).name)
def test_integers_keep_dtype_and_extremes(dtype):
    info = np.iinfo(dtype)
    want = np.array([info.min, info.max, 0, 1, info.max - 1, info.min + 1], dtype)
    out = convert(pa.table({"v": pa.array(want)}))["v"]
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_floats_bit_exact(dtype):
    f = np.finfo(dtype)
    want = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, f.max, f.min, f.tiny, f.smallest_subnormal, 1 / 3],
                    dtype)
    out = convert(pa.table({"v": pa.array(want)}))["v"]
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(bits(out), bits(want))


@pytest.mark.parametrize("dtype", INTS + [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_numbers_are_read_from_their_buffers_at_any_offset(dtype):
    """Null-free numbers come from a view of the Arrow buffer (no pandas round trip): at a
    slice's offset, across chunks, empty, and a list's sliced values, equal to pyarrow's values."""
    values = (np.arange(25) * 3 + 1).astype(dtype)
    whole = pa.table({"v": pa.chunked_array([values[:10], values[10:]]),
                      "l": pa.array([list(values[i:i + i % 3]) for i in range(25)], pa.list_(pa.from_numpy_dtype(dtype)))})
    for lo, n in ((0, 25), (7, 11), (12, 9), (13, 0)):
        t = whole.slice(lo, n)
        out = convert(t)
        assert out["v"].dtype == np.dtype(dtype) and out["v"].tolist() == t["v"].to_pylist()
        assert lists(out["l"]) == t["l"].to_pylist()


def test_bool():
    out = convert(pa.table({"b": pa.array([True, False, True, True])}))["b"]
    assert out.dtype == np.bool_ and out.tolist() == [True, False, True, True]


DAYS = [-719162, -1, 0, 1, 19782, 2932896]  # 0001-01-01 .. 9999-12-31


def test_dates_as_days_since_epoch():
    t = pa.table({"d32": pa.array(DAYS, pa.date32()),
                  "d64": pa.array([d * 86_400_000 for d in DAYS], pa.date64())})
    out = convert(t)
    for k in ("d32", "d64"):
        assert out[k].dtype == np.int64 and out[k].tolist() == DAYS, k


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
@pytest.mark.parametrize("tz", [None, "UTC", "America/New_York", "+05:30"])
def test_timestamps_as_int64_in_their_unit(unit, tz):
    moments = np.array(["1969-12-31T23:59:59", "1970-01-01", "2024-02-29T12:34:56.789123456",
                        "2262-04-11"], "datetime64[ns]").astype(f"datetime64[{unit}]")
    want = moments.astype(np.int64)  # UTC instants, whatever the zone shown
    out = convert(pa.table({"t": pa.array(want, pa.timestamp(unit, tz=tz))}))["t"]
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("typ,values", [
    (pa.duration("s"), [-5, 0, 86_400]), (pa.duration("ms"), [2**40, -1, 7]),
    (pa.duration("us"), [1, 2, 3]), (pa.duration("ns"), [2**62, -(2**62), 0]),
    (pa.time32("s"), [0, 3_600, 86_399]), (pa.time32("ms"), [0, 1, 86_399_999]),
    (pa.time64("us"), [0, 86_399_999_999, 12]), (pa.time64("ns"), [0, 86_399_999_999_999, 5]),
], ids=str)
def test_durations_and_times_as_int64_in_their_unit(typ, values):
    out = convert(pa.table({"t": pa.array(values, typ)}))["t"]
    assert out.dtype == np.int64 and out.tolist() == values


def test_dictionary_columns_are_decoded_across_chunks_with_different_dictionaries():
    b1 = pa.record_batch({"i": pa.DictionaryArray.from_arrays(pa.array([1, 0, 1], pa.int8()),
                                                               pa.array([10, -20], pa.int32())),
                          "f": pa.DictionaryArray.from_arrays(pa.array([0, 0, 1], pa.int32()),
                                                               pa.array([0.5, np.nan]))})
    b2 = pa.record_batch({"i": pa.DictionaryArray.from_arrays(pa.array([2, 0], pa.int8()),
                                                               pa.array([7, 8, 9], pa.int32())),
                          "f": pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()),
                                                               pa.array([-1.25, 3.0]))})
    t = pa.Table.from_batches([b1, b2])
    assert t.column("i").num_chunks == 2
    out = convert(t)
    assert out["i"].dtype == np.int32 and out["i"].tolist() == [-20, 10, -20, 9, 7]
    assert out["f"].dtype == np.float64
    np.testing.assert_array_equal(out["f"], [0.5, 0.5, np.nan, -1.25, 3.0])
    out = convert(t.slice(2, 2))  # slice across the chunk boundary
    assert out["i"].tolist() == [-20, 9]


def _fsl_table():
    b = [pa.record_batch({"v": pa.array([[i * 4 + j for j in range(4)] for i in range(lo, hi)],
                                        pa.list_(pa.float32(), 4))}) for lo, hi in ((0, 3), (3, 7))]
    return pa.Table.from_batches(b)


@pytest.mark.parametrize("part", ["whole", "chunked-slice", "one-chunk-offset"])
def test_fixed_size_list_is_2d(part):
    t = _fsl_table()
    lo, hi = {"whole": (0, 7), "chunked-slice": (1, 6), "one-chunk-offset": (4, 7)}[part]
    t = t.slice(lo, hi - lo)
    out = convert(t)["v"]
    assert out.dtype == np.float32 and out.shape == (hi - lo, 4)
    np.testing.assert_array_equal(out, np.arange(lo * 4, hi * 4, dtype=np.float32).reshape(-1, 4))


LISTS = [[1, 2], [], [3], [4, 5, 6], [], [7], [8, 9]]


@pytest.mark.parametrize("typ,dtype", [(pa.list_(pa.int64()), np.int64), (pa.large_list(pa.float32()), np.float32)],
                         ids=["list<int64>", "large_list<float32>"])
@pytest.mark.parametrize("lo,hi", [(0, 7), (1, 6), (2, 3), (4, 7), (1, 2)])
def test_variable_lists_are_ragged_including_sliced_and_chunked(typ, dtype, lo, hi):
    t = pa.Table.from_batches([pa.record_batch({"v": pa.array(LISTS[a:b], typ)}) for a, b in ((0, 3), (3, 5), (5, 7))])
    out = convert(t.slice(lo, hi - lo))["v"]
    assert isinstance(out, Ragged) and out.values.dtype == dtype
    assert lists(out) == LISTS[lo:hi]


def test_lists_of_temporals_and_bools():
    day = 86_400_000
    t = pa.table({"fd": pa.array([[day, 2 * day], None, [-3 * day, None]], pa.list_(pa.date64(), 2)),
                  "ld": pa.array([[day, -5 * day], None, [7 * day]], pa.large_list(pa.date64())),
                  "lt": pa.array([[1000, None], [], [-1]], pa.list_(pa.timestamp("ms", tz="UTC"))),
                  "lb": pa.array([[True], [None, False], []], pa.list_(pa.bool_()))})
    for lo in (0, 1):
        out = convert(t.slice(lo), fill_nulls={"fd": 9, "ld": 9, "lt": 9, "lb": True})
        assert out["fd"].tolist() == [[1, 2], [9, 9], [-3, 9]][lo:]
        assert lists(out["ld"]) == [[1, -5], [], [7]][lo:] and out["ld"].values.dtype == np.int64
        assert lists(out["lt"]) == [[1000, 9], [], [-1]][lo:]
        assert lists(out["lb"]) == [[True], [True, False], []][lo:] and out["lb"].values.dtype == np.bool_


def test_zero_row_table():
    t = pa.table({"a": pa.array([], pa.int16()), "l": pa.array([], pa.list_(pa.int32())),
                  "f": pa.array([], pa.list_(pa.float64(), 3))})
    out = convert(t)
    assert out["a"].shape == (0,) and out["f"].shape == (0, 3) and lists(out["l"]) == []


def test_groups_stack_with_promotion_and_explicit_cast():
    t = pa.table({"i8": pa.array([-1, 2, 3], pa.int8()), "u8": pa.array([255, 0, 1], pa.uint8()),
                  "f32": pa.array([0.5, 1.5, -2.0], pa.float32()), "i32": pa.array([2**24 + 1, 0, -7], pa.int32()),
                  "b": pa.array([True, False, True])})
    cases = {"iu": (["i8", "u8"], np.int16, [[-1, 255], [2, 0], [3, 1]]),
             "fi": (["f32", "i8"], np.float32, [[0.5, -1], [1.5, 2], [-2, 3]]),
             "wide": (["f32", "i32"], np.float64, [[0.5, 2**24 + 1], [1.5, 0], [-2, -7]]),
             "bi": (["b", "i8"], np.int8, [[1, -1], [0, 2], [1, 3]])}
    out = convert(t, {k: v[0] for k, v in cases.items()})
    for k, (_, dtype, want) in cases.items():
        assert out[k].dtype == np.dtype(dtype) and out[k].shape == (3, 2), k
        np.testing.assert_array_equal(out[k], np.array(want, dtype))
    out = convert(t, {"g": ["i32", "u8"], "s": "i8", "l": "i32"}, dtypes={"g": "float32", "s": np.float64,
                                                                        "l": "int64"})
    assert out["g"].dtype == np.float32 and out["g"][:, 0].tolist() == [float(np.float32(2**24 + 1)), 0, -7]
    assert out["s"].dtype == np.float64 and out["s"].tolist() == [-1.0, 2.0, 3.0]
    assert out["l"].dtype == np.int64 and out["l"].tolist() == [2**24 + 1, 0, -7]


@pytest.mark.parametrize("value", [0.5, float("nan"), float("-inf")])
def test_a_float_no_integer_holds_is_refused_as_such(value):
    """0.5, NaN or infinity cast to an integer dtype: the message says no integer type holds
    it (a float dtype does, or rounding first), not to choose a wider integer."""
    t = pa.table({"f": pa.array([1.0, value])})
    with pytest.raises(gpuload.ConfigError, match=r"column 'f' holds .* not a whole number, which no integer dtype "
                                                  r"holds; keep a float dtype in dtypes="):
        convert(t, ["f"], dtypes={"f": "int64"})
    with pytest.raises(gpuload.ConfigError, match=r"holds 1e\+20 in .* which int32 cannot represent; choose a wider"):
        convert(pa.table({"f": pa.array([1.0, 1e20])}), ["f"], dtypes={"f": "int32"})


def test_a_groups_common_float_type_never_rounds_its_integers_unasked():
    """int64 (or uint64) stacked with a float: NumPy's common type, float64, holds integers
    exactly up to 2**53. Within it the group is exact; beyond it a ConfigError names the column,
    the value, the output and the setting, unless dtypes= names the output's type (rounding
    asked for); signed values beyond -2**53 too."""
    ok = pa.table({"a": pa.array([2**53, -(2**53), 7], pa.int64()), "f": pa.array([0.5, 1.5, 2.5], pa.float32())})
    out = convert(ok, {"x": ["a", "f"]})
    assert out["x"].dtype == np.float64 and out["x"][:, 0].tolist() == [2**53, -(2**53), 7]
    for col, typ, big in (("a", pa.int64(), 2**53 + 1), ("a", pa.int64(), -(2**53) - 1), ("u", pa.uint64(), 2**63 + 1)):
        t = pa.table({col: pa.array([5, big], typ), "i": pa.array([1, -1], pa.int64()),
                      "f": pa.array([0.5, 1.5], pa.float32())})
        members = [col, "f"] if col == "a" else [col, "i"]
        with pytest.raises(gpuload.ConfigError, match=rf"column '{col}' holds {big} in file.parquet .*output 'x' "
                                                      r"\(float64.*dtypes="):
            convert(t, {"x": members})
        out = convert(t, {"x": members}, dtypes={"x": "float64"})  # asked for: rounds, as NumPy and torch do
        assert out["x"][1, 0] == float(big)
    small = pa.table({"b": pa.array([2**31 - 1], pa.int32()), "f": pa.array([0.5], pa.float32())})
    assert convert(small, {"x": ["b", "f"]})["x"].tolist() == [[2**31 - 1, 0.5]]  # int32 in float64: always exact


def test_list_values_cast_with_dtypes():
    t = pa.table({"r": pa.array(LISTS, pa.list_(pa.int64())), "f": pa.array([[1, 2], [3, 4]] * 3 + [[5, 6]],
                                                                             pa.list_(pa.int16(), 2))})
    out = convert(t, dtypes={"r": "float32", "f": "int64"})
    assert out["r"].values.dtype == np.float32 and lists(out["r"]) == LISTS
    assert out["f"].dtype == np.int64 and out["f"][-1].tolist() == [5, 6]


# -- nulls --------------------------------------------------------------------------------
def test_fill_nulls_scalar_and_per_column_in_scalar_columns():
    t = pa.table({"i": pa.array([1, None, 3], pa.int32()), "f": pa.array([None, 2.5, None], pa.float16()),
                  "b": pa.array([None, True, False]), "u": pa.array([None, 1, 2], pa.uint64()),
                  "d": pa.array([None, 86_400_000], pa.date64()).take([0, 1, 1]),
                  "t": pa.array([5, None, 6], pa.timestamp("ms", tz="UTC"))})
    out = convert(t, fill_nulls=1)
    assert out["i"].tolist() == [1, 1, 3] and out["i"].dtype == np.int32
    assert out["f"].tolist() == [1.0, 2.5, 1.0] and out["f"].dtype == np.float16
    assert out["b"].tolist() == [True, True, False] and out["d"].tolist() == [1, 1, 1]
    assert out["t"].tolist() == [5, 1, 6]
    out = convert(t, fill_nulls={"i": -7, "f": np.nan, "b": False, "u": 2**64 - 1, "d": -3, "t": 0})
    assert out["i"].tolist() == [1, -7, 3] and np.isnan(out["f"][[0, 2]]).all() and out["f"][1] == 2.5
    assert out["b"].tolist() == [False, True, False] and out["u"].tolist() == [2**64 - 1, 1, 2]
    assert out["d"].tolist() == [-3, 1, 1] and out["t"].tolist() == [5, 0, 6]


def test_fill_nulls_in_a_group_and_dictionary():
    t = pa.table({"a": pa.array([1, None], pa.int64()), "b": pa.array([None, 2.0]),
                  "c": pa.DictionaryArray.from_arrays(pa.array([0, None, 1], pa.int8()).slice(1),
                                                      pa.array([4, 5], pa.int16()))})
    out = convert(t, {"g": ["a", "b"], "c": "c"}, fill_nulls={"a": 10, "b": -0.5, "c": 9})
    assert out["g"].tolist() == [[1.0, -0.5], [10.0, 2.0]] and out["c"].tolist() == [9, 5]


def test_fill_nulls_in_lists():
    values = pa.array([1, None, 3, 4, 5, 6], pa.int64())
    ll = pa.ListArray.from_arrays(pa.array([0, 2, 5, 5, 6], pa.int32()), values,
                                  mask=pa.array([False, True, False, False]))  # null row over 3 values
    fs = pa.FixedSizeListArray.from_arrays(pa.array([1.0, None, 3.0, 4.0, 5.0, 6.0], pa.float32()), 2,
                                           mask=pa.array([False, True, False]))
    t = pa.table({"l": ll, "big": pa.array([[1.5], None, [None, 2.0], []], pa.large_list(pa.float64())),
                  "f": fs.take([0, 1, 2, 1])})
    out = convert(t, fill_nulls={"l": 0, "big": -1, "f": 7})
    assert lists(out["l"]) == [[1, 0], [], [], [6]]  # null list -> empty list, its 3 values gone
    assert lists(out["big"]) == [[1.5], [], [-1.0, 2.0], []]
    np.testing.assert_array_equal(out["f"], np.float32([[1, 7], [7, 7], [5, 6], [7, 7]]))
    sliced = convert(t.slice(1, 2), fill_nulls=0)
    assert lists(sliced["l"]) == [[], []] and sliced["f"].tolist() == [[0, 0], [5, 6]]
    # a null fixed-size row over non-null values (3, 4) still becomes a row of the fill value
    assert convert(pa.table({"f": fs}), fill_nulls=7)["f"].tolist() == [[1, 7], [7, 7], [5, 6]]


def test_list_arrays_with_an_offset():
    """Sliced arrays reach the list converters directly where ``combine_chunks`` returns a
    lone chunk as it is (it copies in pyarrow 26, so call them directly)."""
    from gpuload.convert import _fixed, _ragged

    fs = pa.array([[1, 2], None, [5, 6], [7, 8]], pa.list_(pa.int16(), 2)).slice(1)
    ll = pa.array([[1], None, [2, 3], [], [4]], pa.large_list(pa.int16())).slice(1, 3)
    specs = {s.name: s for s in resolve_outputs(pa.schema([("f", fs.type), ("l", ll.type)]), fill_nulls=0)}
    assert _fixed(fs, specs["f"], "").tolist() == [[0, 0], [5, 6], [7, 8]]
    assert lists(_ragged([ll], specs["l"], "")) == [[], [2, 3], []]


@pytest.mark.parametrize("arr,count", [
    (pa.array([1, None, None, 4], pa.int32()), 2),
    (pa.array([None, 0.5, 1.0, 2.0], pa.float32()), 1),
    (pa.array([None, None, 1, None], pa.date64()), 3),
    (pa.DictionaryArray.from_arrays(pa.array([0, None, 0, None]), pa.array([1.5])), 2),
    (pa.array([[1], None, None, []], pa.list_(pa.int64())), 2),
    (pa.array([[1, None], [None], [None], []], pa.large_list(pa.int64())), 3),
    (pa.array([[1, 2], None, [3, 4], [5, 6]], pa.list_(pa.int8(), 2)), 1),
    (pa.array([[1, None], [2, 2], [None, 3], [4, 4]], pa.list_(pa.int8(), 2)), 2),
], ids=["int", "float", "date64", "dict", "null-lists", "null-values", "null-fixed", "fixed-values"])
def test_nulls_without_fill_name_column_and_count(arr, count):
    t = pa.table({"ok": pa.array([1, 2, 3, 4]), "bad col": arr})
    with pytest.raises(gpuload.NullValuesError, match=rf"'bad col' has {count} null.*file\.parquet rg 0-1"):
        convert(t)
    with pytest.raises(gpuload.NullValuesError, match="'bad col'"):
        convert(t, fill_nulls={"ok": 0})  # a fill for another column does not cover it


def test_nulls_in_a_group_member_without_fill():
    t = pa.table({"a": pa.array([1, 2]), "b": pa.array([None, 2])})
    with pytest.raises(gpuload.NullValuesError, match="'b' has 1 null"):
        convert(t, {"g": ["a", "b"]}, fill_nulls={"a": 0})


# -- Parquet-produced arrays -----------------------------------------------------------------
FILL = {"l": -1, "f": -1}


def test_parquet_round_trip(tmp_path):
    n = 1000
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 5, n)
    t = pa.table({
        "u32": pa.array(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)),
        "h": pa.array(rng.standard_normal(n).astype(np.float16)),
        "b": pa.array(rng.random(n) < 0.5),
        "d": pa.array(rng.integers(-1000, 30000, n).astype(np.int64) * 86_400_000, pa.date64()),
        "ts": pa.array(rng.integers(0, 2**50, n), pa.timestamp("us", tz="Asia/Tokyo")),
        "l": pa.array([list(range(i, i + k)) if i % 7 else None for i, k in enumerate(lens)], pa.list_(pa.int64())),
        "ll": pa.array([[float(i)] * k for i, k in enumerate(lens)], pa.large_list(pa.float32())),
        "f": pa.array([[i, -i, None] if i % 5 or not ARROW_READS_NULL_FIXED_LISTS else None for i in range(n)],
                      pa.list_(pa.float64(), 3)),  # null rows only where pyarrow reads them (apache/arrow#35692)
    })
    path = tmp_path / "t.parquet"
    pq.write_table(t, path, row_group_size=128)
    back = pq.read_table(path)  # (numeric dictionaries do not survive Parquet: covered above)
    assert back.column("l").num_chunks > 1 and back.schema.field("d").type == pa.date32()
    want = convert(t, fill_nulls=FILL)
    for table in (back, pq.ParquetFile(path).read_row_groups([2, 3, 4]), back.slice(300, 211)):
        got = convert(table, fill_nulls=FILL)
        lo = {1000: 0, 384: 256, 211: 300}[table.num_rows]
        for k, v in want.items():
            if isinstance(v, Ragged):
                assert lists(got[k]) == lists(v)[lo:lo + table.num_rows], k
            else:
                assert got[k].dtype == v.dtype, k
                np.testing.assert_array_equal(bits(got[k]) if v.dtype.kind == "f" else got[k], (
                    bits(v) if v.dtype.kind == "f" else v)[lo:lo + table.num_rows], err_msg=k)


@pytest.mark.parametrize("values,dtype", [([1, 2**40], "int32"), ([1.0, 1.5], "int8"), ([0, 2], "bool"),
                                          ([1.0, float("nan")], "int64")])
def test_lossy_integer_cast_is_refused(values, dtype):
    with pytest.raises(gpuload.ConfigError, match="'x' holds"):
        convert(pa.table({"x": pa.array(values)}), {"y": "x"}, dtypes={"y": dtype})


def test_exact_narrowing_and_float_rounding_are_allowed():
    out = convert(pa.table({"x": pa.array([1, -5, 127, 0]), "f": pa.array([0.1, 3e38, -2.5, float("-inf")])}),
                  {"x": "x", "f": "f"}, dtypes={"x": "int8", "f": "float32"})
    assert out["x"].dtype == np.int8 and out["x"].tolist() == [1, -5, 127, 0]
    assert out["f"].dtype == np.float32  # floats round, as asked (an infinity stays one)
    assert out["f"].tolist() == np.array([0.1, 3e38, -2.5, float("-inf")], np.float32).tolist()
    with pytest.raises(gpuload.ConfigError, match="'f' holds 1e\\+300 .*beyond the range of float32"):
        convert(pa.table({"f": pa.array([0.1, 1e300])}), {"f": "f"}, dtypes={"f": "float32"})  # not silently inf


def test_float64_to_float16_rounds_once_to_nearest():
    """As documented: one rounding to nearest (NumPy's, and the GPU's ``__double2half``), where torch's
    float64 -> float16 rounds through float32 (a helper's trial: the README said "exactly as torch")."""
    x = np.array([1 + 2**-11 + 2**-40, 2.0**-14 * (1 + 2**-11 + 2**-40), 1024 * (1 + 2**-11 + 2**-40), 0.1, -65519.0])
    out = convert(pa.table({"x": pa.array(x)}), {"x": "x"}, dtypes={"x": "float16"})["x"]
    assert out.view(np.uint16).tolist() == x.astype(np.float16).view(np.uint16).tolist()
    assert out.view(np.uint16)[0] == 0x3C01  # 1 + 2**-10: above the halfway point, as float64 holds it
    assert x.astype(np.float32).astype(np.float16).view(np.uint16)[0] == 0x3C00  # two roundings: below


def test_date64_before_1970_rounds_down_to_its_day():
    """-1 ms is 1969-12-31: day -1 (as the GPU path computes it), not day 0."""
    import pyarrow as pa

    from gpuload.convert import table_to_columns
    from gpuload.schema import resolve_outputs

    ms = [-1, -86_400_000, -86_400_001, 0, 86_399_999, 86_400_000, None]
    t = pa.table({"d": pa.array(ms, pa.date64())})
    specs = resolve_outputs(t.schema, ["d"], fill_nulls={"d": 7})
    got = table_to_columns(t, specs)["d"].tolist()
    assert got == [-1, -1, -2, 0, 0, 1, 7]


# -- decimals ---------------------------------------------------------------------------------
def _decimals(rng, n, precision, scale):
    import decimal

    digits = rng.integers(1, precision + 1, n)
    values = [None if i % 9 == 0 else decimal.Decimal(int(rng.integers(-10**int(k) + 1, 10**int(k)) if k < 18 else
                                                           int.from_bytes(rng.bytes(16), "little") % 10**int(k)
                                                           * (-1) ** i)).scaleb(-scale)
              for i, k in enumerate(digits)]
    return values


def _as_float(d, scale):  # the documented rule, value by value: float(unscaled) / 10**scale
    return float(int(d.scaleb(scale))) / float(10**scale)


@pytest.mark.parametrize("precision,scale", [(9, 2), (18, 4), (38, 10), (38, 0), (30, 25)])
@pytest.mark.parametrize("store_as_integer", [False, True])
def test_decimals_become_float64_by_the_documented_rule(tmp_path, precision, scale, store_as_integer):
    if scale > precision:
        pytest.skip("pyarrow wants scale <= precision")
    rng = np.random.default_rng(precision * 100 + scale)
    values = _decimals(rng, 3000, precision, scale)
    path = tmp_path / "d.parquet"
    kw = {"store_decimal_as_integer": True} if store_as_integer and precision <= 18 else {}
    pq.write_table(pa.table({"v": pa.array(values, pa.decimal128(precision, scale))}), path, row_group_size=700, **kw)
    ds = gpuload.ParquetDataset(path, ["v"], cache_dir=tmp_path / "c", device="cpu", shuffle=False, batch_size=3000,
                                fill_nulls=-1.5)
    got = next(iter(ds))["v"].numpy()
    want = np.array([-1.5 if v is None else _as_float(v, scale) for v in values])
    assert got.dtype == np.float64 and got.tobytes() == want.tobytes()
    exact = [v is not None and abs(int(v.scaleb(scale))) < 2**63 for v in values]
    ints = gpuload.ParquetDataset(path, ["v"], cache_dir=tmp_path / "c", device="cpu", shuffle=False, batch_size=3000,
                                  fill_nulls=0, dtypes={"v": "int64"})
    if all(e for e, v in zip(exact, values) if v is not None):
        assert next(iter(ints))["v"].numpy().tolist() == [0 if v is None else int(v.scaleb(scale)) for v in values]
    else:  # an unscaled integer beyond int64: refused, naming the column and the value
        with pytest.raises(gpuload.ConfigError, match=r"column 'v' holds .* whose unscaled integer int64 cannot hold"):
            next(iter(ints))


def test_decimal_nulls_without_a_fill_and_narrow_integer_casts_are_refused(tmp_path):
    import decimal

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"v": pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("400.00")],
                                           pa.decimal128(6, 2))}), path)
    with pytest.raises(gpuload.NullValuesError, match="'v'"):
        gpuload.ParquetDataset(path, ["v"], cache_dir=tmp_path / "c", device="cpu")
    ds = gpuload.ParquetDataset(path, ["v"], cache_dir=tmp_path / "c", device="cpu", fill_nulls=0,
                                dtypes={"v": "int8"}, shuffle=False)
    with pytest.raises(gpuload.ConfigError, match=r"column 'v' holds 150 in .* which int8 cannot represent"):
        next(iter(ds))


def test_chunked_columns_convert_piece_by_piece_exactly_as_joined_ones():
    """A chunk's row groups arrive as Arrow chunks: converted one by one (never joined in Arrow),
    handed to the layout as Pieces and packed, they give the bytes the joined table gives."""
    from gpuload.layout import Pieces
    from gpuload.layout import Layout
    from gpuload.layout import spec_description

    rng = np.random.default_rng(3)
    parts = []
    for n in (5, 0, 7, 4):
        parts.append(pa.table({
            "id": pa.array(rng.integers(0, 1 << 40, n)),
            "i": pa.array([None if v % 3 == 0 else int(v) for v in rng.integers(0, 50, n)], pa.int32()),
            "f": pa.array(rng.random(n).astype(np.float32)),
            "g": pa.array(rng.random(n)),
            "s": pa.array([f"k{v}" for v in rng.integers(0, 4, n)]).dictionary_encode(),
            "h": pa.array([None if v == 0 else [int(v), None][:1 + v % 2] * (int(v) % 3) for v in rng.integers(0, 9, n)],
                          pa.list_(pa.int64()))}))  # null lists and null elements in several pieces
    chunked = pa.concat_tables([p.cast(parts[0].schema) for p in parts])
    assert chunked.column("id").num_chunks == 4
    columns = {"id": "id", "i": "i", "f": "f", "fg": ["f", "g"], "s": "s", "h": "h"}
    specs = resolve_outputs(chunked.schema, columns, {"i": -1, "h": 7}, {"i": "float32"}, file="x")  # s: hashed ids
    assert chunked.column("h").null_count > 0 and pc.list_flatten(chunked.column("h")).null_count > 0
    whole = table_to_columns(chunked.combine_chunks(), specs, "x")
    piecewise = table_to_columns(chunked, specs, "x", pieces=True)
    assert isinstance(piecewise["id"], Pieces) and len(piecewise["id"].parts) == 4
    assert lists(piecewise["h"]) == [[7 if v is None else v for v in r or []] for r in chunked.column("h").to_pylist()]
    np.testing.assert_array_equal(table_to_columns(chunked, specs, "x")["i"], whole["i"])  # joined by default
    for layout in ("rows", "columns"):
        lay = Layout(spec_description(specs, layout))
        a, b = lay.pack(whole), lay.pack(piecewise)
        assert list(a) == list(b)
        for k in a:
            if isinstance(a[k], Ragged):
                np.testing.assert_array_equal(a[k].values, b[k].values)
                np.testing.assert_array_equal(a[k].offsets, b[k].offsets)
            else:
                assert a[k].dtype == b[k].dtype and b[k].flags.c_contiguous
                np.testing.assert_array_equal(bits(a[k]) if a[k].dtype.kind == "f" else a[k],
                                              bits(b[k]) if b[k].dtype.kind == "f" else b[k])
    # the first value a cast cannot hold is named, in whichever piece it lies
    bad = pa.chunked_array([pa.array([1.0, 2.0]), pa.array([3.0, 4.5, 5.5])])
    with pytest.raises(gpuload.ConfigError, match="holds 4.5"):
        table_to_columns(pa.table({"x": bad}), resolve_outputs(pa.schema([("x", pa.float64())]), {"y": "x"},
                                                                None, {"y": "int64"}, file="x"), "x", pieces=True)
