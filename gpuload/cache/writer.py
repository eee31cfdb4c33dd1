"""The cache's background writer: chunk files written on a thread of their own.

Without a budget, a chunk built by a loader thread is handed to one writer thread per
cache folder, which writes it and then releases the chunk's build lock, so decoding goes
on meanwhile. At most :data:`PENDING` chunks wait for it (the caller blocks beyond that):
the host memory bound counts them (:func:`gpuload.memory.host_budget`, ``pending_writes``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

__all__ = ["PENDING", "Writer"]

log = logging.getLogger("gpuload")

PENDING = 2  #: chunks that may wait for one writer thread at once


class Writer:
    """One writer thread (it ends when the writer is collected: hold no reference back to it)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuload-write")
        self._slots = threading.Semaphore(PENDING)  # chunks waiting to be written, at most
        self._flushing = threading.Lock()  # two flushes taking slots at once would each wait for the other's

    def submit(self, write: Callable, key, make_cols: Callable[[], dict], lock,
               waited: Callable[[float, float], None] | None = None, clock: Callable[[], float] = time.perf_counter
               ) -> None:
        """``write(key, make_cols())`` on the writer thread (``make_cols`` called here: e.g. a copy
        the caller may not change), then release ``lock`` (any object with ``release()``); waits
        while :data:`PENDING` chunks are pending. ``lock`` is the writer's once this returns.
        ``waited(t0, t1)``, where given, is told each such wait (``clock`` seconds): the writer
        holding back the thread that built the chunk."""
        if not self._slots.acquire(blocking=False):
            t0 = clock()
            self._slots.acquire()
            if waited is not None:
                waited(t0, clock())
        try:
            self._pool.submit(self._write_and_release, write, key, make_cols(), lock)
        except BaseException:  # a failed copy, or interpreter shutdown: give the slot back
            self._slots.release()
            raise

    def _write_and_release(self, write: Callable, key, cols: dict, lock) -> None:
        try:
            write(key, cols)  # an OSError is the write's to say; anything else would be lost in the pool
        except Exception:
            log.exception("gpuload: writing the cache file of %s failed; the chunk is not cached", key)
        finally:
            lock.release()
            self._slots.release()

    def flush(self) -> None:
        """Wait until every write handed over so far has finished (safe from several threads at once)."""
        with self._flushing:
            for _ in range(PENDING):
                self._slots.acquire()
            for _ in range(PENDING):
                self._slots.release()
