"""Schema: which columns are accepted, and the errors for everything else."""

from __future__ import annotations

import logging
import re

import numpy as np
import pyarrow as pa
import pytest

import gpuload
from gpuload.cache.chunkfile import spec_hash
from gpuload.layout import spec_description
from gpuload.schema import resolve_outputs


def spec_token(specs):
    return spec_hash(spec_description(specs))

BAD = {
    "dec": pa.decimal256(40, 2),
    "st": pa.struct([("a", pa.int32())]),
    "m": pa.map_(pa.int32(), pa.float32()),
    "lol": pa.list_(pa.list_(pa.int32())),
}
HASHED = {  # categorical: int64 ids (tests/test_categorical.py checks the values)
    "s": pa.string(),
    "ls": pa.large_string(),
    "bin": pa.binary(),
    "lstr": pa.list_(pa.string()),
    "fslstr": pa.list_(pa.string(), 2),
    "dstr": pa.dictionary(pa.int32(), pa.string()),
}
GOOD = {"i": pa.int32(), "f": pa.float32(), "u": pa.uint8(), "b": pa.bool_(), "t": pa.timestamp("ms"),
        "r": pa.list_(pa.int64()), "fx": pa.list_(pa.float32(), 4), "d": pa.decimal128(10, 2)}
SCHEMA = pa.schema([(k, t) for k, t in GOOD.items()] + list(HASHED.items()) + list(BAD.items()))


def resolve(columns=None, fill_nulls=None, dtypes=None, schema=SCHEMA):
    return resolve_outputs(schema, columns, fill_nulls, dtypes, file="data/part-0.parquet")


@pytest.mark.parametrize("name", list(BAD))
def test_unsupported_type_selected_explicitly_names_column_and_type(name):
    typ = BAD[name]
    for columns in ([name], ["i", name], {"out": name}):
        with pytest.raises(gpuload.SchemaError) as e:
            resolve(columns)
        msg = str(e.value)
        assert f"'{name}'" in msg and str(typ) in msg, msg
        assert "columns=" in msg  # says what to do


def test_columns_none_skips_unsupported_and_logs_them_once(caplog):
    with caplog.at_level(logging.INFO, logger="gpuload"):
        specs = resolve()
    assert [s.name for s in specs] == list(GOOD) + list(HASHED)
    assert all(s.dtype == "<i8" and s.sources[0].encode == gpuload.Hash().key for s in specs if s.name in HASHED)
    records = [r for r in caplog.records if r.name == "gpuload" and r.levelno >= logging.WARNING]
    assert len(records) == 1
    (info,) = [r.getMessage() for r in caplog.records if r.name == "gpuload" and r.levelno == logging.INFO]
    assert "string and binary columns s, ls, bin, lstr, fslstr, dstr become categorical ids" in info
    for name, typ in BAD.items():
        assert f"{name} ({typ})" in records[0].getMessage()
    assert not any(re.search(rf"(: |, ){g} \(", records[0].getMessage()) for g in [*GOOD, *HASHED])


def test_columns_none_all_supported_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="gpuload"):
        resolve(schema=pa.schema([("a", pa.int8())]))
    assert not [r for r in caplog.records if r.name == "gpuload"]


def test_no_supported_column_at_all():
    with pytest.raises(gpuload.SchemaError, match="data/part-0.parquet"):
        resolve(schema=pa.schema([("d", pa.decimal256(40, 2))]))


@pytest.mark.parametrize("columns", [["i", "nope"], {"x": "nope"}, {"g": ["i", "nope"]}, "nope"])
def test_missing_column_is_named(columns):
    with pytest.raises(gpuload.SchemaError, match=r"'nope' is not in data/part-0\.parquet"):
        resolve(columns)


@pytest.mark.parametrize("others", [dict(fill_nulls={"i": 0}), dict(categorical={"s": gpuload.Hash()}),
                                    dict(dtypes={"y": "float64"})])
def test_a_misspelt_column_is_named_before_the_settings_that_name_the_real_one(others):
    """A user's trial: columns={"x": ["prise"]} with fill_nulls={"price": 0} was told fill_nulls names a
    column not loaded, never that 'prise' does not exist."""
    with pytest.raises(gpuload.SchemaError, match=r"'nope' is not in data/part-0\.parquet"):
        resolve_outputs(SCHEMA, {"x": "nope", "y": "f"}, others.get("fill_nulls"), others.get("dtypes"),
                        file="data/part-0.parquet", categorical=others.get("categorical"))


@pytest.mark.parametrize("member", ["r", "fx"])
def test_group_containing_a_list_column_is_refused(member):
    with pytest.raises(gpuload.SchemaError, match=rf"'g'.*'{member}'"):
        resolve({"g": ["i", member]})


