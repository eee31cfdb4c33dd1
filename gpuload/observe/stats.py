"""Stats: the summary a :class:`gpuload.Metrics` gives of what it recorded, and its rendering
(plain text for logs and terminals, HTML for notebooks)."""

from __future__ import annotations

import html
import threading
from dataclasses import asdict, dataclass, field

__all__ = ["Stats", "StageStats", "CONTENTION_MIN_S", "LoadCounters"]

CONTENTION_MIN_S = 0.5  # CPU seconds measured at least before the run-queue share means anything


@dataclass(frozen=True)
class StageStats:
    """One stage's totals. Seconds are busy time summed over the threads that ran it.

    Attributes
    ----------
    name, calls : the stage (one of :data:`gpuload.observe.metrics.STAGES`) and the spans recorded.
    seconds : busy time in seconds, summed over threads (may exceed the wall time).
    nbytes, rows : bytes and rows the spans reported.
    threads : distinct threads that ran the stage.
    gbps, rows_per_s : ``nbytes / seconds / 1e9`` and ``rows / seconds``: one busy thread's rates.
    share : ``seconds / wall_s`` of the :class:`Stats` (above 1 when threads overlap; ``list`` runs
        when the dataset opens, outside that wall time: the table says "at open").
    training_thread : whether some of its spans ran on the training (consumer) thread,
        i.e. inside ``next()`` rather than in the background.
    """

    name: str
    seconds: float
    calls: int
    nbytes: int
    rows: int
    threads: int
    gbps: float
    rows_per_s: float
    share: float
    training_thread: bool = False


