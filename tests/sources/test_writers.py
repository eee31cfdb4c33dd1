"""Parquet as the tools users have write it: Spark, DuckDB, Polars, fastparquet, pandas and
Delta Lake. Each writes one table (every type gpuload loads, nulls, empty lists, sentinel
dates, a partition key); gpuload's batches must hold exactly what pyarrow reads from the
same files (INT96 in microseconds, as Spark means them), every row once.

Spark needs a Java runtime: without one its tests are skipped, saying so (``.ci/run``
installs Debian's when it is missing).
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

import gpuload
import torch
import xxhash

N = 3000
COLUMNS = {"id": "id", "i8": "i8", "i16": "i16", "i32": "i32", "f32": "f32", "f64": "f64", "flag": "flag",
           "day": "day", "ts": "ts", "hist": "hist", "part": "part"}
FILL = {"i32": -1, "hist": 0}
SENTINELS = [dt.datetime(1, 1, 1), dt.datetime(9999, 12, 31, 23, 59, 59, 999999)]


def _frame(sentinels: bool) -> pd.DataFrame:
    """The table every writer writes (``sentinels``: timestamps outside what nanoseconds hold,
    for the writers that keep microseconds)."""
    rng = np.random.default_rng(7)
    base = dt.datetime(2024, 1, 1)
    ts = [base + dt.timedelta(microseconds=int(u)) for u in rng.integers(-10**15, 10**15, N)]
    if sentinels:
        ts[:2] = SENTINELS
    i32 = pd.array(rng.integers(-2**31, 2**31 - 1, N), dtype="Int32")
    i32[::17] = pd.NA
    return pd.DataFrame({
        "id": np.arange(N, dtype=np.int64),
        "i8": rng.integers(-128, 128, N).astype(np.int8),
        "i16": rng.integers(-2**15, 2**15, N).astype(np.int16),
        "i32": i32,
        "f32": rng.random(N).astype(np.float32),
        "f64": rng.standard_normal(N),
        "flag": rng.random(N) < 0.3,
        "day": [dt.date(1970, 1, 1) + dt.timedelta(days=int(d)) for d in rng.integers(-30000, 30000, N)],
        "ts": ts,
        "hist": [list(rng.integers(-50, 50, k)) for k in rng.integers(0, 5, N)],
        "part": (np.arange(N) % 3).astype(np.int32),
    })


def _arrow(df: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(df, schema=pa.schema([
        ("id", pa.int64()), ("i8", pa.int8()), ("i16", pa.int16()), ("i32", pa.int32()), ("f32", pa.float32()),
        ("f64", pa.float64()), ("flag", pa.bool_()), ("day", pa.date32()), ("ts", pa.timestamp("us")),
        ("hist", pa.list_(pa.int64())), ("part", pa.int32())]), preserve_index=False)


def _reference(table: pa.Table) -> dict:
    """What gpuload must yield for each output, by row id, from pyarrow's reading alone."""
    out = {}
    ids = table.column("id").to_numpy()
    order = np.argsort(ids)
    for name, col in ((n, table.column(n).combine_chunks()) for n in COLUMNS if n in table.column_names):
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        listed = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        if name in FILL and not listed:
            col = col.fill_null(FILL[name])
        if listed:
            out[name] = [[] if v is None else [0 if x is None else x for x in v] for v in col.to_pylist()]
            out[name] = [out[name][i] for i in order]
            continue
        if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
            col = col.cast(pa.int32() if pa.types.is_date32(col.type) else pa.int64()).cast(pa.int64())
        out[name] = col.to_numpy(zero_copy_only=False)[order]
    return out


