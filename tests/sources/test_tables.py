"""Table formats: a Delta Lake folder is read through its log (live files only, partition
values from the log), an Iceberg folder is refused, and neither is ever read file by file."""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pytest

import gpuload

from conftest import dataset_factory

deltalake = pytest.importorskip("deltalake")


_ds = dataset_factory(shuffle=False, batch_size=64)


def _rows(ds) -> dict:
    out: dict = {}
    for b in ds:
        for k, v in b.items():
            out.setdefault(k, []).append(v.numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def _table(ids, day):
    return pa.table({"id": pa.array(ids, pa.int64()), "v": pa.array(np.asarray(ids) * 0.5, pa.float32()),
                     "day": pa.array(day, pa.int64())})


@pytest.fixture
def delta(tmp_path):
    """A Delta table partitioned by an int64 ``day``: written, overwritten, appended to and
    deleted from, so that its folder holds files of rows the table no longer has."""
    root = tmp_path / "delta"
    w = deltalake.write_deltalake
    w(root, _table(np.arange(100), np.arange(100) % 3), partition_by=["day"])           # replaced below
    w(root, _table(np.arange(1000, 1200), np.arange(200) % 4), partition_by=["day"], mode="overwrite")
    w(root, _table(np.arange(2000, 2050), np.full(50, 7)), partition_by=["day"], mode="append")
    deltalake.DeltaTable(root).delete("id < 1010")                                       # rewrites a file
    want = deltalake.DeltaTable(root).to_pyarrow_table().sort_by("id")
    assert want.num_rows == 240
    return root, want


def test_a_delta_folder_serves_only_the_live_rows_with_the_logs_partition_values(delta, tmp_path):
    root, want = delta
    files = sorted(p for p in root.rglob("*.parquet") if "_delta_log" not in p.parts)
    assert len(files) > len(deltalake.DeltaTable(root).file_uris())  # removed files are still there
    got = _rows(_ds(root, tmp_path / "cache", ["id", "v", "day"]))
    order = np.argsort(got["id"])
    np.testing.assert_array_equal(got["id"][order], want["id"].to_numpy())
    np.testing.assert_array_equal(got["v"][order], want["v"].to_numpy())
    np.testing.assert_array_equal(got["day"][order], want["day"].to_numpy())
    assert got["day"].dtype == np.int64  # typed by the table's schema, not guessed from the folder names


def test_a_delta_partition_folder_or_glob_is_read_through_the_table_log(delta, tmp_path):
    root, want = delta
    day1 = want.filter(pa.compute.equal(want["day"], 1))
    for source in (root / "day=1", str(root / "day=1" / "*.parquet"), str(root / "**" / "*.parquet")):
        got = _rows(_ds(source, tmp_path / "cache", ["id", "day"]))
        expect = day1 if "day=1" in str(source) else want
        assert sorted(got["id"]) == sorted(expect["id"].to_pylist()), source


def test_a_delta_table_on_s3_is_read_through_its_log(delta, tmp_path):
    pytest.importorskip("moto", reason="the S3 server needs moto")
    from gpuload.testing import S3Server

    root, want = delta
    with S3Server() as s3:
        s3.upload_folder(root, "lake", "clicks/")
        ds = gpuload.ParquetDataset("s3://lake/clicks", ["id", "day"], cache_dir=tmp_path / "c", device="cpu",
                                    batch_size=64, storage_options=s3.storage_options)
        got = _rows(ds)
    assert sorted(got["id"]) == want["id"].to_pylist()
    assert sorted(zip(got["id"], got["day"])) == sorted(zip(want["id"].to_pylist(), want["day"].to_pylist()))


def test_a_delta_table_missing_a_live_file_is_refused(delta, tmp_path):
    root, _ = delta
    live = deltalake.DeltaTable(root).file_uris()[0]
    import os

    os.unlink(live)
    with pytest.raises(gpuload.SourceError, match="live file .* is missing"):
        _ds(root, tmp_path / "cache", ["id"])


def test_without_deltalake_a_delta_folder_is_refused_with_what_to_do(delta, tmp_path, monkeypatch):
    root, _ = delta
    monkeypatch.setitem(sys.modules, "deltalake", None)  # as if it were not installed
    with pytest.raises(gpuload.SourceError, match=r"Delta Lake table.*pip install gpuload\[delta\].*file_uris"):
        _ds(root, tmp_path / "cache", ["id"])


def test_column_mapping_is_refused(tmp_path):
    root = tmp_path / "cm"
    deltalake.write_deltalake(root, _table(np.arange(10), np.zeros(10)),
                              configuration={"delta.columnMapping.mode": "name"})
    with pytest.raises(gpuload.SourceError, match="column mapping"):
        _ds(root, tmp_path / "cache", ["id"])


def test_a_column_added_to_the_table_later_reads_as_nulls_in_the_files_without_it(tmp_path):
    """A column merged into the schema by an append is null in the older files, as deltalake reads the table:
    without a fill value that is refused, naming the files that lack it; with one, every value is deltalake's."""
    root = tmp_path / "evolved"
    deltalake.write_deltalake(root, _table(np.arange(10), np.zeros(10)))
    deltalake.write_deltalake(root, pa.table({"id": np.arange(10, 20), "v": np.ones(10, np.float32),
                                              "day": np.ones(10, np.int64), "w": np.arange(10) * 2.5}),
                              mode="append", schema_mode="merge")
    with pytest.raises(gpuload.NullValuesError, match=r"'w' has 10 null values .*1 file lacks the column"):
        _ds(root, tmp_path / "cache", ["id", "w"])
    ds = gpuload.ParquetDataset(root, ["id", "w"], fill_nulls={"w": -1.0}, cache_dir=tmp_path / "cache",
                                device="cpu", batch_size=8)
    got = sorted((i, w) for b in ds for i, w in zip(b["id"].tolist(), b["w"].tolist()))
    ref = deltalake.DeltaTable(root).to_pyarrow_table(columns=["id", "w"]).sort_by("id")
    assert got == list(zip(ref.column("id").to_pylist(), ref.column("w").fill_null(-1.0).to_pylist()))
    assert sum(w == -1.0 for _, w in got) == 10


def test_an_iceberg_folder_is_refused_with_the_call_that_lists_its_files(tmp_path):
    from conftest import write_parquet

    root = tmp_path / "ice"
    write_parquet(root / "data" / "00000-0-a.parquet", {"id": np.arange(5)})
    (root / "metadata").mkdir()
    (root / "metadata" / "00001-abc.metadata.json").write_text("{}")
    for source in (root, root / "data"):
        with pytest.raises(gpuload.SourceError, match="Iceberg table.*plan_files"):
            _ds(source, tmp_path / "cache", ["id"])


def test_rows_masked_by_deletion_vectors_are_refused(tmp_path):
    """A commit as Spark writes it for a DELETE on a table with deletion vectors: the file stays
    live, its deleted rows only masked. (delta-rs rewrites files instead, so the commit is written here.)"""
    import json

    root = tmp_path / "dv"
    deltalake.write_deltalake(root, _table(np.arange(10), np.zeros(10)),
                              configuration={"delta.enableDeletionVectors": "true"})
    first = (root / "_delta_log" / f"{0:020d}.json").read_text().splitlines()
    add = next(json.loads(line)["add"] for line in first if "add" in json.loads(line))
    remove = {"path": add["path"], "deletionTimestamp": add["modificationTime"] + 1, "dataChange": True,
              "size": add["size"]}
    masked = {**add, "deletionVector": {"storageType": "u", "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^",
                                        "offset": 1, "sizeInBytes": 36, "cardinality": 3}}
    (root / "_delta_log" / f"{1:020d}.json").write_text("\n".join(json.dumps(a) for a in (
        {"commitInfo": {"timestamp": 1, "operation": "DELETE"}}, {"remove": remove}, {"add": masked})) + "\n")
    assert len(deltalake.DeltaTable(root).file_uris()) == 1  # the file is live, 3 of its rows deleted
    with pytest.raises(gpuload.SourceError, match="deletion vectors"):
        _ds(root, tmp_path / "cache", ["id"])
