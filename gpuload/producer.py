"""The producer thread and the training thread's side of it.

:class:`Background` runs a loader's producer (an iterator factory) on a daemon thread and
hands its items to the training thread through a bounded queue: an exception there is
raised here, where it happened in the stream, and :meth:`Background.close` stops it.
:func:`handed_out` is the training thread's loop over it: each wait inside ``next()``
measured, the pass closed when it ends or is left. :func:`lowered_priority` lowers the
producer (and the threads it starts) ``nice`` steps below the training thread
(docs/architecture.md, Threads). The dataset (:mod:`gpuload.running`) and a mix
(:mod:`gpuload.mix`) each run one per iteration.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Callable, Iterator

from .batch import nbytes, nrows

__all__ = ["Background", "handed_out", "lowered_priority"]

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def lowered_priority(nice: int) -> Callable[[], None]:
    """What a background thread calls first to run ``nice`` steps below the calling thread
    (on Linux the nice value belongs to each thread, and threads it starts inherit it).

    Called on the thread that starts the work (the training thread), it returns a function
    for the new thread; ``nice=0``, other systems, or a priority that cannot be lowered
    leave the thread as it is. Lowering is allowed without privileges; raising is not, so
    a thread already at or below the target stays where it is.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):  # elsewhere a thread id may name another process
        return lambda: None
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)  # PRIO_PROCESS 0: the calling thread, on Linux

    def lower() -> None:
        tid = threading.get_native_id()
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except OSError:  # a sandbox that forbids it: run at the inherited priority
            pass

    return lower


def handed_out(producer: Background, metrics, receive: Callable, taken: Callable,
               ending: Callable[[], None] | None = None) -> Iterator:
    """The training thread's side of a loader: each item of ``producer`` made a batch by
    ``receive(item)``, the wait inside ``next()`` and the queue's depth recorded in ``metrics``,
    ``taken(item)`` called just before the batch is handed out (a state taken then counts it);
    the pass closed in ``metrics`` when it ends, or when the loop is left early. ``ending()``
    runs inside the ``next()`` that ends the pass, before it is closed: what it waits for (the
    next epoch's first loads) is the pass's waiting, in its wall time."""
    m = metrics
    t0 = m.clock()
    try:
        for item in producer:
            batch = receive(item)
            t1 = m.clock()
            m.consumer_wait(t0, t1, rows=nrows(batch), nbytes=nbytes(batch))
            m.queue_depth(producer.depth())
            taken(item)
            yield batch
            t0 = m.clock()
        if ending is not None:
            ending()
        m.consumer_end(t0, m.clock())
    except GeneratorExit:  # the loop was left early
        t = m.clock()
        m.consumer_end(t, t)
        raise


class Background:
    """Runs ``make()`` (an iterator factory) on a daemon thread; iterate to get its items.

    At most ``depth`` items wait in the queue. An exception in the thread is raised
    in the consumer at the point it happened. :meth:`close` stops the thread early.
    The thread runs ``nice`` steps below the thread that made it (default 0: the same;
    :func:`lowered_priority`), and so do the threads it starts (loader, window, writer and
    fetch threads), so a training step's own threads get a core first.
    """

    def __init__(self, make: Callable[[threading.Event], Iterator], depth: int, name: str = "gpuload-producer",
                 nice: int = 0):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.finished = False  # the consumer took the last item
        self._lower = lowered_priority(nice)
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
        self._lower()
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
            self.finished = True
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
