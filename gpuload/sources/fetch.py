"""Fetch: the byte ranges of a chunk's columns from a remote store, many at once, retried.

The first epoch of a remote source reads, per chunk, only the column chunks of the
selected columns: their byte ranges come from the (cached) footer, nearby ranges are
merged into one request, long ones are split, and the requests run on a thread pool
bounded by the bytes in flight (:attr:`RemoteSettings.max_inflight_bytes`) and the
number of requests (:attr:`RemoteSettings.max_requests`), not by files. The reader
starts the fetches of chunks ahead of the one being decoded
(:attr:`RemoteSettings.readahead_bytes`), so request latency overlaps with decoding.

Transient failures (HTTP 5xx, 429 and 408, throttling, connection resets, timeouts,
short bodies) are retried with exponential backoff and full jitter; after the last
try a :class:`~gpuload.SourceError` names the object, the range and the last error. A
chunk whose ranges could not all be fetched is never decoded, so never cached.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread
import threading
import time
import itertools
import queue
import weakref
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from ..errors import SourceError
from .ranges import coalesce
from .retry import Truncated, retry
from .settings import RemoteSettings, RemoteStats

__all__ = ["Fetcher", "Job"]


class _Budget:
    """A counting limit on bytes, granted first come first served; a request larger than
    the whole limit runs alone."""

    def __init__(self, limit: int):
        self.limit, self.used, self._next, self._serving = limit, 0, 0, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket and self.used + n <= self.limit)
            self._serving += 1
            self.used += n
            self._cond.notify_all()
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class Job:
    """The fetch of one object's ranges: :meth:`result` waits for all of them."""

    def __init__(self, futures: list[Future], ranges: list[tuple[int, int]], nbytes: int,
                 check: Future | None = None, stop: threading.Event | None = None):
        self.futures, self.ranges, self.nbytes, self.check = futures, ranges, nbytes, check
        self.stop = stop  # set: the fetcher was closed, and result() gives up at once

    def done(self) -> bool:
        return all(f.done() for f in self.futures) and (self.check is None or self.check.done())

    def result(self) -> dict[int, bytes]:
        """``{start: bytes}`` of the fetched spans (split requests joined again); the first
        failure's :class:`SourceError` if any failed."""
        out: dict[int, bytes] = {}
        pending: list[bytes] = []
        start = end = None
        if self.check is not None:
            _wait(self.check, self.stop)
        for (a, b), f in zip(self.ranges, self.futures):
            data = _wait(f, self.stop)
            if a != end and pending:
                out[start] = pending[0] if len(pending) == 1 else b"".join(pending)
                pending = []
            if not pending:
                start = a
            pending.append(data)
            end = b
        if pending:
            out[start] = pending[0] if len(pending) == 1 else b"".join(pending)
        return out

    def cancel(self) -> None:
        for f in [*self.futures, *([self.check] if self.check is not None else [])]:
            f.cancel()


def _wait(f: Future, stop: threading.Event | None = None):
    """``f``'s result; a :class:`SourceError` as soon as ``stop`` is set (checked every 0.1 s)
    or ``f`` is cancelled, so a load never waits on a stalled request of a closed fetcher."""
    while True:
        try:
            return f.result(timeout=None if stop is None else 0.1)
        except CancelledError:
            break
        except (TimeoutError, FutureTimeout):
            if f.done():  # the request's own timeout
                raise
            if stop.is_set():
                break
    raise SourceError("a remote fetch was abandoned: the dataset was closed, or its epoch ended early (an exception, "
                      "Ctrl-C, the loop left); start the epoch again") from None


