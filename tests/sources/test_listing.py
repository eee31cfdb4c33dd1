"""Sources: what a dataset accepts as ``source``, and what it finds in the files' footers
and folders: awkward column names, pandas index columns, Hive partition folders, files
whose columns differ, and footers that cannot be right."""

from __future__ import annotations

import io
import logging
import struct

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

import gpuload

from conftest import dataset_factory, write_parquet


_ds = dataset_factory(batch_size=50, shuffle=False)


def _all(ds) -> dict:
    out: dict = {}
    for b in ds:
        for k, v in b.items():
            if isinstance(v, gpuload.Ragged):
                out.setdefault(k + ".values", []).append(v.values.numpy())
            else:
                out.setdefault(k, []).append(v.numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------

NAMES = ["user.age", "a/b", "x[0]", "with space", "ünï©ødé", "a.b", "..", "col,comma", "'quoted\"", ""]


def test_any_column_name_works_and_a_dotted_name_is_not_a_struct_path(tmp_path):
    n = 200
    cols = {name: pa.array(np.arange(n, dtype=np.int64) * (i + 2)) for i, name in enumerate(NAMES)}
    cols["a"] = pa.array([{"b": i} for i in range(n)])  # a struct a with a child b, beside a column "a.b"
    cols["list.col"] = pa.array([[i, i] for i in range(n)], pa.list_(pa.int32()))
    p = write_parquet(tmp_path / "names.parquet", pa.table(cols), row_group_size=64)
    for columns in ([*NAMES, "list.col"], {f"out {i}": name for i, name in enumerate(NAMES)},
                    {"stacked": ["user.age", "a.b", "with space"]}):
        ds = _ds(p, tmp_path / "cache", columns, dtypes=None)
        got = _all(ds)
        if isinstance(columns, list):
            for i, name in enumerate(NAMES):
                np.testing.assert_array_equal(got[name], np.arange(n) * (i + 2), err_msg=name)
            np.testing.assert_array_equal(got["list.col.values"], np.repeat(np.arange(n), 2))
        elif "stacked" in columns:
            want = np.stack([np.arange(n) * (NAMES.index(c) + 2) for c in columns["stacked"]], 1)
            np.testing.assert_array_equal(got["stacked"], want)
        else:
            for i, name in enumerate(NAMES):
                np.testing.assert_array_equal(got[f"out {i}"], np.arange(n) * (i + 2))
    # columns=None: every supported column (the struct is skipped), names intact
    got = _all(_ds(p, tmp_path / "cache", None))
    assert set(NAMES) <= set(got) and "a" not in got


def test_dotted_name_with_nulls_found_at_open(tmp_path):
    t = pa.table({"user.age": pa.array([1, None, 3] * 50), "user": pa.array([{"age": 1}] * 150)})
    p = write_parquet(tmp_path / "n.parquet", t)
    with pytest.raises(gpuload.NullValuesError, match="'user.age' has 50 null"):
        _ds(p, tmp_path / "cache", ["user.age"])
    got = _all(_ds(p, tmp_path / "cache", ["user.age"], fill_nulls={"user.age": -1}))
    assert (got["user.age"] == -1).sum() == 50


# ---------------------------------------------------------------------------------------
# sources that are not paths
# ---------------------------------------------------------------------------------------

def _not_paths(tmp_path):
    p = write_parquet(tmp_path / "ok.parquet", {"x": np.arange(10)})
    import fsspec

    return {
        "None": (None, "source is None"),
        "bytes": (p.read_bytes(), "bytes"),
        "bytearray": (bytearray(b"PAR1"), "bytearray"),
        "table": (pa.table({"x": [1]}), "pyarrow Table"),
        "dataframe": (pd.DataFrame({"x": [1]}), "pandas DataFrame"),
        "open file": (open(p, "rb"), "open file"),
        "BytesIO": (io.BytesIO(p.read_bytes()), "open file"),
        "fsspec": (fsspec.filesystem("file"), "filesystem object"),
        "arrow fs": (pa.fs.LocalFileSystem(), "filesystem object"),
        "int": (3, "int"),
        "dict": ({"path": str(p)}, "dict"),
        "list with None": ([str(p), None], "source is None"),
        "generator": ((x for x in [str(p)]), "generator"),
    }


@pytest.mark.parametrize("kind", ["None", "bytes", "bytearray", "table", "dataframe", "open file", "BytesIO",
                                  "fsspec", "arrow fs", "int", "dict", "list with None", "generator"])
def test_sources_that_are_not_paths_are_refused_clearly(tmp_path, kind):
    source, needle = _not_paths(tmp_path)[kind]
    with pytest.raises(gpuload.SourceError, match=needle):
        _ds(source, tmp_path / "cache")


# ---------------------------------------------------------------------------------------
# columns that differ between files
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra_first", [True, False])
def test_columns_none_takes_the_columns_every_file_has_in_either_order(tmp_path, extra_first, caplog):
    a = {"x": np.arange(100), "y": np.arange(100) * 2.0}
    b = {"x": np.arange(100, 200), "y": np.arange(100, 200) * 2.0, "extra": np.ones(100)}
    write_parquet(tmp_path / "d" / "1.parquet", b if extra_first else a)
    write_parquet(tmp_path / "d" / "2.parquet", a if extra_first else b)
    caplog.set_level(logging.WARNING, logger="gpuload")
    ds = _ds(tmp_path / "d", tmp_path / "cache")
    assert ds.outputs == ["x", "y"]
    got = _all(ds)
    assert sorted(got["x"]) == list(range(200))
    assert any("extra" in r.getMessage() and "not in every file" in r.getMessage() for r in caplog.records)
    with pytest.raises(gpuload.NullValuesError, match="'extra' .*1 file lacks the column"):  # asked for by name:
        _ds(tmp_path / "d", tmp_path / "cache", ["x", "extra"])  # nulls where it is missing, in either order
    ds = gpuload.ParquetDataset(tmp_path / "d", ["x", "extra"], fill_nulls=0.0, cache_dir=tmp_path / "cache",
                                device="cpu")
    got = _all(ds)
    assert sorted(zip(got["x"], got["extra"])) == [(x, float(x >= 100)) for x in range(200)]


@pytest.mark.parametrize("first", [0, 1])
def test_a_column_typed_differently_is_refused_in_either_order(tmp_path, first):
    files = [{"x": np.arange(10, dtype=np.int64)}, {"x": np.arange(10, dtype=np.float64)}]
    write_parquet(tmp_path / "d" / "1.parquet", files[first])
    write_parquet(tmp_path / "d" / "2.parquet", files[1 - first])
    with pytest.raises(gpuload.SchemaError, match="'x' is"):
        _ds(tmp_path / "d", tmp_path / "cache")


# ---------------------------------------------------------------------------------------
# pandas index columns
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", ["unnamed", "named", "multi", "range"])
def test_pandas_index_is_not_a_feature_unless_asked_for(tmp_path, index):
    df = pd.DataFrame({"x": np.arange(100), "y": np.arange(100) * 2})
    if index == "unnamed":
        df.index = np.arange(100) * 7
    elif index == "named":
        df.index = pd.Index(np.arange(100) * 7, name="row")
    elif index == "multi":
        df.index = pd.MultiIndex.from_arrays([np.arange(100), np.arange(100) % 3], names=["i", "j"])
    df.to_parquet(tmp_path / "df.parquet")
    ds = _ds(tmp_path / "df.parquet", tmp_path / "cache")
    assert ds.outputs == ["x", "y"]
    stored = [n for n in pq.read_schema(tmp_path / "df.parquet").names if n not in ("x", "y")]
    if stored:  # asked for by name, it is loaded
        got = _all(_ds(tmp_path / "df.parquet", tmp_path / "cache", stored[:1]))
        assert len(got[stored[0]]) == 100


# ---------------------------------------------------------------------------------------
# Hive partitions
# ---------------------------------------------------------------------------------------

def _hive(root, days=(1, 2, 3), rows=40):
    for d in days:
        for part in (0, 1):
            write_parquet(root / f"day={d}" / "region=eu" / f"part-{part}.parquet",
                          {"x": np.arange(rows) + 1000 * d + 100 * part})
    return root


def test_hive_partition_keys_are_columns_typed_as_pyarrow_types_them(tmp_path):
    root = _hive(tmp_path / "h")
    want = pq.read_table(root).to_pandas()  # pyarrow's own reading of the folders
    ds = _ds(root, tmp_path / "cache", ["x", "day"])
    got = _all(ds)
    assert got["day"].dtype == np.dtype(pa.int32().to_pandas_dtype())  # as pyarrow types it
    assert sorted(zip(got["x"], got["day"])) == sorted(zip(want["x"], want["day"].astype(int)))
    # the default picks up every key; a string key becomes categorical ids, as a string column does
    assert _ds(root, tmp_path / "cache").outputs == ["x", "day", "region"]
    region = _all(_ds(root, tmp_path / "cache", ["x", "region"], categorical={"region": gpuload.Hash(1000)}))["region"]
    assert set(region.tolist()) == {1 + xxhash.xxh64_intdigest(b"eu") % 1000}
    # cached like any other column: a second dataset decodes nothing
    again = _ds(root, tmp_path / "cache", ["x", "day"])
    assert sorted(_all(again)["day"]) == sorted(got["day"]) and again.reader.counters.decoded == 0
    # stacked with a file column, and cast
    g = _all(_ds(root, tmp_path / "cache", {"xd": ["x", "day"]}, dtypes={"xd": "float32"}))
    assert g["xd"].dtype == np.float32 and sorted(g["xd"][:, 1]) == sorted(got["day"].astype(np.float32))


def test_hive_null_partition_needs_a_fill(tmp_path):
    root = _hive(tmp_path / "h", days=(1,))
    write_parquet(root / "day=__HIVE_DEFAULT_PARTITION__" / "region=eu" / "p.parquet", {"x": np.arange(5)})
    with pytest.raises(gpuload.NullValuesError, match="'day'"):
        _ds(root, tmp_path / "cache", ["x", "day"])
    got = _all(_ds(root, tmp_path / "cache", ["x", "day"], fill_nulls={"day": -1}))
    assert (got["day"] == -1).sum() == 5


@pytest.mark.parametrize("writer", ["polars", "duckdb"])
def test_partition_keys_also_stored_in_the_files_are_read(tmp_path, writer):
    """Polars' partition_by and DuckDB's WRITE_PARTITION_COLUMNS keep the key in each file too."""
    n = 500
    df = pd.DataFrame({"id": np.arange(n, dtype=np.int64), "day": np.arange(n, dtype=np.int64) % 4,
                       "v": np.arange(n) * 0.25})
    root = tmp_path / writer
    if writer == "polars":
        pl = pytest.importorskip("polars")
        pl.from_pandas(df).write_parquet(root, partition_by=["day"])
    else:
        duckdb = pytest.importorskip("duckdb")
        duckdb.sql(f"COPY (SELECT * FROM df) TO '{root}' (FORMAT PARQUET, PARTITION_BY (day), "
                   "WRITE_PARTITION_COLUMNS true)")
    assert "day" in pq.read_schema(next(root.rglob("*.parquet"))).names
    want = pq.read_table(next(root.rglob("*.parquet"))).schema.field("day").type
    ds = _ds(root, tmp_path / "cache", ["id", "day", "v"])
    got = _all(ds)
    order = np.argsort(got["id"])
    np.testing.assert_array_equal(got["id"][order], df["id"])
    np.testing.assert_array_equal(got["day"][order], df["day"])  # the file's values, in the file's type
    np.testing.assert_array_equal(got["v"][order], df["v"])
    assert got["day"].dtype == np.dtype(want.to_pandas_dtype())
    assert _ds(root, tmp_path / "cache").outputs == ["id", "day", "v"]  # columns=None: the key once


@pytest.mark.parametrize("stats", [True, False])
def test_a_stored_key_that_disagrees_with_its_folder_is_refused_naming_file_and_key(tmp_path, stats):
    write_parquet(tmp_path / "h" / "day=1" / "a.parquet", {"x": np.arange(5), "day": np.full(5, 1)},
                  write_statistics=stats)
    bad = write_parquet(tmp_path / "h" / "day=2" / "b.parquet", {"x": np.arange(5), "day": [2, 2, 3, 2, 2]},
                        write_statistics=stats)
    with pytest.raises(gpuload.SourceError, match=rf"{bad}: column 'day' holds 1 of 5 values other than its "
                                                  r"partition folder's \(day=2\)"):
        _ds(tmp_path / "h", tmp_path / "cache", ["x", "day"])
    assert sorted(_all(_ds(tmp_path / "h", tmp_path / "cache", ["x"]))["x"]) == sorted([*range(5)] * 2)  # key not loaded


@pytest.mark.parametrize("stats", [True, False])
@pytest.mark.parametrize("day", [1, 2, 3])
def test_a_stored_key_that_disagrees_is_refused_where_only_a_filter_reads_it(tmp_path, stats, day):
    """Filtered on and not loaded, the key is still the folder's: a file that stores another value is
    refused, whichever rows the filter asks for (day=3: rows the folder says are not there; day=1:
    rows the file's statistics rule out), not filtered by the file's values."""
    write_parquet(tmp_path / "h" / "day=1" / "a.parquet", {"x": np.arange(5), "day": np.full(5, 1)},
                  write_statistics=stats)
    bad = write_parquet(tmp_path / "h" / "day=2" / "b.parquet", {"x": np.arange(5, 10), "day": [2, 2, 3, 2, 2]},
                        write_statistics=stats)
    with pytest.raises(gpuload.SourceError, match=rf"{bad}: column 'day' holds 1 of 5 values other than its "
                                                  r"partition folder's \(day=2\)"):
        _all(_ds(tmp_path / "h", tmp_path / "cache", ["x"], filters=[("day", "==", day)]))


def test_counts_and_chunks_of_the_file_alone_are_not_those_of_its_folder(tmp_path):
    """The same file given alone (its column is only the file's) and under its Hive folder (it must
    hold the folder's value): a review found the first's kept counts and chunks served to the second,
    unchecked. Keys stored as text compare as the folder's text (zip=01234 holds "01234")."""
    a = write_parquet(tmp_path / "h" / "day=1" / "a.parquet", {"x": np.arange(5), "day": np.full(5, 1)})
    b = write_parquet(tmp_path / "h" / "day=2" / "b.parquet", {"x": np.arange(5, 10), "day": [2, 2, 3, 2, 2]})
    alone = _ds([a, b], tmp_path / "cache", ["x"], filters=[("day", "==", 1)])
    assert sorted(_all(alone)["x"]) == [*range(5)]  # the files' values: no folder to hold
    with pytest.raises(gpuload.SourceError, match=rf"{b}: column 'day' holds 1 of 5 values other than"):
        _all(_ds(tmp_path / "h", tmp_path / "cache", ["x"], filters=[("day", "==", 1)]))
    for i, zip_code in enumerate(["01234", "01234", "98765"]):
        write_parquet(tmp_path / "z" / f"zip={zip_code}" / f"{i}.parquet", {"x": [i], "zip": [zip_code]})
    for columns in (["x"], ["x", "zip"]):
        got = _all(_ds(tmp_path / "z", tmp_path / "cache", columns, filters=[("zip", "==", "01234")]))["x"]
        assert sorted(got) == [0, 1]


@pytest.mark.parametrize("stats", [True, False])
def test_a_stored_key_that_agrees_filters_as_its_folder_says(tmp_path, stats):
    for day in (1, 2):
        write_parquet(tmp_path / "h" / f"day={day}" / "a.parquet", {"x": np.arange(5) + 10 * day,
                                                                    "day": np.full(5, day)}, write_statistics=stats)
    for day in (1, 2):
        got = _all(_ds(tmp_path / "h", tmp_path / "cache", ["x"], filters=[("day", "==", day)]))["x"]
        assert sorted(got) == [*range(10 * day, 10 * day + 5)]
    with pytest.raises(gpuload.SourceError, match="keeps no row of the 2 files"):
        _ds(tmp_path / "h", tmp_path / "cache", ["x"], filters=[("day", "==", 3)])


def test_a_stored_key_that_disagrees_is_refused_when_a_remote_chunk_is_decoded(tmp_path):
    pytest.importorskip("moto", reason="the S3 server needs moto")
    from gpuload.testing import S3Server

    write_parquet(tmp_path / "h" / "day=1" / "a.parquet", {"x": np.arange(5), "day": [1, 1, 1, 1, 7]},
                  write_statistics=False)
    with S3Server() as s3:
        s3.upload_folder(tmp_path / "h", "bkt")
        ds = gpuload.ParquetDataset("s3://bkt/", ["x", "day"], cache_dir=tmp_path / "c", device="cpu", batch_size=5,
                                    storage_options=s3.storage_options)
        with pytest.raises(gpuload.SourceError, match="column 'day' holds 1 of 5 values other than"):
            list(ds)
    assert not list((tmp_path / "c").rglob("*.glc"))  # nothing cached


# ---------------------------------------------------------------------------------------
# footers that cannot be right
# ---------------------------------------------------------------------------------------

def _patch_footer_rows(path, rows: int) -> None:
    """Rewrite a Parquet file's footer so that it declares ``rows`` rows (num_rows of the
    file and of its single row group), as a corrupt or hostile writer would."""
    raw = bytearray(path.read_bytes())
    flen = struct.unpack("<I", raw[-8:-4])[0]
    footer = bytes(raw[-8 - flen:-8])
    meta = pq.read_metadata(path)
    old = meta.num_rows
    # thrift compact: the row counts are zigzag varints; replace every varint encoding `old`
    def varint(v):
        v = (v << 1) ^ (v >> 63)
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)
    new_footer = footer.replace(varint(old), varint(rows))
    assert new_footer != footer
    raw[-8 - flen:] = new_footer + struct.pack("<I", len(new_footer)) + b"PAR1"
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("rows", [10**15, 2**62])
def test_absurd_row_counts_are_refused_at_open(tmp_path, rows):
    p = write_parquet(tmp_path / "x.parquet", {"x": np.arange(1000, dtype=np.int64)})
    _patch_footer_rows(p, rows)
    assert pq.read_metadata(p).num_rows == rows
    with pytest.raises(gpuload.SourceError, match="cannot be right"):
        _ds(p, tmp_path / "cache")


