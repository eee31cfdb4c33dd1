"""Batch: take / rows / concat on column sets with Ragged columns, and the Batcher."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuload import plan
from gpuload.batch import Batcher, Parts, Ragged, concat, long_runs, nbytes, nrows, rows, take

SETTINGS = settings(max_examples=120, deadline=None)


# -- a column set whose every value says which row it came from ----------------------------
def _lists(ids) -> list[list[int]]:
    return [[int(i) * 10 + j for j in range(int(i) % 4)] for i in ids]  # lengths 0..3, empties included


def ragged_of(lists: list[list[int]], dtype=np.int64) -> Ragged:
    off = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=off[1:])
    return Ragged(np.array([v for x in lists for v in x], dtype=dtype), off)


def to_lists(r: Ragged) -> list[list]:
    check_offsets(r)
    return [r.values[r.offsets[i]:r.offsets[i + 1]].tolist() for i in range(len(r.offsets) - 1)]


def check_offsets(r: Ragged) -> None:
    assert r.offsets.dtype == np.int64
    assert r.offsets[0] == 0 and r.offsets[-1] == len(r.values)
    assert np.all(np.diff(r.offsets) >= 0)


def cols_of(ids) -> dict:
    ids = np.asarray(ids, np.int64)
    return {"x": ids.copy(), "f": np.stack([ids, 2 * ids, -ids], axis=1).astype(np.float32),
            "r": ragged_of(_lists(ids))}


def assert_cols_are(cols: dict, ids) -> None:
    """``cols`` holds exactly rows ``ids`` of the reference, in that order."""
    ids = np.asarray(ids, np.int64)
    assert nrows(cols) == len(ids)
    np.testing.assert_array_equal(cols["x"], ids)
    np.testing.assert_array_equal(cols["f"], cols_of(ids)["f"])
    assert cols["f"].shape == (len(ids), 3)
    assert len(cols["r"].offsets) == len(ids) + 1
    assert to_lists(cols["r"]) == _lists(ids)


# -- take / rows / concat -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.bool_, np.int8])
def test_device_ragged_gather_equals_the_host_one(dtype):
    """The device gather (its own kernels) gives the host gather's values and offsets:
    empty rows first, last and in runs, repeated rows, int32 and int64 indices, no rows,
    only empty rows."""
    import cupy

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 5, 3000)
    lengths[:3] = lengths[-3:] = 0
    lengths[1000:1200] = 0
    lists = [list(rng.integers(-50, 50, n)) for n in lengths]
    host = ragged_of(lists, dtype)
    dev = Ragged(cupy.asarray(host.values), cupy.asarray(host.offsets))
    cases = [rng.permutation(3000), rng.integers(0, 3000, 5000).astype(np.int32), np.arange(1000, 1200),
             np.array([2999, 0, 0, 1500]), np.zeros(0, np.int64)]
    for idx in cases:
        want = take({"r": host}, idx)["r"]
        got = take({"r": dev}, cupy.asarray(idx))["r"]
        assert got.values.dtype == want.values.dtype and cupy.asnumpy(got.offsets).tolist() == want.offsets.tolist()
        assert cupy.asnumpy(got.values).tolist() == want.values.tolist()
    # rows of a slice (its values a view at an offset) through a strided index
    part_host, part_dev = rows({"r": host}, 700, 2900), rows({"r": dev}, 700, 2900)
    idx = rng.permutation(2200)
    want = take(part_host, idx[::3])["r"]
    got = take(part_dev, cupy.asarray(idx)[::3])["r"]
    assert cupy.asnumpy(got.offsets).tolist() == want.offsets.tolist()
    assert cupy.asnumpy(got.values).tolist() == want.values.tolist()


@SETTINGS
@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(1, 9), st.data())
def test_parts_copy_a_block_shuffles_rows_without_joining_the_window(sizes, block, data):
    """A window's chunk pieces (empty ones too), read through a block permutation or any
    index: the rows of their concatenation, runs across a piece's end included, in new
    arrays, the same as the joined window's gather."""
    bounds = np.cumsum([0] + sizes)
    parts = [cols_of(np.arange(a, b) + 5) for a, b in zip(bounds[:-1], bounds[1:])]
    n = int(bounds[-1])
    assume(n > 0)
    starts = data.draw(st.permutations(list(range(0, n, block))))
    perm = np.concatenate([np.arange(a, min(a + block, n)) for a in starts]).astype(np.int64)
    lo = data.draw(st.integers(0, n))
    idx = perm[lo:data.draw(st.integers(lo, n))] if data.draw(st.booleans()) else \
        np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=40)), np.int64)
    window = Parts(parts)
    assert len(window) == n and window.nbytes == sum(nbytes(p) for p in parts)
    got = window.take(idx)
    assert_cols_are(got, idx + 5)
    for k, v in got.items():  # copies: the pieces can go
        for a in (v.values, v.offsets) if isinstance(v, Ragged) else (v,):
            assert not any(np.shares_memory(a, b) for p in parts for b in
                           ((p[k].values, p[k].offsets) if isinstance(p[k], Ragged) else (p[k],)))


