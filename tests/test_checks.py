"""Open-time checks: nulls and out-of-range casts are found when the dataset opens, not
after hours of decoding; and opening a cached dataset reads no column data."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import gpuload
from gpuload import checks

from conftest import ARROW_READS_NULL_FIXED_LISTS, write_parquet


def _lists(n, null_at=None, empty=True, null_elem_at=None):
    out = []
    for i in range(n):
        if i == null_at:
            out.append(None)
        elif empty and i % 7 == 0:
            out.append([])
        else:
            out.append([i, i + 1] if i != null_elem_at else [i, None])
    return pa.array(out, pa.list_(pa.int64()))


def _files(root, nfiles=20, rows=500, last=None, statistics=True, writer="pyarrow"):
    """``nfiles`` files of rows with a list column (with empty lists); the last gets ``last``.
    ``writer="polars"``: written by Polars, whose files hold no definition-level histograms
    (so the check reads the column); pyarrow's do."""
    for f in range(nfiles):
        h = _lists(rows, **(last if f == nfiles - 1 and last else {}))
        t = pa.table({"row_id": np.arange(f * rows, (f + 1) * rows), "h": h,
                      "fixed": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 2.0)), 2)})
        path = root / f"part-{f:03d}.parquet"
        if writer == "polars":
            pl = pytest.importorskip("polars")

            root.mkdir(parents=True, exist_ok=True)
            pl.from_arrow(t).write_parquet(path, row_group_size=100, statistics=statistics)
        else:
            write_parquet(path, t, row_group_size=100, write_statistics=statistics)
    return root


def _count_scans(monkeypatch) -> list:
    """The column reads of the open-time null check: (file, column, row groups) each."""
    scans = []
    real = checks._scan
    monkeypatch.setattr(checks, "_scan", lambda f, c, groups, lists: scans.append((f.path, c, groups))
                        or real(f, c, groups, lists))
    return scans


@pytest.mark.parametrize("writer", ["pyarrow", "polars"])
@pytest.mark.parametrize("statistics", [True, False])
@pytest.mark.parametrize("fault", [dict(null_at=333), dict(null_elem_at=8)])
def test_null_list_in_the_last_file_is_found_at_open(tmp_path, monkeypatch, statistics, fault, writer):
    """20 files, one null list in the last: refused when the dataset opens, naming the fix;
    from pyarrow's footers alone (their definition-level histograms), else by reading the column."""
    data = _files(tmp_path / "d", last=fault, statistics=statistics, writer=writer)
    scans = _count_scans(monkeypatch)
    with pytest.raises(gpuload.NullValuesError) as info:
        gpuload.ParquetDataset(data, ["row_id", "h"], cache_dir=tmp_path / "c", device="cpu", batch_size=100)
    assert any(c == "h" for _, c, _ in scans) == (writer == "polars")  # (flat columns without statistics: read)
    msg = str(info.value)
    assert "'h'" in msg and "part-019.parquet" in msg and "part-000" not in msg
    assert "fill_nulls={'h': 0}" in msg and "empty" in msg
    ds = gpuload.ParquetDataset(data, ["row_id", "h"], cache_dir=tmp_path / "c", device="cpu", batch_size=100,
                                fill_nulls={"h": 0})
    assert sum(len(b["row_id"]) for b in ds) == 10_000


def test_empty_lists_are_not_nulls(tmp_path):
    data = _files(tmp_path / "d", nfiles=3)
    ds = gpuload.ParquetDataset(data, ["row_id", "h", "fixed"], cache_dir=tmp_path / "c", device="cpu")
    assert sum(len(b["row_id"]) for b in ds) == 1500


def test_open_reads_no_column_data_for_cached_chunks(tmp_path, monkeypatch):
    """The scan for null lists (files without definition-level histograms) reads a list column
    once; a reopened, cached dataset reads none."""
    data = _files(tmp_path / "d", nfiles=4, writer="polars")
    scans = _count_scans(monkeypatch)
    ds = gpuload.ParquetDataset(data, ["row_id", "h"], cache_dir=tmp_path / "c", device="cpu", batch_size=100)
    # each row group's list column read once (statistics cannot rule nulls out), a few row groups per job
    read = sorted((p, g) for p, _, groups in scans for g in groups)
    assert read == sorted((str(f), g) for f in sorted(data.glob('*.parquet')) for g in range(pq.ParquetFile(f).metadata.num_row_groups))
    assert max(len(groups) for _, _, groups in scans) <= checks._SCAN_GROUPS
    list(ds)
    ds.reader.cache.flush()
    scans.clear()
    gpuload.ParquetDataset(data, ["row_id", "h"], cache_dir=tmp_path / "c", device="cpu", batch_size=100)
    assert scans == []


