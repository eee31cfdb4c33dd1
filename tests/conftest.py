"""Shared test set-up.

* the ``gpu`` marker skips cleanly where the GPU path cannot run (no driver, CuPy or KvikIO);
* ``device``: runs a test once with ``"cpu"`` and once with ``"cuda"`` (marked ``gpu``);
* ``tmp_cache``: a fresh, empty cache directory under ``tmp_path`` (also set as
  ``$GPULOAD_CACHE_DIR``, so a dataset opened without ``cache_dir=`` never touches
  ``~/.cache``);
* ``write_parquet(path, table, row_group_size)``: a plain function (``from conftest
  import write_parquet``) and a fixture of the same name returning it;
* ``ManualClock``: a clock for ``Metrics(clock=...)`` that moves only when a test moves it.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _gpu_reason() -> str | None:
    from gpuload.gpu import gpu_status

    missing = {k: v for k, v in gpu_status().items() if v is not None and k != "cudf"}
    return None if not missing else "; ".join(f"{k}: {v}" for k, v in missing.items())


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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Runs a test body on the CPU and, where the GPU path can run, on the GPU."""
    return request.param


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(path))
    return path


class ManualClock:
    """A clock for ``Metrics(clock=...)``: seconds that move only when the test moves them."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