def test_a_name_with_glob_characters_is_that_file(tmp_path):
    write_parquet(tmp_path / "d" / "data[1].parquet", {"x": np.arange(10)})
    write_parquet(tmp_path / "d" / "data1.parquet", {"x": np.arange(100, 110)})  # what the glob would match
    got = _all(_ds(tmp_path / "d" / "data[1].parquet", tmp_path / "cache"))
    assert got["x"].tolist() == list(range(10))
    assert sorted(_all(_ds(str(tmp_path / "d" / "data?.parquet"), tmp_path / "cache"))["x"]) == list(range(100, 110))


def test_a_file_named_twice_is_read_once_and_the_log_says_so(tmp_path, caplog):
    """A list that repeats a file (an attempt to oversample it), or a folder and a file in it:
    each file's rows come once, and one warning names it and points to a Mix's weights."""
    write_parquet(tmp_path / "d" / "a.parquet", {"x": np.arange(10)})
    write_parquet(tmp_path / "d" / "b.parquet", {"x": np.arange(10, 20)})
    a = tmp_path / "d" / "a.parquet"
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        got = _all(_ds([a, str(a), tmp_path / "d"], tmp_path / "cache"))
    assert sorted(got["x"]) == list(range(20))
    said = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
    assert len(said) == 1 and "1 file(s)" in said[0] and str(a) in said[0] and "Mix" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        _all(_ds([a, tmp_path / "d" / "b.parquet"], tmp_path / "cache"))
    assert not [r for r in caplog.records if "more than once" in r.getMessage()]


