"""Resumable, elastic epochs: state_dict / load_state_dict.

* the pure plan of an epoch's rest (:mod:`gpuload.resume`), against a simulation of
  the rows every rank takes, for random chains of runs on other world sizes;
* the conformance harness: a state taken at every batch position of epochs 0 and 1
  (before the first batch and at each epoch's end included) restores, in a fresh
  dataset, to exactly the batches of the uninterrupted run; and from ``W1`` to ``W2``
  ranks, every row of the epoch exactly once across the union of ranks, equal batch
  counts, and the next epoch in the ``W2`` order;
* only the chunks still needed are read; the footguns (a state from another dataset,
  ``load_state_dict`` while iterating, ``iter()`` before ``load_state_dict``);
* torchdata's ``StatefulDataLoader`` round trip, and a restore in a fresh process;
* iterations without ``set_epoch`` (Lightning never calls it): each begins the next
  epoch, alone, after a restore and through a ``StatefulDataLoader``;
* a state that cannot exist (node layouts, runs, outputs) is refused by
  ``load_state_dict`` with a ``ConfigError``, never accepted to fail in a loader thread.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuload
from gpuload import plan, resume
from gpuload.batch import Ragged
from gpuload.preload import first_chunks

from conftest import open_dataset, record_loads, row_ids, write_parquet

pytestmark = pytest.mark.usefixtures("no_leftover_threads")

BATCH = 64
ROWS = (1500, 1445)  # 2,945 rows: on 2 ranks, rank 1's last batch would be empty, so it is halved


# ---------------------------------------------------------------------------------------
# the pure plan of the rest of an epoch
# ---------------------------------------------------------------------------------------

def _simulate(total: int, batch: int, drop_last: bool, chain: list[tuple[int, float]], seed: int):
    """Rows taken by every rank of every run of ``chain`` ((world, fraction of its batches taken)),
    the last run taken to its end; the first run's windows are random cuts of each rank's range."""
    rng = np.random.default_rng(seed)
    w0 = chain[0][0]
    ids = {}
    for q in range(w0):
        start, stop = plan.rank_range(total, w0, q, batch, drop_last)
        cuts = np.sort(rng.choice(np.arange(1, max(stop - start, 1)), size=min(3, max(stop - start - 1, 0)),
                                  replace=False)) if stop - start > 1 else []
        bounds = [0, *cuts, stop - start]
        ids[q] = [rng.permutation(np.arange(start + a, start + b)) for a, b in zip(bounds, bounds[1:]) if b > a]
    window_rows = lambda q: [len(w) for w in ids[q]]  # noqa: E731
    runs_so_far: list[resume.Run] = []
    taken, counts = [], []
    for i, (world, frac) in enumerate(chain):
        runs = resume.runs_of(total, runs_so_far + [resume.Run(world, 0)], batch, drop_last)
        last = i == len(chain) - 1
        k = runs[-1].batches if last else int(frac * runs[-1].batches)
        per_rank = []
        for r in range(world):
            pieces, sizes = resume.rest_of_epoch(window_rows, runs, r)
            seq = np.concatenate([ids[p.rank][p.window][p.lo:p.hi] for p in pieces]) if pieces else np.zeros(0, int)
            assert len(seq) == sum(sizes)  # the sizes cover the rank's rows exactly
            keys = [(p.rank, p.window) for p in pieces]  # a window's pieces come together: it is read once
            assert len(set(keys)) == len([k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k])
            assert len(sizes) == runs[-1].batches  # every rank the same number of batches
            per_rank.append(len(sizes))
            taken.append(seq[:sizes.rows_before(k)])
        counts.append(per_rank)
        runs_so_far.append(resume.Run(world, k))
    return np.concatenate(taken), resume.runs_of(total, runs_so_far, batch, drop_last)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 400), batch=st.integers(1, 9), drop_last=st.booleans(),
       chain=st.lists(st.tuples(st.integers(1, 6), st.floats(0, 1)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_runs_of_an_epoch_deliver_each_row_at_most_once(total, batch, drop_last, chain, seed):
    if not plan.feasible(total, chain[0][0], batch, drop_last):
        return
    got, runs = _simulate(total, batch, drop_last, chain, seed)
    assert len(np.unique(got)) == len(got), "a row delivered twice"
    assert got.min(initial=0) >= 0 and got.max(initial=0) < total
    dropped = sum(resume.dropped_rows(runs[:i + 1]) for i in range(len(runs)))
    first = runs[0]
    lost_tail = total - sum(first.span(r)[1] - first.span(r)[0] for r in range(first.world))  # drop_last's tail
    assert len(got) == total - lost_tail - dropped
    if not drop_last:
        assert lost_tail == 0
        for i in range(1, len(runs)):  # what an elastic run cannot share is less than its world size
            if batch == 1:
                assert resume.dropped_rows(runs[:i + 1]) < runs[i].world
            else:
                assert resume.dropped_rows(runs[:i + 1]) < runs[i].world


def test_same_world_size_continues_the_run():
    runs = resume.runs_of(100, [resume.Run(2, 3)], 8, False)
    pieces, sizes = resume.rest_of_epoch(lambda q: [20, 30], runs, 1)
    assert [(p.rank, p.window, p.lo, p.hi) for p in pieces] == [(1, 1, 4, 30)]
    assert list(sizes) == list(plan.batch_sizes(100, 2, 1, 8, False))[3:]


def test_impossible_runs_are_refused():
    with pytest.raises(gpuload.ConfigError, match="took 99 batches"):
        resume.runs_of(100, [resume.Run(2, 99)], 8, False)
    with pytest.raises(gpuload.ConfigError, match="cannot be shared"):
        resume.runs_of(3, [resume.Run(4, 0)], 8, False)


# ---------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two files, 2,945 rows: row_id, a float, a stacked pair and a list column."""
    d = tmp_path_factory.mktemp("resume")
    rng = np.random.default_rng(3)
    start = 0
    for i, n in enumerate(ROWS):
        lengths = rng.integers(0, 5, n)
        write_parquet(d / f"part{i}.parquet", pa.table({
            "row_id": np.arange(start, start + n, dtype=np.int64),
            "x": rng.standard_normal(n),
            "g1": rng.integers(0, 1000, n).astype(np.int32),
            "g2": rng.integers(0, 1000, n).astype(np.int32),
            "h": pa.array([list(rng.integers(0, 99, k)) for k in lengths], pa.list_(pa.int64())),
        }), row_group_size=100)
        start += n
    return d