def _gpuload(source, tmp_path, columns=COLUMNS, **kw) -> dict:
    ds = gpuload.ParquetDataset(source, columns, fill_nulls={k: v for k, v in FILL.items() if k in columns},
                                batch_size=700, cache_dir=tmp_path / "cache", device="cpu", seed=3, **kw)
    parts: dict = {}
    for epoch in (0, 1):  # decoded, then from the cache: the same rows
        ds.set_epoch(epoch)
        got: dict = {}
        for b in ds:
            for k, v in b.items():
                if isinstance(v, gpuload.Ragged):
                    off = v.offsets.numpy()
                    vals = v.values.numpy()
                    got.setdefault(k, []).extend(vals[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1))
                else:
                    got.setdefault(k, []).append(v.numpy())
        ids = np.concatenate(got["id"])
        assert np.array_equal(np.sort(ids), np.arange(N)), "every row exactly once"
        order = np.argsort(ids)
        out = {k: ([v[i] for i in order] if k == "hist" else np.concatenate(v)[order]) for k, v in got.items()}
        if parts:
            for k in out:
                assert np.array_equal(np.asarray(out[k], dtype=object), np.asarray(parts[k], dtype=object)), k
        parts = out
    return parts


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if k == "hist":
            assert got[k] == want[k], k
        else:
            assert got[k].dtype.kind == np.asarray(want[k]).dtype.kind or k == "flag", (k, got[k].dtype)
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _pyarrow(folder) -> pa.Table:
    """pyarrow's own reading of a folder: hidden files skipped, Hive keys typed, INT96 in microseconds."""
    fmt = pds.ParquetFileFormat(default_fragment_scan_options=None,
                                read_options=pds.ParquetReadOptions(coerce_int96_timestamp_unit="us"))
    return pds.dataset(str(folder), format=fmt, partitioning="hive").to_table()


# ---------------------------------------------------------------------------------------
# the writers
# ---------------------------------------------------------------------------------------

def test_duckdb(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    t = _arrow(_frame(sentinels=True))  # noqa: F841 - read by DuckDB's replacement scan
    folder = tmp_path / "duck"
    duckdb.sql(f"COPY (SELECT * FROM t) TO '{folder}' (FORMAT PARQUET, PARTITION_BY (part), ROW_GROUP_SIZE 700)")
    _same(_gpuload(folder, tmp_path), _reference(_pyarrow(folder)))


def test_duckdb_parquet_v2_delta_encoded_columns_read_as_pyarrow_reads_them(tmp_path):
    """A user's trial: DuckDB's PARQUET_VERSION V2 delta-encodes strings (DELTA_LENGTH_BYTE_ARRAY), which
    pyarrow cannot read as a dictionary, and such files were refused as corrupt. Their ids are those of the
    values, and the delta-packed integers and doubles pyarrow's."""
    duckdb = pytest.importorskip("duckdb")
    path = tmp_path / "v2.parquet"
    duckdb.sql(f"COPY (SELECT i::BIGINT AS id, 'k' || (i * 7919 % 5000)::VARCHAR AS s, (i * 3 - 7000)::INT AS v, "
               f"i / 7.0 AS d FROM range(20000) r(i)) TO '{path}' (FORMAT PARQUET, PARQUET_VERSION V2, "
               f"ROW_GROUP_SIZE 6000)")
    md = pq.ParquetFile(path).metadata
    assert "DELTA_LENGTH_BYTE_ARRAY" in md.row_group(0).column(1).encodings
    ref = pq.read_table(path)
    ds = gpuload.ParquetDataset(path, ["id", "s", "v", "d"], categorical={"s": gpuload.Hash(buckets=100_000)},
                                batch_size=4096, shuffle=False, device="cpu", cache_dir=tmp_path / "c")
    got = {k: torch.cat([b[k] for b in ds]).tolist() for k in ("id", "s", "v", "d")}
    assert got["id"] == ref.column("id").to_pylist()
    assert got["v"] == ref.column("v").to_pylist() and got["d"] == ref.column("d").to_pylist()
    assert got["s"] == [1 + xxhash.xxh64_intdigest(v.encode()) % 100_000 for v in ref.column("s").to_pylist()]


def test_duckdb_enum_columns_give_the_ids_of_their_values(tmp_path):
    """A user's trial: DuckDB writes an ENUM column's unused values as empty strings in its
    dictionary pages, which pyarrow's dictionary reads drop (later indices then run past the
    end), and hashing through them raised an IndexError from deep inside; such columns are read
    as values, and give the ids the same strings written by pyarrow give."""
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    con.sql("CREATE TYPE mood AS ENUM ('a', 'b', 'c', 'd')")
    enum = tmp_path / "enum.parquet"
    con.sql(f"COPY (SELECT i AS id, (CASE WHEN i < 600 OR i % 2 = 0 THEN 'd' ELSE 'b' END)::mood AS m "
            f"FROM range(1000) r(i)) TO '{enum}' (FORMAT PARQUET, ROW_GROUP_SIZE 500)")
    dictionary = pq.ParquetFile(enum, read_dictionary=["m"]).read().column("m")
    from gpuload.decode import _indices_in_range

    assert not _indices_in_range(dictionary), "pyarrow reads these dictionaries now: the fallback is not tested"
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(enum), plain)  # the same values, as pyarrow writes them
    for categorical in (gpuload.Hash(buckets=1000), gpuload.Vocab()):
        ids = []
        for path in (enum, plain):
            ds = gpuload.ParquetDataset(path, ["id", "m"], batch_size=300, shuffle=False, device="cpu",
                                        cache_dir=tmp_path / "c", categorical={"m": categorical})
            ids.append(torch.cat([b["m"] for b in ds]))
        assert torch.equal(ids[0], ids[1]) and len(set(ids[0].tolist())) == 2


