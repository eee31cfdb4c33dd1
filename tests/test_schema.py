"""Unsupported types and bad settings are refused before any work, naming what is wrong."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest

import gpuload
from gpuload.schema import resolve_outputs

BAD = {
    "s": pa.string(), "bin": pa.binary(), "dec": pa.decimal128(10, 2),
    "st": pa.struct([("a", pa.int32())]), "m": pa.map_(pa.string(), pa.int32()),
    "ll": pa.list_(pa.list_(pa.int32())), "ls": pa.list_(pa.string()),
}
SCHEMA = pa.schema([("ok", pa.int32()), ("h", pa.list_(pa.int64()))] + list(BAD.items()))


@pytest.mark.parametrize("name", BAD)
def test_unsupported_type_named_when_selected(name):
    with pytest.raises(gpuload.SchemaError, match=f"column '{name}'") as e:
        resolve_outputs(SCHEMA, [name], file="f.parquet")
    assert str(SCHEMA.field(name).type) in str(e.value)


def test_columns_none_skips_unsupported_with_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        specs = resolve_outputs(SCHEMA, None, file="f.parquet")
    assert [s.name for s in specs] == ["ok", "h"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and all(f"{n} (" in lines[0] for n in BAD)


def test_missing_column_names_file_and_column():
    with pytest.raises(gpuload.SchemaError, match=r"'nope' is not in f\.parquet"):
        resolve_outputs(SCHEMA, ["ok", "nope"], file="f.parquet")


def test_group_with_list_column_refused():
    with pytest.raises(gpuload.SchemaError, match="'g' stacks list columns"):
        resolve_outputs(SCHEMA, {"g": ["ok", "h"]})


@pytest.mark.parametrize("schema,fill", [
    (pa.schema([("u", pa.uint8())]), -1), (pa.schema([("u", pa.int32())]), 0.5),
    (pa.schema([("u", pa.int32())]), "zero"), (pa.schema([("u", pa.int8())]), 1000),
])
def test_bad_fill_value_names_column(schema, fill):
    with pytest.raises(gpuload.ConfigError, match="'u'"):
        resolve_outputs(schema, None, fill_nulls={"u": fill})


@pytest.mark.parametrize("kwargs,match", [
    ({"fill_nulls": {"zz": 0}}, "zz"), ({"dtypes": {"zz": "float32"}}, "zz"),
    ({"columns": ["ok", "ok"]}, "more than once"), ({"columns": 5}, "columns="),
    ({"dtypes": {"ok": "U4"}}, "numeric"), ({"columns": {"g": []}}, "non-empty"),
])
def test_bad_settings(kwargs, match):
    kwargs.setdefault("columns", ["ok"])
    with pytest.raises(gpuload.ConfigError, match=match):
        resolve_outputs(SCHEMA, **kwargs)


def test_renamed_and_grouped_outputs():
    specs = resolve_outputs(pa.schema([("a", pa.int32()), ("b", pa.int64())]), {"x": "a", "g": ["a", "b"]})
    assert [(s.name, s.columns, s.kind, s.width) for s in specs] == [
        ("x", ("a",), "scalar", 1), ("g", ("a", "b"), "group", 2)]