COLUMNS = {"row_id": "row_id", "x": "x", "g": ["g1", "g2"], "h": "h"}


def _open(source, cache, world=1, rank=0, **kw):
    kw = {"batch_size": BATCH, "chunk_bytes": 8 << 10, "shuffle_window": 3, **kw}
    return open_dataset(source, COLUMNS, cache, rank=rank, world_size=world, **kw)


def _same(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, Ragged):
            if not (torch.equal(x.offsets, y.offsets) and torch.equal(x.values, y.values)):
                return False
        elif not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return list(a) == list(b)


def _assert_same_run(got: list, want: list, where) -> None:
    assert len(got) == len(want), (where, len(got), len(want))
    for i, ((e1, a), (e2, b)) in enumerate(zip(got, want)):
        assert e1 == e2 and _same(a, b), (where, i)


def _reference(ds, epochs) -> tuple[list, list]:
    """Batches (epoch, batch) of an uninterrupted run, and the state after each position:
    states[i] resumes before batch i (before the first, and at each epoch's end included)."""
    run, states = [], []
    for e in epochs:
        ds.set_epoch(e)
        states.append((e, json.loads(json.dumps(ds.state_dict()))))  # only JSON types in it
        for b in ds:
            run.append((e, b))
            states.append((e, ds.state_dict()))
    return run, states


def _resumed(ds, state, last_epoch) -> list:
    """What a training loop yields after restoring ``state``: the rest of its epoch, then on."""
    ds.load_state_dict(state)
    out = []
    for e in range(state["epoch"], last_epoch + 1):
        ds.set_epoch(e)
        left, counted = ds.batches_left, len(ds)
        out.extend((e, b) for b in ds)
        assert sum(1 for x in out if x[0] == e) == left, "batches_left is not what the iteration yielded"
        # len(): a whole epoch, resumed or not, but for the rest of one begun on other ranks (elastic):
        # what each rank took before plus the new run (the count test below); then whole epochs again
        assert counted >= left and len(ds) == ds.batches_left
    return out


# ---------------------------------------------------------------------------------------
# the conformance harness
# ---------------------------------------------------------------------------------------

def _rest_from(ref_run: list, epoch: int, batches: int) -> list:
    """The reference run after ``batches`` batches of ``epoch``."""
    first = next(j for j, (e, _) in enumerate(ref_run) if e == epoch)
    return ref_run[first + batches:]


@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (False, False), (True, True)])
def test_resume_at_every_position_is_exact(source, tmp_path, shuffle, drop_last):
    cache = tmp_path / "c"
    k = len(_open(source, cache, shuffle=shuffle, drop_last=drop_last))
    ref_run, states = _reference(_open(source, cache, shuffle=shuffle, drop_last=drop_last), [0, 1, 2])
    tried = 0
    for epoch, state in states:
        if epoch == 2:
            break
        fresh = _open(source, cache, shuffle=shuffle, drop_last=drop_last)
        taken = state["runs"][-1][1]
        want = [x for x in _rest_from(ref_run, epoch, taken) if x[0] <= epoch + 1]
        _assert_same_run(_resumed(fresh, state, epoch + 1), want, (epoch, taken))
        tried += 1
    assert tried == 2 * (k + 1)  # before each batch of epochs 0 and 1, and after each one's last


@pytest.mark.parametrize("w1, w2", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 1), (2, 2)])
def test_elastic_resume_delivers_the_rest_exactly_once(source, tmp_path, w1, w2):
    """States taken on ``w1`` ranks at every position of epochs 0 and 1, restored on ``w2``."""
    cache = tmp_path / "c"
    olds = [_open(source, cache, w1, r) for r in range(w1)]
    refs = [_reference(ds, [0, 1]) for ds in olds]
    news = [_open(source, cache, w2, r) for r in range(w2)]
    next_epoch = {e: [list(ds) for ds in news for _ in [ds.set_epoch(e)]] for e in (1, 2)}
    n = sum(ROWS)
    for i, (epoch, state) in enumerate(refs[0][1]):
        # DDP ranks take the same number of batches, so every rank's state is the same: rank 0's is enough
        assert all(ref[1][i][1] == state for ref in refs)
        taken = state["runs"][-1][1]
        before = [b for ref in refs for b in [x for e, x in ref[0] if e == epoch][:taken]]
        rests = [_resumed(ds, state, epoch + 1) for ds in news]
        this = [[b for e, b in rest if e == epoch] for rest in rests]
        assert len({len(t) for t in this}) == 1, "ranks yield different batch counts"
        ids = np.concatenate([row_ids(before)] + [row_ids(t) for t in this])
        assert len(np.unique(ids)) == len(ids), (epoch, taken, "a row delivered twice")
        assert len(ids) >= n - (w2 - 1), (epoch, taken, "rows skipped")
        if taken == 0:  # nothing was taken: the whole epoch, shared by the new ranks
            assert len(ids) == n
        if w1 == w2:  # the same ranks: exactly the uninterrupted run
            for r in range(w2):
                want = [x for e, x in refs[r][0] if e == epoch][taken:]
                _assert_same_run([(epoch, b) for b in this[r]], [(epoch, b) for b in want], (epoch, taken, r))
        for r, rest in enumerate(rests):  # the next epoch is the w2 order
            after = [b for e, b in rest if e == epoch + 1]
            _assert_same_run([(0, b) for b in after], [(0, b) for b in next_epoch[epoch + 1][r]], (epoch, taken, r))


