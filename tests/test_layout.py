"""Storage layouts (gpuload.layout) and block shuffling: what is stored, what comes out, which order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import gpuload
from gpuload import plan
from gpuload.batch import Ragged, nrows
from gpuload.cache.chunkfile import PREFIX
from gpuload.layout import Layout, Pieces, joined, merge_pieces, spec_description, stack, stored_outputs
from gpuload.schema import resolve_outputs

from conftest import dataset_factory, row_ids

N = 6000


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two files of 3000 rows (500-row row groups): ids, two int64 and two float32 columns, a list."""
    d = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(5)
    for f in range(2):
        ids = np.arange(f * 3000, (f + 1) * 3000, dtype=np.int64)
        lengths = rng.integers(0, 4, 3000)
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        t = pa.table({"id": ids, "a": ids * 7, "x": rng.random(3000).astype(np.float32),
                      "y": rng.random(3000).astype(np.float32), "lab": (ids % 2).astype(np.int8),
                      "h": pa.ListArray.from_arrays(pa.array(off), pa.array(rng.integers(0, 99, int(off[-1]))))})
        pq.write_table(t, d / f"part-{f}.parquet", row_group_size=500)
    return d


COLUMNS = {"id": "id", "a": "a", "x": "x", "y": "y", "lab": "lab", "xy": ["x", "y"], "h": "h"}


_open = dataset_factory(COLUMNS, batch_size=256, chunk_bytes=32 << 10)


def _specs(source):
    return resolve_outputs(pq.read_schema(next(source.glob("*.parquet"))), COLUMNS, None, None)


def _all(ds) -> dict:
    out: dict = {}
    for b in ds:
        for k, v in b.items():
            out.setdefault(k, []).append(v)
    return out


# -- the layout itself ---------------------------------------------------------------------------
def test_rows_layout_blocks_scalars_sharing_a_dtype(source):
    desc = spec_description(_specs(source), "rows")
    assert {d["name"]: d.get("block") for d in desc} == {"id": "#<i8", "a": "#<i8", "x": "#<f4", "y": "#<f4",
                                                          "lab": None, "xy": None, "h": None}
    assert [s[0] for s in stored_outputs(desc)] == ["#<i8", "#<f4", "lab", "xy", "h"]
    assert stored_outputs(desc)[0] == ("#<i8", "group", "<i8", 2)
    # the columns layout describes the outputs exactly as before layouts existed: old caches keep their key
    plain = spec_description(_specs(source), "columns")
    assert all(set(d) == {"name", "columns", "kind", "dtype", "width", "sources", "fills"} for d in plain)
    assert [s[0] for s in stored_outputs(plain)] == list(COLUMNS)


def test_pack_and_unpack_round_trip_into_contiguous_outputs(source):
    layout = Layout(spec_description(_specs(source), "rows"))
    rng = np.random.default_rng(0)
    n = 1000
    cols = {"id": np.arange(n), "a": np.arange(n) * 7, "x": rng.random(n, np.float32),
            "y": rng.random(n, np.float32), "lab": np.zeros(n, np.int8), "xy": rng.random((n, 2), np.float32),
            "h": Ragged(np.arange(3), np.array([0] * (n - 2) + [1, 2, 3]))}
    stored = layout.pack(cols)
    assert list(stored) == ["#<i8", "#<f4", "lab", "xy", "h"]
    assert stored["#<i8"].shape == (n, 2) and stored["#<i8"].flags.c_contiguous
    np.testing.assert_array_equal(stored["#<i8"][:, 1], cols["a"])
    for alloc in (None, lambda shape, dtype: np.empty(shape, dtype)):
        back = layout.unpack({k: v[10:20] if not isinstance(v, Ragged) else v for k, v in stored.items()}, alloc)
        assert list(back) == list(cols)
        for k in ("id", "a", "x", "y"):
            assert back[k].flags.c_contiguous and back[k].dtype == cols[k].dtype
            np.testing.assert_array_equal(back[k], cols[k][10:20])


def test_hash_names_are_reserved_in_the_rows_layout(tmp_path):
    pq.write_table(pa.table({"a": [1, 2], "b": [3, 4]}), tmp_path / "t.parquet")
    with pytest.raises(gpuload.ConfigError, match="'#a'.*reserved"):
        gpuload.ParquetDataset(tmp_path / "t.parquet", {"#a": "a", "b": "b"}, cache_dir=tmp_path / "c",
                               device="cpu")
    ds = gpuload.ParquetDataset(tmp_path / "t.parquet", {"#a": "a", "b": "b"}, cache_dir=tmp_path / "c",
                                device="cpu", layout="columns", shuffle=False)
    assert next(iter(ds))["#a"].tolist() == [1, 2]


