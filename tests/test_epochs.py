"""Epochs: the rest of an epoch as one typed value, window permutations, restored runs fitted
to new ranks (pure: a real EpochPlan over made-up chunks, no dataset)."""

from __future__ import annotations

import numpy as np
import pytest

from gpuload import plan
from gpuload.config import Options
from gpuload.epochs import EpochPlan, Position, Rest, Take
from gpuload.ranks import Ranks
from gpuload.resume import Run

ROWS = [100, 120, 90, 110, 70, 130]  # 620 rows
FINGERPRINT = 7


def _plan(**options) -> EpochPlan:
    return EpochPlan(ROWS, FINGERPRINT, Options(**{"batch_size": 32, "shuffle_window": 2, **options}))


def _rows(segments) -> int:
    return sum(s.hi - s.lo for s in segments)


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_rest_of_a_whole_epoch_is_each_window_of_the_rank(shuffle):
    p = _plan(shuffle=shuffle)
    for r in range(2):
        rest = p.rest(Position(3, p.first_run(Ranks(r, 2)), Ranks(r, 2)), r)
        windows = p.windows(3, 2, r)
        assert isinstance(rest, Rest) and all(isinstance(t, Take) for t in rest.takes)
        assert rest.takes == [Take(r, w, ((0, _rows(win)),)) for w, win in enumerate(windows)]
        assert rest.loads == windows
        assert list(rest.sizes) == list(p.first(Ranks(r, 2)).sizes(r))


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_rest_after_batches_taken(shuffle):
    p = _plan(shuffle=shuffle)
    ranks = Ranks(1, 2)
    first = p.first(ranks)
    rest = p.rest(Position(0, (Run(2, 3),), ranks), 1)
    skip = first.sizes(1).rows_before(3)
    windows = p.windows(0, 2, 1)
    ends = np.cumsum([_rows(w) for w in windows])
    w = int(np.searchsorted(ends, skip, side="right"))  # the window the rank's next row is in
    assert (rest.takes[0].window, rest.takes[0].spans[0][0]) == (w, skip - (int(ends[w - 1]) if w else 0))
    taken = sum(hi - lo for t in rest.takes for lo, hi in t.spans)
    assert taken == sum(rest.sizes) == first.span(1)[1] - first.span(1)[0] - skip
    assert len(rest.loads) == len(rest.takes)
    if shuffle:  # a window is loaded whole to permute it
        assert [_rows(w) for w in rest.loads] == [_rows(windows[t.window]) for t in rest.takes]
    else:  # in file order, only the rows taken
        assert sum(_rows(w) for w in rest.loads) == taken


def test_a_complete_epoch_has_no_rest():
    p = _plan()
    runs = (Run(1, p.first(Ranks(0, 1)).batches),)
    assert p.rest(Position(0, runs, Ranks(0, 1)), 0) == Rest([], [], plan.BatchSizes(0, 32, ()))


def test_elastic_rests_read_each_window_once_and_share_the_rows_left():
    p = _plan()
    runs = (Run(2, 2), Run(3, 1), Run(2, 0))
    left = p.runs(runs[:2])[-1].left()
    seen = set()
    for r in range(2):
        rest = p.rest(Position(0, runs, Ranks(r, 2)), r)
        keys = [(t.rank, t.window) for t in rest.takes]
        assert len(set(keys)) == len(keys)  # one take, one load per window
        rows = {(t.rank, t.window, i) for t in rest.takes for lo, hi in t.spans for i in range(lo, hi)}
        assert len(rows) == sum(rest.sizes) and not rows & seen
        seen |= rows
    assert len(seen) == p.runs(runs)[-1].total <= left


@pytest.mark.parametrize("block_rows", [None, 4])
def test_permutation_is_the_window_permutation_cut_to_the_spans(block_rows):
    p = _plan(**({} if block_rows is None else {"shuffle": "block", "block_rows": block_rows}))
    key = dict(fingerprint=FINGERPRINT, seed=0, epoch=5, rank=1, window=2)
    whole = plan.window_permutation(20, **key) if block_rows is None else plan.block_permutation(20, 4, **key)
    np.testing.assert_array_equal(p.permutation(5, Take(1, 2, ((0, 20),)), 20), whole)
    got = p.permutation(5, Take(1, 2, ((3, 7), (10, 12))), 20)
    np.testing.assert_array_equal(got, np.concatenate([whole[3:7], whole[10:12]]))
    assert got.dtype == np.int64
    assert not np.array_equal(p.permutation(5, Take(2, 1, ((0, 20),)), 20), whole)  # keyed by rank and window


def test_restored_runs_go_on_typed(caplog):
    p = _plan()
    fresh = Position(0, (Run(2, 0),))
    assert p.go_on(fresh, Ranks(0, 4, 2), warn=True) == (Run(4, 0, 2),)  # nothing taken: as these ranks run it
    started = Position(0, (Run(2, 3),))
    assert p.go_on(started, Ranks(0, 2), warn=True) == (Run(2, 3),)  # the same ranks go on
    with caplog.at_level("WARNING", logger="gpuload"):
        assert p.go_on(started, Ranks(0, 4, 2), warn=True) == (Run(2, 3), Run(4, 0))  # elastic
    assert "shard layout global and resumes on 2 nodes x 2 ranks" in caplog.text
    assert started.raw == (Run(2, 3),)  # the restored runs are not changed
