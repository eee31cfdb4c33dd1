"""diagnose: the right bottleneck and advice, from synthetic Stats and from a timed mini-pipeline.

The timed cases run on a :class:`ManualClock` (``Metrics(clock=...)``): the figures diagnose
sees are exact, not whatever a busy machine makes of real sleeps.
"""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuload
import gpuload.observe.metrics
from gpuload.observe.stats import StageStats, Stats

from conftest import ManualClock


def stage(name: str, seconds: float, threads: int = 1, nbytes: int = 0, rows: int = 0, wall: float = 10.0,
          training_thread: bool = False):
    return StageStats(name, seconds, 100, nbytes, rows, threads, nbytes / seconds / 1e9, rows / seconds,
                      seconds / wall, training_thread)


def make_stats(starvation: float = 0.5, wall: float = 10.0, stages=(), **kw) -> Stats:
    batches = 100
    wait = starvation * wall
    base = dict(wall_s=wall, batches=batches, rows=batches * 65536, bytes=batches * 10**7, wait_s=wait,
                starvation=starvation, passes=1, wait_mean_s=wait / batches, wait_max_s=2 * wait / batches,
                step_mean_s=(wall - wait) / batches, step_max_s=2 * (wall - wait) / batches,
                stages={s.name: s for s in stages})
    return Stats(**{**base, **kw})


def test_a_first_epoch_spent_converting_is_named_so_not_decode_bound():
    """A helper's trial: hashed string columns took 0.52 s converting and 0.03 s decoding, and the
    message said decode-bound. The two still count as one job (one pool thread runs both)."""
    d = gpuload.diagnose(make_stats(0.6, stages=[stage("read", 0.5, 2, 10**8), stage("decode", 2.0, 2, 10**9),
                                                 stage("convert", 16.0, 2, 4 * 10**9, 6_553_600),
                                                 stage("batch", 1.0)], loader="gpuload",
                                    loader_settings={"device": "cpu", "cache_io": "direct"}))
    assert d.limiting == "decode"
    assert d.message.startswith("first epoch is bound by converting (casts, categorical hashing or vocabularies, "
                                "fill values: 16.00 s, against 2.00 s decoding) on the CPU"), d.message


def test_a_one_pass_job_bound_by_its_transform_names_the_transform_first():
    """With cache_io='off' and a transform, conversion time is mostly the transform's: the message names it
    before casts and hashing (a review: it listed casts first); decode-bound epochs name it as included."""
    settings = {"device": "cpu", "cache_io": "off", "transform": "features-v3"}
    converting = [stage("read", 0.5, 2, 10**8), stage("decode", 2.0, 2, 10**9),
                  stage("convert", 16.0, 2, 4 * 10**9, 6_553_600), stage("batch", 1.0)]
    d = gpuload.diagnose(make_stats(0.6, stages=converting, loader="gpuload", loader_settings=settings))
    assert d.message.startswith("epochs are bound by converting (the transform 'features-v3', casts, categorical "
                                "hashing or vocabularies, fill values: 16.00 s, against 2.00 s decoding): with "
                                "cache_io='off' each one decodes Parquet"), d.message
    decoding = [stage("read", 0.5, 2, 10**8), stage("decode", 16.0, 2, 4 * 10**9, 6_553_600),
                stage("convert", 2.0, 2, 10**9), stage("batch", 1.0)]
    d = gpuload.diagnose(make_stats(0.6, stages=decoding, loader="gpuload", loader_settings=settings))
    assert d.message.startswith("epochs are decode-bound, the transform 'features-v3' included: with cache_io='off'"), \
        d.message


def test_slow_decode():
    d = gpuload.diagnose(make_stats(0.6, stages=[stage("read", 2.0, 2, 10**9), stage("decode", 18.0, 2, 4 * 10**9,
                                                                                  6_553_600),
                                                 stage("cache_write", 3.0, 2), stage("batch", 1.0)]))
    assert d.limiting == "decode" and d.starvation == 0.6
    assert d.message.startswith("first epoch is decode-bound on the CPU")
    assert "busy 90% of the 10.00 s run" in d.message and "0.22 GB/s" in d.message and "60.0%" in d.message
    assert "gpuload cache build" in d.action and "device=cuda" in d.action


def test_decode_in_stats_over_cached_passes_says_the_decoding_was_the_first_epochs():
    """Stats that add up a first epoch and cached ones (a user's trial: three passes) still name
    decode when it ran longest, and say it was the first epoch's and how to measure the cached
    passes alone; one pass, or no cache read, says nothing of it."""
    stages = [stage("decode", 18.0, 2, 4 * 10**9, 6_553_600), stage("cache_read", 2.0, 2, 10**9), stage("batch", 1.0)]
    note = "the decoding was the first epoch's, later passes read the cache; ds.reset_stats() after the first"
    three = dict(passes=3, rows=3 * 6_553_600, loader="gpuload")  # three passes' rows delivered
    d = gpuload.diagnose(make_stats(0.6, stages=stages, **three))
    assert d.limiting == "decode" and "add up 3 passes" in d.message and note in d.message
    assert note not in gpuload.diagnose(make_stats(0.6, stages=stages, loader="gpuload")).message
    assert note not in gpuload.diagnose(make_stats(0.6, stages=stages[:1] + stages[2:], **three)).message
    evicting = [stage("decode", 18.0, 2, 4 * 10**9, 3 * 6_553_600)] + stages[1:]  # every pass decoded its rows
    assert note not in gpuload.diagnose(make_stats(0.6, stages=evicting, **three)).message


