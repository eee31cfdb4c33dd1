"""Casts: an output's values as the dtype it asks for, the same bytes on the CPU and the GPU.

:func:`cast_values` is what :mod:`gpuload.convert` (NumPy) and :mod:`gpuload.gpu.cudf_decode` (CuPy)
call for ``dtypes=`` and stacked groups' common types: casts to floats round to nearest once but never
make a finite value an infinity, casts to integers or bool keep every value exactly, and what cannot
be kept is refused by column and value. :func:`may_overflow` is the open-time check's question
(:func:`gpuload.checks.check_casts`, from the footers' statistics).
"""

from __future__ import annotations

import math

import numpy as np

from .batch import _xp
from .dtypes import BFLOAT16
from .errors import ConfigError, flag

__all__ = ["cast_values", "may_overflow", "quiet_nans"]

_QUIET_NAN = {2: 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}  # NumPy's NaN per float size (no sign, no payload)
_BF16_NAN = 0x7FC0  # torch's bfloat16 NaN on the CPU


def _bfloat16_bits(values):
    """``values`` (NumPy or CuPy) rounded to bfloat16 as torch does, as uint16 bit patterns
    (every NaN as 0x7FC0: torch's CUDA rounding gives 0x7FFF where its CPU one gives 0x7FC0)."""
    import torch

    if isinstance(values, np.ndarray):
        t = torch.from_numpy(np.array(values, copy=not values.flags.writeable, order="C"))
        bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    else:
        import cupy  # on the GPU path torch's current stream is the loader's, as CuPy's

        # into CuPy's (the loader's) memory, guarded for the consumer like every loader buffer,
        # not into a tensor torch allocates on its own, which nothing would guard
        out = cupy.empty(values.shape, dtype=cupy.int16)
        torch.from_dlpack(out).view(torch.bfloat16).copy_(torch.from_dlpack(cupy.ascontiguousarray(values)))
        bits = out.view(cupy.uint16)
    if values.dtype.kind == "f":
        bits[_xp(values).isnan(values)] = _BF16_NAN
    return bits


def quiet_nans(out):
    """``out`` (floats, NumPy or CuPy) with every NaN the positive quiet NaN of its type, copied
    first where it is read-only and holds one: the bits a cast NaN gets on every device."""
    nan = _xp(out).isnan(out)
    if bool(nan.any()):
        if not getattr(out.flags, "writeable", True):
            out = out.copy()
        out.view(f"u{out.itemsize}")[nan] = _QUIET_NAN[out.itemsize]
    return out


def may_overflow(src: np.dtype, dst: np.dtype) -> bool:
    """Whether a finite value of ``src`` can lie beyond float ``dst``'s range (a cast makes it an infinity)."""
    top = np.iinfo(src).max if src.kind in "iu" else np.finfo(src).max if src.kind == "f" else 0
    return float(top) > float(np.finfo(dst).max)


def _overflow(column: str, value, where: str, dtype: str, top: float) -> ConfigError:
    """The refusal of a float cast that would make the finite ``value`` an infinity."""
    return ConfigError(f"column {column!r} holds {value!r} in {where}, beyond the range of {dtype} (its largest "
                       f"magnitude is about {top:g}): the cast would make it an infinity; choose a wider dtype in "
                       f"{flag('dtypes')} (or none), or scale the column first")


def cast_values(values, dtype: str, column: str, where: str, exact: str = ""):
    """``values`` (NumPy or CuPy) as ``dtype``. Casts to floats may round, but a finite value
    beyond the float's range (an infinity once cast) is refused; casts to integers or bool must
    keep every value exactly; :class:`ConfigError` names the column and the value.
    ``"bfloat16"`` gives the uint16 bit patterns of torch's rounding. ``exact``: the name of a
    stacked output whose float dtype is its columns' common type (:attr:`OutputSpec.exact`):
    integers must then keep their value in it too.

    The same bytes on the CPU and the GPU: a cast float NaN becomes the positive quiet NaN
    of its new type (CUDA's conversions give other bit patterns than NumPy's), and a float
    outside an integer type's range is refused (NumPy wraps it, CUDA saturates it)."""
    if dtype == BFLOAT16:
        bits = _bfloat16_bits(values)
        if values.dtype.kind == "f" and bool((made := _xp(values).isfinite(values) & (
                (bits & 0x7FFF) == 0x7F80)).any()):  # a finite value rounded to an infinity
            raise _overflow(column, values[int(made.argmax())].item(), where, "bfloat16", 3.39e38)
        return bits
    dst = np.dtype(dtype)
    if values.dtype == dst:
        return values
    with np.errstate(invalid="ignore", over="ignore"):  # checked below for integers; floats may round
        out = values.astype(dst)
    if dst.kind == "f" and values.dtype.kind == "f":
        out = quiet_nans(out)
    if dst.kind in "biu" and not np.can_cast(values.dtype, dst, "safe"):
        with np.errstate(invalid="ignore", over="ignore"):  # a value must come back unchanged, with its sign
            bad = (out.astype(values.dtype) != values) | ((out < 0) != (values < 0))
            if dst.kind in "iu" and values.dtype.kind == "f":  # and lie in the integer type's range (compared in
                info = np.iinfo(dst)  # the values' dtype, where float16 rounds int32's bounds to infinities: so
                bad |= ~_xp(values).isfinite(values)  # an infinity is refused by name, not by the range)
                bad |= (values < float(info.min)) | (values >= 2.0 ** (info.bits - (info.min < 0)))
        if bool(bad.any()):
            v = values[int(bad.argmax())].item()
            if isinstance(v, float) and not (math.isfinite(v) and v == int(v)):  # 0.5, NaN: no integer type holds it
                raise ConfigError(f"column {column!r} holds {v!r} in {where}, not a whole number, which no integer "
                                  f"dtype holds; keep a float dtype in {flag('dtypes')} (or none), or round the column "
                                  "first")
            raise ConfigError(f"column {column!r} holds {v!r} in {where}, which {dst} cannot represent; "
                              f"choose a wider dtype in {flag('dtypes')} (or none)")
    elif dst.kind == "f" and may_overflow(values.dtype, dst) and bool(_xp(out).isinf(out).any()) and bool(
            (made := _xp(values).isfinite(values) & _xp(out).isinf(out)).any()):  # a finite value made an infinity
        raise _overflow(column, values[int(made.argmax())].item(), where, str(dst), float(np.finfo(dst).max))
    if exact and dst.kind == "f" and values.dtype.kind in "iu":
        top = 2 ** (np.finfo(dst).nmant + 1)  # every integer up to it is exact in dst, some beyond it are not
        bad = values > top
        if values.dtype.kind == "i":
            bad |= values < -top
        if bool(bad.any()):
            v = values[int(bad.argmax())].item()
            raise ConfigError(f"column {column!r} holds {v!r} in {where}, which output {exact!r} ({dst}: the common "
                              f"type of its stacked columns) cannot hold exactly (integers only up to 2**"
                              f"{np.finfo(dst).nmant + 1}); name its dtype in {flag('dtypes')} (float64 accepts "
                              f"the rounding), or stack {column!r} apart")
    return out