def test_long_runs_tells_a_block_permutation_from_a_row_permutation():
    rng = np.random.default_rng(1)
    blocks = np.concatenate([np.arange(a, a + 64) for a in rng.permutation(100) * 64])
    assert long_runs(blocks) and not long_runs(rng.permutation(6400))
    assert not long_runs(np.arange(1)) and not long_runs(np.arange(5) * 2)


@SETTINGS
@given(st.integers(0, 40), st.data())
def test_take_gathers_rows_in_index_order(n, data):
    cols = cols_of(np.arange(n) + 5)
    idx = np.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=50 if n else 0)), np.int64)
    assert_cols_are(take(cols, idx), idx + 5)  # repeats and any order


@SETTINGS
@given(st.integers(1, 40), st.data())
def test_take_into_allocated_arrays(n, data):
    """With ``alloc`` every output array (dense, values, offsets) comes from it, holding the same rows."""
    cols = cols_of(np.arange(n) + 5)
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=50)), np.int64)
    made = []

    def alloc(shape, dtype):
        made.append(np.full(shape, 77, dtype))  # garbage that must be overwritten
        return made[-1]

    out = take(cols, idx, alloc)
    assert_cols_are(out, idx + 5)
    owned = [out["x"], out["f"], out["r"].offsets] + ([out["r"].values] if len(out["r"].values) else [])
    assert all(any(a is m for m in made) for a in owned)


def test_take_where_every_row_is_empty_and_empty_index():
    r = ragged_of([[], [1, 2], [], []])
    out = take({"r": r}, np.array([0, 2, 3, 0]))["r"]
    assert to_lists(out) == [[], [], [], []] and out.values.dtype == r.values.dtype
    out = take({"r": r}, np.array([], np.int64))["r"]
    assert to_lists(out) == [] and out.offsets.tolist() == [0]


def test_take_ragged_float_values_and_long_rows():
    lists = [[float(j) + i / 100 for j in range(i * 7 % 13)] for i in range(30)]
    idx = np.random.default_rng(0).permutation(30)
    out = take({"r": ragged_of(lists, np.float32)}, idx)["r"]
    assert out.values.dtype == np.float32
    np.testing.assert_allclose(np.concatenate([np.float32(lists[i]) for i in idx] + [[]]), out.values)
    assert np.diff(out.offsets).tolist() == [len(lists[i]) for i in idx]


def test_take_ragged_batches_larger_than_any_before_and_after_them():
    """The gather's kept positions (0, 1, 2, ...) grow with the largest batch and stay read-only:
    batches of 3, 40,000 and 5 values, in that order, each equal to the lists they name."""
    from gpuload import batch

    lists = [[7] * 3, list(range(40_000)), [1, 2, 3, 4, 5]]
    r = ragged_of(lists)
    for i in (0, 1, 2, 1, 0):
        out = take({"r": r}, np.array([i]))["r"]
        assert to_lists(out) == [lists[i]]
    assert len(batch._counts) >= 40_000 and not batch._counts.flags.writeable


@SETTINGS
@given(st.integers(0, 40), st.data())
def test_rows_slices_and_rebases_offsets(n, data):
    base = np.arange(n) * 3
    cols = cols_of(base)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    out = rows(cols, a, b)
    assert_cols_are(out, base[a:b])
    if b > a:  # dense outputs and ragged values are views, not copies
        assert np.shares_memory(out["x"], cols["x"]) and np.shares_memory(out["f"], cols["f"])
        if len(out["r"].values):
            assert np.shares_memory(out["r"].values, cols["r"].values)


