"""The cache's background writer: at most PENDING chunks wait, THREADS are written at once, flush
waits for them all, and each chunk's lock is released after its write, even a failed one."""

from __future__ import annotations

import threading
import types

import pytest

from gpuload.cache.writer import PENDING, THREADS, Writer


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
    assert sorted(done) == list(range(PENDING + 2)) and all(lock.released.is_set() for lock in locks)


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
    """The loader thread held back by the writer: a ``write_wait`` span once per submit that
    blocked, in the metrics' clock; never for a submit that found a free slot."""
    gate, waits = threading.Event(), []
    ticks = iter(range(100))
    writer = Writer()

    def write(key, cols):
        gate.wait(10)

    def submit(i):
        def record(stage, t0, t1):
            assert stage == "write_wait"
            waits.append((i, t0, t1))

        metrics = types.SimpleNamespace(clock=lambda: next(ticks), record=record)
        writer.submit(write, i, lambda: {}, _Lock(), metrics)

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


def test_chunks_are_written_on_several_threads_at_once():
    """One chunk's write (its fsync waiting for the disk) does not hold up the next: THREADS writes
    run together (each waits here until all of them have started)."""
    assert THREADS == PENDING == 2
    together, names = threading.Barrier(THREADS, timeout=10), []
    writer = Writer()

    def write(key, cols):
        names.append(threading.current_thread().name)
        together.wait()  # raises BrokenBarrierError (logged, the chunk not cached) if they ran one by one

    locks = [_Lock() for _ in range(THREADS)]
    for i, lock in enumerate(locks):
        writer.submit(write, i, lambda: {}, lock)
    writer.flush()
    assert not together.broken and len(set(names)) == THREADS and all(n.startswith("gpuload-write") for n in names)


def test_a_failing_wait_callback_gives_the_slot_back():
    gate = threading.Event()
    writer = Writer()
    for i in range(PENDING):
        writer.submit(lambda k, c: gate.wait(10), i, lambda: {}, _Lock())
    threading.Timer(0.2, gate.set).start()

    def boom(stage, t0, t1):
        raise RuntimeError("a metrics clock that fails")

    with pytest.raises(RuntimeError, match="clock"):
        writer.submit(lambda k, c: None, "x", lambda: {}, _Lock(), types.SimpleNamespace(clock=lambda: 0.0, record=boom))
    assert _flushes(writer)  # no slot leaked


def test_a_written_chunk_is_let_go_before_its_slot():
    """A chunk's arrays are free by the time its slot is given back (the read pool's buffers, for the
    next chunks), not still held by the writer's thread pool (its work item keeps its arguments until
    after the slot is back)."""
    writer, freed, at_release = Writer(), [], []

    class Chunk:  # made by the copy (make_cols): nothing else holds it
        def __init__(self):
            self.freed = threading.Event()
            freed.append(self.freed)

        def __del__(self):
            self.freed.set()

    slots = writer._slots

    class Slots:  # records, as each slot comes back, whether every chunk submitted before is free
        def acquire(self, *args, **kwargs):
            return slots.acquire(*args, **kwargs)

        def release(self):
            at_release.append(all(f.is_set() for f in freed))
            slots.release()

    writer._slots = Slots()
    for i in range(3 * PENDING):
        writer.submit(lambda k, c: None, i, lambda: {"a": Chunk()}, _Lock())
        writer.flush()  # waits for the chunk's write: its slot comes back once it is written
    assert at_release[:3 * PENDING] == [True] * (3 * PENDING)


@pytest.mark.parametrize("how", ["written", "write fails", "copy fails"])
def test_done_is_set_whatever_becomes_of_the_chunk(how):
    """Whoever waits for a chunk's write (its batches are views of what the writer writes) is let
    go in every case: a hang here would stop the training loop."""
    writer, done = Writer(), threading.Event()

    def write(key, cols):
        if how == "write fails":
            raise OSError("disk gone")

    def make():
        if how == "copy fails":
            raise MemoryError()
        return {}

    if how == "copy fails":
        with pytest.raises(MemoryError):
            writer.submit(write, "k", make, _Lock(), done=done)
    else:
        writer.submit(write, "k", make, _Lock(), done=done)
    assert done.wait(10) and _flushes(writer)
