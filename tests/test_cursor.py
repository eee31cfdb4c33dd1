"""Cursor: the epoch position of a dataset, pure (a real EpochPlan over made-up chunks, no dataset).

* iterations begun without ``set_epoch`` follow the next epoch;
* ``set_epoch`` after ``load_state_dict``: the restored epoch keeps its position, the epoch
  after a complete one starts it, another drops it with a warning; and before it (a
  StatefulDataLoader's order);
* a state taken before the first batch, mid-epoch (in the loop or after it was left) and
  after the last batch restores where it was taken;
* typed runs go through a state's lists unchanged (node-affine and elastic runs included);
* a tiny dataset, for what only a dataset shows: it holds its cursor without a reference cycle.
"""

from __future__ import annotations

import copy
import gc
import json
import weakref

import numpy as np
import pyarrow as pa
import pytest

import gpuload
from gpuload import resume
from gpuload.config import Options
from gpuload.cursor import Cursor
from gpuload.epochs import EpochPlan
from gpuload.ranks import RankLayout
from gpuload.resume import Run

ROWS = [100, 120, 90, 110]  # 420 rows: 14 batches of 32 on one rank
BATCHES = 14
SIGNATURE = {"source": "0x01", "rows": 420, "chunks": "0x02", "outputs": {"x": ["x"]}, "seed": 0, "shuffle": True,
             "batch_size": 32, "drop_last": False, "shuffle_window": 2}


def _cursor(world: int | None = 1, rank: int | None = 0, shard: str = "global", local: int | None = None) -> Cursor:
    plan = EpochPlan(ROWS, 7, Options(batch_size=32, shuffle_window=2))
    return Cursor(plan, RankLayout(rank, world, shard, local), copy.deepcopy(SIGNATURE))


def _iterate(c: Cursor, batches: int, end: bool = True):
    """An iteration as ParquetDataset runs one: begun, ``batches`` handed out, ended (or still running)."""
    pos = c.begin()
    for _ in range(batches):
        pos.take()
    pos.running = not end
    return pos


def _state(epoch: int, runs: list) -> dict:
    return {"format": resume.FORMAT, "version": resume.VERSION, "epoch": epoch, "runs": runs, "dataset": SIGNATURE}


def test_iterations_without_set_epoch_follow_the_next_epoch():
    c = _cursor()
    assert c.epoch == 0 and c.state_dict() == _state(0, [[1, 0]])
    assert _iterate(c, 3).epoch == 0
    assert c.epoch == 0 and c.state_dict() == _state(0, [[1, 3]])  # the epoch that ran, until the next begins
    pos = _iterate(c, 0, end=False)
    assert (pos.epoch, pos.runs) == (1, (Run(1, 0),)) and c.epoch == 1  # no set_epoch since: the next epoch
    pos.running = False
    c.set_epoch(1)
    assert _iterate(c, 2).epoch == 1  # set_epoch since the last began: that epoch again, from its start
    assert _iterate(c, 0).epoch == 2
    c.set_epoch(0)
    assert c.state_dict() == _state(0, [[1, 0]])  # a position not running is dropped by set_epoch


@pytest.mark.parametrize("taken,set_to,want,warned", [
    (5, 2, (2, 5), False),  # the restored epoch: its position goes on
    (BATCHES, 3, (3, 0), False),  # the epoch after a complete one: it begins
    (BATCHES, 2, (2, BATCHES), False),  # a complete epoch set again: its position (nothing left)
    (5, 3, (3, 0), True),  # the next epoch while the restored one was not over: dropped
    (5, 0, (0, 0), True),  # another epoch: dropped
])
def test_set_epoch_after_load_state_dict(taken, set_to, want, warned, caplog):
    c = _cursor()
    c.load_state_dict(_state(2, [[1, taken]]))
    with caplog.at_level("WARNING", logger="gpuload"):
        c.set_epoch(set_to)
    dropped = f"set_epoch({set_to}) after load_state_dict: the restored position (epoch 2, batch {taken}) is dropped"
    assert (dropped in caplog.text) == warned
    assert c.state_dict() == _state(want[0], [[1, want[1]]])
    pos = c.begin()
    assert (pos.epoch, pos.runs) == (want[0], (Run(1, want[1]),))


