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



def test_a_source_of_empty_files_is_refused_naming_them(tmp_path, write_parquet):
    for n in (1, 4):
        paths = [write_parquet(tmp_path / f"s{n}" / f"part{i}.parquet", {"x": np.arange(0)}) for i in range(n)]
        said = "the 1 file of the source holds no rows" if n == 1 else "the 4 files of the source hold no rows"
        with pytest.raises(gpuload.SourceError, match=said) as e:
            gpuload.ParquetDataset(tmp_path / f"s{n}", ["x"], batch_size=4, cache_dir=tmp_path / "c", device="cpu")
        assert str(paths[0]) in str(e.value) and (n == 1 or str(e.value).count("part") == 3)


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


# ---------------------------------------------------------------------------------------
# the first epoch's chunks reuse host memory
# ---------------------------------------------------------------------------------------

def test_decoded_chunks_are_packed_into_reused_host_buffers(tmp_path):
    """A decoded chunk's blocks come from the reader's host pool, as cache reads do: chunks
    decoded one after another refill one buffer instead of faulting in new pages, with pyarrow's values."""
    import pyarrow as pa

    import gpuload

    data = tmp_path / "data"
    data.mkdir()
    tables = []
    for f in range(2):  # one chunk per file; its int64 block (40,000 x 4) is over the pool's 1 MiB floor
        ids = np.arange(f * 40_000, (f + 1) * 40_000, dtype=np.int64)
        tables.append(pa.table({"a": ids, "b": ids * 3, "c": -ids, "d": ids % 7}))
        pq.write_table(tables[-1], data / f"part-{f}.parquet")
    ds = gpuload.ParquetDataset(data, ["a", "b", "c", "d"], batch_size=1000, cache_dir=tmp_path / "cache",
                                device="cpu", prefetch=0)
    r = ds.reader
    try:
        assert [c.rows for c in r.chunks] == [40_000, 40_000]
        first = r._stored(0)["#<i8"]
        where = first.ctypes.data
        assert any(np.shares_memory(first, b) for b in r.read_pool._bufs)
        np.testing.assert_array_equal(first[:, 1], tables[0]["b"].to_numpy())
        del first
        second = r._stored(1)["#<i8"]
        assert second.ctypes.data == where and any(np.shares_memory(second, b) for b in r.read_pool._bufs)
        for j, name in enumerate("abcd"):
            np.testing.assert_array_equal(second[:, j], tables[1][name].to_numpy())
    finally:
        ds.close()
