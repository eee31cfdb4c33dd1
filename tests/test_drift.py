"""Schema drift (gpuload/drift.py): files of one source whose types for a column differ are read
in the type that holds every file's values exactly, each file's values as pyarrow casts them;
types none holds, or values the finer unit cannot hold, are refused at open, naming the files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

import gpuload
from gpuload import drift

from conftest import write_parquet


@pytest.mark.parametrize("a, b, want", [
    (pa.int32(), pa.int64(), pa.int64()), (pa.int8(), pa.int16(), pa.int16()), (pa.uint8(), pa.uint32(), pa.uint32()),
    (pa.int8(), pa.uint8(), pa.int16()), (pa.int64(), pa.uint32(), pa.int64()), (pa.int16(), pa.uint32(), pa.int64()),
    (pa.int64(), pa.uint64(), None), (pa.float32(), pa.float64(), pa.float64()),
    (pa.int16(), pa.float32(), pa.float32()), (pa.int32(), pa.float32(), pa.float64()),
    (pa.uint32(), pa.float64(), pa.float64()), (pa.int64(), pa.float64(), None), (pa.bool_(), pa.int8(), None),
    (pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.large_list(pa.int64())),
    (pa.list_(pa.float32()), pa.list_(pa.float64()), pa.list_(pa.float64())),
    (pa.list_(pa.int32(), 3), pa.list_(pa.int64(), 3), pa.list_(pa.int64(), 3)),
    (pa.list_(pa.int32(), 3), pa.list_(pa.int32(), 4), None), (pa.list_(pa.int32()), pa.int32(), None),
    (pa.dictionary(pa.int8(), pa.int32()), pa.int64(), pa.int64()),
    (pa.timestamp("ms"), pa.timestamp("us"), pa.timestamp("us")), (pa.timestamp("ns"), pa.timestamp("s"), pa.timestamp("ns")),
    (pa.timestamp("ms", "UTC"), pa.timestamp("us", "Asia/Tokyo"), pa.timestamp("us", "Asia/Tokyo")),
    (pa.timestamp("ms"), pa.timestamp("ms", "UTC"), None), (pa.timestamp("ms"), pa.date32(), None),
    (pa.duration("s"), pa.duration("us"), pa.duration("us")), (pa.duration("s"), pa.timestamp("s"), None),
    (pa.time32("s"), pa.time64("ns"), pa.time64("ns")), (pa.time32("s"), pa.time32("ms"), pa.time32("ms")),
    (pa.decimal128(5, 2), pa.decimal128(6, 3), pa.decimal128(6, 3)), (pa.decimal128(9, 0), pa.decimal128(4, 4),
                                                                       pa.decimal128(13, 4)),
    (pa.decimal128(38, 0), pa.decimal128(38, 10), None), (pa.decimal128(5, 2), pa.float64(), None),
    (pa.list_(pa.timestamp("ms")), pa.large_list(pa.timestamp("ns")), pa.large_list(pa.timestamp("ns"))),
    (pa.null(), pa.float32(), pa.float32()), (pa.null(), pa.string(), pa.string()), (pa.null(), pa.null(), pa.null()),
    (pa.list_(pa.null()), pa.large_list(pa.int16()), pa.large_list(pa.int16())),
])
def test_wider_holds_both_types_exactly_or_is_none(a, b, want):
    assert drift.wider(a, b) == want and drift.wider(b, a) == want


@pytest.mark.parametrize("types, want", [
    ((pa.int32(), pa.uint32(), pa.float32()), pa.float64()),  # pairwise, int32 and uint32 first, it was refused
    ((pa.int16(), pa.uint16(), pa.float32()), pa.float32()),
    ((pa.int32(), pa.float64(), pa.int64()), None),
    ((pa.int8(), pa.uint16(), pa.int16()), pa.int32()),
])
def test_wider_is_one_type_for_all_whatever_their_order(types, want):
    import itertools

    assert {drift.wider(*p) for p in itertools.permutations(types)} == {want}


def test_files_whose_types_drift_are_read_in_the_type_that_holds_them_all(tmp_path, device_decode):
    """pyarrow's int32 and float32 beside DuckDB's int64 and double, an int column beside one
    pandas made float (its nulls), pyarrow's list beside Polars' large_list: each output in the
    type that holds every file's values, equal to pyarrow's own reading of each file cast to it.
    With cuDF, a file whose column is narrower than the output is decoded by pyarrow instead
    (cuDF's bytes would be the file's type): the fallback is counted, the values are the same.
    Where DuckDB or Polars is missing (the GPU node, which has room for neither), pyarrow writes
    their files in the types they write, so the device variants still see the drift."""
    _drifting_files(tmp_path / "src")
    device, decode = device_decode
    ds = gpuload.ParquetDataset(tmp_path / "src", ["id", "x", "n", "h"], batch_size=7, shuffle=False, device=device,
                                decode=decode, cache_dir=tmp_path / "c", fill_nulls={"n": -1.5})
    types = {"id": pa.int64(), "x": pa.float64(), "n": pa.float32(), "h": pa.large_list(pa.int64())}
    want = pa.concat_tables(pq.read_table(f).select(list(types)).cast(pa.schema(types))
                            for f in sorted((tmp_path / "src").glob("*.parquet")))
    for _ in range(2):  # decoded, then from the cache
        got = {k: [] for k in types}
        for b in ds:
            for k in ("id", "x", "n"):
                got[k].append(b[k].cpu().numpy())
            got["h"].extend(np.split(b["h"].values.cpu().numpy(), b["h"].offsets.cpu().numpy()[1:-1]))
        assert [a.dtype for a in (got["id"][0], got["x"][0], got["n"][0], got["h"][0])] == \
            [np.int64, np.float64, np.float32, np.int64]
        assert np.array_equal(np.concatenate(got["id"]), want["id"].to_numpy())
        assert np.array_equal(np.concatenate(got["x"]), want["x"].to_numpy())
        assert np.array_equal(np.concatenate(got["n"]), want["n"].fill_null(-1.5).to_numpy())
        assert [h.tolist() for h in got["h"]] == want["h"].to_pylist()
    if decode == "gpu":  # a.parquet's narrower columns went through pyarrow; cuDF decoded the rest
        assert 0 < ds.reader.decode.fallbacks < ds.reader.counters.decoded, (ds.reader.decode.fallbacks,
                                                                               ds.reader.counters.decoded)


def test_timestamps_and_decimals_in_several_units_are_read_in_the_finest(tmp_path, device_decode):
    """A new user's trial: pandas' nanoseconds beside Spark's or Polars' microseconds, timestamps in
    milliseconds beside seconds, decimals of two scales, were refused as if no type held them both.
    Each file's values, as pyarrow casts them to the finest unit (the largest scale), exactly."""
    import decimal

    src = tmp_path / "src"
    ts = [0, 1_700_000_000_123, -86_400_001, None]  # ms, before 1970 too
    write_parquet(src / "a.parquet", pa.table({
        "t": pa.array(ts, pa.timestamp("ms", "UTC")), "d": pa.array([decimal.Decimal(v) for v in
                                                                     ("1.25", "-3.50", "0.01", "99.99")],
                                                                    pa.decimal128(4, 2)),
        "h": pa.array([[1, 2], [], None, [3]], pa.list_(pa.duration("s")))}))
    write_parquet(src / "b.parquet", pa.table({
        "t": pa.array([5, 1_700_000_000_123_456, None], pa.timestamp("us", "America/New_York")),
        "d": pa.array([decimal.Decimal(v) for v in ("1.255", "-0.001", "12.345")], pa.decimal128(5, 3)),
        "h": pa.array([[7], [8, 9], []], pa.list_(pa.duration("us")))}))
    device, decode = device_decode
    ds = gpuload.ParquetDataset(src, ["t", "d", "h"], batch_size=3, shuffle=False, device=device, decode=decode,
                                cache_dir=tmp_path / "c", fill_nulls={"t": 0, "h": 0})
    types = {"t": pa.timestamp("us", "UTC"), "d": pa.decimal128(5, 3), "h": pa.list_(pa.duration("us"))}
    want = pa.concat_tables(pq.read_table(f).cast(pa.schema(types)) for f in sorted(src.glob("*.parquet")))
    for _ in range(2):  # decoded, then from the cache
        t, d, h = [], [], []
        for b in ds:
            t += b["t"].cpu().tolist()
            d += b["d"].cpu().tolist()
            h += [v.tolist() for v in np.split(b["h"].values.cpu().numpy(), b["h"].offsets.cpu().numpy()[1:-1])]
        assert t == [0 if v is None else v for v in want["t"].cast(pa.int64()).to_pylist()]
        assert d == [float(v) for v in want["d"].to_pylist()]
        assert h == [[] if v is None else v for v in want["h"].cast(pa.list_(pa.int64())).to_pylist()]
    ds = gpuload.ParquetDataset(src, ["d"], dtypes={"d": "int64"}, shuffle=False, device=device, decode=decode,
                                cache_dir=tmp_path / "c")  # the unscaled integers, at the largest scale
    assert [v for b in ds for v in b["d"].cpu().tolist()] == [1250, -3500, 10, 99990, 1255, -1, 12345]


