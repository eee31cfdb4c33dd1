"""Exceptions raised on purpose by gpuload.

Every error a user can cause derives from :class:`GpuloadError`, names the file,
column or setting involved, and says what to do about it. The CLI prints these as
one line and exits non-zero.
"""

from __future__ import annotations

__all__ = [
    "GpuloadError",
    "ConfigError",
    "SourceError",
    "SchemaError",
    "NullValuesError",
    "CacheError",
    "CorruptCacheError",
]


class GpuloadError(Exception):
    """Base class of every error gpuload raises on purpose."""


class ConfigError(GpuloadError, ValueError):
    """A setting (argument, environment variable) has an unusable value."""


class SourceError(GpuloadError):
    """A source path cannot be listed, opened or read as Parquet."""


class SchemaError(GpuloadError):
    """A selected column is missing, has an unsupported type, or differs across files."""


class NullValuesError(GpuloadError):
    """A selected column holds nulls and no ``fill_nulls`` value was given for it."""


class CacheError(GpuloadError):
    """The cache directory cannot be used (permissions, missing source for a rebuild)."""


class CorruptCacheError(CacheError):
    """A cache entry failed verification (bad header, size or checksum)."""