def test_throttled_reader():
    d = gpuload.diagnose(make_stats(0.8, stages=[stage("read", 19.0, 2, 19 * 10**8), stage("decode", 4.0, 2)]))
    assert d.limiting == "read" and "throttled at 0.20 GB/s" in d.message  # 0.1 GB/s per thread x 2
    assert "local NVMe" in d.action


def test_remote_bound_and_decode_bound_first_epochs_are_told_apart():
    remote = gpuload.RemoteStats(400, 4 * 10**8, 3, 0, 0.045, 0.08, 0.2)
    d = gpuload.diagnose(make_stats(0.8, remote=remote, stages=[stage("read", 19.0, 2, 4 * 10**8),
                                                                stage("decode", 4.0, 2)]))
    assert d.limiting == "read" and d.message.startswith("first epoch is remote-bound")
    assert "400 requests" in d.message and "45/80/200 ms" in d.message
    assert "max_requests" in d.action and "gpuload cache build" in d.action
    # a helper's trial: 8 requests in all, max_requests=64 advised (and changing nothing); num_threads 2 -> 4 cut
    # the epoch by 31%. Fewer requests than may be in flight: more loader threads, not a deeper request queue
    few = gpuload.RemoteStats(8, 7 * 10**7, 0, 0, 1.3, 1.4, 1.4)
    mine = {"num_threads": 2, "prefetch": 2, "device": "cpu", "max_requests": 32}
    d = gpuload.diagnose(make_stats(0.8, remote=few, loader="gpuload", loader_settings=mine,
                                    stages=[stage("read", 19.0, 2, 7 * 10**7), stage("decode", 4.0, 2)]))
    assert d.limiting == "read" and "raise num_threads (now 2)" in d.action and "max_requests" not in d.action
    d = gpuload.diagnose(make_stats(0.8, remote=remote, loader="gpuload", loader_settings=mine,
                                    stages=[stage("read", 19.0, 2, 4 * 10**8), stage("decode", 4.0, 2)]))
    assert "max_requests" in d.action and "raise num_threads" not in d.action  # 400 requests: the queue may be full
    d = gpuload.diagnose(make_stats(0.8, remote=remote, stages=[stage("read", 2.0, 2, 4 * 10**8),
                                                                stage("decode", 19.0, 2)]))
    assert d.limiting == "decode" and d.message.startswith("first epoch is decode-bound")


def test_slow_cache_read_against_the_disk():
    stats = make_stats(0.4, stages=[stage("cache_read", 16.0, 2, 4 * 10**9), stage("batch", 3.0)])
    d = gpuload.diagnose(stats, disk_gbps=3.0)
    assert d.limiting == "cache_read"
    assert "cache reads run at 0.50 GB/s against 3.00 GB/s the disk gives" in d.message
    assert d.action.startswith("raise prefetch")
    near = gpuload.diagnose(make_stats(0.4, stages=[stage("cache_read", 16.0, 2, 23 * 10**9)]), disk_gbps=3.0)
    assert "2.88 GB/s against 3.00" in near.message and "the disk is the limit" in near.action
    unknown = gpuload.diagnose(stats)
    assert "not measured" in unknown.message and "raise prefetch" in unknown.action
    # a user's trial: "raise prefetch first; then: raise prefetch (and num_threads)"
    assert d.action.count("raise prefetch") == unknown.action.count("raise prefetch") == 1
    # reads faster than the disk come from the page cache: the disk is not their limit (it was said to be)
    reads = [stage("cache_read", 16.0, 2, 40 * 10**9)]
    for mode, said in (("buffered", "so they come from the page cache"), ("direct", "measured as one stream")):
        fast = gpuload.diagnose(make_stats(0.4, stages=reads, loader_settings={"cache_io": mode}), disk_gbps=3.0)
        assert "5.00 GB/s, faster than the 3.00 GB/s measured for the disk" in fast.message and said in fast.message
        assert "the disk is the limit" not in fast.action and "raise prefetch" in fast.action


def test_slow_consumer():
    d = gpuload.diagnose(make_stats(0.02, stages=[stage("cache_read", 1.0, 2)]))
    assert d.limiting == "step" and "the step itself is the bottleneck: the loader is not" in d.message
    assert "2.0%" in d.message and "profile the step" in d.action


def test_foreign_loader_without_stage_data():
    d = gpuload.diagnose(make_stats(0.7, cpu_percent=98.0, util_samples=10))
    assert d.limiting == "loader" and "cannot keep up with the step" in d.message
    assert "70.0% of 10.00 s" in d.message and "70.0 ms per next()" in d.message and "CPU 98%" in d.message
    assert "no per-stage timings" in d.message
    assert "gpuload.ParquetDataset" in d.action and "num_workers" in d.action


def test_busy_time_is_per_available_worker():
    stats = make_stats(0.5, stages=[stage("decode", 8.0, 1), stage("batch", 5.0)])
    assert gpuload.diagnose(stats).limiting == "decode"  # seen on one thread: 8 s per worker
    shuffle = gpuload.diagnose(stats, threads=4)  # 2 s per pool worker; batching runs on one thread
    assert shuffle.limiting == "batch" and "shuffle_window" in shuffle.action


@pytest.mark.parametrize("name, words", [("h2d", "pinned"), ("cache_write", "gpuload cache build"),
                                         ("list", "list of files"), ("convert", "device=cuda")])
def test_every_stage_has_advice(name, words):
    d = gpuload.diagnose(make_stats(0.3, stages=[stage(name, 9.0, 1, 10**9)]))
    assert d.limiting == name and words in d.action and "9.00 s in all" in d.message


