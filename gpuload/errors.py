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
import operator

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
    "entry",
    "flag",
    "value",
    "integer",
]

_style = "python"
#: The ``gpuload`` command's flag for each setting it takes (``num_threads`` is ``--threads``).
FLAGS = {"fill_nulls": "--fill-nulls", "columns": "--columns", "dtypes": "--dtypes", "batch_size": "--batch-size",
          "cache_dir": "--cache-dir", "device": "--device", "num_threads": "--threads", "prefetch": "--prefetch",
          "nice": "--nice", "cache_io": "--cache-io",
          "chunk_bytes": "--chunk-mib", "max_cache_bytes": "--max-gib", "storage_options": "--storage-options",
          "layout": "--layout", "block_rows": "--block-rows", "shuffle": "--shuffle", "seed": "--seed", "nodes": "--nodes",
          "step_ms": "--step-ms", "model": "--model", "epochs": "--epochs", "workers": "--workers",
          "scheduler": "--scheduler", "categorical": "--categorical", "filters": "--filter"}
#: Settings whose flag takes another unit than the Python argument: (divisor, flag's unit).
_UNITS = {"chunk_bytes": 2**20, "max_cache_bytes": 2**30}


def set_style(style: str) -> None:
    """``"cli"`` or ``"python"`` (default): how :func:`setting` writes settings in messages."""
    global _style
    _style = style


def _in_unit(nbytes, unit: int) -> str:
    """``nbytes`` in ``unit``, as the shortest number that gives these bytes back (the command
    turns ``--max-gib 0.0001`` into ``int(0.0001 * 2**30)`` bytes: say ``0.0001`` again)."""
    for digits in range(1, 18):
        text = f"{nbytes / unit:.{digits}g}"
        if int(float(text) * unit) == nbytes:
            return text
    return f"{nbytes / unit:g}"


def _cli_value(name: str, value):
    if name in _UNITS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _in_unit(value, _UNITS[name])
    if isinstance(value, (dict, list)):  # objects that say how the command takes them (gpuload.Hash) say so
        return f"'{json.dumps(value, default=lambda o: o.as_json())}'"
    return value


def setting(name: str, value) -> str:
    """How to pass ``value`` for setting ``name``, in the language the user is speaking:
    ``num_threads=0`` in Python, ``--threads 0`` from the ``gpuload`` command (sizes in the
    flag's unit: ``chunk_bytes=1048576`` is ``--chunk-mib 1``)."""
    if _style == "cli" and name in FLAGS:
        return f"{FLAGS[name]} {_cli_value(name, value)}"
    return f"{name}={value!r}"


def value(name: str, value) -> str:
    """``value`` of setting ``name`` alone, in the unit the user gives it (``--chunk-mib``: MiB)."""
    return str(_cli_value(name, value)) if _style == "cli" and name in FLAGS else repr(value)


def counted(name: str, given: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``given`` as a Python int (a NumPy integer too), of at least ``minimum`` (and at most ``maximum``, if given), else a
    :class:`ConfigError` naming the setting as the user gave it (``num_threads=0`` in Python,
    ``--threads 0`` from the command)."""
    n = integer(given)
    if n is None:
        raise ConfigError(f"{setting(name, given)} must be an integer")
    if maximum is not None and not minimum <= n <= maximum:
        raise ConfigError(f"{setting(name, given)} must be an integer from {value(name, minimum)} "
                          f"to {value(name, maximum)}")
    if n < minimum:
        raise ConfigError(f"{setting(name, given)} must be an integer >= {value(name, minimum)}")
    return n


def entry(name: str, key) -> str:
    """One entry of a mapping setting, without its value: ``dtypes['f1']`` in Python, ``--dtypes f1``
    from the ``gpuload`` command."""
    return f"{FLAGS[name]} {key}" if _style == "cli" and name in FLAGS else f"{name}[{key!r}]"


def flag(name: str) -> str:
    """The setting ``name`` itself, without a value: ``--dtypes`` from the command, ``dtypes=`` in Python."""
    return FLAGS[name] if _style == "cli" and name in FLAGS else f"{name}="


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


def integer(v) -> int | None:
    """``v`` as a Python int when it is an integer of any kind (``int``, a NumPy or torch
    integer scalar: anything with ``__index__``), else None; booleans are not integers here."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None
