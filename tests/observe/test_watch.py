"""watch: starvation of controlled loops, counting batches, any loader, passes and early exits.

Durations come from a :class:`ManualClock` given to the watched loader's Metrics, never from
the machine's timing; sampling is waited for, not assumed to keep up with real sleeps.
"""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog
from gpuload.observe.watch import _measure

from conftest import ManualClock, wait_until


def watched(loader, clock: ManualClock, **kw):
    return gpuload.watch(loader, metrics=gpuload.Metrics(clock=clock), sample_util=False, **kw)


def slow_generator(n: int, ms: float, clock=None):
    """``n`` batches, each taking ``ms`` to make: on ``clock`` (a ManualClock), else no time at all."""
    for i in range(n):
        if clock is not None:
            clock.sleep(ms / 1000)
        yield torch.full((16, 2), i, dtype=torch.float32)


def prefetching(n: int, ms: float, clock: ManualClock, depth: int = 4):
    """A prefetching loader, played out in ``clock``'s virtual time: as if a producer thread,
    started by the first ``next()``, made an item every ``ms`` into a queue of ``depth`` items
    (blocking while it is full), then an end marker; ``next()`` waits until its item is queued."""
    put, take, start = [], [], clock.t
    for i in range(n):
        made = (put[-1] if put else start) + ms / 1000
        put.append(max(made, take[i - depth]) if i >= depth else made)
        clock.t = max(clock.t, put[i])
        take.append(clock.t)
        yield np.full(8, i)
    clock.t = max(clock.t, put[-1], take[n - depth] if n >= depth else put[-1])  # the end marker


def consume(batches, step_ms: float, clock=None) -> int:
    """Iterate ``batches``, each step taking ``step_ms`` on ``clock`` (none without one)."""
    n = 0
    for _ in batches:
        if clock is not None:
            clock.sleep(step_ms / 1000)
        n += 1
    return n


@pytest.mark.parametrize("produce_ms, step_ms", [(3.0, 1.0), (1.0, 3.0)])
def test_inline_generator_starvation(produce_ms, step_ms):
    # the loader runs inside next(): every wait is the full production time
    clock = ManualClock(10.0)
    w = watched(slow_generator(80, produce_ms, clock), clock)
    assert consume(w, step_ms, clock) == 80
    s = w.stats()
    p, c = produce_ms / 1000, step_ms / 1000
    assert s.wall_s == pytest.approx(80 * (p + c), rel=1e-9) and s.wait_s == pytest.approx(80 * p, rel=1e-9)
    assert s.starvation == pytest.approx(p / (p + c), rel=1e-9)
    assert s.wait_mean_s == pytest.approx(80 * p / 81, rel=1e-9) and s.step_mean_s == pytest.approx(c, rel=1e-9)
    assert (s.batches, s.rows, s.bytes, s.passes) == (80, 80 * 16, 80 * 16 * 2 * 4, 1)


@pytest.mark.parametrize("produce_ms, step_ms", [(6.0, 2.0), (2.0, 6.0)])
def test_prefetching_loader_starvation(produce_ms, step_ms):
    clock = ManualClock(10.0)
    w = watched(prefetching(60, produce_ms, clock), clock)
    assert consume(w, step_ms, clock) == 60
    s = w.stats()
    n, p, c = 60, produce_ms / 1000, step_ms / 1000
    # the first next() waits p, each later one max(0, p - c); the pass ends one step after the last item
    wait, wall = p + (n - 1) * max(0.0, p - c), n * max(p, c) + min(p, c)
    assert s.wall_s == pytest.approx(wall, rel=1e-9) and s.starvation == pytest.approx(wait / wall, rel=1e-9)
    # steady state: one item per max(p, c), of which the consumer waits max(0, p - c)
    assert s.starvation == pytest.approx(max(0.0, p - c) / max(p, c), abs=0.01)


def test_torch_dataloader_every_iter_is_a_pass(tmp_path):
    x, y = torch.randn(1000, 4), torch.randint(0, 2, (1000,))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    w = gpuload.watch(dl, sample_util=False)
    assert len(w) == len(dl) == 16 and w.batch_size == 64  # attributes of the DataLoader
    for _ in range(2):
        assert consume(w, 0.0) == 16
    s = w.stats()
    assert (s.passes, s.batches, s.rows) == (2, 32, 2000)
    assert s.bytes == 2 * (x.nbytes + y.nbytes)
    doc = json.loads(w.write_trace(tmp_path / "t.json").read_text())
    assert sum(e["name"] == "wait (end of pass)" for e in doc["traceEvents"]) == 2


def test_parquet_dataset(tmp_path, tmp_cache):
    write_clicklog(tmp_path / "data", rows=20_000, files=2, row_group_rows=4096)
    ds = gpuload.ParquetDataset(tmp_path / "data", columns=clicklog_columns(), batch_size=4096, device="cpu")
    # a clock that moves 0.25 s at every reading: the pass lasts long enough for its utilisation
    # sample (taken at the end of a pass of 10 ms or more) however fast this machine reads
    w = gpuload.watch(ds, metrics=gpuload.Metrics(clock=itertools.count(0.0, 0.25).__next__))
    w.set_epoch(1)
    assert ds.epoch == 1 and len(w) == len(ds) == 5
    batches = list(w)
    s = w.stats()
    assert s.batches == 5 and s.rows == 20_000
    assert s.bytes == sum(_measure(b)[1] for b in batches) > 20_000 * (13 * 4 + 8 * 8 + 1)
    assert s.util_samples >= 1 and s.cpu_percent is not None
    assert gpuload.diagnose(s).starvation == s.starvation


