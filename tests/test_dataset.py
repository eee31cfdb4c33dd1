"""Integration tests of ParquetDataset: exactly-once delivery, sharding, determinism,
exact values, cache-only later epochs, bad input, early exit, background errors and
the DataLoader contract.

CPU only, small data: tens of thousands of rows in 64 KiB chunks (tens of chunks).
"""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import gpuload
import gpuload.decode
from gpuload.batch import Ragged
from gpuload.synth import clicklog_columns, write_clicklog

from conftest import wait_no_threads as _wait_no_threads

DENSE, SPARSE = 4, 3
# single-column outputs of one dtype share a row-major block in the default layout (row_id and
# cat_0; dense_0 and dense_1; g1 and g2), beside stacked groups and lists
CLICK_COLUMNS = {**clicklog_columns(DENSE, SPARSE), "row_id": "row_id", "cat_0": "cat_0", "dense_0": "dense_0",
                 "dense_1": "dense_1"}
MIXED_COLUMNS = {"row_id": "row_id", "x": "x", "g": ["g1", "g2"], "h": "h", "g1": "g1", "g2": "g2"}
CHUNK_BYTES = 64 << 10


# ---------------------------------------------------------------------------------------
# data and reference values
# ---------------------------------------------------------------------------------------

def _np(t):
    return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class Reference:
    """Expected outputs, computed with pyarrow alone, looked up by ``row_id``."""

    def __init__(self, table: pa.Table, columns: dict):
        self.table = table
        self.n = table.num_rows
        row_id = table["row_id"].to_numpy()
        self.pos = np.full(int(row_id.max()) + 1 if self.n else 1, -1, dtype=np.int64)
        self.pos[row_id] = np.arange(self.n)
        self.outputs = {}
        for name, src in columns.items():
            if isinstance(src, list):
                self.outputs[name] = ("dense", np.stack([table[c].to_numpy() for c in src], axis=1))
                continue
            col = table[src].combine_chunks()
            if pa.types.is_list(col.type):
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
                off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
                self.outputs[name] = ("ragged", (lengths, off, pc.list_flatten(col).to_numpy()))
            else:
                self.outputs[name] = ("dense", col.to_numpy())

    def check(self, batch: dict) -> np.ndarray:
        """Assert every output of ``batch`` equals pyarrow's values; returns the row_ids."""
        assert set(batch) == set(self.outputs)
        ids = _np(batch["row_id"])
        assert ids.dtype == np.int64 and ids.ndim == 1
        idx = self.pos[ids]
        assert (idx >= 0).all(), "unknown row_id"
        for name, (kind, want) in self.outputs.items():
            got = batch[name]
            if kind == "dense":
                assert isinstance(got, torch.Tensor) and got.device.type == "cpu", name
                assert got.is_contiguous(), name  # in both layouts
                g = _np(got)
                assert g.dtype == want.dtype, (name, g.dtype, want.dtype)
                assert g.shape == (len(ids),) + want.shape[1:], name
                np.testing.assert_array_equal(g, want[idx], err_msg=name)
            else:
                lengths, off, values = want
                assert isinstance(got, Ragged), name
                assert isinstance(got.offsets, torch.Tensor) and isinstance(got.values, torch.Tensor)
                o, v = _np(got.offsets), _np(got.values)
                assert o.dtype == np.int64, name
                assert o.shape == (len(ids) + 1,) and o[0] == 0, name
                assert v.dtype == values.dtype and v.ndim == 1 and len(v) == o[-1], name
                np.testing.assert_array_equal(np.diff(o), lengths[idx], err_msg=name)
                expect = (np.concatenate([values[off[i]:off[i + 1]] for i in idx]) if len(idx)
                          else values[:0])
                np.testing.assert_array_equal(v, expect, err_msg=name)
        return ids


class Data:
    def __init__(self, source, columns, ref):
        self.source, self.columns, self.ref = source, columns, ref

    def open(self, cache, **kw):
        kw.setdefault("batch_size", 997)
        kw.setdefault("chunk_bytes", CHUNK_BYTES)
        kw.setdefault("device", "cpu")
        if kw.get("shuffle") == "block":
            kw.setdefault("block_rows", 64)  # chunks hold ~1000 rows here: many blocks per window
        return gpuload.ParquetDataset(self.source, self.columns, cache_dir=cache, **kw)