def test_stage_on_the_training_thread():
    stats = make_stats(0.6, stages=[stage("convert", 4.0, 1, training_thread=True), stage("decode", 2.0, 1,
                                                                                            training_thread=True)])
    d = gpuload.diagnose(stats, threads=4)  # the pool size does not apply to work done inside next()
    # decode and convert of a chunk are one CPU job: named decode, their times added
    assert d.limiting == "decode" and "runs on the training thread, 6.00 s of its 6.00 s of waiting" in d.message
    assert "move the loading off the training thread" in d.action and "prefetch" not in d.action


def test_inline_loader_measured_through_watch():
    clock = ManualClock()
    m = gpuload.Metrics(clock=clock)

    def loader():
        for i in range(30):
            with m.span("decode", rows=100):
                clock.sleep(0.004)
            yield i

    w = gpuload.watch(loader(), metrics=m, sample_util=False)
    for _ in w:
        clock.sleep(0.001)
    s = w.stats()
    assert s.stages["decode"].training_thread and s.starvation == pytest.approx(0.8, rel=1e-9)  # 4 ms of each 5
    d = gpuload.diagnose(s)
    assert d.limiting == "decode" and "runs on the training thread, 0.12 s of its 0.12 s of waiting" in d.message


def test_unsaturated_loader_is_told_to_prefetch():
    d = gpuload.diagnose(make_stats(0.3, stages=[stage("cache_read", 2.0, 2, 10**9)]))
    assert d.limiting == "cache_read" and d.action.startswith("raise prefetch")
    assert "not keeping enough work in flight" in d.message and d.action.count("raise prefetch") == 1
    d = gpuload.diagnose(make_stats(0.3, stages=[stage("decode", 2.0, 2, 10**9)]))
    assert d.limiting == "decode" and d.action.startswith("raise prefetch first; then: build the cache")


def test_an_unsaturated_loader_that_always_had_work_in_flight_is_not_told_to_prefetch():
    """A helper's trial: "nothing running for 0.042 s" of the waits, and yet "the loader is not keeping enough work
    in flight ... raise prefetch first" (prefetch 2, 4, 8 then measured alike): where some stage ran through nearly
    all the waits, more in flight cannot help."""
    stages = [stage("decode", 2.0, 2, 10**9)]
    busy = gpuload.diagnose(make_stats(0.3, stages=stages, during_waits={"idle": 0.04, "decode": 2.96}))
    assert "more work in flight would not help" in busy.message and "raise prefetch" not in busy.action
    assert "not keeping enough work in flight" not in busy.message
    idle = gpuload.diagnose(make_stats(0.3, stages=stages, during_waits={"idle": 2.0, "decode": 1.0}))
    assert "not keeping enough work in flight" in idle.message and idle.action.startswith("raise prefetch first")


def test_str_and_errors():
    d = gpuload.diagnose(make_stats(0.25, stages=[stage("decode", 9.0)]))
    text = str(d)
    assert text.startswith("starvation 25.0%; limited by: decode") and "action: build the cache" in text
    with pytest.raises(gpuload.ConfigError, match="no batch"):
        gpuload.diagnose(gpuload.Metrics().stats())


