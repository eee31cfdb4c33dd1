"""Integration tests of ParquetDataset: exactly-once delivery, sharding, determinism,
exact values, bad input and the DataLoader contract (the pipeline's threads, early exits
and background errors: test_pipeline.py; the reader's chunks and cache-only later epochs:
test_reader.py; files changed after opening: test_decode.py).

CPU only, small data: tens of thousands of rows in 64 KiB chunks (tens of chunks;
tests/reference.py).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import xxhash
import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.synth import write_clicklog

from conftest import row_ids, run_with_timeout
from reference import CLICK_COLUMNS, DENSE, SPARSE, Data, Reference, read_all, same_batches


@pytest.fixture(params=["click", "mixed"])
def data(request) -> Data:
    return request.getfixturevalue(request.param)


def _ceil(a, b):
    return -(-a // b)


def _epoch(ds) -> list[dict]:
    return list(ds)


pytestmark = pytest.mark.usefixtures("no_leftover_threads")


# ---------------------------------------------------------------------------------------
# exactly once
# ---------------------------------------------------------------------------------------

LAYOUTS = pytest.mark.parametrize("layout", ["rows", "columns"])


@LAYOUTS
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [997, 4096])
@pytest.mark.parametrize("shuffle", [True, False, "block", "chunks"])
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


@LAYOUTS
@pytest.mark.parametrize("shuffle", [True, False, "block", "chunks"])
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

@pytest.mark.parametrize("shuffle", [True, "block"])
def test_epochs_and_seeds_change_the_order(click, tmp_path, shuffle):
    cache = tmp_path / "cache"

    def order(seed, epoch, **kw):
        ds = click.open(cache, seed=seed, shuffle=shuffle, **kw)
        ds.set_epoch(epoch)
        return row_ids(_epoch(ds))

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
    # NumPy integers (a loop over np.arange, settings from pandas) mean what the ints mean
    assert np.array_equal(order(np.int64(0), np.int64(1)), e1)
    assert set(order(np.int32(0), np.uint8(0), rank=np.int64(0), world_size=np.int64(2)).tolist()) == r0


def test_chunk_shuffle_permutes_the_chunks_and_keeps_their_rows_in_order(click, tmp_path):
    """shuffle="chunks": each epoch a permutation of the chunks (the same for the same seed and
    epoch), each chunk's rows in file order, batches cut straight from them."""
    cache = tmp_path / "cache"

    def order(seed, epoch, **kw):
        ds = click.open(cache, seed=seed, shuffle="chunks", **kw)
        ds.set_epoch(epoch)
        return ds, np.concatenate([click.ref.check(b) for b in _epoch(ds)])

    ds, e0 = order(0, 0)
    starts = np.cumsum([0] + [c.rows for c in ds.reader.chunks])  # files in order: chunks hold consecutive ids
    where = {int(v): i for i, v in enumerate(e0)}
    firsts = []
    for lo, hi in zip(starts[:-1], starts[1:]):
        at = where[int(lo)]
        assert np.array_equal(e0[at:at + hi - lo], np.arange(lo, hi))  # a chunk's rows, whole and in order
        firsts.append(at)
    assert firsts != sorted(firsts)  # the chunks themselves are permuted
    _, e1 = order(0, 1)
    _, s1 = order(1, 0)
    assert np.array_equal(order(0, 0)[1], e0) and not np.array_equal(e0, e1) and not np.array_equal(e0, s1)
    assert np.array_equal(np.sort(e1), np.arange(click.ref.n))
    with pytest.raises(gpuload.ConfigError, match=r"shuffle='rows' must be True .*'block', 'chunks' or False"):
        click.open(cache, shuffle="rows")
    state = ds.state_dict()  # from a chunk-shuffled epoch: another mode is refused, naming both
    with pytest.raises(gpuload.ConfigError, match=r"shuffle: 'chunks' in the state, True here"):
        click.open(cache).load_state_dict(state)


@LAYOUTS
@pytest.mark.parametrize("epoch", [0, 5])
def test_no_shuffle_gives_file_order(data, tmp_path, epoch, layout):
    ds = data.open(tmp_path / "cache", shuffle=False, seed=123, layout=layout)
    ds.set_epoch(epoch)
    assert np.array_equal(row_ids(_epoch(ds)), np.arange(data.ref.n))


# ---------------------------------------------------------------------------------------
# exact values
# ---------------------------------------------------------------------------------------