@pytest.mark.parametrize("bad", [dict(layout="diagonal"), dict(shuffle="blocks"), dict(shuffle="block", block_rows=0),
                                 dict(shuffle=2)])
def test_bad_layout_and_shuffle_settings_are_refused(source, tmp_path, bad):
    with pytest.raises(gpuload.ConfigError, match="layout|shuffle|block_rows"):
        _open(source, tmp_path / "c", **bad)


def _header(path) -> dict:
    raw = path.read_bytes()
    _, _, hlen, _ = PREFIX.unpack(raw[:PREFIX.size])
    return json.loads(raw[PREFIX.size:PREFIX.size + hlen])


def test_chunk_files_store_blocks_and_each_layout_has_its_own(source, tmp_path):
    cache = tmp_path / "c"
    got = {}
    for layout in ("rows", "columns"):
        ds = _open(source, cache, layout=layout, shuffle=False)
        got[layout] = _all(ds)
        ds.reader.cache.flush()
        assert ds.reader.counters.decoded == len(ds.reader.chunks)  # no file of the other layout is served
    files = sorted(cache.rglob("*.glc"))
    regions = [{r["output"]: r["shape"] for r in _header(f)["regions"]} for f in files]
    rows = [r for r in regions if "#<i8" in r]
    assert len(rows) == len(files) // 2
    assert all(r["#<i8"][1] == 2 and r["#<f4"][1] == 2 and "id" not in r for r in rows)
    for k in COLUMNS:  # identical batches in both layouts
        for a, b in zip(got["rows"][k], got["columns"][k]):
            if isinstance(a, Ragged):
                assert torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)
            else:
                assert torch.equal(a, b) and a.is_contiguous()


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_same_order_in_both_layouts(source, tmp_path, shuffle):
    orders = []
    for layout in ("rows", "columns"):
        ds = _open(source, tmp_path / layout, layout=layout, shuffle=shuffle, block_rows=32, seed=4)
        ds.set_epoch(2)
        orders.append(row_ids(ds, "id"))
    assert np.array_equal(*orders)
    assert np.array_equal(np.sort(orders[0]), np.arange(N))


def _same(got: dict, want: dict) -> None:
    for k in COLUMNS:
        for a, b in zip(got[k], want[k], strict=True):
            if isinstance(a, Ragged):
                assert torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)
            else:
                assert torch.equal(a, b) and a.is_contiguous()


@pytest.mark.parametrize("shuffle", [False, "chunks", True, "block"])
@pytest.mark.parametrize("cache_io", ["off", "buffered"])
def test_auto_layout_is_columns_where_no_row_is_gathered(source, tmp_path, shuffle, cache_io):
    """layout='auto' (the default) stores rows where rows are gathered (a row or block shuffle), else
    columns (no shuffle, or 'chunks'): batches are views of the chunks' columns, no block to
    unpack (a cached epoch's CPU about halved on 2 cores). The batches are those of an explicit
    'rows' dataset, in the same order."""
    auto = _open(source, tmp_path / "a", shuffle=shuffle, block_rows=32, seed=3, cache_io=cache_io)
    columns = shuffle in (False, "chunks")
    assert bool(auto.reader.layout.blocks) != columns
    assert auto.stats().loader_settings["layout"] == ("columns" if columns else "rows")  # what "auto" chose
    rows = _open(source, tmp_path / "r", shuffle=shuffle, block_rows=32, seed=3, cache_io=cache_io, layout="rows")
    assert rows.reader.layout.blocks
    _same(_all(auto), _all(rows))