def mini_pipeline(slow: str, n: int = 40) -> Stats:
    """Two loader threads read (cache_read 1 ms) then decode (decode 1 ms) each chunk, the
    ``slow`` stage taking 8 ms instead, and queue it; the training thread takes the chunks in
    order, gathers each (batch, 0.25 ms) and steps 1.75 ms. In virtual time: chunk i is ready at
    9 ms x (i // 2 + 1), with the queue (2 chunks) never full, the consumer being faster."""
    clock = ManualClock()
    m = gpuload.Metrics(clock=clock)
    ready = [0.009 * (i // 2 + 1) for i in range(n)]
    turn, both = threading.Lock(), threading.Barrier(2)

    def worker(w: int):
        with turn:  # one thread at a time moves the clock
            for i in range(w, n, 2):
                clock.t = ready[i] - 0.009
                for name in ("cache_read", "decode"):
                    with m.span(name, nbytes=10**6, rows=1000):
                        clock.sleep((8.0 if name == slow else 1.0) / 1000)
        both.wait()  # alive together: a finished thread's ident may be reused

    threads = [threading.Thread(target=worker, args=(w,), name=f"loader-{w}") for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.t = 0.0
    for i in range(n):
        t0 = clock()
        clock.t = max(clock.t, ready[i])
        m.consumer_wait(t0, clock(), rows=1000)
        with m.span("batch", rows=1000):
            clock.sleep(0.00025)
        clock.sleep(0.00175)
    m.consumer_end(clock(), clock())  # both loaders were done with the last chunk
    return m.stats()


@pytest.mark.parametrize("slow", ["decode", "cache_read"])
def test_measured_pipeline_names_the_injected_slow_stage(slow):
    stats = mini_pipeline(slow)
    # each pair of chunks takes 9 ms; the consumer waits for the first of a pair (9 ms for the
    # first pair, then 9 - 2 x 2 = 5 ms), not the second; 2 ms after the last chunk the pass ends
    wall, wait = 0.009 * 20 + 0.004, 0.009 + 19 * 0.005
    assert stats.wall_s == pytest.approx(wall) and stats.starvation == pytest.approx(wait / wall)
    assert stats.stages[slow].seconds == pytest.approx(40 * 0.008) and stats.stages[slow].threads == 2
    d = gpuload.diagnose(stats, threads=2)
    assert d.limiting == slow
    assert f"busy {40 * 0.008 / 2 / wall:.0%}" in d.message and "busy 87%" in d.message


def test_startup_wait_is_named_apart_from_steady_state():
    # 1 s of waiting, 0.9 s of it in one next(): the first window, then the loader keeps up
    d = gpuload.diagnose(make_stats(0.1, wait_max_s=0.9, stages=[stage("cache_read", 1.0, 2), stage("batch", 2.0)]))
    assert d.limiting == "startup" and "0.90 of 1.00 s" in d.message and "shuffle_window" in d.action
    assert "gpuload cache build" not in d.action  # read from the cache already (a user's trial was told to build it)
    cold = gpuload.diagnose(make_stats(0.1, wait_max_s=0.9, stages=[stage("decode", 1.0, 2), stage("batch", 2.0)]))
    assert cold.limiting == "startup" and "gpuload cache build" in cold.action
    spread = gpuload.diagnose(make_stats(0.1, stages=[stage("cache_read", 1.0, 2), stage("batch", 2.0)]))
    assert spread.limiting == "batch"  # the same waiting spread over every batch is the gather
    # a remote source whose pass is about one window: the start-up is the fetching, not nothing to fix
    remote = gpuload.RemoteStats(6, 9 * 10**5, 0, 0, 0.73, 0.73, 0.73)
    d = gpuload.diagnose(make_stats(0.1, wait_max_s=0.9, remote=remote, loader="gpuload",
                                    stages=[stage("read", 2.4, 2), stage("batch", 0.1)]))
    assert d.limiting == "startup" and "from the object store in the passes that read it (6 requests" in d.message
    assert "nothing to fix" not in d.action and "gpuload cache build URL" in d.action


def _run_passes(m, clock, passes, between: float = 0.0) -> None:
    """A watched loop in virtual time: ``passes`` is a list of passes, each a list of ``(wait,
    step)`` seconds per batch; ``between`` seconds (not counted) separate the passes."""
    for p in passes:
        for wait, step in p:
            t0 = clock.t
            clock.sleep(wait)
            m.consumer_wait(t0, clock.t, rows=1)
            clock.sleep(step)
        m.consumer_end(clock.t, clock.t)
        clock.sleep(between)


def _watched_passes(passes) -> Stats:
    """Stats of :func:`_run_passes` with 100 s between passes."""
    clock = ManualClock()
    m = gpuload.Metrics(clock=clock, nvtx=False)
    _run_passes(m, clock, passes, between=100.0)
    return m.stats()


def test_startup_share_never_exceeds_the_waiting_over_several_passes():
    """A watched loader over 3 epochs whose first next() took 5 s once (the longest next()
    times the passes was printed as 15.00 of 8.07 s): the start-up share is what the first
    next() of each pass waited, never more than the waiting itself."""
    first = [(5.0, 0.02)] + [(0.0005, 0.02)] * 99
    later = [(0.05, 0.02)] + [(0.0005, 0.02)] * 99
    s = _watched_passes([first, later, later])
    assert s.passes == 3 and s.wait_s == pytest.approx(5.0 + 0.1 + 3 * 0.0495)
    assert s.first_wait_s == pytest.approx(5.1)
    d = gpuload.diagnose(s)
    check_shares(d.message)
    assert d.limiting == "startup" and "(5.10 of 5.25 s)" in d.message
    # the same first next() in a longer run is no longer most of the waiting: not start-up
    longer = [(0.05, 0.02)] + [(0.01, 0.02)] * 99
    assert gpuload.diagnose(_watched_passes([first] + [longer] * 4)).limiting == "loader"


def test_a_start_that_is_most_of_the_waiting_is_not_blamed_when_the_rest_waits_too():
    """A user's trial: a first next() of 1.29 s was 63% of 2.05 s of waiting, and the diagnosis said
    "in between it keeps up with the step ... nothing to fix in steady state" while the rest of the
    run waited 88% of its time. The steady state must keep up (waiting under STARVED) for start-up
    to be the answer; else the loader is."""
    from gpuload.observe.diagnose import STARVED

    for rest_wait, limit in ((0.0005, "startup"), (0.01, "loader")):
        s = _watched_passes([[(5.0, 0.02)] + [(rest_wait, 0.02)] * 99])
        steady = (s.wait_s - s.first_wait_s) / (s.wall_s - s.first_wait_s)
        assert (steady < STARVED) == (limit == "startup") and s.first_wait_s >= 0.6 * s.wait_s
        d = gpuload.diagnose(s)
        assert d.limiting == limit and ("keeps up with the step" in d.message) == (limit == "startup")


SHARES = (r"\((\d+\.\d+) of (\d+\.\d+) s\)", r"(\d+\.\d+) s of its (\d+\.\d+) s")


def check_shares(text: str) -> None:
    """Every share printed in ``text`` is at most its whole."""
    for pattern in SHARES:
        for part, whole in re.findall(pattern, text):
            assert float(part) <= float(whole), text
    for pct in re.findall(r"(?:busy|waited) (\d+(?:\.\d+)?)%", text):
        assert float(pct) <= 100.0, text


@settings(max_examples=150, deadline=None)
@given(passes=st.lists(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 1)), min_size=1, max_size=8),
                       min_size=1, max_size=4),
       spans=st.lists(st.tuples(st.sampled_from(gpuload.observe.metrics.STAGES), st.floats(0.001, 50),
                                st.booleans()), max_size=6),
       threads=st.one_of(st.none(), st.integers(1, 8)), disk=st.one_of(st.none(), st.floats(0.1, 10)),
       loader=st.sampled_from([None, "gpuload", "DataLoader", "iterable"]))
