"""The producer thread and the training thread's side of it (gpuload/producer.py): items in
order through a bounded queue, an exception raised where it happened, ``close`` stopping a
producer that waits on a full queue, each ``next()`` measured and the pass closed whether it
ends or is left, and the producer's lowered priority."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from conftest import ManualClock, run_with_timeout, wait_until
from gpuload import running as running_mod
from gpuload.observe.metrics import Metrics
from gpuload.producer import Background, handed_out

pytestmark = pytest.mark.usefixtures("no_leftover_threads")


class Boom(Exception):
    pass


def _counting(n: int, fail_at: int | None = None, made: list | None = None):
    def make(stop: threading.Event):
        for i in range(n):
            if i == fail_at:
                raise Boom(f"item {i}")
            if made is not None:
                made.append(i)
            yield i
    return make


def test_items_come_in_order_and_the_end_is_final():
    bg = Background(_counting(50), depth=3)
    assert list(bg) == list(range(50)) and bg.finished
    with pytest.raises(StopIteration):  # asked again after its end: still the end, no hang
        next(bg)
    bg.close()


def test_an_exception_is_raised_where_it_happened_and_again_if_asked_again():
    bg = Background(_counting(10, fail_at=6), depth=2)
    got = []
    with pytest.raises(Boom, match="item 6"):
        for i in bg:
            got.append(i)
    assert got == [0, 1, 2, 3, 4, 5] and not bg.finished
    with pytest.raises(Boom, match="item 6"):
        next(bg)
    bg.close()


def test_the_queue_bounds_how_far_the_producer_runs_ahead_and_close_stops_it():
    made = []
    bg = Background(_counting(10_000, made=made), depth=4)
    assert next(bg) == 0
    wait_until(lambda: len(made) >= 6, 10)
    assert len(made) <= 1 + 4 + 1  # the one taken, a full queue, and one waiting to be put
    run_with_timeout(bg.close)  # a producer blocked on the full queue sees the stop within its put timeout
    assert not bg._thread.is_alive() and len(made) < 10


def test_each_next_is_measured_and_the_end_waits_inside_the_last_next():
    clock = ManualClock(10.0)
    m = Metrics(clock=clock)
    ended = []

    def make(stop):
        for i in range(3):
            yield {"row_id": np.arange(4) + 4 * i}

    taken = []
    it = handed_out(Background(make, depth=2), m, lambda item: item, taken.append,
                    ending=lambda: (clock.sleep(5.0), ended.append(True)))
    batches = []
    for b in it:
        assert len(taken) == len(batches) + 1  # counted just before it is handed out
        batches.append(b)
        clock.sleep(1.0)  # the step
    assert ended == [True] and [len(b["row_id"]) for b in batches] == [4, 4, 4]
    st = m.stats()
    assert st.rows == 12 and st.wall_s == pytest.approx(8.0) and st.wait_s == pytest.approx(5.0)


def test_a_loop_left_early_closes_the_pass_without_the_end():
    clock = ManualClock(0.0)
    m = Metrics(clock=clock)
    ended = []
    bg = Background(_counting(100), depth=2)
    it = handed_out(bg, m, lambda item: {"row_id": np.zeros(2)}, lambda item: None, ending=lambda: ended.append(1))
    for i, _ in enumerate(it):
        clock.sleep(1.0)
        if i == 2:
            break
    it.close()
    bg.close()
    st = m.stats()
    assert ended == [] and st.rows == 6 and st.wall_s == pytest.approx(3.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 5])
def test_background_threads_run_nice_steps_below_the_training_thread(click, tmp_path, monkeypatch, nice):
    """Loader, window, producer and cache writer threads yield the CPU to the training thread's own
    threads: ``nice`` steps below it (the training thread itself is left as it is)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setattr(running_mod, "cut_threads", lambda n: n)  # the cut threads too
    ds = click.open(tmp_path / "cache", nice=nice, prefetch=1, num_threads=2)  # cold: the writer runs too
    seen: dict[str, int] = {}

    def consume():
        for _ in ds:
            for t in threading.enumerate():
                if t.name.startswith("gpuload-") and t.native_id is not None and t.is_alive():
                    try:
                        seen[t.name.split("_")[0]] = os.getpriority(os.PRIO_PROCESS, t.native_id)
                    except OSError:  # it ended meanwhile
                        pass

    run_with_timeout(consume)
    assert {"gpuload-producer", "gpuload-load", "gpuload-window", "gpuload-write", "gpuload-cut"} <= set(seen)
    assert set(seen.values()) == {min(19, base + nice)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
