"""Trace export: the events a :class:`gpuload.Metrics` keeps, as Chrome trace-event JSON.

:meth:`gpuload.Metrics.trace_events` copies what it keeps into a :class:`TraceRecord`
under its lock; :func:`iter_events` turns a record into trace events (``ph`` X, C, M,
and an instant ``i`` where events were not kept) one at a time, sorted by time, and
:class:`TraceFile` writes them to a file event by event, for https://ui.perfetto.dev
or ``chrome://tracing``. Timestamps and durations are in microseconds since an
``origin`` (a time of the Metrics' clock, in seconds).

Each thread gets a small track id (:func:`_track`) that is the same in every trace of
this process, so the events of several epochs (several Metrics) given one ``origin``
concatenate into one trace.
"""

from __future__ import annotations

import gzip
import heapq
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

__all__ = ["TraceRecord", "TraceFile", "iter_events", "SPAN_FIELDS"]

#: The kinds of events a Metrics keeps, in the order of :attr:`TraceRecord.dropped`.
_KINDS = ("spans", "waits", "queue samples", "utilisation samples")
#: Span fields, in the order of the tuples a Metrics records.
SPAN_FIELDS = ("stage", "tid", "t0", "t1", "nbytes", "rows")


@dataclass(frozen=True)
class TraceRecord:
    """The events a :class:`gpuload.Metrics` keeps for its trace, copied under its lock.

    Attributes
    ----------
    stages : stage names by index (:data:`gpuload.observe.metrics.STAGES`).
    spans : one array per field of :data:`SPAN_FIELDS` (stage index, thread ident, start
        and end in clock seconds, bytes, rows), one element per span kept, in the order recorded.
    span_head : spans kept for good (the first ones, before the gap when some were not kept).
    waits : ``(before the gap, after it)``, lists of ``(thread ident, t0, t1, rows, bytes,
        delivered a batch)`` per ``next()`` of a training thread (times in clock seconds).
    depths : ``(before the gap, after it)``, lists of ``(t, ready batches)`` queue samples.
    utils : ``(before the gap, after it)``, lists of ``(t, process CPU %, machine CPU %,
        GPU %, GPU memory bytes)`` utilisation samples (None: not measured).
    dropped : events not kept, per kind (spans, waits, queue samples, utilisation samples).
    names : thread ident -> thread name.
    consumers : idents of the training threads, in the order they first called ``next()``.
    """

    stages: tuple[str, ...]
    spans: dict[str, np.ndarray]
    span_head: int
    waits: tuple[list[tuple], list[tuple]]
    depths: tuple[list[tuple], list[tuple]]
    utils: tuple[list[tuple], list[tuple]]
    dropped: tuple[int, int, int, int]
    names: dict[int, str]
    consumers: list[int]


def iter_events(rec: TraceRecord, origin: float) -> Iterator[dict]:
    """The trace events of ``rec``, one at a time, sorted by time (outer spans first):
    process and thread names, stage spans, each training thread's waits and the steps
    between them, queue-depth and utilisation counters, and an instant event where the
    events kept for good end when later ones were not kept. ``origin``: the clock time
    (seconds) that becomes 0 microseconds."""
    pid = os.getpid()

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    consumers, names, dropped = rec.consumers, rec.names, rec.dropped
    span_tids = [int(t) for t in dict.fromkeys(rec.spans["tid"].tolist())]
    order = consumers + [t for t in span_tids if t not in consumers]
    small = {tid: _track(tid, names.get(tid, str(tid))) for tid in order}
    yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "gpuload"}}
    for tid in order:
        label = names.get(tid, str(tid)) + (" (training)" if tid in consumers else "")
        yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": small[tid], "args": {"name": label}}
        yield {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": small[tid],
               "args": {"sort_index": 0 if tid in consumers else small[tid]}}

    def span(name, cat, tid, t0, t1, args) -> dict:
        a, b = us(t0), us(t1)
        return {"name": name, "cat": cat, "ph": "X", "ts": a, "dur": max(0.0, round(b - a, 3)), "pid": pid,
                "tid": small[tid], "args": args}

    def gap(kind: int, t: float | None) -> Iterator[dict]:
        """Where the events kept for good end, when later ones were not kept."""
        if dropped[kind] and t is not None:
            yield {"name": f"{dropped[kind]:,} {_KINDS[kind]} not kept (Metrics max_events)", "ph": "i",
                   "s": "g", "ts": us(t), "pid": pid, "tid": 0, "args": {"events_not_kept": dropped[kind]}}

    def span_events() -> Iterator[dict]:  # by start time, outer spans first
        spans = rec.spans
        by_start = np.lexsort((spans["t0"] - spans["t1"], spans["t0"]))
        cols = [spans[k][by_start].tolist() for k in SPAN_FIELDS]
        for s, tid, t0, t1, nb, r in zip(*cols):
            yield span(rec.stages[s], "gpuload", tid, t0, t1, {"bytes": nb, "rows": r})

    def wait_events(consumer: int) -> Iterator[dict]:  # one training thread's waits and steps, in order
        for part in rec.waits:
            last = None  # no step across the events not kept
            for tid, t0, t1, rows, nb, batch in part:
                if tid != consumer:
                    continue
                if last is not None and last[5]:
                    yield span("step", "consumer", tid, last[2], t0, {})
                yield span("wait" if batch else "wait (end of pass)", "consumer", tid, t0, t1,
                           {"bytes": nb, "rows": rows})
                last = (tid, t0, t1, rows, nb, batch)

    def counter_events() -> Iterator[dict]:
        for dpart, upart in zip(rec.depths, rec.utils):
            yield from heapq.merge(
                ({"name": "queue depth", "ph": "C", "ts": us(t), "pid": pid, "tid": 0, "args": {"batches": d}}
                 for t, d in sorted(dpart)),
                (e for u in sorted(upart, key=lambda u: u[0]) for e in _util_events(u, us(u[0]), pid)),
                key=lambda e: e["ts"])

    ends = (float(rec.spans["t1"][rec.span_head - 1]) if rec.span_head else None,
            *(part[0][-1][i] if part[0] else None for part, i in ((rec.waits, 2), (rec.depths, 0), (rec.utils, 0))))
    gaps = sorted((e for kind, t in enumerate(ends) for e in gap(kind, t)), key=lambda e: e["ts"])
    yield from heapq.merge(span_events(), counter_events(), gaps, *(wait_events(c) for c in consumers),
                           key=lambda e: (e["ts"], -e.get("dur", 0.0)))


