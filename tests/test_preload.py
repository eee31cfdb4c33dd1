"""Preload: the next epoch's first chunks loaded while an epoch's last window is cut, taken by
the next iteration instead of loaded again; orders never change, wrong guesses cost reads only."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import gpuload
from conftest import open_dataset, record_loads, row_ids, wait_until, write_parquet
from gpuload.pipeline import epoch_batches
from gpuload.plan import Segment
from gpuload.preload import Preload, first_chunks

pytestmark = pytest.mark.usefixtures("no_leftover_threads")

FILES, ROWS = 6, 2000


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload")
    for f in range(FILES):
        ids = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        write_parquet(d / f"part-{f}.parquet", pa.table({"row_id": ids, "x": ids * 0.5}), row_group_size=500)
    return d


def _open(source, cache, shuffle_window=2, **kw):
    return open_dataset(source, ["row_id", "x"], cache, batch_size=700, chunk_bytes=4096,
                        shuffle_window=shuffle_window, **kw)


def _settled(ds) -> None:
    """An epoch that ran to its end returned with its preload's loads done: nothing reads after it."""
    assert ds._epochs.ahead.pending is not None and all(f.done() for f in ds._epochs.ahead.pending._futures.values())


def test_first_chunks_are_the_first_window_and_prefetch_more():
    windows = [[Segment(5, 0, 9), Segment(2, 0, 9)], [Segment(7, 0, 9)], [Segment(1, 0, 4), Segment(1, 4, 9)]]
    assert first_chunks(windows, 0) == [5, 2]
    assert first_chunks(windows, 2) == [5, 2, 7, 1]
    assert first_chunks(windows, 9) == [5, 2, 7, 1, 1]
    assert first_chunks([], 2) == []
    # in file order a batch needs only the chunk it is cut from: the one cut first, the one taken after it, prefetch
    assert first_chunks(windows, 1, shuffled=False) == [5, 2, 7]
    assert first_chunks(windows, 0, shuffled=False) == [5, 2]


def test_each_load_is_taken_once_and_a_drop_cancels_those_not_started():
    release, calls = threading.Event(), []

    def load(c):
        calls.append(c)
        release.wait(10)
        return c * 10

    pre = Preload(load, [3, 1, 3, 4, 5], threads=1)
    assert len(pre) == 4  # the repeated 3 loaded once
    wait_until(lambda: calls == [3], 10)
    first = pre.take(3)
    assert pre.take(3) is None and pre.take(9) is None
    pre.drop()  # 1, 4, 5 not started: never loaded
    release.set()
    assert first.result(10) == 30
    time.sleep(0.05)
    assert calls == [3] and pre.take(1) is None


def _run(windows, sizes, load, **kw):
    perm = (lambda w, n: np.random.default_rng(w).permutation(n))
    return [b["x"].copy() for b in epoch_batches(windows, sizes, load, perm, lambda c: c, threads=2, prefetch=1,
                                                 stop=threading.Event(), **kw)]


