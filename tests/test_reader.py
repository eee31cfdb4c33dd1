"""The reader (gpuload/reader.py, ChunkReader) behind a dataset: the chunks it plans from the
files it lists, and every chunk load routed through the cache (a cached epoch opens no Parquet file).
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import gpuload.decode


pytestmark = pytest.mark.usefixtures("no_leftover_threads")


def test_empty_files_contribute_no_chunks(mixed, tmp_path):
    """0-row files contribute no chunk and no batch, wherever they sort."""
    ds = mixed.open(tmp_path / "cache", shuffle=False)
    assert len(ds.reader.files) == 6
    assert all(c.rows > 0 for c in ds.reader.chunks)
    assert sum(c.rows for c in ds.reader.chunks) == mixed.ref.n


# ---------------------------------------------------------------------------------------
# later epochs read the cache only
# ---------------------------------------------------------------------------------------

def test_second_epoch_opens_no_parquet_file(click, tmp_path, monkeypatch):
    opened = []
    real = pq.ParquetFile

    def counting(*a, **k):
        opened.append(a[0] if a else k.get("source"))
        return real(*a, **k)

    def forbidden(name):
        def f(*a, **k):
            raise AssertionError(f"pyarrow.parquet.{name} called during a cached epoch")
        return f

    monkeypatch.setattr(pq, "ParquetFile", counting)
    monkeypatch.setattr(gpuload.decode.pq, "ParquetFile", counting)
    ds = click.open(tmp_path / "cache")
    list(ds)
    assert opened, "the counting patch did not see the first epoch's reads"
    ds.reader.cache.flush()
    other = click.open(tmp_path / "cache", seed=4)  # opening reads footers: allowed

    opened.clear()
    for name in ("read_table", "read_metadata", "read_schema", "ParquetDataset", "read_pandas"):
        monkeypatch.setattr(pq, name, forbidden(name))
    ds.set_epoch(1)
    ids = np.concatenate([click.ref.check(b) for b in ds])
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))
    ids = np.concatenate([click.ref.check(b) for b in other])
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))
    assert opened == []
    assert ds.reader.counters.decoded == len(ds.reader.chunks)
    assert other.reader.counters.decoded == 0