@LAYOUTS
@pytest.mark.parametrize("shuffle", [True, False, "block", "chunks"])
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


def _four_big_chunks(tmp_path, shuffle) -> tuple[Reference, gpuload.ParquetDataset]:
    """60,000 click-log rows in 4 chunks of more than 1 MiB (they go through reused host buffers)."""
    d = tmp_path / "big"
    files = write_clicklog(d, rows=60_000, files=2, row_group_rows=15_000, dense=DENSE, sparse=SPARSE,
                           list_max=20, seed=5)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", batch_size=7000,
                                chunk_bytes=3 << 19, device="cpu", shuffle=shuffle, shuffle_window=2)
    return Reference(read_all(files), CLICK_COLUMNS), ds


@pytest.mark.parametrize("shuffle", [False, True])
def test_kept_batches_stay_valid_across_epochs(tmp_path, shuffle):
    """Chunks larger than 1 MiB go through reused host buffers; batches a user keeps
    must not change when later epochs reuse those buffers."""
    ref, ds = _four_big_chunks(tmp_path, shuffle)
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


@pytest.mark.parametrize("shuffle", [False, "chunks", True, "block"])
def test_batches_changed_in_place_leave_the_cache_exact(tmp_path, shuffle, monkeypatch):
    """A training step that changes its batch in place (``x.zero_()``, an in-place normalisation)
    while the chunk's file is still being written: the file holds the decoded values. Without a
    row shuffle the batches are views of the chunk the writer writes from, so none is handed out
    before the chunk is written (each write made slow here, so that a batch handed out earlier
    would be zeroed before it is written)."""
    from gpuload.cache.store import ChunkCache

    write = ChunkCache._write

    def slow(self, key, cols, spill=True):
        time.sleep(0.2)
        return write(self, key, cols, spill)

    monkeypatch.setattr(ChunkCache, "_write", slow)
    ref, ds = _four_big_chunks(tmp_path, shuffle)
    for b in ds:
        ref.check(b)
        for v in b.values():
            for t in (v.values, v.offsets) if isinstance(v, Ragged) else (v,):
                t.zero_()
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded == len(ds.reader.chunks) == 4
    ds.set_epoch(1)
    ids = np.concatenate([ref.check(b) for b in ds])
    assert np.array_equal(np.sort(ids), np.arange(ref.n))
    assert ds.reader.counters.from_cache >= len(ds.reader.chunks)  # epoch 1 read the files the first one wrote


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
    _write(d / "a.parquet", pa.table({"v": pa.array([1, 2, 3], pa.int64())}))  # no float holds every int64
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
    with pytest.raises(gpuload.NullValuesError) as info:  # nulls where it lacks the column: a fill is needed
        gpuload.ParquetDataset(d, ["u", "v"], cache_dir=tmp_path / "c", device="cpu")
    msg = str(info.value)
    assert "'v'" in msg and f"{missing_in}.parquet" in msg and "1 file lacks the column" in msg
    ds = gpuload.ParquetDataset(d, ["u", "v"], fill_nulls=-9, cache_dir=tmp_path / "c", device="cpu", shuffle=False)
    got = [(u, v) for b in ds for u, v in zip(b["u"].tolist(), b["v"].tolist())]
    assert got == ([(1, -9), (2, -9), (1, 3), (2, 4)] if missing_in == "a" else [(1, 3), (2, 4), (1, -9), (2, -9)])


def test_string_column_selected_becomes_64_bit_hash_ids(tmp_path):
    """Without categorical=, a string column gets Hash(): XXH64 of its bytes as int64 (tests/test_categorical.py)."""
    p = _write(tmp_path / "s.parquet", pa.table({"id": [1, 2, 3], "name": ["a", "b", None]}))
    ds = gpuload.ParquetDataset(p, ["id", "name"], cache_dir=tmp_path / "c", device="cpu", shuffle=False)
    ids = next(iter(ds))["name"].numpy().view(np.uint64).tolist()
    assert ids == [xxhash.xxh64_intdigest(b"a"), xxhash.xxh64_intdigest(b"b"), 0]


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
    from gpuload.cache.evict import datasets
    from gpuload.cache.fs import CacheRoot

    assert datasets(CacheRoot(tmp_path / "c")) == []  # refused at open: no dataset recorded in the cache
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
# DataLoader
# ---------------------------------------------------------------------------------------