def test_scalar_nulls_in_files_without_statistics_are_found_at_open(tmp_path):
    t = pa.table({"x": pa.array([1.0] * 999 + [None])})
    write_parquet(tmp_path / "d" / "a.parquet", {"x": np.ones(1000)}, write_statistics=False)
    write_parquet(tmp_path / "d" / "b.parquet", t, write_statistics=False)
    with pytest.raises(gpuload.NullValuesError, match="'x' has 1 null values .*b.parquet"):
        gpuload.ParquetDataset(tmp_path / "d", ["x"], cache_dir=tmp_path / "c", device="cpu")


@pytest.mark.parametrize("dtype,bad", [("int8", 1000), ("uint16", -1), ("bool", 2), ("int32", 2**40)])
def test_casts_that_cannot_hold_the_values_are_refused_at_open(tmp_path, dtype, bad):
    for f in range(5):
        v = np.arange(100, dtype=np.int64) % 2  # fits every dtype
        if f == 4:
            v[50] = bad
        write_parquet(tmp_path / "d" / f"{f}.parquet", {"x": v})
    with pytest.raises(gpuload.ConfigError, match=rf"'x' holds {bad}.*4.parquet.*statistics"):
        gpuload.ParquetDataset(tmp_path / "d", ["x"], cache_dir=tmp_path / "c", device="cpu", dtypes={"x": dtype})


def test_fill_value_that_the_output_cannot_hold_is_refused_at_open(tmp_path):
    write_parquet(tmp_path / "a.parquet", pa.table({"x": pa.array([1, None, 3], pa.int64())}))
    with pytest.raises(gpuload.ConfigError, match="fill value"):
        gpuload.ParquetDataset(tmp_path / "a.parquet", ["x"], cache_dir=tmp_path / "c", device="cpu",
                               fill_nulls={"x": 300}, dtypes={"x": "int8"})


def test_without_statistics_a_bad_cast_is_still_caught_while_decoding(tmp_path):
    v = np.arange(100, dtype=np.int64)
    v[5] = 1000
    write_parquet(tmp_path / "a.parquet", {"x": v}, write_statistics=False)
    ds = gpuload.ParquetDataset(tmp_path / "a.parquet", ["x"], cache_dir=tmp_path / "c", device="cpu",
                                dtypes={"x": "int8"})
    with pytest.raises(gpuload.ConfigError, match="1000"):
        list(ds)



