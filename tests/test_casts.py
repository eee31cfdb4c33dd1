"""Casts: refusals by column and value, and the same bytes whatever the device's conversions do."""

from __future__ import annotations

import numpy as np
import pytest

import gpuload
from gpuload.casts import cast_values, may_overflow


@pytest.mark.parametrize("src", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint32", "uint64"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinities_cast_to_integers_are_refused_by_name(value, dtype, src):
    """float16 compares with int32's and int64's bounds rounded to infinities: -inf once passed as INT_MIN."""
    for values in (np.array([1.0, value, 3.0], src), np.array([1.0, value, 3.0], src).view(_Saturating)):
        with pytest.raises(gpuload.ConfigError, match=rf"'x' holds {value!r} in w, not a whole number"):
            cast_values(values, np.dtype(dtype).str, "x", "w")


class _Saturating(np.ndarray):
    """Floats whose casts to integers saturate, as CUDA's do (NumPy's wrap around)."""

    def astype(self, dtype, *args, **kwargs):
        dtype = np.dtype(dtype)
        if dtype.kind in "iu" and self.dtype.kind == "f":
            info = np.iinfo(dtype)
            return np.clip(np.asarray(self, np.float64), info.min, info.max).astype(dtype)
        return np.asarray(self).astype(dtype, *args, **kwargs)


@pytest.mark.parametrize("value, dtype", [(2.0**31, "int32"), (2.0**63, "int64"), (-(2.0**63) * 2, "int64"),
                                          (2.0**64, "uint64"), (70000.0, "uint16")])
def test_float_out_of_integer_range_is_refused_where_casts_saturate(value, dtype):
    """On a GPU 2**31 as float32 becomes INT32_MAX, which comes back as 2**31: the round trip
    alone would let it through."""
    for src in (np.float32, np.float64):
        values = np.array([1.0, value], src).view(_Saturating)
        with pytest.raises(gpuload.ConfigError, match=f"'x' holds .* which {dtype} cannot represent"):
            cast_values(values, np.dtype(dtype).str, "x", "w")
    ok = np.array([1.0, 2.0**31 - 128, -(2.0**31)], np.float32).view(_Saturating)  # in range: kept
    assert cast_values(ok, "<i4", "x", "w").tolist() == [1, 2**31 - 128, -(2**31)]


def test_cast_nans_become_one_pattern():
    """NaNs of either sign or any payload: the positive quiet NaN of the new float type (CUDA's
    conversions give other patterns than NumPy's; the bytes must not depend on the device)."""
    weird = np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF4000000000123],
                     np.uint64).view(np.float64)
    v = np.concatenate([weird, [1.5, -np.inf]])
    assert cast_values(v, "<f2", "x", "w").view(np.uint16).tolist()[:4] == [0x7E00] * 4
    assert cast_values(v, "<f4", "x", "w").view(np.uint32).tolist()[:4] == [0x7FC00000] * 4
    assert cast_values(v, "bfloat16", "x", "w").tolist()[:4] == [0x7FC0] * 4
    assert cast_values(v, "<f4", "x", "w")[4:].tolist() == [1.5, -np.inf]
    assert cast_values(v, "<f8", "x", "w") is v  # no cast: the file's bytes, NaN payloads included


def test_a_bfloat16_cast_that_would_make_a_value_an_infinity_is_refused():
    """A review: bfloat16 casts skipped the float-overflow refusal (1e300 and 3.3999e38 became inf)."""
    import torch

    for bad in (1e300, -3.3999e38):
        with pytest.raises(gpuload.ConfigError, match="beyond the range of bfloat16"):
            cast_values(np.array([1.0, bad]), "bfloat16", "x", "w")
    bits = cast_values(np.array([1.0, 3.3e38, float("inf"), float("nan")]), "bfloat16", "x", "w")
    got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    assert got[0] == 1.0 and torch.isfinite(got[1]) and got[2] == float("inf") and got[3].isnan()


@pytest.mark.parametrize("src, dst, can", [("float64", "float32", True), ("float64", "float16", True),
                                           ("float32", "float16", True), ("int32", "float16", True),
                                           ("uint8", "float16", False), ("int16", "float16", False),
                                           ("int64", "float32", False), ("float32", "float64", False),
                                           ("float16", "float32", False)])
def test_may_overflow_says_whether_a_finite_value_can_lie_beyond_the_float(src, dst, can):
    """The open-time check's question (int16's 32767 fits float16's 65504; int32's 2**31 does not)."""
    assert may_overflow(np.dtype(src), np.dtype(dst)) is can
    if can:  # and then some finite value of src does become an infinity
        top = np.iinfo(src).max if np.dtype(src).kind in "iu" else np.finfo(src).max
        with np.errstate(over="ignore"):
            assert np.isinf(np.array([top], src).astype(dst)[0])