def _util_events(u: tuple, ts: float, pid: int) -> Iterator[dict]:
    """Counter events (CPU %, GPU %, GPU memory MiB) of one utilisation sample ``u`` at ``ts``
    microseconds; a counter none of whose values was measured is left out."""
    t, cpu, scpu, gpu, gmem = u
    for name, args in (("CPU %", {"process": cpu, "system": scpu}), ("GPU %", {"gpu": gpu}),
                       ("GPU memory MiB", {"used": None if gmem is None else round(gmem / 2**20, 1)})):
        args = {k: v for k, v in args.items() if v is not None}
        if args:
            yield {"name": name, "ph": "C", "ts": ts, "pid": pid, "tid": 0, "args": args}


class TraceFile:
    """A Chrome trace-event JSON file written event by event (gzip-compressed for ``.gz``).

    ``with TraceFile(path, other_data) as t: t.add(events); t.add(more)``: the events of
    every :meth:`add`, then ``otherData`` (a JSON-serialisable dict, default empty),
    written as they come. A block that raises leaves the file unfinished (not valid JSON).
    """

    def __init__(self, path, other_data: dict | None = None):
        self.path = Path(os.fspath(path))
        self.other_data = dict(other_data or {})
        self._file = None
        self._first = True

    def __enter__(self) -> TraceFile:
        raw = open(self.path, "wb")
        self._file = gzip.GzipFile(fileobj=raw, mode="wb") if self.path.suffix == ".gz" else raw
        self._raw = raw
        self._file.write(b'{"traceEvents":[')
        return self

    def add(self, events) -> None:
        """Write ``events`` (an iterable of trace-event dicts), 4,096 at a time."""
        dumps: Callable[[dict], str] = json.JSONEncoder(separators=(",", ":")).encode
        batch: list[str] = []
        for e in events:
            batch.append(dumps(e))
            if len(batch) >= 4096:
                self._write(batch)
                batch = []
        self._write(batch)

    def _write(self, parts: list[str]) -> None:
        if parts:
            self._file.write(((b"" if self._first else b",") + ",".join(parts).encode()))
            self._first = False

    def __exit__(self, kind, *exc) -> None:
        try:
            if kind is None:
                tail = json.dumps({"displayTimeUnit": "ms", "otherData": self.other_data}, separators=(",", ":"))
                self._file.write(b"]," + tail[1:].encode())
        finally:
            if self._file is not self._raw:
                self._file.close()
            self._raw.close()


_TRACKS: dict[tuple[int, str], int] = {}  # (thread ident, name) -> trace tid, for this process
_TRACKS_LOCK = threading.Lock()


def _track(ident: int, name: str) -> int:
    """A small trace tid for a thread, the same in every trace of this process (a reused
    ident with another thread name gets its own)."""
    with _TRACKS_LOCK:
        return _TRACKS.setdefault((ident, name), len(_TRACKS) + 1)
