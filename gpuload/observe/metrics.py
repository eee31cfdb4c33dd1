"""Metrics: how long each pipeline stage and the training thread took, and when.

A :class:`Metrics` records, from any thread (in seconds of its ``clock``): stage
spans (:data:`STAGES`), each ``next()`` of the training thread, ready-queue depth, and
CPU/GPU utilisation samples (:class:`gpuload.observe.sampling.UtilSampler`), as running sums
under one lock, exact over any run, plus the events themselves for the trace, in bounded
memory: up to ``max_events`` of each kind, the first half kept for good and the latest in
a ring, packed in NumPy arrays (:mod:`gpuload.observe.events`; about 68 MB at most by
default, whatever the run's length). :meth:`Metrics.stats` summarises them;
:meth:`Metrics.write_trace` writes Chrome trace-event JSON for Perfetto, event by event
(:mod:`gpuload.observe.trace`).

Starvation is the fraction of wall time the training thread spent inside ``next()``.
Wall time is measured per *pass* (one iteration over the loader): from the start of
its first ``next()`` call to the end of its last one (the call that raised
``StopIteration``, or the last delivered batch while a pass is still open), summed over
passes. Time between passes (evaluation, checkpoints) is not counted.

Where torch sees a CUDA device, spans also push NVTX ranges ``gpuload:<stage>`` (see
:class:`Metrics`); CPU-only machines do no NVTX work.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from threading import get_ident
from time import perf_counter
from typing import Callable, Iterator

import torch

from ..errors import counted
from .events import EventLog
from .stats import StageStats, Stats
from .exposed import exposed
from .trace import SPAN_FIELDS, TraceFile, TraceRecord, iter_events

__all__ = ["STAGES", "Metrics"]

#: Pipeline stages a span can name, in pipeline order; then ``write_wait``, not work but a loader
#: thread blocked until the cache writer took its chunk (the writes holding the loader back).
STAGES = ("list", "read", "decode", "convert", "cache_write", "cache_read", "h2d", "batch", "write_wait")
_INDEX = {s: i for i, s in enumerate(STAGES)}
_NVTX_NAMES = tuple(f"gpuload:{s}" for s in STAGES)

# packed events of each kind (see gpuload.observe.events): 41, 41, 12 and 40 bytes
_DTYPES = ([("stage", "u1"), ("tid", "u8"), ("t0", "f8"), ("t1", "f8"), ("nbytes", "i8"), ("rows", "i8")],
           [("tid", "u8"), ("t0", "f8"), ("t1", "f8"), ("rows", "i8"), ("nbytes", "i8"), ("batch", "?")],
           [("t", "f8"), ("depth", "i4")],
           [("t", "f8"), ("cpu", "f8"), ("system", "f8"), ("gpu", "f8"), ("memory", "i8")])
_NAN = float("nan")


def _pack_util(e: tuple) -> tuple:  # None (not measured) as NaN, or -1 bytes
    t, cpu, system, gpu, mem = e
    return (t, _NAN if cpu is None else cpu, _NAN if system is None else system, _NAN if gpu is None else gpu,
            -1 if mem is None else mem)


def _unpack_util(e: tuple) -> tuple:
    return (e[0], *(None if v != v else v for v in e[1:4]), None if e[4] < 0 else e[4])


_CODECS = ((), (), (), (_pack_util, _unpack_util))


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


def _thread_name(tid: int) -> str:
    """The name of the thread ``tid`` (the calling one): a Python thread's own, else ``"native"``
    (pyarrow's I/O threads record spans too; ``threading.current_thread()`` would register each
    as a ``Dummy-N`` thread for good, in ``threading.enumerate()``)."""
    return next((t.name for t in threading.enumerate() if t.ident == tid), "native")


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
    max_events : events of each kind (spans, waits, queue and utilisation samples) kept for
        the trace (default 500,000: the first 250,000 and the latest 250,000 or so, about 68 MB
        at most in all, see :meth:`max_trace_nbytes`); every event counts in :meth:`stats`,
        kept or not, and the trace says how many were not kept.
    clock : returns the time in seconds, as a float (default ``time.perf_counter``; kept as
        ``.clock``). Spans, queue samples, :func:`gpuload.watch` and :class:`~gpuload.observe.sampling.UtilSampler`
        read it; timestamps given to :meth:`record` and the others must come from it. Only
        differences count: a test can pass a manual clock to get exact figures.

    One training thread consumes per Metrics; :meth:`consumer_end` closes each of its passes.
    """

    def __init__(self, *, nvtx: bool | None = None, max_events: int = 500_000,
                 clock: Callable[[], float] = perf_counter):
        self._nvtx, self.clock = _nvtx_backend(nvtx), clock
        self.max_events, self._lock = counted("max_events", max_events, 0, None), threading.Lock()
        self._resets = -1  # reset() calls so far, this first one not counted
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far (settings are kept)."""
        with self._lock:
            self._resets += 1  # for totals(): figures across a reset do not subtract
            # events: spans (stage, tid, t0, t1, nbytes, rows), waits (tid, t0, t1, rows, nbytes, delivered
            # a batch), depths (t, depth), utils (t, cpu %, system cpu %, gpu %, gpu memory bytes)
            self._spans, self._waits, self._depths, self._utils = (
                EventLog(dtype, self.max_events, fold.__get__(self), *codec)
                for dtype, fold, codec in zip(_DTYPES, self._folders, _CODECS))
            self._logs = (self._spans, self._waits, self._depths, self._utils)
            self._names, self._consumers = {}, []  # {ident: thread name}, consumer idents
            self._stage = [[0.0, 0, 0, 0, set()] for _ in STAGES]  # seconds, calls, nbytes, rows, threads
            self._c = dict(batches=0, rows=0, bytes=0, wait=0.0, wait_max=0.0, waits=0, step=0.0, steps=0,
                           step_max=0.0, wall=0.0, passes=0, first_wait=0.0)
            self._pass_start = self._last_end = None  # open pass: start, end of its last batch's next()
            self._q = [0, 0, None, 0]  # depth sum, samples, min, zeros
            self._u = [[0.0, 0] for _ in range(3)]  # cpu, system cpu, gpu: (sum, samples)
            self._u_n, self._u_mem = 0, None  # samples, most gpu memory
            self._runq = {"gpuload": [0.0, 0.0], "other": [0.0, 0.0]}  # cpu s, run-queue s (RunQueue)
            self._since = self.clock()  # a span begun before this counts from here

    @property
    def trace_nbytes(self) -> int:
        """Bytes the events kept for the trace take now (at most :meth:`max_trace_nbytes`)."""
        with self._lock:
            return sum(log.nbytes for log in self._logs)

    def max_trace_nbytes(self) -> int:
        """The most the events kept for the trace can take, in bytes: ``max_events`` of each
        kind at 41 (span), 41 (wait), 12 (queue sample) and 40 (utilisation sample) bytes, plus
        up to 1,023 events of each kind not packed yet (about 280 bytes each)."""
        return sum(log.max_nbytes() for log in self._logs)

    @property
    def events_not_kept(self) -> int:
        """Events counted in :meth:`stats` but no longer kept for the trace (``max_events``)."""
        with self._lock:
            return sum(log.dropped for log in self._logs)

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
        with self._lock:  # a span across a reset: its time since (one thread showed 240% of a pass's wall)
            self._spans.push((stage, tid, self._since if t0 < self._since <= t1 else t0, t1, nbytes, rows))
            if tid not in self._names:
                self._names[tid] = _thread_name(tid)

    def queue_depth(self, depth: int) -> None:
        """Sample the number of ready batches waiting in the queue, now."""
        t = self.clock()
        with self._lock:
            self._depths.push((t, depth))

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
            self._waits.push(event)
            if tid not in self._names:
                self._names[tid] = _thread_name(tid)
            if tid not in self._consumers:
                self._consumers.append(tid)

    def util_sample(self, t: float, *, cpu_percent: float | None = None, system_cpu_percent: float | None = None,
                    gpu_percent: float | None = None, gpu_memory_bytes: int | None = None) -> None:
        """One utilisation sample at :attr:`clock` time ``t``: this process's CPU (percent of one
        core), the machine's CPU (0-100), GPU use (0-100), GPU memory used (bytes); None: not measured."""
        with self._lock:
            self._utils.push((t, cpu_percent, system_cpu_percent, gpu_percent, gpu_memory_bytes))

    def run_queue(self, delta: dict) -> None:
        """Add CPU and run-queue seconds of the process's threads (a
        :class:`gpuload.observe.sampling.RunQueue` delta: ``{"gpuload"|"other": (cpu s, run-queue s)}``)."""
        with self._lock:
            for k, (cpu, wait) in delta.items():
                agg = self._runq.setdefault(k, [0.0, 0.0])
                agg[0], agg[1] = agg[0] + cpu, agg[1] + wait

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
                c["first_wait"] += t1 - t0
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
        for log in self._logs:
            log.fold()

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
            dropped = sum(log.dropped for log in self._logs)
            runq = {k: tuple(v) for k, v in self._runq.items()} if any(v[0] for v in self._runq.values()) else None
            spans = [self._spans.field_array(k, i) for i, k in ((0, "stage"), (2, "t0"), (3, "t1"))]
            waits = [self._waits.field_array(k, i) for i, k in ((1, "t0"), (2, "t1"))]
        during = {}
        if c["wait"] > 0 and len(spans[0]) and not dropped:  # else the spans that ran cannot all be known
            per, idle = exposed(*waits, *spans, len(STAGES))
            during = {name: float(v) for name, v in zip(STAGES, per) if v > 0}
            during["idle"] = idle
        return Stats(wall_s=wall, batches=c["batches"], rows=c["rows"], bytes=c["bytes"], wait_s=c["wait"],
                     starvation=min(1.0, c["wait"] / wall) if wall > 0 else 0.0, passes=c["passes"],
                     wait_mean_s=c["wait"] / c["waits"] if c["waits"] else 0.0, wait_max_s=c["wait_max"],
                     first_wait_s=c["first_wait"],
                     step_mean_s=c["step"] / c["steps"] if c["steps"] else 0.0, step_max_s=c["step_max"],
                     stages=stages, queue_mean=qsum / qn if qn else None, queue_min=qmin,
                     queue_empty=qzero / qn if qn else None, queue_samples=qn, cpu_percent=u[0],
                     system_cpu_percent=u[1], gpu_percent=u[2], gpu_memory_bytes=umem, util_samples=un,
                     events_not_kept=dropped, during_waits=during or None, cpu_queue=runq)

    def totals(self, stage: str) -> tuple[int, float, float, float]:
        """(resets so far, wall s, waiting s after each pass's first ``next()``, ``stage``'s busy s
        summed over threads): sums of :meth:`stats` without its look at what ran during the
        waits, cheap enough for every pass's end; two of them differ by what happened between
        them if their first figure (:meth:`reset` calls) is the same."""
        with self._lock:
            self._fold()
            wall = self._c["wall"]
            if self._pass_start is not None and self._last_end is not None:
                wall += self._last_end - self._pass_start
            return self._resets, wall, self._c["wait"] - self._c["first_wait"], self._stage[_INDEX[stage]][0]

    def timeline(self) -> dict:
        """Per delivered batch whose wait is kept for the trace, for plots: ``{"start": [...],
        "wait": [...], "step": [...]}``: when its ``next()`` began (seconds since the first
        ``next()``), its duration, and the time to the following ``next()`` (NaN for the last
        batch of an unfinished pass, and for the last one before events were not kept)."""
        with self._lock:
            head, rest = self._waits.parts()
        origin = head[0][1] if head else rest[0][1] if rest else 0.0
        after, rows = {}, []
        for part in (rest, head):
            for tid, t0, t1, _, _, batch in reversed(part):
                if batch:
                    rows.append((t0 - origin, t1 - t0, after[tid] - t1 if tid in after else float("nan")))
                after[tid] = t0
            after = {}  # the next() after the last one of the head may not be kept
        rows.reverse()
        return {k: [r[i] for r in rows] for i, k in enumerate(("start", "wait", "step"))}

    def util_samples(self) -> dict:
        """Utilisation samples kept for the trace as lists: ``t`` (seconds since the first
        ``next()``, else the first sample), ``cpu_percent``, ``system_cpu_percent``,
        ``gpu_percent``, ``gpu_memory_bytes``."""
        with self._lock:
            utils = self._utils.events()
            first_wait = self._waits.field_min("t0", 1)
        origin = first_wait if first_wait is not None else (utils[0][0] if utils else 0.0)
        keys = ("t", "cpu_percent", "system_cpu_percent", "gpu_percent", "gpu_memory_bytes")
        return {k: [u[i] - origin if i == 0 else u[i] for u in utils] for i, k in enumerate(keys)}

    def first_time(self) -> float | None:
        """Earliest :attr:`clock` time among the events kept (None without events)."""
        with self._lock:
            found = (self._spans.field_min("t0", 2), self._waits.field_min("t0", 1),
                     self._depths.field_min("t", 0), self._utils.field_min("t", 0))
        return min((t for t in found if t is not None), default=None)

    def trace_events(self, origin: float | None = None) -> list[dict]:
        """Chrome trace events (``ph`` X, C, M, and an instant ``i`` where events were not kept;
        microseconds since ``origin``, a :attr:`clock` time, default :meth:`first_time`; see
        :meth:`write_trace`), sorted by time. Track ids are stable in a process, so events of
        several calls (epochs, Metrics) with one ``origin`` concatenate into one trace."""
        return list(self.iter_trace_events(origin))

    def iter_trace_events(self, origin: float | None = None) -> Iterator[dict]:
        """The events of :meth:`trace_events`, made one at a time (:func:`gpuload.observe.trace.iter_events`),
        so that a trace is written without holding them all."""
        if origin is None:
            origin = self.first_time() or 0.0
        yield from iter_events(self._trace_record(), origin)

    def _trace_record(self) -> TraceRecord:
        """A copy of the events kept for the trace, taken under the lock."""
        with self._lock:
            return TraceRecord(STAGES, {k: self._spans.field_array(k, i) for i, k in enumerate(SPAN_FIELDS)},
                               self._spans.head_len, self._waits.parts(), self._depths.parts(), self._utils.parts(),
                               tuple(log.dropped for log in self._logs), dict(self._names), list(self._consumers))

    def write_trace(self, path) -> Path:
        """Write the trace as Chrome trace-event JSON (gzip-compressed if ``path`` ends in
        ``.gz``) to open in https://ui.perfetto.dev or ``chrome://tracing``; returns the path.
        Written event by event: the file, not memory, holds the whole trace."""
        with TraceFile(path, {"producer": "gpuload", "events_not_kept": self.events_not_kept,
                              "stats": self.stats().to_dict()}) as out:
            out.add(self.iter_trace_events())
        return out.path


def _stage_index(stage: str) -> int:
    if stage not in _INDEX:
        raise ValueError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}")
    return _INDEX[stage]