def test_a_value_the_finer_unit_cannot_hold_is_refused_at_open(tmp_path):
    """Microseconds in the year 3000 are beyond int64 nanoseconds: refused by the statistics, naming the file."""
    src = tmp_path / "src"
    write_parquet(src / "a.parquet", pa.table({"t": pa.array([0], pa.timestamp("ns"))}))
    write_parquet(src / "b.parquet", pa.table({"t": pa.array([32_503_680_000 * 10**6], pa.timestamp("us"))}))
    with pytest.raises(gpuload.SourceError, match=r"column 't' is timestamp\[us\] in .*b.parquet \(row group 0, by "
                                                  r"its statistics\), and other files have it in ns"):
        gpuload.ParquetDataset(src, cache_dir=tmp_path / "c", device="cpu")
    write_parquet(src / "b.parquet", pa.table({"t": pa.array([32_503_680_000 * 10**6], pa.timestamp("us"))}),
                  write_statistics=False)  # then when the chunk is converted
    ds = gpuload.ParquetDataset(src, cache_dir=tmp_path / "c", device="cpu", shuffle=False)
    with pytest.raises(gpuload.SourceError, match=r"beyond what int64 holds in ns"):
        list(ds)


def _drifting_files(src):
    """a.parquet by pyarrow (int32, float32, int16, list<int32>), b.parquet by DuckDB (int64,
    double, float with nulls, list<int64>), c.parquet by Polars (int64, double, float,
    large_list<int64>); b and c by pyarrow in those types where the tool does not import."""
    a = pa.table({"id": pa.array(np.arange(40), pa.int32()), "x": pa.array(np.linspace(0, 1, 40), pa.float32()),
                  "n": pa.array(np.arange(40) * 3, pa.int16()),
                  "h": pa.array([list(range(i % 4)) for i in range(40)], pa.list_(pa.int32()))})
    write_parquet(src / "a.parquet", a, row_group_size=16)
    try:
        import duckdb
        duckdb.sql("SELECT (i + 40)::BIGINT AS id, i / 7.0 ::DOUBLE AS x, CASE WHEN i % 5 = 0 THEN NULL ELSE i * 0.5 "
                   "END ::FLOAT AS n, [i, i + 1]::BIGINT[] AS h FROM range(30) t(i)").write_parquet(str(src / "b.parquet"))
    except ImportError:
        i = np.arange(30)
        pq.write_table(pa.table({"id": pa.array(i + 40, pa.int64()), "x": pa.array(i / 7.0, pa.float64()),
                                 "n": pa.array(np.where(i % 5 == 0, np.nan, i * 0.5), pa.float32(), mask=i % 5 == 0),
                                 "h": pa.array([[k, k + 1] for k in i], pa.list_(pa.int64()))}), src / "b.parquet")
    c = {"id": np.arange(70, 90, dtype=np.int64), "x": np.linspace(2, 3, 20), "n": np.arange(20, dtype=np.float32),
         "h": [[i] for i in range(20)]}
    try:
        import polars as pl
        pl.DataFrame(c, schema_overrides={"h": pl.List(pl.Int64)}).write_parquet(src / "c.parquet")
    except ImportError:
        pq.write_table(pa.table({**c, "h": pa.array(c["h"], pa.large_list(pa.int64()))}), src / "c.parquet")