def test_kinds_dtypes_and_widths():
    specs = {s.name: s for s in resolve({"i": "i", "r": "r", "fx": "fx", "g": ["u", "i", "b"], "t": "t"})}
    assert (specs["i"].kind, specs["i"].dtype, specs["i"].width) == ("scalar", "<i4", 1)
    assert (specs["r"].kind, specs["r"].dtype) == ("ragged", "<i8")
    assert (specs["fx"].kind, specs["fx"].dtype, specs["fx"].width, specs["fx"].ndim) == ("fixed", "<f4", 4, 2)
    assert (specs["g"].kind, specs["g"].dtype, specs["g"].width, specs["g"].columns) == ("group", "<i4", 3,
                                                                                          ("u", "i", "b"))
    assert (specs["t"].dtype, specs["t"].sources[0].temporal) == ("<i8", "int")


# -- fill values ------------------------------------------------------------------------------
@pytest.mark.parametrize("column,fill", [
    ("u", -1), ("u", 256), ("i", 0.5), ("i", 2**31), ("i", float("nan")), ("i", "0"), ("f", "nan"),
    ("b", 2), ("b", 0.5), ("r", "x"), ("fx", [0.0]), ("i", b"1"),
])
def test_bad_fill_value_names_the_column(column, fill):
    with pytest.raises(gpuload.ConfigError, match=f"'{column}'"):
        resolve([column], fill_nulls={column: fill})
    # as a scalar for every column: a number is refused naming the column it does not fit; anything else
    # as it was given (a user's trial passed fill_nulls="abc" and was shown fill_nulls={'id': 'abc'})
    number = isinstance(fill, (int, float))
    with pytest.raises(gpuload.ConfigError, match=f"'{column}'" if number else re.escape(f"fill_nulls={fill!r} must")):
        resolve([column], fill_nulls=fill)


@pytest.mark.parametrize("column,fill,want", [
    ("u", 255, 255), ("u", 3.0, 3), ("i", -2**31, -2**31), ("i", True, 1), ("i", np.True_, 1), ("f", 1, 1.0),
    ("f", float("-inf"), float("-inf")), ("b", 1, True), ("b", False, False), ("r", np.int64(4), 4),
    ("fx", np.float32(0.25), 0.25), ("t", -1, -1),
])
def test_good_fill_values_are_normalised(column, fill, want):
    (spec,) = resolve([column], fill_nulls={column: fill})
    assert spec.fills == (want,) and type(spec.fills[0]) is type(want)
    (spec,) = resolve([column], fill_nulls=fill)  # one value for every column (np.True_ was refused)
    assert spec.fills == (want,) and type(spec.fills[0]) is type(want)


@pytest.mark.parametrize("columns, fill, dtypes, want", [
    (["u"], {"u": -1}, {"u": "int16"}, "<i2"),  # uint8's nulls as -1: read as int16, then filled
    (["u"], {"u": 300}, {"u": "float32"}, "<f4"),
    (["i"], {"i": 2**40}, {"i": "int64"}, "<i8"),
    (["i"], {"i": 0.5}, {"i": "float64"}, "<f8"),  # int32 read as float64 (exact), then 0.5 where null
    ({"g": ["u", "i"]}, {"u": -1}, None, "<i4"),  # a stacked group's common type holds it: no dtypes= needed
])
def test_a_fill_the_column_cannot_hold_fills_it_in_a_wider_output_type(columns, fill, dtypes, want):
    (spec,) = resolve(columns, fill_nulls=fill, dtypes=dtypes)
    member = spec.columns.index(next(iter(fill)))
    assert spec.dtype == want and spec.sources[member].dtype == want  # the column's values read in the output's type
    assert spec.fills[member] == next(iter(fill.values()))


@pytest.mark.parametrize("columns, fill, dtypes", [
    (["u"], {"u": -1}, {"u": "uint16"}),  # uint16 holds no -1 either
    (["u"], {"u": 70000}, {"u": "int16"}),
    (["f"], {"f": 1e300}, {"f": "float16"}),  # a narrower output: the fill must fit the column first
    (["r"], {"r": float("nan")}, {"r": "float64"}),  # int64 is not exact in float64 (a review's catch)
    (["i"], {"i": 0.5}, {"i": "int64"}),  # not an integer, for integer types
])
def test_a_fill_no_output_type_holds_is_still_refused(columns, fill, dtypes):
    with pytest.raises(gpuload.ConfigError, match=f"'{columns[0]}'"):
        resolve(columns, fill_nulls=fill, dtypes=dtypes)


def test_one_fill_for_every_column_still_fills_only_the_columns_it_fits():
    """fill_nulls=nan leaves integer columns without one, whatever their outputs (the README says so)."""
    i, f = resolve(["i", "f"], fill_nulls=float("nan"), dtypes={"i": "float64"})
    assert i.fills == (None,) and i.sources[0].dtype == "<i4" and np.isnan(f.fills[0])


