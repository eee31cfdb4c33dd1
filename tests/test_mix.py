"""gpuload.Mix: several sources mixed by weight or by fixed composition, with every guarantee
of one source: exact counts per epoch, every row at most once per pass (the source that
ends an epoch read whole), one order per (seed, epoch), equal steps on every rank, bit-exact
resume at every position, every row once across a resume on other ranks; caches shared,
values equal to pyarrow's, and the slow source named."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import gpuload
from gpuload.mixplan import PASS_STRIDE, apportion
from gpuload.testing import HttpServer

from conftest import open_dataset, write_parquet

COLS = ["row_id", "x", "h"]
SIZES = {"a": 1000, "b": 400, "c": 650}  # rows per source; row ids start at BASE[name]
BASE = {"a": 0, "b": 100_000, "c": 200_000}
BS = 50


def _table(name: str) -> pa.Table:
    n, base = SIZES[name], BASE[name]
    ids = np.arange(base, base + n)
    return pa.table({"row_id": ids, "x": (ids * 0.5).astype(np.float32),
                     "h": pa.array([[int(i)] * (int(i) % 4) for i in ids], pa.list_(pa.int64()))})


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix_sources")
    out = {}
    for name in SIZES:
        t = _table(name)
        half = t.num_rows // 2
        write_parquet(root / name / "p0.parquet", t.slice(0, half), row_group_size=100)
        write_parquet(root / name / "p1.parquet", t.slice(half), row_group_size=100)
        out[name] = root / name
    return out


def _mix(paths, cache, weights=None, names=("a", "b", "c"), rank=None, world=None, bs=BS, sizes=None, **kw):
    ds = {n: open_dataset(paths[n], COLS, cache, batch_size=(sizes or {}).get(n, bs), rank=rank, world_size=world,
                          seed=i) for i, n in enumerate(names)}
    return gpuload.Mix(ds, weights, **kw)


def _source_of(ids: torch.Tensor) -> np.ndarray:
    return np.searchsorted(np.array(sorted(BASE.values())), ids.numpy(), side="right") - 1


def _steps(it):
    return [{k: (v.values.clone(), v.offsets.clone()) if isinstance(v, gpuload.Ragged) else v.clone()
             for k, v in b.items()} for b in it]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        set(x) == set(y) and all(torch.equal(*(p, q)) if not isinstance(p, tuple) else
                                 (torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]))
                                 for p, q in ((x[k], y[k]) for k in x)) for x, y in zip(a, b))


W = {"a": 0.5, "b": 0.3, "c": 0.2}


def test_an_epoch_holds_each_source_exactly_its_share_with_pyarrows_values(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", W, batches_per_step=4, provenance="src")
    p = m.plan()
    steps = _steps(m)
    assert len(steps) == len(m) == p.steps
    rows = np.concatenate([s["row_id"].numpy() for s in steps])
    src = np.concatenate([s["src"].numpy() for s in steps])
    assert all(len(s["row_id"]) == 4 * BS for s in steps)
    assert np.array_equal(src, _source_of(torch.from_numpy(rows)))  # provenance names the row's source
    assert np.bincount(src, minlength=3).tolist() == [c * BS for c in p.counts]
    assert len(np.unique(rows)) == len(rows)  # every row at most once
    limiting = int(np.argmin([SIZES[n] / W[n] for n in "abc"]))  # ends the epoch: whole here (to 3 batches in general)
    name = "abc"[limiting]
    assert sorted(rows[src == limiting]) == list(range(BASE[name], BASE[name] + SIZES[name]))
    assert abs(p.counts[0] / sum(p.counts) - 0.5) <= 1 / sum(p.counts)  # proportions within one batch
    ref = {n: pq.read_table(paths[n]).to_pydict() for n in "abc"}
    for s in steps[:3]:  # values against pyarrow's, row by row, lists included
        for j, rid in enumerate(s["row_id"].tolist()):
            n = "abc"[_source_of(torch.tensor([rid]))[0]]
            k = rid - BASE[n]
            assert s["x"][j].item() == ref[n]["x"][k]
            vals, off = s["h"]
            assert vals[off[j]:off[j + 1]].tolist() == ref[n]["h"][k]


def test_repeat_reads_every_source_whole_and_each_pass_once(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", W, batches_per_step=2, exhausted="repeat", provenance="src")
    p = m.plan()
    steps = _steps(m)
    rows = np.concatenate([s["row_id"].numpy() for s in steps])
    src = np.concatenate([s["src"].numpy() for s in steps])
    for i, n in enumerate("abc"):
        stream, per_pass = rows[src == i], SIZES[n]
        assert len(stream) == p.counts[i] * BS and len(stream) >= per_pass
        for a in range(0, len(stream), per_pass):  # each pass (the last may be partial): each row once
            part = stream[a:a + per_pass]
            assert len(np.unique(part)) == len(part)
            if len(part) == per_pass:
                assert sorted(part) == list(range(BASE[n], BASE[n] + per_pass))
        assert p.passes[i] == -(-len(stream) // per_pass)
    assert max(p.passes) > 1


def test_composition_gives_each_step_one_batch_of_every_source(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", names=("a", "b"), sizes={"a": 30, "b": 20}, provenance="src")
    steps = _steps(m)
    assert len(steps) == min(-(-SIZES["a"] // 30), -(-SIZES["b"] // 20)) == len(m)
    for s in steps:
        assert s["src"].tolist() == [0] * 30 + [1] * 20
    with pytest.raises(gpuload.ConfigError, match="mode='composition' .* weights= has no use there"):
        _mix(paths, tmp_path / "c", W, mode="composition")
    with pytest.raises(gpuload.ConfigError, match=r"batches_per_step=4 counts the source batches drawn by weight per "
                                                  r"step: give weights= too"):  # not the mode= it did not give
        _mix(paths, tmp_path / "c", names=("a", "b"), sizes={"a": 30, "b": 20}, batches_per_step=4)


def test_order_is_a_pure_function_of_seed_and_epoch(paths, tmp_path):
    first = _steps(_mix(paths, tmp_path / "c1", W, batches_per_step=2))
    again = _mix(paths, tmp_path / "c2", W, batches_per_step=2)
    assert _same(first, _steps(again))
    second = _steps(again)  # no set_epoch: the next epoch, in another order
    assert not _same(first, second)
    again.set_epoch(1)
    assert _same(second, _steps(again))
    other_seed = _steps(_mix(paths, tmp_path / "c3", W, batches_per_step=2, seed=7))
    assert not _same(first, other_seed)


@pytest.mark.parametrize("exhausted", ["end", "repeat"])
def test_resume_at_every_position_is_bit_exact(paths, tmp_path, exhausted):
    kw = dict(weights={"a": 1, "b": 1}, names=("a", "b"), bs=100, batches_per_step=2, exhausted=exhausted,
              provenance="src")
    m = _mix(paths, tmp_path / "c", **kw)
    m.set_epoch(3)
    ref = _steps(m)
    nxt = _steps(m)  # epoch 4: where a state taken after epoch 3's last step goes on
    for k in range(len(ref) + 1):
        m = _mix(paths, tmp_path / "c", **kw)
        m.set_epoch(3)
        it = iter(m)
        head = _steps(next(it) for _ in range(k))
        state = json.loads(json.dumps(m.state_dict()))  # as a checkpoint keeps it
        it.close()
        fresh = _mix(paths, tmp_path / "c", **kw)
        fresh.load_state_dict(state)
        assert fresh.epoch == 3 and fresh.steps_left == (len(ref) - k or len(nxt))  # after the last step: the next epoch
        rest = _steps(fresh)
        assert fresh.epoch == (3 if k < len(ref) else 4)
        assert _same(head + rest, ref) if k < len(ref) else _same(head, ref) and _same(rest, nxt), k


def test_numpy_weights_and_epochs_mean_what_python_numbers_mean(paths, tmp_path):
    kw = dict(bs=BS, batches_per_step=2, provenance="src")
    m = _mix(paths, tmp_path / "c", weights={"a": 5, "b": 3, "c": 2}, **kw)
    m.set_epoch(1)
    n = _mix(paths, tmp_path / "c", weights={"a": np.int64(5), "b": np.uint8(3), "c": np.float32(2)}, **kw)
    n.set_epoch(np.int64(1))
    assert _same(_steps(n), _steps(m)) and n.epoch == 1 and type(n.epoch) is int
    for bad, what in ((-1, r"epoch=-1 must be an integer from 0 to"), (1.0, r"epoch=1.0 must be an integer"),
                      (True, r"epoch=True must be an integer"), (2**63, r"epoch=\d+ must be an integer from 0 to")):
        for loader in (m, m.sources[0]):  # the Mix and one of its datasets refuse it alike
            with pytest.raises(gpuload.ConfigError, match=what):
                loader.set_epoch(bad)
        with pytest.raises(gpuload.ConfigError, match=what):  # the plan of an epoch that cannot be is refused too
            m.sources[0].plan_epoch(bad)
    assert m.epoch == 1  # a refused epoch changes nothing


def test_a_restore_never_leaks_into_later_epochs_or_rollbacks(paths, tmp_path):
    kw = dict(weights=W, bs=BS, batches_per_step=2, provenance="src")
    m = _mix(paths, tmp_path / "c", **kw)
    epoch0 = _steps(m)
    probe = _mix(paths, tmp_path / "c", **kw)
    states, it = [], iter(probe)
    for _ in range(len(epoch0) - 1):  # a state after each step, the last one after source c's last batch
        next(it)
        states.append(probe.state_dict())
    it.close()
    late = _mix(paths, tmp_path / "c", **kw)
    late.load_state_dict(states[-1])
    assert len(_steps(late)) == 1
    late.set_epoch(0)
    assert _same(_steps(late), epoch0)  # a whole epoch 0: nothing of the restored position left in a source
    late.load_state_dict(states[5])  # roll back: the sources follow the state, not what they held last
    assert _same(_steps(late), epoch0[6:])
    late.load_state_dict(states[2])
    it = iter(late)
    next(it)
    it.close()
    late.load_state_dict(states[1])
    assert _same(_steps(late), epoch0[2:])


@pytest.mark.parametrize("per_step", [1, 3])
def test_chains_of_restores_stay_bit_exact(paths, tmp_path, per_step):
    """Restore, take a step, save again, restore that: a source restored but not read since keeps
    its restored position in the new state."""
    kw = dict(weights=W, batches_per_step=per_step, provenance="src")
    ref = _steps(_mix(paths, tmp_path / "c", **kw))
    m = _mix(paths, tmp_path / "c", **kw)
    it = iter(m)
    head = _steps([next(it)])
    state = m.state_dict()
    it.close()
    for _ in range(3):  # each time: restore, one step, save
        m = _mix(paths, tmp_path / "c", **kw)
        m.load_state_dict(json.loads(json.dumps(state)))
        it = iter(m)
        head += _steps([next(it)])
        state = m.state_dict()
        it.close()
    last = _mix(paths, tmp_path / "c", **kw)
    last.load_state_dict(state)
    assert _same(head + _steps(last), ref)


def test_a_mix_is_never_pickled_and_a_deep_copy_of_its_holder_shares_it(paths, tmp_path):
    import copy
    import pickle

    m = _mix(paths, tmp_path / "c", W)
    with pytest.raises(gpuload.ConfigError, match="a Mix cannot be pickled or copied"):
        pickle.dumps(m)
    holder = torch.nn.Linear(2, 2)
    holder.mix = m
    assert copy.deepcopy(holder).mix is m  # SWA and EMA callbacks copy the LightningModule that holds it


def test_closing_a_mix_closes_its_sources_and_it_still_iterates(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", W)
    first = _steps(m)
    assert all(d.reader.cache.registration is not None for d in m.sources)  # their chunks kept from eviction
    m.close()  # a new user's trial: Mix had no close(), where the README closes datasets
    assert all(d._epochs.ahead.pending is None and d.reader.cache.registration is None for d in m.sources)
    m.set_epoch(0)
    assert _same(_steps(m), first)


def test_a_malformed_state_is_refused_as_such(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", W)
    good = m.state_dict()
    for key, bad in (("mix", None), ("runs", [[1, 2, 3]]), ("runs", "x"), ("epoch", "one"), ("sources", 5)):
        state = {**good, key: bad}
        with pytest.raises(gpuload.ConfigError, match=r"state is malformed \(.*\): pass what Mix.state_dict\(\)"):
            m.load_state_dict(state)
    with pytest.raises(gpuload.ConfigError, match="malformed"):
        m.load_state_dict({k: v for k, v in good.items() if k != "runs"})
    with pytest.raises(gpuload.ConfigError, match="a state of version 1, saved by an older gpuload whose shuffle "
                                                  "orders differ, cannot be resumed exactly"):
        m.load_state_dict({**good, "version": 1})
    with pytest.raises(gpuload.ConfigError, match="not a gpuload.Mix state of version 2$"):
        m.load_state_dict({**good, "version": 3})
    m.load_state_dict(good)  # and the good one still restores


def test_set_epoch_before_load_state_dict_as_a_stateful_dataloader_restores(paths, tmp_path):
    done = _mix(paths, tmp_path / "c", W)
    epochs = [_steps(done) for _ in range(3)]  # epochs 0, 1, 2
    state0 = _mix(paths, tmp_path / "c", W)
    list(state0)
    saved = state0.state_dict()  # after epoch 0's last step
    m = _mix(paths, tmp_path / "c", W)
    got = []
    for e in range(3):
        m.set_epoch(e)
        if e == 0:
            m.load_state_dict(saved)  # inside iter(), after the loop's set_epoch
        got.append(_steps(m))
    assert got[0] == [] and _same(got[1], epochs[1]) and _same(got[2], epochs[2])


def test_set_epoch_during_an_iteration_applies_to_the_next(paths, tmp_path):
    ref = _mix(paths, tmp_path / "c", W)
    e0, e5 = _steps(ref), None
    ref.set_epoch(5)
    e5 = _steps(ref)
    m = _mix(paths, tmp_path / "c", W)
    it = iter(m)
    first = _steps([next(it), next(it)])
    m.set_epoch(5)  # the running epoch goes on
    assert _same(first + _steps(it), e0)
    assert _same(_steps(m), e5)


def test_len_set_epoch_and_stats_after_the_loop_is_left_early(paths, tmp_path):
    m = _mix(paths, tmp_path / "c", W, batches_per_step=2)
    whole = len(m)
    it = iter(m)
    for _ in range(3):
        next(it)
    it.close()
    assert len(m) == whole == m.steps_left  # the next iteration is a whole epoch
    m.set_epoch(0)  # after a break: epoch 0 again, from its first step
    ref = _steps(_mix(paths, tmp_path / "c2", W, batches_per_step=2))
    assert _same(_steps(m), ref)
    st = m.stats()
    assert st.passes == 2 and st.batches == 3 + whole
    done = _mix(paths, tmp_path / "c", W, batches_per_step=2)
    list(done)
    state = done.state_dict()
    again = _mix(paths, tmp_path / "c", W, batches_per_step=2)
    again.load_state_dict(state)  # taken after the last step of epoch 0
    again.set_epoch(0)  # the usual loop: range(saved epoch, ...) starts with the finished one
    assert _steps(again) == []
    assert again.epoch == 0 and len(_steps(again)) == whole and again.epoch == 1


def _ranked(paths, cache, world, **kw):
    return [_mix(paths, cache, W, rank=r, world=world, provenance="src", **kw) for r in range(world)]


def _passes(m, it, k=None) -> list[tuple[str, int, np.ndarray]]:
    """(source, its epoch, row ids) of each step taken from ``it`` (one source batch per step):
    which pass a batch came from, read from the mix's state after it."""
    out = []
    for b in (it if k is None else (next(it) for _ in range(k))):
        n = "abc"[int(b["src"][0])]
        out.append((n, m.state_dict()["sources"][n]["epoch"], b["row_id"].numpy().copy()))
    return out