def _read_all(paths) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(map(str, paths))])


@pytest.fixture(scope="module")
def click(tmp_path_factory) -> Data:
    """3 click-log files, 20,000 rows, 1000-row row groups: 21 chunks."""
    d = tmp_path_factory.mktemp("click")
    files = write_clicklog(d, rows=20_000, files=3, row_group_rows=1000, dense=DENSE, sparse=SPARSE,
                           list_max=5, seed=3)
    return Data(d, CLICK_COLUMNS, Reference(_read_all(files), CLICK_COLUMNS))


MIXED_SCHEMA = pa.schema([("row_id", pa.int64()), ("x", pa.float64()), ("g1", pa.int32()), ("g2", pa.int32()),
                          ("h", pa.list_(pa.int32()))])


def _mixed_table(start, n, seed):
    rng = np.random.default_rng(seed)
    ids = np.arange(start, start + n, dtype=np.int64)
    lengths = rng.integers(0, 9, n)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table({
        "row_id": ids,
        "x": rng.standard_normal(n),
        "g1": rng.integers(-1000, 1000, n).astype(np.int32),
        "g2": (ids * 7 % 1001).astype(np.int32),
        "h": pa.ListArray.from_arrays(pa.array(off), pa.array(rng.integers(0, 10**6, int(off[-1])).astype(np.int32))),
    }, schema=MIXED_SCHEMA)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Data:
    """Files of different row-group sizes, with 0-row files first and in the middle."""
    d = tmp_path_factory.mktemp("mixed")
    layout = [("00-empty.parquet", 0, 1000), ("01-a.parquet", 3000, 500), ("02-empty.parquet", 0, 64),
              ("03-b.parquet", 4111, 1300), ("04-c.parquet", 2777, 10_000), ("05-d.parquet", 1, 1)]
    start = 0
    for i, (name, n, rg) in enumerate(layout):
        pq.write_table(_mixed_table(start, n, i), d / name, row_group_size=rg)
        start += n
    table = _read_all(sorted(d.glob("*.parquet")))
    assert table.num_rows == start
    return Data(d, MIXED_COLUMNS, Reference(table, MIXED_COLUMNS))


@pytest.fixture(params=["click", "mixed"])
def data(request) -> Data:
    return request.getfixturevalue(request.param)


