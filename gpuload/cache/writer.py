"""The cache's background writer: chunk files written (and fsynced) on threads of their own.

Without a budget, a chunk built by a loader thread is handed to the writer of its cache
folder, whose :data:`THREADS` threads each write a chunk, fsync it, rename it into place
and release its build lock, so decoding goes on meanwhile. At most :data:`PENDING` chunks
are with the writer at once (the caller blocks beyond that): the host memory bound counts
them (:func:`gpuload.memory.host_budget`, ``pending_writes``).

Two threads, so that one chunk's fsync (waiting for the disk) overlaps the next one's
checksums and copies (into the page cache, or a direct write's bounce buffer): on the H200 node the fsync was half the lone
writer thread's time in a first epoch with cuDF, and the loader threads waited 1.6 s for
it; on the 2-core VM a first epoch of 8M rows took 8.87 s with one thread, 7.58 s with two
and 7.49 s with no fsync at all (medians of 3). Every file is still on disk before it has
its name: a power cut leaves a chunk whole or absent, whatever a later reader checks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

__all__ = ["PENDING", "Writer", "Writing"]

log = logging.getLogger("gpuload")

PENDING = 2  #: chunks with one folder's writer at once (being written or waiting)
THREADS = 2  #: writer threads per cache folder


class Writing(dict):
    """A chunk's column set that the cache writer is writing from these very arrays: nothing may
    change them until ``written`` is set (once the writer is done with them, written or not).
    :meth:`gpuload.cache.store.ChunkCache.load` hands one out with ``shared=True``; the pipeline waits for it before
    cutting the chunk's batches, which are views of it (``_Lookahead.take`` in :mod:`gpuload.pipeline`)."""

    def __init__(self, cols: dict):
        super().__init__(cols)
        self.written = threading.Event()


class Writer:
    """A cache folder's writer threads (they end when the writer is collected: hold no
    reference back to it)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gpuload-write")
        self._slots = threading.Semaphore(PENDING)  # chunks with the writer, at most
        self._flushing = threading.Lock()  # two flushes taking slots at once would each wait for the other's

    def submit(self, write: Callable, key, make_cols: Callable[[], dict], lock, metrics=None,
               done: threading.Event | None = None) -> None:
        """``write(key, make_cols())`` on the writer thread (``make_cols`` called here: e.g. a device
        chunk copied back to the host), then release ``lock`` (any object with ``release()``); waits
        while :data:`PENDING` chunks are pending. ``lock`` is the writer's once this returns.
        Each such wait is a ``write_wait`` span of ``metrics`` (a :class:`gpuload.Metrics`, default
        None): the writer holding back the thread that built the chunk. ``done`` (default None) is
        set once the writer is done with the chunk, written or not (also when this call fails)."""
        if not self._slots.acquire(blocking=False):
            t0 = None if metrics is None else metrics.clock()
            self._slots.acquire()
            try:
                if metrics is not None:
                    metrics.record("write_wait", t0, metrics.clock())
            except BaseException:  # a failing clock (or Ctrl-C here): no slot is lost
                self._slots.release()
                if done is not None:
                    done.set()
                raise
        try:
            # in a list the writer empties: the executor's work item holds its arguments until after the slot
            # is given back, and a chunk's arrays (the read pool's buffers) should be free by then, for the next
            self._pool.submit(self._write_and_release, write, key, [make_cols()], lock, done)
        except BaseException:  # make_cols failed (a device copy), or interpreter shutdown: give the slot back
            self._slots.release()
            if done is not None:
                done.set()
            raise

    def _write_and_release(self, write: Callable, key, held: list, lock, done) -> None:
        try:
            write(key, held.pop())  # an OSError is the write's to say; anything else would be lost in the pool
        except Exception:
            log.exception("gpuload: writing the cache file of %s failed; the chunk is not cached", key)
        finally:
            if done is not None:
                done.set()
            lock.release()
            self._slots.release()

    def flush(self) -> None:
        """Wait until every write handed over so far has finished (safe from several threads at once)."""
        with self._flushing:
            taken = 0
            try:  # every slot back, even if a signal's exception cuts the wait short
                for _ in range(PENDING):
                    self._slots.acquire()
                    taken += 1
            finally:
                for _ in range(taken):
                    self._slots.release()