def test_measure_batches():
    r = gpuload.Ragged(torch.arange(10), torch.tensor([0, 3, 10]))
    assert _measure(r) == (2, 10 * 8 + 3 * 8)
    assert _measure({"x": np.zeros((5, 3), np.float32), "h": r}) == (5, 60 + 104)
    assert _measure((torch.zeros(7, 2), torch.zeros(7))) == (7, 56 + 28)
    assert _measure([np.float64(1.0)]) == (1, 8)
    assert _measure(pa.record_batch({"a": pa.array(np.arange(4))})) == (4, 32)
    assert _measure("text") == (0, 0) and _measure(object()) == (0, 0) and _measure({}) == (0, 0)


def test_leaving_early_ends_the_pass_and_keeps_a_generator_resumable():
    clock = ManualClock()
    gen = slow_generator(10, 1.0, clock)
    w = watched(gen, clock)
    for i, _ in enumerate(w):
        if i == 3:
            clock.sleep(0.05)
            break
        clock.sleep(0.002)
    s = w.stats()
    assert (s.batches, s.passes) == (4, 1)
    # 4 batches of 1 ms, 3 steps of 2 ms, then 50 ms before leaving the loop: that ends the pass
    assert s.wall_s == pytest.approx(0.004 + 0.006 + 0.05) and s.wait_s == pytest.approx(0.004)
    assert s.step_max_s == pytest.approx(0.05)
    assert next(gen)[0, 0].item() == 4  # not closed behind the user's back
    assert consume(w, 0.0) == 5 and w.stats().passes == 2


def test_errors_propagate_and_are_timed():
    clock = ManualClock()

    def failing():
        clock.sleep(0.5)
        yield torch.zeros(2)
        clock.sleep(0.25)
        raise OSError("disk gone")

    w = watched(failing(), clock)
    with pytest.raises(OSError, match="disk gone"):
        consume(w, 1000.0, clock)  # a step of 1 s
    s = w.stats()
    # the failed next() counts as waiting up to the error, and ends the pass
    assert (s.batches, s.passes, s.wait_s, s.wall_s, s.wait_max_s) == (1, 1, 0.75, 1.75, 0.5)


def test_utilisation_is_sampled_during_a_pass():
    m = gpuload.Metrics()

    def loader():  # each batch waits for another sample: however slowly this machine's threads run
        for i in range(5):
            wait_until(lambda: m.stats().util_samples > i)
            yield torch.zeros(2)

    w = gpuload.watch(loader(), metrics=m, util_period=0.02)
    assert consume(w, 0.0) == 5
    s = w.stats()
    assert s.util_samples >= 5 and 0 <= s.system_cpu_percent <= 100 and s.cpu_percent >= 0
    assert "utilisation" in str(s)
    assert not w._sampler.running  # paused with the pass
    n = s.util_samples
    time.sleep(0.1)
    assert w.stats().util_samples == n  # no samples between passes
    consume(w, 0.0)  # a generator: a second, empty pass resumes the same sampler
    assert w.stats().passes == 2 and not w._sampler.running


def test_shared_metrics_and_reset():
    m = gpuload.Metrics()
    w = gpuload.watch(range(3), metrics=m, sample_util=False)
    assert w.metrics is m and consume(w, 0.0) == 3 and m.stats().batches == 3
    w.reset()
    assert m.stats().batches == 0 and repr(w) == "Watched(range(0, 3))"
    with pytest.raises(TypeError):
        len(gpuload.watch(iter([1])))
    with pytest.raises(ValueError, match="util_period"):
        gpuload.watch([], util_period=0)


class _Items(torch.utils.data.Dataset):
    """Items that take 10 ms each: asleep (a disk or a store's wait) or computing."""

    def __init__(self, compute: bool):
        self.compute = compute

    def __len__(self):
        return 300

    def __getitem__(self, i):
        end = time.perf_counter() + 0.01
        if not self.compute:
            time.sleep(0.01)
        while time.perf_counter() < end:
            pass
        return torch.full((4,), i)


@pytest.mark.slow  # DataLoader worker processes
def test_a_watched_dataloaders_workers_cpu_tells_waiting_from_computing():
    """A new user's trial: I/O-bound workers as many as the cores were told more would only share them,
    where 6 instead of 2 halved the waiting; the workers' own CPU now tells (the process CPU is the
    training process's alone). Compared in one run: the sleeping workers use far less than the busy."""
    used = {}
    for compute in (False, True):
        w = gpuload.watch(torch.utils.data.DataLoader(_Items(compute), batch_size=2, num_workers=2,
                                                      persistent_workers=True))
        for _ in w:
            pass
        used[compute] = w.stats().worker_cpu_percent
    assert used[False] is not None and used[True] is not None
    assert used[False] < used[True] / 2 and used[False] < 50, used
    assert "each worker's CPU" in str(w.stats())


def test_watch_of_something_that_cannot_be_iterated_is_refused_at_the_call():
    """It failed only at the training loop's first for (a TypeError from iter() there)."""
    for bad in (5, None, gpuload.Metrics()):
        with pytest.raises(gpuload.ConfigError, match=f"watch\\(\\) takes the loader the training loop iterates .*"
                                                      f"not a {type(bad).__name__}"):
            gpuload.watch(bad)
    assert list(gpuload.watch([1, 2])) == [1, 2] and list(gpuload.watch("ab")) == ["a", "b"]