def _ceil(a, b):
    return -(-a // b)


def _epoch(ds) -> list[dict]:
    return list(ds)


def _ids(batches) -> np.ndarray:
    return np.concatenate([_np(b["row_id"]) for b in batches]) if batches else np.zeros(0, np.int64)


def _same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert list(x) == list(y)
        for k in x:
            if isinstance(x[k], Ragged):
                assert torch.equal(x[k].offsets, y[k].offsets), (i, k)
                assert torch.equal(x[k].values, y[k].values), (i, k)
            else:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (i, k)


pytestmark = pytest.mark.usefixtures("no_leftover_threads")


# ---------------------------------------------------------------------------------------
# exactly once
# ---------------------------------------------------------------------------------------

LAYOUTS = pytest.mark.parametrize("layout", ["rows", "columns"])


@LAYOUTS
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [997, 4096])
@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_every_row_exactly_once(data, tmp_path, shuffle, batch_size, drop_last, layout):
    ref = data.ref
    ds = data.open(tmp_path / "cache", batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, layout=layout)
    assert ds.num_rows == ref.n
    for epoch in (0, 1):  # cold, then warm
        ds.set_epoch(epoch)
        batches = _epoch(ds)
        assert len(batches) == len(ds)
        sizes = [len(b["row_id"]) for b in batches]
        ids = np.concatenate([ref.check(b) for b in batches])
        if drop_last:
            k = ref.n // batch_size
            assert len(ds) == k and sizes == [batch_size] * k
            assert len(np.unique(ids)) == len(ids) == k * batch_size
            if not shuffle:  # file order: the tail is what is dropped
                assert np.array_equal(ids, np.arange(k * batch_size))
        else:
            assert len(ds) == -(-ref.n // batch_size)
            assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and 0 < sizes[-1] <= batch_size
            assert np.array_equal(np.sort(ids), np.arange(ref.n))
            if not shuffle:
                assert np.array_equal(ids, np.arange(ref.n))


def test_empty_files_contribute_no_chunks(mixed, tmp_path):
    """0-row files contribute no chunk and no batch, wherever they sort."""
    ds = mixed.open(tmp_path / "cache", shuffle=False)
    assert len(ds.reader.files) == 6
    assert all(c.rows > 0 for c in ds.reader.chunks)
    assert sum(c.rows for c in ds.reader.chunks) == mixed.ref.n


@LAYOUTS
@pytest.mark.parametrize("shuffle", [True, False, "block"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_ranks_partition_the_epoch(click, tmp_path, world, drop_last, shuffle, layout):
    ref = click.ref
    cache = tmp_path / "cache"
    per_rank, lens = [], []
    for rank in range(world):
        ds = click.open(cache, rank=rank, world_size=world, drop_last=drop_last, shuffle=shuffle, seed=9,
                        layout=layout)
        ds.set_epoch(2)
        batches = _epoch(ds)
        assert len(batches) == len(ds)
        lens.append(len(ds))
        per_rank.append(np.concatenate([ref.check(b) for b in batches]))
        if drop_last:
            assert all(len(b["row_id"]) == ds.options.batch_size for b in batches)
        else:
            assert all(len(b["row_id"]) > 0 for b in batches)
    assert len(set(lens)) == 1, lens  # equal batch counts: DDP never hangs
    ids = np.concatenate(per_rank)
    if drop_last:
        k = ref.n // (world * 997)
        assert lens[0] == k
        assert len(ids) == k * world * 997 and len(np.unique(ids)) == len(ids)
    else:
        assert lens[0] == _ceil(_ceil(ref.n, world), 997)
        assert np.array_equal(np.sort(ids), np.arange(ref.n))
    if not shuffle and not drop_last:
        # file order: rank r holds the r-th contiguous range, in order
        assert np.array_equal(ids, np.arange(ref.n))
        assert max(len(r) for r in per_rank) - min(len(r) for r in per_rank) <= 1


def test_uneven_tail_across_ranks(mixed, tmp_path):
    """N % world != 0 and a batch size that leaves one rank's last batch empty."""
    n = mixed.ref.n
    world = 4
    assert n % world
    # every rank gets n // world or n // world + 1 rows; choose batch_size so that
    # n // world is a multiple of it: the shorter ranks must still yield as many batches
    batch_size = n // world // 3
    assert (n // world) % batch_size == 0
    got, lens = [], []
    for rank in range(world):
        ds = mixed.open(tmp_path / "cache", rank=rank, world_size=world, batch_size=batch_size, seed=1)
        batches = _epoch(ds)
        lens.append(len(batches))
        assert len(batches) == len(ds)
        assert all(len(b["row_id"]) > 0 for b in batches)
        got.append(np.concatenate([mixed.ref.check(b) for b in batches]))
    assert len(set(lens)) == 1
    assert np.array_equal(np.sort(np.concatenate(got)), np.arange(n))


# ---------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------

@LAYOUTS
@pytest.mark.parametrize("shuffle", [True, "block"])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1)])
def test_order_is_independent_of_threads_prefetch_and_cache(click, tmp_path, world, rank, shuffle, layout):
    kw = dict(seed=11, rank=rank, world_size=world, shuffle_window=3, shuffle=shuffle, layout=layout)
    warm = tmp_path / "warm"
    base_ds = click.open(warm, prefetch=2, num_threads=2, **kw)
    base_ds.set_epoch(3)
    base = _epoch(base_ds)  # cold
    click.ref.check(base[0])
    variants = [dict(cache=warm, prefetch=p, num_threads=t) for p in (0, 1, 4) for t in (1, 3)]
    variants += [dict(cache=tmp_path / "cold1", prefetch=0, num_threads=3),
                 dict(cache=tmp_path / "cold2", prefetch=4, num_threads=1)]
    for v in variants:
        v = dict(v)
        ds = click.open(v.pop("cache"), **v, **kw)
        ds.set_epoch(3)
        _same_batches(base, _epoch(ds))
    # and the same object again, after another epoch in between
    base_ds.set_epoch(4)
    _epoch(base_ds)
    base_ds.set_epoch(3)
    _same_batches(base, _epoch(base_ds))


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_epochs_and_seeds_change_the_order(click, tmp_path, shuffle):
    cache = tmp_path / "cache"

    def order(seed, epoch, **kw):
        ds = click.open(cache, seed=seed, shuffle=shuffle, **kw)
        ds.set_epoch(epoch)
        return _ids(_epoch(ds))

    e0, e1, s1 = order(0, 0), order(0, 1), order(1, 0)
    assert np.array_equal(np.sort(e0), np.sort(e1))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, s1)
    assert np.array_equal(e0, order(0, 0))
    # shard membership changes with the seed and the epoch (not just the order inside a shard)
    r0 = set(order(0, 0, rank=0, world_size=2).tolist())
    assert r0 != set(order(0, 1, rank=0, world_size=2).tolist())
    assert r0 != set(order(1, 0, rank=0, world_size=2).tolist())
    # rows are shuffled within windows, not just chunks reordered
    first = e0[:997]
    assert len(np.unique(first // 1000)) > 1


@LAYOUTS
@pytest.mark.parametrize("epoch", [0, 5])
def test_no_shuffle_gives_file_order(data, tmp_path, epoch, layout):
    ds = data.open(tmp_path / "cache", shuffle=False, seed=123, layout=layout)
    ds.set_epoch(epoch)
    assert np.array_equal(_ids(_epoch(ds)), np.arange(data.ref.n))


# ---------------------------------------------------------------------------------------
# exact values
# ---------------------------------------------------------------------------------------

@LAYOUTS
@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_values_equal_pyarrow_cold_and_warm(data, tmp_path, shuffle, layout):
    ds = data.open(tmp_path / "cache", shuffle=shuffle, batch_size=1234, layout=layout)
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches = _epoch(ds)
        ids = np.concatenate([data.ref.check(b) for b in batches])
        assert np.array_equal(np.sort(ids), np.arange(data.ref.n))
        if epoch == 0:
            ds.reader.cache.flush()
    assert ds.reader.counters.decoded == len(ds.reader.chunks)


def test_click_output_types(click, tmp_path):
    ds = click.open(tmp_path / "cache")
    b = next(iter(ds))
    assert b["dense"].dtype == torch.float32 and b["dense"].shape == (997, DENSE)
    assert b["sparse"].dtype == torch.int64 and b["sparse"].shape == (997, SPARSE)
    assert b["label"].dtype == torch.int8 and b["label"].shape == (997,)
    assert b["row_id"].dtype == torch.int64
    assert isinstance(b["history"], Ragged)
    assert b["history"].offsets.dtype == torch.int64 and b["history"].values.dtype == torch.int64
    assert ds.outputs == list(CLICK_COLUMNS)


@pytest.mark.parametrize("shuffle", [False, True])
def test_kept_batches_stay_valid_across_epochs(tmp_path, shuffle):
    """Chunks larger than 1 MiB go through reused host buffers; batches a user keeps
    must not change when later epochs reuse those buffers."""
    d = tmp_path / "big"
    files = write_clicklog(d, rows=60_000, files=2, row_group_rows=15_000, dense=DENSE, sparse=SPARSE,
                           list_max=20, seed=5)
    ref = Reference(_read_all(files), CLICK_COLUMNS)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", batch_size=7000,
                                chunk_bytes=3 << 19, device="cpu", shuffle=shuffle, shuffle_window=2)
    assert len(ds.reader.chunks) == 4
    _epoch(ds)
    ds.reader.cache.flush()
    ds.set_epoch(1)
    kept = _epoch(ds)  # from the cache
    for epoch in (2, 3, 4):
        ds.set_epoch(epoch)
        for b in ds:
            ref.check(b)
    ids = np.concatenate([ref.check(b) for b in kept])
    assert np.array_equal(np.sort(ids), np.arange(ref.n))


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
    _epoch(ds)
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
# bad input
# ---------------------------------------------------------------------------------------

def _write(path, table, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **kw)
    return path


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope" / "data.parquet"
    with pytest.raises(gpuload.SourceError, match="nope"):
        gpuload.ParquetDataset(missing, cache_dir=tmp_path / "c", device="cpu")


def test_directory_without_parquet(tmp_path):
    d = tmp_path / "emptydir"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    with pytest.raises(gpuload.SourceError, match="emptydir"):
        gpuload.ParquetDataset(d, cache_dir=tmp_path / "c", device="cpu")


def test_non_parquet_file_named_parquet(tmp_path):
    d = tmp_path / "d"
    _write(d / "a.parquet", pa.table({"row_id": np.arange(10)}))
    (d / "x.parquet").write_bytes(b"this is not parquet at all" * 10)
    for source in (d / "x.parquet", d):
        with pytest.raises(gpuload.SourceError, match="x.parquet"):
            gpuload.ParquetDataset(source, cache_dir=tmp_path / "c", device="cpu")


def test_files_disagree_on_column_type(tmp_path):
    d = tmp_path / "d"
    _write(d / "a.parquet", pa.table({"v": pa.array([1, 2, 3], pa.int32())}))
    _write(d / "b.parquet", pa.table({"v": pa.array([1.0, 2.0], pa.float32())}))
    with pytest.raises(gpuload.SchemaError) as info:
        gpuload.ParquetDataset(d, ["v"], cache_dir=tmp_path / "c", device="cpu")
    msg = str(info.value)
    assert "a.parquet" in msg and "b.parquet" in msg and "'v'" in msg


@pytest.mark.parametrize("missing_in", ["a", "b"])
def test_file_lacks_selected_column(tmp_path, missing_in):
    d = tmp_path / "d"
    full = pa.table({"u": pa.array([1, 2], pa.int64()), "v": pa.array([3, 4], pa.int64())})
    _write(d / "a.parquet", full.select(["u"]) if missing_in == "a" else full)
    _write(d / "b.parquet", full.select(["u"]) if missing_in == "b" else full)
    with pytest.raises(gpuload.SchemaError) as info:
        gpuload.ParquetDataset(d, ["u", "v"], cache_dir=tmp_path / "c", device="cpu")
    msg = str(info.value)
    assert "'v'" in msg and f"{missing_in}.parquet" in msg


def test_string_column_selected(tmp_path):
    p = _write(tmp_path / "s.parquet", pa.table({"id": [1, 2], "name": ["a", "b"]}))
    with pytest.raises(gpuload.SchemaError, match="'name'"):
        gpuload.ParquetDataset(p, ["id", "name"], cache_dir=tmp_path / "c", device="cpu")


def _nullable_table(n=1000, nulls=37):
    mask = np.zeros(n, bool)
    mask[np.random.default_rng(0).choice(n, nulls, replace=False)] = True
    return pa.table({"row_id": np.arange(n), "v": pa.array(np.arange(n, dtype=np.float32), mask=mask)})


@pytest.mark.parametrize("statistics", [True, False])
def test_nulls_without_fill(tmp_path, statistics):
    p = _write(tmp_path / "n.parquet", _nullable_table(), row_group_size=100, write_statistics=statistics)
    with pytest.raises(gpuload.NullValuesError) as info:
        ds = gpuload.ParquetDataset(p, ["row_id", "v"], cache_dir=tmp_path / "c", device="cpu", batch_size=64)
        list(ds)  # without statistics, found while decoding
    msg = str(info.value)
    assert "'v'" in msg and "fill_nulls" in msg
    if statistics:
        assert "37" in msg
    # with a fill value, the same file loads, nulls replaced
    ds = gpuload.ParquetDataset(p, ["row_id", "v"], cache_dir=tmp_path / "c2", device="cpu", batch_size=64,
                                fill_nulls={"v": -1.5}, shuffle=False)
    v = torch.cat([b["v"] for b in ds]).numpy()
    want = pc.fill_null(_nullable_table()["v"], -1.5).to_numpy()
    np.testing.assert_array_equal(v, want)


def test_null_lists_without_fill(tmp_path):
    lists = pa.array([[1, 2], None, [3], [], None] * 20, pa.list_(pa.int64()))
    p = _write(tmp_path / "l.parquet", pa.table({"row_id": np.arange(100), "h": lists}))
    with pytest.raises(gpuload.NullValuesError, match="'h'"):
        list(gpuload.ParquetDataset(p, cache_dir=tmp_path / "c", device="cpu", batch_size=10))


@pytest.mark.parametrize("rank,world", [(2, 2), (5, 3), (-1, 2), (0, 0)])
def test_bad_rank(click, tmp_path, rank, world):
    with pytest.raises(gpuload.ConfigError, match="rank|world_size"):
        click.open(tmp_path / "c", rank=rank, world_size=world)


@pytest.mark.parametrize("batch_size", [0, -5])
def test_bad_batch_size(click, tmp_path, batch_size):
    with pytest.raises(gpuload.ConfigError, match="batch_size"):
        click.open(tmp_path / "c", batch_size=batch_size)


def test_fewer_rows_than_ranks(tmp_path):
    p = _write(tmp_path / "tiny.parquet", pa.table({"row_id": np.arange(5)}))
    with pytest.raises(gpuload.ConfigError, match="5 rows .* use at most 5 ranks"):
        gpuload.ParquetDataset(p, cache_dir=tmp_path / "c", device="cpu", world_size=7, rank=0, batch_size=1)
    with pytest.raises(gpuload.ConfigError, match="at most 5 ranks"):
        gpuload.ParquetDataset(p, cache_dir=tmp_path / "c", device="cpu", world_size=7, rank=3, batch_size=1,
                               drop_last=True)
    # drop_last=True would yield no batch on any rank: refused rather than training on nothing
    with pytest.raises(gpuload.ConfigError, match="no full batch .* use batch_size=2 or less"):
        gpuload.ParquetDataset(p, cache_dir=tmp_path / "c", device="cpu", world_size=2, rank=1, batch_size=4,
                               drop_last=True)
    ds = gpuload.ParquetDataset(p, cache_dir=tmp_path / "c", device="cpu", world_size=2, rank=1, batch_size=2,
                                drop_last=True)  # the suggestion works
    assert len(ds) == 1


# ---------------------------------------------------------------------------------------
# early exit and background errors
# ---------------------------------------------------------------------------------------

def _run_with_timeout(fn, timeout=20.0):
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "timed out: the loader hangs"
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.mark.parametrize("close", ["break", "close", "abandon"])
@pytest.mark.parametrize("warm", [False, True])
def test_early_exit_does_not_hang_or_leak_threads(click, tmp_path, warm, close):
    ds = click.open(tmp_path / "cache", prefetch=4, num_threads=2)
    if warm:
        _epoch(ds)
        ds.reader.cache.flush()

    def consume():
        if close == "break":
            for i, b in enumerate(ds):
                click.ref.check(b)
                if i == 1:
                    break
        else:
            it = iter(ds)
            click.ref.check(next(it))
            next(it)
            if close == "close":
                it.close()
            del it

    _run_with_timeout(consume)
    gc.collect()
    assert _wait_no_threads(include_writer=False) == []
    # the dataset still works afterwards
    ds.set_epoch(1)
    ids = _run_with_timeout(lambda: np.concatenate([click.ref.check(b) for b in ds]))
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))
    del ds
    gc.collect()
    assert _wait_no_threads(include_writer=True) == []