@pytest.mark.parametrize("shuffle", [False, "chunks"])
def test_auto_reads_the_row_blocks_cached_before_instead_of_building_columns(source, tmp_path, shuffle):
    """A cache built for a row shuffle (or by `gpuload cache build`, rows by default) serves a run
    that gathers no row: nothing decoded, no second copy on the disk; a set missing a chunk (evicted,
    a node's share, a build going on) too, the missing chunk built as row blocks; an explicit
    layout='columns', or a cache holding as much as columns, builds or reads columns."""
    built = _open(source, tmp_path / "c", shuffle=True, seed=3)
    _all(built)
    built.reader.cache.flush()
    files = sorted((tmp_path / "c").rglob("*.glc"))
    assert len(files) == len(built.reader.chunks) > 1
    built.close()
    ds = _open(source, tmp_path / "c", shuffle=shuffle, seed=3)
    assert ds.stats().loader_settings["layout"] == "rows" and ds.reader.layout.blocks
    got = _all(ds)
    assert ds.reader.counters.decoded == 0 and sorted((tmp_path / "c").rglob("*.glc")) == files
    fresh = _open(source, tmp_path / "f", shuffle=shuffle, seed=3)
    assert fresh.stats().loader_settings["layout"] == "columns"
    want = _all(fresh)
    _same(got, want)
    ds.close()
    files[0].unlink()  # one chunk of the set gone: the rest still read, the one built as row blocks
    partial = _open(source, tmp_path / "c", shuffle=shuffle, seed=3)
    assert partial.stats().loader_settings["layout"] == "rows"
    _same(_all(partial), want)
    partial.reader.cache.flush()  # the writer's threads write it after the epoch (a busy CI counted 11 of 12)
    assert partial.reader.counters.decoded == 1 and len(list((tmp_path / "c").rglob("*.glc"))) == len(files)
    partial.close()
    forced = _open(source, tmp_path / "c", shuffle=shuffle, seed=3, layout="columns")  # asked for: built
    _same(_all(forced), want)
    assert forced.reader.counters.decoded == len(forced.reader.chunks)
    forced.close()
    both = _open(source, tmp_path / "c", shuffle=shuffle, seed=3)  # as much cached either way: columns
    assert both.stats().loader_settings["layout"] == "columns"
    _same(_all(both), want)
    assert both.reader.counters.decoded == 0
    both.close()
    fresh.close()


# -- block shuffling -----------------------------------------------------------------------------
@pytest.mark.parametrize("n,b", [(0, 4), (1, 4), (10, 3), (12, 3), (1000, 64), (63, 64)])
def test_block_permutation_moves_whole_blocks(n, b):
    key = dict(fingerprint=9, seed=1, epoch=2, rank=0, window=3)
    p = plan.block_permutation(n, b, **key)
    assert np.array_equal(np.sort(p), np.arange(n))
    assert np.array_equal(p, plan.block_permutation(n, b, **key))  # a pure function
    pos = 0
    while pos < n:  # block after block: each starts at a multiple of b and keeps its rows in order
        start = p[pos]
        length = min(b, n - start)
        assert start % b == 0 and np.array_equal(p[pos:pos + length], np.arange(start, start + length))
        pos += length
    if n >= 10 * b:
        assert not np.array_equal(p, plan.block_permutation(n, b, **{**key, "epoch": 3}))


def test_block_shuffle_reads_permuted_chunks_in_blocks(source, tmp_path):
    ds = _open(source, tmp_path / "c", shuffle="block", block_rows=32, shuffle_window=2)
    ds.set_epoch(1)
    ids = row_ids(ds, "id")
    assert np.array_equal(np.sort(ids), np.arange(N))
    # rows were permuted inside each chunk when it was cached...
    stored = [ds.reader.load(i)["#<i8"][:, 0] for i in range(len(ds.reader.chunks))]
    assert all(not np.array_equal(s, np.sort(s)) for s in stored)
    assert np.mean(np.diff(ids) == 1) < 0.05
    # ...and blocks of 32 rows of that stored order come out whole: nearly every delivered row is
    # followed by its successor in the stored order (not at block ends, nor at a chunk's end)
    where = np.empty(N, np.int64)
    where[np.concatenate(stored)] = np.arange(N)
    assert np.mean(np.diff(where[ids]) == 1) > 0.9


def test_block_cache_files_are_deterministic_and_prebuilt(source, tmp_path):
    kw = dict(shuffle="block", block_rows=32)
    summary = gpuload.build_cache(source, tmp_path / "a", COLUMNS, chunk_bytes=32 << 10, **kw)
    gpuload.build_cache(source, tmp_path / "b", COLUMNS, chunk_bytes=32 << 10, **kw)
    a, b = sorted((tmp_path / "a").rglob("*.glc")), sorted((tmp_path / "b").rglob("*.glc"))
    assert len(a) == summary.chunks and [f.name for f in a] == [f.name for f in b]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    ds = _open(source, tmp_path / "a", **kw)
    row_ids(ds, "id")
    assert ds.reader.counters.decoded == 0 and ds.reader.counters.from_cache > 0  # build_cache built exactly what block shuffling reads
    # another block size reads the same files (the permutation inside a chunk does not depend on it)
    ds = _open(source, tmp_path / "a", shuffle="block", block_rows=100)
    row_ids(ds, "id")
    assert ds.reader.counters.decoded == 0


