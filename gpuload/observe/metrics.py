"""Metrics: how long each pipeline stage and the training thread took, and when.

A :class:`Metrics` records, from any thread (in seconds of its ``clock``): stage
spans (:data:`STAGES`), each ``next()`` of the training thread, ready-queue depth, and
CPU/GPU utilisation samples (:class:`gpuload.observe.sampling.UtilSampler`), as running sums
under one lock plus a tuple per event for the trace. :meth:`Metrics.stats` summarises
them; :meth:`Metrics.write_trace` writes Chrome trace-event JSON for Perfetto.

Starvation is the fraction of wall time the training thread spent inside ``next()``.
Wall time is measured per *pass* (one iteration over the loader): from the start of
its first ``next()`` call to the end of its last one (the call that raised
``StopIteration``, or the last delivered batch while a pass is still open), summed over
passes. Time between passes (evaluation, checkpoints) is not counted.

Where torch sees a CUDA device, spans also push NVTX ranges ``gpuload:<stage>`` (see
:class:`Metrics`); CPU-only machines do no NVTX work.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from itertools import chain
from pathlib import Path
from threading import get_ident
from time import perf_counter
from typing import Callable

import torch

from .stats import StageStats, Stats

__all__ = ["STAGES", "Metrics"]

#: Pipeline stages a span can name, in pipeline order.
STAGES = ("list", "read", "decode", "convert", "cache_write", "cache_read", "h2d", "batch")
_INDEX = {s: i for i, s in enumerate(STAGES)}
_NVTX_NAMES = tuple(f"gpuload:{s}" for s in STAGES)


def _nvtx_backend(enabled: bool | None):
    """(push, pop) callables for NVTX ranges, or None when NVTX is off or unavailable."""
    off = os.environ.get("GPULOAD_NVTX", "").strip().lower() in ("0", "false", "no", "off")
    if enabled is False or (enabled is None and off):
        return None
    try:
        if torch.cuda.is_available():
            return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    except Exception:  # a broken CUDA install must not break loading
        pass
    if enabled:
        try:
            import nvtx
        except ImportError:
            return None
        return nvtx.push_range, nvtx.pop_range
    return None


class _Span:
    """Context manager of :meth:`Metrics.span`; ``nbytes`` and ``rows`` may be set inside."""

    __slots__ = ("_metrics", "_stage", "_t0", "nbytes", "rows")

    def __init__(self, metrics: Metrics, stage: int, nbytes: int, rows: int):
        self._metrics, self._stage, self.nbytes, self.rows = metrics, stage, nbytes, rows

    def __enter__(self) -> _Span:
        if self._metrics._nvtx is not None:
            self._metrics._nvtx[0](_NVTX_NAMES[self._stage])
        self._t0 = self._metrics.clock()
        return self

    def __exit__(self, kind, *exc) -> None:
        t1 = self._metrics.clock()
        if self._metrics._nvtx is not None:
            self._metrics._nvtx[1]()
        if kind is None:  # work that failed (a missing cache file, a corrupt chunk) is not counted
            self._metrics._add(self._stage, self._t0, t1, self.nbytes, self.rows)


class Metrics:
    """Thread-safe recorder of stage spans, consumer waits, queue depth and utilisation.

    Parameters
    ----------
    nvtx : None (default: NVTX ranges when torch sees a CUDA device, unless
        ``$GPULOAD_NVTX=0``), True (also through the ``nvtx`` package), False (never).
    max_events : events of each kind kept for the trace (default 1,000,000, about 100 MB at
        most); later ones still count in :meth:`stats`.
    clock : returns the time in seconds, as a float (default ``time.perf_counter``; kept as
        ``.clock``). Spans, queue samples, :func:`gpuload.watch` and :class:`~gpuload.observe.sampling.UtilSampler`
        read it; timestamps given to :meth:`record` and the others must come from it. Only
        differences count: a test can pass a manual clock to get exact figures.

    One training thread consumes per Metrics; :meth:`consumer_end` closes each of its passes.
    """

    def __init__(self, *, nvtx: bool | None = None, max_events: int = 1_000_000,
                 clock: Callable[[], float] = perf_counter):
        self._nvtx, self.clock = _nvtx_backend(nvtx), clock
        self.max_events, self._lock = int(max_events), threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far (settings are kept)."""
        with self._lock:
            # events: spans (stage, tid, t0, t1, nbytes, rows), waits (tid, t0, t1, rows, nbytes, delivered
            # a batch), depths (t, depth), utils (t, cpu %, system cpu %, gpu %, gpu memory bytes)
            self._spans, self._waits, self._depths, self._utils = [], [], [], []
            self._folded = [0, 0, 0, 0]  # events of each list already added to the sums below
            self._names, self._consumers, self._dropped = {}, [], 0  # {ident: thread name}, consumer idents
            self._stage = [[0.0, 0, 0, 0, set()] for _ in STAGES]  # seconds, calls, nbytes, rows, threads
            self._c = dict(batches=0, rows=0, bytes=0, wait=0.0, wait_max=0.0, waits=0, step=0.0, steps=0,
                           step_max=0.0, wall=0.0, passes=0)
            self._pass_start = self._last_end = None  # open pass: start, end of its last batch's next()
            self._q = [0, 0, None, 0]  # depth sum, samples, min, zeros
            self._u = [[0.0, 0] for _ in range(3)]  # cpu, system cpu, gpu: (sum, samples)
            self._u_n, self._u_mem = 0, None  # samples, most gpu memory

    # -- recording: under the lock, append a tuple; sums are folded in by stats() ------------
    def span(self, stage: str, *, nbytes: int = 0, rows: int = 0) -> _Span:
        """Context manager timing one ``stage`` span on the calling thread (ValueError for a stage
        not in :data:`STAGES`). ``nbytes`` and ``rows`` (what the span processed) may also be set
        inside the block: ``with m.span("read") as s: ...; s.nbytes = n``."""
        return _Span(self, _INDEX[stage] if stage in _INDEX else _stage_index(stage), nbytes, rows)

    def record(self, stage: str, t0: float, t1: float, *, nbytes: int = 0, rows: int = 0) -> None:
        """Record a ``stage`` span from :attr:`clock` timestamps ``t0 <= t1`` (seconds)."""
        self._add(_INDEX[stage] if stage in _INDEX else _stage_index(stage), t0, t1, nbytes, rows)

    def _add(self, stage: int, t0: float, t1: float, nbytes: int, rows: int) -> None:
        tid = get_ident()
        with self._lock:
            self._push(0, (stage, tid, t0, t1, nbytes, rows))
            if tid not in self._names:
                self._names[tid] = threading.current_thread().name

    def _push(self, kind: int, event: tuple) -> None:
        events = (self._spans, self._waits, self._depths, self._utils)[kind]
        if len(events) < self.max_events:
            return events.append(event)
        self._dropped += 1  # not kept for the trace; in the sums, in order (the pass logic needs it)
        self._fold()
        self._folders[kind](self, (event,))

    def queue_depth(self, depth: int) -> None:
        """Sample the number of ready batches waiting in the queue, now."""
        t = self.clock()
        with self._lock:
            self._push(2, (t, depth))

    def consumer_wait(self, t0: float, t1: float, *, rows: int = 0, nbytes: int = 0) -> None:
        """One ``next()`` on the training thread from ``t0`` to ``t1`` (:attr:`clock` seconds)
        that delivered a batch of ``rows`` rows and ``nbytes`` bytes at ``t1``."""
        self._consumer((get_ident(), t0, t1, rows, nbytes, True))

    def consumer_end(self, t0: float, t1: float) -> None:
        """The ``next()`` that ended a pass (raised ``StopIteration``, or the loop was left:
        then ``t0 == t1`` = the time it was left). Counts as waiting; delivers nothing."""
        self._consumer((get_ident(), t0, t1, 0, 0, False))

    def _consumer(self, event: tuple) -> None:
        tid = event[0]
        with self._lock:
            self._push(1, event)
            if tid not in self._names:
                self._names[tid] = threading.current_thread().name
            if tid not in self._consumers:
                self._consumers.append(tid)

    def util_sample(self, t: float, *, cpu_percent: float | None = None, system_cpu_percent: float | None = None,
                    gpu_percent: float | None = None, gpu_memory_bytes: int | None = None) -> None:
        """One utilisation sample at :attr:`clock` time ``t``: this process's CPU (percent of one
        core), the machine's CPU (0-100), GPU use (0-100), GPU memory used (bytes); None: not measured."""
        with self._lock:
            self._push(3, (t, cpu_percent, system_cpu_percent, gpu_percent, gpu_memory_bytes))

    # -- folding events into sums (under the lock) -------------------------------------------
    def _fold_spans(self, events) -> None:
        for stage, tid, t0, t1, nbytes, rows in events:
            agg = self._stage[stage]
            agg[0], agg[1], agg[2], agg[3] = agg[0] + t1 - t0, agg[1] + 1, agg[2] + nbytes, agg[3] + rows
            agg[4].add(tid)

    def _fold_waits(self, events) -> None:
        c = self._c
        for _, t0, t1, rows, nbytes, batch in events:
            if self._pass_start is None:
                self._pass_start = t0
                c["passes"] += 1
            elif self._last_end is not None:
                step = t0 - self._last_end
                c["step"], c["steps"], c["step_max"] = c["step"] + step, c["steps"] + 1, max(c["step_max"], step)
            wait = t1 - t0
            c["wait"], c["waits"], c["wait_max"] = c["wait"] + wait, c["waits"] + 1, max(c["wait_max"], wait)
            if batch:
                c["batches"], c["rows"], c["bytes"] = c["batches"] + 1, c["rows"] + rows, c["bytes"] + nbytes
                self._last_end = t1
            else:
                c["wall"] += t1 - self._pass_start
                self._pass_start = self._last_end = None

    def _fold_depths(self, events) -> None:
        q = self._q
        for _, depth in events:
            q[0], q[1], q[3] = q[0] + depth, q[1] + 1, q[3] + (depth == 0)
            q[2] = depth if q[2] is None or depth < q[2] else q[2]

    def _fold_utils(self, events) -> None:
        for _, *values, mem in events:
            for agg, v in ((a, v) for a, v in zip(self._u, values) if v is not None):
                agg[0], agg[1] = agg[0] + v, agg[1] + 1
            self._u_mem = self._u_mem if mem is None else max(self._u_mem or 0, mem)
            self._u_n += 1

    _folders = (_fold_spans, _fold_waits, _fold_depths, _fold_utils)

    def _fold(self) -> None:
        for kind, events in enumerate((self._spans, self._waits, self._depths, self._utils)):
            if self._folded[kind] < len(events):
                self._folders[kind](self, events[self._folded[kind]:])
                self._folded[kind] = len(events)

    # -- reading ----------------------------------------------------------------------------
    def stats(self) -> Stats:
        """Summary of everything recorded since creation or :meth:`reset`."""
        with self._lock:
            self._fold()
            c = dict(self._c)
            wall = c["wall"]
            if self._pass_start is not None and self._last_end is not None:
                wall += self._last_end - self._pass_start
            stages = {}
            for name, (sec, calls, nb, rows, threads) in zip(STAGES, self._stage):
                if calls:
                    stages[name] = StageStats(name, sec, calls, nb, rows, len(threads),
                                              nb / sec / 1e9 if sec > 0 else 0.0, rows / sec if sec > 0 else 0.0,
                                              sec / wall if wall > 0 else 0.0, not threads.isdisjoint(self._consumers))
            qsum, qn, qmin, qzero = self._q
            u = [(s / n if n else None) for s, n in self._u]
            umem, un = self._u_mem, self._u_n
        return Stats(wall_s=wall, batches=c["batches"], rows=c["rows"], bytes=c["bytes"], wait_s=c["wait"],
                     starvation=min(1.0, c["wait"] / wall) if wall > 0 else 0.0, passes=c["passes"],
                     wait_mean_s=c["wait"] / c["waits"] if c["waits"] else 0.0, wait_max_s=c["wait_max"],
                     step_mean_s=c["step"] / c["steps"] if c["steps"] else 0.0, step_max_s=c["step_max"],
                     stages=stages, queue_mean=qsum / qn if qn else None, queue_min=qmin,
                     queue_empty=qzero / qn if qn else None, queue_samples=qn, cpu_percent=u[0],
                     system_cpu_percent=u[1], gpu_percent=u[2], gpu_memory_bytes=umem, util_samples=un)

    def timeline(self) -> dict:
        """Per delivered batch, for plots: ``{"start": [...], "wait": [...], "step": [...]}``: when its
        ``next()`` began (seconds since the first ``next()``), its duration, and the time to the
        following ``next()`` (NaN for the last batch of an unfinished pass)."""
        with self._lock:
            waits = list(self._waits)
        origin, after, rows = (waits[0][1] if waits else 0.0), {}, []
        for tid, t0, t1, _, _, batch in reversed(waits):
            if batch:
                rows.append((t0 - origin, t1 - t0, after[tid] - t1 if tid in after else float("nan")))
            after[tid] = t0
        rows.reverse()
        return {k: [r[i] for r in rows] for i, k in enumerate(("start", "wait", "step"))}

    def util_samples(self) -> dict:
        """Utilisation samples as lists: ``t`` (seconds since the first ``next()``, else the
        first sample), ``cpu_percent``, ``system_cpu_percent``, ``gpu_percent``, ``gpu_memory_bytes``."""
        with self._lock:
            utils = list(self._utils)
            origin = self._waits[0][1] if self._waits else (utils[0][0] if utils else 0.0)
        keys = ("t", "cpu_percent", "system_cpu_percent", "gpu_percent", "gpu_memory_bytes")
        return {k: [u[i] - origin if i == 0 else u[i] for u in utils] for i, k in enumerate(keys)}

    def first_time(self) -> float | None:
        """Earliest :attr:`clock` time among the events kept (None without events)."""
        with self._lock:
            return min(chain((e[2] for e in self._spans), (e[1] for e in self._waits),
                             (e[0] for e in self._depths), (e[0] for e in self._utils)), default=None)

    def trace_events(self, origin: float | None = None) -> list[dict]:
        """Chrome trace events (``ph`` X, C, M; microseconds since ``origin``, a :attr:`clock` time,
        default :meth:`first_time`; see :meth:`write_trace`). Track ids are stable in a process, so
        events of several calls (epochs, Metrics) with one ``origin`` concatenate into one trace."""
        if origin is None:
            origin = self.first_time() or 0.0
        with self._lock:
            spans, waits = list(self._spans), list(self._waits)
            depths, utils = list(self._depths), list(self._utils)
            names, consumers = dict(self._names), list(self._consumers)
        pid = os.getpid()

        def us(t: float) -> float:
            return round((t - origin) * 1e6, 3)

        order = consumers + [t for t in dict.fromkeys(e[1] for e in spans) if t not in consumers]
        small = {tid: _track(tid, names.get(tid, str(tid))) for tid in order}
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "gpuload"}}]
        for tid in order:
            label = names.get(tid, str(tid)) + (" (training)" if tid in consumers else "")
            meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": small[tid], "args": {"name": label}},
                     {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": small[tid],
                      "args": {"sort_index": 0 if tid in consumers else small[tid]}}]

        def span(name, cat, tid, t0, t1, args) -> dict:
            a, b = us(t0), us(t1)
            return {"name": name, "cat": cat, "ph": "X", "ts": a, "dur": max(0.0, round(b - a, 3)), "pid": pid,
                    "tid": small[tid], "args": args}

        events = [span(STAGES[s], "gpuload", tid, t0, t1, {"bytes": nb, "rows": r})
                  for s, tid, t0, t1, nb, r in spans]
        last: dict[int, tuple] = {}
        for tid, t0, t1, rows, nb, batch in waits:
            prev = last.get(tid)
            if prev is not None and prev[5]:
                events.append(span("step", "consumer", tid, prev[2], t0, {}))
            events.append(span("wait" if batch else "wait (end of pass)", "consumer", tid, t0, t1,
                               {"bytes": nb, "rows": rows}))
            last[tid] = (tid, t0, t1, rows, nb, batch)
        events += [{"name": "queue depth", "ph": "C", "ts": us(t), "pid": pid, "tid": 0, "args": {"batches": d}}
                   for t, d in depths]
        for t, cpu, scpu, gpu, gmem in utils:
            for name, args in (("CPU %", {"process": cpu, "system": scpu}), ("GPU %", {"gpu": gpu}),
                               ("GPU memory MiB", {"used": None if gmem is None else round(gmem / 2**20, 1)})):
                args = {k: v for k, v in args.items() if v is not None}
                if args:
                    events.append({"name": name, "ph": "C", "ts": us(t), "pid": pid, "tid": 0, "args": args})
        events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        return meta + events

    def write_trace(self, path) -> Path:
        """Write the trace as Chrome trace-event JSON (gzip-compressed if ``path`` ends in
        ``.gz``) to open in https://ui.perfetto.dev or ``chrome://tracing``; returns the path."""
        path = Path(os.fspath(path))
        doc = {"traceEvents": self.trace_events(), "displayTimeUnit": "ms",
               "otherData": {"producer": "gpuload", "events_not_kept": self._dropped,
                             "stats": self.stats().to_dict()}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
        return path


_TRACKS: dict[tuple[int, str], int] = {}  # (thread ident, name) -> trace tid, for this process
_TRACKS_LOCK = threading.Lock()


def _track(ident: int, name: str) -> int:
    """A small trace tid for a thread, the same in every trace of this process (a reused
    ident with another thread name gets its own)."""
    with _TRACKS_LOCK:
        return _TRACKS.setdefault((ident, name), len(_TRACKS) + 1)


def _stage_index(stage: str) -> int:
    if stage not in _INDEX:
        raise ValueError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}")
    return _INDEX[stage]
