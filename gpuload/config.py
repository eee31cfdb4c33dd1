"""Configuration: every loader setting in one typed, validated place.

Defaults come from the arguments' defaults, then environment variables where noted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cache.store import default_cache_dir
from .errors import ConfigError, setting, value

__all__ = ["Options", "MiB"]

MiB = 1 << 20


def _positive_int(name: str, given: Any, minimum: int = 1) -> int:
    """``given``, an integer of at least ``minimum``, else a :class:`ConfigError` naming the
    setting as the user gave it (``num_threads=0`` in Python, ``--threads 0`` from the command)."""
    if isinstance(given, bool) or not isinstance(given, int) or given < minimum:
        raise ConfigError(f"{setting(name, given)} must be an integer >= {value(name, minimum)}"
                          if isinstance(given, int) and not isinstance(given, bool) else
                          f"{setting(name, given)} must be an integer")
    return given


@dataclass(frozen=True)
class Options:
    """Settings of a :class:`gpuload.ParquetDataset` (see its docstring for each)."""

    batch_size: int = 65536
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    cache_dir: Path | None = None
    device: str = "auto"
    chunk_bytes: int = 64 * MiB
    shuffle_window: int = 4
    prefetch: int = 2
    num_threads: int = 2
    max_cache_bytes: int | None = None
    verify_checksums: bool | str = True
    decode: str = "auto"
    max_device_bytes: int | None = None
    kvikio_threads: int = 4
    kvikio_compat: str = "auto"
    layout: str = "rows"
    block_rows: int | None = None  # set: block shuffling (``shuffle="block"``), in blocks of this many rows

    @classmethod
    def shuffle_mode(cls, shuffle, block_rows) -> tuple[bool, int | None]:
        """``(shuffle, block_rows)`` fields of ``shuffle=`` (True, False or ``"block"``) and
        ``block_rows=`` as the public API takes them."""
        if isinstance(shuffle, str) and shuffle == "block":
            return True, _positive_int("block_rows", block_rows)
        if isinstance(shuffle, (bool, np.bool_)):
            return bool(shuffle), None
        raise ConfigError(f"shuffle={shuffle!r} must be True (rows permuted in windows), 'block' or False")

    def __post_init__(self):
        _positive_int("batch_size", self.batch_size)
        _positive_int("shuffle_window", self.shuffle_window)
        _positive_int("prefetch", self.prefetch, 0)
        _positive_int("num_threads", self.num_threads)
        _positive_int("chunk_bytes", self.chunk_bytes, 4096)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"{setting('seed', self.seed)} must be an integer")
        if self.verify_checksums not in (True, False, "always"):
            raise ConfigError(f"verify_checksums={self.verify_checksums!r} must be True, False or 'always'")
        if self.max_cache_bytes is not None:
            _positive_int("max_cache_bytes", self.max_cache_bytes, 0)
        if self.max_device_bytes is not None:
            _positive_int("max_device_bytes", self.max_device_bytes)
        _positive_int("kvikio_threads", self.kvikio_threads)
        if self.decode not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"decode={self.decode!r} must be 'auto', 'gpu' or 'cpu'")
        if self.kvikio_compat not in ("auto", "on", "off"):
            raise ConfigError(f"kvikio_compat={self.kvikio_compat!r} must be 'auto', 'on' or 'off'")
        if self.layout not in ("rows", "columns"):
            raise ConfigError(f"{setting('layout', self.layout)} must be 'rows' or 'columns'")
        if self.block_rows is not None:
            _positive_int("block_rows", self.block_rows)
            if not self.shuffle:
                raise ConfigError("block_rows is for shuffle='block'")
        cache = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        object.__setattr__(self, "cache_dir", Path(os.fspath(cache)).expanduser())
        if not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))
