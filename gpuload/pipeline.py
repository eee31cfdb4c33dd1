"""Pipeline: background threads that load chunks ahead and assemble batches.

The training thread only takes finished batches from a bounded queue. Behind it, one
producer thread walks the epoch's windows in plan order, a thread pool loads chunks
(cache reads or decodes) up to ``prefetch`` chunks ahead, and the
producer permutes, slices and hands off each batch. Futures are consumed in plan
order, so thread count and prefetch depth never change the order (invariant 1).
Memory is bounded by the window, the chunks in flight and the batch queue.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from .batch import Batcher, concat, nbytes, nrows, rows
from .plan import Segment

__all__ = ["Background", "epoch_batches"]

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Background:
    """Runs ``make()`` (an iterator factory) on a daemon thread; iterate to get its items.

    At most ``depth`` items wait in the queue. An exception in the thread is raised
    in the consumer at the point it happened. :meth:`close` stops the thread early.
    """

    def __init__(self, make: Callable[[threading.Event], Iterator], depth: int, name: str = "gpuload-producer"):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make) -> None:
        try:
            for item in make(self.stop):
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer
            self._put(_Failure(e))

    def __iter__(self):
        return self

    def __next__(self):
        item = self._q.get()
        if item is _END:
            self._q.put(_END)
            raise StopIteration
        if isinstance(item, _Failure):
            self._q.put(item)
            raise item.exc
        return item

    def depth(self) -> int:
        """Items ready in the queue now."""
        return self._q.qsize()

    def close(self) -> None:
        """Stop the producer and drop what it queued."""
        self.stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)


class _Lookahead:
    """Loads segments' chunks on a pool, ``ahead`` segments beyond the one being taken."""

    def __init__(self, pool: ThreadPoolExecutor, segments: Sequence[Segment], load: Callable[[int], dict],
                 ahead: int, warm: Callable[[int], bool] | None = None):
        self._pool, self._segments, self._load, self._ahead, self._warm = pool, segments, load, ahead, warm
        self._futures: deque[Future] = deque()
        self._next = self._warmed = 0

    def _fill(self, upto: int) -> None:
        while self._next < min(upto, len(self._segments)):
            self._futures.append(self._pool.submit(self._load, self._segments[self._next].chunk))
            self._next += 1
        # remote sources: start the fetches of later chunks, as far as the reader's read-ahead allows
        self._warmed = max(self._warmed, self._next)
        while self._warm is not None and self._warmed < len(self._segments):
            if not self._warm(self._segments[self._warmed].chunk):
                break
            self._warmed += 1

    def take(self, index: int) -> dict:
        """Column set of segment ``index`` (segments must be taken in order)."""
        self._fill(index + 1 + self._ahead)
        cols = self._futures.popleft().result()
        s = self._segments[index]
        return cols if s.lo == 0 and s.hi == nrows(cols) else rows(cols, s.lo, s.hi)

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()


def epoch_batches(windows: Sequence[Sequence[Segment]], sizes: Sequence[int], load: Callable[[int], dict],
                  permutation: Callable[[int, int], object] | None, handoff: Callable[[dict], object],
                  *, threads: int, prefetch: int, stop: threading.Event, alloc=None,
                  enter: Callable[[], contextlib.AbstractContextManager] | None = None, metrics=None,
                  warm: Callable[[int], bool] | None = None, forget: Callable[[], None] | None = None) -> Iterator:
    """Yield this rank's batches for one epoch, handed off, in plan order.

    Parameters
    ----------
    windows : the rank's segments grouped into shuffle windows.
    sizes : planned batch sizes.
    load : chunk index -> column set.
    permutation : (window index, rows) -> row permutation, or None for no shuffling.
    handoff : column set -> what the consumer receives (tensors on the target device).
    threads, prefetch : loader threads; chunks loaded beyond the current window.
    stop : set when the consumer has gone away.
    alloc : ``alloc(shape, dtype)`` for window buffers (default: new arrays).
    enter : a context every loader thread runs inside (the GPU path's device, stream
        and allocator: :meth:`gpuload.gpu.DeviceContext.active`).
    metrics : a :class:`gpuload.Metrics`; records a ``batch`` span for each window's
        concatenation and for cutting (gathering) and handing off each batch.
    warm, forget : remote sources: ``warm(chunk)`` starts a chunk's fetch ahead of its load
        (False: not now, the read-ahead is full); ``forget()`` drops unused ones at the end.
    """
    enter = enter or contextlib.nullcontext
    try:
        with enter():
            yield from _batches(windows, sizes, load, permutation, handoff, threads, prefetch, stop, alloc, enter,
                                metrics, warm)
    finally:
        if forget is not None:
            forget()


def _timed(batches: Iterator, handoff, metrics) -> Iterator:
    """Hand off each batch of ``batches``, recording the time to cut and hand it off."""
    if metrics is None:
        for b in batches:
            yield handoff(b)
        return
    while True:
        with metrics.span("batch") as span:
            b = next(batches, None)
            if b is not None:
                out = handoff(b)
                span.nbytes, span.rows = nbytes(b), nrows(b)
        if b is None:
            return
        yield out


def _batches(windows, sizes, load, permutation, handoff, threads, prefetch, stop, alloc, enter, metrics,
             warm) -> Iterator:
    def load_in(i: int) -> dict:
        with enter():
            return load(i)

    segments = [s for w in windows for s in w]
    ahead = prefetch
    batcher = Batcher(sizes)
    pos = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpuload-load") as pool:
        look = _Lookahead(pool, segments, load_in, ahead, warm)
        try:
            for w, window in enumerate(windows):
                parts = []
                for _ in window:
                    parts.append(look.take(pos))
                    pos += 1
                    if stop.is_set():
                        return
                if permutation is None:
                    for p in parts:
                        yield from _timed(batcher.add(p), handoff, metrics)
                else:
                    with contextlib.nullcontext() if metrics is None else metrics.span("batch") as span:
                        cols = concat(parts, alloc)
                        del parts
                        perm = permutation(w, nrows(cols))
                        if span is not None:
                            span.nbytes = nbytes(cols)
                    yield from _timed(batcher.add(cols, perm), handoff, metrics)
        finally:
            look.cancel()
    if not batcher.done:
        raise RuntimeError("gpuload internal error: the epoch ended before every planned batch was cut")
