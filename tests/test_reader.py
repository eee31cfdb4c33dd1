"""The reader (gpuload/reader.py, ChunkReader) behind a dataset: the chunks it plans from the
files it lists, and every chunk load routed through the cache (a cached epoch opens no Parquet file).
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import gpuload
import gpuload.decode
from conftest import write_parquet


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


# ---------------------------------------------------------------------------------------
# cache_io="off": every epoch decodes, nothing is cached or read from the cache
# ---------------------------------------------------------------------------------------

def _copy(b) -> dict:
    """A batch's tensors as NumPy copies (a list column as its values and offsets)."""
    out = {}
    for k, v in b.items():
        parts = (v.values, v.offsets) if isinstance(v, gpuload.Ragged) else (v,)
        out[k] = [t.numpy().copy() for t in parts]
    return out


def _batches(ds, epoch):
    ds.set_epoch(epoch)
    return [_copy(b) for b in ds]


def test_cache_off_decodes_every_epoch_in_the_cached_order_and_writes_no_chunk(click, tmp_path, caplog):
    """The same batches, bit for bit, as a cached dataset's (order is a pure function of seed and
    epoch), pyarrow's values, every row once per epoch; no chunk file or lock is written and none
    already cached is read; no warning about the cache's room."""
    cached = click.open(tmp_path / "cache", batch_size=997)
    want = [_batches(cached, e) for e in (0, 1)]
    cached.reader.cache.flush()
    chunks_before = sorted((tmp_path / "cache").rglob("*.glc"))
    assert len(chunks_before) == len(cached.reader.chunks)

    off_root = tmp_path / "off"
    for root in (off_root, tmp_path / "cache"):  # an empty folder, and one that holds every chunk
        with caplog.at_level("WARNING", logger="gpuload"):  # a budget of 0 would warn, were chunks cached
            ds = click.open(root, batch_size=997, cache_io="off", max_cache_bytes=0)
        assert ds.reader.cached_at_open == set() and not any("has space for" in r.message for r in caplog.records)
        for e in (0, 1):
            ds.reader.counters.reset()
            ds.set_epoch(e)
            got = []
            for b in ds:
                click.ref.check(b)
                got.append(_copy(b))
            assert len(got) == len(want[e])
            for g, w in zip(got, want[e]):
                assert g.keys() == w.keys() and all(np.array_equal(x, y) for k in g for x, y in zip(g[k], w[k]))
            ids = np.concatenate([g["row_id"][0] for g in got])
            assert np.array_equal(np.sort(ids), np.arange(click.ref.n))
            # every chunk once: no next epoch's window decoded ahead (a job of one epoch has none)
            assert ds.reader.counters.from_cache == 0 and ds.reader.counters.decoded == len(ds.reader.chunks)
            assert ds._epochs.ahead.pending is None
        assert ds.loader_description()[1]["cache_io"] == "off"
        ds.close()
    assert not list(off_root.rglob("*.glc")) and not list(off_root.rglob("*.lock"))
    assert sorted((tmp_path / "cache").rglob("*.glc")) == chunks_before


def test_cache_off_resumes_mid_epoch(click, tmp_path):
    """A state taken mid-epoch with cache_io="off" resumes in another dataset to the very batches left."""
    ds = click.open(tmp_path / "a", batch_size=512, cache_io="off")
    ds.set_epoch(3)
    it = iter(ds)
    for _ in range(7):
        next(it)
    state = ds.state_dict()
    rest = [b["row_id"].clone() for b in it]
    other = click.open(tmp_path / "b", batch_size=512, cache_io="off")
    other.load_state_dict(state)
    other.set_epoch(3)
    got = [b["row_id"].clone() for b in other]
    assert len(got) == len(rest) and all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, rest))


def test_building_a_cache_with_cache_off_is_refused(click, tmp_path):
    with pytest.raises(gpuload.ConfigError, match=r"cache_io='off' caches nothing, so there is no cache to build"):
        gpuload.build_cache(click.source, tmp_path / "cache", click.columns, cache_io="off")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.glc"))


def test_the_room_warning_counts_the_chunks_that_fit(tmp_path, caplog):
    """A new user's trial: "space for about 2 of this dataset's 8 chunks" where 4 were cached, each chunk
    file estimated with a 64 KiB header where its header is a few KiB."""
    import glob
    import os

    import gpuload
    from conftest import write_parquet

    n = 120_000
    write_parquet(tmp_path / "d" / "a.parquet", {"id": np.arange(n), "x": np.linspace(0, 1, n),
                                                 "score": np.ones(n, np.float32)}, row_group_size=15_000)
    kw = dict(device="cpu", chunk_bytes=300_000, shuffle=False)
    probe = gpuload.ParquetDataset(tmp_path / "d", cache_dir=tmp_path / "probe", **kw)
    list(probe)
    probe.reader.cache.flush()
    size = max(os.path.getsize(p) for p in glob.glob(str(tmp_path / "probe" / "**" / "*.glc"), recursive=True))
    assert len(probe.reader.chunks) == 8
    with caplog.at_level("WARNING", logger="gpuload"):
        ds = gpuload.ParquetDataset(tmp_path / "d", cache_dir=tmp_path / "c", max_cache_bytes=int(size * 4.5), **kw)
    (said,) = [r.getMessage() for r in caplog.records if "has space for about" in r.getMessage()]
    list(ds)
    ds.reader.cache.flush()
    cached = len(glob.glob(str(tmp_path / "c" / "**" / "*.glc"), recursive=True))
    assert cached == 4 and f"about {cached} of this dataset's 8 chunks" in said, said