def test_every_rank_takes_the_same_steps_and_each_row_once_across_ranks(paths, tmp_path):
    mixes = _ranked(paths, tmp_path / "c", 2, batches_per_step=2)
    per_rank = [_steps(m) for m in mixes]
    assert len(per_rank[0]) == len(per_rank[1]) == len(mixes[0]) == len(mixes[1])
    rows = np.concatenate([s["row_id"].numpy() for steps in per_rank for s in steps])
    assert len(np.unique(rows)) == len(rows)


@pytest.mark.parametrize("exhausted", ["end", "repeat"])
@pytest.mark.parametrize("new_world", [3, 1])
def test_a_resume_on_other_ranks_delivers_each_row_at_most_once_per_pass_with_equal_steps(paths, tmp_path,
                                                                                         new_world, exhausted):
    before = _ranked(paths, tmp_path / "c", 2, exhausted=exhausted)
    its = [iter(m) for m in before]
    head = [_passes(m, it, 8) for m, it in zip(before, its)]
    states = [m.state_dict() for m in before]
    assert states[0] == states[1]  # the same on every rank: rank 0's is enough
    for it in its:
        it.close()
    after = _ranked(paths, tmp_path / "c", new_world, exhausted=exhausted)
    for m in after:
        m.load_state_dict(states[0])
    planned = {m.steps_left for m in after}
    assert len(planned) == 1  # ('end': 0 when a source the rest begins with had finished its pass)
    # len(): the steps each rank took before plus the new run's, as Lightning counts a resumed epoch
    whole = len(_ranked(paths, tmp_path / "c", new_world, exhausted=exhausted)[0])
    assert {len(m) for m in after} == {max(whole, 8 + planned.copy().pop())}
    tails = [_passes(m, iter(m)) for m in after]
    assert {len(t) for t in tails} == planned  # every rank the steps steps_left said
    for t in tails:  # the rest holds each source's share by weight, as a whole epoch does (to one batch)
        got = [sum(n == x for n, _, _ in t) for x in "abc"]
        assert got == apportion(len(t), list(W.values())), got
    groups: dict = {}
    for part in head + tails:
        for n, ep, ids in part:
            groups.setdefault((n, ep), []).append(ids)
    whole = []
    for (n, ep), parts in groups.items():  # every pass of every source: no row twice, across both runs
        ids = np.concatenate(parts)
        assert len(np.unique(ids)) == len(ids), (n, ep)
        if ep == 0 and sorted(ids) == list(range(BASE[n], BASE[n] + SIZES[n])):
            whole.append(n)
    if exhausted == "repeat":  # every source's first pass read whole: each of its rows exactly once
        assert sorted(whole) == ["a", "b", "c"]
        nxt = _passes(after[0], iter(after[0]))  # the next epoch: passes of its own, none seen before
        assert not {(n, ep) for n, ep, _ in nxt} & set(groups)
        # a whole epoch repeats the sources that run out first ('a' at weight 0.5 before 'c' at 0.2); the
        # rest of a resumed one need not (each rank's shares may end on its last step together)
        assert any(ep % PASS_STRIDE > 0 for _, ep, _ in nxt)
    else:  # the source that ran out was read whole, exactly once across the two runs
        assert whole


