"""filters=: the rows pyarrow's own filters= keeps, each once per epoch, planned over the kept rows;
row groups the statistics exclude are never read; the filter is part of the cache key."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

import gpuload
import gpuload.counting
import gpuload.decode
from gpuload.rowfilter import RowFilter

from conftest import dataset_factory, write_parquet

N, RG = 4000, 250
_ds = dataset_factory(["id", "v", "l"], batch_size=128, chunk_bytes=8192)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rowfilter")
    rng = np.random.default_rng(4)
    for k in range(2):  # `day` rises with the row: the statistics exclude whole row groups
        ids = np.arange(k * N, (k + 1) * N)
        write_parquet(d / f"part-{k}.parquet", pa.table({
            "id": ids, "day": 20260100 + ids // 100, "country": pa.array(["DE", "FR", "US", None, "DE"] * (N // 5)),
            "score": pa.array([None if i % 7 == 0 else float(i % 13) for i in range(N)]),
            "v": rng.random(N), "l": pa.array([[int(i)] * (int(i) % 3) for i in ids], pa.list_(pa.int64()))}),
            row_group_size=RG)
    return d


def _ids(ds) -> np.ndarray:
    return np.concatenate([b["id"].numpy() for b in ds])


def _want(data, filters) -> np.ndarray:
    return np.sort(pq.read_table(data, filters=filters)["id"].to_numpy())


FILTERS = [
    [("day", ">=", 20260150), ("country", "in", ["DE", "FR"])],
    [[("day", "<", 20260105)], [("country", "==", "US"), ("score", ">", 9.0)]],
    [("country", "not in", ["DE"]), ("id", "!=", 17)],
    [("score", "<=", 2.0)],  # a column with nulls: a null never passes
    pc.field("v") * 2 > 1.5,  # an expression over a column not loaded... of a loaded one
]


@pytest.mark.parametrize("filters", FILTERS, ids=range(len(FILTERS)))
def test_the_kept_rows_are_pyarrows_each_once_per_epoch(data, tmp_path, filters):
    ds = _ds(data, tmp_path / "c", filters=filters)
    want = _want(data, filters)
    assert ds.num_rows == len(want) and len(ds) == -(-len(want) // 128)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        got = _ids(ds)
        assert len(got) == len(want) and np.array_equal(np.sort(got), want)
    first = _ids(_ds(data, tmp_path / "c", filters=filters))  # from the cache: the same order for (seed, epoch 0)
    ds.set_epoch(0)
    assert np.array_equal(first, _ids(ds))


def test_values_and_lists_of_the_kept_rows_are_exact(data, tmp_path):
    f = [("day", ">=", 20260130), ("country", "==", "DE")]
    ds = _ds(data, tmp_path / "c", filters=f, shuffle=False)
    rows = {}
    for b in ds:
        vals, off = b["l"].values.numpy(), b["l"].offsets.numpy()
        for i, (id_, v) in enumerate(zip(b["id"].numpy(), b["v"].numpy())):
            rows[int(id_)] = (v, vals[off[i]:off[i + 1]].tolist())
    table = pq.read_table(data, filters=f)
    assert sorted(rows) == sorted(table["id"].to_pylist())
    for id_, v, l in zip(table["id"].to_pylist(), table["v"].to_pylist(), table["l"].to_pylist()):
        assert rows[id_] == (v, l)


def test_row_groups_the_statistics_exclude_are_never_read(data, tmp_path, monkeypatch):
    read = []
    real = gpuload.decode.read_columns

    def recording(src, f, chunk, leaves, *a, **k):
        read.extend((f.path, g) for g in range(chunk.rg_start, chunk.rg_stop))
        return real(src, f, chunk, leaves, *a, **k)

    monkeypatch.setattr(gpuload.decode, "read_columns", recording)  # the decoder's and the counting's reads
    ds = _ds(data, tmp_path / "c", filters=[("day", ">=", 20260170)])  # the last 3,000 rows of part-1
    assert np.array_equal(np.sort(_ids(ds)), np.arange(7000, 8000))
    assert {g for p, g in read if p.endswith("part-1.parquet")} == set(range(12, 16))
    assert not [p for p, _ in read if p.endswith("part-0.parquet")]


def test_hive_keys_filter_whole_files_unread(tmp_path, monkeypatch):
    table = pa.table({"id": np.arange(600), "country": pa.array(["DE", "FR", "US"] * 200), "v": np.arange(600) * 0.5})
    pq.write_to_dataset(table, tmp_path / "hive", partition_cols=["country"])
    read = []
    real = gpuload.decode.read_columns
    monkeypatch.setattr(gpuload.decode, "read_columns",
                        lambda src, f, *a, **k: read.append(f.path) or real(src, f, *a, **k))
    ds = gpuload.ParquetDataset(tmp_path / "hive", ["id", "v"], filters=[("country", "in", ["FR"])],
                                cache_dir=tmp_path / "c", device="cpu", batch_size=50)
    got = np.sort(_ids(ds))
    want = np.sort(pds.dataset(tmp_path / "hive", partitioning="hive").to_table(
        filter=pc.field("country") == "FR")["id"].to_numpy())
    assert np.array_equal(got, want) and len(got) == 200
    assert read and all("country=FR" in p for p in read)
    summary = gpuload.build_cache(tmp_path / "hive", tmp_path / "c2", ["id", "v"], filters=[("country", "in", ["FR"])])
    assert summary.files == 1 and "from 1 files" in str(summary)  # the files the kept rows come from, not all 3


def test_ranks_share_the_kept_rows_with_equal_batch_counts(data, tmp_path):
    f = [("country", "==", "FR")]
    parts = [list(_ds(data, tmp_path / "c", filters=f, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert len({len(p) for p in parts}) == 1
    ids = np.concatenate([np.concatenate([b["id"].numpy() for b in p]) for p in parts])
    assert len(np.unique(ids)) == len(ids) and set(ids) <= set(_want(data, f))


def test_a_resumed_filtered_epoch_gives_the_rest_of_the_uninterrupted_one(data, tmp_path):
    f = [("day", "<", 20260160)]
    ds = _ds(data, tmp_path / "c", filters=f)
    run, states = [], []
    for b in ds:
        run.append(b["id"].numpy().copy())
        states.append(ds.state_dict())
    for k in (0, 3, len(run) - 2):
        again = _ds(data, tmp_path / "c", filters=f)
        again.load_state_dict(states[k])
        rest = [b["id"].numpy() for b in again]
        assert len(rest) == len(run) - k - 1 and all(np.array_equal(a, b) for a, b in zip(rest, run[k + 1:]))


def test_the_filter_is_part_of_the_cache_key(data, tmp_path):
    a = _ds(data, tmp_path / "c", filters=[("country", "==", "DE")])
    list(a)
    same = _ds(data, tmp_path / "c", filters=[("country", "==", "DE")])
    list(same)
    assert same.reader.counters.decoded == 0 and same.reader.spec_hash == a.reader.spec_hash
    other = _ds(data, tmp_path / "c", filters=[("country", "==", "FR")])
    assert other.reader.spec_hash != a.reader.spec_hash != _ds(data, tmp_path / "c").reader.spec_hash
    list(other)
    assert other.reader.counters.decoded == len(other.reader.chunks)


def test_nulls_count_only_in_kept_rows(data, tmp_path):
    f = [("score", ">", 11.0)]  # rows whose score is null are not kept
    ds = _ds(data, tmp_path / "c", ["id", "score"], filters=f)
    assert np.array_equal(np.sort(_ids(ds)), _want(data, f))
    with pytest.raises(gpuload.NullValuesError, match="score"):  # kept rows with nulls: refused, naming it
        list(_ds(data, tmp_path / "c2", ["id", "score"], filters=[("day", ">", 20260100)]))


def test_bad_filters_are_refused_naming_what_to_do(data, tmp_path):
    with pytest.raises(gpuload.SourceError, match=r"filters= .*keeps no row of the 2 files \(8,000 rows\)"):
        _ds(data, tmp_path / "c", filters=[("day", ">", 30000000)])
    with pytest.raises(gpuload.SchemaError, match=r"filters= .*names column 'dya', which the files do not have; "
                                                  r"name columns they have \(id, "):
        _ds(data, tmp_path / "c", filters=[("dya", ">", 1)])
    with pytest.raises(gpuload.SchemaError, match=r"filters= .*compares values of different types \(int64, string\); "
                                                  r"give each condition a value of its column's type \(day is int64\)"):
        _ds(data, tmp_path / "c", filters=[("day", "==", "x")])  # a type no kernel compares with
    # an empty 'in' list: the column exists, so the advice is the value's, not the column names' (a new user's trial)
    with pytest.raises(gpuload.SchemaError, match=r"filters= .* cannot be applied to the files' columns .*; give each "
                                                  r"condition a value its column's type holds \(country is string\), "
                                                  r"or an operator that takes it \(a non-empty list for 'in'\)"):
        _ds(data, tmp_path / "c", filters=[("country", "in", [])])
    with pytest.raises(gpuload.ConfigError, match="is not a filter"):
        _ds(data, tmp_path / "c", filters=[("day", "~", 1)])
    with pytest.raises(gpuload.ConfigError, match="must be a pyarrow.compute expression"):
        _ds(data, tmp_path / "c", filters="day > 1")
    # one condition given bare, not in a list (was a TypeError from tuple(20260101))
    with pytest.raises(gpuload.ConfigError, match=r"filters=\('day', '>', 1\) is one condition, not a list of them: "
                                                  r"give \[\('day', '>', 1\)\]"):
        _ds(data, tmp_path / "c", filters=("day", ">", 1))
    with pytest.raises(gpuload.ConfigError, match="is not a filter"):  # a condition that is not a sequence
        _ds(data, tmp_path / "c", filters=[("day", ">", 1), 5])


def test_a_vocabulary_counts_the_rows_the_filter_keeps(data, tmp_path, monkeypatch):
    """A gpuload.Vocab column of a filtered dataset: its vocabulary is counted over the kept rows
    (each value's count, most frequent first, then by bytes), kept in the cache under the filter,
    and every delivered id is the kept rows' id of the row's value."""
    counted = []
    real = gpuload.counting.count_vocabulary
    monkeypatch.setattr(gpuload.counting, "count_vocabulary", lambda *a, **k: counted.append(1) or real(*a, **k))
    filters = ([("day", ">=", 20260150), ("country", "in", ["FR", "US"])], [("day", "<", 20260130)])
    for k, f in enumerate(filters):
        kept = pq.read_table(data, filters=f)
        counts = collections.Counter(c for c in kept["country"].to_pylist() if c is not None)
        want = {v: i for i, v in enumerate(sorted(counts, key=lambda v: (-counts[v], v.encode())), 1)}
        assert k or want == {"FR": 1, "US": 2}  # over every row: DE 1, FR 2, US 3
        ds = _ds(data, tmp_path / "c", ["id", "country"], filters=f, categorical={"country": gpuload.Vocab()})
        assert ds.vocabulary("country").to_dict() == want
        country = dict(zip(kept["id"].to_pylist(), kept["country"].to_pylist()))
        for b in ds:
            assert b["country"].tolist() == [want.get(country[i], 0) for i in b["id"].tolist()]
        assert len(counted) == k + 1
    _ds(data, tmp_path / "c", ["id", "country"], filters=filters[0], categorical={"country": gpuload.Vocab()})
    assert len(counted) == 2  # the same filter again: read from the cache, not counted


def test_the_filters_columns_and_text():
    f = RowFilter.of([[("a", ">", 1), ("b", "in", [1, 2])], [("c", "==", "x")]])
    schema = pa.schema([("a", pa.int64()), ("b", pa.int32()), ("c", pa.string()), ("d", pa.float64())])
    assert f.columns(schema) == ["a", "b", "c"]
    assert RowFilter.of([("a", ">", 1)]).text == "(a > 1)"
    long = [RowFilter.of([("a", "in", [v if i == 20 else i for i in range(40)])]) for v in (100, 101)]  # abbreviated
    spaced = [RowFilter.of([("s", "==", v)]) for v in ("a  b", "a b")]
    floats = [RowFilter.of(pc.field("f") == pc.scalar(pa.scalar(0.1, t))) for t in (pa.float32(), pa.float64())]
    for one, other in (long, spaced, floats):  # texts alike, filters not: keys differ
        assert one.text == other.text and one.key != other.key
    assert RowFilter.of([("a", ">", 1)]).key == RowFilter.of(pc.field("a") > 1).key  # the same filter: one key
    assert RowFilter.of(f) is f and RowFilter.of(None) is None


def test_counts_are_kept_in_the_cache_and_read_by_the_next_open(data, tmp_path, monkeypatch):
    counted = []
    real = gpuload.counting.kept_positions
    monkeypatch.setattr(gpuload.counting, "kept_positions",
                        lambda f, chunk, *a, **k: counted.append((f.path, chunk.rg_start)) or real(f, chunk, *a, **k))
    f = [("day", ">=", 20260150)]
    first = _ds(data, tmp_path / "c", filters=f)
    assert counted and first.reader.cache.root.scan(("v3", "vocab"))
    counted.clear()
    again = _ds(data, tmp_path / "c", filters=f)  # a restart, another rank: no Parquet read to plan
    assert counted == [] and again.reader.chunks == first.reader.chunks
    _ds(data, tmp_path / "c", filters=[("day", ">=", 20260151)])  # another filter: counted again
    assert counted


def test_kept_counts_are_verified_listed_and_cleared(data, tmp_path, cli):
    from gpuload.cache.fs import CacheRoot

    _ds(data, tmp_path / "c", filters=[("country", "==", "US")])
    root = CacheRoot(tmp_path / "c")
    names = [n for n, _ in root.scan(("v3", "vocab")) if n.endswith(".kept")]
    assert len(names) == 2  # one per source file
    info = cli("cache", "info", "--cache-dir", str(tmp_path / "c"))
    assert "kept-row counts: 2 source files counted" in info.stdout
    assert cli("cache", "verify", "--cache-dir", str(tmp_path / "c")).returncode == 0
    path = tmp_path / "c" / "v3" / "vocab" / names[0]
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    bad = cli("cache", "verify", "--cache-dir", str(tmp_path / "c"))
    assert bad.returncode == 1 and names[0] in bad.stdout + bad.stderr
    ds = _ds(data, tmp_path / "c", filters=[("country", "==", "US")])  # a bad file is counted again, not trusted
    assert np.array_equal(np.sort(_ids(ds)), _want(data, [("country", "==", "US")]))
    ds.close()  # an open dataset's column set (and the counts beside it) would be kept
    assert cli("cache", "clear", "--cache-dir", str(tmp_path / "c")).returncode == 0
    assert not list((tmp_path / "c").rglob("*.kept"))


def test_the_command_builds_and_profiles_filtered_caches(data, tmp_path, cli):
    f = '[["country", "==", "DE"], ["day", "<", 20260120]]'
    built = cli("cache", "build", str(data), "--cache-dir", str(tmp_path / "c"), "--columns", "id,v,l",
                "--chunk-mib", "0.0078125", "--filter", f)
    assert built.returncode == 0, built.stderr
    ds = _ds(data, tmp_path / "c", filters=[("country", "==", "DE"), ("day", "<", 20260120)])
    assert np.array_equal(np.sort(_ids(ds)), _want(data, [("country", "==", "DE"), ("day", "<", 20260120)]))
    assert ds.reader.counters.decoded == 0  # the command built this dataset's cache
    info = cli("cache", "info", "--cache-dir", str(tmp_path / "c"))
    assert 'rows where ((country == "DE") and (day < 20260120))' in info.stdout
    bad = cli("cache", "build", str(data), "--cache-dir", str(tmp_path / "c"), "--filter", "[[day]]")
    assert bad.returncode != 0 and "--filter" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
def test_on_a_gpu_the_kept_rows_are_the_cpus(data, tmp_path):
    """With cuDF, pyarrow evaluates the filter on its columns and the kept rows are gathered on the GPU
    from cuDF's decoding; without it, pyarrow decodes and the chunk is copied: the rows are the CPU's."""
    f = [("day", ">=", 20260120), ("country", "!=", "US")]
    cpu = _ds(data, tmp_path / "cpu", filters=f, shuffle=False)
    gpu = _ds(data, tmp_path / "gpu", filters=f, shuffle=False, device="cuda")
    a, b = list(cpu), list(gpu)
    assert len(a) == len(b) and all(torch_equal(x["v"], y["v"].cpu()) and torch_equal(x["id"], y["id"].cpu())
                                    for x, y in zip(a, b))


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_every_position_resumes_and_an_elastic_resize_keeps_each_kept_row_once(data, tmp_path):
    f = [("day", "<", 20260150), ("country", "!=", "FR")]
    ds = _ds(data, tmp_path / "c", filters=f, batch_size=300)
    run, states = [], [ds.state_dict()]
    for b in ds:
        run.append(b["id"].numpy().copy())
        states.append(ds.state_dict())
    for k, state in enumerate(states[:-1]):  # resumed before batch k
        again = _ds(data, tmp_path / "c", filters=f, batch_size=300)
        again.load_state_dict(state)
        rest = [b["id"].numpy() for b in again]
        assert len(rest) == len(run) - k and all(np.array_equal(a, b) for a, b in zip(rest, run[k:])), k
    two = []  # 2 ranks take 3 batches each, then 3 ranks share the rest of the epoch
    for r in range(2):
        d = _ds(data, tmp_path / "c", filters=f, batch_size=300, rank=r, world_size=2)
        it = iter(d)
        two.append([next(it)["id"].numpy().copy() for _ in range(3)])
        state = d.state_dict()
        it.close()
    rest = [np.concatenate([b["id"].numpy() for b in _resumed(data, tmp_path, f, state, r)]) for r in range(3)]
    got = np.concatenate([np.concatenate(p) for p in two] + rest)
    want = _want(data, f)
    assert len(np.unique(got)) == len(got) and set(got) <= set(want) and len(want) - len(got) < 3 * 300


def _resumed(data, tmp_path, f, state, rank):
    d = _ds(data, tmp_path / "c", filters=f, batch_size=300, rank=rank, world_size=3)
    d.load_state_dict(state)
    return list(d)


def test_a_filter_and_a_transform_together(data, tmp_path):
    import torch

    t = gpuload.Transform(lambda o: {"id": o["id"], "v2": (o["v"] * 2).to(torch.float32)}, key="v2")
    ds = _ds(data, tmp_path / "c", filters=[("country", "==", "US")], transform=t, shuffle=False)
    got = {int(i): float(v) for b in ds for i, v in zip(b["id"].numpy(), b["v2"].numpy())}
    table = pq.read_table(data, filters=[("country", "==", "US")])
    assert sorted(got) == sorted(table["id"].to_pylist())
    assert all(got[i] == np.float32(v * 2) for i, v in zip(table["id"].to_pylist(), table["v"].to_pylist()))


def test_every_type_of_the_kept_rows_is_exact(tmp_path):
    """The every-type data (tests/typecases.py), filtered on a loaded and an unloaded column: each
    value of each kept row as the unfiltered data has it, the kept rows pyarrow's."""
    from typecases import COLUMNS, DTYPES, FILL, write_every_type

    expected = write_every_type(tmp_path / "every", files=2, rows=4000)
    f = [[("row_id", ">=", 1000), ("row_id", "<", 6500), ("i32", ">", 0)], [("row_id", "<", 50)]]
    ds = gpuload.ParquetDataset(tmp_path / "every", COLUMNS, cache_dir=tmp_path / "c", device="cpu", fill_nulls=FILL,
                                dtypes=DTYPES, batch_size=700, chunk_bytes=1 << 17, filters=f, seed=3)
    ids = np.concatenate([expected.check(b, COLUMNS) for b in ds])
    want = np.sort(pq.read_table(tmp_path / "every", columns=["row_id"], filters=f)["row_id"].to_numpy())
    assert len(ids) == len(want) and np.array_equal(np.sort(ids), want)


def test_a_filter_on_a_hashed_string_output_compares_its_values(data, tmp_path):
    """The decoder reads a hashed string column as a dictionary: the filter still sees strings."""
    f = pc.starts_with(pc.field("country"), "D")
    ds = _ds(data, tmp_path / "c", ["id", "country"], filters=f, categorical={"country": gpuload.Hash(100)})
    assert np.array_equal(np.sort(_ids(ds)), np.sort(pq.read_table(data, filters=f)["id"].to_numpy()))


def test_a_filter_that_cannot_be_evaluated_is_refused_naming_the_file(tmp_path, cli):
    write_parquet(tmp_path / "d" / "a.parquet", {"id": np.arange(10), "t": np.arange(10)})
    write_parquet(tmp_path / "d" / "b.parquet", {"id": np.arange(10), "t": pa.array(list("abcdefghij"))})
    f = [("t", ">", 3)]  # a number in a.parquet, a string in b.parquet
    with pytest.raises(gpuload.SchemaError, match=r"b\.parquet: filters= .* cannot be evaluated on its columns"):
        _ds(tmp_path / "d", tmp_path / "c", ["id"], filters=f)
    with pytest.raises(gpuload.SchemaError, match=r"filters= \(t > 3\) compares values of different types "
                                                  r"\(string, int8\); .*\(t is string\)"):
        _ds(tmp_path / "d" / "b.parquet", tmp_path / "c", ["id"], filters=f)
    r = cli("cache", "build", str(tmp_path / "d"), "--cache-dir", str(tmp_path / "c"), "--columns", "id",
            "--filter", '[["t", ">", 3]]')
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "--filter" in r.stderr


def test_a_state_does_not_resume_a_dataset_with_another_filter(data, tmp_path):
    a = _ds(data, tmp_path / "c", filters=[("country", "==", "DE")])
    it = iter(a)
    next(it)
    state = a.state_dict()
    it.close()
    b = _ds(data, tmp_path / "c", filters=[("country", "==", "FR")])
    with pytest.raises(gpuload.ConfigError, match="filter"):
        b.load_state_dict(state)
