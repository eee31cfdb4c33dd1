"""Batch cutting and gathering against plain-Python references."""

from __future__ import annotations

import numpy as np
import pytest

from gpuload.batch import Batcher, Ragged, concat, nrows, rows, take


def _cols(ids, rng):
    """A column set keyed by row id: dense [n], group [n, 3], ragged lists of id-derived values."""
    lengths = rng.integers(0, 5, len(ids))
    lists = [[int(i) * 10 + j for j in range(n)] for i, n in zip(ids, lengths)]
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.array([v for lst in lists for v in lst], dtype=np.int64)
    return ({"id": np.asarray(ids, np.int64), "g": np.stack([ids, ids * 2, ids * 3], 1).astype(np.float32),
             "r": Ragged(values, off)}, lists)


def _lists(r: Ragged):
    assert r.offsets.dtype == np.int64 and r.offsets[0] == 0 and r.offsets[-1] == len(r.values)
    return [r.values[r.offsets[i]:r.offsets[i + 1]].tolist() for i in range(len(r.offsets) - 1)]


def _check(batch, ref_lists, ids):
    assert batch["id"].tolist() == list(ids)
    assert np.array_equal(batch["g"][:, 1], np.asarray(ids, np.float32) * 2)
    assert _lists(batch["r"]) == [ref_lists[i] for i in ids]
    assert len(batch["r"].offsets) == len(ids) + 1


def test_take_rows_concat_match_reference():
    rng = np.random.default_rng(0)
    cols, lists = _cols(np.arange(50), rng)
    idx = rng.permutation(50)[:17].astype(np.int64)
    _check(take(cols, idx), lists, idx)
    _check(rows(cols, 5, 20), lists, range(5, 20))
    _check(concat([rows(cols, 0, 7), take(cols, idx), rows(cols, 40, 50)]), lists,
           list(range(7)) + list(idx) + list(range(40, 50)))


def test_take_of_rows_that_are_all_empty_lists():
    cols = {"r": Ragged(np.array([5, 6], np.int64), np.array([0, 0, 2, 2], np.int64))}
    out = take(cols, np.array([2, 0], np.int64))["r"]
    assert out.offsets.tolist() == [0, 0, 0] and len(out.values) == 0


def test_rows_without_permutation_are_views():
    cols, _ = _cols(np.arange(100), np.random.default_rng(1))
    part = rows(cols, 10, 30)
    assert np.shares_memory(part["g"], cols["g"]) and np.shares_memory(part["r"].values, cols["r"].values)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("sizes", [[7] * 14 + [2], [16] * 6 + [4], [1] * 100, [50, 50]])
def test_batcher_cuts_planned_sizes_across_windows(shuffle, sizes):
    rng = np.random.default_rng(2)
    cols, lists = _cols(np.arange(100), rng)
    windows = [(0, 23), (23, 60), (60, 61), (61, 100)]
    b = Batcher(sizes)
    expected, got = [], []
    for w, (lo, hi) in enumerate(windows):
        piece = rows(cols, lo, hi)
        perm = np.random.default_rng(w).permutation(hi - lo).astype(np.int64) if shuffle else None
        expected += list(lo + perm) if shuffle else list(range(lo, hi))
        got += list(b.add(piece, perm))
    assert b.done
    assert [nrows(x) for x in got] == sizes
    _check(concat(got), lists, expected)


def test_batch_inside_one_piece_is_a_view():
    cols, _ = _cols(np.arange(40), np.random.default_rng(3))
    (first, second) = list(Batcher([20, 20]).add(cols))
    assert np.shares_memory(first["g"], cols["g"]) and np.shares_memory(second["id"], cols["id"])
