"""Plan: chunking, epoch order, shards and batch sizes (pure functions, property-based)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gpuload
from gpuload import plan
from gpuload.plan import Chunk

SETTINGS = settings(max_examples=150, deadline=None)


def _feasible(n: int, world: int, bs: int, drop_last: bool) -> bool:
    """The documented condition for equal, non-empty batch counts and at least one batch."""
    if drop_last:
        return n >= world * bs
    return not (n < world or (bs == 1 and n % world))


@st.composite
def shapes(draw, max_rows=3000):
    """(total rows, world size, batch size, drop_last); the batch size sometimes divides a rank's rows."""
    world = draw(st.integers(1, 7))
    n = draw(st.integers(0, max_rows))
    per = max(n // world, 1)
    divisors = [d for d in range(1, min(per, 64) + 1) if per % d == 0]
    bs = draw(st.one_of(st.integers(1, 64), st.sampled_from(divisors)))
    return n, world, bs, draw(st.booleans())


def _ranges(n, world, bs, drop_last):
    return [plan.rank_range(n, world, r, bs, drop_last) for r in range(world)]


# -- (a) rank ranges -----------------------------------------------------------------------
@SETTINGS
@given(shapes())
def test_rank_ranges_partition_the_stream(shape):
    n, world, bs, drop_last = shape
    ranges = _ranges(n, world, bs, drop_last)
    assert ranges[0][0] == 0
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        assert stop == start  # contiguous, no gap, no overlap
    lengths = [b - a for a, b in ranges]
    assert min(lengths) >= 0
    if drop_last:
        k = plan.num_batches(n, world, bs, True)
        assert ranges[-1][1] == k * world * bs <= n
        assert n - k * world * bs < world * bs  # only the tail that cannot fill a round is dropped
        assert set(lengths) == {k * bs}
    else:
        assert ranges[-1][1] == n
        assert max(lengths) - min(lengths) <= 1


# -- (b) batch sizes -----------------------------------------------------------------------
@SETTINGS
@given(shapes())
def test_every_rank_yields_the_same_number_of_batches(shape):
    n, world, bs, drop_last = shape
    if not _feasible(n, world, bs, drop_last):
        with pytest.raises(gpuload.ConfigError):
            plan.batch_sizes(n, world, 0, bs, drop_last)
        return
    k = plan.num_batches(n, world, bs, drop_last)
    assert k >= 1
    longest = 0
    for r, (start, stop) in enumerate(_ranges(n, world, bs, drop_last)):
        sizes = plan.batch_sizes(n, world, r, bs, drop_last)
        assert len(sizes) == k
        assert sum(sizes) == stop - start
        assert all(1 <= s <= bs for s in sizes)
        if drop_last:
            assert sizes == [bs] * k
        else:  # full batches except the last one or two
            assert sizes[:-2] == [bs] * max(k - 2, 0)
        longest = max(longest, stop - start)
    if not drop_last:  # no more batches than the longest rank needs
        assert k == -(-longest // bs)


@pytest.mark.parametrize("n,world,bs,expected", [
    (9, 2, 4, [[4, 1], [2, 2]]),           # rank 1 would end on an empty batch: halves its last
    (10, 3, 2, [[2, 2], [2, 1], [2, 1]]),
    (17, 4, 5, [[5], [4], [4], [4]]),
    (8, 2, 4, [[4], [4]]),
])
def test_tail_balancing_examples(n, world, bs, expected):
    assert [plan.batch_sizes(n, world, r, bs, False) for r in range(world)] == expected


# -- (g) infeasible configurations -----------------------------------------------------------
@SETTINGS
@given(st.integers(0, 200), st.integers(1, 7), st.integers(1, 8), st.booleans())
def test_check_balance_refuses_exactly_the_documented_cases(n, world, bs, drop_last):
    if _feasible(n, world, bs, drop_last):
        plan.check_balance(n, world, bs, drop_last)
        return
    with pytest.raises(gpuload.ConfigError) as info:
        plan.check_balance(n, world, bs, drop_last)
    text = str(info.value)
    if n == 0:
        assert "no rows" in text
        return
    assert text.startswith(f"{n:,} rows")
    # every change the message suggests makes the configuration feasible, and there is one
    def num(text):
        return int(text.replace(",", ""))

    tried = 0
    if m := re.search(r"batch_size=1 on at most ([\d,]+) ranks", text):
        assert _feasible(n, num(m[1]), 1, drop_last), text
        text, tried = text.replace(m[0], ""), tried + 1
    if m := re.search(r"at most ([\d,]+) ranks", text):
        assert _feasible(n, num(m[1]), bs, drop_last), text
        tried += 1
    if m := re.search(r"batch_size=([\d,]+) or less", text):
        assert _feasible(n, world, num(m[1]), drop_last), text
        tried += 1
    if m := re.search(r"batch_size=(\d+) or more", text):
        assert _feasible(n, world, int(m[1]), drop_last), text
        tried += 1
    if "drop_last=True (" in text:
        assert _feasible(n, world, bs, True), text
        tried += 1
    if "drop_last=False" in text:
        assert _feasible(n, world, bs, False), text
        tried += 1
    assert tried, text
    assert plan.feasible(n, world, bs, drop_last) is False


def test_world_larger_than_rows_names_a_fix_that_works():
    """2000 ranks over 1,000 rows: no batch size or drop_last helps; fewer ranks does."""
    with pytest.raises(gpuload.ConfigError, match="at most 1,000 ranks") as info:
        plan.check_balance(1000, 2000, 8, False)
    assert "drop_last=True" not in str(info.value) and "larger batch_size" not in str(info.value)
    with pytest.raises(gpuload.ConfigError, match="at most 125 ranks") as info:  # 125 * 8 = 1,000 rows
        plan.check_balance(1000, 2000, 8, True)
    assert "at most 1,000" not in str(info.value)
    plan.check_balance(1000, 125, 8, True)
    plan.check_balance(1000, 1000, 8, False)


def test_batch_sizes_cost_no_memory_per_batch():
    """A plan of 10^12 batches is a few objects, not a list of 10^12 sizes."""
    import sys

    sizes = plan.batch_sizes(10**15, 7, 3, 1000, False)
    assert len(sizes) == plan.num_batches(10**15, 7, 1000, False) > 10**11
    assert sys.getsizeof(sizes) < 1000
    assert sizes[0] == 1000 and sizes[-1] == sizes[len(sizes) - 1] >= 1
    assert sum(sizes[-3:]) <= 3000


@pytest.mark.parametrize("n,world,bs", [(3, 4, 8), (6, 7, 2), (7, 2, 1), (10, 3, 1)])
def test_impossible_balance_is_refused(n, world, bs):
    with pytest.raises(gpuload.ConfigError, match=f"{n} rows"):
        plan.check_balance(n, world, bs, False)
    with pytest.raises(gpuload.ConfigError):
        plan.batch_sizes(n, world, 0, bs, False)


@pytest.mark.parametrize("n,world,bs,drop_last", [(0, 1, 4, False), (0, 3, 1, False), (0, 2, 4, True),
                                                  (7, 2, 4, True), (15, 4, 4, True)])
def test_an_epoch_without_batches_is_refused(n, world, bs, drop_last):
    """No rows, or drop_last with fewer than W * batch_size rows: refused, not an empty epoch."""
    with pytest.raises(gpuload.ConfigError, match="no rows|no full batch"):
        plan.check_balance(n, world, bs, drop_last)
    plan.check_balance(world * bs, world, bs, drop_last)  # one full round is enough


@pytest.mark.parametrize("bs,world", [(0, 1), (4, 0)])
def test_nonpositive_batch_size_or_world_refused(bs, world):
    with pytest.raises(gpuload.ConfigError):
        plan.check_balance(100, world, bs, True)


# -- (c) segments cover every row exactly once -----------------------------------------------
@SETTINGS
@given(chunk_rows=st.lists(st.integers(1, 60), min_size=1, max_size=25), world=st.integers(1, 7),
       bs=st.integers(1, 40), drop_last=st.booleans(), shuffle=st.booleans(),
       seed=st.integers(0, 2**32), epoch=st.integers(0, 50), window=st.integers(1, 5))
def test_rank_segments_deliver_every_stream_row_once(chunk_rows, world, bs, drop_last, shuffle, seed, epoch,
                                                      window):
    n = sum(chunk_rows)
    assume(_feasible(n, world, bs, drop_last))
    offsets = np.concatenate([[0], np.cumsum(chunk_rows)])
    order = plan.chunk_order(len(chunk_rows), fingerprint=123, seed=seed, epoch=epoch, shuffle=shuffle)
    stream = np.concatenate([offsets[c] + np.arange(chunk_rows[c]) for c in order])
    delivered = []
    for r in range(world):
        start, stop = plan.rank_range(n, world, r, bs, drop_last)
        segs = plan.rank_segments(chunk_rows, order, start, stop)
        for s in segs:
            assert 0 <= s.lo < s.hi <= chunk_rows[s.chunk]
        ids = np.concatenate([offsets[s.chunk] + np.arange(s.lo, s.hi) for s in segs] or [np.array([], int)])
        np.testing.assert_array_equal(ids, stream[start:stop])  # in stream order
        assert len(ids) == sum(plan.batch_sizes(n, world, r, bs, drop_last))
        wins = plan.windows(segs, window)
        assert [s for w in wins for s in w] == segs
        assert all(len(w) == window for w in wins[:-1]) and all(1 <= len(w) <= window for w in wins)
        delivered.append(ids)
    everything = np.concatenate(delivered)
    assert len(np.unique(everything)) == len(everything)  # nothing twice
    if drop_last:
        kept = plan.num_batches(n, world, bs, True) * world * bs
        assert set(everything.tolist()) == set(stream[:kept].tolist())
    else:
        assert sorted(everything.tolist()) == list(range(n))


# -- (d) chunk order --------------------------------------------------------------------------
@SETTINGS
@given(st.integers(0, 60), st.integers(0, 2**63 - 1), st.integers(0, 2**40), st.integers(0, 1000))
def test_chunk_order_is_a_deterministic_permutation(n, fingerprint, seed, epoch):
    kw = dict(fingerprint=fingerprint, seed=seed, epoch=epoch)
    a = plan.chunk_order(n, shuffle=True, **kw)
    assert sorted(a.tolist()) == list(range(n))
    np.testing.assert_array_equal(a, plan.chunk_order(n, shuffle=True, **kw))
    np.testing.assert_array_equal(plan.chunk_order(n, shuffle=False, **kw), np.arange(n))


def test_chunk_order_changes_with_epoch_seed_and_fingerprint():
    def order(fp=7, seed=0, epoch=0):
        return tuple(plan.chunk_order(20, fingerprint=fp, seed=seed, epoch=epoch, shuffle=True).tolist())

    assert len({order(epoch=e) for e in range(10)}) == 10
    assert len({order(seed=s) for s in range(10)}) == 10
    assert len({order(fp=f) for f in range(10)}) == 10
    assert order() != tuple(range(20))


@pytest.mark.slow
def test_chunk_order_does_not_depend_on_the_process():
    """Order is the same in another interpreter (no hash() or global RNG state involved)."""
    code = ("from gpuload import plan; print(plan.chunk_order(30, fingerprint=99, seed=5, epoch=3, shuffle=True)"
            ".tolist(), plan.window_permutation(30, fingerprint=99, seed=5, epoch=3, rank=2, window=1).tolist())")
    np.random.seed(12345)  # global RNG state must not matter either
    here = f"{plan.chunk_order(30, fingerprint=99, seed=5, epoch=3, shuffle=True).tolist()} " \
           f"{plan.window_permutation(30, fingerprint=99, seed=5, epoch=3, rank=2, window=1).tolist()}"
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == here


# -- (e) shard membership follows the seed and the epoch --------------------------------------
def _rank0_rows(seed, epoch, shuffle=True, chunks=20, rows=50, world=4):
    chunk_rows = [rows] * chunks
    order = plan.chunk_order(chunks, fingerprint=11, seed=seed, epoch=epoch, shuffle=shuffle)
    start, stop = plan.rank_range(chunks * rows, world, 0, 16, False)
    return frozenset(c * rows + i for s in plan.rank_segments(chunk_rows, order, start, stop)
                     for c in [s.chunk] for i in range(s.lo, s.hi))


def test_seed_and_epoch_change_shard_membership():
    by_seed = {_rank0_rows(seed, 0) for seed in range(10)}
    by_epoch = {_rank0_rows(0, epoch) for epoch in range(10)}
    assert len(by_seed) == 10 and len(by_epoch) == 10
    assert all(len(s) == 250 for s in by_seed)


def test_without_shuffle_shards_are_file_order_ranges():
    assert {_rank0_rows(seed, epoch, shuffle=False) for seed in range(3) for epoch in range(3)} == {
        frozenset(range(250))}


# -- (f) window permutation ------------------------------------------------------------------
@SETTINGS
@given(st.integers(0, 500), st.integers(0, 2**63 - 1), st.integers(0, 2**32), st.integers(0, 100),
       st.integers(0, 7), st.integers(0, 100))
def test_window_permutation_is_a_deterministic_permutation(n, fp, seed, epoch, rank, window):
    kw = dict(fingerprint=fp, seed=seed, epoch=epoch, rank=rank, window=window)
    p = plan.window_permutation(n, **kw)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(n))
    np.testing.assert_array_equal(p, plan.window_permutation(n, **kw))


def test_window_permutation_differs_by_every_key_part():
    base = dict(fingerprint=1, seed=2, epoch=3, rank=0, window=0)
    p = plan.window_permutation(100, **base).tolist()
    for k in base:
        assert plan.window_permutation(100, **{**base, k: base[k] + 1}).tolist() != p, k
    # the chunk order and rank 0's first window are not the same stream
    assert plan.chunk_order(100, fingerprint=1, seed=2, epoch=3, shuffle=True).tolist() != p


# -- (h) chunking ------------------------------------------------------------------------------
files_st = st.lists(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 100)), max_size=12), max_size=6)