def test_polars(tmp_path):
    pl = pytest.importorskip("polars")
    folder = tmp_path / "polars"
    pl.from_arrow(_arrow(_frame(sentinels=True))).write_parquet(folder, partition_by=["part"], row_group_size=700)
    want = _reference(_pyarrow(folder))
    assert pq.read_schema(next(folder.rglob("*.parquet"))).field("part")  # the key is in the files too
    _same(_gpuload(folder, tmp_path), want)


def test_fastparquet(tmp_path):
    """fastparquet writes lists as JSON text (gpuload refuses text), dates as timestamps."""
    pytest.importorskip("fastparquet")
    df = _frame(sentinels=False).drop(columns=["hist"])
    # nanoseconds: fastparquet writes other units' integers into INT96 as if they were nanoseconds
    df["day"] = pd.to_datetime(df["day"]).astype("datetime64[ns]")
    df["ts"] = df["ts"].astype("datetime64[ns]")
    folder = tmp_path / "fp"
    df.to_parquet(folder, engine="fastparquet", partition_cols=["part"], row_group_offsets=700, index=False,
                  times="int96")
    table = _pyarrow(folder)
    assert table.column("ts").cast(pa.int64()).to_pylist() != list(range(N))  # (not garbage)
    np.testing.assert_array_equal(table.sort_by("id").column("ts").cast(pa.int64()).to_numpy(),
                                  df["ts"].astype("datetime64[us]").astype(np.int64).to_numpy())
    assert any(pq.read_metadata(p).schema.column(pq.read_schema(p).get_field_index("ts")).physical_type == "INT96"
               for p in folder.rglob("*.parquet"))
    columns = {k: v for k, v in COLUMNS.items() if k != "hist"}
    _same(_gpuload(folder, tmp_path, columns), _reference(table))


def test_pandas_with_an_index(tmp_path):
    df = _frame(sentinels=False).set_index(pd.Index(np.random.default_rng(1).permutation(N) * 2, name="idx"))
    folder = tmp_path / "pd"
    folder.mkdir()
    for i in range(3):
        df.iloc[i::3].to_parquet(folder / f"part-{i}.parquet", engine="pyarrow", row_group_size=400)
    assert "idx" in pq.read_schema(folder / "part-0.parquet").names
    want = _reference(pq.read_table(folder))
    _same(_gpuload(folder, tmp_path), want)
    ds = gpuload.ParquetDataset(folder, None, fill_nulls=FILL, cache_dir=tmp_path / "c2", device="cpu")
    assert "idx" not in ds.outputs and "id" in ds.outputs  # the index is not a feature unless asked for


