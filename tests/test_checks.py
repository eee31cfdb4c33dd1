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


@pytest.mark.parametrize("column,dtype,bad", [
    (pa.array([1, -(2**62)], pa.int64()), "float16", -(2**62)),
    (pa.array([1, 70_000], pa.int32()), "float16", 70_000),
    (pa.array([1.0, 1e300]), "float32", r"1e\+300"),
    (pa.array(np.array([1.0, -1e38], np.float32)), "float16", "-1e\\+38|-9.99"),
])
@pytest.mark.parametrize("statistics", [True, False])
def test_a_cast_that_would_make_a_value_an_infinity_is_refused(tmp_path, column, dtype, bad, statistics):
    """A float cast may round, but a finite value beyond the float's range would become +-inf,
    silently: refused at open where the statistics show it, else while decoding, naming the value;
    values in range, NaNs and infinities the column holds itself are cast as they are."""
    write_parquet(tmp_path / "a.parquet", pa.table({"x": column}), write_statistics=statistics)
    with pytest.raises(gpuload.ConfigError, match=rf"'x' holds ({bad}).* beyond the range of {dtype}.*infinity.*dtypes="):
        ds = gpuload.ParquetDataset(tmp_path / "a.parquet", ["x"], cache_dir=tmp_path / "c", device="cpu",
                                    dtypes={"x": dtype})
        assert not statistics  # with statistics, the open refuses it
        list(ds)
    ok = pa.array([1.5, float("inf"), float("nan"), -65504.0])
    write_parquet(tmp_path / "b.parquet", pa.table({"x": ok}), write_statistics=statistics)
    got = torch.cat([b["x"] for b in gpuload.ParquetDataset(tmp_path / "b.parquet", ["x"], cache_dir=tmp_path / "c",
                                                            device="cpu", shuffle=False, dtypes={"x": "float16"})])
    assert got.dtype == torch.float16 and got[0] == 1.5 and got[1] == float("inf") and got[2].isnan()
    assert got[3] == -65504.0


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