class Boom(Exception):
    pass


def test_background_exception_reaches_consumer(click, tmp_path):
    ds = click.open(tmp_path / "cache", shuffle=False, num_threads=2, prefetch=2, shuffle_window=1)
    real = ds.reader.decode
    calls = []

    def flaky(f, chunk, specs):
        calls.append(chunk)
        if len(calls) == 5:
            raise Boom("decoder exploded")
        return real(f, chunk, specs)

    ds.reader.decode = flaky
    got = []

    def consume():
        with pytest.raises(Boom, match="decoder exploded") as info:
            for b in ds:
                got.append(b)
        return info

    info = _run_with_timeout(consume)
    assert type(info.value) is Boom
    for b in got:
        click.ref.check(b)
    # two threads decode, so the 5th call may be chunk 4 or a later one; whichever failed, the
    # consumer got nothing from it or beyond it, and the loader had not run far ahead of it
    failed = ds.reader.chunks.index(calls[4])
    assert 4 <= failed <= 4 + 2 + 2
    assert sum(len(b["row_id"]) for b in got) <= sum(c.rows for c in ds.reader.chunks[:failed])
    gc.collect()
    assert _wait_no_threads(include_writer=False) == []
    # the next epoch works again
    ds.reader.decode = real
    ids = _run_with_timeout(lambda: np.concatenate([click.ref.check(b) for b in ds]))
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))


