"""UtilSampler: CPU samples everywhere, GPU samples through NVML (faked here), silent NVML failures.

No test assumes the sampling thread keeps time: tests wait for its samples (with a generous
bound), take samples with :meth:`UtilSampler.sample`, or run on a :class:`ManualClock`.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
import types

import pytest
import torch

from gpuload import Metrics
from gpuload.observe import sampling
from gpuload.observe.sampling import UtilSampler

from conftest import ManualClock, wait_until


@pytest.fixture
def fresh_nvml_report(monkeypatch):
    monkeypatch.setattr(sampling, "_nvml_reported", False)


def fake_nvml(*, init_error: Exception | None = None, gpu: int = 42, used: int = 3 << 30):
    opened = []

    def init():
        if init_error is not None:
            raise init_error

    def by_index(i):
        opened.append(("index", i))
        return f"handle{i}"

    def by_uuid(u):
        opened.append(("uuid", u))
        return u

    mod = types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: opened.append(("shutdown",)),
        nvmlDeviceGetHandleByIndex=by_index, nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=gpu, memory=10),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used, total=8 << 30))
    return mod, opened


def test_cpu_samples_of_a_busy_thread():
    m = Metrics()
    start, cpu0 = time.perf_counter(), time.process_time()
    with UtilSampler(m, period=0.02, gpu=False) as s:
        assert s.running and not s.has_gpu
        thread = s._thread
        data, end = bytes(1 << 18), time.monotonic() + 60
        while time.process_time() - cpu0 < 0.3 or m.stats().util_samples < 4:  # however busy the machine is
            assert time.monotonic() < end, "no samples"
            hashlib.sha256(data).digest()  # CPU work without the GIL: the sampler samples on time
    cpu = time.process_time() - cpu0
    assert not s.running and not thread.is_alive()  # the context manager closes it
    st = m.stats()
    assert st.util_samples >= 4 and st.cpu_percent > 0
    # each sample is the process's CPU use (percent of a core) since the previous one (or the start):
    # over their intervals they add up to the CPU time it used, whatever share of a core it got
    times = [start] + [t + m.first_time() for t in m.util_samples()["t"]]
    used = sum(pct / 100 * (t1 - t0) for pct, t0, t1 in zip(m.util_samples()["cpu_percent"], times, times[1:]))
    assert used == pytest.approx(cpu, abs=0.05)  # /proc counts CPU time in 10 ms ticks; a tail under 10 ms
    assert 0 < st.system_cpu_percent <= 100
    assert st.gpu_percent is None and st.gpu_memory_bytes is None
    cpu = [e for e in m.trace_events() if e["name"] == "CPU %"]
    assert len(cpu) == st.util_samples and {"process", "system"} == cpu[0]["args"].keys()


def test_pause_resume_and_close(monkeypatch):
    m = Metrics()
    s = UtilSampler(m, period=0.01, gpu=False)
    s.stop()  # no-op
    threads = set()
    for _ in range(2):
        s.start()
        assert s.start() is s and s.running  # already running: no second thread
        threads.add(s._thread)
        before = m.stats().util_samples
        wait_until(lambda: m.stats().util_samples >= before + 2)  # the thread samples while running
        s.stop()
        n = m.stats().util_samples
        time.sleep(0.03)
        assert m.stats().util_samples == n  # paused: no samples
    (thread,) = threads  # one thread, kept while paused
    assert thread.name == "gpuload-util" and thread.is_alive()
    s.close()
    assert not thread.is_alive()
    with pytest.raises(ValueError):
        UtilSampler(m, period=0)


def test_an_idle_thread_ends_and_a_restart_makes_a_new_one(monkeypatch):
    monkeypatch.setattr(UtilSampler, "IDLE_EXIT_S", 0.05)
    m = Metrics()
    s = UtilSampler(m, period=0.01, gpu=False).start()
    s.stop()
    thread = s._thread
    thread.join(timeout=30)
    assert not thread.is_alive() and s._thread is None
    s.start()
    wait_until(lambda: m.stats().util_samples >= 3)  # a new thread samples
    assert s._thread is not None and s._thread is not thread and s._thread.is_alive()
    s.close()


def test_gpu_samples_through_nvml(monkeypatch, fresh_nvml_report):
    mod, opened = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    m = Metrics()
    with UtilSampler(m, period=0.01, device=0) as s:
        assert s.has_gpu
        s.sample()
    st = m.stats()
    assert st.gpu_percent == 42.0 and st.gpu_memory_bytes == 3 << 30
    assert opened[0] == ("index", 0) and opened[-1] == ("shutdown",)
    names = {e["name"] for e in m.trace_events() if e["ph"] == "C"}
    assert {"CPU %", "GPU %", "GPU memory MiB"} <= names
    assert "GPU 42%" in str(st)


@pytest.mark.parametrize("visible, expected", [("3,5", ("index", 5)), ("GPU-abc, GPU-def", ("uuid", "GPU-def"))])
def test_cuda_visible_devices_maps_to_nvml(monkeypatch, fresh_nvml_report, visible, expected):
    mod, opened = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with UtilSampler(Metrics(), period=0.01, device=1):
        pass
    assert opened[0] == expected


def test_nvml_failures_are_silent_and_logged_once(monkeypatch, fresh_nvml_report, caplog):
    mod, _ = fake_nvml(init_error=RuntimeError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    caplog.set_level(logging.DEBUG, logger="gpuload")
    m = Metrics()
    for _ in range(3):
        with UtilSampler(m, period=0.01) as s:
            s.sample()
    st = m.stats()
    assert st.gpu_percent is None and st.cpu_percent is not None and st.util_samples >= 3
    records = [r for r in caplog.records if "GPU utilisation" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert "Not Found" in records[0].getMessage()


def test_without_pynvml(monkeypatch, fresh_nvml_report, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    caplog.set_level(logging.DEBUG, logger="gpuload")
    with UtilSampler(Metrics(), period=0.01) as s:
        assert not s.has_gpu
    assert any("nvidia-ml-py" in r.getMessage() for r in caplog.records)


def test_real_nvml_on_this_machine():
    m = Metrics()
    with UtilSampler(m, period=0.01) as s:
        has_gpu = s.has_gpu
        s.sample()
    st = m.stats()
    if has_gpu:  # a GPU that NVML reports on (not a MIG slice)
        assert 0 <= st.gpu_percent <= 100 and st.gpu_memory_bytes > 0
    else:
        assert st.gpu_percent is None
    if not torch.cuda.is_available():
        assert not has_gpu


def test_stop_samples_the_tail_only_when_it_is_worth_it():
    clock = ManualClock()
    m = Metrics(clock=clock)
    s = UtilSampler(m, period=1024.0, gpu=False)  # the thread would sample after 1024 real seconds: never here

    def run(start: float, sample_at: float | None, stop: float) -> None:
        clock.t = start
        s.start()
        if sample_at is not None:
            clock.t = sample_at
            s.sample()
        clock.t = stop
        s.stop()

    run(8.0, None, 8.0 + 2**-7)  # 7.8 ms, nothing sampled: no sample of a near-empty interval
    run(16.0, None, 16.0 + 2**-6)  # 15.6 ms, nothing sampled: the tail becomes the pass's one sample
    run(32.0, 33.0, 33.0 + 511)  # under half a period since the last sample: no tail
    run(1024.0, 1025.0, 1025.0 + 512)  # half a period: the tail is sampled
    s.close()
    cpu = [e["ts"] / 1e6 for e in m.trace_events(origin=0.0) if e["name"] == "CPU %"]
    assert cpu == [16.0 + 2**-6, 33.0, 1025.0, 1537.0] and m.stats().util_samples == 4


def test_run_queue_measures_threads_waiting_for_a_core():
    """More threads that each want a core than there are cores: they wait in the run queue, and
    the loader's (named gpuload-*) are told apart from the others."""
    import hashlib
    import os
    import threading

    from gpuload.observe.sampling import RunQueue

    rq = RunQueue()
    if not rq.available:
        pytest.skip("no /proc/self/task/*/schedstat here")
    data, done = b"x" * (4 << 20), threading.Event()

    def spin():
        while not done.is_set():
            hashlib.sha256(data).digest()  # releases the GIL: every thread runs at once

    n = 3 * (os.cpu_count() or 1)
    threads = [threading.Thread(target=spin, name=f"gpuload-test-{i}" if i % 2 else f"other-{i}") for i in range(n)]
    for t in threads:
        t.start()
    try:
        # until they ran 0.6 s of CPU in all, about 0.3 s a side (0.6 s of wall time on one idle core): on
        # busy cores 0.6 s of wall time gave a side 0.03 s
        cpu0, end = time.process_time(), time.monotonic() + 60
        time.sleep(0.6)
        while time.process_time() - cpu0 < 0.6 and time.monotonic() < end:
            time.sleep(0.05)
        got = rq.delta()  # while they run: a thread's counters go with it when it ends
    finally:
        done.set()
        for t in threads:
            t.join()
    for side in ("gpuload", "other"):
        cpu, wait = got[side]
        assert cpu > 0.05 and wait > 0.2 * cpu, got  # three threads per core: each waits about twice as long as it runs
    assert rq.delta()["gpuload"][0] < got["gpuload"][0]  # the next delta starts from here