@pytest.mark.parametrize("taken,set_to,want,warned", [
    (BATCHES, 3, (3, 0), False),  # set_epoch(next) first, then a complete epoch's state: that epoch begins
    (5, 4, (2, 5), True),  # set_epoch of another epoch first: the state wins, said
    (5, 2, (2, 5), False),
])
def test_set_epoch_before_load_state_dict(taken, set_to, want, warned, caplog):
    c = _cursor()
    c.set_epoch(set_to)
    with caplog.at_level("WARNING", logger="gpuload"):
        c.load_state_dict(_state(2, [[1, taken]]))
    said = f"load_state_dict resumes epoch 2 at batch {taken}, not epoch {set_to} given to set_epoch"
    assert (said in caplog.text) == warned
    pos = c.begin()
    assert (pos.epoch, pos.runs) == (want[0], (Run(1, want[1]),))


def test_a_restored_complete_epoch_is_followed_by_the_next():
    c = _cursor()
    state = _state(2, [[1, BATCHES]])
    c.load_state_dict(state)
    assert c.epoch == 2 and c.state_dict() == state
    pos = c.begin()
    assert (pos.epoch, pos.runs) == (3, (Run(1, 0),))


@pytest.mark.parametrize("where,taken,running,resumes", [
    ("before the first batch", None, False, (2, 0)),
    ("begun, no batch yet", 0, True, (2, 0)),
    ("mid-epoch, in the loop", 5, True, (2, 5)),
    ("mid-epoch, the loop left", 5, False, (2, 5)),
    ("after the last batch", BATCHES, False, (3, 0)),
])
def test_a_state_restores_where_it_was_taken(where, taken, running, resumes):
    a = _cursor()
    a.set_epoch(2)
    if taken is not None:
        _iterate(a, taken, end=not running)
    state = a.state_dict()
    assert state == _state(2, [[1, 0 if taken is None else taken]]), where
    b = _cursor()
    b.load_state_dict(json.loads(json.dumps(state)))
    assert b.state_dict() == state, where  # restored, not iterated yet: the same state
    pos = b.begin()
    assert (pos.epoch, pos.runs) == (resumes[0], (Run(1, resumes[1]),)), where


def test_load_state_dict_is_refused_while_an_iteration_runs():
    c = _cursor()
    _iterate(c, 2, end=False)
    with pytest.raises(gpuload.ConfigError, match="while an iteration of this dataset is running"):
        c.load_state_dict(_state(0, [[1, 1]]))
    assert c.state_dict() == _state(0, [[1, 2]])


def test_typed_runs_round_trip_through_the_state_lists(monkeypatch):
    assert Run.from_list([4, 3]) == Run(4, 3) and Run(4, 3).to_list() == [4, 3]
    assert Run.from_list([4, 3, 2]) == Run(4, 3, 2) and Run(4, 3, 2).to_list() == [4, 3, 2]
    state = _state(1, [[4, 2, 2], [3, 1]])  # 2 nodes x 2 ranks, then 3 ranks (elastic)
    epoch, runs, dataset = resume.check_state(state)
    assert runs == (Run(4, 2, 2), Run(3, 1))
    assert resume.state_of(epoch, runs, dataset) == state
    for world in (3, None):  # the ranks of the last run go on with it; ranks not known yet: the state as saved
        with monkeypatch.context() as m:
            m.setenv("WORLD_SIZE", "3")  # a launcher's, no process group yet: no ranks before the iteration
            c = _cursor(world=world, rank=None if world is None else 0)
            c.load_state_dict(json.loads(json.dumps(state)))
            assert json.dumps(c.state_dict()) == json.dumps(state)
    pos = _cursor(world=3).begin()
    assert pos.runs == (Run(3, 0),)
    c = _cursor(world=3)
    c.load_state_dict(state)
    assert c.begin().runs == (Run(4, 2, 2), Run(3, 1))
    node = _cursor(world=4, shard="node", local=2)  # a node-affine first run keeps its local world size
    node.load_state_dict(_state(1, [[4, 2, 2]]))
    assert node.state_dict()["runs"] == [[4, 2, 2]] and node.begin().runs == (Run(4, 2, 2),)


def test_a_run_that_took_no_batch_is_not_kept():
    c = _cursor()
    c.load_state_dict(_state(0, [[1, 5], [2, 0]]))  # 2 ranks began the rest and took nothing
    assert c.state_dict() == _state(0, [[1, 5]])
    assert c.begin().runs == (Run(1, 5),)


