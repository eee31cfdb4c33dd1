"""Shared test set-up.

* the ``gpu`` marker skips cleanly where no GPU is usable;
* ``tmp_cache``: a fresh, empty cache directory under ``tmp_path`` (also set as
  ``$GPULOAD_CACHE_DIR``, so a dataset opened without ``cache_dir=`` never touches
  ``~/.cache``);
* ``write_parquet(path, table, row_group_size)``: a plain function (``from conftest
  import write_parquet``) and a fixture of the same name returning it.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_parquet(path, table, row_group_size: int | None = None, **kwargs) -> Path:
    """Write ``table`` (a ``pa.Table`` or a dict of columns) to ``path`` with row groups
    of ``row_group_size`` rows (None: one row group); creates parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(table, pa.Table):
        table = pa.table(table)
    pq.write_table(table, path, row_group_size=row_group_size or max(table.num_rows, 1), **kwargs)
    return path


@pytest.fixture(name="write_parquet")
def _write_parquet_fixture():
    return write_parquet


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(path))
    return path
