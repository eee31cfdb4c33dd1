"""Pipeline: background threads that load chunks ahead and assemble batches.

The training thread only takes finished batches from a bounded queue
(:mod:`gpuload.producer`), which the producer thread fills. Behind it, a
thread pool loads chunks (cache reads or decodes) up to ``prefetch`` chunks ahead, a
window thread joins each shuffle window's chunks and draws its permutation while the
window before it is being cut, and one producer thread slices and hands off each batch (on
the CPU its gathers and tensors are made on ``cut_threads`` threads at once, taken back in
order). Futures are consumed in plan order, so thread count and prefetch depth never change
the order (docs/architecture.md, Invariants 1).
Memory is bounded by the window, the chunks in flight and the batch queue.

On the GPU path the loader threads run on one CUDA stream and the window and producer
threads on another (:class:`Stages`, implemented by
:class:`gpuload.gpu.streams.DeviceContext`): each loaded chunk crosses from the first to
the second with an event, received before the chunk's first use.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from .batch import Batcher, Parts, concat, long_runs, nbytes, nrows, rows
from .machine import cores as usable_cores
from .plan import Segment

__all__ = ["epoch_batches", "Stages", "cut_threads"]


class Stages:
    """Where the two sides of the pipeline run, and how a chunk crosses between them (here:
    the CPU path, where nothing is needed).

    * :meth:`reading`: the context every loader thread loads a chunk in;
    * :meth:`batching`: the context the window thread and the producer thread run in;
    * :meth:`handover`: on the loader thread, inside :meth:`reading`, right after a chunk is
      loaded: what travels to the taking side (the GPU path adds the chunk's ready event);
    * :meth:`receive`: on the taking thread, inside :meth:`batching`, before the chunk's
      first use (slicing included): the column set (the GPU path makes the batch stream
      wait for the chunk's event first).
    """

    def reading(self):
        return contextlib.nullcontext()

    def batching(self):
        return contextlib.nullcontext()

    def handover(self, cols: dict):
        return cols

    def receive(self, item) -> dict:
        return item


def cut_threads(num_threads: int, cores: int | None = None) -> int:
    """Threads the CPU path gathers batches on: the loader's ``num_threads`` where the process
    has cores for them beside the loader threads, the producer and the training thread
    (``cores``: default :func:`gpuload.machine.cores`, its affinity and CPU quota), else 1 (the producer alone). Measured on 2 cores,
    cached epochs of 8M rows: gathering on 2 threads was 1.3x as fast with no training step, and
    9% slower with a 2 ms step and a consumer copying every tensor (threads fighting for the
    two cores): docs/benchmarks.md, "Gathering batches on several threads"."""
    if cores is None:
        cores = usable_cores()
    return num_threads if cores >= num_threads + 3 else 1


class _Lookahead:
    """Loads segments' chunks on a pool, ``ahead`` segments beyond the one being taken."""

    def __init__(self, pool: ThreadPoolExecutor, segments: Sequence[Segment], load: Callable[[int], object],
                 ahead: int, warm: Callable[[int], bool] | None = None, receive: Callable[[object], dict] = None,
                 preloaded=None):
        self._pool, self._segments, self._load, self._ahead, self._warm = pool, segments, load, ahead, warm
        self._receive = receive or (lambda item: item)
        self._preloaded = preloaded  # a gpuload.preload.Preload, or None
        self._futures: deque[tuple[Future, bool]] = deque()  # (load, whether it was preloaded)
        self._next = self._warmed = 0

    def _fill(self, upto: int) -> None:
        while self._next < min(upto, len(self._segments)):
            chunk = self._segments[self._next].chunk
            f = None if self._preloaded is None else self._preloaded.take(chunk)
            self._futures.append((f, True) if f is not None else (self._pool.submit(self._load, chunk), False))
            self._next += 1
        # remote sources: start the fetches of later chunks, as far as the reader's read-ahead allows
        self._warmed = max(self._warmed, self._next)
        while self._warm is not None and self._warmed < len(self._segments):
            chunk = self._segments[self._warmed].chunk  # one the preload holds is loading already
            if not (self._preloaded is not None and self._preloaded.holds(chunk)) and not self._warm(chunk):
                break
            self._warmed += 1

    def queued_all(self) -> bool:
        """Whether every segment's load is queued (or taken from the preload)."""
        return self._next >= len(self._segments)

    def start(self, index: int) -> None:
        """Queue the loads that taking segment ``index`` needs, and those ``ahead`` of it."""
        self._fill(index + 1 + self._ahead)

    def take(self, index: int) -> dict:
        """Column set of segment ``index`` (segments must be taken in order), received (see
        :meth:`Stages.receive`) before it is sliced."""
        self.start(index)
        s = self._segments[index]
        f, preloaded = self._futures.popleft()
        try:
            item = f.result()
        except Exception:
            if not preloaded:
                raise
            item = self._pool.submit(self._load, s.chunk).result()  # interrupted with an earlier iteration: again
        written = getattr(item, "written", None)  # a gpuload.cache.writer.Writing: the cache writer writes from
        if written is not None:  # these very arrays, and the batches cut next are views of them (an in-place
            written.wait()  # change in the step or a batch_transform must not reach the file)
        cols = self._receive(item)
        return cols if s.lo == 0 and s.hi == nrows(cols) else rows(cols, s.lo, s.hi)

    def cancel(self) -> None:
        for f, _ in self._futures:
            f.cancel()


def epoch_batches(windows: Sequence[Sequence[Segment]], sizes: Sequence[int], load: Callable[[int], dict],
                  permutation: Callable[[int, int], object] | None, handoff: Callable[[dict], object],
                  *, threads: int, prefetch: int, stop: threading.Event, alloc=None,
                  stages: Stages | None = None, metrics=None,
                  warm: Callable[[int], bool] | None = None, forget: Callable[[], None] | None = None,
                  batch_alloc=None, cut_threads: int = 1, preloaded=None,
                  loaded: Callable[[], None] | None = None) -> Iterator:
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
    alloc, batch_alloc : ``alloc(shape, dtype)`` for window buffers and for the arrays of
        gathered or joined batches (default: new arrays; see :class:`gpuload.memory.HostPool`);
        a window's are ``alloc(shape, dtype, key, grow)``: its column's key, and the epoch's
        largest window over this one (:meth:`gpuload.memory.HostPool.array`).
    stages : where loads and batching run and how chunks cross between them (default
        :class:`Stages`: the CPU path; the GPU path passes its
        :class:`gpuload.gpu.streams.DeviceContext`).
    metrics : a :class:`gpuload.Metrics`; records a ``batch`` span for each window's
        concatenation and for cutting (gathering) and handing off each batch.
    warm, forget : remote sources: ``warm(chunk)`` starts a chunk's fetch ahead of its load
        (False: not now, the read-ahead is full); ``forget()`` drops unused ones at the end.
    cut_threads : threads that gather batches and make their tensors at once (default 1: the
        producer thread); more only where ``handoff`` can ``prepare`` batches on any thread
        (the CPU path). Batches are still handed on in plan order.
    preloaded : a :class:`gpuload.preload.Preload` whose loads are taken for the chunks it
        holds, in place of new ones (default None).
    loaded : called once, on the producer thread, when the epoch's last loads are under way
        (not when the epoch stops early): the dataset then preloads the next epoch's first
        chunks. Shuffled, when the last window is assembled and the one before it cut: the
        preload takes the place of the window the memory bounds count as being assembled. In
        file order, from the piece after which ``prefetch + 1`` remain, at the first the producer
        takes once every load of the epoch is queued: the next epoch's first ``prefetch + 2``
        chunks (counted in the memory bounds) are read while the last ones are cut, not after (an
        epoch's last ``next()`` waits for them: :mod:`gpuload.preload`); the reader's loads, this
        epoch's and the preload's, run ``num_threads`` at a time.
    """
    stages = stages or Stages()
    try:
        with stages.batching():  # the producer thread: cuts, gathers and hands off batches
            yield from _batches(windows, sizes, load, permutation, handoff, threads, prefetch, stop, alloc, stages,
                                metrics, warm, batch_alloc, cut_threads, preloaded, loaded)
    finally:
        if forget is not None:
            forget()


def _made(cut: Callable[[], dict], hand: Callable[[dict], object], metrics):
    """``hand(cut())``: a batch gathered and handed off (or prepared), timed as a ``batch`` span."""
    if metrics is None:
        return hand(cut())
    with metrics.span("batch") as span:
        b = cut()
        out = hand(b)
        span.nbytes, span.rows = nbytes(b), nrows(b)
    return out


class _Cutters:
    """Batches of a deferred :class:`Batcher` made in their order: on the producer thread one at a
    time (``pool`` None), or on ``pool``'s ``threads`` threads at once (the CPU path: gathers and
    tensors), at most ``threads + 1`` in flight, each handed on when its turn comes; ``drain``
    yields those still in flight."""

    def __init__(self, pool: ThreadPoolExecutor | None, threads: int, handoff, metrics):
        self._pool, self._limit, self._handoff, self._metrics = pool, threads + 1, handoff, metrics
        self._pending: deque[Future] = deque()

    def add(self, cuts: Iterator) -> Iterator:
        for cut in cuts:
            if self._pool is None:
                yield _made(cut, self._handoff, self._metrics)
                continue
            self._pending.append(self._pool.submit(_made, cut, self._handoff.prepare, self._metrics))
            while len(self._pending) > self._limit:
                yield self._handoff.finish(self._pending.popleft().result())

    def drain(self) -> Iterator:
        while self._pending:
            yield self._handoff.finish(self._pending.popleft().result())

    def cancel(self) -> None:
        for f in self._pending:
            f.cancel()


def _batches(windows, sizes, load, permutation, handoff, threads, prefetch, stop, alloc, stages, metrics,
             warm, batch_alloc, cut_threads, preloaded, loaded) -> Iterator:
    def load_in(i: int):
        if stop.is_set():  # the consumer left: queued loads are not run
            raise RuntimeError("gpuload: the epoch was stopped")
        with stages.reading():  # a loader thread: reads or decodes the chunk
            return stages.handover(load(i))

    segments = [s for w in windows for s in w]
    most = max((sum(s.hi - s.lo for s in w) for w in windows), default=0)  # rows of the largest window
    # what is assembled at once: a window (joined and permuted), or in file order one chunk piece
    starts = list(range(len(segments) + 1)) if permutation is None else [0]
    for window in windows if permutation is not None else ():
        starts.append(starts[-1] + len(window))
    # on the CPU, batches are gathered on `cut_threads` threads at once (in order: _Cutters);
    # on a GPU, on the producer thread alone, where its stream and events are
    parallel = cut_threads > 1 and hasattr(handoff, "prepare")
    batcher = Batcher(sizes, batch_alloc, deferred=True)
    halt = threading.Event()  # the epoch ended early: the window being assembled is not wanted
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpuload-load") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuload-window") as assembler, \
            (ThreadPoolExecutor(max_workers=cut_threads, thread_name_prefix="gpuload-cut") if parallel
             else contextlib.nullcontext()) as cutting:
        look = _Lookahead(pool, segments, load_in, prefetch, warm, stages.receive, preloaded)
        cutters = _Cutters(cutting, cut_threads, handoff, metrics)

        def assemble(w: int):
            """Group ``w``'s chunk pieces (in file order), or its rows joined with their permutation."""
            with stages.batching():  # the window thread
                if permutation is not None:  # drawn while the window's chunks load (its size is planned)
                    look.start(starts[w])
                    planned = sum(s.hi - s.lo for s in windows[w])
                    with contextlib.nullcontext() if metrics is None else metrics.span("batch"):
                        perm = permutation(w, planned)
                parts = []
                for pos in range(starts[w], starts[w + 1]):
                    parts.append(look.take(pos))
                    if stop.is_set() or halt.is_set():
                        return None
                if permutation is None:
                    return parts
                if long_runs(perm):  # a host permutation (a GPU's is on the device) of long runs: a block
                    cols = Parts(parts)  # shuffle's batches copy them straight from the chunks, no join
                    got = len(cols)
                else:
                    with contextlib.nullcontext() if metrics is None else metrics.span("batch") as span:
                        # each column its own buffers, made for the epoch's largest window at once
                        grow = most / planned if planned else 1.0
                        # (a list's values grow with its lengths, not its rows: they get no reserve)
                        keyed = None if alloc is None else (lambda shape, dtype, key: alloc(
                            shape, dtype, key, 1.0 if isinstance(key, tuple) and key[-1] == "values" else grow))
                        cols = concat(parts, keyed, keyed=alloc is not None)
                        got = nrows(cols)
                        if span is not None:
                            span.nbytes = nbytes(cols)
                del parts
                if got != planned:
                    raise RuntimeError(f"gpuload internal error: window {w} has {got} rows, {planned} planned")
                return cols, perm

        # window w + 1 is loaded and joined on its own thread while window w is cut into batches,
        # so a window's join never stalls the batch queue (windows are still taken in plan order;
        # one more window in memory: gpuload.ParquetDataset.device_bytes_bound counts it)
        n = len(starts) - 1
        ahead = assembler.submit(assemble, 0) if n else None
        try:
            for w in range(n):
                got = ahead.result()
                yield from cutters.drain()  # the last window's batches are gathered before a third is joined
                ahead = assembler.submit(assemble, w + 1) if w + 1 < n else None
                if got is None:
                    return
                if loaded is not None and (w == n - 1 or (permutation is None and look.queued_all())):
                    loaded()  # the last window is in, its predecessor cut; in file order, once every load is queued
                    loaded = None
                if permutation is None:
                    for p in got:
                        yield from cutters.add(batcher.add(p))
                else:
                    cols, perm = got
                    del got
                    yield from cutters.add(batcher.add(cols, perm))
                    del cols, perm
            yield from cutters.drain()
        finally:
            cutters.cancel()
            if ahead is not None and not ahead.cancel():  # it is taking chunks: stop it, then the loads
                halt.set()
                try:
                    ahead.result()
                except BaseException:  # noqa: S110 - the window is abandoned with the epoch
                    pass
            look.cancel()
    if not batcher.done:
        raise RuntimeError("gpuload internal error: the epoch ended before every planned batch was cut")