def test_no_printed_share_exceeds_its_whole(passes, spans, threads, disk, loader):
    clock = ManualClock()
    m = gpuload.Metrics(clock=clock, nvtx=False)
    for stage_name, seconds, training in spans:  # stage work, on the training thread or on a loader thread
        record = lambda n=stage_name, sec=seconds: m.record(n, 0.0, sec, nbytes=10**6, rows=10)  # noqa: E731
        if training:
            m.consumer_wait(0.0, 0.0)  # makes this thread the training thread
            record()
        else:
            t = threading.Thread(target=record)
            t.start()
            t.join()
    m.reset() if not spans else None
    _run_passes(m, clock, passes)
    s = dataclasses.replace(m.stats(), loader=loader)
    if s.wall_s <= 0:
        return
    check_shares(str(gpuload.diagnose(s, threads=threads, disk_gbps=disk)))


class _SlowItems(torch.utils.data.Dataset):
    """A map-style dataset whose items take ``seconds`` of virtual time (the first ``first``)."""

    def __init__(self, clock, n=40, seconds=0.01, first=None):
        self.clock, self.n, self.seconds, self.first = clock, n, seconds, first

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.clock.sleep(self.first if i == 0 and self.first is not None else self.seconds)
        return torch.zeros(4)


def test_advice_fits_a_watched_dataloader():
    clock = ManualClock()
    loader = torch.utils.data.DataLoader(_SlowItems(clock), batch_size=4, num_workers=0)
    w = gpuload.watch(loader, metrics=gpuload.Metrics(clock=clock, nvtx=False), sample_util=False)
    for _ in w:
        clock.sleep(0.001)
    s = w.stats()
    assert s.loader == "DataLoader" and s.loader_settings["num_workers"] == 0
    d = gpuload.diagnose(s)
    assert d.limiting == "loader" and "num_workers" in d.action and "pin_memory" in d.action
    assert "gpuload cache build" not in d.action and "training thread" in d.message
    # a slow start: the first batch of each pass (workers starting, files opening)
    w = gpuload.watch(torch.utils.data.DataLoader(_SlowItems(clock, first=5.0, seconds=0.0005), batch_size=4),
                      metrics=gpuload.Metrics(clock=clock, nvtx=False), sample_util=False)
    for _ in range(2):
        for _ in w:
            clock.sleep(0.05)
    d = gpuload.diagnose(w.stats())
    assert d.limiting == "startup" and "persistent_workers" in d.action
    assert "gpuload cache build" not in d.action and "shuffle_window" not in d.action


def test_dataloader_workers_that_have_every_core_are_not_told_to_add_workers(monkeypatch):
    """A user's trial: 4 busy DataLoader workers on 2 cores were told to raise num_workers, with
    "process CPU 4%" (the training process's alone) beside it."""
    import gpuload.observe.advice as advice
    import gpuload.observe.diagnose as diag

    for module in (advice, diag):  # the advice counts the cores; the oversubscription note names them
        monkeypatch.setattr(module, "_cores", lambda: 2)
    settings = {"num_workers": 4, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": False}
    d = gpuload.diagnose(make_stats(0.8, cpu_percent=4.0, loader="DataLoader", loader_settings=settings))
    assert d.limiting == "loader" and "raise num_workers" not in d.action and "make it cheaper" in d.action
    assert "as many as the machine's 2 CPU cores" in d.message and "training process's alone" in d.message
    few = gpuload.diagnose(make_stats(0.8, loader="DataLoader", loader_settings={**settings, "num_workers": 1}))
    assert "raise num_workers (now 1, of 2 CPU cores)" in few.action
    # a new user's trial: workers sleeping on I/O (10% of a core each) were told more would only share the cores
    idle = gpuload.diagnose(make_stats(0.8, loader="DataLoader", loader_settings=settings, worker_cpu_percent=10.0))
    assert "each worker used 10% of a core: they mostly wait" in idle.message
    assert idle.action.startswith("raise num_workers (now 4; waiting workers share the 2 CPU cores well)")
    busy = gpuload.diagnose(make_stats(0.8, loader="DataLoader", loader_settings=settings, worker_cpu_percent=97.0))
    assert "raise num_workers" not in busy.action and "make it cheaper" in busy.action


def test_advice_fits_any_watched_iterable():
    clock = ManualClock()

    def slow():
        for i in range(30):
            clock.sleep(3.0 if i == 0 else 0.002)
            yield i

    w = gpuload.watch(slow(), metrics=gpuload.Metrics(clock=clock, nvtx=False), sample_util=False)
    for _ in w:
        clock.sleep(0.05)
    s = w.stats()
    assert s.loader == "iterable"
    d = gpuload.diagnose(s)
    assert d.limiting == "startup" and "gpuload cache build" not in d.action and "shuffle_window" not in d.action
    w = gpuload.watch([1, 2, 3], metrics=gpuload.Metrics(clock=clock, nvtx=False), sample_util=False)
    for _ in w:
        clock.sleep(0.0001)
    assert w.stats().loader == "iterable" and w.stats().loader_settings == {"type": "list"}


def test_advice_on_a_gpu_names_what_helps_there_not_device_cuda():
    decode = [stage("read", 1.0, 2, 10**9), stage("decode", 18.0, 2, 4 * 10**9, 6_553_600)]
    batch = [stage("cache_read", 1.0, 2, 10**9), stage("batch", 9.0, 1, 10**9, 6_553_600)]
    for stages, limit in ((decode, "decode"), (batch, "batch")):
        cpu = gpuload.diagnose(make_stats(0.6, stages=stages, loader="gpuload",
                                          loader_settings={"num_threads": 2, "prefetch": 2, "device": "cpu"}))
        gpu = gpuload.diagnose(make_stats(0.6, stages=stages, loader="gpuload",
                                          loader_settings={"num_threads": 2, "prefetch": 2, "device": "cuda"}))
        assert cpu.limiting == gpu.limiting == limit
        assert "device=cuda" in cpu.action and "device=cuda" not in gpu.action
    assert "install cuDF" in gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload",
                                                         loader_settings={"device": "cuda"})).action
    cudf = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload",  # cuDF decodes already (an H200 run)
                                       loader_settings={"device": "cuda", "decode": "gpu"}))
    assert cudf.limiting == "decode" and "cuDF decoding on the GPU" in cudf.message
    assert "install cuDF" not in cudf.action and "num_threads" in cudf.action