@SETTINGS
@given(files_st, st.integers(1, 300))
def test_make_chunks_bounds_bytes_and_keeps_row_groups_in_order(files, chunk_bytes):
    chunks = plan.make_chunks(files, chunk_bytes)
    assert [c.file for c in chunks] == sorted(c.file for c in chunks)
    for f, groups in enumerate(files):
        mine = [c for c in chunks if c.file == f]
        # consecutive runs covering every row group of the file, in order
        assert [(c.rg_start, c.rg_stop) for c in mine] == list(zip([0] + [c.rg_stop for c in mine[:-1]],
                                                                   [c.rg_stop for c in mine]))
        assert (mine[-1].rg_stop if mine else 0) == len(groups)
        for c in mine:
            part = groups[c.rg_start:c.rg_stop]
            assert c.rows == sum(r for r, _ in part) and c.nbytes == sum(b for _, b in part)
            assert c.nbytes <= chunk_bytes or c.rg_stop - c.rg_start == 1  # only a lone big group exceeds
            if c.rg_stop < len(groups):  # greedy: the next group did not fit
                assert c.nbytes + groups[c.rg_stop][1] > chunk_bytes


def test_make_chunks_examples():
    big = [(10, 50), (10, 500), (10, 50), (10, 50)]
    assert plan.make_chunks([big], 100) == [Chunk(0, 0, 1, 10, 50), Chunk(0, 1, 2, 10, 500), Chunk(0, 2, 4, 20, 100)]
    # two small files are never merged into one chunk
    assert plan.make_chunks([[(5, 1)], [(6, 1)]], 1000) == [Chunk(0, 0, 1, 5, 1), Chunk(1, 0, 1, 6, 1)]
    # files without row groups, or with empty ones only, yield no chunk (numbers stay the file's index)
    assert plan.make_chunks([[], [(0, 0), (0, 8)], [(3, 3)]], 100) == [Chunk(2, 0, 1, 3, 3)]


