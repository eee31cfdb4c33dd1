"""The command's flags as gpuload reads them (gpuload/tools/flags.py); through the real command: tests/test_cli.py."""

import math

import pytest

import gpuload
from gpuload.tools.flags import _fill


def test_fill_nulls_takes_json_and_numbers_as_python_writes_them():
    assert _fill('{"a": 0, "b": NaN}')["a"] == 0 and math.isnan(_fill('{"a": 0, "b": NaN}')["b"])
    assert _fill("7") == 7 and _fill("-1.5") == -1.5 and _fill("inf") == math.inf and _fill("-Infinity") == -math.inf
    assert math.isnan(_fill("nan")) and math.isnan(_fill("NaN"))  # a new user's "nan" was refused as no number
    assert _fill("1_000") == 1000 and _fill("+9007199254740993") == 2**53 + 1  # an int stays exact
    assert _fill(None) is None
    with pytest.raises(gpuload.ConfigError, match="--fill-nulls 'zero': give a number or a JSON object"):
        _fill("zero")


def test_no_pack_files_reaches_the_settings_and_its_absence_leaves_the_default():
    import argparse

    from gpuload.tools.flags import add_chunk_flags, loader_settings

    p = argparse.ArgumentParser()
    add_chunk_flags(p)
    assert loader_settings(p.parse_args(["--no-pack-files"]))["pack_files"] is False
    assert "pack_files" not in loader_settings(p.parse_args([]))
