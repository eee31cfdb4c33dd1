"""A producer thread and a training loop recording into a :class:`gpuload.Metrics` in real time.

For the tests of what is recorded (threads, spans, waits, trace tracks), never of how
long it took: a busy machine stretches real sleeps by any amount.
"""

from __future__ import annotations

import queue
import threading
import time

from gpuload.observe.metrics import Metrics


def run_producer_consumer(m: Metrics, n: int, produce_ms: float, step_ms: float, depth: int = 4) -> None:
    """A background producer making an item every ``produce_ms`` into a bounded queue;
    the calling thread takes ``n`` items, records each wait, and steps ``step_ms``.
    Real threads and sleeps: for tests of what is recorded, not of how long it took."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def produce():
        for i in range(n):
            with m.span("decode", nbytes=1000, rows=10):
                time.sleep(produce_ms / 1000)
            q.put(i)
            m.queue_depth(q.qsize())

    threading.Thread(target=produce, name="test-producer", daemon=True).start()
    for _ in range(n):
        t0 = time.perf_counter()
        q.get()
        m.consumer_wait(t0, time.perf_counter(), rows=10, nbytes=1000)
        time.sleep(step_ms / 1000)
    t0 = time.perf_counter()
    m.consumer_end(t0, time.perf_counter())