def test_source_removed_after_open_raises_gpuload_error(tmp_path):
    d = tmp_path / "d"
    files = write_clicklog(d, rows=3000, files=3, row_group_rows=500, dense=DENSE, sparse=SPARSE, list_max=5)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", device="cpu", batch_size=100,
                                chunk_bytes=CHUNK_BYTES, shuffle=False)
    Path(files[2]).unlink()

    def consume():
        with pytest.raises(gpuload.GpuloadError) as info:
            for _ in ds:
                pass
        return info

    info = _run_with_timeout(consume)
    assert files[2].name in str(info.value)


def test_source_rewritten_after_open_raises(tmp_path):
    d = tmp_path / "d"
    files = write_clicklog(d, rows=3000, files=2, row_group_rows=500, dense=DENSE, sparse=SPARSE, list_max=5)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", device="cpu", batch_size=100,
                                chunk_bytes=CHUNK_BYTES, shuffle=False)
    other = write_clicklog(tmp_path / "o", rows=3000, files=2, row_group_rows=500, dense=DENSE, sparse=SPARSE,
                           list_max=5, seed=99)
    shutil.copyfile(other[1], files[1])
    with pytest.raises(gpuload.GpuloadError, match=files[1].name):
        _run_with_timeout(lambda: list(ds))