def test_contention_is_reported_and_diagnosed():
    import gpuload
    from gpuload.observe.stats import Stats

    def stats(queue):
        return Stats(wall_s=10.0, batches=10, rows=100, bytes=1, wait_s=5.0, starvation=0.5, passes=1,
                     wait_mean_s=0.5, wait_max_s=1.0, step_mean_s=0.5, step_max_s=1.0, stages={}, first_wait_s=0.1,
                     loader="iterable", cpu_queue=queue)

    busy = stats({"gpuload": (4.0, 3.0), "other": (4.0, 1.0)})
    assert busy.cpu_contention == pytest.approx(0.5) and "waited for a core 50% as long as they ran" in str(busy)
    d = gpuload.diagnose(busy)
    assert "oversubscribed (measured)" in d.message and "torch.set_num_threads" in d.action
    calm = stats({"gpuload": (4.0, 0.2), "other": (4.0, 0.1)})
    assert "oversubscribed" not in gpuload.diagnose(calm).message
    assert stats(None).cpu_contention is None


def test_a_sample_taken_while_paused_records_nothing():
    m = Metrics()
    s = UtilSampler(m, period=60, gpu=False)
    s.start()
    s.stop()
    n = m.stats().util_samples
    s.sample()  # paused: the time since the last sample was not measured time
    assert m.stats().util_samples == n
    s.close()
