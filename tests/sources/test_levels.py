"""Nulls counted from footers' definition-level histograms (gpuload.sources.levels), against
pyarrow reading the column; and the cases where the histograms must not be trusted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import ARROW_READS_NULL_FIXED_LISTS
from gpuload.sources.levels import definition_histograms, null_counts


def _read_nulls(path, column: str, groups, lists: bool) -> int:
    """The reference: the column read, null lists plus null elements counted."""
    col = pq.ParquetFile(path).read_row_groups(list(groups), columns=[column]).column(0)
    return col.null_count + (pc.list_flatten(col).null_count if lists else 0)


def _written_nulls(data: list, rows_per_group: int, groups) -> int:
    """The reference without reading (pyarrow < 26 cannot read fixed-size lists with null rows):
    null lists plus null elements among the rows written to ``groups``."""
    rows = [v for g in groups for v in data[g * rows_per_group:(g + 1) * rows_per_group]]
    return sum(1 if v is None else sum(x is None for x in v) for v in rows)


def _values(rng, n: int, null_lists: bool, null_elements: bool, fixed: int = 0):
    out = []
    for i in range(n):
        r = rng.random()
        if null_lists and r < 0.05:
            out.append(None)
        elif not fixed and r < 0.15:
            out.append([])
        else:
            k = fixed or int(rng.integers(1, 5))
            out.append([None if null_elements and rng.random() < 0.1 else int(v) for v in rng.integers(0, 99, k)])
    return out


TYPES = {"list": pa.list_, "large_list": pa.large_list, "fixed": lambda v: pa.list_(v, 3)}
# (nullable list, nullable element, null lists written, null elements written)
NULLS = sorted({(n_l, n_e, w_l, w_e) for n_l in (True, False) for n_e in (True, False)
                for w_l in (False, n_l) for w_e in (False, n_e)})


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("nullable_list, nullable_element, null_lists, null_elements", NULLS)
def test_list_nulls_equal_what_reading_the_column_finds(tmp_path, kind, null_lists, null_elements, nullable_list,
                                                         nullable_element):
    rng = np.random.default_rng(sorted(TYPES).index(kind) * 16 + 2 * null_lists + null_elements)
    value = pa.field("element", pa.int64(), nullable=nullable_element)
    t = TYPES[kind](value)
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("h", t, nullable=nullable_list)])
    data = _values(rng, 3000, null_lists, null_elements, fixed=3 if kind == "fixed" else 0)
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": np.arange(3000), "h": pa.array(data, t)}, schema=schema), path,
                   row_group_size=700)
    md = pq.ParquetFile(path).metadata
    readable = kind != "fixed" or not null_lists or ARROW_READS_NULL_FIXED_LISTS
    for groups in ([0], [1, 3], list(range(md.num_row_groups))):
        got, = null_counts(md, pq.ParquetFile(path).schema_arrow, [("h", 1, groups, True)])
        assert got == _written_nulls(data, 700, groups), groups
        if readable:  # and what pyarrow finds reading the column
            assert got == _read_nulls(path, "h", groups, True), groups
    if null_lists or null_elements:
        assert null_counts(md, pq.ParquetFile(path).schema_arrow, [("h", 1, range(md.num_row_groups), True)])[0] > 0


def test_flat_column_nulls_and_several_list_columns(tmp_path):
    rng = np.random.default_rng(5)
    n = 2500
    x = pa.array([None if rng.random() < 0.02 else float(i) for i in range(n)])
    a = pa.array(_values(rng, n, True, False))
    b = pa.array(_values(rng, n, False, True))
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"x": x, "a": a, "b": b}), path, row_group_size=600)
    pf = pq.ParquetFile(path)
    groups = range(pf.metadata.num_row_groups)
    wanted = [(col, leaf, groups, lists) for leaf, (col, lists) in enumerate([("x", False), ("a", True), ("b", True)])]
    got = null_counts(pf.metadata, pf.schema_arrow, wanted)  # one walk of the footer for all three
    assert got == [_read_nulls(path, col, groups, lists) for col, _, _, lists in wanted] and min(got) > 0


LISTS = pa.table({"h": pa.array([[1, None], None, [], [4]] * 100, pa.list_(pa.int64()))})


@pytest.mark.parametrize("writer", ["polars", "duckdb"])
def test_files_without_histograms_are_left_to_reading(tmp_path, writer):
    """Polars and DuckDB write no definition-level histograms: None, never a guess."""
    pl = pytest.importorskip("polars")
    pl.from_arrow(LISTS).write_parquet(tmp_path / "p.parquet")
    if writer == "duckdb":
        duckdb = pytest.importorskip("duckdb")
        duckdb.sql(f"COPY (SELECT * FROM read_parquet('{tmp_path / 'p.parquet'}')) TO '{tmp_path / 'd.parquet'}' "
                   "(FORMAT parquet)")
    pf = pq.ParquetFile(tmp_path / ("p.parquet" if writer == "polars" else "d.parquet"))
    assert null_counts(pf.metadata, pf.schema_arrow, [("h", 0, [0], True)]) == [None]


def test_what_they_cannot_tell_is_left_to_reading(tmp_path):
    """A list of structs (another shape of levels): None, never a guess; a list of numbers
    written the same way is counted."""
    s = pa.table({"h": pa.array([[{"a": 1}], None], pa.list_(pa.struct([("a", pa.int64())])))})
    pq.write_table(s, tmp_path / "s.parquet")
    pf = pq.ParquetFile(tmp_path / "s.parquet")
    assert null_counts(pf.metadata, pf.schema_arrow, [("h", 0, [0], True)]) == [None]
    pq.write_table(LISTS, tmp_path / "a.parquet")
    pf = pq.ParquetFile(tmp_path / "a.parquet")
    assert null_counts(pf.metadata, pf.schema_arrow, [("h", 0, [0], True)]) == [200]  # 100 null lists, 100 elements


def test_footer_bytes_it_cannot_walk_raise_value_error(tmp_path):
    t = pa.table({"h": pa.array([[1], None] * 50, pa.list_(pa.int64()))})
    pq.write_table(t, tmp_path / "a.parquet", row_group_size=30)
    thrift = bytes(pq.ParquetFile(tmp_path / "a.parquet").metadata.__reduce__()[1][0])
    whole = definition_histograms(thrift, {0}, range(4))
    assert sorted(whole) == [(g, 0) for g in range(4)] and sum(sum(h) for h in whole.values()) == 100  # one a row
    cut_short = 0
    for cut in range(0, len(thrift), 7):  # cut anywhere: the right answer or ValueError, never a wrong one
        try:
            got = definition_histograms(thrift[:cut], {0}, range(4))
        except ValueError:
            cut_short += 1
            continue
        assert got == whole, cut
    assert cut_short > 10
    with pytest.raises(ValueError):
        definition_histograms(b"\x1f" + thrift[1:], {0}, range(4))  # a field of an unknown type


def _field(delta_or_id: int, kind: int, last: int = 0) -> bytes:
    """A compact-protocol field header: short form (the id's delta in the high nibble) where the
    delta is 1-15, else the long form (type alone, then the id as a zigzag varint)."""
    delta = delta_or_id - last
    if 0 < delta < 16:
        return bytes([delta << 4 | kind])
    z = (delta_or_id << 1) ^ (delta_or_id >> 63)
    out = bytearray([kind])
    while True:
        out.append(z & 0x7F | (0x80 if z > 0x7F else 0))
        z >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


def test_the_footer_walk_skips_every_thrift_shape():
    """Shapes pyarrow's footers hold (nested structs, lists of structs and of strings) and those they
    may (maps, sets, bools in containers and as fields, bytes, doubles, a long-form field id, a list of
    more than 14 elements): the walk that skips them lands on the byte after, and refuses a cut."""
    from gpuload.sources.levels import _BINARY, _BYTE, _DOUBLE, _FALSE, _I32, _I64, _LIST, _MAP, _SET, _STRUCT, \
        _TRUE, _skip

    inner = _field(1, _I32) + b"\x96\x01" + _field(2, _TRUE, 1) + _field(3, _BINARY, 2) + b"\x03abc" + b"\x00"
    body = (
        _field(1, _STRUCT) + inner                                         # a nested struct
        + _field(2, _LIST, 1) + bytes([2 << 4 | _STRUCT]) + inner + inner  # a list of structs
        + _field(3, _LIST, 2) + bytes([3 << 4 | _TRUE]) + b"\x01\x02\x01"  # bools in a list: a byte each
        + _field(4, _SET, 3) + bytes([0xF0 | _I64]) + bytes([20]) + b"\x02" * 20  # 20 elements: long size
        + _field(5, _MAP, 4) + b"\x02" + bytes([_BINARY << 4 | _FALSE]) + b"\x01k\x01\x01l\x02"  # map -> bool
        + _field(6, _DOUBLE, 5) + b"\x00" * 8 + _field(7, _BYTE, 6) + b"\x7f"
        + _field(300, _STRUCT, 7) + b"\x00"                                # a long-form id, an empty struct
        + _field(301, _MAP, 300) + b"\x00"                                 # an empty map
        + b"\x00"
    )
    tail = b"\xaa\xbb"
    assert _skip(body + tail, 0, _STRUCT) == len(body)
    for cut in range(1, len(body)):
        with pytest.raises((ValueError, IndexError)):
            _skip(body[:cut], 0, _STRUCT)