def test_a_budget_of_0_is_answered_with_cache_off_not_with_more_space(click, tmp_path, caplog):
    """A user's trial set max_cache_bytes=0 for a one-epoch job and was told to "cache it whole with
    2.1 MiB more space"; the budget was asked for: the warning names cache_io='off'."""
    with caplog.at_level("WARNING", logger="gpuload"):
        ds = click.open(tmp_path / "c", max_cache_bytes=0)
    (said,) = [r.getMessage() for r in caplog.records if "max_cache_bytes" in r.getMessage()]
    assert "those not cached already are decoded from Parquet every epoch" in said and "cache_io='off'" in said \
        and "more space" not in said
    assert sum(len(b["row_id"]) for b in ds) == click.ref.n and ds.reader.counters.from_cache == 0


def test_the_cache_io_reported_is_the_one_in_use_after_a_refused_direct_write(click, tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT turns the writes buffered: stats and diagnose say so
    (they reported the setting asked for, "direct", at open)."""
    import gpuload.cache.store

    real = gpuload.cache.store.write_regions

    def refused(fd, head, regions, arrays, total, direct):  # written buffered; False: O_DIRECT was refused
        return real(fd, head, regions, arrays, total, False) and not direct

    monkeypatch.setattr(gpuload.cache.store, "write_regions", refused)
    ds = click.open(tmp_path / "c", cache_io="direct")
    assert ds.loader_description()[1]["cache_io"] == "direct"
    list(ds)
    ds.reader.cache.flush()
    assert ds.reader.cache.direct_writes is False and ds.stats().loader_settings["cache_io"] == "buffered"
    ds.close()


# ---------------------------------------------------------------------------------------
# memory given back
# ---------------------------------------------------------------------------------------

N = 400_000


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Chunks of a few MiB: large enough for the pools to keep (smaller arrays bypass them)."""
    d = tmp_path_factory.mktemp("wide")
    for f in range(2):
        ids = np.arange(f * N // 2, (f + 1) * N // 2, dtype=np.int64)
        write_parquet(d / f"part-{f}.parquet", {"row_id": ids, "a": ids * 2, "b": ids * 3, "c": ids * 0.5},
                      row_group_size=50_000)
    return d


def _open_wide(wide, cache):
    return gpuload.ParquetDataset(wide, ["row_id", "a", "b", "c"], batch_size=4096, chunk_bytes=2 << 20,
                                  cache_dir=cache, device="cpu")


def _ids(batches) -> np.ndarray:
    return np.sort(np.concatenate([b["row_id"].numpy() for b in batches]))


def _pools(ds) -> int:
    r = ds.reader
    return sum(p.held_bytes for p in (r.read_pool, r.pool, r.batch_pool, r.source_pool))


def test_close_gives_the_pools_memory_back_and_the_dataset_still_iterates(wide, tmp_path):
    """An interactive trial: in a notebook something often still holds a closed dataset (Out[], a traceback), and
    close() kept its pools (120 MiB each at the default chunk size), so re-running a cell grew the process."""
    ds = _open_wide(wide, tmp_path / "cache")
    list(ds)
    assert _pools(ds) > 0
    ds.close()
    assert _pools(ds) == 0
    assert np.array_equal(_ids(ds), np.arange(N))  # new buffers, the same rows
    ds.close()


class Boom(Exception):
    pass


def test_an_error_inside_next_gives_the_pools_memory_back(wide, tmp_path):
    """The same trial: Ctrl-C inside next() in Jupyter keeps the traceback (sys.last_traceback), whose frames hold
    the iteration and the reader. Its pools are emptied when an error ends an iteration (a break keeps them)."""
    ds = _open_wide(wide, tmp_path / "cache")
    list(ds)
    it = iter(ds)
    next(it)
    next(it)
    it.close()  # left with a break: kept for the next epoch
    assert _pools(ds) > 0
    real, calls = ds.reader.load, []

    def failing(i):
        calls.append(i)
        if len(calls) > 2:
            raise Boom("interrupted")
        return real(i)

    ds.reader.load = failing
    kept = []
    with pytest.raises(Boom):
        for b in ds:
            kept.append(b)  # batches the loop still holds
    assert _pools(ds) == 0
    ds.reader.load = real
    assert np.array_equal(_ids(ds), np.arange(N))
    ds.close()