def test_delta_lake(tmp_path):
    deltalake = pytest.importorskip("deltalake")
    t = _arrow(_frame(sentinels=True))
    folder = tmp_path / "delta"
    deltalake.write_deltalake(folder, t.slice(0, 1000), partition_by=["part"])
    deltalake.write_deltalake(folder, t, partition_by=["part"], mode="overwrite")  # the first files are removed
    want = _reference(deltalake.DeltaTable(folder).to_pyarrow_table())
    _same(_gpuload(folder, tmp_path), want)


# ---------------------------------------------------------------------------------------
# Spark
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    java = shutil.which("java")
    if java is None:
        pytest.skip("Spark needs a Java runtime, and none is installed (apt-get install default-jre-headless)")
    version = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    if not any(f'version "{v}' in version for v in ("17", "21", "25")):
        pytest.skip(f"pyspark 4 needs Java 17 or newer: {version.splitlines()[0] if version else java}")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("gpuload-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "2").config("spark.driver.memory", "1g")
               .config("spark.sql.parquet.int96RebaseModeInWrite", "CORRECTED")
               .config("spark.sql.parquet.datetimeRebaseModeInWrite", "CORRECTED")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.slow
@pytest.mark.parametrize("timestamps", ["INT96", "TIMESTAMP_MICROS"])
def test_spark(spark, tmp_path, timestamps):
    """Spark's own folder: ``_SUCCESS``, hidden ``.crc`` files, ``part=N`` folders and, by default,
    INT96 timestamps (its sentinel dates too); switching ``outputTimestampType`` changes nothing."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    spark.conf.set("spark.sql.parquet.outputTimestampType", timestamps)
    df = _frame(sentinels=True)
    schema = T.StructType([
        T.StructField("id", T.LongType()), T.StructField("i8", T.ByteType()), T.StructField("i16", T.ShortType()),
        T.StructField("i32", T.IntegerType()), T.StructField("f32", T.FloatType()),
        T.StructField("f64", T.DoubleType()), T.StructField("flag", T.BooleanType()),
        T.StructField("day", T.DateType()), T.StructField("ts", T.TimestampNTZType()),
        T.StructField("hist", T.ArrayType(T.LongType())), T.StructField("part", T.IntegerType())])
    rows = [tuple(r.values()) for r in _arrow(df).to_pylist()]  # Python values: datetimes, dates, lists, None
    sdf = spark.createDataFrame(rows, schema).withColumn("ts", F.col("ts").cast(T.TimestampType()))
    folder = tmp_path / "spark"
    sdf.repartition(3).write.partitionBy("part").option("parquet.block.size", 16 << 10).parquet(str(folder))
    assert (folder / "_SUCCESS").exists() and list(folder.rglob(".*.crc"))
    kinds = {pq.read_metadata(p).schema.column(pq.read_schema(p).get_field_index("ts")).physical_type
             for p in folder.rglob("*.parquet")}
    assert kinds == {"INT96" if timestamps == "INT96" else "INT64"}
    want = _reference(_pyarrow(folder))
    # Spark's own view of its timestamps: microseconds since 1970 UTC, sentinels included
    spark_ts = {r["id"]: r["us"] for r in spark.read.parquet(str(folder)).selectExpr(
        "id", "unix_micros(ts) as us").collect()}
    assert [spark_ts[i] for i in range(N)] == list(want["ts"])
    _same(_gpuload(folder, tmp_path), want)


@pytest.mark.slow
def test_spark_legacy_format_decimals_and_strings(spark, tmp_path):
    """Spark's ``writeLegacyFormat`` (Hive's layout: decimals as fixed-length bytes, lists as
    ``bag``/``array`` groups), with its money and id columns: decimals become float64 by the
    documented rule (or exact unscaled int64), strings and lists of strings categorical ids."""
    import decimal

    import xxhash
    from pyspark.sql import types as T

    rng = np.random.default_rng(11)
    rows = []
    for i in range(N):
        amount = None if i % 13 == 0 else decimal.Decimal(int(rng.integers(-10**9, 10**9))).scaleb(-2)
        big = decimal.Decimal(int(rng.integers(0, 10**18)) * 10**3 + i).scaleb(-4)
        country = None if i % 7 == 0 else ("DE", "FR", "US", "JP")[i % 4]
        tags = None if i % 11 == 0 else [None if (i + j) % 5 == 0 else f"t{(i * j) % 9}" for j in range(i % 4)]
        hist = None if i % 6 == 0 else [int(x) for x in rng.integers(-50, 50, i % 5)]
        rows.append((i, amount, big, country, tags, hist))
    schema = T.StructType([
        T.StructField("id", T.LongType()), T.StructField("amount", T.DecimalType(10, 2)),
        T.StructField("big", T.DecimalType(25, 4)), T.StructField("country", T.StringType()),
        T.StructField("tags", T.ArrayType(T.StringType())), T.StructField("hist", T.ArrayType(T.LongType()))])
    spark.conf.set("spark.sql.parquet.writeLegacyFormat", "true")
    try:
        folder = tmp_path / "legacy"
        spark.createDataFrame(rows, schema).repartition(2).write.parquet(str(folder))
    finally:
        spark.conf.unset("spark.sql.parquet.writeLegacyFormat")
    files = sorted(folder.glob("*.parquet"))
    layout = str(pq.read_metadata(files[0]).schema)
    assert "bag" in layout and "fixed_len_byte_array" in layout  # really the legacy layout
    columns = ["id", "amount", "big", "country", "tags", "hist"]
    ds = gpuload.ParquetDataset(folder, columns, cache_dir=tmp_path / "c", device="cpu", batch_size=N,
                                shuffle=False, fill_nulls={"amount": 0, "hist": 0},
                                categorical={"country": gpuload.Hash(100), "tags": gpuload.Hash(50, seed=1)})
    (b,) = list(ds)
    by_id = {r[0]: r for r in rows}
    order = b["id"].numpy().tolist()
    assert sorted(order) == list(range(N))

    def as_float(d):  # the documented rule: float(unscaled) / 10**scale
        return float(int(d.scaleb(-d.as_tuple().exponent))) / float(10 ** -d.as_tuple().exponent)

    def ids(v, enc):
        return 0 if v is None else 1 + xxhash.xxh64_intdigest(v.encode(), enc.seed) % enc.buckets

    assert b["amount"].numpy().tolist() == [0.0 if by_id[i][1] is None else as_float(by_id[i][1]) for i in order]
    assert b["big"].numpy().tolist() == [as_float(by_id[i][2]) for i in order]
    assert b["country"].numpy().tolist() == [ids(by_id[i][3], gpuload.Hash(100)) for i in order]

    def lists(r):
        off = r.offsets.numpy()
        return [r.values.numpy()[off[k]:off[k + 1]].tolist() for k in range(len(off) - 1)]

    assert lists(b["tags"]) == [[ids(t, gpuload.Hash(50, seed=1)) for t in by_id[i][4] or []] for i in order]
    assert lists(b["hist"]) == [by_id[i][5] or [] for i in order]
    cents = gpuload.ParquetDataset(folder, ["id", "amount"], cache_dir=tmp_path / "c", device="cpu", batch_size=N,
                                   shuffle=False, fill_nulls=-1, dtypes={"amount": "int64"})
    (c,) = list(cents)
    assert c["amount"].numpy().tolist() == [-1 if by_id[i][1] is None else int(by_id[i][1].scaleb(2))
                                            for i in c["id"].numpy().tolist()]