def test_a_second_resume_goes_on_from_the_first(source, tmp_path):
    """Restore, take a few batches, save again, restore again: the run goes on (it does not restart)."""
    cache = tmp_path / "c"
    ref_run, states = _reference(_open(source, cache), [0, 1])
    a = _open(source, cache)
    a.load_state_dict(states[5][1])  # epoch 0, after 5 batches
    it = iter(a)
    got = [(0, next(it)) for _ in range(7)]
    second = a.state_dict()
    it.close()
    assert second["runs"] == [[1, 12]]
    b = _open(source, cache)
    got += _resumed(b, second, 1)
    _assert_same_run(got, _rest_from(ref_run, 0, 5), "second resume")


def test_elastic_chain_within_one_epoch(source, tmp_path):
    """2 ranks, then 3, then 1, in one epoch: each row once over the three runs."""
    cache = tmp_path / "c"
    seen, state = [], None
    for world, steps in ((2, 5), (3, 4), (1, None)):
        ranks = [_open(source, cache, world, r) for r in range(world)]
        states = []
        for ds in ranks:
            if state is not None:
                ds.load_state_dict(state)
            ds.set_epoch(1)
            it = iter(ds)
            seen += list(itertools.islice(it, steps))
            states.append(ds.state_dict())
            it.close()
        assert all(s == states[0] for s in states)
        state = states[0]
    assert [w for w, _ in state["runs"]] == [2, 3, 1]
    ids = row_ids(seen)
    assert len(np.unique(ids)) == len(ids) and len(ids) == sum(ROWS)


@pytest.mark.parametrize("chain", [((2, 5), (3, None)), ((2, 5), (4, None)), ((2, 7), (1, None)),
                                   ((3, 2), (2, 3), (4, None))])
def test_a_count_against_len_ends_an_elastic_epoch_with_its_last_row(source, tmp_path, chain):
    """Lightning counts a resumed epoch's batches, those before the checkpoint and after, against
    ``len(ds)`` as it reads it after the restore, and keeps that count for the epochs after (a
    user's trial: 2 ranks, then 3, lost 8% of the epoch's rows, as len was a whole epoch of 3
    ranks). On any chain of rank counts: the resumed epoch ends (its rest runs out) no later than
    the count, and no count of a later epoch is cut short (len is at least a whole epoch); len stays
    while the epoch runs, and every row comes once."""
    cache = tmp_path / "c"
    seen, state, counter = [], None, 0
    for world, steps in chain:
        counts, states = set(), []
        whole = len(_open(source, cache, world, 0))
        for r in range(world):
            ds = _open(source, cache, world, r)
            if state is not None:
                ds.load_state_dict(state)
            ds.set_epoch(1)
            length = len(ds)
            assert length == max(whole, counter + ds.batches_left), (world, r)
            it, n = iter(ds), counter
            for b in it:
                seen.append(b)
                n += 1
                assert len(ds) == length and n <= length  # the same while the epoch runs; never past it
                if steps is not None and n == counter + steps:
                    break
            counts.add(n)
            states.append(ds.state_dict())
            it.close()
        assert len(counts) == 1 and all(s == states[0] for s in states)
        state, counter = states[0], counts.pop()
    ids = row_ids(seen)
    assert len(np.unique(ids)) == len(ids) and len(ids) >= sum(ROWS) - (chain[-1][0] - 1)
    ds = _open(source, cache, chain[-1][0], 0)
    ds.load_state_dict(state)
    ds.set_epoch(2)
    assert len(ds) == len(_open(source, cache, chain[-1][0], 0))  # the next epoch is a whole one


def test_a_length_taken_before_an_elastic_restore_that_grows_it_is_warned_of(source, tmp_path, caplog):
    """Lightning takes len(ds) before its checkpoint restores the dataset: a restore that makes the
    epoch's count longer says so (the count would stop short of the epoch's rows), and names the fix."""
    cache = tmp_path / "c"
    old = _open(source, cache, 2, 0)
    old.set_epoch(1)
    it = iter(old)
    for _ in range(5):
        next(it)
    state = old.state_dict()
    it.close()
    late, early = _open(source, cache, 3, 0), _open(source, cache, 3, 0)
    whole = len(late)  # taken first, as Lightning does
    with caplog.at_level("WARNING", logger="gpuload"):
        late.load_state_dict(state)
    grown = len(late)
    assert grown > whole
    said = [r.getMessage() for r in caplog.records if "before this restore" in r.getMessage()]
    assert len(said) == 1 and f"len() said {whole} batches" in said[0] and f"it is {grown} now" in said[0]
    assert "on_load_checkpoint" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpuload"):
        early.load_state_dict(state)  # restored before its length is asked: nothing to warn of
        late.load_state_dict(state)  # the same restore again (Lightning's, after the hook's)
    assert len(early) == grown and not [r for r in caplog.records if "before this restore" in r.getMessage()]


def test_state_is_small_json_and_round_trips_without_iterating(source, tmp_path):
    ds = _open(source, tmp_path / "c", 2, 0)
    ds.set_epoch(3)
    sd = ds.state_dict()
    assert sd["epoch"] == 3 and sd["runs"] == [[2, 0]] and sd["version"] == resume.VERSION
    text = json.dumps(sd)
    assert len(text) < 1024
    other = _open(source, tmp_path / "c", 2, 1)
    other.load_state_dict(json.loads(text))
    assert other.state_dict() == sd
    on3 = _open(source, tmp_path / "c", 3, 2)
    on3.load_state_dict(sd)
    assert on3.state_dict()["runs"] == [[3, 0]]  # nothing taken yet: the ordinary 3-rank epoch