def test_the_users_own_transforms_are_named_when_their_stage_is_the_limit(tmp_path):
    """A slow batch_transform is the producer's work, on one thread: raising prefetch or shrinking the
    shuffle window does nothing for it (a user's trial followed that advice to no effect); a slow
    transform= is timed as conversion, which device=cuda would not speed up."""
    batch = [stage("cache_read", 1.0, 2, 10**9), stage("batch", 9.0, 2, 10**9, 6_553_600)]
    decode = [stage("read", 1.0, 2, 10**9), stage("decode", 1.0, 2, 10**9, 6_553_600),
              stage("convert", 17.0, 2, 4 * 10**9, 6_553_600)]
    plain = {"num_threads": 2, "prefetch": 2, "device": "cpu"}
    slow_bt = gpuload.diagnose(make_stats(0.6, stages=batch, loader="gpuload", loader_settings=plain | {
        "batch_transform": "augment"}))
    assert slow_bt.limiting == "batch" and "batch_transform 'augment'" in slow_bt.message
    assert "prefetch" not in slow_bt.action and "shuffle_window" not in slow_bt.action
    assert "transform=" in slow_bt.action  # work that is the same each epoch: computed once
    assert "shuffle_window" in gpuload.diagnose(make_stats(0.6, stages=batch, loader="gpuload",
                                                            loader_settings=plain)).action
    slow_t = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload", loader_settings=plain | {
        "transform": "features-v1"}))
    assert slow_t.limiting == "decode" and "transform 'features-v1'" in slow_t.message
    assert "device=cuda" not in slow_t.action and "first epoch only" in slow_t.action
    ds = gpuload.ParquetDataset(_clicks(tmp_path), ["row_id"], cache_dir=tmp_path / "c", device="cpu",
                                batch_size=500, batch_transform=lambda b, g: b,
                                transform=gpuload.Transform(lambda o: o, key="same-v1"))
    assert sum(len(b["row_id"]) for b in ds) == 2000
    assert ds.stats().loader_settings["transform"] == "same-v1"
    assert ds.stats().loader_settings["batch_transform"] == "<lambda>"


def test_buffered_cache_writes_that_limit_a_first_epoch_point_to_direct_io(tmp_path):
    """On the 2-core VM a buffered first epoch was bound by the writer's copies into new page-cache
    pages (diagnose named cache_write); cache_io='direct' (now auto's writes on the CPU) made it
    1.6x faster: say so, where it applies."""
    writes = [stage("decode", 2.0, 2, 10**9, 6_553_600), stage("cache_write", 9.0, 1, 3 * 10**9, 6_553_600)]
    plain = {"num_threads": 2, "prefetch": 2, "device": "cpu"}
    for mode in ("buffered", "direct"):
        d = gpuload.diagnose(make_stats(0.6, stages=writes, loader="gpuload", loader_settings=plain | {"cache_io": mode}))
        assert d.limiting == "cache_write" and "gpuload cache build" in d.action
        assert ("cache_io='direct'" in d.action) == ("through the page cache" in d.message) == (mode == "buffered")
        assert ("leave cache_io at 'auto'" in d.action) == (mode == "buffered")  # the CPU path's default
    data = _clicks(tmp_path)
    for mode in ("buffered", "direct"):
        ds = gpuload.ParquetDataset(data, ["row_id"], cache_dir=tmp_path / mode, device="cpu",
                                    batch_size=500, cache_io=mode)
        assert ds.stats().loader_settings["cache_io"] == mode


@pytest.mark.parametrize("held", [7.0, 2.0])
def test_loader_threads_held_back_by_the_cache_writer_name_the_writes_not_decoding(held):
    """The H200's first epoch with cuDF: decode and convert kept the 2 loader threads busiest (1.9 s of
    2.3 s), so decoding was named, with 'raise prefetch' and 'raise num_threads'; the threads had
    waited 1.6 s for the one writer thread, the real limit. Waiting a fifth of their time or more
    (7 s of 2 x 10 s) names the cache writes; less (2 s) leaves the busiest stage named."""
    stages = [stage("read", 2.0, 2, 10**9), stage("decode", 9.0, 2, 4 * 10**9, 6_553_600),
              stage("convert", 5.0, 2, 4 * 10**9, 6_553_600), stage("cache_write", 8.0, 3, 3 * 10**9, 6_553_600),
              stage("write_wait", held, 2)]
    settings = {"num_threads": 2, "prefetch": 2, "device": "cuda", "decode": "gpu", "cache_io": "buffered"}
    d = gpuload.diagnose(make_stats(0.9, stages=stages, loader="gpuload", loader_settings=settings))
    if held == 7.0:
        assert d.limiting == "cache_write" and f"waited {held:.2f} s in all for the cache writer" in d.message
        assert "cache_write kept 3 threads busy" in d.message  # the writer's threads, not the loader pool
        assert "gpuload cache build" in d.action and "cache_io='direct'" in d.action
        assert "'auto'" not in d.action  # on a GPU auto writes a cache that fits in memory buffered
        assert "raise prefetch" not in d.action and "not keeping enough work in flight" not in d.message
    else:
        assert d.limiting == "decode" and "cache writer" not in d.message
    assert "write_wait" not in d.message.split("during those waits")[0]