def test_a_file_whose_column_holds_only_nulls_reads_as_the_other_files_type(tmp_path):
    """A user's trial: pandas and pyarrow type a column that is all None in one file (one day's
    file, an empty table) as Arrow's null type; it holds nothing any type could not, so the
    source reads in the other files' types, the nulls filled, where it was refused before."""
    src = tmp_path / "src"
    write_parquet(src / "a.parquet", pa.table({"id": np.arange(30), "x": np.arange(30) / 4, "s": ["k"] * 30,
                                               "t": pa.array(np.arange(30).astype("datetime64[ms]")),
                                               "h": pa.array([[i, i] for i in range(30)], pa.list_(pa.int32())),
                                               "fx": pa.array([[i, -i] for i in range(30)], pa.list_(pa.float32(), 2)),
                                               "sl": pa.array([["a", "b"]] * 30)}))
    write_parquet(src / "b.parquet", pa.table({"id": np.arange(30, 50), "x": pa.nulls(20), "s": pa.nulls(20),
                                               "t": pa.nulls(20), "h": pa.array([[]] * 19 + [None]),
                                               "fx": pa.nulls(20), "sl": pa.nulls(20)}))
    assert pq.read_schema(src / "b.parquet").field("h").type == pa.list_(pa.null())
    fill = {"x": -1.0, "t": -7, "h": 0, "fx": 2.5}
    ds = gpuload.ParquetDataset(src, None, batch_size=8, shuffle=False, device="cpu", cache_dir=tmp_path / "c",
                                fill_nulls=fill)
    assert ds.outputs == ["id", "x", "s", "t", "h", "fx", "sl"]
    got = {k: [] for k in ds.outputs}
    for b in ds:
        for k, v in b.items():
            got[k] += [v.values[v.offsets[i]:v.offsets[i + 1]].tolist() for i in range(len(v.offsets) - 1)] \
                if isinstance(v, gpuload.Ragged) else v.tolist()
    want = pa.concat_tables([pq.read_table(f) for f in (src / "a.parquet", src / "b.parquet")], promote_options="permissive")
    assert got["id"] == list(range(50)) and got["x"] == want["x"].fill_null(-1.0).to_pylist()
    assert got["t"] == list(range(30)) + [-7] * 20 and got["h"] == [[i, i] for i in range(30)] + [[]] * 20
    assert len(set(got["s"][:30])) == 1 and got["s"][30:] == [0] * 20  # a hashed null: id 0
    assert got["fx"] == [[i, -i] for i in range(30)] + [[2.5, 2.5]] * 20  # null rows: rows of the fill
    assert got["sl"][:30] == [got["sl"][0]] * 30 and len(got["sl"][0]) == 2 and got["sl"][30:] == [[]] * 20
    with pytest.raises(gpuload.NullValuesError, match="'x' has 20 null values"):
        list(gpuload.ParquetDataset(src, ["x"], device="cpu", cache_dir=tmp_path / "c2"))
    for c in ("h", "fx"):  # null lists without a fill are refused naming the column, as in a typed file
        with pytest.raises(gpuload.NullValuesError, match=f"'{c}' has .* null lists"):
            list(gpuload.ParquetDataset(src, [c], device="cpu", cache_dir=tmp_path / "c2"))