class _Requests:
    """``workers`` threads running submitted calls in priority order (lowest first): requests
    of the fetches decoders wait on first, then those started ahead, each kind in the order the
    fetches began, so the chunk decoding waits for is never queued behind the read-ahead."""

    def __init__(self, workers: int):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads: list[threading.Thread] = []
        self._workers, self._closed, self._lock = workers, False, threading.Lock()

    def submit(self, priority: tuple, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            self._q.put((priority, next(self._order), fut, fn, args))
            if len(self._threads) < self._workers and self._q.qsize() > 0:
                t = threading.Thread(target=self._run, name=f"gpuload-fetch-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def _run(self) -> None:
        while self._one(self._q.get()):
            pass

    @staticmethod
    def _one(item) -> bool:
        """Run one queued call (False: the thread should end). Its own frame, so that an idle
        thread keeps no reference to the last call (and so to its fetcher)."""
        _, _, fut, fn, args = item
        if fut is None:
            return False
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter
                fut.set_exception(e)
        return True

    def close(self) -> None:
        """Cancel what is queued and let the threads end."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item[2] is not None:
                item[2].cancel()
        for _ in range(threads):
            self._q.put(((float("inf"),), next(self._order), None, None, ()))


_LIVE: "weakref.WeakSet[Fetcher]" = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit, before Python joins the loader threads: stop every fetcher, so that
    no load waits on a stalled request (Ctrl-C during a remote first epoch exits at once)."""
    for fetcher in list(_LIVE):
        fetcher.interrupt()


concurrent.futures.thread  # noqa: B018 - imported first, so its exit hook (joining pool threads) runs after ours
getattr(threading, "_register_atexit", atexit.register)(_stop_all)


class Fetcher:
    """Runs range requests to one :class:`~gpuload.sources.remote.Store` on a bounded pool, retried and timed.

    :meth:`close` (called by the dataset's ``close()``, when an epoch ends early, and at
    interpreter exit) abandons requests in flight and queued within 0.1 s."""

    def __init__(self, store, settings: RemoteSettings, clock: Callable[[], float] = time.perf_counter):
        self.store, self.settings, self.clock = store, settings, clock
        self._pool = _Requests(settings.max_requests)
        self._pools = [self._pool]  # the current pool, for the finalizer (which may not hold self)
        weakref.finalize(self, lambda pools: pools[0].close(), self._pools)  # a dropped dataset's threads end
        self._jobs = itertools.count()
        self._budget = _Budget(settings.max_inflight_bytes)
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.reset()
        _LIVE.add(self)

    def reset(self) -> None:
        """Forget the request statistics."""
        with self._lock:
            self._lat: list[float] = []
            self._bytes = self._retried = self._failed = 0

    def stats(self) -> RemoteStats:
        """Requests made since creation or :meth:`reset`."""
        with self._lock:
            lat, nb, retried, failed = sorted(self._lat), self._bytes, self._retried, self._failed

        def q(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        return RemoteStats(len(lat), nb, retried, failed, q(0.5), q(0.9), q(0.99))

    def _retried_once(self) -> None:
        with self._lock:
            self._retried += 1

    def get(self, path: str, start: int, end: int, stop: threading.Event | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``path``, retried; on the calling thread. ``stop``: the event of the
        fetch it serves (default: the fetcher's now), refused once set."""
        stop = self.stop if stop is None else stop
        self._refuse_if_stopped(path, stop)
        def once() -> bytes:
            t0 = self.clock()
            try:
                data = self.store.read(path, start, end, timeout=self.settings.timeout_s or None, stop=stop)
            except asyncio.TimeoutError:  # fsspec's FSTimeoutError says nothing itself
                raise TimeoutError(f"not done within timeout_s={self.settings.timeout_s:g} s (no answer, or a link too "
                                   "slow for the range: raise timeout_s)") from None
            if len(data) > end - start:
                raise SourceError(f"{self.store.url(path)}: asked for bytes {start}-{end - 1}, got {len(data)} "
                                  "bytes: the server ignores Range requests, which gpuload needs; serve the "
                                  "objects from a server that honours them")
            if len(data) < end - start:
                raise Truncated(f"the body ended after {len(data)} of {end - start} bytes")
            t1 = self.clock()
            with self._lock:
                self._lat.append(t1 - t0)
                self._bytes += len(data)
            return bytes(data)

        try:
            return retry(once, f"{self.store.url(path)} (bytes {start}-{end - 1})", self.settings,
                         self._retried_once, stop)
        except SourceError:
            with self._lock:
                self._failed += 1
            raise

    def _one(self, path: str, start: int, end: int, stop: threading.Event) -> bytes:
        granted = self._budget.acquire(end - start)
        try:  # a fetch of an epoch interrupted while this waited for the budget: not made (resume() made a new stop)
            return self.get(path, start, end, stop)
        finally:
            self._budget.release(granted)

    def start(self, path: str, ranges, check: Callable[[], None] | None = None, urgent: bool = False) -> Job:
        """Start fetching the (coalesced) ``ranges`` of ``path``; returns at once. ``check()``
        runs once they have all arrived (the object's identity asked again: a rewrite
        between listing and fetching must not be decoded as the listed version). An ``urgent``
        fetch (one a decoder waits on now) is queued before every fetch started ahead."""
        self._refuse_if_stopped(path)
        s, stop, pool = self.settings, self.stop, self._pool
        merged = coalesce(ranges, s.coalesce_bytes, s.max_range_bytes)
        job = (0 if urgent else 1, next(self._jobs))
        try:
            futures = [pool.submit((job, 1, i), self._one, path, a, b, stop) for i, (a, b) in enumerate(merged)]
            after = None
            if check is not None:
                def verify() -> None:  # queued after this fetch's ranges and before any later fetch's
                    for f in futures:  # all dequeued already, so running or done: this waits on no queue
                        f.result()
                    retry(check, f"{self.store.url(path)}: asking its version again", self.settings,
                          self._retried_once, stop)

                after = pool.submit((job, 2, 0), verify)
        except RuntimeError:  # interrupted meanwhile: the pool is closed
            self._refuse_if_stopped(path)
            raise
        return Job(futures, merged, sum(b - a for a, b in merged), after, stop)

    def interrupt(self) -> None:
        """Abandon the requests in flight and queued (each within 0.1 s) and refuse new ones with a
        :class:`SourceError` until :meth:`resume`: an epoch that ended early, or a closed dataset."""
        self.stop.set()
        self._pool.close()

    def resume(self) -> None:
        """Take requests again after :meth:`interrupt` (a new epoch); what was abandoned stays so."""
        with self._lock:
            if self.stop.is_set():
                self.stop = threading.Event()
                self._pool = self._pools[0] = _Requests(self.settings.max_requests)

    def _refuse_if_stopped(self, what: str, stop: threading.Event | None = None) -> None:
        if (self.stop if stop is None else stop).is_set():
            raise SourceError(f"{self.store.url(what)}: not fetched: the dataset was closed, or its epoch ended "
                              "early (an exception, Ctrl-C, the loop left); start the epoch again")

    def close(self) -> None:
        """:meth:`interrupt`, and close the store's open files (:meth:`resume` takes requests again)."""
        self.interrupt()
        self.store.close()