@SETTINGS
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6))
def test_concat_joins_rows_in_order(lengths):
    starts = np.cumsum([0] + lengths)
    parts = [cols_of(np.arange(s, s + n) * 7) for s, n in zip(starts, lengths)]
    out = concat(parts)
    assert_cols_are(out, np.arange(starts[-1]) * 7)
    if len(parts) > 1:  # new arrays: the parts' buffers may be reused afterwards
        for k in ("x", "f"):
            assert not any(np.shares_memory(out[k], p[k]) for p in parts)


def test_concat_takes_list_parts_whose_offsets_do_not_start_at_zero():
    """A Ragged part may be a slice of a larger one (offsets from its first row's, values whole)."""
    whole = [[1, 2], [3], [], [4, 5, 6], [7]]
    big = ragged_of(whole)
    a = {"r": Ragged(big.values, big.offsets[1:4])}   # rows 1-2: offsets [2, 3, 3]
    b = {"r": Ragged(big.values, big.offsets[3:6])}   # rows 3-4: offsets [3, 6, 7]
    out = concat([a, b])["r"]
    assert to_lists(out) == whole[1:5]
    check_offsets(out)


def test_concat_one_part_is_returned_as_is_and_alloc_is_used():
    part = cols_of(np.arange(4))
    assert concat([part]) is part
    made = []

    def alloc(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]

    out = concat([cols_of(np.arange(4)), cols_of(np.arange(4, 9))], alloc=alloc)
    assert_cols_are(out, np.arange(9))
    n_values = sum(i % 4 for i in range(9))
    assert sorted((a.shape, a.dtype.str) for a in made) == sorted(
        [((9,), "<i8"), ((9, 3), "<f4"), ((10,), "<i8"), ((n_values,), "<i8")])
    assert any(out["x"] is a for a in made) and any(out["r"].offsets is a for a in made)


def test_nbytes_counts_values_and_offsets():
    cols = cols_of(np.arange(10))
    r = cols["r"]
    assert nbytes(cols) == 10 * 8 + 10 * 3 * 4 + r.values.nbytes + 11 * 8
    assert nrows({}) == 0 and nrows({"r": r}) == 10


# -- Batcher ------------------------------------------------------------------------------
@st.composite
def epochs(draw):
    windows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    total, sizes = sum(windows), []
    while True:
        s = draw(st.integers(1, 30))
        if sum(sizes) + s > total or len(sizes) > 40:
            break
        sizes.append(s)
    return windows, sizes, draw(st.booleans())


@SETTINGS
@given(epochs())
def test_batcher_cuts_planned_sizes_in_window_order(epoch):
    window_rows, sizes, shuffle = epoch
    rng = np.random.default_rng(len(sizes))
    batcher, batches, expected, added = Batcher(sizes), [], [], 0
    for w, n in enumerate(window_rows):
        ids = np.arange(added, added + n)
        perm = rng.permutation(n).astype(np.int64) if shuffle else None
        expected.append(ids if perm is None else ids[perm])
        new = list(batcher.add(cols_of(ids), perm))
        batches += new
        added += n
        # every batch complete once this window arrived was yielded right away
        assert len(batches) == int(np.searchsorted(np.cumsum(sizes), added, side="right"))
    assert batcher.done  # sum(sizes) <= rows added
    assert [nrows(b) for b in batches] == sizes
    want = np.concatenate(expected)[:sum(sizes)]
    got = np.concatenate([b["x"] for b in batches] + [np.array([], np.int64)])
    np.testing.assert_array_equal(got, want)
    pos = 0
    for b, s in zip(batches, sizes):
        assert_cols_are(b, want[pos:pos + s])
        pos += s


@pytest.mark.parametrize("shuffle", [False, True])
def test_batcher_with_planned_sizes_and_straddling_windows(shuffle):
    n, world, bs = 1003, 3, 64
    for rank in range(world):
        start, stop = plan.rank_range(n, world, rank, bs, False)
        sizes = plan.batch_sizes(n, world, rank, bs, False)
        ids = np.arange(start, stop)
        cuts = [0, 50, 51, 180, 333, len(ids)]  # windows of 50, 1, 129, 153, 1 or 2 rows
        batcher, out, want = Batcher(sizes), [], []
        for w, (a, b) in enumerate(zip(cuts, cuts[1:])):
            perm = plan.window_permutation(b - a, fingerprint=1, seed=2, epoch=0, rank=rank, window=w) \
                if shuffle else None
            want.append(ids[a:b] if perm is None else ids[a:b][perm])
            out += list(batcher.add(cols_of(ids[a:b]), perm))
        assert batcher.done and [nrows(b) for b in out] == sizes
        want = np.concatenate(want)
        assert_cols_are(concat(out), want)
        if shuffle:
            assert not np.array_equal(want, ids)


