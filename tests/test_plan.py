"""The epoch plan is a pure function: shards partition the rows, batch counts are equal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuload
from gpuload import plan

SETTINGS = settings(max_examples=150, deadline=None)


def _stream_rows(chunk_rows, order):
    """Global row ids in stream order (chunk c holds ids starts[c] .. starts[c] + rows[c])."""
    starts = np.concatenate([[0], np.cumsum(chunk_rows)[:-1]])
    return np.concatenate([np.arange(starts[c], starts[c] + chunk_rows[c]) for c in order] or [np.zeros(0, int)])


def _rank_rows(chunk_rows, order, total, world, rank, bs, drop_last):
    starts = np.concatenate([[0], np.cumsum(chunk_rows)[:-1]])
    a, b = plan.rank_range(total, world, rank, bs, drop_last)
    segs = plan.rank_segments(chunk_rows, order, a, b)
    got = [np.arange(starts[s.chunk] + s.lo, starts[s.chunk] + s.hi) for s in segs]
    return np.concatenate(got) if got else np.zeros(0, int)


@SETTINGS
@given(chunk_rows=st.lists(st.integers(1, 50), min_size=1, max_size=30), world=st.integers(1, 7),
       bs=st.integers(1, 40), drop_last=st.booleans(), seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_shards_cover_every_row_once_with_equal_batch_counts(chunk_rows, world, bs, drop_last, seed, epoch):
    total = sum(chunk_rows)
    try:
        plan.check_balance(total, world, bs, drop_last)
    except gpuload.ConfigError:
        # refused only in the documented impossible cases
        assert not drop_last and (total < world or (bs == 1 and total % world))
        return
    order = plan.chunk_order(len(chunk_rows), fingerprint=7, seed=seed, epoch=epoch, shuffle=True)
    k = plan.num_batches(total, world, bs, drop_last)
    delivered = []
    for rank in range(world):
        rows = _rank_rows(chunk_rows, order, total, world, rank, bs, drop_last)
        sizes = plan.batch_sizes(total, world, rank, bs, drop_last)
        assert len(sizes) == k  # equal on every rank: DDP never hangs
        assert sum(sizes) == len(rows)
        assert all(1 <= s <= bs for s in sizes)
        if drop_last:
            assert all(s == bs for s in sizes)
        delivered.append(rows)
    everything = np.concatenate(delivered)
    assert len(np.unique(everything)) == len(everything)  # never twice
    if drop_last:
        assert len(everything) == k * world * bs
        # the dropped rows are the stream's tail
        assert set(everything) == set(_stream_rows(chunk_rows, order)[:len(everything)])
    else:
        assert sorted(everything) == list(range(total))  # exactly once


@pytest.mark.parametrize("total,world,bs", [(9, 2, 4), (10, 3, 2), (1000, 7, 64), (17, 4, 5)])
def test_tail_balancing_examples(total, world, bs):
    sizes = [plan.batch_sizes(total, world, r, bs, False) for r in range(world)]
    assert len({len(s) for s in sizes}) == 1
    assert sum(map(sum, sizes)) == total
    assert min(min(s) for s in sizes) >= 1


def test_short_rank_splits_its_last_full_batch():
    # 9 rows, 2 ranks, batch 4: rank 0 has 5 rows (4 + 1), rank 1 has 4 rows -> 2 + 2
    assert plan.batch_sizes(9, 2, 0, 4, False) == [4, 1]
    assert plan.batch_sizes(9, 2, 1, 4, False) == [2, 2]


@pytest.mark.parametrize("total,world,bs", [(3, 4, 8), (7, 2, 1)])
def test_impossible_balance_is_refused(total, world, bs):
    with pytest.raises(gpuload.ConfigError, match="drop_last=True"):
        plan.batch_sizes(total, world, 0, bs, False)


def test_chunk_order_is_pure_and_changes_with_seed_and_epoch():
    a = plan.chunk_order(20, fingerprint=1, seed=0, epoch=0, shuffle=True)
    assert sorted(a) == list(range(20))
    assert np.array_equal(a, plan.chunk_order(20, fingerprint=1, seed=0, epoch=0, shuffle=True))
    assert not np.array_equal(a, plan.chunk_order(20, fingerprint=1, seed=0, epoch=1, shuffle=True))
    assert not np.array_equal(a, plan.chunk_order(20, fingerprint=1, seed=1, epoch=0, shuffle=True))
    assert not np.array_equal(a, plan.chunk_order(20, fingerprint=2, seed=0, epoch=0, shuffle=True))
    assert list(plan.chunk_order(20, fingerprint=1, seed=5, epoch=3, shuffle=False)) == list(range(20))


def test_seed_changes_shard_membership():
    rows = [100] * 20
    members = []
    for seed in (0, 1):
        order = plan.chunk_order(20, fingerprint=3, seed=seed, epoch=0, shuffle=True)
        members.append(set(_rank_rows(rows, order, 2000, 4, 0, 32, False)))
    assert members[0] != members[1]
    assert len(members[0]) == len(members[1]) == 500


def test_window_permutation_is_a_pure_permutation():
    p = plan.window_permutation(1000, fingerprint=1, seed=2, epoch=3, rank=0, window=4)
    assert p.dtype == np.int64 and sorted(p) == list(range(1000))
    assert np.array_equal(p, plan.window_permutation(1000, fingerprint=1, seed=2, epoch=3, rank=0, window=4))
    for change in ({"rank": 1}, {"window": 5}, {"epoch": 4}, {"seed": 3}):
        args = dict(fingerprint=1, seed=2, epoch=3, rank=0, window=4) | change
        assert not np.array_equal(p, plan.window_permutation(1000, **args))


def test_make_chunks_bounds_bytes_and_keeps_files_apart():
    files = [[(10, 100)] * 5, [], [(10, 1000)], [(5, 30), (5, 30)]]
    chunks = plan.make_chunks(files, chunk_bytes=250)
    assert [(c.file, c.rg_start, c.rg_stop) for c in chunks] == [
        (0, 0, 2), (0, 2, 4), (0, 4, 5), (2, 0, 1), (3, 0, 2)]
    assert all(c.nbytes <= 250 or c.rg_stop - c.rg_start == 1 for c in chunks)  # oversized group: alone
    assert sum(c.rows for c in chunks) == 50 + 10 + 10


def test_make_chunks_skips_empty_row_groups_only_files():
    assert plan.make_chunks([[(0, 0)]], chunk_bytes=10) == []


@SETTINGS
@given(st.lists(st.integers(1, 9), min_size=0, max_size=25), st.integers(1, 6))
def test_windows_keep_segment_order(seg_sizes, size):
    segs = [plan.Segment(i, 0, n) for i, n in enumerate(seg_sizes)]
    ws = plan.windows(segs, size)
    assert [s for w in ws for s in w] == segs
    assert all(1 <= len(w) <= size for w in ws)