def test_fill_is_per_member_of_a_group():
    (spec,) = resolve({"g": ["i", "f", "u"]}, fill_nulls={"f": 0.5, "u": 9})
    assert spec.fills == (None, 0.5, 9)


# -- other settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(columns=["i"], fill_nulls={"f": 0}), r"fill_nulls.*\['f'\]"),          # not loaded
    (dict(columns=["i"], fill_nulls={"zz": 0, "i": 0}), r"fill_nulls.*\['zz'\]"),
    (dict(columns={"g": ["i", "f"]}, fill_nulls={"g": 0}),                       # an output, not its columns
     r"fill_nulls= names outputs \['g'\]; it takes the Parquet columns \(a stacked group's members: \{'g': \['i', 'f'\]\}"),
    (dict(columns={"x": "i"}, dtypes={"i": "float32"}),                          # outputs, not columns
     r"dtypes= names outputs that do not exist: \['i'\] \(column 'i' is read into output 'x'\); it takes the "
     r"outputs of columns=: \['x'\]"),
    (dict(columns={"g": ["i", "f"]}, dtypes={"f": "float32"}), r"\(column 'f' is read into output 'g'\)"),
    (dict(columns=["i"], dtypes={"q": "int8"}), r"dtypes.*\['q'\]"),
    (dict(columns=["i", "f", "i"]), r"columns=.*\['i'\]"),                        # duplicate names
    (dict(columns=["i"], dtypes={"i": "not-a-dtype"}), r"dtypes\['i'\]"),
    (dict(columns=["i"], dtypes={"i": "U3"}), r"dtypes\['i'\]"),
    (dict(columns=["i"], dtypes={"i": "datetime64[ns]"}), r"dtypes\['i'\]"),
    (dict(columns=["i"], dtypes="float32"), r"dtypes='float32' must be \{output: dtype\}"),  # not a mapping
    (dict(columns=["i"], dtypes=np.float32), r"dtypes=.* must be \{output: dtype\}"),
    (dict(columns={"g": []}), r"columns\['g'\]"),
    (dict(columns={"g": ["i", 3]}), r"columns\['g'\]"),
    (dict(columns=42), r"columns="),
    (dict(columns=[]), r"columns= is empty; name the columns"), (dict(columns={}), r"columns= is empty"),
    (dict(columns=["i", 3]), r"columns="),
])
def test_bad_settings_raise_config_error_naming_them(kwargs, match):
    with pytest.raises(gpuload.ConfigError, match=match):
        resolve(**kwargs)


def test_spec_hash_separates_every_option():
    base = spec_token(resolve(["i", "r"]))
    variants = [resolve(["r", "i"]), resolve(["i"]), resolve({"j": "i", "r": "r"}),
                resolve(["i", "r"], fill_nulls=0), resolve(["i", "r"], fill_nulls={"r": 1}),
                resolve(["i", "r"], dtypes={"i": "int64"}), resolve(["i", "r"], dtypes={"r": "float32"})]
    tokens = [spec_token(v) for v in variants]
    assert base == spec_token(resolve(["i", "r"])) and base not in tokens and len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("dtype,fill", [(pa.float16(), 1e10), (pa.float32(), 1e300)])
def test_float_fill_out_of_range_is_refused(dtype, fill):
    with pytest.raises(gpuload.ConfigError, match="'f'"):
        resolve_outputs(pa.schema([("f", dtype)]), None, fill_nulls={"f": fill})
    assert resolve_outputs(pa.schema([("f", dtype)]), None, fill_nulls={"f": float("nan")})[0].fills == (
        pytest.approx(float("nan"), nan_ok=True),)


@pytest.mark.parametrize("fill", [0.5, float("nan"), -1])
def test_one_fill_for_every_column_fills_those_it_fits(fill):
    """A user's trial: fill_nulls=0.5 (or NaN) with an integer column loaded too was refused as
    fill_nulls={'i': 0.5}, which they never wrote, though that column holds no nulls; a single
    number fills the columns it fits, and is refused only where it fits none."""
    specs = {s.name: s for s in resolve(["i", "f", "u", "b"], fill_nulls=fill)}
    assert specs["f"].fills[0] == pytest.approx(fill, nan_ok=True)
    assert specs["i"].fills == ((fill,) if fill == -1 else (None,)) and specs["u"].fills == (None,)
    assert specs["b"].fills == (None,)
    with pytest.raises(gpuload.ConfigError, match=r"^fill_nulls=0\.5 fits none of the loaded columns .*'u' \(uint"):
        resolve(["u", "b"], fill_nulls=0.5)  # it fits none of them: refused, as the user wrote it


def test_a_decimal_wider_than_38_digits_is_refused_naming_the_limit():
    with pytest.raises(gpuload.SchemaError, match=r"'d' has type decimal256\(40, 2\).*decimals of up to 38 digits"):
        resolve_outputs(pa.schema([("d", pa.decimal256(40, 2))]), ["d"])
