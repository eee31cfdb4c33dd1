"""The pipeline (gpuload/pipeline.py) behind a dataset: its background threads never change
the order (threads, prefetch depth, a cold or warm cache), an early exit neither hangs nor
leaves threads behind, and an error on a background thread reaches the consumer.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from conftest import run_with_timeout, wait_no_threads
from gpuload import running as running_mod
from gpuload.pipeline import cut_threads
from reference import same_batches

pytestmark = pytest.mark.usefixtures("no_leftover_threads")


# ---------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("shuffle", [True, "block", False, "chunks"])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1)])
def test_order_is_independent_of_threads_prefetch_and_cache(click, tmp_path, monkeypatch, world, rank, shuffle,
                                                            layout):
    monkeypatch.setattr(running_mod, "cut_threads", lambda n: n)  # gathers on several threads, even on 2 cores
    kw = dict(seed=11, rank=rank, world_size=world, shuffle_window=3, shuffle=shuffle, layout=layout)
    warm = tmp_path / "warm"
    base_ds = click.open(warm, prefetch=2, num_threads=2, **kw)
    base_ds.set_epoch(3)
    base = list(base_ds)  # cold
    click.ref.check(base[0])
    variants = [dict(cache=warm, prefetch=p, num_threads=t) for p in (0, 1, 4) for t in (1, 3)]
    variants += [dict(cache=tmp_path / "cold1", prefetch=0, num_threads=3),
                 dict(cache=tmp_path / "cold2", prefetch=4, num_threads=1)]
    for v in variants:
        v = dict(v)
        ds = click.open(v.pop("cache"), **v, **kw)
        ds.set_epoch(3)
        same_batches(base, list(ds))
    # and the same object again, after another epoch in between
    base_ds.set_epoch(4)
    list(base_ds)
    base_ds.set_epoch(3)
    same_batches(base, list(base_ds))


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_each_windows_permutation_is_drawn_one_window_ahead_on_its_own_thread(click, tmp_path, monkeypatch, shuffle):
    """Window w + 1's permutation is drawn on the gpuload-perm thread while window w is assembled (the
    H200's cached epochs spent half the window thread drawing them); each window gets the plan's own
    permutation, once, whatever thread drew it: the batches are those of a plan drawn by hand."""
    from gpuload.epochs import EpochPlan

    drawn, real = [], EpochPlan.permutation

    def recording(self, epoch, take, n):
        drawn.append((take.window, threading.current_thread().name.split("_")[0]))
        return real(self, epoch, take, n)

    kw = dict(seed=5, shuffle_window=2, shuffle=shuffle, block_rows=16)
    want = list(click.open(tmp_path / "a", **kw))  # drawn before the change too: the reference order
    monkeypatch.setattr(EpochPlan, "permutation", recording)
    ds = click.open(tmp_path / "a", **kw)
    same_batches(want, list(ds))
    assert len(drawn) >= 3 and sorted(w for w, _ in drawn) == list(range(len(drawn)))  # each window once
    assert dict(drawn) == {w: "gpuload-window" if w == 0 else "gpuload-perm" for w in range(len(drawn))}


# ---------------------------------------------------------------------------------------
# early exit and background errors
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("close", ["break", "close", "abandon"])
@pytest.mark.parametrize("warm", [False, True])
def test_early_exit_does_not_hang_or_leak_threads(click, tmp_path, warm, close):
    ds = click.open(tmp_path / "cache", prefetch=4, num_threads=2)
    if warm:
        list(ds)
        ds.reader.cache.flush()

    def consume():
        if close == "break":
            for i, b in enumerate(ds):
                click.ref.check(b)
                if i == 1:
                    break
        else:
            it = iter(ds)
            click.ref.check(next(it))
            next(it)
            if close == "close":
                it.close()
            del it

    run_with_timeout(consume)
    gc.collect()
    assert wait_no_threads(include_writer=False) == []
    # the dataset still works afterwards
    ds.set_epoch(1)
    ids = run_with_timeout(lambda: np.concatenate([click.ref.check(b) for b in ds]))
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))
    del ds
    gc.collect()
    assert wait_no_threads(include_writer=True) == []


class Boom(Exception):
    pass


def test_background_exception_reaches_consumer(click, tmp_path):
    ds = click.open(tmp_path / "cache", shuffle=False, num_threads=2, prefetch=2, shuffle_window=1)
    real = ds.reader.decode
    bad = ds.reader.chunks[4]
    calls = []

    def flaky(f, chunk, specs):
        calls.append(chunk)
        if chunk == bad:
            raise Boom("decoder exploded")
        return real(f, chunk, specs)

    ds.reader.decode = flaky
    got = []

    def consume():
        with pytest.raises(Boom, match="decoder exploded") as info:
            for b in ds:
                got.append(b)
        return info

    info = run_with_timeout(consume)
    assert type(info.value) is Boom
    for b in got:
        click.ref.check(b)
    # chunk 4 failed (whichever of the two decoding threads took it): the consumer got nothing
    # from it or beyond it, and the loader had not read far ahead of it (threads + prefetch)
    assert sum(len(b["row_id"]) for b in got) <= sum(c.rows for c in ds.reader.chunks[:4])
    assert max(ds.reader.chunks.index(c) for c in calls) <= 4 + 2 + 2
    gc.collect()
    assert wait_no_threads(include_writer=False) == []
    # the next epoch works again
    ds.reader.decode = real
    ids = run_with_timeout(lambda: np.concatenate([click.ref.check(b) for b in ds]))
    assert np.array_equal(np.sort(ids), np.arange(click.ref.n))


def test_batches_are_gathered_on_several_threads_only_with_cores_to_spare():
    assert cut_threads(2, cores=5) == 2 and cut_threads(4, cores=16) == 4
    assert cut_threads(2, cores=4) == 1 and cut_threads(2, cores=2) == 1 and cut_threads(1, cores=64) == 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_failing_gather_on_a_cut_thread_reaches_the_consumer(click, tmp_path, monkeypatch, shuffle):
    """The CPU path gathers batches on the loader's cut threads: an error there reaches the
    consumer at that batch (the batches before it delivered, in order), and no thread is left."""
    from gpuload import layout as layout_mod

    monkeypatch.setattr(running_mod, "cut_threads", lambda n: n)
    ds = click.open(tmp_path / "cache", num_threads=3, prefetch=1, shuffle=shuffle)
    expected = [b["row_id"].clone() for b in ds]
    ds.set_epoch(0)
    real, calls, seen = layout_mod.Layout.unpack, [], []

    def unpack(self, cols, alloc=None):
        calls.append(threading.current_thread().name)
        if len(calls) == 5:
            raise RuntimeError("gather failed")
        return real(self, cols, alloc)

    monkeypatch.setattr(layout_mod.Layout, "unpack", unpack)
    with pytest.raises(RuntimeError, match="gather failed"):
        for b in ds:
            seen.append(b["row_id"].clone())
    assert all(name.startswith("gpuload-cut") for name in calls)
    # the 5th gather started failed: batches before it came in order (at most threads + 1 were
    # gathered ahead of the consumer, in any order)
    assert len(seen) <= 4 + 4 and all(a.equal(b) for a, b in zip(seen, expected))
    assert wait_no_threads(include_writer=False) == []
    monkeypatch.setattr(layout_mod.Layout, "unpack", real)
    ds.set_epoch(0)
    again = [b["row_id"] for b in ds]
    assert len(again) == len(expected) and all(a.equal(b) for a, b in zip(expected, again))


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_a_block_shuffle_copies_runs_from_the_chunks_as_a_joined_window_gives(click, tmp_path, monkeypatch, shuffle):
    """A block-shuffled window is not joined: each batch copies its runs of rows straight from
    the window's chunks (batch.Parts). Its batches equal those of the joined window's gather,
    and a row-shuffled window is still joined."""
    from gpuload import batch, pipeline

    kw = dict(seed=5, shuffle_window=3, shuffle=shuffle, prefetch=1, num_threads=2)
    ds = click.open(tmp_path / "c", **kw)
    ds.set_epoch(2)
    joined = []
    with monkeypatch.context() as m:
        m.setattr(pipeline, "long_runs", lambda perm: False)
        joined = list(ds)
    taken = []
    real = batch.Parts.take
    monkeypatch.setattr(batch.Parts, "take", lambda self, idx, alloc=None: taken.append(len(idx)) or real(self, idx, alloc))
    ds.set_epoch(2)
    same_batches(joined, list(ds))
    assert (sum(taken) == ds.num_rows) == (shuffle == "block") and (not taken) == (shuffle is True)