def test_types_no_type_holds_exactly_are_refused_naming_both_files(tmp_path):
    write_parquet(tmp_path / "src" / "a.parquet", {"id": np.arange(5, dtype=np.int64)})
    write_parquet(tmp_path / "src" / "b.parquet", {"id": np.arange(5, dtype=np.float64)})  # pandas' ints with NaN
    write_parquet(tmp_path / "src" / "c.parquet", {"id": np.arange(5, dtype=np.int32)})  # held by both: not named
    with pytest.raises(gpuload.SchemaError, match=r"column 'id' is int64 in .*a\.parquet, double in .*b\.parquet, "
                                                  r"int32 in .*c\.parquet, and no type holds all of them exactly "
                                                  r".*rewrite the files"):
        gpuload.ParquetDataset(tmp_path / "src", ["id"], batch_size=2, device="cpu", cache_dir=tmp_path / "c")


def test_widened_float_nans_are_the_positive_quiet_nan(tmp_path):
    """A float32 file's NaN of any sign and payload, beside a float64 file: float64's positive
    quiet NaN, as a dtypes= cast makes it (the bytes do not depend on the path)."""
    odd = np.array([0xFFC00001, 0x7FC00000, 0x3F800000], np.uint32).view(np.float32)  # -NaN with a payload, NaN, 1.0
    write_parquet(tmp_path / "src" / "a.parquet", {"v": odd})
    write_parquet(tmp_path / "src" / "b.parquet", {"v": np.array([2.0])})
    ds = gpuload.ParquetDataset(tmp_path / "src", ["v"], batch_size=4, shuffle=False, device="cpu",
                                cache_dir=tmp_path / "c")
    got = next(iter(ds))["v"].numpy().view(np.uint64).tolist()
    assert got == [0x7FF8000000000000, 0x7FF8000000000000, 0x3FF0000000000000, 0x4000000000000000]


def _evolved(src):
    """Three files of one table whose later two gained columns: a float, a list, a string and a timestamp."""
    write_parquet(src / "a.parquet", {"id": np.arange(3)})
    for k, name in enumerate(("b", "c")):
        ids = np.arange(3 * k + 3, 3 * k + 6)
        pq.write_table(pa.table({"id": ids, "w": ids * 0.5, "l": pa.array([[int(i)] * (i % 3) for i in ids]),
                                 "s": pa.array([f"v{i}" for i in ids]),
                                 "t": pa.array(ids.astype("datetime64[ms]"))}), src / f"{name}.parquet")