# ---------------------------------------------------------------------------------------
# DataLoader
# ---------------------------------------------------------------------------------------

def test_dataloader_without_workers(click, tmp_path):
    ds = click.open(tmp_path / "cache", seed=2)
    direct = _epoch(ds)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    assert len(dl) == len(ds)
    ds.set_epoch(0)  # the same epoch again (a new iteration alone would begin epoch 1)
    via = list(dl)
    _same_batches(direct, via)
    for b in via:
        click.ref.check(b)


@pytest.mark.slow  # the DataLoader starts a worker process
def test_dataloader_with_workers_is_refused(click, tmp_path):
    ds = click.open(tmp_path / "cache")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(Exception) as info:
        _run_with_timeout(lambda: next(iter(dl)), timeout=60)
    assert isinstance(info.value, gpuload.ConfigError) or "ConfigError" in str(info.value)
    assert "num_workers=0" in str(info.value)


# ---------------------------------------------------------------------------------------
# DataLoader use, torch dtypes
# ---------------------------------------------------------------------------------------

def test_dataloader_without_batch_size_none_is_refused_not_reshaped(tmp_path):
    p = _write(tmp_path / "x.parquet", pa.table({"x": np.arange(100)}))
    ds = gpuload.ParquetDataset(p, batch_size=10, cache_dir=tmp_path / "c", device="cpu")
    with pytest.raises(gpuload.ConfigError, match="batch_size=None"):
        next(iter(torch.utils.data.DataLoader(ds)))  # default batch_size=1 would add a [1, ...] dimension
    with pytest.raises(gpuload.ConfigError, match="batch_size=None"):
        next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert [b["x"].shape for b in batches] == [(10,)] * 10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "bfloat16", "torch.bfloat16", torch.float64,
                                   torch.int32, torch.uint8, "torch.float16"])
