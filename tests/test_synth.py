"""Tests for gpuload.synth: the synthetic click-log generator."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from gpuload.synth import clicklog_columns, write_clicklog


def _read(paths):
    return pa.concat_tables(pq.read_table(p) for p in paths)


def test_files_rows_and_row_groups(tmp_path):
    paths = write_clicklog(tmp_path / "d", rows=1_003, files=3, row_group_rows=100)
    assert [p.name for p in paths] == [f"part-0000{i}.parquet" for i in range(3)]
    assert all(p.parent == tmp_path / "d" for p in paths)
    metas = [pq.ParquetFile(p).metadata for p in paths]
    # 1_003 rows over 3 files: as even as possible, earlier files take the extra.
    assert [m.num_rows for m in metas] == [335, 334, 334]
    for m in metas:
        sizes = [m.row_group(i).num_rows for i in range(m.num_row_groups)]
        assert m.num_row_groups == 4
        assert sizes[:-1] == [100, 100, 100] and sizes[-1] == m.num_rows - 300


def test_schema_and_value_ranges(tmp_path):
    paths = write_clicklog(tmp_path, rows=5_000, files=2, dense=3, sparse=2,
                           list_max=7, row_group_rows=1_000)
    table = _read(paths)
    expected = ["row_id", "label", "dense_0", "dense_1", "dense_2",
                "cat_0", "cat_1", "history"]
    assert table.column_names == expected
    assert table.schema.field("row_id").type == pa.int64()
    assert table.schema.field("label").type == pa.int8()
    assert table.schema.field("dense_0").type == pa.float32()
    assert table.schema.field("cat_1").type == pa.int64()
    assert table.schema.field("history").type == pa.list_(pa.int64())

    np.testing.assert_array_equal(table["row_id"].to_numpy(), np.arange(5_000))
    labels = table["label"].to_numpy()
    assert set(np.unique(labels)) <= {0, 1}
    assert 0.15 < labels.mean() < 0.35
    for name in ("dense_0", "dense_1", "dense_2"):
        assert (table[name].to_numpy() > 0).all()
    # the label is learnable from dense_0
    dense0 = table["dense_0"].to_numpy()
    assert dense0[labels == 1].mean() > dense0[labels == 0].mean()
    for name in ("cat_0", "cat_1"):
        ids = table[name].to_numpy()
        assert ids.min() >= 0 and ids.max() < 100_000
    history = table["history"].combine_chunks()
    lengths = pc.list_value_length(history).to_numpy()
    assert lengths.min() >= 0 and lengths.max() <= 7
    assert history.null_count == 0
    values = history.flatten().to_numpy()
    assert len(values) == lengths.sum()
    assert values.min() >= 0 and values.max() < 100_000


def test_deterministic_for_a_seed(tmp_path):
    kwargs = dict(rows=2_000, files=2, row_group_rows=300, dense=2, sparse=2)
    a = _read(write_clicklog(tmp_path / "a", seed=7, **kwargs))
    b = _read(write_clicklog(tmp_path / "b", seed=7, **kwargs))
    c = _read(write_clicklog(tmp_path / "c", seed=8, **kwargs))
    assert a.equals(b)
    for name in a.column_names:
        assert a[name].combine_chunks().equals(b[name].combine_chunks()), name
    assert not a["dense_0"].equals(c["dense_0"])
    np.testing.assert_array_equal(a["row_id"].to_numpy(), c["row_id"].to_numpy())


def test_list_max_zero_gives_empty_history(tmp_path):
    table = _read(write_clicklog(tmp_path, rows=50, files=1, list_max=0))
    assert pc.max(pc.list_value_length(table["history"])).as_py() == 0


def test_clicklog_columns():
    cols = clicklog_columns(dense=2, sparse=3)
    assert cols == {"dense": ["dense_0", "dense_1"],
                    "sparse": ["cat_0", "cat_1", "cat_2"],
                    "label": "label", "history": "history"}
    assert clicklog_columns()["dense"][-1] == "dense_12"


@pytest.mark.parametrize("kwargs", [dict(files=0), dict(rows=2, files=3),
                                    dict(row_group_rows=0), dict(list_max=-1)])
def test_bad_arguments(tmp_path, kwargs):
    kwargs.setdefault("rows", 10)
    with pytest.raises(ValueError):
        write_clicklog(tmp_path, **kwargs)
