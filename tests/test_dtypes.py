"""Output dtypes: what ``dtypes=`` takes and refuses, how each is stored, Arrow's numeric types."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gpuload import ConfigError
from gpuload.dtypes import BFLOAT16, numpy_dtype, parse_dtype, storage_dtype

NUMERIC = [pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(),
           pa.uint64(), pa.float16(), pa.float32(), pa.float64()]


@pytest.mark.parametrize("t", NUMERIC, ids=str)
def test_numpy_dtype_is_arrows_own(t):
    # pyarrow's own mapping is the reference (gpuload avoids calling it: pyarrow 25 imports pandas there)
    assert numpy_dtype(t) == np.dtype(t.to_pandas_dtype())


@pytest.mark.parametrize("given, expected", [
    ("float32", "<f4"), (np.float16, "<f2"), (np.dtype(">i4"), "<i4"), ("int64", "<i8"), ("bool", "|b1"),
    (torch.float16, "<f2"), (torch.int32, "<i4"), (torch.uint8, "|u1"), ("torch.float64", "<f8"),
    (torch.bfloat16, BFLOAT16), ("bfloat16", BFLOAT16), ("torch.bfloat16", BFLOAT16),
])
def test_parse_dtype_accepts_numpy_and_torch_names(given, expected):
    assert parse_dtype(given, "dtypes['x']") == expected


@pytest.mark.parametrize("given, says", [
    ("complex64", "not a numeric dtype"), (torch.complex64, "not a numeric dtype"), ("U8", "not a numeric dtype"),
    ("flaot32", "is not a dtype"), (object, "not a numeric dtype"), ("datetime64[ns]", "not a numeric dtype"),
])
def test_parse_dtype_refuses_what_torch_cannot_hold(given, says):
    with pytest.raises(ConfigError, match=says) as e:
        parse_dtype(given, "dtypes['x']")
    assert "dtypes['x']" in str(e.value)


def test_bfloat16_is_stored_as_its_bit_pattern():
    assert storage_dtype(BFLOAT16) == np.dtype("<u2")
    assert storage_dtype("<f4") == np.dtype("<f4")
    bits = torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.int16).numpy().view(storage_dtype(BFLOAT16))
    assert torch.from_numpy(bits.view("<i2")).view(torch.bfloat16).tolist() == [1.5, -2.0]
