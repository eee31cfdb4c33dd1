"""Read-ahead: remote chunks' column ranges fetched before their decoding asks for them.

A remote chunk is decoded from the bytes of its column chunks (:mod:`gpuload.sources.ranges`).
:class:`ReadAhead` starts those fetches ahead, as the pipeline's plan reaches a chunk
(:meth:`ReadAhead.warm`), within ``RemoteSettings.readahead_bytes``; the decoder then takes
the fetch started for its chunk (:meth:`ReadAhead.fetch`), or starts one. One
:class:`~gpuload.sources.fetch.Fetcher` per store carries the requests, bounded by bytes
and count, and an epoch left early abandons them (:meth:`ReadAhead.interrupt`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from ..errors import SourceError
from .fetch import Fetcher, Job
from .settings import RemoteSettings, RemoteStats
from .listing import SourceFile
from .ranges import RangeFile, column_ranges, image_ranges
from .remote import same_version

__all__ = ["ReadAhead"]


def _key(chunk) -> tuple[int, int, int]:
    """What names a chunk's fetch: (file, first row group, row group after the last)."""
    return chunk.file, chunk.rg_start, chunk.rg_stop


class ReadAhead:
    """The remote fetches of one opened dataset.

    Parameters
    ----------
    settings : the :class:`RemoteSettings` (requests and bytes in flight, read-ahead budget, retries).
    metrics : a :class:`gpuload.Metrics` (default None): each wait for a chunk's bytes is a ``read`` span.
    """

    def __init__(self, settings: RemoteSettings, metrics=None):
        self.settings, self.metrics = settings, metrics
        self._fetchers: dict[int, Fetcher] = {}
        self._lock = threading.Lock()
        self._ahead: dict[tuple, Job] = {}  # fetches started ahead of decoding, by chunk key
        self._ahead_bytes = 0
        self.ahead_used = 0  #: chunks whose fetch had been started ahead when decoding asked for it

    def fetcher(self, store) -> Fetcher:
        """The one :class:`Fetcher` of ``store`` (a :class:`gpuload.sources.remote.Store`)."""
        with self._lock:
            got = self._fetchers.get(id(store))
            if got is None:
                clock = self.metrics.clock if self.metrics is not None else time.perf_counter
                got = self._fetchers[id(store)] = Fetcher(store, self.settings, clock)
            return got

    def _start(self, f: SourceFile, groups: Sequence[int], leaves: Sequence[int], footer: bool,
               urgent: bool = False) -> Job:
        if footer:  # for libcudf, which reads the file itself: also magic, page indexes and footer
            ranges = image_ranges(f.metadata, f.size, f.tail, groups, leaves)
        else:
            ranges = [r for g in groups for r in column_ranges(f.metadata, g, g + 1, leaves)]

        def unchanged() -> None:
            size, mtime, tag = f.store.identity(f.key)
            if not same_version((f.size, f.mtime_ns, f.tag), (size, mtime, tag)):
                raise SourceError(f"{f.path} changed after the dataset was opened (size {f.size:,} -> {size:,}, "
                                  f"version {f.tag or '-'} -> {tag or '-'}, last modified {f.mtime_ns} -> {mtime} "
                                  "ns); open the dataset again to pick up the new object")

        return self.fetcher(f.store).start(f.key, ranges, check=unchanged, urgent=urgent)

    def warm(self, f: SourceFile, chunk, leaves: Sequence[int], footer: bool, cached: Callable[[], bool],
             urgent: bool = False) -> bool:
        """Start fetching ``chunk`` of remote ``f`` (``leaves``: the Parquet leaf columns to
        read; ``footer``: and the footer, for libcudf) unless it is fetched ahead already or
        ``cached()``. False when the read-ahead budget is spent: call again later. ``urgent``
        (default False): whatever the budget, before the fetches queued ahead (a pack's files,
        about to be decoded one after another: their requests in flight together)."""
        k = _key(chunk)
        with self._lock:
            if k in self._ahead:
                return True
            if not urgent and self._ahead and self._ahead_bytes >= self.settings.readahead_bytes:
                return False
        if cached():
            return True
        job = self._start(f, range(chunk.rg_start, chunk.rg_stop), leaves, footer, urgent=urgent)
        with self._lock:
            twice = k in self._ahead  # another thread started it meanwhile: its fetch is the one kept
            if not twice:
                self._ahead[k] = job
                self._ahead_bytes += job.nbytes
        if twice:
            job.cancel()
        return True

    def _take(self, k: tuple) -> Job | None:
        """The fetch started ahead for chunk key ``k``, now no longer ahead."""
        with self._lock:
            job = self._ahead.pop(k, None)
            if job is not None:
                self._ahead_bytes -= job.nbytes
        return job

    def drop(self, chunk) -> None:
        """Cancel ``chunk``'s fetch started ahead, if any (it was cached meanwhile)."""
        job = self._take(_key(chunk))
        if job is not None:
            job.cancel()

    def forget(self) -> None:
        """Drop the fetches started ahead that were not used (an epoch left early)."""
        with self._lock:
            jobs, self._ahead, self._ahead_bytes = list(self._ahead.values()), {}, 0
        for job in jobs:
            job.cancel()

    def fetch(self, f: SourceFile, chunk, leaves: Sequence[int], footer: bool = False) -> RangeFile:
        """The decoders' hook: a readable file of remote ``f`` holding ``chunk``'s column
        chunks of ``leaves`` (and, for libcudf, its magic and footer), from the fetch started
        ahead (which covers every leaf the decoders ask for, and the footer whenever the GPU
        decoder is in use) or fetched now; the wait is timed as a ``read`` span."""
        job = self._take(_key(chunk))
        if job is not None:
            with self._lock:
                self.ahead_used += 1
        else:  # a decoder waits on it now: before everything started ahead
            job = self._start(f, range(chunk.rg_start, chunk.rg_stop), leaves, footer, urgent=True)
        m = self.metrics
        t0 = m.clock() if m is not None else 0.0
        fetcher = self.fetcher(f.store)
        out = RangeFile(f.path, f.size, job.result(), lambda a, b: fetcher.get(f.key, a, b))
        if m is not None:
            m.record("read", t0, m.clock(), nbytes=sum(len(b) for b in out.parts.values()))
        return out

    def stats(self) -> RemoteStats:
        """Requests made since open or :meth:`reset`, over every store (latency percentiles of the busiest)."""
        with self._lock:
            all_stats = [f.stats() for f in self._fetchers.values()]
        if not all_stats:
            return RemoteStats(0, 0, 0, 0, None, None, None)
        if len(all_stats) == 1:
            return all_stats[0]
        best = max(all_stats, key=lambda s: s.requests)
        return RemoteStats(sum(s.requests for s in all_stats), sum(s.bytes for s in all_stats),
                           sum(s.retried for s in all_stats), sum(s.failed for s in all_stats),
                           best.latency_p50_s, best.latency_p90_s, best.latency_p99_s)

    def _each(self, call: str) -> None:
        with self._lock:
            fetchers = list(self._fetchers.values())
        for f in fetchers:
            getattr(f, call)()

    def reset(self) -> None:
        """Start :meth:`stats` afresh."""
        self._each("reset")

    def interrupt(self) -> None:
        """Abandon fetches in flight and queued, and refuse new ones until :meth:`resume`
        (an epoch left early: its loads must not wait on a stalled store)."""
        self.forget()
        self._each("interrupt")

    def resume(self) -> None:
        """Fetch again after :meth:`interrupt` or :meth:`close` (an epoch begins)."""
        self._each("resume")

    def close(self) -> None:
        """:meth:`interrupt`, and close the stores' open files."""
        self.forget()
        self._each("close")