def test_the_pipeline_takes_preloaded_chunks_and_reloads_one_that_failed():
    chunks = {i: {"x": np.arange(i * 10, i * 10 + 10)} for i in range(6)}
    windows = [[Segment(0, 0, 10), Segment(1, 0, 10)], [Segment(2, 0, 10), Segment(3, 0, 10)],
               [Segment(4, 0, 10), Segment(5, 0, 10)]]
    sizes = [7] * 8 + [4]
    calls, events = [], []

    def load(i):
        calls.append(i)
        return chunks[i]

    want = _run(windows, sizes, load)
    calls.clear()

    def preload_load(i):
        if i == 1:
            raise OSError("interrupted")  # as a load cut short by an iteration left early
        return chunks[i]

    pre = Preload(preload_load, [0, 1, 2], threads=2)
    got = _run(windows, sizes, lambda i: (events.append(("load", i)), load(i))[1], preloaded=pre,
               loaded=lambda: events.append(("loaded",)))
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert sorted(calls) == [1, 3, 4, 5]  # 0 and 2 taken as preloaded; 1 failed there, loaded again
    assert events[-1] == ("loaded",) and events.count(("loaded",)) == 1  # once, after the last load


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_in_file_order_the_next_epoch_loads_once_this_ones_last_loads_are_queued(prefetch):
    """Unshuffled, an epoch's last next() waited for the next epoch's first chunks, read only once its last chunk
    was in (0.1-0.3 s of each cached epoch of 3 s on the 2-core VM). Now they load while the last prefetch + 2
    pieces are cut: from the piece after which prefetch + 1 remain, at the first the producer takes once this
    epoch's last load is queued (the window thread queues it while taking the next piece: then, or one later)."""
    chunks = {i: {"x": np.arange(i * 10, i * 10 + 10)} for i in range(8)}
    windows = [[Segment(i, 0, 10), Segment(i + 1, 0, 10)] for i in range(0, 8, 2)]
    events, lock = [], threading.Lock()

    def load(i):
        with lock:
            events.append(("load", i))
        return chunks[i]

    out = []
    for b in epoch_batches(windows, [10] * 8, load, None, lambda c: c, threads=2, prefetch=prefetch,
                           stop=threading.Event(), loaded=lambda: events.append(("loaded", len(out)))):
        out.append(b["x"].copy())
    assert np.array_equal(np.concatenate(out), np.arange(80))  # the order is the plan's
    fired = [e for e in events if e[0] == "loaded"]
    first = max(0, 8 - 2 - prefetch)  # one batch a piece: the pieces cut before it
    assert len(fired) == 1 and fired[0][1] in (first, first + 1), fired
    assert sorted(e[1] for e in events if e[0] == "load") == list(range(8))  # each chunk loaded once


@pytest.mark.parametrize("shuffle", [False, "chunks", True])
def test_the_epochs_loads_and_the_preloads_run_num_threads_at_a_time(source, tmp_path, shuffle):
    """A review: with the preload begun while an epoch's last chunks still load, loads ran on the epoch's threads and
    the preload's at once, twice num_threads (decodes too, beyond the host bound's decode term). The reader now runs
    num_threads loads at once, whoever asks."""
    ds = _open(source, tmp_path / "c", shuffle=shuffle, num_threads=2, prefetch=2)
    row_ids(ds)  # built
    lock, now, most = threading.Lock(), [0], [0]
    real = ds.reader._load

    def counted(i):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.01)  # long enough for the preload's threads to overlap the epoch's last loads
            return real(i)
        finally:
            with lock:
                now[0] -= 1

    ds.reader._load = counted
    for _ in range(3):
        assert sorted(row_ids(ds).tolist()) == list(range(FILES * ROWS))
        _settled(ds)
    assert most[0] == 2  # both threads busy at times, never more
    ds.close()


def test_an_epoch_stopped_while_its_last_window_loads_preloads_nothing():
    chunks = {i: {"x": np.arange(i * 10, i * 10 + 10)} for i in range(4)}
    windows = [[Segment(0, 0, 10), Segment(1, 0, 10)], [Segment(2, 0, 10), Segment(3, 0, 10)]]
    called, stop, gate, waiting = [], threading.Event(), threading.Event(), threading.Event()

    def load(i):
        if i == 3:  # the last window's last chunk: held until the consumer has gone
            waiting.set()
            gate.wait(10)
        return chunks[i]

    perm = (lambda w, n: np.arange(n))
    it = epoch_batches(windows, [5] * 8, load, perm, lambda c: c, threads=2, prefetch=1, stop=stop,
                       loaded=lambda: called.append(1))
    next(it)
    wait_until(waiting.is_set, 10)
    stop.set()  # the consumer goes: the window thread finds it after its last load
    gate.set()
    list(it)  # the producer meets the abandoned window
    assert called == []