@pytest.mark.parametrize("shuffle", [True, False, "chunks"])
def test_resume_reads_only_the_chunks_still_needed(source, tmp_path, shuffle):
    cache = tmp_path / "c"
    ref = _open(source, cache, shuffle=shuffle)
    ref.set_epoch(1)
    list(ref)  # the whole cache is built
    windows, sizes = ref.plan_epoch(1)
    k = len(sizes) // 2
    pos = sizes.rows_before(k)
    ref.set_epoch(1)  # again (without it, the next iteration would be epoch 2)
    it = iter(ref)
    list(itertools.islice(it, k))
    state = ref.state_dict()
    it.close()
    ds = _open(source, cache, shuffle=shuffle)
    loaded = record_loads(ds)
    list(_resumed(ds, state, 1))
    start, want, skipped = 0, [], []
    for w in windows:
        n = sum(s.hi - s.lo for s in w)
        if shuffle is True:  # a window started is read whole (its rows are shuffled together)
            (want if start + n > pos else skipped).extend(s.chunk for s in w)
        else:  # in file order, only the chunks with rows still to come
            for s in w:
                (want if start + (s.hi - s.lo) > pos else skipped).append(s.chunk)
                start += s.hi - s.lo
            continue
        start += n
    # and, while the epoch's last batches are cut, the next epoch's first chunks (gpuload.preload): shuffled,
    # once the last window is in; in file order, once the last prefetch + 2 = 4 pieces are being cut
    ahead = first_chunks(ds.plan_epoch(2)[0], 2, ds.options.shuffled)
    own = len(want) if ds.options.shuffled else max(0, len(want) - 4)  # loads before the preload can begin
    assert loaded[:own] == want[:own] and Counter(loaded) == Counter(want) + Counter(ahead)
    assert skipped and not set(skipped) & set(loaded[:own])


def test_elastic_resume_reads_only_windows_with_rows_left(source, tmp_path):
    cache = tmp_path / "c"
    olds = [_open(source, cache, 2, r) for r in range(2)]
    left = set()  # chunks of windows with rows left (a chunk may be split between two ranks)
    for ds in olds:
        windows, sizes = ds.plan_epoch(0)
        pos = sizes.rows_before(15)
        ends = np.cumsum([sum(s.hi - s.lo for s in w) for w in windows])
        left |= {s.chunk for w, end in zip(windows, ends) if end > pos for s in w}
        it = iter(ds)
        list(itertools.islice(it, 15))
        state = ds.state_dict()
        it.close()
    done = set(range(len(olds[0].reader.chunks))) - left
    assert done
    for r in range(3):
        ds = _open(source, cache, 3, r, prefetch=0)  # no chunk loaded ahead, nor the next epoch's
        loaded = record_loads(ds)
        list(_resumed(ds, state, 0))
        assert loaded and set(loaded) <= left  # never a chunk whose rows were all taken


# ---------------------------------------------------------------------------------------
# safety
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"seed": 1}, "seed"),
    ({"batch_size": 32}, "batch_size"),
    ({"shuffle": False}, "shuffle"),
    ({"shuffle": "block"}, r"shuffle: shuffle=True in the state, shuffle='block' \(block_rows=256\) here\."),
    ({"drop_last": True}, "drop_last"),
    ({"shuffle_window": 2}, r"shuffle_window: 3 in the state, 2 here \(give shuffle_window=3 to restore it\)"),
    ({"chunk_bytes": 16 << 10}, "chunks"),
    ({"columns": {"row_id": "row_id", "x": "x"}}, "outputs"),
])
def test_state_from_another_dataset_is_refused(source, tmp_path, change, field):
    ds = _open(source, tmp_path / "c")
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    it.close()
    columns = change.pop("columns", COLUMNS)
    kw = {"batch_size": BATCH, "chunk_bytes": 8 << 10, "shuffle_window": 3, **change}
    other = gpuload.ParquetDataset(source, columns, cache_dir=tmp_path / "c", device="cpu", **kw)
    with pytest.raises(gpuload.ConfigError, match=rf"another dataset: {field}"
                                                  + ("" if field.startswith(("shuffle:", "shuffle_window:")) else ": ")):
        other.load_state_dict(state)
    assert other.state_dict()["runs"] == [[1, 0]]  # nothing restored