@pytest.mark.parametrize("statistics", [True, False])
def test_a_stacked_groups_default_float_type_that_would_round_is_refused(tmp_path, statistics, capsys):
    """uint64 stacked with int64 (or int64 with a float): NumPy's common type is float64, which
    rounds integers beyond 2**53. With statistics, opening refuses it, naming the file, the
    column, the value and the output; without, the first epoch does before any batch of it;
    naming the dtype in dtypes= accepts the rounding; the command says it in one line."""
    for f in range(3):
        u = np.arange(10, dtype=np.uint64)
        if f == 2:
            u[4] = 2**63 + 1
        write_parquet(tmp_path / "d" / f"{f}.parquet", {"u": u, "i": np.arange(10, dtype=np.int64) - 5},
                      write_statistics=statistics)
    kw = dict(cache_dir=tmp_path / "c", device="cpu", shuffle=False)
    msg = rf"column 'u' holds {2**63 + 1} in .*2.parquet.*output 'x' \(float64"
    if statistics:
        with pytest.raises(gpuload.ConfigError, match=msg + ".*dtypes="):
            gpuload.ParquetDataset(tmp_path / "d", {"x": ["u", "i"]}, **kw)
    else:
        ds = gpuload.ParquetDataset(tmp_path / "d", {"x": ["u", "i"]}, **kw)
        with pytest.raises(gpuload.ConfigError, match=msg):
            list(ds)
    got = torch.cat([b["x"] for b in gpuload.ParquetDataset(tmp_path / "d", {"x": ["u", "i"]}, dtypes={"x": "float64"},
                                                                **kw)])
    assert got.dtype == torch.float64 and got[24, 0].item() == float(2**63 + 1)
    from gpuload.tools.cli import main

    capsys.readouterr()
    rc = main(["cache", "build", str(tmp_path / "d"), "--columns", '{"x": ["u", "i"]}',
               "--cache-dir", str(tmp_path / "c2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "'u'" in err[0] and "--dtypes" in err[0], err


@pytest.mark.parametrize("values,src,dtype", [([-1, 5], pa.int8(), "uint8"), ([2**63 + 5, 1], pa.uint64(), "int64"),
                                              ([3_000_000_000, 1], pa.uint32(), "int32"), ([-1, 0], pa.int64(), "bool")])
@pytest.mark.parametrize("statistics", [True, False])
def test_same_width_casts_never_wrap_around(tmp_path, values, src, dtype, statistics):
    """-1 as uint8 would be 255: refused (at open from statistics, else while decoding), never served."""
    write_parquet(tmp_path / "a.parquet", pa.table({"x": pa.array(values, src)}), write_statistics=statistics)
    with pytest.raises(gpuload.ConfigError, match=f"holds {values[0]}"):
        ds = gpuload.ParquetDataset(tmp_path / "a.parquet", ["x"], cache_dir=tmp_path / "c", device="cpu",
                                    dtypes={"x": dtype})
        list(ds)


@pytest.mark.parametrize("column,dtype,bad", [
    (pa.array([0, 2**40], pa.timestamp("ns")), "int32", 2**40),
    (pa.array([1, 2**33], pa.duration("s")), "int32", 2**33),
    (pa.array(np.array([1.0, 1.5], np.float16)), "int8", 1.5),
    (pa.array([0, 40_000], pa.date32()), "int8", 40_000),
])
def test_temporal_and_float16_casts_are_checked_at_open(tmp_path, column, dtype, bad):
    write_parquet(tmp_path / "a.parquet", pa.table({"x": column}))
    with pytest.raises(gpuload.ConfigError, match=f"holds {bad}.*statistics"):
        gpuload.ParquetDataset(tmp_path / "a.parquet", ["x"], cache_dir=tmp_path / "c", device="cpu",
                               dtypes={"x": dtype})


def test_fitting_temporal_casts_are_not_refused(tmp_path):
    """No false refusals: statistics in another unit than the values would be (seconds
    stored as milliseconds) or of dictionary columns."""
    t = pa.table({"s": pa.array([0, 100], pa.timestamp("s")), "d": pa.array([1, 2]).dictionary_encode(),
                  "t": pa.array([1, 50], pa.time32("s"))})
    write_parquet(tmp_path / "a.parquet", t)
    ds = gpuload.ParquetDataset(tmp_path / "a.parquet", ["s", "d", "t"], cache_dir=tmp_path / "c", device="cpu",
                                shuffle=False, dtypes={"s": "int32", "d": "int8", "t": "int32"})
    (b,) = list(ds)
    assert b["s"].tolist() == [0, 100_000] and b["d"].tolist() == [1, 2] and b["t"].tolist() == [1000, 50_000]


def _five_null_columns(root):
    """Five columns with nulls, found in five different ways: statistics of a scalar column,
    a file without statistics, a list column (read once), a column in a group, a fixed-size
    list; and a clean column."""
    n = 200
    ok = np.arange(n, dtype=np.int64)
    with_null = pa.array([None] + list(range(1, n)), pa.int64())
    write_parquet(root / "a.parquet", pa.table({
        "id": ok, "s": with_null, "g1": ok, "g2": ok, "h": _lists(n), "fx": pa.array([[1, 2]] * n, pa.list_(pa.int8(), 2)),
        "ns": ok}), row_group_size=50)
    write_parquet(root / "b.parquet", pa.table({
        "id": ok, "s": ok, "g1": ok, "g2": with_null, "h": _lists(n, null_at=7),
        "fx": pa.array([[1, 2]] * (n - 1) + [None], pa.list_(pa.int8(), 2)), "ns": ok}), row_group_size=50)
    write_parquet(root / "c.parquet", pa.table({
        "id": ok, "s": ok, "g1": ok, "g2": ok, "h": _lists(n), "fx": pa.array([[1, 2]] * n, pa.list_(pa.int8(), 2)),
        "ns": with_null}), row_group_size=50, write_statistics=False)
    return {"id": "id", "s": "s", "g": ["g1", "g2"], "h": "h", "fx": "fx", "ns": "ns"}


def test_every_column_with_nulls_is_reported_at_once(tmp_path):
    """Five columns with nulls and no fill value: one error names them all, with the
    fill_nulls that covers every one; passing it opens the dataset."""
    columns = _five_null_columns(tmp_path / "d")
    with pytest.raises(gpuload.NullValuesError) as info:
        gpuload.ParquetDataset(tmp_path / "d", columns, cache_dir=tmp_path / "c", device="cpu")
    msg = str(info.value)
    fix = {"s": 0, "g2": 0, "h": 0, "fx": 0, "ns": 0}
    assert f"fill_nulls={fix!r}" in msg and msg.count("fill_nulls=") == 1
    for column, where in (("s", "a.parquet"), ("g2", "b.parquet"), ("h", "b.parquet"), ("fx", "b.parquet"),
                          ("ns", "c.parquet")):
        assert f"'{column}'" in msg and where in msg
    assert "'id'" not in msg and "'g1'" not in msg and "5 columns" in msg
    assert info.value.columns == {"s": 1, "g2": 1, "h": 1, "fx": 1, "ns": 1}
    ds = gpuload.ParquetDataset(tmp_path / "d", columns, cache_dir=tmp_path / "c", device="cpu", fill_nulls=fix)
    if not ARROW_READS_NULL_FIXED_LISTS:  # the footers told the nulls, but pyarrow < 26 cannot read 'fx'
        with pytest.raises(gpuload.SourceError, match=r"b.parquet.*column 'fx' cannot be read: pyarrow .*"
                                                      r"pip install 'pyarrow>=26'"):
            list(ds)
        return
    assert sum(len(b["id"]) for b in ds) == 600


def test_conversion_reports_every_column_with_nulls_of_its_chunk():
    """Where nulls are found only while converting (remote files without statistics), the
    error names every column of the chunk that holds nulls, with one fill_nulls for all."""
    from gpuload.convert import table_to_columns
    from gpuload.schema import resolve_outputs

    t = pa.table({"a": pa.array([1, None, 3]), "b": pa.array([1.0, 2.0, 3.0]), "c": pa.array([None, None, 1.0]),
                  "l": pa.array([[1], None, [2, None]], pa.list_(pa.int64()))})
    specs = resolve_outputs(t.schema, None, None, None, file="x")
    with pytest.raises(gpuload.NullValuesError) as info:
        table_to_columns(t, specs, "s3://b/x.parquet, row groups 0-0")
    msg = str(info.value)
    assert "fill_nulls={'a': 0, 'c': 0, 'l': 0}" in msg and msg.count("fill_nulls=") == 1
    assert "'a' has 1 null values" in msg and "'c' has 2 null values" in msg and "'l' has 2 null lists" in msg
    assert "s3://b/x.parquet, row groups 0-0" in msg and "'b'" not in msg
    assert info.value.columns == {"a": 1, "c": 2, "l": 2}


def test_a_large_footer_over_little_data_is_not_walked(tmp_path, monkeypatch):
    """Walking a footer in Python costs about 200 times a data byte: a file whose footer is
    large (many columns and row groups) and whose list data is small has its list column read
    instead, and still finds the null."""
    n = 40 * 50
    cols = {f"f{i}": np.zeros(n, np.float32) for i in range(300)}
    cols["h"] = pa.array([[1]] * (n - 1) + [None], pa.list_(pa.int64()))
    write_parquet(tmp_path / "d" / "wide.parquet", pa.table(cols), row_group_size=50)
    assert pq.ParquetFile(tmp_path / "d" / "wide.parquet").metadata.serialized_size > checks._WALK_FREE
    scans = _count_scans(monkeypatch)
    with pytest.raises(gpuload.NullValuesError, match="'h' has 1 null"):
        gpuload.ParquetDataset(tmp_path / "d", ["h"], cache_dir=tmp_path / "c", device="cpu")
    assert [c for _, c, _ in scans] and all(c == "h" for _, c, _ in scans)


# ---------------------------------------------------------------------------------------
# schema drift: files of one source whose types differ
# ---------------------------------------------------------------------------------------

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
    (pa.dictionary(pa.int8(), pa.int32()), pa.int64(), pa.int64()), (pa.timestamp("ms"), pa.timestamp("us"), None),
    (pa.null(), pa.float32(), pa.float32()), (pa.null(), pa.string(), pa.string()), (pa.null(), pa.null(), pa.null()),
    (pa.list_(pa.null()), pa.large_list(pa.int16()), pa.large_list(pa.int16())),
])
def test_wider_holds_both_types_exactly_or_is_none(a, b, want):
    assert checks.wider(a, b) == want and checks.wider(b, a) == want


@pytest.mark.parametrize("types, want", [
    ((pa.int32(), pa.uint32(), pa.float32()), pa.float64()),  # pairwise, int32 and uint32 first, it was refused
    ((pa.int16(), pa.uint16(), pa.float32()), pa.float32()),
    ((pa.int32(), pa.float64(), pa.int64()), None),
    ((pa.int8(), pa.uint16(), pa.int16()), pa.int32()),
])
def test_wider_is_one_type_for_all_whatever_their_order(types, want):
    import itertools

    assert {checks.wider(*p) for p in itertools.permutations(types)} == {want}


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
