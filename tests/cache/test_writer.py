"""The cache's background writer: at most PENDING chunks wait, flush waits for them all, and each
chunk's lock is released after its write, even a failed one."""

from __future__ import annotations

import threading

import pytest

from gpuload.cache.writer import PENDING, Writer


def _flushes(writer: Writer) -> bool:
    """Whether ``writer.flush()`` returns within 10 s (a leaked slot would keep it waiting)."""
    t = threading.Thread(target=writer.flush, daemon=True)
    t.start()
    t.join(10)
    return not t.is_alive()


class _Lock:
    def __init__(self):
        self.released = threading.Event()

    def release(self):
        self.released.set()


def test_at_most_pending_chunks_wait_and_flush_waits_for_them():
    gate, done = threading.Event(), []
    writer = Writer()

    def write(key, cols):
        gate.wait(10)
        done.append(key)

    locks = [_Lock() for _ in range(PENDING + 2)]
    submitted = threading.Event()

    def submit_all():
        for i, lock in enumerate(locks):
            writer.submit(write, i, lambda: {}, lock)
        submitted.set()

    t = threading.Thread(target=submit_all)
    t.start()
    assert not submitted.wait(0.3)  # the writer is busy and PENDING chunks wait: the caller blocks
    gate.set()
    t.join(10)
    writer.flush()
    assert done == list(range(PENDING + 2)) and all(lock.released.is_set() for lock in locks)


def test_a_failed_write_still_releases_its_lock_and_slot():
    writer = Writer()

    def write(key, cols):
        raise OSError("disk gone")

    locks = [_Lock() for _ in range(PENDING + 1)]
    for lock in locks:
        writer.submit(write, "k", lambda: {}, lock)
    assert _flushes(writer) and all(lock.released.is_set() for lock in locks)


def test_a_failed_copy_gives_the_slot_back():
    writer = Writer()
    for _ in range(PENDING + 1):
        with pytest.raises(MemoryError):
            writer.submit(lambda k, c: None, "k", lambda: (_ for _ in ()).throw(MemoryError()), _Lock())
    assert _flushes(writer)  # no slot leaked


def test_a_caller_that_waits_for_a_slot_is_told_how_long_in_the_given_clock():
    """The loader thread held back by the writer: ``waited(t0, t1)`` once per submit that
    blocked, in the caller's clock; never for a submit that found a free slot."""
    gate, waits = threading.Event(), []
    ticks = iter(range(100))
    writer = Writer()

    def write(key, cols):
        gate.wait(10)

    def submit(i):
        writer.submit(write, i, lambda: {}, _Lock(), lambda t0, t1: waits.append((i, t0, t1)), lambda: next(ticks))

    for i in range(PENDING):  # the writer takes these: no wait
        submit(i)
    assert waits == []
    t = threading.Thread(target=submit, args=(PENDING,))
    t.start()
    t.join(0.3)
    assert t.is_alive() and waits == []  # blocked, not told yet
    gate.set()
    t.join(10)
    writer.flush()
    assert waits == [(PENDING, 0, 1)]