def test_one_thread_briefly_held_back_among_eight_does_not_name_the_writer():
    """The share is of the loader pool's time (num_threads from the stats' settings when diagnose is
    not told the threads): 2.1 s of one thread among 8 over 10 s is 3%, not the limit."""
    stages = [stage("decode", 72.0, 8, 4 * 10**9, 6_553_600), stage("cache_write", 3.0, 1, 3 * 10**9, 6_553_600),
              stage("write_wait", 2.1, 1)]
    settings = {"num_threads": 8, "prefetch": 2, "device": "cpu", "cache_io": "buffered"}
    for threads in (None, 8):
        d = gpuload.diagnose(make_stats(0.9, stages=stages, loader="gpuload", loader_settings=settings),
                             threads=threads)
        assert d.limiting == "decode" and "cache writer" not in d.message


def test_a_first_epoch_held_back_by_a_slow_writer_records_write_waits(tmp_path, monkeypatch):
    """Every chunk write slowed: the loader threads block on the writer's slots, and the epoch's
    stats hold write_wait spans, none longer than the run; the rows are all there."""
    import time as _time

    from gpuload.cache.store import ChunkCache

    real = ChunkCache._write
    monkeypatch.setattr(ChunkCache, "_write", lambda self, key, cols, spill=True: (_time.sleep(0.05),
                                                                                     real(self, key, cols, spill))[1])
    from gpuload.synth import write_clicklog

    write_clicklog(tmp_path / "d", rows=4000, files=1, row_group_rows=100)
    ds = gpuload.ParquetDataset(tmp_path / "d", ["row_id"], cache_dir=tmp_path / "c", device="cpu", batch_size=500,
                                chunk_bytes=4096, num_threads=2, shuffle=False)
    assert len(ds.reader.chunks) == 8 and sum(len(b["row_id"]) for b in ds) == 4000
    st = ds.stats()
    waits = st.stages["write_wait"]
    assert waits.calls > 0 and 0 < waits.seconds and waits.seconds / waits.threads <= st.wall_s
    assert "cache_write" in st.stages


def test_epochs_that_decode_because_caching_is_off_are_told_so_not_to_build_the_cache(tmp_path):
    """cache_io='off' decodes every epoch by choice: building the cache ahead is not the advice;
    leaving 'off' out is, for a job of more than one epoch."""
    decode = [stage("read", 1.0, 2, 10**9), stage("decode", 18.0, 2, 4 * 10**9, 6_553_600)]
    plain = {"num_threads": 2, "prefetch": 2, "device": "cpu"}
    for mode in ("off", "buffered"):
        d = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload", loader_settings=plain | {"cache_io": mode}))
        assert d.limiting == "decode"
        assert ("cache build" in d.action) == ("first epoch" in d.message) == (mode != "off")
        assert ("leave out cache_io='off'" in d.action) == ("each one decodes Parquet" in d.message) == (mode == "off")
    off = plain | {"cache_io": "off"}
    for extra in ({"transform": "features-v1"}, {"decode": "gpu", "device": "cuda"}):  # their own branches came first
        d = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload", loader_settings=off | extra))
        assert "each one decodes Parquet" in d.message and "cache build" not in d.action, d
    remote = gpuload.RemoteStats(400, 4 * 10**8, 3, 0, 0.045, 0.08, 0.2)
    d = gpuload.diagnose(make_stats(0.8, remote=remote, stages=[stage("read", 18.0, 2, 4 * 10**8),
                                                                stage("decode", 2.0, 2)], loader="gpuload",
                                    loader_settings=off))
    assert d.limiting == "read" and "every epoch is remote-bound" in d.message and "cache build" not in d.action
    ds = gpuload.ParquetDataset(_clicks(tmp_path), ["row_id"], cache_dir=tmp_path / "c", device="cpu",
                                batch_size=500, cache_io="off")
    assert sum(len(b["row_id"]) for b in ds) == 2000
    start = gpuload.diagnose(ds.stats())  # the first window is decoded: no "build the cache ahead" either
    assert ds.stats().loader_settings["cache_io"] == "off" and "cache build" not in start.action


def _clicks(tmp_path):
    from gpuload.synth import write_clicklog

    write_clicklog(tmp_path / "d", rows=2000, files=1)
    return tmp_path / "d"


def test_a_datasets_stats_say_which_loader_and_device(tmp_path):
    from gpuload.synth import write_clicklog

    write_clicklog(tmp_path / "d", rows=2000, files=1)
    ds = gpuload.ParquetDataset(tmp_path / "d", ["row_id"], cache_dir=tmp_path / "c", device="cpu", batch_size=500)
    assert sum(len(b["row_id"]) for b in ds) == 2000
    s = ds.stats()
    assert s.loader == "gpuload" and s.loader_settings["device"] == "cpu" and s.batches == 4
    assert s.loader_settings["decode"] == "cpu"