def test_chunks_the_preload_holds_are_not_fetched_ahead_again():
    chunks = {i: {"x": np.arange(i * 10, i * 10 + 10)} for i in range(6)}
    windows = [[Segment(i, 0, 10), Segment(i + 1, 0, 10)] for i in (0, 2, 4)]
    warmed = []
    pre = Preload(lambda i: chunks[i], first_chunks(windows, 2), threads=2)
    _run(windows, [6] * 10, lambda i: chunks[i], preloaded=pre, warm=lambda c: warmed.append(c) or True)
    assert warmed and not set(warmed) & {0, 1, 2, 3}  # a remote source's read-ahead: only the others


@pytest.mark.parametrize("shuffle", [True, "block", False, "chunks"])
def test_the_next_epoch_is_loaded_ahead_and_its_order_is_unchanged(source, tmp_path, shuffle):
    ds = _open(source, tmp_path / "c", shuffle=shuffle, seed=3, shuffle_window=3)
    ref = _open(source, tmp_path / "c", shuffle=shuffle, seed=3, prefetch=0, shuffle_window=3)
    loaded = record_loads(ds)
    first = row_ids(ds)  # epoch 0 (the cache is built)
    _settled(ds)
    ahead = first_chunks(ds.plan_epoch(1)[0], ds.options.prefetch, ds.options.shuffled)
    n = len(ds.reader.chunks)
    # shuffled, the first window (3 chunks) and prefetch (2) more; in file order, prefetch + 2
    assert len(ahead) == len(set(ahead)) == (4 if shuffle in (False, "chunks") else 3 + 2)
    # every chunk once for epoch 0, and epoch 1's first ones once more (in file order begun before epoch 0's last)
    assert Counter(loaded) == Counter(range(n)) + Counter(ahead)
    del loaded[:]
    second = row_ids(ds)  # epoch 1: follows epoch 0 without set_epoch
    ref.set_epoch(1)
    assert np.array_equal(second, row_ids(ref))
    assert np.array_equal(first, second) == (shuffle is False)
    after = first_chunks(ds.plan_epoch(2)[0], ds.options.prefetch, ds.options.shuffled)
    # what epoch 1 loaded itself (none of the preloaded ones again), then epoch 2's first chunks
    assert Counter(loaded) == Counter(i for i in range(n) if i not in ahead) + Counter(after)
    ds.close()
    assert ds._epochs.ahead.pending is None


def test_another_epoch_set_is_right_and_loads_what_the_guess_missed(source, tmp_path):
    ds = _open(source, tmp_path / "c", seed=1)
    row_ids(ds)
    _settled(ds)
    guessed = set(first_chunks(ds.plan_epoch(1)[0], ds.options.prefetch))
    loaded = record_loads(ds)
    ds.set_epoch(5)
    got = row_ids(ds)
    ref = _open(source, tmp_path / "c", seed=1, prefetch=0)
    ref.set_epoch(5)
    assert np.array_equal(got, row_ids(ref))
    n = len(ds.reader.chunks)
    own = loaded[:n - len(guessed)]  # before epoch 6's preload: every chunk not guessed, once
    assert sorted(own + sorted(guessed)) == list(range(n))
    ds.close()


def test_prefetch_0_loads_nothing_ahead_and_another_consumer_stream_drops_the_preload(source, tmp_path, monkeypatch):
    ds = _open(source, tmp_path / "c", prefetch=0)
    loaded = record_loads(ds)
    row_ids(ds)
    assert ds._epochs.ahead.pending is None and sorted(loaded) == list(range(len(ds.reader.chunks)))

    ds = _open(source, tmp_path / "c")
    row_ids(ds)
    _settled(ds)
    assert ds._epochs.ahead.pending is not None and len(ds._epochs.ahead.pending)
    monkeypatch.setattr(ds.reader.device, "consumer_stream", lambda: "another stream")  # the GPU path's guard
    loaded = record_loads(ds)
    row_ids(ds)
    n = len(ds.reader.chunks)
    assert sorted(loaded[:n]) == list(range(n))  # every chunk loaded again: the preload was not used
    ds.close()