@dataclass(frozen=True)
class Stats:
    """A summary of what a :class:`Metrics` recorded. Times in seconds, sizes in bytes.

    Attributes
    ----------
    wall_s : training-thread wall time: per pass from the start of its first ``next()``
        to the end of its last, summed over passes.
    batches, rows, bytes : delivered to the training thread.
    wait_s : time spent inside ``next()`` (within ``wall_s``).
    starvation : ``wait_s / wall_s``, 0 to 1 (0 when nothing was timed).
    passes : iterations over the loader (started ones). wait_mean_s, wait_max_s: per ``next()``.
    first_wait_s : the first ``next()`` of each pass, summed over passes (within ``wait_s``):
        the loader's start-up; None where not measured (Stats made by hand).
    step_mean_s, step_max_s : from a batch's delivery to the next ``next()`` (the step).
    stages : ``{stage: StageStats}`` for the stages that recorded a span, in pipeline order.
    queue_mean, queue_min, queue_empty : ready-batch queue depth: mean, minimum, fraction of
        samples at 0 (None without samples); queue_samples: their number.
    cpu_percent, system_cpu_percent : mean CPU use of this process (percent of one core:
        200 = two cores busy) and of the whole machine (0 to 100).
    worker_cpu_percent : a watched DataLoader's worker processes: each one's mean CPU use while
        the passes ran (percent of one core; low: they wait, on a disk or a store), or None.
    gpu_percent : mean GPU utilisation, 0 to 100; gpu_memory_bytes: most GPU memory used.
        The four are None without samples; util_samples: their number.
    remote : requests to a remote source's store (:class:`gpuload.RemoteStats`), or None.
    events_not_kept : events counted here but no longer kept for the trace (a run longer than
        the Metrics' ``max_events``; the trace marks where they were left out).
    loader : what was measured, for advice that fits it: ``"gpuload"`` (a
        :class:`gpuload.ParquetDataset`, or a DataLoader over one), ``"DataLoader"`` (a torch
        DataLoader over another dataset), ``"iterable"`` (anything else), None (not said;
        stats with stage timings are gpuload's). loader_settings: what the advice may refer to
        (a DataLoader's ``num_workers``, ``pin_memory``, ``persistent_workers``,
        ``prefetch_factor``; a dataset's ``num_threads`` and ``prefetch``; else ``type``).
    during_waits : what the loader did while the training thread waited (the waiting prefetch did
        not hide): ``{stage: seconds its spans overlapped the waits, summed over threads}`` and
        ``"idle"``: seconds of waiting with no stage running anywhere (nothing in flight). None
        without waits, without stage spans in this Metrics (a watched loader; a Mix, whose
        sources have their own), or once events were not kept (``events_not_kept``).
    cpu_queue : ``{"gpuload": (cpu s, run-queue s), "other": (...)}``: seconds this process's
        threads ran on a core and seconds they were runnable but waiting for one (Linux
        schedstat, while utilisation was sampled), gpuload's threads and the others (the
        training thread, torch's intra-op threads) apart; None where not measured.
        :attr:`cpu_contention` is the run-queue share.
    sources : a :class:`gpuload.Mix`'s ``{source name: Stats}``: each source's own stats, whose
        waits are the mix thread's waits for that source's batches; None for anything else.
    """

    wall_s: float
    batches: int
    rows: int
    bytes: int
    wait_s: float
    starvation: float
    passes: int
    wait_mean_s: float
    wait_max_s: float
    step_mean_s: float
    step_max_s: float
    stages: dict[str, StageStats]
    queue_mean: float | None = None
    queue_min: int | None = None
    queue_empty: float | None = None
    queue_samples: int = 0
    cpu_percent: float | None = None
    system_cpu_percent: float | None = None
    gpu_percent: float | None = None
    gpu_memory_bytes: int | None = None
    util_samples: int = 0
    remote: object = None  # a gpuload.RemoteStats: requests to a remote source's store
    events_not_kept: int = 0
    first_wait_s: float | None = None
    loader: str | None = None
    loader_settings: dict | None = None
    sources: dict | None = None
    during_waits: dict | None = None
    worker_cpu_percent: float | None = None
    cpu_queue: dict | None = None

    @property
    def rows_per_s(self) -> float:
        """Rows delivered per second of wall time (0.0 when none was timed)."""
        return self.rows / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_contention(self) -> float | None:
        """Run-queue seconds over CPU seconds of this process's threads (0: every thread got a
        core when it could run; 0.5: they waited half as long as they ran), or None where not
        measured or measured over less than ``CONTENTION_MIN_S`` (0.5) CPU seconds."""
        if not self.cpu_queue:
            return None
        cpu = sum(v[0] for v in self.cpu_queue.values())
        return sum(v[1] for v in self.cpu_queue.values()) / cpu if cpu >= CONTENTION_MIN_S else None

    def waits_text(self) -> str:
        """The waiting not hidden by prefetch and what ran during it, in words."""
        during = self.during_waits or {}
        parts = sorted(((k, v) for k, v in during.items() if k not in ("idle", "write_wait")), key=lambda kv: -kv[1])
        busy = ", ".join(f"{k} {v:.3f} s" for k, v in parts) or "no stage"
        held = (f", and waiting for the cache writer to take their chunks {during['write_wait']:.3f} s"
                if during.get("write_wait") else "")
        return (f"{self.wait_s:.3f} s not hidden by prefetch; loader threads busy meanwhile: {busy}{held}; nothing "
                f"running for {during.get('idle', 0.0):.3f} s" + (" (from the events kept)" if self.events_not_kept
                                                                   else ""))

    def to_dict(self) -> dict:
        """Plain dict (stages as dicts), ready for ``json.dumps``."""
        return asdict(self)

    def _summary(self) -> list[tuple[str, str]]:
        passes = f"{self.passes} pass{'es' * (self.passes != 1)}"
        out = [("delivered", f"{self.batches:,} batches, {self.rows:,} rows, {_size(self.bytes)} in "
                             f"{self.wall_s:.3f} s ({_count(self.rows_per_s)} rows/s, {passes})"),
               ("starvation", f"{self.starvation:.1%}  (waited {self.wait_s:.3f} s inside next(); mean wait "
                              f"{self.wait_mean_s * 1e3:.2f} ms per next(), mean step "
                              f"{self.step_mean_s * 1e3:.2f} ms)")]
        if self.queue_samples:
            out.append(("queue depth", f"mean {self.queue_mean:.2f}, min {self.queue_min}, empty in "
                                       f"{self.queue_empty:.0%} of {self.queue_samples:,} samples"))
        if self.util_samples:
            parts = [f"{label} {v:.0f}%" for label, v in (("process CPU", self.cpu_percent),
                                                         ("each worker's CPU", self.worker_cpu_percent),
                                                         ("system CPU", self.system_cpu_percent),
                                                         ("GPU", self.gpu_percent)) if v is not None]
            if self.gpu_memory_bytes is not None:
                parts.append(f"GPU memory max {_size(self.gpu_memory_bytes)}")
            out.append(("utilisation", ", ".join(parts) + f" ({self.util_samples:,} samples)"))
        if self.during_waits:
            out.append(("during waits", self.waits_text()))
        if self.cpu_contention is not None:
            g, o = self.cpu_queue.get("gpuload", (0, 0)), self.cpu_queue.get("other", (0, 0))
            out.append(("cpu queue", f"threads waited for a core {self.cpu_contention:.0%} as long as they ran "
                                     f"(gpuload's: {g[1]:.2f} s waiting, {g[0]:.2f} s running; others: {o[1]:.2f} s, "
                                     f"{o[0]:.2f} s)"))
        if self.remote is not None:
            out.append(("remote", str(self.remote)))
        for name, st in (self.sources or {}).items():  # a mix: what its thread waited for each source, as
            share = st.wait_s / self.wall_s if self.wall_s else 0.0  # shares of the mix's time, which add up
            out.append((f"source {name}", f"{st.batches:,} batches, {st.rows:,} rows; the mix waited "
                                          f"{st.wait_s:.3f} s for them ({share:.1%} of the mix's time)"))
        return out

    _HEAD = ("stage", "busy s", "calls", "threads", "GB/s", "rows/s", "% of wall")

    def _stage_rows(self) -> list[tuple[str, ...]]:
        # a stage that counts bytes alone (the Parquet reads) or rows alone shows "-" for the other rate, not 0;
        # listing runs when a dataset opens, outside the passes whose wall time the shares divide by
        return [(s.name, f"{s.seconds:.3f}", f"{s.calls:,}", str(s.threads), f"{s.gbps:.2f}" if s.nbytes else "-",
                 _count(s.rows_per_s) if s.rows else "-", "at open" if s.name == "list" else f"{s.share:.1%}")
                for s in self.stages.values()]

    def __str__(self) -> str:
        lines = [f"{k:12} {v}" for k, v in self._summary()]
        if self.stages:
            table = [self._HEAD] + self._stage_rows()
            widths = [max(len(r[i]) for r in table) for i in range(len(self._HEAD))]
            for r in table:
                lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))))
        else:
            lines.append("stages       none recorded (a loader without gpuload metrics)")
        return "gpuload stats\n" + "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(f"<tr><th style='text-align:left'>{e(k)}</th><td style='text-align:left' colspan='6'>"
                       f"{e(v)}</td></tr>" for k, v in self._summary())
        if self.stages:
            rows += "<tr>" + "".join(f"<th>{e(h)}</th>" for h in self._HEAD) + "</tr>"
            rows += "".join("<tr>" + "".join(f"<td style='text-align:{'left' if i == 0 else 'right'}'>{e(c)}</td>"
                                              for i, c in enumerate(r)) + "</tr>" for r in self._stage_rows())
        return f"<table><caption>gpuload stats</caption>{rows}</table>"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,.0f}"


@dataclass
class LoadCounters:
    """How chunks were obtained since the counters were last reset (thread-safe)."""

    from_cache: int = 0
    decoded: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, cached: bool) -> None:
        with self._lock:
            if cached:
                self.from_cache += 1
            else:
                self.decoded += 1

    def reset(self) -> None:
        with self._lock:
            self.from_cache = self.decoded = 0
