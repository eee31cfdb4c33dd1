"""Trace export: the Chrome trace-event format of what a Metrics keeps, across epochs too."""

from __future__ import annotations

import gzip
import json
import time

import numpy as np
import pytest

from gpuload.observe.metrics import Metrics
from gpuload.observe.trace import SPAN_FIELDS, TraceFile, TraceRecord, iter_events

from producers import run_producer_consumer


def check_trace(doc: dict) -> list[dict]:
    """Assert the trace-event format; return the events."""
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    last: dict = {}
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys()
        assert e["ph"] in ("X", "C", "M")
        if e["ph"] == "X":
            assert {"ts", "dur", "tid", "cat", "args"} <= e.keys()
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in named
        if e["ph"] in ("X", "C"):
            key = (e["pid"], e["tid"], e["ph"])
            assert e["ts"] >= last.get(key, 0.0), "timestamps go back on a track"
            last[key] = e["ts"]
    return events


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_trace_is_valid_trace_event_json(tmp_path, name):
    m = Metrics()
    run_producer_consumer(m, 12, 3.0, 1.0)
    m.record("cache_read", time.perf_counter() - 0.002, time.perf_counter(), nbytes=10)
    m.util_sample(time.perf_counter(), cpu_percent=80.0, system_cpu_percent=30.0)
    path = m.write_trace(tmp_path / name)
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
    events = check_trace(doc)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "MainThread (training)" in names and "test-producer" in names
    training = next(e["tid"] for e in events if e["name"] == "thread_name" and "training" in e["args"]["name"])
    on_training = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == training]
    assert on_training.count("wait") == 12 and on_training.count("step") == 12
    assert on_training.count("wait (end of pass)") == 1
    decode = [e for e in events if e["name"] == "decode"]
    assert len(decode) == 12 and decode[0]["args"] == {"bytes": 1000, "rows": 10} and decode[0]["cat"] == "gpuload"
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"queue depth", "CPU %"} <= counters
    assert doc["otherData"]["stats"]["batches"] == 12


def test_traces_of_several_epochs_share_one_timeline_and_stable_tracks():
    epochs = []
    for _ in range(2):  # an epoch: a fresh Metrics (or a reset one) and a new loader thread
        m = Metrics()
        run_producer_consumer(m, 5, 2.0, 1.0)
        epochs.append(m)
    origin = epochs[0].first_time()
    assert origin is not None and origin <= epochs[1].first_time() and Metrics().first_time() is None
    events = [e for m in epochs for e in m.trace_events(origin=origin)]
    check_trace({"traceEvents": events})
    names: dict = {}
    for e in events:
        if e["name"] == "thread_name":
            assert names.setdefault(e["tid"], e["args"]["name"]) == e["args"]["name"]  # one name per track
    training = [t for t, n in names.items() if "training" in n]
    assert len(training) == 1 and sum(n == "test-producer" for n in names.values()) >= 1
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0.0


def test_events_of_a_record_and_the_file_they_make(tmp_path):
    """iter_events reads nothing but its record: spans by start (outer first), waits and
    the steps between them on the training thread's track, counters, microseconds."""
    spans = {k: np.array(v) for k, v in zip(SPAN_FIELDS, ([1, 0], [7, 7], [10.0, 10.0], [10.5, 11.0],
                                                          [100, 200], [1, 2]))}
    rec = TraceRecord(("read", "decode"), spans, 2, ([(9, 10.0, 10.25, 4, 40, True), (9, 11.0, 11.0, 0, 0, False)], []),
                      ([(10.5, 3)], []), ([(10.75, 50.0, None, None, 2**20)], []), (0, 0, 0, 0),
                      {7: "loader", 9: "main"}, [9])
    events = list(iter_events(rec, origin=10.0))
    labels = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert labels == {"loader", "main (training)"}
    timed = [(e["name"], e["ts"], e.get("dur")) for e in events if e["ph"] in ("X", "C")]
    assert timed == [("read", 0.0, 1e6), ("decode", 0.0, 5e5), ("wait", 0.0, 2.5e5), ("step", 2.5e5, 7.5e5),
                     ("queue depth", 5e5, None), ("CPU %", 7.5e5, None), ("GPU memory MiB", 7.5e5, None),
                     ("wait (end of pass)", 1e6, 0.0)]
    with TraceFile(tmp_path / "t.json.gz", {"producer": "test"}) as out:
        out.add(events)
    doc = json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))
    assert doc["traceEvents"] == events and doc["otherData"] == {"producer": "test"}
