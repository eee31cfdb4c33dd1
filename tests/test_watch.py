"""watch: starvation of controlled loops, counting batches, any loader, passes and early exits."""

from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog
from gpuload.watch import _measure


def slow_generator(n: int, ms: float):
    for i in range(n):
        time.sleep(ms / 1000)
        yield torch.full((16, 2), i, dtype=torch.float32)


def background(n: int, ms: float, depth: int = 4):
    """Items made every ``ms`` on a thread, ahead of the consumer (a prefetching loader)."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def produce():
        for i in range(n):
            time.sleep(ms / 1000)
            q.put(np.full(8, i))
        q.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while (item := q.get()) is not None:
        yield item


def consume(batches, step_ms: float) -> int:
    n = 0
    for _ in batches:
        time.sleep(step_ms / 1000)
        n += 1
    return n


@pytest.mark.parametrize("produce_ms, step_ms", [(3.0, 1.0), (1.0, 3.0)])
def test_inline_generator_starvation(produce_ms, step_ms):
    # the loader runs inside next(): every wait is the full production time
    w = gpuload.watch(slow_generator(80, produce_ms), sample_util=False)
    assert consume(w, step_ms) == 80
    s = w.stats()
    assert s.starvation == pytest.approx(produce_ms / (produce_ms + step_ms), abs=0.05)
    assert (s.batches, s.rows, s.bytes) == (80, 80 * 16, 80 * 16 * 2 * 4)


@pytest.mark.parametrize("produce_ms, step_ms", [(6.0, 2.0), (2.0, 6.0)])
def test_prefetching_loader_starvation(produce_ms, step_ms):
    w = gpuload.watch(background(60, produce_ms), sample_util=False)
    assert consume(w, step_ms) == 60
    expected = max(0.0, produce_ms - step_ms) / max(produce_ms, step_ms)
    assert w.stats().starvation == pytest.approx(expected, abs=0.05)


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
    w = gpuload.watch(ds)
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
    gen = slow_generator(10, 0.0)
    w = gpuload.watch(gen, sample_util=False)
    for i, _ in enumerate(w):
        if i == 3:
            time.sleep(0.05)
            break
    s = w.stats()
    assert (s.batches, s.passes) == (4, 1) and s.wall_s >= 0.05 and s.step_max_s >= 0.05
    assert next(gen)[0, 0].item() == 4  # not closed behind the user's back
    assert consume(w, 0.0) == 5 and w.stats().passes == 2


def test_errors_propagate_and_are_timed():
    def failing():
        yield torch.zeros(2)
        time.sleep(0.02)
        raise OSError("disk gone")

    w = gpuload.watch(failing(), sample_util=False)
    with pytest.raises(OSError, match="disk gone"):
        consume(w, 0.0)
    s = w.stats()
    assert s.batches == 1 and s.wait_s >= 0.02 and s.passes == 1


def test_utilisation_is_sampled_during_a_pass():
    w = gpuload.watch(slow_generator(20, 10.0), util_period=0.02)
    consume(w, 0.0)
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
