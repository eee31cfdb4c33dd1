"""Exceptions raised on purpose by gpuload.

Every error a user can cause derives from :class:`GpuloadError`, names the file,
column or setting involved, and says what to do about it. The CLI prints these as
one line and exits non-zero.

Messages name the setting that fixes a problem with :func:`setting`, which writes it
the way the user gave it: ``fill_nulls={'f3': 0}`` in Python, ``--fill-nulls '{"f3": 0}'``
from the ``gpuload`` command (which calls :func:`set_style`).
"""

from __future__ import annotations

import json

__all__ = [
    "GpuloadError",
    "ConfigError",
    "SourceError",
    "SchemaError",
    "NullValuesError",
    "CacheError",
    "CorruptCacheError",
    "setting",
    "set_style",
]

_style = "python"
_FLAGS = {"fill_nulls": "--fill-nulls", "columns": "--columns", "dtypes": "--dtypes", "batch_size": "--batch-size",
          "cache_dir": "--cache-dir", "device": "--device", "num_threads": "--threads", "prefetch": "--prefetch"}


def set_style(style: str) -> None:
    """``"cli"`` or ``"python"`` (default): how :func:`setting` writes settings in messages."""
    global _style
    _style = style


def setting(name: str, value) -> str:
    """How to pass ``value`` for setting ``name``, in the language the user is speaking."""
    if _style == "cli" and name in _FLAGS:
        if isinstance(value, (dict, list)):
            return f"{_FLAGS[name]} '{json.dumps(value)}'"
        return f"{_FLAGS[name]} {value}"
    return f"{name}={value!r}"


class GpuloadError(Exception):
    """Base class of every error gpuload raises on purpose."""


class ConfigError(GpuloadError, ValueError):
    """A setting (argument, environment variable) has an unusable value."""


class SourceError(GpuloadError):
    """A source path cannot be listed, opened or read as Parquet."""


class SchemaError(GpuloadError):
    """A selected column is missing, has an unsupported type, or differs across files."""


class NullValuesError(GpuloadError):
    """Selected columns hold nulls and no ``fill_nulls`` value was given for them.

    ``columns``: ``{column: nulls found}`` for every such column found (all of them at
    open; those of one chunk when found while converting).
    """

    def __init__(self, message: str = "", columns: dict | None = None):
        super().__init__(message)
        self.columns = dict(columns or {})

    def __reduce__(self):  # keeps ``columns`` through pickling (errors raised on Dask workers)
        return type(self), (self.args[0] if self.args else "", self.columns)


class CacheError(GpuloadError):
    """The cache directory cannot be used (permissions, missing source for a rebuild)."""


class CorruptCacheError(CacheError):
    """A cache entry failed verification (bad header, size or checksum)."""
