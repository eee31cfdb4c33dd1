"""Live export: a loader's figures as Prometheus metrics over HTTP, or handed to a callback.

    server = gpuload.serve_metrics(ds, port=9464)       # http://127.0.0.1:9464/metrics, scraped live
    reporter = gpuload.report_metrics(ds, send, every_s=10)   # send(samples) every 10 s (OpenTelemetry, logs...)

Figures are read from the loader's ``stats()`` when they are asked for (a scrape, a report), so
nothing runs between scrapes but the HTTP server's thread. Every sample carries the labels
``rank`` and ``world_size`` (the loader's, when it knows them) and those the caller gives; a
:class:`gpuload.Mix` adds its sources' figures labelled ``source``. Totals are Prometheus
counters (``rate()`` gives rows/s and bytes/s per stage); the waiting fraction and the queue
are gauges. ``docs/grafana/gpuload.json`` is a dashboard of these metrics. Serving needs
``prometheus_client`` (``pip install 'gpuload[metrics]'``); :func:`samples` and
:func:`report_metrics` need nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError

__all__ = ["Sample", "samples", "serve_metrics", "report_metrics", "MetricsServer", "MetricsReporter"]


@dataclass(frozen=True)
class Sample:
    """One figure: a metric ``name``, ``kind`` (``"counter"`` or ``"gauge"``), its ``help``
    text, ``labels`` (str -> str) and ``value``."""

    name: str
    kind: str
    help: str
    labels: dict
    value: float


_TOTALS = (  # (metric, Stats field, help): counters of the training thread's side
    ("gpuload_batches_total", "batches", "batches handed to the training thread"),
    ("gpuload_rows_total", "rows", "rows handed to the training thread"),
    ("gpuload_bytes_total", "bytes", "bytes handed to the training thread"),
    ("gpuload_wait_seconds_total", "wait_s", "seconds the training thread waited inside next()"),
    ("gpuload_wall_seconds_total", "wall_s", "seconds of the training thread's passes, first next() to last"),
    ("gpuload_passes_total", "passes", "passes (epochs) over the loader begun"),
)
_STAGE = (("gpuload_stage_busy_seconds_total", "seconds", "busy seconds of a stage, summed over its threads"),
          ("gpuload_stage_bytes_total", "nbytes", "bytes a stage processed"),
          ("gpuload_stage_rows_total", "rows", "rows a stage processed"))
_REMOTE = (("gpuload_remote_requests_total", "requests", "requests made to a remote store"),
           ("gpuload_remote_bytes_total", "bytes", "bytes fetched from a remote store"),
           ("gpuload_remote_retries_total", "retried", "remote requests tried again"),
           ("gpuload_remote_failures_total", "failed", "remote requests that failed for good"))


def _ranks(loader) -> dict:
    for obj in (loader, *getattr(loader, "sources", ())[:1]):
        try:
            return {"rank": str(obj.rank), "world_size": str(obj.world_size)}
        except (AttributeError, ConfigError):  # not a gpuload dataset, or ranks not known yet
            continue
    return {}


def _one(stats, counters, labels: dict) -> list[Sample]:
    out = [Sample(m, "counter", h, labels, float(getattr(stats, f))) for m, f, h in _TOTALS]
    out.append(Sample("gpuload_wait_fraction", "gauge", "share of the training thread's time spent waiting "
                      "for batches (0 to 1), over the passes so far", labels, float(stats.starvation)))
    if stats.queue_samples:
        out.append(Sample("gpuload_queue_depth_mean", "gauge", "mean number of ready batches queued",
                          labels, float(stats.queue_mean)))
        out.append(Sample("gpuload_queue_empty_fraction", "gauge", "share of queue samples with no batch ready",
                          labels, float(stats.queue_empty)))
    for s in stats.stages.values():
        if s.name == "write_wait":  # not busy time: the loader threads held back by the cache writer
            out.append(Sample("gpuload_write_wait_seconds_total", "counter", "seconds loader threads waited for "
                              "the cache writer to take the chunks they built", labels, float(s.seconds)))
            continue
        for m, f, h in _STAGE:
            out.append(Sample(m, "counter", h, {**labels, "stage": s.name}, float(getattr(s, f))))
    if stats.remote is not None:
        out += [Sample(m, "counter", h, labels, float(getattr(stats.remote, f))) for m, f, h in _REMOTE]
    if counters is not None:
        for outcome, n in (("cached", counters.from_cache), ("decoded", counters.decoded)):
            out.append(Sample("gpuload_chunks_total", "counter", "chunks loaded, from the cache or decoded",
                              {**labels, "outcome": outcome}, float(n)))
    return out


def samples(loader, labels: dict | None = None) -> list[Sample]:
    """The figures of ``loader`` now (anything with ``stats()``: a dataset, a :class:`gpuload.Mix`,
    a :class:`gpuload.Watched`), labelled with its ranks and ``labels``."""
    base = {**_ranks(loader), **{str(k): str(v) for k, v in (labels or {}).items()}}
    stats = loader.stats()
    counters = getattr(getattr(loader, "reader", None), "counters", None)
    out = _one(stats, counters, base)
    for (name, src_stats), src in zip((stats.sources or {}).items(), getattr(loader, "sources", ())):
        out += _one(src_stats, getattr(getattr(src, "reader", None), "counters", None), {**base, "source": name})
    return out


def _check_loader(fn: str, loader) -> None:
    """A :class:`ConfigError` at the call for a ``loader`` without ``stats()``, which every scrape or
    report would fail on, quietly (an HTTP 500, an entry of ``reporter.errors``)."""
    if not callable(getattr(loader, "stats", None)):
        raise ConfigError(f"{fn}() takes a loader with stats() (a gpuload.ParquetDataset, a gpuload.Mix or "
                          f"gpuload.watch(...) of yours), not a {type(loader).__name__}")


class MetricsServer:
    """A running Prometheus endpoint (:func:`serve_metrics`): ``url``; :meth:`close` stops it."""

    def __init__(self, server, thread, url: str):
        self._server, self._thread, self.url = server, thread, url

    def close(self) -> None:
        """Stop serving (the port is free again)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_metrics(loader, port: int = 9464, addr: str = "127.0.0.1", labels: dict | None = None) -> MetricsServer:
    """Serve ``loader``'s figures (:func:`samples`) for Prometheus at ``http://addr:port/metrics``.

    ``port``: the TCP port (default 9464; 0: any free one, see ``url``); ``addr``: the address
    to listen on (default loopback only; ``"0.0.0.0"`` for a scraper on another host). With
    several ranks on a node, give each its own port (e.g. ``9464 + local_rank``). Returns a
    :class:`MetricsServer`; raises :class:`~gpuload.ConfigError` without ``prometheus_client``.
    """
    _check_loader("serve_metrics", loader)
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        raise ConfigError("serve_metrics needs prometheus_client: pip install 'gpuload[metrics]'") from None

    class _Collector:
        def collect(self):
            groups: dict = {}  # family -> its samples: every sample of a family gets the same label names
            for s in samples(loader, labels):
                groups.setdefault(s.name[:-len("_total")] if s.kind == "counter" else s.name, []).append(s)
            out = []
            for base, group in groups.items():
                keys = sorted({k for s in group for k in s.labels})  # a mix's total: source=""
                make = CounterMetricFamily if group[0].kind == "counter" else GaugeMetricFamily
                fam = make(base, group[0].help, labels=keys)
                for s in group:
                    fam.add_metric([s.labels.get(k, "") for k in keys], s.value)
                out.append(fam)
            return out

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise ConfigError(f"serve_metrics cannot listen on {addr}:{port} ({e.strerror or e}): choose another "
                          "port= (each rank on a node needs its own)") from None
    return MetricsServer(server, thread, f"http://{addr}:{server.server_port}/metrics")


