"""Column ranges from footers, coalescing, and a Parquet file made of fetched ranges."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuload.sources.ranges import RangeFile, coalesce, column_ranges


def test_column_ranges_cover_exactly_the_column_chunks(tmp_path):
    t = pa.table({"a": list(range(1000)), "b": [str(i % 7) for i in range(1000)], "c": [1.5] * 1000})
    pq.write_table(t, tmp_path / "x.parquet", row_group_size=300)
    meta = pq.read_metadata(tmp_path / "x.parquet")
    data = (tmp_path / "x.parquet").read_bytes()
    ranges = column_ranges(meta, 1, 3, [1])  # column b (dictionary encoded) of row groups 1 and 2
    assert len(ranges) == 2
    parts = {a: data[a:b] for a, b in ranges}
    f = RangeFile("x", len(data), parts, lambda a, b: pytest.fail(f"unplanned read {a}-{b}"))
    got = pq.ParquetFile(f, metadata=meta, pre_buffer=False).reader.read_row_groups([1, 2], column_indices=[1])
    assert got.column(0).to_pylist() == t.column("b").to_pylist()[300:900]
    assert f.unplanned == 0


def test_coalesce_merges_near_ranges_and_splits_long_ones():
    assert coalesce([(100, 200), (0, 50), (60, 90)], gap=10, longest=1000) == [(0, 200)]
    assert coalesce([(100, 200), (0, 50), (60, 90)], gap=9, longest=1000) == [(0, 50), (60, 90), (100, 200)]
    assert coalesce([(0, 10), (10, 20), (5, 8)], gap=0, longest=1000) == [(0, 20)]
    assert coalesce([(0, 1000)], gap=0, longest=300) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert coalesce([(5, 5)], gap=0, longest=10) == []


def test_a_read_outside_the_fetched_ranges_is_served_by_the_fallback():
    calls = []
    f = RangeFile("x", 100, {10: b"abcdef"}, lambda a, b: calls.append((a, b)) or b"z" * (b - a))
    f.seek(11)
    assert f.read(3) == b"bcd"
    f.seek(14)
    assert f.read(4) == b"zzzz" and calls == [(14, 18)] and f.unplanned == 1
