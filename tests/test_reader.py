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


# -- packs of small files (gpuload.packs.pack_small) ------------------------------------------------
def _by_id(folder) -> dict:
    t = pq.read_table(folder, columns=["row_id", "x", "tags"]).to_pydict()
    return {i: (x, tags) for i, x, tags in zip(t["row_id"], t["x"], t["tags"])}


def _epoch(ds, epoch: int) -> list[tuple[int, float, list]]:
    ds.set_epoch(epoch)
    out = []
    for b in ds:
        offsets, values = b["tags"].offsets.cpu().numpy(), b["tags"].values.cpu().numpy()
        out += [(int(i), float(x), values[offsets[k]:offsets[k + 1]].tolist())
                for k, (i, x) in enumerate(zip(b["row_id"].cpu().numpy(), b["x"].cpu().numpy()))]
    return out


@pytest.mark.parametrize("shuffle", [True, False, "block", "chunks"])
def test_small_files_are_packed_and_each_row_comes_once_with_its_values(small_files, tmp_path, shuffle):
    root, _, total = small_files
    want = _by_id(root)
    kw = dict(batch_size=97, device="cpu", cache_dir=tmp_path / "c", shuffle=shuffle, seed=5)
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], **kw)
    packs = [c for c in ds.reader.chunks if c.parts]
    assert packs and sum(len(c.parts) for c in packs) >= 30 and len(ds.reader.chunks) <= 30
    first = [_epoch(ds, e) for e in (0, 1)]
    ds.close()
    for rows in first:
        assert sorted(i for i, _, _ in rows) == list(range(total))  # every row once
        assert all(want[i] == (x, tags) for i, x, tags in rows)  # as pyarrow reads it
    again = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], **kw)
    assert again.reader.cached_at_open == set(range(len(again.reader.chunks)))  # restarts read no Parquet
    assert [_epoch(again, e) for e in (0, 1)] == first  # the same order from the packs' cache files
    again.close()


def test_packs_on_every_device_equal_pyarrow(small_files, tmp_path, device_decode):
    """A pack on a GPU: its files decoded one by one (cuDF, or pyarrow then copied) and joined there."""
    device, decode = device_decode
    root, _, total = small_files
    want = _by_id(root)
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], batch_size=97, device=device, decode=decode,
                                cache_dir=tmp_path / "c", seed=2)
    assert any(c.parts for c in ds.reader.chunks)
    for epoch in (0, 1):  # built, then read from the cache
        rows = _epoch(ds, epoch)
        assert sorted(i for i, _, _ in rows) == list(range(total))
        assert all(want[i] == (x, tags) for i, x, tags in rows)
    ds.close()


def _pack_files(cache) -> list:
    """The packs' cache files (their headers name several files)."""
    from gpuload.cache.chunkfile import read_chunk

    return sorted(p for p in (cache / "v3").glob("*/*.glc") if read_chunk(p, verify=False)[0].get("members"))


def test_a_rewritten_small_file_rebuilds_its_pack_alone_and_replaces_the_old_version(small_files, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(small_files[0], root)
    cache = tmp_path / "c"
    kw = dict(batch_size=64, device="cpu", cache_dir=cache)
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], **kw)
    _epoch(ds, 0)
    ds.close()
    packs = _pack_files(cache)
    victim = root / "part-030.parquet"
    t = pq.read_table(victim)
    pq.write_table(t.set_column(1, "x", pa_array(np.full(t.num_rows, 7.5))), victim)
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], **kw)
    redone = [i for i, c in enumerate(ds.reader.chunks) if i not in ds.reader.cached_at_open]
    assert len(redone) == 1 and any(str(victim) == ds.reader.files[p.file].path for p in ds.reader.chunks[redone[0]].parts)
    rows = _epoch(ds, 0)
    ds.reader.cache.flush()
    ds.close()
    ids = set(t.column("row_id").to_pylist())
    assert all(x == 7.5 for i, x, _ in rows if i in ids) and sum(i in ids for i, _, _ in rows) == len(ids)
    after = _pack_files(cache)
    assert len(after) == len(packs) and len(set(after) - set(packs)) == 1  # the old version deleted, others kept


def pa_array(values):
    import pyarrow as pa

    return pa.array(values)


def test_another_listing_of_the_same_files_keeps_its_own_packs(small_files, tmp_path):
    """Two datasets over overlapping sets of small files pack them differently: each keeps its own packs
    (a pack's folder is named by its files), neither deletes the other's as an old version."""
    _, paths, _ = small_files
    cache = tmp_path / "c"
    kw = dict(batch_size=64, device="cpu", cache_dir=cache)
    packed = []
    for source in ([str(p) for p in paths], [str(p) for p in paths if not p.name.endswith("5.parquet")]):
        ds = gpuload.ParquetDataset(source, ["row_id", "x"], **kw)
        packed.append({tuple(p.file for p in c.parts) for c in ds.reader.chunks if c.parts})
        sum(1 for _ in ds)
        ds.reader.cache.flush()
        ds.close()
    assert len(_pack_files(cache)) > len(packed[0])  # packs of each listing
    ds = gpuload.ParquetDataset([str(p) for p in paths], ["row_id", "x"], **kw)
    assert ds.reader.cached_at_open == set(range(len(ds.reader.chunks)))  # the first's are all there still
    ds.close()


