"""What-if estimates against the model's own arithmetic on hand-made figures, in diagnose, and
(with a real loader) the direction of the top recommendation."""

from __future__ import annotations

import dataclasses

import pytest

from gpuload.observe.stats import StageStats, Stats
from gpuload.observe.whatif import loader_seconds, what_if


def _stats(stages: dict, wall=10.0, wait=6.0, first=0.5, rows=1_000_000, threads=1) -> Stats:
    st = {n: StageStats(n, sec, 10, 1, rows, 1, 0.0, 0.0, sec / wall) for n, sec in stages.items()}
    return Stats(wall_s=wall, batches=100, rows=rows, bytes=1, wait_s=wait, starvation=wait / wall, passes=1,
                 wait_mean_s=wait / 100, wait_max_s=first, step_mean_s=0.04, step_max_s=0.05, stages=st,
                 first_wait_s=first, loader="gpuload", loader_settings={"num_threads": threads, "prefetch": 2})


def test_more_threads_spread_the_pool_stages_up_to_the_cores():
    s = _stats({"decode": 8.0, "batch": 1.0})  # own time 4 s; the loader needs 8 s on one thread
    assert loader_seconds(s, 1, cores=4) == 8.0 and loader_seconds(s, 2, cores=4) == 4.0
    assert loader_seconds(s, 16, cores=4) == 2.0  # no more than the cores
    est = what_if(s, 1, cores=4)
    assert [w.change for w in est] == ["num_threads=4", "num_threads=2"]
    # waiting = startup (0.5, scaled as the pool's 8 s are) + max(0, L - own 4) + rest (6 - 0.5 - (8 - 4) = 1.5)
    assert est[0].waiting_s == pytest.approx(0.5 * 2 / 8 + 0 + 1.5)  # 4 threads: pool 2 s, L = 2
    assert est[1].waiting_s == pytest.approx(0.5 * 4 / 8 + 0 + 1.5)  # 2 threads: pool 4 s, L = 4
    assert est[0].starvation == pytest.approx(est[0].waiting_s / (4 + est[0].waiting_s))
    slow_step = what_if(_stats({"decode": 8.0, "batch": 1.0}, wall=20.0, wait=6.0), 1, cores=4)
    assert slow_step[0].waiting_s == pytest.approx(0.125 + 0 + 5.5)  # own 14 s: the loader was not the limit


def test_a_warm_cache_replaces_the_first_epochs_decoding():
    first = _stats({"read": 1.0, "decode": 6.0, "convert": 1.0, "cache_write": 2.0, "batch": 1.0}, threads=2)
    cached = _stats({"cache_read": 0.5, "batch": 1.0}, wait=0.2, rows=500_000)
    est = {w.change: w for w in what_if(first, 2, cores=2, cached=cached)}
    warm = est["a warm cache (gpuload cache build ahead of training)"]
    # pool 8 s over 2 threads = 4 s, the writer 2 s: L = 4, own 4: rest = 6 - 0.5 - 0 = 5.5
    # warm: cache reads 0.5 s per 500k rows -> 1.0 s for 1M, over 2 threads 0.5 (startup x 0.5 / 4);
    # the producer 1.0: L = 1.0
    assert warm.waiting_s == pytest.approx(0.5 * 0.5 / 4 + 0 + 5.5) and "cache reads" in warm.basis
    assert not what_if(_stats({}), 1) and not what_if(_stats({"decode": 1.0}, wait=0.0), 1)


def test_diagnose_names_the_change_that_helps_most(monkeypatch):
    import os

    import gpuload.machine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)  # it may use 4 cores
    monkeypatch.setattr(gpuload.machine, "_cgroup_cpus", lambda: [])
    d = gpuload.diagnose(_stats({"decode": 8.0, "batch": 1.0}, wait=6.0, first=0.1))
    best = d.what_if[0]
    assert best.change == "num_threads=4" and best.waiting_s == pytest.approx(0.1 * 2 / 8 + 1.9)
    assert (f"what would help most (estimated from the stage costs): num_threads=4, waiting about "
            f"{best.waiting_s:.2f} s ({best.starvation:.0%} of the time) instead of 6.00 s (60%; ") in d.message
    # a helper's trial: the message named shuffle='block' best, the action only a smaller shuffle_window
    assert d.action.startswith("num_threads=4 first (the estimate); then: ")
    # a loop with hardly any step (a benchmark) waits about 98% of the time either way: the seconds say the gain
    bare = gpuload.diagnose(_stats({"decode": 8.0, "batch": 1.0}, wall=6.1, wait=6.0, first=0.1))
    gain = bare.what_if[0]
    assert gain.starvation > 0.9 and f"waiting about {gain.waiting_s:.2f} s" in bare.message
    assert gain.waiting_s < 2.0 and "instead of 6.00 s (98%" in bare.message
    busy_step = gpuload.diagnose(_stats({"decode": 1.0}, wall=10.0, wait=0.2))
    assert busy_step.what_if == () and "what would help" not in busy_step.message


