"""Metrics: starvation against its analytic value, exact sums, stage stats, bounded events.

Assertions on durations use a :class:`ManualClock` (``Metrics(clock=...)``), never the
machine's timing: a busy machine stretches real sleeps by any amount.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import types

import numpy as np
import pytest

import gpuload
from gpuload.observe.metrics import STAGES, Metrics
from gpuload.observe.stats import Stats

from conftest import ManualClock, gpuload_threads, wait_until
from producers import run_producer_consumer


def simulate_producer_consumer(m: Metrics, n: int, produce_ms: float, step_ms: float, depth: int = 4) -> None:
    """:func:`run_producer_consumer` in the virtual time of ``m.clock`` (a :class:`ManualClock`):
    the producer thread's spans and queue samples, and the consumer's waits, at the times a
    queue of ``depth`` items gives them."""
    p, c, clock = produce_ms / 1000, step_ms / 1000, m.clock
    put, take = [], []  # when item i entered the queue; when the consumer's next() returned it
    for i in range(n):
        made = (put[-1] if put else 0.0) + p
        put.append(max(made, take[i - depth]) if i >= depth else made)  # a full queue holds the producer up
        take.append(max(take[-1] + c if take else 0.0, put[i]))

    def produce():
        for i in range(n):
            clock.t = put[i - 1] if i else 0.0
            with m.span("decode", nbytes=1000, rows=10):
                clock.sleep(p)
            clock.t = put[i]
            m.queue_depth(sum(t > put[i] for t in take[:i + 1]))

    producer = threading.Thread(target=produce, name="test-producer")
    producer.start()
    producer.join()  # one thread at a time moves the clock
    for i in range(n):
        clock.t = take[i - 1] + c if i else 0.0
        t0 = clock()
        clock.t = take[i]
        m.consumer_wait(t0, clock(), rows=10, nbytes=1000)
    clock.t = take[-1] + c
    m.consumer_end(clock(), clock())


@pytest.mark.parametrize("produce_ms, step_ms", [(6.0, 2.0), (2.0, 6.0), (5.0, 3.0)])
def test_starvation_matches_analytic_value(produce_ms, step_ms):
    m = Metrics(clock=ManualClock())
    n, p, c = 60, produce_ms / 1000, step_ms / 1000
    simulate_producer_consumer(m, n, produce_ms, step_ms)
    s = m.stats()
    # the first next() waits p, each later one max(0, p - c); the pass ends one step after the last item
    wait, wall = p + (n - 1) * max(0.0, p - c), n * max(p, c) + min(p, c)
    assert s.wall_s == pytest.approx(wall, rel=1e-9) and s.wait_s == pytest.approx(wait, rel=1e-9)
    assert s.starvation == pytest.approx(wait / wall, rel=1e-9)
    # steady state: one item per max(p, c), of which the consumer waits max(0, p - c)
    assert s.starvation == pytest.approx(max(0.0, p - c) / max(p, c), abs=0.01)
    assert s.batches == 60 and s.rows == 600 and s.bytes == 60_000 and s.passes == 1
    assert s.step_mean_s == pytest.approx(c, rel=1e-9) and s.wait_max_s == pytest.approx(p, rel=1e-9)
    decode = s.stages["decode"]
    assert decode.seconds == pytest.approx(n * p, rel=1e-9) and decode.share == pytest.approx(n * p / wall)
    assert decode.threads == 1 and not decode.training_thread
    # a slow producer leaves the queue empty; a fast one fills it after the first item
    assert s.queue_samples == n and s.queue_empty == (1.0 if p > c else 1 / n)


def test_wall_wait_and_steps_are_exact_over_passes():
    m = Metrics()
    m.consumer_wait(0.0, 1.0, rows=5, nbytes=50)  # pass 1
    m.consumer_wait(3.0, 4.0, rows=5, nbytes=50)
    m.consumer_end(6.0, 6.5)
    m.consumer_wait(100.0, 102.0, rows=7, nbytes=70)  # pass 2: the 93.5 s between passes do not count
    m.consumer_end(103.0, 103.0)
    s = m.stats()
    assert s.wall_s == pytest.approx(6.5 + 3.0)
    assert s.wait_s == pytest.approx(1 + 1 + 0.5 + 2)
    assert s.starvation == pytest.approx(4.5 / 9.5)
    assert (s.batches, s.rows, s.bytes, s.passes) == (3, 17, 170, 2)
    assert s.step_mean_s == pytest.approx((2 + 2 + 1) / 3) and s.step_max_s == pytest.approx(2.0)
    assert s.wait_max_s == pytest.approx(2.0) and s.wait_mean_s == pytest.approx(4.5 / 5)
    assert m.timeline() == {"start": [0.0, 3.0, 100.0], "wait": [1.0, 1.0, 2.0], "step": [2.0, 2.0, 1.0]}


def test_open_pass_counts_up_to_the_last_delivered_batch():
    m = Metrics()
    m.consumer_wait(10.0, 11.0)
    m.consumer_wait(13.0, 14.0)
    s = m.stats()
    assert s.wall_s == pytest.approx(4.0) and s.starvation == pytest.approx(0.5) and s.passes == 1


def test_empty_metrics():
    s = Metrics().stats()
    assert (s.wall_s, s.starvation, s.batches, s.stages, s.queue_mean, s.cpu_percent) == (0.0, 0.0, 0, {}, None, None)
    assert "0.0%" in str(s)


def test_stage_stats_from_several_threads():
    m = Metrics()
    m.consumer_wait(0.0, 0.0)
    m.consumer_wait(9.0, 10.0)  # wall 10 s

    both = threading.Barrier(2)  # alive together: a finished thread's ident may be reused

    def work():
        m.record("cache_read", 1.0, 3.0, nbytes=4_000_000_000, rows=1000)
        both.wait()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.record("batch", 0.0, 0.5, rows=2000)
    s = m.stats()
    assert list(s.stages) == ["cache_read", "batch"]  # pipeline order, recorded stages only
    cr = s.stages["cache_read"]
    assert (cr.seconds, cr.calls, cr.nbytes, cr.rows, cr.threads) == (4.0, 2, 8_000_000_000, 2000, 2)
    assert cr.gbps == pytest.approx(2.0) and cr.rows_per_s == pytest.approx(500) and cr.share == pytest.approx(0.4)
    assert s.stages["batch"].threads == 1 and s.stages["batch"].gbps == 0.0
    assert s.stages["batch"].training_thread and not cr.training_thread  # recorded on the consumer's thread or not


def test_span_records_and_accepts_sizes_set_inside():
    assert Metrics().clock is time.perf_counter  # the default clock
    clock = ManualClock(100.0)
    m = Metrics(clock=clock)
    with m.span("read") as sp:
        clock.sleep(0.25)
        sp.nbytes, sp.rows = 123, 4
    with pytest.raises(RuntimeError):
        with m.span("read", nbytes=7):
            clock.sleep(1.0)
            raise RuntimeError("boom")  # never swallowed; failed work is not counted
    st = m.stats().stages["read"]
    assert (st.calls, st.nbytes, st.rows, st.seconds) == (1, 123, 4, 0.25)
    assert m.first_time() == 100.0 and m.trace_events()[-1]["dur"] == 250_000.0  # microseconds
    with pytest.raises(ValueError, match="unknown stage 'decoding'"):
        m.span("decoding")
    with pytest.raises(ValueError):
        m.record("nope", 0.0, 1.0)


def test_queue_and_util_summaries_and_reset():
    m = Metrics()
    for d in (0, 2, 4, 0):
        m.queue_depth(d)
    m.util_sample(1.0, cpu_percent=150.0, system_cpu_percent=60.0)
    m.util_sample(2.0, cpu_percent=50.0, system_cpu_percent=40.0, gpu_percent=30.0, gpu_memory_bytes=2**30)
    s = m.stats()
    assert (s.queue_mean, s.queue_min, s.queue_empty, s.queue_samples) == (1.5, 0, 0.5, 4)
    assert (s.cpu_percent, s.system_cpu_percent, s.gpu_percent) == (100.0, 50.0, 30.0)
    assert s.gpu_memory_bytes == 2**30 and s.util_samples == 2
    assert m.util_samples()["gpu_percent"] == [None, 30.0]
    m.reset()
    s = m.stats()
    assert s.queue_samples == 0 and s.util_samples == 0 and m.trace_events()[1:] == []


def test_max_events_caps_the_trace_not_the_stats():
    capped, full = Metrics(max_events=10), Metrics()
    for m in (capped, full):
        for i in range(100):
            m.record("decode", i, i + 0.5, rows=1)
            m.queue_depth(i % 3)
            m.util_sample(i, cpu_percent=i, gpu_memory_bytes=i)
            if i % 7 == 6:
                m.consumer_end(i, i + 0.25)
            else:
                m.consumer_wait(i, i + 0.5, rows=i)
        if m is capped:
            m.stats()  # folding part of the events early changes nothing
    # every figure but what ran during the waits (from the events kept, documented) is exact
    assert dataclasses.replace(capped.stats(), events_not_kept=0, during_waits=None) == \
        dataclasses.replace(full.stats(), during_waits=None)
    s = capped.stats()
    assert s.stages["decode"].calls == 100 and s.rows == sum(i for i in range(100) if i % 7 != 6)
    assert s.passes == 15 and s.queue_samples == 100 and s.util_samples == 100 and s.gpu_memory_bytes == 99
    assert s.events_not_kept == capped.events_not_kept == 4 * 90 and full.stats().events_not_kept == 0
    events = capped.trace_events(origin=0.0)
    decode = [e["ts"] / 1e6 for e in events if e["name"] == "decode"]
    assert decode == [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]  # how it started, and the latest
    gaps = [e for e in events if e["ph"] == "i"]
    assert len(gaps) == 4 and all(e["args"]["events_not_kept"] == 90 for e in gaps)
    assert [e["ts"] / 1e6 for e in gaps if "spans" in e["name"]] == [4.5]  # where the kept head ends
    # no step spans across the gap: the steps are those between kept waits of one stretch
    steps = [(e["ts"] / 1e6, e["dur"] / 1e6) for e in events if e["name"] == "step"]
    assert all(d == 0.5 for _, d in steps) and [t for t, _ in steps] == [0.5, 1.5, 2.5, 3.5, 95.5, 96.5, 98.5]
    assert capped.util_samples()["cpu_percent"] == [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]
    assert capped.util_samples()["gpu_percent"] == [None] * 10
    line = capped.timeline()
    assert line["start"] == [0, 1, 2, 3, 4, 95, 96, 98, 99] and math.isnan(line["step"][4]) and line["step"][5] == 0.5


def test_two_million_spans_stay_within_max_trace_nbytes_and_stats_stay_exact():
    """The events kept for the trace are bounded by max_events, in bytes too; the sums are
    exact however many were dropped."""
    clock = ManualClock()
    m = Metrics(clock=clock, max_events=100_000, nvtx=False)
    n = 2_000_000
    for i in range(n):
        m.record("cache_read", i * 1e-3, i * 1e-3 + 2.5e-4, nbytes=3, rows=1)
    bound = m.max_trace_nbytes()
    assert m.trace_nbytes <= bound < 100_000 * (41 + 41 + 12 + 40) + 4 * 4096 * 280
    assert len(m._spans) <= 100_000 and m.events_not_kept == n - len(m._spans) > 1_800_000
    cr = m.stats().stages["cache_read"]
    assert (cr.calls, cr.nbytes, cr.rows) == (n, 3 * n, n) and cr.seconds == pytest.approx(500.0, rel=1e-9)
    assert Metrics().max_trace_nbytes() < 100e6  # the default: the documented bound


def test_recording_is_cheap():
    m = Metrics()
    n = 20_000
    t0 = time.thread_time()  # this thread's CPU time: waiting for a busy machine's CPUs does not count
    for _ in range(n):
        with m.span("batch", nbytes=1, rows=1):
            pass
        m.record("h2d", 0.0, 0.0)
    per_pair = (time.thread_time() - t0) / n
    assert per_pair < 20e-6, f"{per_pair * 1e6:.1f} us per span + record"  # about 2 us here


def test_stats_text_and_html_show_starvation():
    m = Metrics()
    run_producer_consumer(m, 10, 3.0, 1.0)
    m.util_sample(time.perf_counter(), cpu_percent=42.0)
    s = m.stats()
    figure = f"{s.starvation:.1%}"
    for text in (str(s), repr(s), s._repr_html_()):
        assert figure in text and "decode" in text
    assert s._repr_html_().startswith("<table>") and "process CPU 42%" in str(s)
    assert isinstance(s, Stats) and json.loads(json.dumps(s.to_dict()))["stages"]["decode"]["calls"] == 10


def test_no_nvtx_on_cpu_only_machines(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert Metrics()._nvtx is None and Metrics(nvtx=False)._nvtx is None


def test_nvtx_ranges_through_the_nvtx_package(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch.cuda.nvtx is used where torch sees a GPU")
    calls = []
    fake = types.SimpleNamespace(push_range=lambda message: calls.append(("push", message)),
                                 pop_range=lambda: calls.append(("pop",)))
    monkeypatch.setitem(__import__("sys").modules, "nvtx", fake)
    m = Metrics(nvtx=True)
    with m.span("decode"):
        pass
    assert calls == [("push", "gpuload:decode"), ("pop",)]
    assert STAGES[-1] == "write_wait" and m.stats().stages["decode"].calls == 1


def _record_batches(m: Metrics, clock: ManualClock, n: int, util_every: int = 100, end: bool = True) -> None:
    """``n`` batches of a training loop in virtual time: per batch a cache read on a loader
    thread's span, a ``next()`` that waits 1 ms, a queue sample and a 2 ms step; a utilisation
    sample every ``util_every`` batches; ``end``: the pass ends after them."""
    for i in range(n):
        t = clock.t
        m.record("batch", t, t + 0.0005, nbytes=4096, rows=64)
        m.consumer_wait(t, t + 0.001, rows=64, nbytes=4096)
        m.queue_depth(i % 3)
        if i % util_every == 0:
            m.util_sample(t, cpu_percent=100.0, system_cpu_percent=50.0)
        clock.t = t + 0.003
    if end:
        m.consumer_end(clock.t, clock.t)


def test_many_times_max_events_batches_keep_the_trace_under_its_documented_bound():
    """Ten times ``max_events`` batches (four events and more each) hold no more than
    :meth:`Metrics.max_trace_nbytes`, measured by tracemalloc (everything allocated with
    gpuload.observe's code on the stack and kept, once no loader thread of another test is left);
    once every ring is full, the second half of the batches adds nothing (so even a byte
    leaked per batch fails); the stats stay exact. The default bound is under 100 MB.
    (tracemalloc slows every allocation about 15x: the rings are made small.)"""
    import gc
    import tracemalloc

    from gpuload.observe.events import BLOCK

    assert Metrics(nvtx=False).max_trace_nbytes() < 100e6
    # at both measurements every kind has a whole number of blocks (none waits unpacked): a multiple
    # of BLOCK spans, waits and queue samples, and of BLOCK utilisation samples (one per 4 batches);
    # the queue depths cycle over 3, so the halves' means are equal
    half = 3 * 4 * BLOCK * 4

    snaps = []

    def metrics_bytes() -> int:  # what gpuload.observe's code allocated (at any depth) and still holds
        gc.collect()  # not the cycles stats() left for the collector (counted, or not, as gc last ran)
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*gpuload/observe/*",
                                                                             all_frames=True)])
        snaps.append(snap)
        return sum(t.size for t in snap.traces)

    # another test's loader threads, ending in this process, would record into their own Metrics meanwhile
    # (idle pools that outlive their tests, the cache writers' and a remote source's fetchers, record nothing)
    wait_until(lambda: not [n for n in gpuload_threads(include_writer=False) if not n.startswith("gpuload-fetch")],
               timeout=30, what="other tests' loader threads to end")
    # a pending write of another test's cache writer may still record a span into its own Metrics: the
    # growth is measured up to 3 times and the least counts (a byte leaked per batch shows in every try)
    for _ in range(3):
        clock = ManualClock()
        m = Metrics(clock=clock, nvtx=False, max_events=10_000)
        tracemalloc.start(3)
        try:
            _record_batches(m, clock, half, util_every=4, end=False)
            m.stats()
            first = metrics_bytes()
            _record_batches(m, clock, half, util_every=4)
            m.stats()
            held = metrics_bytes()
        finally:
            tracemalloc.stop()
        if held - first < 4096:
            break
    n = 2 * half
    assert held < m.max_trace_nbytes(), f"{held:,} bytes held for the trace of {n:,} batches"
    if held - first >= 4096:  # where the growth was allocated, and which threads were alive: what to look for
        grew = [str(d) for d in snaps[-1].compare_to(snaps[-2], "traceback")[:3]]
        pytest.fail(f"{held - first:,} bytes more after {half:,} more batches; grown at: {grew}; threads: "
                    f"{[t.name for t in threading.enumerate()]}")
    assert m.events_not_kept > 0 and half // 4 > m.max_events  # every ring full, the utilisation samples' too
    s = m.stats()
    assert (s.batches, s.rows, s.bytes, s.passes) == (n, 64 * n, 4096 * n, 1)
    assert s.stages["batch"].calls == n and s.queue_samples == n and s.util_samples == n // 4
    assert s.wait_s == pytest.approx(0.001 * n, rel=1e-9) and s.wall_s == pytest.approx(0.003 * n, rel=1e-9)
    assert s.queue_mean == pytest.approx(1.0, abs=1e-5) and s.step_mean_s == pytest.approx(0.002, rel=1e-6)


def test_a_stage_that_counts_no_rows_shows_no_row_rate():
    """A user's trial read "read ... rows/s 0" (the Parquet reads count bytes, not rows): "-" instead."""
    m = Metrics()
    m.consumer_wait(0.0, 1.0)
    m.record("read", 0.0, 0.5, nbytes=10**9)
    m.record("decode", 0.0, 0.5, nbytes=10**9, rows=1000)
    rows = {r[0]: r for r in m.stats()._stage_rows()}
    assert rows["read"][4:6] == ("2.00", "-") and rows["decode"][4:6] == ("2.00", "2,000")


def test_listing_at_open_shows_no_share_of_the_passes_wall_time():
    """A new user's trial read "list ... 104.4%" (an S3 listing longer than the epoch that followed)."""
    m = Metrics()
    m.record("list", 0.0, 2.0)  # the dataset's opening, before any pass
    m.consumer_wait(2.0, 3.0)
    m.record("decode", 2.0, 2.5, rows=10)
    rows = {r[0]: r for r in m.stats()._stage_rows()}
    assert rows["list"][6] == "at open" and rows["decode"][6].endswith("%")
    assert "at open" in str(m.stats())


def test_spans_from_native_threads_leave_no_dummy_thread_behind():
    """An interactive trial saw Dummy-N threads in threading.enumerate() for a whole session: spans recorded on
    pyarrow's I/O threads made threading register each. They are named "native" now, and nothing is registered."""
    import _thread
    import threading

    from gpuload import Metrics

    m = Metrics()
    done = threading.Event()
    # a thread the threading module did not start, as pyarrow's are
    _thread.start_new_thread(lambda: (m.record("read", 0.0, 1.0), done.set()), ())
    assert done.wait(10)
    assert not [x for x in threading.enumerate() if x.name.startswith("Dummy")]
    assert set(m._names.values()) == {"native"}


def test_a_span_begun_before_a_reset_counts_from_the_reset():
    """An interactive trial: after reset_stats() mid-epoch, cache_write showed 240% of the wall on one thread (its
    spans begun before the reset counted whole)."""
    from conftest import ManualClock
    from gpuload import Metrics

    clock = ManualClock(100.0)
    m = Metrics(clock=clock)
    t0 = clock()
    clock.sleep(10.0)
    m.reset()  # at 110
    clock.sleep(2.0)
    m.record("cache_write", t0, clock())  # 100 to 112: 2 s of it after the reset
    m.consumer_wait(110.0, 112.0, rows=1)
    assert m.stats().stages["cache_write"].seconds == pytest.approx(2.0)


def test_a_max_events_that_is_not_a_count_is_refused_where_it_is_given():
    """It was taken as given (-5 kept nothing, silently; 2.5 was cut to 2)."""
    for bad, what in ((-5, r"max_events=-5 must be an integer >= 0"), (2.5, r"max_events=2.5 must be an integer"),
                      ("10", r"max_events='10' must be an integer")):
        with pytest.raises(gpuload.ConfigError, match=what):
            Metrics(max_events=bad)
    assert Metrics(max_events=0).max_events == 0 and type(Metrics(max_events=np.int64(7)).max_events) is int