def test_cache_verify_checks_a_packs_files_against_its_name(small_files, tmp_path):
    from gpuload.cache import admin
    from gpuload.cache.fs import CacheRoot

    root, _, _ = small_files
    cache = tmp_path / "c"
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], batch_size=64, device="cpu", cache_dir=cache)
    _epoch(ds, 0)
    ds.reader.cache.flush()
    ds.close()
    croot = CacheRoot(cache)
    assert admin.verify_all(croot) == []
    summary = admin.summary(croot)["sources"]
    assert any("files packed after it" in name for name in summary)
    a, b = _pack_files(cache)[:2]
    a.replace(b.parent / a.name)  # a pack's file in another pack's folder: its files are not that folder's
    (bad,) = admin.verify_all(croot)
    assert bad.kind == "corrupt" and "packs" in bad.problem
    b.write_bytes((b.parent / a.name).read_bytes())  # under another pack's name, in its folder
    (b.parent / a.name).unlink()
    (bad,) = admin.verify_all(croot)
    assert bad.path == b and "packs" in bad.problem
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], batch_size=64, device="cpu", cache_dir=cache)
    want = _by_id(root)
    rows = _epoch(ds, 0)  # the impostor is refused and its pack built again, from its own files
    ds.reader.cache.flush()
    ds.close()
    assert sorted(i for i, _, _ in rows) == sorted(want) and all(want[i] == (x, t) for i, x, t in rows)


def _in_a_pack(ds, path) -> bool:
    return any(ds.reader.files[p.file].path == str(path) for c in ds.reader.chunks for p in c.parts)


def test_a_corrupt_file_in_a_pack_is_named_and_nothing_of_its_pack_is_cached(small_files, tmp_path):
    """A page that cannot be decoded (the footer is fine: the open cannot tell) fails the pack's
    build naming its own file; the pack is not cached, the others are."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(small_files[0], root)
    bad = root / "part-020.parquet"
    kw = dict(batch_size=64, device="cpu", cache_dir=tmp_path / "c", shuffle=False)
    raw = bytearray(bad.read_bytes())
    raw[4:60] = b"\xff" * 56  # the first column's first page header and data
    bad.write_bytes(bytes(raw))
    ds = gpuload.ParquetDataset(root, ["row_id", "x"], **kw)
    assert _in_a_pack(ds, bad)
    with pytest.raises(gpuload.SourceError, match=r"part-020\.parquet \(row groups 0-0\)"):
        list(ds)
    ds.reader.cache.flush()
    where = next(i for i, c in enumerate(ds.reader.chunks) if any(
        ds.reader.files[p.file].path == str(bad) for p in c.parts))
    assert not ds.reader.is_cached(where)
    ds.close()


def test_a_null_a_filter_keeps_in_a_packed_file_names_that_file(small_files, tmp_path):
    """With a row filter the open does not check nulls (those in rows it drops do not count): the
    conversion of a pack's rows, all at once, finds it, and names the file it is in."""
    import shutil

    import pyarrow as pa

    root = tmp_path / "data"
    shutil.copytree(small_files[0], root)
    bad = root / "part-020.parquet"
    t = pq.read_table(bad)
    pq.write_table(t.set_column(1, "x", pa.array([None] + t.column("x").to_pylist()[1:], pa.float64())), bad)
    ds = gpuload.ParquetDataset(root, ["row_id", "x"], batch_size=64, device="cpu", cache_dir=tmp_path / "c",
                                filters=[("row_id", ">=", 0)])
    assert _in_a_pack(ds, bad)
    with pytest.raises(gpuload.GpuloadError, match=r"part-020\.parquet") as e:
        list(ds)
    assert "'x'" in str(e.value) and "null" in str(e.value) and "packed" not in str(e.value)
    ds.close()


@pytest.mark.parametrize("kw", [{"pack_files": False}, {"shard": "node", "world_size": 2, "rank": 0,
                                                           "local_world_size": 1}])
def test_pack_files_false_and_node_shards_keep_a_chunk_per_file(small_files, tmp_path, kw):
    root, paths, _ = small_files
    ds = gpuload.ParquetDataset(root, ["row_id"], batch_size=64, device="cpu", cache_dir=tmp_path / "c", **kw)
    assert len(ds.reader.chunks) == len(paths) and not any(c.parts for c in ds.reader.chunks)
    ds.close()
