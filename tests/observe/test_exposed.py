"""Exposed wait: the stages running while the training thread waited, against an analytic
model on a virtual clock and against a brute-force sweep over random intervals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpuload
from gpuload.observe.exposed import exposed, merge

from conftest import ManualClock


def test_the_overlap_of_each_stage_and_the_idle_waiting_are_exact():
    m = gpuload.Metrics(clock=ManualClock(), nvtx=False)
    m.record("decode", 0.0, 5.0)      # a loader thread decodes 0-5
    m.record("decode", 2.0, 2.5)      # a second thread, briefly
    m.record("batch", 5.0, 5.5)       # the producer gathers 5-5.5
    m.consumer_wait(1.0, 3.0, rows=10)  # the training thread waits 1-3 and 4-6
    m.consumer_wait(4.0, 6.0, rows=10)
    m.consumer_end(7.0, 7.0)
    st_ = m.stats()
    assert st_.wait_s == 4.0
    assert st_.during_waits == {"decode": 3.5, "batch": 0.5, "idle": 0.5}  # 2 + 1 + 0.5 decoding; 5.5-6 nothing
    assert "during waits" in str(st_) and "nothing running for 0.500 s" in str(st_)
    d = gpuload.diagnose(st_)
    assert "during those waits" in d.message and "decode 3.500 s" in d.message


def test_no_waits_no_figures():
    m = gpuload.Metrics(clock=ManualClock(), nvtx=False)
    m.record("decode", 0.0, 1.0)
    assert m.stats().during_waits is None


def _brute(waits, spans, n, dt=1e-3):
    grid = np.arange(0, 20, dt) + dt / 2
    waiting = np.zeros(len(grid), bool)
    for a, b in waits:
        waiting |= (grid >= a) & (grid < b)
    per, running = np.zeros(n), np.zeros(len(grid), bool)
    for s, a, b in spans:
        on = (grid >= a) & (grid < b)
        per[s] += (on & waiting).sum() * dt
        running |= on
    return per, (waiting & ~running).sum() * dt


interval = st.tuples(st.integers(0, 180), st.integers(1, 20)).map(lambda t: (t[0] / 10, (t[0] + t[1]) / 10))


@settings(max_examples=60, deadline=None)
@given(st.lists(interval, max_size=6), st.lists(st.tuples(st.integers(0, 2), interval), max_size=8))
def test_against_a_brute_force_sweep(waits, spans):
    w = np.array(waits).reshape(-1, 2)
    sp = np.array([(s, a, b) for s, (a, b) in spans]).reshape(-1, 3)
    per, idle = exposed(w[:, 0], w[:, 1], sp[:, 0].astype(int), sp[:, 1], sp[:, 2], 3)
    want_per, want_idle = _brute(waits, [(s, a, b) for s, (a, b) in spans], 3)
    assert per == pytest.approx(want_per, abs=0.01) and idle == pytest.approx(want_idle, abs=0.01)


def test_merge_joins_overlapping_and_touching_intervals():
    a, b = merge(np.array([5.0, 0.0, 1.0, 8.0]), np.array([6.0, 2.0, 3.0, 9.0]))
    assert a.tolist() == [0.0, 5.0, 8.0] and b.tolist() == [3.0, 6.0, 9.0]


def test_nothing_is_said_when_the_spans_cannot_all_be_known():
    m = gpuload.Metrics(clock=ManualClock(), nvtx=False, max_events=40)
    for i in range(100):  # spans and waits past what is kept: figures from them would be wrong
        m.record("decode", float(i), i + 1.0)
        m.consumer_wait(i + 0.5, i + 0.9, rows=1)
    assert m.stats().events_not_kept > 0 and m.stats().during_waits is None
    watched = gpuload.Metrics(clock=ManualClock(), nvtx=False)  # a watched loader: waits, no spans
    watched.consumer_wait(0.0, 1.0, rows=1)
    assert watched.stats().during_waits is None