def test_torch_dtypes_are_accepted_and_converted_once(tmp_path, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32) * 100
    x[:3] = [np.nan, np.inf, -0.0]
    ints = rng.integers(0, 200, 1000)
    lists = pa.array([[float(v), float(v) / 3] for v in x[:1000]], pa.list_(pa.float32()))
    p = _write(tmp_path / "x.parquet", pa.table({"x": x, "i": ints, "l": lists}))
    integer = dtype in (torch.int32, torch.uint8)
    src = "i" if integer else "x"
    columns = {"v": src, "g": [src, src]} if integer else {"v": "x", "g": ["x", "i"], "l": "l"}
    dtypes = {k: dtype for k in columns}
    ds = gpuload.ParquetDataset(p, columns, batch_size=1000, shuffle=False, cache_dir=tmp_path / "c",
                                device="cpu", dtypes=dtypes)
    (b,) = list(ds)
    want_dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    src_values = torch.from_numpy(ints if integer else x)
    def bits(t):  # exact comparison, NaN included
        return t.contiguous().view(torch.uint8)

    want = src_values.to(want_dtype) if integer or want_dtype == torch.float32 else _canonical(src_values.to(want_dtype))
    assert b["v"].dtype == want_dtype
    assert torch.equal(bits(b["v"]), bits(want))
    assert b["g"].dtype == want_dtype and b["g"].shape == (1000, 2)
    assert torch.equal(bits(b["g"][:, 0]), bits(want))
    if not integer:
        assert b["l"].values.dtype == want_dtype
        flat = torch.from_numpy(np.stack([x, x / np.float32(3)], 1).reshape(-1))
        np.testing.assert_array_equal(b["l"].values.float().numpy(), flat.to(want_dtype).float().numpy())
    # bit for bit what torch's own conversion gives, also read back from the cache
    ds.reader.cache.flush()
    ds2 = gpuload.ParquetDataset(p, columns, batch_size=1000, shuffle=False, cache_dir=tmp_path / "c",
                                 device="cpu", dtypes=dtypes)
    (again,) = list(ds2)
    assert again["v"].dtype == want_dtype and ds2.reader.counters.decoded == 0
    assert torch.equal(bits(again["v"]), bits(b["v"]))