def test_oversubscribed_cores_are_not_answered_with_more_threads(monkeypatch):
    """A user's trial on 2 cores was told "more num_threads ... ; and run fewer threads at once: ... a smaller
    num_threads" in one action; with the cores measured busy, no advice adds threads. (On 8 cores, where
    more loader threads would gather batches.)"""
    import gpuload.observe.advice as advice

    monkeypatch.setattr(advice, "_cores", lambda: 8)
    batch = [stage("cache_read", 1.0, 2, 10**9), stage("batch", 9.0, 1, 10**9, 6_553_600)]
    plain = {"num_threads": 2, "prefetch": 2, "device": "cpu"}
    for queue, more in (({"gpuload": (4.0, 2.0), "other": (2.0, 1.0)}, False), (None, True)):
        d = gpuload.diagnose(make_stats(0.6, stages=batch, loader="gpuload", loader_settings=plain, cpu_queue=queue))
        assert d.limiting == "batch" and ("more num_threads" in d.action) == more, d.action
        assert ("a smaller num_threads" in d.action) == (not more)
        assert "on a node with a GPU, device=cuda" in d.action
    # a helper's trial (1 loader thread, a matmul step): "what would help most: num_threads=2", then "a smaller
    # num_threads" for one already at 1; measured, num_threads=2 slowed the step as much as it saved
    monkeypatch.setattr(gpuload.observe.diagnose, "_cores", lambda: 2)
    decode = [stage("decode", 8.0, 1, 10**9)]
    one = {"num_threads": 1, "prefetch": 2, "device": "cpu"}
    d = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload", loader_settings=one,
                                    cpu_queue={"gpuload": (4.0, 2.0), "other": (2.0, 1.0)}))
    assert "num_threads=2" not in d.message and all("num_threads" not in w.settings for w in d.what_if)
    assert "a smaller num_threads" not in d.action and "a nice= for the loader" in d.action


@pytest.mark.parametrize("torch_threads, policy, told", [(2, None, True), (1, None, False), (2, "passive", False),
                                                          (4, "ACTIVE", True)])
def test_oversubscribed_cores_with_torch_threads_spinning_point_to_a_passive_wait_policy(monkeypatch, torch_threads,
                                                                                          policy, told):
    """On 2 cores a consumer cloning batches with torch's 2 threads slowed a one-pass gpuload epoch by
    a third (its OpenMP threads spin between parallel regions); OMP_WAIT_POLICY=PASSIVE gave it back.
    Said where the cores are measured oversubscribed, torch runs several threads and the policy is
    not passive already."""
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    decode = [stage("decode", 9.0, 2, 10**9, 6_553_600)]
    busy = {"gpuload": (4.0, 2.0), "other": (2.0, 1.0)}
    d = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload", cpu_queue=busy,
                                    loader_settings={"num_threads": 2, "prefetch": 2, "device": "cpu"}))
    assert ("OMP_WAIT_POLICY=PASSIVE" in d.action) == told
    assert (f"torch's {torch_threads} threads" in d.action) == told
    calm = gpuload.diagnose(make_stats(0.6, stages=decode, loader="gpuload",
                                       loader_settings={"num_threads": 2, "prefetch": 2, "device": "cpu"}))
    assert "OMP_WAIT_POLICY" not in calm.action


@pytest.mark.parametrize("shuffle, cache_io", [(True, "buffered"), ("chunks", "off"), (False, "off"), ("block", "off")])
def test_a_slow_start_is_told_what_fills_it_in_each_shuffle_mode(shuffle, cache_io):
    """A user's trial: a one-pass job with shuffle='chunks' and cache_io='off' was told "longer epochs
    amortise it; use a smaller shuffle_window": it has no shuffle window and no later epoch."""
    s = make_stats(0.2, stages=[stage("decode", 3.0, 2, 10**9, 6_553_600)], first_wait_s=1.9, loader="gpuload",
                   loader_settings={"num_threads": 2, "prefetch": 2, "device": "cpu", "cache_io": cache_io,
                                    "shuffle": shuffle})
    d = gpuload.diagnose(s)
    windowed = shuffle in (True, "block")
    assert d.limiting == "startup"
    assert ("shuffle_window" in d.action) == windowed and "chunk_bytes" in d.action
    assert ("first shuffle window" in d.message) == windowed and ("first chunk" in d.message) != windowed
    assert ("amortise" in d.action) == (cache_io != "off")
    assert ("gpuload cache build" in d.action) == (cache_io != "off")


def test_something_that_is_not_a_loops_stats_is_refused_clearly():
    for wrong in ({"x": 1}, [1, 2], None):
        with pytest.raises(gpuload.ConfigError, match="takes the stats of a loop"):
            gpuload.diagnose(wrong)


def test_more_threads_are_not_offered_for_gathers_where_no_cut_thread_would_run(monkeypatch):
    """A user's trial on 2 cores, a gather-bound cached epoch: told "more num_threads (the CPU path
    gathers batches on them)"; there the cut threads never run (they need the loader's threads plus 3
    cores), so more threads gather nothing."""
    import gpuload.observe.advice as advice

    batch = [stage("cache_read", 1.0, 2, 10**9), stage("batch", 9.0, 1, 10**9, 6_553_600)]
    plain = {"num_threads": 2, "prefetch": 2, "device": "cpu"}
    for cores, offered in ((2, False), (5, False), (6, True), (16, True)):
        monkeypatch.setattr(advice, "_cores", lambda c=cores: c)
        d = gpuload.diagnose(make_stats(0.6, stages=batch, loader="gpuload", loader_settings=plain))
        assert d.limiting == "batch" and ("more num_threads" in d.action) == offered, (cores, d.action)


def test_stats_of_no_batch_are_refused_saying_what_to_iterate():
    """An interactive trial: diagnose(ds.stats()) before the first loop spoke of "the watched loader" to a user who
    never called watch()."""
    with pytest.raises(gpuload.ConfigError, match=r"iterate the loader \(the ParquetDataset, or the loader gpuload.watch"):
        gpuload.diagnose(gpuload.Metrics().stats())