def test_block_shuffle_resumes_exactly_and_refuses_another_block_size(source, tmp_path):
    kw = dict(shuffle="block", block_rows=32, seed=3)
    ds = _open(source, tmp_path / "c", **kw)
    ds.set_epoch(1)
    full = [b["id"].numpy() for b in ds]
    ds.set_epoch(1)  # again (a new iteration alone would begin epoch 2)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    it.close()
    again = _open(source, tmp_path / "c", **kw)
    again.load_state_dict(json.loads(json.dumps(state)))
    again.set_epoch(1)
    rest = [b["id"].numpy() for b in again]
    assert len(rest) == len(full) - 5 and all(np.array_equal(x, y) for x, y in zip(rest, full[5:]))
    for other in (dict(kw, block_rows=64), dict(seed=3)):
        with pytest.raises(gpuload.ConfigError, match="block_rows"):
            _open(source, tmp_path / "c", **other).load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 3), st.data())
def test_pieces_give_each_row_once_in_spans_stacks_and_joins(lengths, k, data):
    rng = np.random.default_rng(sum(lengths) + k)
    columns = [rng.integers(-9, 9, sum(lengths)) for _ in range(k)]
    cuts = np.cumsum([0] + lengths)
    pieces = [Pieces([c[a:b] for a, b in zip(cuts[:-1], cuts[1:])]) for c in columns]
    n = sum(lengths)
    assert len(pieces[0]) == n and nrows({"c": pieces[0]}) == n and pieces[0].nbytes == columns[0].nbytes
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    got = np.zeros(b - a, np.int64) - 100
    for off, part in pieces[0].spans(a, b):
        assert (got[off:off + len(part)] == -100).all()  # never written twice
        got[off:off + len(part)] = part
    np.testing.assert_array_equal(got, columns[0][a:b])
    # a block of pieces, arrays, or both
    mixed = [p if j % 2 == 0 else c for j, (p, c) in enumerate(zip(pieces, columns))]
    np.testing.assert_array_equal(stack(mixed), np.column_stack(columns))
    kept = []
    joined_ = joined(pieces[0], lambda shape, dtype: kept.append(shape) or np.empty(shape, dtype))
    np.testing.assert_array_equal(joined_, columns[0])
    assert kept == ([] if len(lengths) == 1 else [(n,)])  # one part: itself, not copied
    assert joined(columns[0]) is columns[0]


def test_stacks_of_pieces_cross_tiles_and_parts(monkeypatch):
    import gpuload.layout as layout

    monkeypatch.setattr(layout, "_TILE", 7)  # tiles that end inside parts, parts that end inside tiles
    x, y = np.arange(50.0), -np.arange(50.0)
    p = Pieces([x[:3], x[3:3], x[3:20], x[20:]])
    np.testing.assert_array_equal(stack([p, y]), np.column_stack([x, y]))
    with pytest.raises(ValueError, match="at least one part"):
        Pieces([])


@pytest.mark.parametrize("shuffle, warned", [(True, True), ("chunks", True), (False, True), ("block", False)])
def test_block_rows_given_for_another_shuffle_is_said_to_do_nothing(source, tmp_path, caplog, shuffle, warned):
    """A user's trial: block_rows=64 with shuffle=True was accepted and silently ignored."""
    caplog.set_level("WARNING", logger="gpuload")
    _open(source, tmp_path / "c", shuffle=shuffle, block_rows=64)
    said = [r.getMessage() for r in caplog.records if "block_rows=64 has no effect" in r.getMessage()]
    assert len(said) == int(warned)
    caplog.clear()
    _open(source, tmp_path / "c", shuffle=shuffle)  # the default: nothing to say
    assert not [r for r in caplog.records if "block_rows" in r.getMessage()]


def test_merge_pieces_puts_a_packs_files_rows_one_after_another():
    a = {"x": Pieces([np.arange(3), np.arange(3, 5)]), "v": np.ones((2, 2), np.float32) * [[1], [2]],
         "l": Ragged(np.arange(10, 16), np.array([2, 4, 6]))}  # a list's part may start past 0
    b = {"x": Pieces([np.arange(5, 6)]), "v": np.full((1, 2), 3, np.float32), "l": Ragged(np.arange(3), np.array([0, 3]))}
    got = merge_pieces([a, b])
    assert isinstance(got["x"], Pieces) and joined(got["x"]).tolist() == list(range(6))
    assert got["v"][:, 0].tolist() == [1, 2, 3]
    assert got["l"].offsets.tolist() == [0, 2, 4, 7] and got["l"].values.tolist() == [12, 13, 14, 15, 0, 1, 2]
    assert merge_pieces([a]) is a