def test_bfloat16_bits_match_torch_exactly(tmp_path):
    """Round to nearest even, NaN and infinities, from float64 (one rounding, as torch)."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000),
                        [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 3.4e38, 1 + 2**-8, 1 + 2**-8 + 2**-30]])
    p = _write(tmp_path / "x.parquet", pa.table({"x": x}))
    (b,) = list(gpuload.ParquetDataset(p, batch_size=len(x), shuffle=False, cache_dir=tmp_path / "c",
                                       device="cpu", dtypes={"x": torch.bfloat16}))
    want = _canonical(torch.from_numpy(x).to(torch.bfloat16))
    assert torch.equal(b["x"].view(torch.int16), want.view(torch.int16))


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN as the positive quiet NaN (bfloat16 0x7FC0, float16 0x7E00, float32
    0x7FC00000): gpuload's rule for casts, where torch itself varies (its CPU casts of a float32
    NaN to bfloat16 gave 0xFFFF, of a float64 NaN 0x7FC0; CUDA gives 0x7FFF)."""
    t = t.clone()
    t[torch.isnan(t)] = float("nan")
    return t


def test_dtypes_refuses_what_torch_cannot_take(tmp_path):
    p = _write(tmp_path / "x.parquet", pa.table({"x": np.arange(10)}))
    for bad in (torch.complex64, "complex64", "torch.nothing", object, "float128"):
        with pytest.raises(gpuload.ConfigError, match="dtypes"):
            gpuload.ParquetDataset(p, ["x"], cache_dir=tmp_path / "c", device="cpu", dtypes={"x": bad})


def test_big_endian_dtypes_give_native_tensors(tmp_path):
    p = _write(tmp_path / "x.parquet", pa.table({"x": np.arange(10, dtype=np.int64)}))
    ds = gpuload.ParquetDataset(p, ["x"], cache_dir=tmp_path / "c", device="cpu", dtypes={"x": ">i4"})
    (b,) = list(ds)
    assert b["x"].dtype == torch.int32 and sorted(b["x"].tolist()) == list(range(10))