def test_state_from_other_files_is_refused(source, tmp_path):
    import shutil
    copy = tmp_path / "src"
    shutil.copytree(source, copy)
    ds = _open(copy, tmp_path / "c")
    state = ds.state_dict()
    table = pq.read_table(copy / "part1.parquet")
    write_parquet(copy / "part1.parquet", table.slice(0, 1000), row_group_size=100)  # rewritten: fewer rows
    with pytest.raises(gpuload.ConfigError, match="source: the source files differ.*; rows: 2945 in the state"):
        _open(copy, tmp_path / "c").load_state_dict(state)
    n = len(list(copy.glob("*.parquet")))
    (copy / "part1.parquet").unlink()  # a file gone: the message counts them
    with pytest.raises(gpuload.ConfigError, match=rf"source files differ \({n} files in the state, {n - 1} here; "):
        _open(copy, tmp_path / "c").load_state_dict(state)
    old = {**state, "dataset": {k: v for k, v in state["dataset"].items() if k != "files"}}  # saved before the count
    with pytest.raises(gpuload.ConfigError, match=r"source files differ \(other names below their folder"):
        _open(copy, tmp_path / "c").load_state_dict(old)


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_the_same_files_in_another_folder_resume_exactly(source, tmp_path, shuffle):
    """A job that stages its data anew at each start (``/scratch/$JOB``): copies with new mtimes, at
    another path, with a cache of their own, go on bit for bit from a state saved on the originals."""
    import shutil

    ref_run, states = _reference(_open(source, tmp_path / "c", shuffle=shuffle), [0, 1])
    moved = tmp_path / "job-2" / "data"
    moved.mkdir(parents=True)
    for f in sorted(source.glob("*.parquet")):
        shutil.copyfile(f, moved / f.name)  # contents only: new mtimes
    assert (moved / "part0.parquet").stat().st_mtime_ns != (source / "part0.parquet").stat().st_mtime_ns
    for epoch, state in (states[3], states[len(states) // 2 + 2]):  # in epoch 0, and in epoch 1
        fresh = _open(moved, tmp_path / "c2", shuffle=shuffle)
        assert fresh.reader.fingerprint == _open(source, tmp_path / "c", shuffle=shuffle).reader.fingerprint
        taken = state["runs"][-1][1]
        _assert_same_run(_resumed(fresh, state, 1), _rest_from(ref_run, epoch, taken), (epoch, taken))


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_packed_small_files_resume_exactly_in_another_folder_and_on_other_ranks(small_files, tmp_path, shuffle):
    """Packs (gpuload.packs.pack_small) are part of the order: where they end depends on the files' names
    within their folder, so a copy elsewhere packs alike and goes on bit for bit; elastic resumes too."""
    import shutil

    root, _, total = small_files
    kw = dict(batch_size=64, device="cpu", shuffle=shuffle, seed=3)
    ds = gpuload.ParquetDataset(root, ["row_id", "x", "tags"], cache_dir=tmp_path / "c", **kw)
    assert any(c.parts for c in ds.reader.chunks)
    ref_run, states = _reference(ds, [0, 1])
    moved = tmp_path / "job-2" / "data"
    shutil.copytree(root, moved)
    for epoch, state in (states[5], states[len(states) // 2 + 3]):
        fresh = gpuload.ParquetDataset(moved, ["row_id", "x", "tags"], cache_dir=tmp_path / "c2", **kw)
        assert [[p.file for p in c.pieces] for c in fresh.reader.chunks] == \
            [[p.file for p in c.pieces] for c in ds.reader.chunks]
        taken = state["runs"][-1][1]
        _assert_same_run(_resumed(fresh, state, 1), _rest_from(ref_run, epoch, taken), (epoch, taken))
        fresh.close()
    epoch, state = states[7]
    taken = state["runs"][-1][1]
    news = [gpuload.ParquetDataset(moved, ["row_id", "x", "tags"], cache_dir=tmp_path / "c2", world_size=3, rank=r,
                                   **kw) for r in range(3)]
    rests = [[b for e, b in _resumed(d, state, epoch) if e == epoch] for d in news]
    assert len({len(r) for r in rests}) == 1  # equal batch counts on the new ranks
    ids = np.concatenate([row_ids([b for e, b in ref_run if e == epoch][:taken])] + [row_ids(r) for r in rests])
    assert sorted(ids.tolist()) == list(range(total))  # the rest of the epoch, every row once
    for d in news + [ds]:
        d.close()


def test_a_file_renamed_or_rewritten_changes_the_fingerprint_a_touched_or_linked_one_does_not(source, tmp_path):
    import os
    import shutil

    copy = tmp_path / "d"
    shutil.copytree(source, copy)

    def fp(where=copy):
        return _open(where, tmp_path / "c").reader.fingerprint

    before = fp()
    os.utime(copy / "part0.parquet", ns=(10**18, 10**18))  # touched: the same bytes
    assert fp() == before
    links = tmp_path / "links"  # a folder of links to blobs named otherwise (a hub cache's snapshot)
    (tmp_path / "blobs").mkdir()
    links.mkdir()
    for f in sorted(copy.glob("*.parquet")):
        blob = tmp_path / "blobs" / f"{abs(hash(f.name)):x}"
        shutil.copyfile(f, blob)
        (links / f.name).symlink_to(blob)
    assert fp(links) == before
    (copy / "part0.parquet").rename(copy / "part0b.parquet")  # renamed, in the same place of the file order
    renamed = fp()
    assert renamed != before
    table = pq.read_table(copy / "part0b.parquet")
    other = table.set_column(1, "x", pa.array(np.asarray(table.column("x")) + 1.0))  # the same rows, other values
    write_parquet(copy / "part0b.parquet", other, row_group_size=100)
    assert fp() not in (before, renamed)


def test_hive_keys_above_the_common_folder_are_part_of_the_fingerprint(tmp_path):
    t = pa.table({"row_id": np.arange(10, dtype=np.int64)})
    for year in (2020, 2021):
        (tmp_path / f"h{year}" / f"year={year}").mkdir(parents=True)
        write_parquet(tmp_path / f"h{year}" / f"year={year}" / "p.parquet", t)
    a, b = (open_dataset(tmp_path / f"h{y}", ["row_id", "year"], tmp_path / "c", batch_size=5) for y in (2020, 2021))
    assert a.reader.fingerprint != b.reader.fingerprint
    with pytest.raises(gpuload.ConfigError, match="source: the source files differ"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("mutate, match", [
    (lambda s: "nonsense", "not a gpuload ParquetDataset state"),
    (lambda s: {**s, "format": "x"}, "not a gpuload"),
    (lambda s: {**s, "version": 3}, "state version 3"),
    (lambda s: {**s, "version": 1}, "a state of version 1, saved by an older gpuload whose shuffle orders differ"),
    (lambda s: {**s, "epoch": -1}, "epoch=-1"),
    (lambda s: {**s, "runs": []}, "runs="),
    (lambda s: {**s, "runs": [[0, 1]]}, "runs="),
    (lambda s: {**s, "runs": [[1, 10_000]]}, "took 10000 batches"),
    (lambda s: {k: v for k, v in s.items() if k != "dataset"}, "no 'dataset'"),
    (lambda s: {**s, "dataset": {**s["dataset"], "outputs": {"row_id": [1]}}}, "outputs"),
    (lambda s: {**s, "dataset": {**s["dataset"], "outputs": {"row_id": "row_id"}}}, "outputs"),
    (lambda s: {**s, "dataset": {**s["dataset"], "outputs": ["row_id"]}}, "outputs"),
    (lambda s: {**s, "runs": [[1, 5], [10**9, 0], [2, 1]]}, "run 2 .* took 1 batches"),  # and in no time
])
def test_malformed_states_are_refused(source, tmp_path, mutate, match):
    ds = _open(source, tmp_path / "c")
    with pytest.raises(gpuload.ConfigError, match=match):
        ds.load_state_dict(mutate(ds.state_dict()))


def test_load_while_iterating_raises_and_works_after_close(source, tmp_path):
    cache = tmp_path / "c"
    ref_run, states = _reference(_open(source, cache), [0])
    ds = _open(source, cache)
    it = iter(ds)
    next(it)
    with pytest.raises(gpuload.ConfigError, match="while an iteration of this dataset is running"):
        ds.load_state_dict(states[10][1])
    it.close()
    ds.load_state_dict(states[10][1])
    _assert_same_run([(0, b) for b in ds], ref_run[10:], "after close")


def test_iter_before_load_state_dict_follows_the_restored_state(source, tmp_path):
    """The footgun of other loaders: iter() first, then load_state_dict, then iterate."""
    cache = tmp_path / "c"
    ref_run, states = _reference(_open(source, cache), [0, 1])
    ds = _open(source, cache)
    it = iter(ds)  # not started yet
    ds.load_state_dict(states[30][1])
    _assert_same_run([(0, b) for b in it], ref_run[30:len(ds)], "the same iterator")
    ds2 = _open(source, cache)
    iter(ds2)
    ds2.load_state_dict(states[len(ds) + 1 + 7][1])  # epoch 1, after 7 batches
    _assert_same_run([(1, b) for b in ds2], _rest_from(ref_run, 1, 7), "a new iterator")


def test_state_after_an_exception_in_the_training_step(source, tmp_path):
    cache = tmp_path / "c"
    ref_run, _ = _reference(_open(source, cache), [0])
    ds = _open(source, cache)
    with pytest.raises(ZeroDivisionError):
        for i, _batch in enumerate(ds):
            if i == 12:
                1 / 0  # the step that got batch 12 fails
    state = ds.state_dict()
    assert state["runs"] == [[1, 13]]  # batch 12 was handed out
    _assert_same_run(_resumed(_open(source, cache), state, 0), ref_run[13:], "after the step failed")


def test_state_after_the_loader_fails(source, tmp_path):
    """A read error mid-epoch: the state counts the batches handed out; a restore goes on from there."""
    cache = tmp_path / "c"
    ref_run, _ = _reference(_open(source, cache), [0])
    ds = _open(source, cache)
    windows, _ = ds.plan_epoch(0)
    bad, load = windows[3][0].chunk, ds.reader.load

    def failing(i):
        if i == bad:
            raise OSError("disk gone")
        return load(i)

    ds.reader.load = failing
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for b in ds:
            got.append((0, b))
    state = ds.state_dict()
    assert state["runs"] == [[1, len(got)]] and 0 < len(got) < len(ds)
    _assert_same_run(got + _resumed(_open(source, cache), state, 0), ref_run, "after the read failed")


def test_set_epoch_and_load_state_dict_in_either_order(source, tmp_path, caplog):
    cache = tmp_path / "c"
    ref_run, states = _reference(_open(source, cache), [0, 1, 2])
    k = len(_open(source, cache))
    end_of_0, mid_1 = states[k][1], states[k + 1 + 9][1]
    assert end_of_0["epoch"] == 0 and end_of_0["runs"] == [[1, k]] and mid_1["runs"] == [[1, 9]]
    # the loop's set_epoch comes first (a StatefulDataLoader restores the dataset inside iter())
    ds = _open(source, cache)
    ds.set_epoch(1)
    ds.load_state_dict(end_of_0)  # epoch 0 was complete: epoch 1 starts
    _assert_same_run([(1, b) for b in ds], _rest_from(ref_run, 1, 0)[:k], "set_epoch(next), then load")
    ds = _open(source, cache)
    ds.set_epoch(1)
    ds.load_state_dict(mid_1)
    _assert_same_run([(1, b) for b in ds], _rest_from(ref_run, 1, 9)[:k - 9], "set_epoch, then load")
    # load first, then the loop's set_epoch
    ds = _open(source, cache)
    ds.load_state_dict(end_of_0)
    ds.set_epoch(0)  # a loop that restarts at the saved epoch: it is over
    assert list(ds) == []
    ds.set_epoch(1)
    assert len(list(ds)) == k
    with caplog.at_level("WARNING", logger="gpuload"):
        ds = _open(source, cache)
        ds.load_state_dict(mid_1)
        ds.set_epoch(2)  # another epoch: the restored position is dropped, loudly
    assert "restored position (epoch 1, batch 9) is dropped" in caplog.text
    _assert_same_run([(2, b) for b in ds], _rest_from(ref_run, 2, 0), "set_epoch(other)")


# ---------------------------------------------------------------------------------------
# torchdata's StatefulDataLoader, and a fresh process
# ---------------------------------------------------------------------------------------

def test_stateful_dataloader_round_trip(source, tmp_path, caplog):
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    cache = tmp_path / "c"
    ref_run, _ = _reference(_open(source, cache), [0, 1, 2])
    ds = _open(source, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's own 'set_vital is deprecated'
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=0)
        got = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            for i, b in enumerate(loader):
                got.append((epoch, b))
                if epoch == 1 and i == 20:
                    break
        state = json.loads(json.dumps(loader.state_dict()))  # the loader's state holds ours
        assert state["dataset_state"]["runs"] == [[1, 21]] and state["dataset_state"]["epoch"] == 1
        ds2 = _open(source, cache)
        loaded = record_loads(ds2)
        loader2 = StatefulDataLoader(ds2, batch_size=None, num_workers=0)
        loader2.load_state_dict(state)
        with caplog.at_level("WARNING"):
            for epoch in (1, 2):
                ds2.set_epoch(epoch)
                got.extend((epoch, b) for b in loader2)
    assert "fast-forwarding" not in caplog.text  # restored from our state, not by replaying batches
    _assert_same_run(got, ref_run, "StatefulDataLoader")
    assert len(loaded) < 2 * len(ds.reader.chunks)


FRESH = r"""
import json, sys, numpy as np, gpuload
source, cache, states, out = sys.argv[1:5]
results = {}
for i, state in json.load(open(states)).items():
    ds = gpuload.ParquetDataset(source, json.loads(sys.argv[5]), cache_dir=cache, device="cpu", batch_size=int(sys.argv[6]),
                                chunk_bytes=8 << 10, shuffle_window=3)
    ds.load_state_dict(state)
    ids, xs = [], []
    for e in (state["epoch"], state["epoch"] + 1):
        ds.set_epoch(e)
        for b in ds:
            ids.append(b["row_id"].numpy()); xs.append(b["x"].numpy())
    results[i] = (np.concatenate(ids).tolist(), np.concatenate(xs).tobytes().hex())
json.dump(results, open(out, "w"))
"""


@pytest.mark.slow
def test_restore_in_a_fresh_process(source, tmp_path):
    cache = tmp_path / "c"
    ref_run, states = _reference(_open(source, cache), [0, 1, 2])
    k = len(_open(source, cache))
    sample = {str(i): states[i][1] for i in (0, 1, k // 2, k, k + 1 + k // 3)}
    (tmp_path / "states.json").write_text(json.dumps(sample))
    subprocess.run([sys.executable, "-c", FRESH, str(source), str(cache), str(tmp_path / "states.json"),
                    str(tmp_path / "out.json"), json.dumps(COLUMNS), str(BATCH)], check=True, timeout=120)
    results = json.loads((tmp_path / "out.json").read_text())
    for i, (ids, xs) in results.items():
        epoch, state = states[int(i)]
        want = [b for e, b in _rest_from(ref_run, epoch, state["runs"][-1][1]) if e <= epoch + 1]
        assert ids == row_ids(want).tolist(), i
        assert xs == np.concatenate([b["x"].numpy() for b in want]).tobytes().hex(), i


def test_a_restore_that_took_no_batch_leaves_no_trace(tmp_path):
    """A state taken on other ranks before their first batch restores exactly on the first ranks."""
    write_parquet(tmp_path / "a.parquet", {"row_id": np.arange(395)}, row_group_size=40)
    opened = lambda world=1, rank=0: gpuload.ParquetDataset(  # noqa: E731
        tmp_path / "a.parquet", batch_size=7, drop_last=True, cache_dir=tmp_path / "c", device="cpu",
        chunk_bytes=4096, rank=rank, world_size=world)
    ref_run, states = _reference(opened(), [0])
    on3 = opened(3, 1)
    on3.load_state_dict(states[10][1])
    assert on3.state_dict()["runs"] == [[1, 10], [3, 0]]
    back = opened()
    _assert_same_run(_resumed(back, on3.state_dict(), 0), ref_run[10:], "back on 1 rank")
    fresh_on3 = opened(3, 0)
    fresh_on3.load_state_dict(states[0][1])  # nothing taken: the ordinary 3-rank epoch
    assert fresh_on3.state_dict()["runs"] == [[3, 0]]


def test_state_follows_what_the_next_iteration_does(source, tmp_path):
    cache = tmp_path / "c"
    ds = _open(source, cache)
    end_of_0 = _reference(_open(source, cache), [0])[1][-1][1]
    ds.set_epoch(1)
    it = iter(ds)
    list(itertools.islice(it, 20))
    it.close()
    assert ds.state_dict()["runs"] == [[1, 20]]
    ds.set_epoch(1)  # the next iteration starts epoch 1 again
    assert ds.state_dict() == {**end_of_0, "epoch": 1, "runs": [[1, 0]]}
    it = iter(ds)
    list(itertools.islice(it, 5))
    it.close()
    ds.load_state_dict(end_of_0)  # rolled back to the end of epoch 0
    ds.set_epoch(1)
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["runs"] == [[1, 0]]
    assert len(list(ds)) == len(ds)


def test_chained_elastic_runs_read_each_window_once(source, tmp_path):
    """2 ranks, then 3 that take one batch, then 2 again: a window whose rows the 3 ranks split is read once."""
    cache = tmp_path / "c"
    state, seen = None, []
    for world, steps in ((2, 2), (3, 1)):
        states = []
        for r in range(world):
            ds = _open(source, cache, world, r)
            if state is not None:
                ds.load_state_dict(state)
            it = iter(ds)
            seen.append(row_ids(list(itertools.islice(it, steps))))
            states.append(ds.state_dict())
            it.close()
        state = states[0]
    assert state["runs"] == [[2, 2], [3, 1]]
    split = 0
    for r in range(2):
        ds = _open(source, cache, 2, r)
        ds.load_state_dict(state)
        takes = ds._plan.rest(ds._cursor.pending, r).takes
        assert len({(t.rank, t.window) for t in takes}) == len(takes)  # one load per window
        split += sum(len(t.spans) > 1 for t in takes)
        seen.append(row_ids(list(ds)))
    assert split  # some window had rows taken from its middle by the 3-rank run
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids) == sum(ROWS)


# ---------------------------------------------------------------------------------------
# iterations without set_epoch
# ---------------------------------------------------------------------------------------

def _epochs(source, cache, n: int) -> dict[int, list]:
    """Batches of epochs ``0..n-1``, each selected with set_epoch."""
    ds, out = _open(source, cache), {}
    for e in range(n):
        ds.set_epoch(e)
        out[e] = list(ds)
    return out


def _same_epoch(got: list, want: list, where) -> None:
    _assert_same_run([(0, b) for b in got], [(0, b) for b in want], where)


def test_a_new_iteration_without_set_epoch_begins_the_next_epoch(source, tmp_path):
    cache = tmp_path / "c"
    ref = _epochs(source, cache, 5)
    ds = _open(source, cache)
    assert ds.state_dict()["epoch"] == 0
    _same_epoch(list(ds), ref[0], "the first iteration: epoch 0")
    _same_epoch(list(ds), ref[1], "the second: epoch 1")
    assert ds.epoch == 1 and ds.state_dict()["epoch"] == 1
    iter(ds), iter(ds)  # iterators made but never started are no epoch
    it = iter(ds)
    part = [next(it) for _ in range(5)]  # epoch 2, left after 5 batches
    it.close()
    _same_epoch(part, ref[2][:5], "epoch 2, begun")
    assert ds.state_dict()["epoch"] == 2 and ds.state_dict()["runs"] == [[1, 5]]
    _same_epoch(list(ds), ref[3], "after an iteration was left: the next epoch")
    ds.set_epoch(1)  # set_epoch works as it always did
    _same_epoch(list(ds), ref[1], "set_epoch(1)")
    ds.set_epoch(1)
    _same_epoch(list(ds), ref[1], "set_epoch(1) again")
    _same_epoch(list(ds), ref[2], "then no set_epoch: epoch 2")


def test_restore_then_iterate_without_set_epoch(source, tmp_path):
    cache = tmp_path / "c"
    ref = _epochs(source, cache, 3)
    ds = _open(source, cache)
    list(ds)
    end_of_0 = ds.state_dict()
    it = iter(ds)
    [next(it) for _ in range(7)]
    mid_1 = ds.state_dict()
    it.close()
    assert end_of_0["runs"] == [[1, len(ds)]] and (mid_1["epoch"], mid_1["runs"]) == (1, [[1, 7]])
    a = _open(source, cache)
    a.load_state_dict(end_of_0)  # a complete epoch: the next iteration begins epoch 1
    _same_epoch(list(a), ref[1], "after the end of epoch 0")
    _same_epoch(list(a), ref[2], "then epoch 2")
    b = _open(source, cache)
    b.load_state_dict(mid_1)  # within an epoch: the next iteration goes on with it
    _same_epoch(list(b), ref[1][7:], "the rest of epoch 1")
    _same_epoch(list(b), ref[2], "then epoch 2")


def test_stateful_dataloader_without_set_epoch(source, tmp_path):
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    cache = tmp_path / "c"
    ref = _epochs(source, cache, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's own 'set_vital is deprecated'
        loader = StatefulDataLoader(_open(source, cache), batch_size=None, num_workers=0)
        _same_epoch(list(loader), ref[0], "loader, epoch 0")
        end_of_0 = json.loads(json.dumps(loader.state_dict()))  # after StopIteration
        got = []
        for i, b in enumerate(loader):
            got.append(b)
            if i == 9:
                break
        mid_1 = json.loads(json.dumps(loader.state_dict()))
        _same_epoch(got, ref[1][:10], "loader, epoch 1 begun")
        for state, epoch, skip in ((end_of_0, 1, 0), (mid_1, 1, 10)):
            again = StatefulDataLoader(_open(source, cache), batch_size=None, num_workers=0)
            again.load_state_dict(state)
            _same_epoch(list(again), ref[epoch][skip:], ("restored", epoch, skip))
            _same_epoch(list(again), ref[epoch + 1], ("then", epoch + 1))


# ---------------------------------------------------------------------------------------
# states that cannot exist
# ---------------------------------------------------------------------------------------

def _node_open(source, cache, rank=3):
    return _open(source, cache, 4, rank, shard="node", local_world_size=2)


@pytest.mark.parametrize("runs, match", [
    ([[4, 3, 3]], "4 ranks cannot be nodes of 3"),
    ([[2, 1, 4]], "2 ranks cannot be nodes of 4"),
    ([[6, 1, 4]], "6 ranks cannot be nodes of 4"),
    ([[64, 0, 2]], "32 nodes"),  # nodes too many for the chunks: a layout of another dataset
])
def test_impossible_node_layouts_are_refused(source, tmp_path, runs, match):
    for rank in (0, 3):
        ds = _node_open(source, tmp_path / "c", rank)
        with pytest.raises(gpuload.ConfigError, match=match):
            ds.load_state_dict({**ds.state_dict(), "runs": runs})
        assert len(list(ds)) == len(ds)  # nothing restored


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats(allow_nan=True)
                    | st.text(max_size=4), lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)
RUNS = st.lists(st.lists(st.integers(-1, 70) | st.sampled_from([2**40, 10**9]), min_size=0, max_size=4),
                min_size=0, max_size=4)


def test_any_state_is_refused_or_works(source, tmp_path):
    """Any JSON put in a state's fields (or any runs) is refused with a ConfigError, or restores a
    position that iterates; never a raw exception, in load_state_dict or in the loader."""
    ds = _node_open(source, tmp_path / "c")  # rank 3 of 2 nodes x 2 ranks, for every example
    list(ds)
    valid = json.dumps(ds.state_dict())

    @settings(max_examples=200, deadline=None)
    @given(data=st.data())
    def check(data):
        state = json.loads(valid)
        where = data.draw(st.sampled_from(["runs", "epoch", "format", "version", "dataset", "dataset.outputs",
                                           "dataset.outputs.row_id", "dataset.rows", "dataset.seed"]))
        keys = where.split(".")
        target = state
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = data.draw(RUNS if where == "runs" else JSON)
        try:
            ds.load_state_dict(state)
        except gpuload.ConfigError:
            return
        it = iter(ds)
        try:
            for _ in itertools.islice(it, 3):
                pass
        finally:
            it.close()

    check()


@pytest.mark.parametrize("world", [10**9, 2**40])
def test_a_node_layout_of_a_billion_ranks_is_refused_without_planning_it(source, tmp_path, world):
    """Found by test_any_state_is_refused_or_works under pytest-xdist: [[10**9, 0, 2]] made a node
    plan for 5e8 nodes (22 GB, the worker killed) before refusing it."""
    import resource

    ds = _node_open(source, tmp_path / "c")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    now = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    cap = now + (4 << 30)  # a MemoryError here instead of the machine's OOM killer, if the plan is made
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        with pytest.raises(gpuload.ConfigError, match="nodes for .* chunks"):
            ds.load_state_dict({**ds.state_dict(), "runs": [[world, 0, 2]]})
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_state_of_packed_files_restored_unpacked_is_refused_naming_pack_files_first(small_files, tmp_path):
    root = small_files[0]
    kw = dict(batch_size=64, device="cpu", cache_dir=tmp_path / "c")
    ds = gpuload.ParquetDataset(root, ["row_id"], **kw)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    ds.close()
    unpacked = gpuload.ParquetDataset(root, ["row_id"], pack_files=False, **kw)
    with pytest.raises(gpuload.ConfigError, match=r"another dataset: chunks: the chunk layout differs .*pack_files") as e:
        unpacked.load_state_dict(state)
    assert "give shuffle_window" not in str(e.value)  # its default follows the chunks: not the fix
    unpacked.close()