def test_linked_files_in_a_folder_and_in_hive_folders(tmp_path):
    """Folders of links (DVC, git-annex, Hugging Face caches) work; keys come from the listed names."""
    store = tmp_path / "store"
    for d in (1, 2):
        write_parquet(store / f"blob{d}.parquet", {"x": np.arange(10) + 10 * d})
        (tmp_path / "flat").mkdir(exist_ok=True)
        (tmp_path / "flat" / f"f{d}.parquet").symlink_to(store / f"blob{d}.parquet")
        (tmp_path / "hive" / f"day={d}").mkdir(parents=True)
        (tmp_path / "hive" / f"day={d}" / "p.parquet").symlink_to(store / f"blob{d}.parquet")
    assert sorted(_all(_ds(tmp_path / "flat", tmp_path / "cache"))["x"]) == list(range(10, 30))
    got = _all(_ds(tmp_path / "hive", tmp_path / "cache", ["x", "day"]))
    assert sorted(zip(got["x"], got["day"])) == [(x, x // 10) for x in range(10, 30)]


def test_duplicate_column_names_are_refused_by_name_and_skipped_by_default(tmp_path, caplog):
    t = pa.Table.from_arrays([pa.array(np.arange(5)), pa.array(np.arange(5)), pa.array(np.ones(5))],
                             names=["d", "d", "y"])
    p = write_parquet(tmp_path / "dup.parquet", t)
    with pytest.raises(gpuload.SchemaError, match="more than one column named 'd'"):
        _ds(p, tmp_path / "cache", ["d"])
    caplog.set_level(logging.WARNING, logger="gpuload")
    assert _ds(p, tmp_path / "cache").outputs == ["y"]
    assert any("more than once" in r.getMessage() for r in caplog.records)


def test_extension_typed_columns_do_not_break_other_names(tmp_path):
    class Pair(pa.ExtensionType):
        def __init__(self):
            super().__init__(pa.struct([("k", pa.int32()), ("v", pa.int32())]), "test.pair")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            return cls()

    pa.register_extension_type(Pair())
    try:
        storage = pa.array([{"k": 1, "v": 2}] * 5, Pair().storage_type)
        t = pa.table({"pair": pa.ExtensionArray.from_storage(Pair(), storage), "k.v": np.arange(5),
                      "z": np.arange(5) * 2})
        p = write_parquet(tmp_path / "ext.parquet", t)
        got = _all(_ds(p, tmp_path / "cache", ["k.v", "z"]))
        assert got["k.v"].tolist() == list(range(5)) and got["z"].tolist() == [0, 2, 4, 6, 8]
    finally:
        pa.unregister_extension_type("test.pair")


def test_legitimate_files_with_many_rows_per_byte_are_accepted(tmp_path):
    """Constant and all-null columns compress to almost nothing; they are real data."""
    n = 50_000_000
    t = pa.table({"c": pa.repeat(pa.scalar(7, pa.int8()), n)})
    p = tmp_path / "dense.parquet"
    pq.write_table(t, p, row_group_size=n, data_page_size=1 << 30, max_rows_per_page=n)
    assert n / p.stat().st_size > 1 << 16  # more rows per byte than an earlier, too tight bound allowed
    ds = _ds(p, tmp_path / "cache", ["c"], batch_size=n)
    assert ds.num_rows == n


# ---------------------------------------------------------------------------------------
# what a folder holds besides its data
# ---------------------------------------------------------------------------------------

_HIDDEN = ["_temporary/0/_temporary/attempt_1/day=1/part-9.parquet", ".spark-staging-42/day=1/part-8.parquet",
           ".snapshot/hourly/day=1/part-0.parquet", "day=1/.part-0.parquet.crc.parquet", "day=1/_SUCCESS.parquet",
           "_committed_7/day=1/part-3.parquet"]


def _with_hidden(root):
    write_parquet(root / "day=1" / "part-0.parquet", {"x": np.arange(10, dtype=np.int64)})
    write_parquet(root / "_key=3" / "part-1.parquet", {"x": np.arange(10, 15, dtype=np.int64)})  # Spark keeps it
    for i, rel in enumerate(_HIDDEN):  # each would add rows (or fail to parse) if it were read
        write_parquet(root / rel, {"x": np.full(7, 100 + i, dtype=np.int64)})
    return root


@pytest.mark.parametrize("how", ["folder", "glob", "s3 prefix", "s3 glob"])
def test_hidden_paths_are_left_out_by_every_listing(tmp_path, how):
    root = _with_hidden(tmp_path / "t")
    if how.startswith("s3"):
        pytest.importorskip("moto", reason="the S3 server needs moto")
        from gpuload.testing import S3Server

        with S3Server() as s3:
            s3.upload_folder(root, "bucket")
            src = "s3://bucket/" if how == "s3 prefix" else "s3://bucket/**/*.parquet"
            ds = gpuload.ParquetDataset(src, ["x"], cache_dir=tmp_path / "c", device="cpu", shuffle=False,
                                        batch_size=50, storage_options=s3.storage_options)
            got = sorted(_all(ds)["x"])
    else:
        got = sorted(_all(_ds(root if how == "folder" else str(root / "**" / "*.parquet"), tmp_path / "cache", ["x"]))["x"])
    assert got == list(range(15))


def test_a_row_group_whose_columns_hold_another_count_of_values_is_refused_at_open(tmp_path):
    """Row groups of 150 and 100 rows whose footer says 140 and 110 (the file's total stays 250):
    the column chunks still hold 150 and 100 values."""
    p = write_parquet(tmp_path / "x.parquet", {"x": np.arange(250, dtype=np.int64)}, row_group_size=150)
    meta = pq.read_metadata(p)
    assert [meta.row_group(g).num_rows for g in range(2)] == [150, 100]
    raw = bytearray(p.read_bytes())
    flen = struct.unpack("<I", raw[-8:-4])[0]
    footer = bytes(raw[-8 - flen:-8])

    def i64(field_delta_byte, v):  # a thrift compact i64 field: header byte, zigzag varint
        v = v << 1
        out = bytearray([field_delta_byte])
        while True:
            out.append((v & 0x7F) | (0x80 if v >> 7 else 0))
            v >>= 7
            if not v:
                return bytes(out)

    for old, new in ((150, 140), (100, 110)):  # the 2nd occurrence: RowGroup.num_rows (the 1st: num_values)
        pat = i64(0x16, old)
        first = footer.index(pat)
        second = footer.index(pat, first + 1)
        footer = footer[:second] + i64(0x16, new) + footer[second + len(pat):]
    raw[-8 - flen:-8] = footer
    p.write_bytes(bytes(raw))
    meta = pq.read_metadata(p)
    assert [meta.row_group(g).num_rows for g in range(2)] == [140, 110] and meta.num_rows == 250
    with pytest.raises(gpuload.SourceError, match=rf"{p}: row group 0 declares 140 rows, but its column 'x' holds 150"):
        _ds(p, tmp_path / "cache", ["x"])