def test_a_run_with_no_batch_to_take_leaves_no_trace_either():
    """A resize to more ranks than the rest can feed (4 rows left for 5 ranks: none get a batch)
    gives those ranks an empty rest, whenever they become known; a state saved there still
    resumes exactly on the ranks before it, and shares the rest on others (the 5-rank run is
    no complete run of the 1-rank one: taken as one, rank 4 of it had no place in the earlier run)."""
    plan = EpochPlan(ROWS, 7, Options(batch_size=32, shuffle_window=2))
    state = _state(0, [[1, BATCHES - 1], [5, 0]])  # 13 batches of 32 taken: 4 rows left
    c = _cursor()  # the original rank: its last batch, then the next epoch
    c.load_state_dict(state)
    assert c.state_dict() == _state(0, [[1, BATCHES - 1]])
    pos = c.begin()
    assert (pos.epoch, pos.runs) == (0, (Run(1, BATCHES - 1),)) and len(plan.rest(pos, 0).sizes) == 1
    for known in (True, False):  # those 5 ranks, known when the state is loaded or only when iterating:
        for r in range(5):  # the epoch's rest, empty on every one of them, then the next epoch
            f = _cursor(world=5 if known else None, rank=r if known else None)
            f.load_state_dict(state)
            assert f.state_dict() == (state if known else _state(0, [[1, BATCHES - 1]]))
            f._layout = RankLayout(r, 5, "global", None)
            assert f.batches_next() == 0
            pos = f.begin()
            assert (pos.epoch, pos.runs) == (0, (Run(1, BATCHES - 1), Run(5, 0))) and not plan.rest(pos, r).sizes
            pos.running = False
            assert f.begin().epoch == 1
    three = []  # 3 ranks: the 4 rows shared, each once
    for r in range(3):
        t = _cursor(world=3, rank=r)
        t.load_state_dict(state)
        three.append(plan.rest(t.begin(), r).sizes)
    assert {len(s) for s in three} == {1} and sum(s.rows_before(1) for s in three) == 420 - 32 * (BATCHES - 1)


def test_a_state_is_the_callers_to_change():
    c = _cursor()
    c.state_dict()["dataset"]["outputs"]["x"].append("y")
    assert c.state_dict()["dataset"]["outputs"] == {"x": ["x"]}


def test_a_dataset_and_its_cursor_make_no_reference_cycle(tmp_path, write_parquet):
    """Dropped, a dataset is freed at once, not at the next garbage collection (its cursor holds no
    method of it)."""
    write_parquet(tmp_path / "d" / "a.parquet", pa.table({"x": np.arange(300)}))
    ds = gpuload.ParquetDataset(tmp_path / "d", batch_size=100, device="cpu", cache_dir=tmp_path / "c")
    list(ds)
    ref = weakref.ref(ds)
    gc.disable()
    try:
        del ds
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("saved, now, said", [(2, 1, "epoch 0 ends"), (1, 2, "every later epoch ends"), (2, 2, None)])
def test_a_restore_on_other_ranks_says_how_a_count_read_once_ends_its_epochs(saved, now, said, caplog):
    """A helper's trial under Lightning: resumed mid-epoch on 1 process from 2 (or on 2 from 1), an epoch ran
    out before len() and Lightning skipped its validation, silently. The restore now says which epoch ends
    before the count, by how much, and what keeps it (the same ranks; Lightning's per-epoch reload)."""
    before = _cursor(world=saved)
    _iterate(before, 3, end=False)
    state = before.state_dict()
    after = _cursor(world=now)
    with caplog.at_level("WARNING", logger="gpuload"):
        after.load_state_dict(state)
    told = [r.getMessage() for r in caplog.records if "resumes on other ranks" in r.getMessage()]
    if said is None:
        assert not told
        return
    (text,) = told
    whole, counted = after.whole(), after.batches()
    assert said in text and f"len() counts {counted} batches a rank" in text and f"{whole} for each later" in text
    assert "reload_dataloaders_every_n_epochs=1" in text and "every row is still delivered once" in text
    assert (counted == whole) == (saved > now)  # fewer ranks: the whole epoch's count; more: the resumed one's