def test_a_last_epoch_marked_so_loads_nothing_for_the_next(source, tmp_path):
    """``preload_next = False`` before a run's last epoch: every chunk loaded once, none ahead; the next
    iteration still gets its epoch, whole (the preload is a guess, never the order)."""
    ds = _open(source, tmp_path / "c")
    ds.preload_next = False
    loaded = record_loads(ds)
    first = row_ids(ds)
    assert ds._epochs.ahead.pending is None and sorted(loaded) == list(range(len(ds.reader.chunks)))
    ds.preload_next = True
    assert sorted(row_ids(ds)) == sorted(first)
    _settled(ds)  # loaded ahead again
    with pytest.raises(gpuload.ConfigError, match=r"preload_next='no' must be True or False"):
        ds.preload_next = "no"  # bool('no') is True
    assert ds.preload_next is True
    ds.close()


def test_an_iteration_left_early_keeps_no_preload(source, tmp_path, monkeypatch):
    import gpuload.preload

    made, real = [], gpuload.preload.next_epoch
    monkeypatch.setattr(gpuload.preload, "next_epoch", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    ds = _open(source, tmp_path / "c", shuffle=False)
    row_ids(ds)  # built
    n = len(ds)
    for i, _ in enumerate(ds):
        if i == n - 1:  # its last batch taken (the next epoch's preload begun), the iteration not ended
            break
    assert len(made) == 2 and ds._epochs.ahead.pending is None


def test_an_epoch_run_to_its_end_returns_with_the_next_ones_loads_done(source, tmp_path):
    ds = _open(source, tmp_path / "c")
    row_ids(ds)  # built; epoch 1's first chunks loaded meanwhile
    own = len(ds.reader.chunks) - len(ds._epochs.ahead.pending)  # what epoch 1 loads itself, before epoch 2's
    calls, load = [], ds.reader.load

    def slow_after_the_epoch(i):
        calls.append(i)
        if len(calls) > own:  # epoch 2's: slower than the rest of epoch 1
            time.sleep(0.3)
        return load(i)

    ds.reader.load = slow_after_the_epoch
    row_ids(ds)
    assert len(calls) == len(ds.reader.chunks)
    _settled(ds)
    ds.close()


def test_the_wait_for_the_next_epochs_loads_is_the_epochs_waiting(source, tmp_path, monkeypatch):
    """A helper's trial: with shuffle="chunks" the training thread waited in the epoch's last next() for the next
    epoch's first loads (half of a short cached epoch), a wait neither its wall time nor its waiting counted: the
    verdict said the step was the limit. That wait is now the last next()'s, in the epoch's stats (virtual clock:
    the loads take 5 s of it)."""
    import gpuload.preload as preload
    from conftest import ManualClock

    ds = _open(source, tmp_path / "c", shuffle="chunks")
    ds.metrics.clock = clock = ManualClock(100.0)
    list(ds)  # cached
    wait = preload.Preload.wait

    def slow(self):
        clock.sleep(5.0)
        wait(self)

    monkeypatch.setattr(preload.Preload, "wait", slow)
    ds.reset_stats()
    ds.set_epoch(1)
    assert sorted(row_ids(ds).tolist()) == list(range(ds.num_rows))
    st = ds.stats()
    assert st.wall_s >= 5.0 and st.wait_s >= 5.0 and st.starvation > 0.9, st


def test_a_drop_while_a_preload_is_being_started_drops_it_too(monkeypatch):
    """A review: close() on another thread between the preload's start and its being kept left it pending after the
    close (its loads held until a next iteration)."""
    import gpuload.preload as preload

    ahead, made = preload.Ahead(), []

    def next_epoch(*a, **k):
        ahead.drop()  # close() meanwhile
        made.append(Preload(lambda c: c, [1, 2], threads=1))
        return made[-1]

    monkeypatch.setattr(preload, "next_epoch", next_epoch)
    ahead.start()
    assert ahead.pending is None and len(made) == 1
    assert len(made[0]) == 0 and made[0].take(1) is None  # dropped: nothing left to take
    monkeypatch.setattr(preload, "next_epoch", lambda *a, **k: made.append(Preload(lambda c: c, [3], 1)) or made[-1])
    ahead.start()  # no drop meanwhile: kept
    assert ahead.pending is made[-1]
    ahead.drop()