def test_block_shuffling_scales_the_producers_gathers_by_the_measured_ratio():
    s = _stats({"cache_read": 1.0, "batch": 8.0}, threads=1)  # gather-bound: L = 8, own 4, rest 6 - 0.5 - 4
    est = {w.change: w for w in what_if(s, 1, cores=2, block_gather=0.25)}
    block = est["shuffle='block'"]
    assert block.settings == {"shuffle": "block"} and "0.25x" in block.basis
    assert block.waiting_s == pytest.approx(0.5 + max(0.0, 8.0 * 0.25 - 4.0) + 1.5)
    assert "shuffle='block'" not in {w.change for w in what_if(s, 1, cores=2)}  # not measured: not estimated


def test_the_cpu_path_gathers_batches_on_its_loader_threads():
    """B: the CPU path's batches are gathered on num_threads threads at once, a GPU's on one."""
    s = _stats({"cache_read": 1.0, "batch": 8.0}, threads=2)
    assert loader_seconds(s, 2, cores=8) == pytest.approx(4.0) and loader_seconds(s, 1, cores=8) == 8.0
    assert loader_seconds(s, 2, cores=4) == 8.0  # no core to spare beside the loader, producer and training threads
    gpu = dataclasses.replace(s, loader_settings={"num_threads": 2, "prefetch": 2, "device": "cuda"})
    assert loader_seconds(gpu, 2, cores=8) == 8.0


def test_waiting_with_nothing_in_flight_is_what_a_deeper_prefetch_hides():
    s = _stats({"decode": 2.0, "batch": 1.0}, wait=3.0, first=0.2)  # own 7 s: the stages keep up on average
    s = dataclasses.replace(s, during_waits={"decode": 1.0, "idle": 2.5})
    est = {w.change: w for w in what_if(s, 2, cores=2)}
    deeper = est["prefetch=4"]
    assert deeper.settings == {"prefetch": 4} and deeper.waiting_s == pytest.approx(max(0.2, 3.0 - 2.5))
    assert "prefetch=4" not in {w.change for w in what_if(dataclasses.replace(s, during_waits=None),
                                                          2, cores=2)}


def test_no_estimate_is_above_the_measured_waiting_where_the_model_needs_more_than_was_measured():
    """A helper's trial: a first epoch on one loader thread whose busy seconds overlapped more than the model
    assumes (the next epoch's loads run on threads of their own) was told prefetch=4 and shuffle='block' would
    wait 1.22 s where it waited 0.83 s with nothing changed. The model's surplus is scaled away: a change that
    leaves the loader's need alone estimates the measured waiting, one that halves it less."""
    s = dataclasses.replace(_stats({"decode": 8.0, "batch": 0.5}, wall=6.1, wait=3.0, first=0.1),
                            during_waits={"idle": 0.4, "decode": 2.6})  # own 3.1 s; the model: 8 - 3.1 = 4.9 s short
    est = {w.change: w for w in what_if(s, 1, cores=2, block_gather=0.5)}
    assert all(w.waiting_s <= s.wait_s + 1e-9 for w in est.values()), est
    assert est["prefetch=4"].waiting_s == pytest.approx(3.0)  # its idle 0.4 s: under what the decoding needs
    assert est["shuffle='block'"].waiting_s == pytest.approx(3.0)  # decode-bound: the gathers change nothing
    # two threads: the loader's 8 s become 4, 0.9 s over the step's own 3.1 instead of 4.9, scaled by 2.9 / 4.9
    assert est["num_threads=2"].waiting_s == pytest.approx(0.1 * 4 / 8 + 0.9 * 2.9 / 4.9)