def test_dataloader_without_workers(click, tmp_path):
    ds = click.open(tmp_path / "cache", seed=2)
    direct = _epoch(ds)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    assert len(dl) == len(ds)
    ds.set_epoch(0)  # the same epoch again (a new iteration alone would begin epoch 1)
    via = list(dl)
    same_batches(direct, via)
    for b in via:
        click.ref.check(b)


@pytest.mark.slow  # the DataLoader starts a worker process
def test_dataloader_with_workers_is_refused(click, tmp_path):
    ds = click.open(tmp_path / "cache")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(Exception) as info:
        run_with_timeout(lambda: next(iter(dl)), timeout=60)
    assert isinstance(info.value, gpuload.ConfigError) or "ConfigError" in str(info.value)
    assert "num_workers=0" in str(info.value)
    spawned = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(gpuload.ConfigError, match="cannot be pickled or copied .*num_workers=0"):  # Python 3.14's
        run_with_timeout(lambda: next(iter(spawned)), timeout=60)  # default: the dataset is pickled, not forked


def test_pickling_or_copying_a_dataset_is_refused_with_what_to_do(click, tmp_path):
    """A spawned process (Lightning's ddp_spawn, a DataLoader worker under spawn or forkserver,
    Python 3.14's default) pickles the dataset, and deepcopy copies it: refused by a ConfigError
    naming the fixes, not a TypeError about a lock from deep inside."""
    import copy
    import pickle

    ds = click.open(tmp_path / "cache")
    for attempt in (lambda: pickle.dumps(ds), lambda: copy.copy(ds)):
        with pytest.raises(gpuload.ConfigError, match=r"a ParquetDataset cannot be pickled or copied .*ddp_spawn.*"
                                                      r"num_workers=0"):
            attempt()
    assert len(_epoch(ds)) == len(ds)  # the dataset itself is unharmed
    # a deep copy of what holds it (Lightning's SWA and EMA callbacks copy the LightningModule, a new user's
    # trial: they failed on the README's recipe) shares the dataset, and both still work
    holder = torch.nn.Linear(2, 2)
    holder.train_set = ds
    twin = copy.deepcopy(holder)
    assert twin.train_set is ds and twin.weight is not holder.weight
    assert len(_epoch(twin.train_set)) == len(ds)


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
                        [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 3.38e38, 1 + 2**-8, 1 + 2**-8 + 2**-30]])
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


def test_fills_the_columns_own_types_cannot_hold_land_in_the_wider_outputs(tmp_path):
    """int8 nulls as 300 in an int32 output, uint8's as -1 in an int16 one, float16's as 70000 in float32,
    a list's null elements too, and a stacked group's members in its common type: pyarrow's values
    cast to the output's type, then filled (a new-user trial was refused: the fill checked against int8)."""
    t = pa.table({"i8": pa.array([1, None, -3, None], pa.int8()), "u8": pa.array([None, 255, 0, None], pa.uint8()),
                  "f2": pa.array([None, 1.5, None, 2.0], pa.float16()),
                  "l": pa.array([[1, None], None, [3], [None]], pa.list_(pa.int8()))})
    p = _write(tmp_path / "x.parquet", t)
    fills = {"i8": 300, "u8": -1, "f2": 70000.0, "l": 1000}
    ds = gpuload.ParquetDataset(p, {"i8": "i8", "u8": "u8", "f2": "f2", "l": "l", "g": ["i8", "u8"]}, fill_nulls=fills,
                                dtypes={"i8": "int32", "u8": "int16", "f2": "float32", "l": "int32"}, batch_size=4,
                                shuffle=False, cache_dir=tmp_path / "c", device="cpu")
    for epoch in (0, 1):  # decoded, then from the cache
        ds.set_epoch(epoch)
        (b,) = list(ds)
        want = {c: pc.fill_null(t.column(c).cast(typ), fills[c]).to_numpy()
                for c, typ in (("i8", pa.int32()), ("u8", pa.int16()), ("f2", pa.float32()))}
        for c, dt in (("i8", torch.int32), ("u8", torch.int16), ("f2", torch.float32)):
            assert b[c].dtype == dt and b[c].tolist() == want[c].tolist(), c
        assert b["l"].values.tolist() == [1, 1000, 3, 1000] and b["l"].offsets.tolist() == [0, 2, 2, 3, 4]
        assert b["g"].dtype == torch.int16 and b["g"].tolist() == [[1, -1], [300, 255], [-3, 0], [300, -1]]