@pytest.mark.parametrize("exhausted", ["end", "repeat"])
@pytest.mark.parametrize("new_world", [1, 3])
def test_a_fixed_epoch_resumed_on_other_ranks_keeps_its_steps_worth(paths, tmp_path, new_world, exhausted):
    """steps_per_epoch=6 on 2 ranks is 12 steps' worth of batches: 2 taken on each, the other 8 shared by
    the new ranks (each the same steps). A reviewer's finding: the rest ran to a source's end (95 steps
    for an epoch of 4) as if no steps were fixed."""
    before = _ranked(paths, tmp_path / "c", 2, exhausted=exhausted, steps_per_epoch=6)
    its = [iter(m) for m in before]
    head = [_passes(m, it, 2) for m, it in zip(before, its)]
    state = before[0].state_dict()
    for it in its:
        it.close()
    after = _ranked(paths, tmp_path / "c", new_world, exhausted=exhausted, steps_per_epoch=6)
    for m in after:
        m.load_state_dict(state)
    assert {m.steps_left for m in after} == {8 // new_world}
    tails = [_passes(m, iter(m)) for m in after]
    assert {len(t) for t in tails} == {8 // new_world}
    seen: dict = {}
    for n, ep, ids in (x for part in head + tails for x in part):  # no row twice in a pass, across the runs
        seen.setdefault((n, ep), []).append(ids)
    assert all(len(np.unique(np.concatenate(v))) == len(np.concatenate(v)) for v in seen.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_mixes_resumed_anywhere_on_any_ranks(paths, tmp_path, data):
    """Random weights, ranks, modes and resume positions: every rank the same steps, each epoch
    holding exactly its planned batches per source, no row twice in a pass across the runs."""
    weights = {n: data.draw(st.floats(0.1, 3.0), label=f"w_{n}") for n in "abc"}
    world, new_world = data.draw(st.integers(1, 3), label="world"), data.draw(st.integers(1, 3), label="new world")
    exhausted = data.draw(st.sampled_from(["end", "repeat"]), label="exhausted")
    per_step = 1 if exhausted == "repeat" else data.draw(st.integers(1, 3), label="per step")
    kw = dict(batches_per_step=per_step, exhausted=exhausted, provenance="src")
    before = [_mix(paths, tmp_path / "c", weights, rank=r, world=world, **kw) for r in range(world)]
    p = before[0].plan()
    k = data.draw(st.integers(0, p.steps), label="resume after")
    its = [iter(m) for m in before]
    head = [[(b["src"].numpy().copy(), b["row_id"].numpy().copy(), m.state_dict()["sources"])
             for b in (next(it) for _ in range(k))] for m, it in zip(before, its)]
    state = before[0].state_dict()
    assert all(m.state_dict() == state for m in before)
    for it in its:
        it.close()
    after = [_mix(paths, tmp_path / "c", weights, rank=r, world=new_world, **kw) for r in range(new_world)]
    for m in after:
        m.load_state_dict(state)
    left = {m.steps_left for m in after}
    tails = [[(b["src"].numpy().copy(), b["row_id"].numpy().copy(), m.state_dict()["sources"]) for b in m]
             for m in after]
    assert len(left) == 1 and {len(t) for t in tails} == left  # every rank the same steps, as steps_left said
    assert {len(m) for m in after} == {after[0].plan().steps}  # len(): a whole epoch, resumed or not
    if new_world == world and k < p.steps:  # the same ranks: the epoch holds exactly its planned batches per source
        if per_step == 1:  # a step is one source's batch
            steps = [int(s[0]) for part in head + tails for s, _, _ in part]
            assert np.bincount(steps, minlength=3).tolist() == [c * world for c in p.counts]
        else:  # 'end': one pass per source, its first counts[i] batches on every rank
            rows = np.bincount(np.concatenate([s for part in head + tails for s, _, _ in part]), minlength=3)
            want = [sum(m.sources[i].plan_epoch(0)[1].rows_before(c) for m in before) for i, c in enumerate(p.counts)]
            assert rows.tolist() == want
    seen: dict = {}
    for part in head + tails:
        for src, ids, states in part:
            for i, n in enumerate("abc"):
                if (src == i).any():
                    seen.setdefault((n, states[n]["epoch"]), []).append(ids[src == i])
    for key, parts in seen.items():
        ids = np.concatenate(parts)
        assert len(np.unique(ids)) == len(ids), key


def test_node_affine_sources_mix_with_equal_steps_on_every_rank(paths, tmp_path):
    """Sources with shard='node' (2 nodes x 2 ranks, a cache per node): every rank the same steps,
    no row twice in a pass; each node caches only its share of each source."""
    mixes = [gpuload.Mix({n: open_dataset(paths[n], COLS, tmp_path / f"node{r // 2}", batch_size=BS, seed=i,
                                          rank=r, world_size=4, shard="node", local_world_size=2, chunk_bytes=4096)
                          for i, n in enumerate("abc")}, W, exhausted="repeat", provenance="src") for r in range(4)]
    lens = {len(m) for m in mixes}
    steps = [_passes(m, iter(m)) for m in mixes]
    assert len(lens) == 1 and {len(s) for s in steps} == lens
    seen: dict = {}
    for part in steps:
        for n, ep, ids in part:
            seen.setdefault((n, ep), []).append(ids)
    assert all(len(np.unique(np.concatenate(v))) == sum(map(len, v)) for v in seen.values())
    for m in mixes:
        for d in m.sources:
            d.reader.cache.flush()
    for node in (0, 1):  # each source read whole: a node's cache holds exactly its share of every source
        owned = sum(len(d.node_chunks()[node]) for d in mixes[2 * node].sources)
        total = sum(len(d.reader.chunks) for d in mixes[0].sources)
        assert 0 < owned < total and len(list((tmp_path / f"node{node}").rglob("*.glc"))) == owned


def test_sources_that_do_not_match_are_refused_by_name(paths, tmp_path):
    a = open_dataset(paths["a"], COLS, tmp_path / "c", batch_size=BS)
    b = open_dataset(paths["b"], COLS, tmp_path / "c", batch_size=BS, dtypes={"x": "float64"})
    with pytest.raises(gpuload.ConfigError, match=r"output 'x' is scalar float64 in source 'b' but scalar float32"):
        gpuload.Mix({"a": a, "b": b}, {"a": 1, "b": 1})
    b = open_dataset(paths["b"], ["row_id", "x"], tmp_path / "c", batch_size=BS)
    with pytest.raises(gpuload.ConfigError, match="same outputs"):
        gpuload.Mix({"a": a, "b": b})
    b = open_dataset(paths["b"], COLS, tmp_path / "c", batch_size=2 * BS)
    with pytest.raises(gpuload.ConfigError, match="need one batch_size.*or leave out weights="):
        gpuload.Mix({"a": a, "b": b}, {"a": 1, "b": 1})
    b = open_dataset(paths["b"], COLS, tmp_path / "c", batch_size=BS)
    for weights, what in [({"a": 1}, "each source"), ({"a": 1, "b": -1}, "positive"), ({"a": 1, "b": "x"}, "positive")]:
        with pytest.raises(gpuload.ConfigError, match=what):
            gpuload.Mix({"a": a, "b": b}, weights)
    with pytest.raises(gpuload.ConfigError, match="not an output already"):
        gpuload.Mix({"a": a, "b": b}, provenance="x")
    with pytest.raises(gpuload.ConfigError, match="given twice"):
        gpuload.Mix({"a": a, "b": a})
    with pytest.raises(gpuload.ConfigError, match="exhausted='never'"):
        gpuload.Mix({"a": a, "b": b}, exhausted="never")
    state = gpuload.Mix({"a": a, "b": b}, {"a": 1, "b": 1}).state_dict()
    with pytest.raises(gpuload.ConfigError, match="weights differ"):
        gpuload.Mix({"a": a, "b": b}, {"a": 1, "b": 2}).load_state_dict(state)


def test_a_source_shared_by_two_mixes_is_cached_once(paths, tmp_path):
    cache = tmp_path / "c"
    first = _mix(paths, cache, {"a": 1, "b": 1}, names=("a", "b"), exhausted="repeat")
    list(first)
    for d in first.sources:
        d.reader.cache.flush()  # writes still in flight when the epoch ended
    assert first.sources[0].reader.counters.decoded > 0
    second = _mix(paths, cache, {"a": 1, "c": 1}, names=("a", "c"), exhausted="repeat")
    list(second)
    for d in second.sources:
        d.reader.cache.flush()
    a = second.sources[0].reader.counters
    assert a.decoded == 0 and a.from_cache > 0  # 'a' was cached by the first mix: read, not decoded
    alone = 0
    for n in "abc":  # each source cached on its own, in a folder of its own
        one = open_dataset(paths[n], COLS, tmp_path / f"alone_{n}", batch_size=BS)
        list(one)
        one.reader.cache.flush()
        alone += len(list((tmp_path / f"alone_{n}").rglob("*.glc")))
    assert len(list(cache.rglob("*.glc"))) == alone  # one file per chunk, 'a' once


def test_stats_name_the_source_the_mix_waited_for(paths, tmp_path):
    with HttpServer(paths["b"].parent, latency_s=0.25) as http:
        slow = open_dataset(http.url("b/"), COLS, tmp_path / "c", batch_size=BS, seed=1)
        fast = open_dataset(paths["a"], COLS, tmp_path / "c", batch_size=BS)
        m = gpuload.Mix({"local": fast, "remote": slow}, {"local": 1, "remote": 1})
        for _ in m:
            time.sleep(0.001)
    st = m.stats()
    assert set(st.sources) == {"local", "remote"}
    assert st.sources["remote"].wait_s > st.sources["local"].wait_s
    assert st.batches == len(m) and "source remote" in str(st)
    shares = re.findall(r"source (\w+) +.*the mix waited [\d.]+ s for them \(([\d.]+)% of the mix's time\)", str(st))
    assert sorted(n for n, _ in shares) == ["local", "remote"]
    for name, text in shares:  # shares of one time, the mix's (each source's own wall time differs)
        assert abs(float(text) / 100 - st.sources[name].wait_s / st.wall_s) < 0.001
    d = gpuload.diagnose(st)
    assert d.source == "remote" and "'remote'" in d.message and d.action.startswith("in source 'remote'")


def test_a_mix_starved_by_its_own_thread_says_so():
    from gpuload.observe.stats import Stats

    def stats(wait, wall=10.0, **kw):
        return Stats(wall_s=wall, batches=100, rows=10_000, bytes=1, wait_s=wait, starvation=wait / wall, passes=1,
                     wait_mean_s=0.01, wait_max_s=0.1, step_mean_s=0.05, step_max_s=0.1, stages={},
                     first_wait_s=0.01, **kw)

    mix = stats(5.0, sources={"a": stats(0.2), "b": stats(0.4)})
    d = gpuload.diagnose(mix)
    assert d.limiting == "batch" and d.source is None and "the mix thread itself" in d.message
    assert "prefetch" in d.action


@pytest.mark.gpu
@pytest.mark.parametrize("per_step", [1, 4])
def test_on_a_gpu_the_mix_is_the_cpus(paths, tmp_path, per_step):
    """The steps a GPU mix hands out (source batches handed on, or joined on the training
    stream) equal the CPU's, read on the training stream without any other synchronisation."""
    cpu = _steps(_mix(paths, tmp_path / "c1", W, bs=BS * 4 // per_step, batches_per_step=per_step,
                      provenance="src"))
    m = gpuload.Mix({n: open_dataset(paths[n], COLS, tmp_path / "c2", batch_size=BS * 4 // per_step, seed=i,
                                     device="cuda") for i, n in enumerate("abc")}, W,
                    batches_per_step=per_step, provenance="src")
    gpu = []

    def host(t):  # a non-blocking copy queued behind a slow step on the training stream
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    for b in m:
        assert all(t.is_cuda for v in b.values() for t in (v if isinstance(v, gpuload.Ragged) else (v,)))
        torch.cuda._sleep(5_000_000)  # the step: the copies below wait for it, the loader must not reuse memory
        gpu.append({k: (host(v.values), host(v.offsets)) if isinstance(v, gpuload.Ragged) else host(v)
                    for k, v in b.items()})
    torch.cuda.current_stream().synchronize()
    assert _same(cpu, gpu)


def test_sources_whose_categorical_ids_mean_other_values_are_refused(tmp_path):
    """A user's trial mixed two sources with Vocab() each: 'JP' was id 1 in one and 'GB' in the other,
    so one embedding row meant two countries. Counted vocabularies of other files, or other Hash
    settings, are refused; the same Hash in every source mixes."""
    for name, countries in (("a", ["JP", "JP", "DE", "FR"] * 50), ("b", ["GB", "GB", "GB", "JP"] * 50)):
        write_parquet(tmp_path / name / "p.parquet", pa.table({"row_id": np.arange(200), "country": countries}))

    def ds(name, enc, **kw):
        return open_dataset(tmp_path / name, ["row_id", "country"], tmp_path / "c", batch_size=BS, categorical=enc, **kw)

    va, vb = ds("a", gpuload.Vocab()), ds("b", gpuload.Vocab())
    assert va.vocabulary("country").to_dict()["JP"] == 1 and vb.vocabulary("country").to_dict()["GB"] == 1
    with pytest.raises(gpuload.ConfigError, match=r"output 'country' of a mix's sources is encoded by a vocabulary "
                                                  r"counted over each source's own files.*one gpuload.Hash.*"
                                                  r"one gpuload.Vocabulary"):
        gpuload.Mix({"a": va, "b": vb}, {"a": 1, "b": 1})
    with pytest.raises(gpuload.ConfigError, match=r"Hash\(buckets=10, seed=0\) in 'a' and Hash\(buckets=1000, "
                                                  r"seed=3\) in 'b'"):
        gpuload.Mix({"a": ds("a", gpuload.Hash(10)), "b": ds("b", gpuload.Hash(1000, seed=3))})
    with pytest.raises(gpuload.ConfigError, match=r"Vocab\(min_count=1, max_size=None\) in 'a' and Hash"):
        gpuload.Mix({"a": va, "b": ds("b", gpuload.Hash(1000))})
    ha, hb = ds("a", gpuload.Hash(1000, seed=3)), ds("b", gpuload.Hash(1000, seed=3))
    mix = gpuload.Mix({"a": ha, "b": hb}, {"a": 1, "b": 1})
    ids = {}
    for step in mix:
        for r, c in zip(step["row_id"].tolist(), step["country"].tolist()):
            ids.setdefault(c, set()).add(r)
    assert len(ids) == 4  # JP, DE, FR, GB: one id each, JP's the same in both sources
    same = gpuload.Mix({"a": ds("a", gpuload.Vocab()), "b": ds("a", gpuload.Vocab(), seed=1)})  # one file set
    assert same.names == ["a", "b"]
    # a plain integer column beside a hashed one of the same name (both int64): refused, in either order
    write_parquet(tmp_path / "n" / "p.parquet", pa.table({"row_id": np.arange(200), "country": np.arange(200)}))
    plain = open_dataset(tmp_path / "n", ["row_id", "country"], tmp_path / "c", batch_size=BS)
    for pair in ({"a": ha, "n": plain}, {"n": plain, "a": ha}):
        with pytest.raises(gpuload.ConfigError, match=r"no encoder in '(a|n)'|in 'n' and Hash"):
            gpuload.Mix(pair)
    # a transform that makes 'country' of another column: the encoders it is given are compared
    write_parquet(tmp_path / "r" / "p.parquet", pa.table({"row_id": np.arange(200), "nation": ["GB"] * 200}))
    rename = gpuload.Transform(lambda cols: {"row_id": cols["row_id"], "country": cols["nation"]}, key="rename-v1")
    renamed = open_dataset(tmp_path / "r", ["row_id", "nation"], tmp_path / "c", batch_size=BS,
                           categorical={"nation": gpuload.Hash(10)}, transform=rename)
    with pytest.raises(gpuload.ConfigError, match=r"the columns its transform is given.*Hash\(buckets=1000, seed=3\)"
                                                  r" in 'a' and Hash\(buckets=10, seed=0\) in 'r'"):
        gpuload.Mix({"a": ha, "r": renamed})
    ok = open_dataset(tmp_path / "r", ["row_id", "nation"], tmp_path / "c", batch_size=BS,
                      categorical={"nation": gpuload.Hash(1000, seed=3)}, transform=rename)
    assert gpuload.Mix({"a": ha, "r": ok}).names == ["a", "r"]
    # the same values in the same order, counted over other files (other counts): the same ids, mixed
    one = gpuload.Vocabulary.of(["JP", "DE", "FR", "GB"])
    twin = gpuload.vocabulary.Vocabulary("country", one.values, np.arange(4), gpuload.Vocab())
    assert twin.digest != one.digest
    assert gpuload.Mix({"a": ds("a", {"country": one}), "b": ds("b", {"country": twin})}).names == ["a", "b"]
    # one vocabulary counted over both sources' files, given to each: one id per country, in both
    both = open_dataset([tmp_path / "a", tmp_path / "b"], ["country"], tmp_path / "c", categorical=gpuload.Vocab())
    voc = both.vocabulary("country")
    assert voc.to_dict() == {"GB": 1, "JP": 2, "DE": 3, "FR": 4}  # by count (150, 150, 50, 50), then bytes
    mix = gpuload.Mix({"a": ds("a", {"country": voc}), "b": ds("b", {"country": voc})}, {"a": 1, "b": 1})
    seen = np.bincount(np.concatenate([step["country"].numpy() for step in mix]), minlength=5)
    assert seen.tolist() == [0, 150, 150, 50, 50]  # JP: 100 rows of a and 50 of b, one id
