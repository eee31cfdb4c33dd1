"""Output dtypes: the names ``dtypes=`` takes, and how each is stored.

An output dtype is a NumPy dtype string (``"<f4"``) or ``"bfloat16"``, which NumPy lacks: it
is stored as its 16-bit pattern (:func:`storage_dtype`, uint16) and handed to torch as
``torch.bfloat16``. :func:`numpy_dtype` maps Arrow's boolean, integer and float types.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa

from .errors import ConfigError

__all__ = ["BFLOAT16", "storage_dtype", "parse_dtype", "numpy_dtype"]

BFLOAT16 = "bfloat16"  # an output dtype NumPy lacks: stored as uint16 bit patterns


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype an output of ``dtype`` is stored in (``"bfloat16"``: uint16)."""
    return np.dtype("<u2") if dtype == BFLOAT16 else np.dtype(dtype)


#: dtypes every torch this package supports takes from NumPy, checked without importing torch
_TORCH_TAKES = frozenset(np.dtype(t).newbyteorder("=").str for t in
                         ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"))


def parse_dtype(value, what: str) -> str:
    """A ``dtypes=`` value as an output dtype string: a NumPy dtype or its name, a torch
    dtype (``torch.float16``) or its name (``"torch.float16"``), or ``"bfloat16"``.
    torch is imported only for a torch dtype or one whose support depends on torch's version
    (a cache build on the CPU runs without torch's import)."""
    if isinstance(value, str) and value.startswith("torch."):
        import torch

        value = getattr(torch, value[6:], value)
    torch = sys.modules.get("torch")  # a torch dtype given means torch is imported
    if torch is not None and isinstance(value, torch.dtype):
        if value == torch.bfloat16:
            return BFLOAT16
        try:
            value = torch.empty(0, dtype=value).numpy().dtype
        except (TypeError, RuntimeError):
            raise ConfigError(f"{what}={value} has no NumPy equivalent") from None
    if isinstance(value, str) and value == BFLOAT16:
        return BFLOAT16
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise ConfigError(f"{what}={value!r} is not a dtype ({e}): give a numeric one such as float32, int32, "
                          "bfloat16 or torch.float16") from None
    if dtype.kind not in "biuf":
        raise ConfigError(f"{what}={dtype} is not a numeric dtype (bool, integers, floats, bfloat16)")
    dtype = dtype.newbyteorder("=")  # the cache and torch hold native byte order; the values are the same
    if dtype.str not in _TORCH_TAKES:
        import torch

        try:
            torch.from_numpy(np.empty(0, dtype))
        except TypeError:
            raise ConfigError(f"{what}={dtype}: torch has no such dtype; choose one of bool, (u)int8-64, float16/32/64 "
                              "or bfloat16") from None
    return dtype.str


def numpy_dtype(t: pa.DataType) -> np.dtype:
    """The NumPy dtype of a boolean, integer or floating Arrow type. Not ``to_pandas_dtype()``:
    pyarrow 25 imports pandas there (0.1-0.3 s, on the first open and in a loader thread's first chunk)."""
    if pa.types.is_boolean(t):
        return np.dtype(bool)
    kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
    return np.dtype(f"{kind}{t.bit_width // 8}")