@SETTINGS
@given(st.lists(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 100)), max_size=8), max_size=4),
       st.integers(1, 150))
def test_make_chunks_never_yields_empty_chunks(files, chunk_bytes):
    """Row groups with no rows (a writer flushing an empty table) must not become chunks of
    their own: an empty chunk would be decoded, cached and counted for nothing. Their
    estimated size is not 0 (8 bytes of offsets per list column)."""
    chunks = plan.make_chunks(files, chunk_bytes)
    assert all(c.rows > 0 for c in chunks)
    assert sum(c.rows for c in chunks) == sum(r for groups in files for r, _ in groups)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), world=st.integers(1, 8), bs=st.integers(1, 50), rank=st.integers(0, 7),
       drop_last=st.booleans(), data=st.data())
def test_batch_sizes_rows_before_and_after(n, world, bs, rank, drop_last, data):
    assume(rank < world and plan.feasible(n, world, bs, drop_last))
    sizes = plan.batch_sizes(n, world, rank, bs, drop_last)
    k = data.draw(st.integers(0, len(sizes)))
    assert sizes.rows_before(k) == sum(list(sizes)[:k])
    assert list(sizes.after(k)) == list(sizes)[k:]
    with pytest.raises(IndexError):
        sizes.after(len(sizes) + 1)


@given(rows=st.lists(st.integers(1, 20), min_size=1, max_size=6), data=st.data())
def test_trim_keeps_exactly_the_rows_asked_for(rows, data):
    segments, pos = [], 0
    for c, n in enumerate(rows):
        segments.append(plan.Segment(c, 5, 5 + n))  # chunk c's rows [5, 5 + n)
        pos += n
    lo = data.draw(st.integers(0, pos))
    hi = data.draw(st.integers(lo, pos))
    flat = [(s.chunk, i) for s in segments for i in range(s.lo, s.hi)]
    trimmed = plan.trim(segments, lo, hi)
    assert [(s.chunk, i) for s in trimmed for i in range(s.lo, s.hi)] == flat[lo:hi]
    assert all(s.hi > s.lo for s in trimmed)