class MetricsReporter:
    """A thread calling ``callback(samples)`` every ``every_s`` seconds (:func:`report_metrics`);
    :meth:`close` stops it after one last report."""

    def __init__(self, loader, callback: Callable[[list], None], every_s: float, labels: dict | None):
        self._stop = threading.Event()
        self._args = (loader, callback, labels)
        self.errors: list[BaseException] = []  # a callback's exceptions, kept (the loader goes on)
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="gpuload-metrics", daemon=True)
        self._thread.start()

    def _report(self) -> None:
        loader, callback, labels = self._args
        try:
            callback(samples(loader, labels))
        except Exception as e:  # a monitoring hiccup must not stop training
            self.errors.append(e)

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._report()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._report()

    def __enter__(self) -> MetricsReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report_metrics(loader, callback: Callable[[list], None], every_s: float = 10.0,
                   labels: dict | None = None) -> MetricsReporter:
    """Call ``callback(samples(loader, labels))`` every ``every_s`` seconds (default 10) on a
    thread of its own, and once more at :meth:`MetricsReporter.close`: the same figures as
    :func:`serve_metrics`, for OpenTelemetry or any other system. A callback's exception is
    kept in ``reporter.errors``, never raised into training."""
    _check_loader("report_metrics", loader)
    if not callable(callback):  # else every report fails into reporter.errors, and nothing is reported
        raise ConfigError(f"report_metrics(): callback={callback!r} must be a function callback(samples)")
    if not every_s > 0:
        raise ConfigError(f"every_s={every_s!r} must be a positive number of seconds")
    return MetricsReporter(loader, callback, float(every_s), labels)