def _reference(src, columns, filter=None):
    """pyarrow's own reading of the files under their unified schema: nulls where a file lacks a column."""
    import pyarrow.dataset as pds

    schema = pa.unify_schemas([pq.read_schema(p) for p in sorted(src.glob("*.parquet"))])
    return pds.dataset(src, schema=schema).to_table(columns=columns, filter=filter).sort_by("id")


def test_a_column_some_files_lack_is_nulls_there_and_needs_a_fill_value(tmp_path):
    """A column added later (a Delta table's schema evolution, an older writer's files) is read as nulls in
    the files without it, as pyarrow's dataset reads them: without a fill value that is an error naming the
    files that lack it; with one, every value is pyarrow's, its nulls filled."""
    src = tmp_path / "src"
    _evolved(src)
    with pytest.raises(gpuload.NullValuesError, match=r"'w' has 3 null values \(in .*a\.parquet\) \(1 file lacks the "
                                                      r"column, added later"):
        gpuload.ParquetDataset(src, ["id", "w"], cache_dir=tmp_path / "c", device="cpu")
    fills = {"w": -1.0, "l": 0, "t": -7}
    ds = gpuload.ParquetDataset(src, {"id": "id", "w": "w", "l": "l", "s": "s", "t": "t", "ws": ["w", "id"]},
                                fill_nulls=fills, cache_dir=tmp_path / "c", device="cpu", batch_size=4, shuffle=False)
    got = {k: [] for k in ("id", "w", "l", "s", "t", "ws")}
    for b in ds:
        for k in ("id", "w", "s", "t", "ws"):
            got[k] += b[k].tolist()
        values, offsets = b["l"].values.tolist(), b["l"].offsets.tolist()
        got["l"] += [values[i:j] for i, j in zip(offsets, offsets[1:])]
    ref = _reference(src, ["id", "w", "l", "s", "t"])
    assert got["id"] == ref.column("id").to_pylist() == list(range(9))
    assert got["w"] == ref.column("w").fill_null(-1.0).to_pylist()
    assert got["l"] == [v or [] for v in ref.column("l").to_pylist()]
    assert got["t"] == ref.column("t").cast(pa.int64()).fill_null(-7).to_pylist()
    assert got["ws"] == [[w, float(i)] for w, i in zip(got["w"], got["id"])]
    signed = [xxhash.xxh64_intdigest(v.encode()) for v in ref.column("s").to_pylist()[3:]]
    assert got["s"] == [0, 0, 0] + [h - (1 << 64) * (h >= 1 << 63) for h in signed]  # a null string: id 0


@pytest.mark.parametrize("cond", [[("w", ">", 3.0)], [("w", "<", 100.0)]])
def test_a_filter_on_a_column_some_files_lack_keeps_none_of_their_rows(tmp_path, cond):
    """A condition on a column a file lacks is null there, as in pyarrow's dataset: its rows are not kept;
    columns=None still leaves such a column out."""
    import pyarrow.compute as pc

    src = tmp_path / "src"
    _evolved(src)
    ds = gpuload.ParquetDataset(src, ["id"], filters=cond, cache_dir=tmp_path / "c", device="cpu", shuffle=False)
    name, op, value = cond[0]
    want = _reference(src, ["id"], {">": pc.field(name) > value, "<": pc.field(name) < value}[op])
    assert sorted(v for b in ds for v in b["id"].tolist()) == want.column("id").to_pylist()
    assert gpuload.ParquetDataset(src, cache_dir=tmp_path / "c", device="cpu").outputs == ["id"]


def test_a_column_no_file_has_is_still_a_misspelling(tmp_path):
    src = tmp_path / "src"
    _evolved(src)
    with pytest.raises(gpuload.SchemaError, match=r"column 'nope' is not in "):
        gpuload.ParquetDataset(src, ["id", "nope"], cache_dir=tmp_path / "c", device="cpu")


def test_a_type_no_type_holds_is_said_of_the_files_that_have_it_not_of_those_that_lack_it(tmp_path):
    """A review's find: a file lacking the column was named as holding the first other file's type."""
    src = tmp_path / "src"
    write_parquet(src / "a_old.parquet", {"id": np.arange(3)})
    write_parquet(src / "b.parquet", {"id": np.arange(3), "x": np.arange(3)})
    pq.write_table(pa.table({"id": np.arange(3), "x": ["p", "q", "r"]}), src / "c.parquet")
    with pytest.raises(gpuload.SchemaError) as e:
        gpuload.ParquetDataset(src, ["id", "x"], fill_nulls={"x": 0}, cache_dir=tmp_path / "c", device="cpu")
    assert "int64 in " in str(e.value) and "b.parquet" in str(e.value) and "a_old" not in str(e.value)