def test_batcher_holds_rows_back_until_a_batch_is_full():
    b = Batcher([5, 5])
    assert list(b.add(cols_of(np.arange(3)))) == []
    (first,) = b.add(cols_of(np.arange(3, 6)))
    assert_cols_are(first, np.arange(5)) and not b.done
    (second,) = b.add(cols_of(np.arange(6, 12)))
    assert_cols_are(second, np.arange(5, 10)) and b.done
    assert list(b.add(cols_of(np.arange(12, 20)))) == []  # planned batches only; the rest is dropped


def test_unpermuted_batch_inside_one_window_is_a_view():
    window = cols_of(np.arange(100))
    b = Batcher([30, 30, 40])
    first, second, third = b.add(window)
    for batch, lo in ((first, 0), (second, 30), (third, 60)):
        assert np.shares_memory(batch["x"], window["x"]) and np.shares_memory(batch["f"], window["f"])
        assert batch["x"][0] == lo
    # a permuted batch is a gather into new memory
    (p,) = Batcher([10]).add(window, np.arange(100)[::-1].copy())
    assert not np.shares_memory(p["x"], window["x"])
    assert_cols_are(p, np.arange(99, 89, -1))


def test_batcher_releases_a_shuffled_window_once_its_batches_are_cut():
    import gc
    import weakref

    from gpuload.batch import Batcher

    window = np.arange(1000, dtype=np.int64)
    ref = weakref.ref(window)
    perm = np.random.default_rng(0).permutation(1000)
    b = Batcher([300, 300, 300, 300, 100])
    got = [x["a"].copy() for x in b.add({"a": window}, perm)]
    del window
    gc.collect()
    assert ref() is None  # only the 100 rows still to come were kept, gathered, not the window
    got += [x["a"] for x in b.add({"a": np.arange(1000, 1300, dtype=np.int64)})]
    assert [len(g) for g in got] == [300, 300, 300, 300, 100] and b.done
    assert np.array_equal(np.concatenate(got), np.concatenate([perm, np.arange(1000, 1300)]))


def test_a_batch_joined_across_chunks_takes_one_pooled_buffer_for_all_its_arrays():
    """File order: a batch across two chunks is joined into arrays carved from one buffer of
    the pool (each column alone is too small to be kept), exactly the chunks' rows; once the
    batch is dropped, the next such batch reuses that buffer instead of fresh memory."""
    from gpuload.memory import HostPool

    rng = np.random.default_rng(3)

    def chunk(n, start):
        lens = rng.integers(0, 4, n)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return {"id": np.arange(start, start + n), "x": rng.random((n, 3), dtype=np.float32),
                "h": Ragged(rng.integers(0, 99, int(off[-1])), off)}

    chunks = [chunk(50_000, 0), chunk(50_000, 50_000), chunk(50_000, 100_000)]
    pool = HostPool(max_buffers=8)
    b = Batcher([40_000] * 3 + [30_000], alloc=pool.array)
    got = [batch for c in chunks for batch in b.add(c)]
    want = concat(chunks)
    assert [len(g["id"]) for g in got] == [40_000, 40_000, 40_000, 30_000]
    for g, a in zip(got, range(0, 150_000, 40_000)):
        expect = rows(want, a, a + len(g["id"]))
        assert np.array_equal(g["id"], expect["id"]) and np.array_equal(g["x"], expect["x"])
        assert np.array_equal(g["h"].values, expect["h"].values) and np.array_equal(g["h"].offsets, expect["h"].offsets)
    spanning = got[1]  # rows 40,000-80,000: chunks 0 and 1
    arrays = [spanning["id"], spanning["x"], spanning["h"].values, spanning["h"].offsets]
    bases = {id(_root(a)) for a in arrays}
    assert len(bases) == 1 and _root(arrays[0]) is pool._bufs[0]  # one buffer, the pool's
    held = pool.held_bytes
    del got, spanning, arrays
    b = Batcher([40_000] * 3 + [30_000], alloc=pool.array)
    again = [batch for c in chunks for batch in b.add(c)]
    assert _root(again[1]["id"]) is pool._bufs[0] and pool.held_bytes == held


def _root(a: np.ndarray) -> np.ndarray:
    while a.base is not None:
        a = a.base
    return a
