"""Utilisation sampling: CPU (psutil) and GPU (NVML) on a background thread.

:class:`UtilSampler` feeds :meth:`gpuload.Metrics.util_sample` every ``period``
seconds: this process's CPU use (percent of one core, so 200 means two busy cores),
the whole machine's CPU use (0-100), and, where ``pynvml`` (the ``nvidia-ml-py``
package) imports and NVML initialises, the GPU's utilisation (0-100) and memory in
use (bytes). Without NVML (CPU-only machines, MIG slices that do not report
utilisation) GPU fields stay None; the reason is logged once at debug level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from time import perf_counter

import psutil

__all__ = ["RunQueue", "UtilSampler"]

log = logging.getLogger("gpuload")
_nvml_reported = False


def _report_nvml(reason: str) -> None:
    global _nvml_reported
    if not _nvml_reported:
        _nvml_reported = True
        log.debug("gpuload: no GPU utilisation samples: %s", reason)


def _default_device() -> int:
    """torch's current CUDA device if CUDA is initialised in this process, else 0."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:  # a broken CUDA install: sample device 0
        pass
    return 0


def _open_nvml(device: int):
    """``(pynvml, handle)`` for CUDA device ``device`` (as CUDA numbers it), or None."""
    try:
        import pynvml
    except ImportError:
        _report_nvml("pynvml is not installed (pip install nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:
        _report_nvml(f"NVML did not initialise ({e})")
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        else:  # CUDA numbers the visible devices; NVML numbers them all
            entry = [e.strip() for e in visible.split(",") if e.strip()][device]
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(entry))
        pynvml.nvmlDeviceGetUtilizationRates(handle)  # MIG slices refuse this
        return pynvml, handle
    except Exception as e:
        _report_nvml(f"NVML has no utilisation for CUDA device {device} ({e!r})")
        pynvml.nvmlShutdown()
        return None


class _SystemCpu:
    """Machine-wide CPU use between calls, from ``psutil.cpu_times`` (own state, unlike
    ``psutil.cpu_percent``, which any other caller in the process would reset)."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0), idle

    def percent(self) -> float | None:
        total, idle = self._read()
        d_total, d_idle = total - self._last[0], idle - self._last[1]
        self._last = (total, idle)
        return None if d_total <= 0 else min(100.0, max(0.0, 100.0 * (d_total - d_idle) / d_total))


class RunQueue:
    """CPU time and run-queue time of this process's threads, from Linux's
    ``/proc/self/task/*/schedstat`` (nanoseconds running on a core, and runnable but waiting
    for one). :meth:`delta` gives both, in seconds, since the previous call (or creation), for
    gpuload's threads and the others (the training thread, torch's intra-op threads...)
    apart; threads that started meanwhile count from their start. Where the file is missing
    (another OS, a kernel without schedstats) every figure is 0 and :attr:`available` False."""

    def __init__(self):
        self._last = self._read()
        self.available = bool(self._last)

    @staticmethod
    def _read() -> dict:
        out = {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run, wait = f.read().split()[:2]
                out[int(tid)] = (int(run), int(wait))
            except (OSError, ValueError):
                continue  # ended meanwhile
        return out

    def delta(self) -> dict:
        """``{"gpuload": (cpu s, run-queue s), "other": (cpu s, run-queue s)}`` since the last call."""
        now, last = self._read(), self._last
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {"gpuload": [0, 0], "other": [0, 0]}
        for tid, (run, wait) in now.items():
            r0, w0 = last.get(tid, (0, 0))
            part = out["gpuload" if names.get(tid, "").startswith("gpuload") else "other"]
            part[0] += max(0, run - r0)
            part[1] += max(0, wait - w0)
        self._last = now
        return {k: (v[0] / 1e9, v[1] / 1e9) for k, v in out.items()}


class UtilSampler:
    """Samples CPU and GPU utilisation into ``metrics`` on a daemon thread.

    Use as a context manager (``with UtilSampler(m): ...``: start, then stop and
    :meth:`close`), or call :meth:`start` and :meth:`stop` around each stretch to
    measure and :meth:`close` at the end. Pausing and resuming cost microseconds: the
    thread and NVML stay open while paused (a thread paused for ``IDLE_EXIT_S`` ends, and
    the next start makes a new one). Every sample covers the time since the previous
    one, never time spent paused.

    Parameters
    ----------
    metrics : the :class:`gpuload.Metrics` that receives the samples. Their times, and the
        tail rule of :meth:`stop`, come from its ``clock``; the wait of ``period`` between
        samples is real time.
    period : seconds between samples (default 0.1).
    gpu : sample the GPU through NVML where available (default True).
    device : CUDA device index to sample, as CUDA numbers visible devices (default:
        torch's current device when CUDA is initialised, else 0).
    """

    #: Seconds a paused sampling thread waits for a restart before it ends.
    IDLE_EXIT_S = 5.0

    def __init__(self, metrics, *, period: float = 0.1, gpu: bool = True, device: int | None = None):
        if not period > 0:
            raise ValueError(f"period={period!r} must be a positive number of seconds")
        self.metrics, self.period, self.gpu, self.device = metrics, float(period), gpu, device
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._active = self._closed = self._nvml_tried = False
        self._nvml = None
        self._clock = getattr(metrics, "clock", perf_counter)
        self._proc = psutil.Process()
        self._system = _SystemCpu()
        self._runq = None
        self._last = self._started = 0.0

    @property
    def running(self) -> bool:
        """Whether sampling is on (between :meth:`start` and :meth:`stop`)."""
        return self._active

    @property
    def has_gpu(self) -> bool:
        """Whether GPU samples are taken (NVML opened for the device)."""
        return self._nvml is not None

    def start(self) -> UtilSampler:
        """Start or resume sampling (no-op if running); returns self."""
        with self._cond:
            if self._active:
                return self
            if self.gpu and not self._nvml_tried:
                self._nvml_tried = True
                self._nvml = _open_nvml(_default_device() if self.device is None else self.device)
            self._proc.cpu_percent(None)  # reference points: samples never cover a pause
            self._system = _SystemCpu()
            self._runq = RunQueue()  # reference point: what runs while paused is not counted
            self._last = self._started = self._clock()
            self._active, self._closed = True, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuload-util", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return self

    def stop(self) -> None:
        """Pause sampling, after a last sample of the time since the previous one when that
        is at least half a period (or 10 ms when nothing was sampled since :meth:`start`).
        No-op if not running."""
        with self._cond:
            if not self._active:
                return
            self._active = False
            self._cond.notify_all()
            tail = self._clock() - self._last
            if tail >= self.period / 2 or (tail >= 0.01 and self._last == self._started):
                self._sample()

    def close(self) -> None:
        """Stop sampling, end the thread and release NVML. :meth:`start` may open them again."""
        self.stop()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._nvml is not None:
            try:
                self._nvml[0].nvmlShutdown()
            except Exception:  # shutting down is best effort
                pass
        self._nvml, self._nvml_tried = None, False

    def _run(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while not self._closed and self._thread is me:
                if not self._active:
                    if not self._cond.wait(self.IDLE_EXIT_S) and not self._active:
                        self._thread = None  # idle too long: end; start() makes a new thread
                        return
                    continue
                if not self._cond.wait(self.period) and self._active:  # a full period, not woken
                    self._sample()

    def sample(self) -> None:
        """Take one sample now and record it (the thread calls this every ``period``); while
        paused, nothing is recorded (the time since the last sample was paused time)."""
        with self._cond:
            if self._active:
                self._sample()

    def _sample(self) -> None:
        gpu = mem = None
        if self._nvml is not None:
            nvml, handle = self._nvml
            try:
                gpu = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                mem = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception as e:
                _report_nvml(f"NVML sample failed ({e!r})")
        try:
            cpu, system = self._proc.cpu_percent(None), self._system.percent()
        except Exception as e:  # psutil cannot fail for this process on Linux; elsewhere, skip the sample
            log.debug("gpuload: CPU sample failed: %r", e)
            cpu = system = None
        self._last = t = self._clock()
        self.metrics.util_sample(t, cpu_percent=cpu, system_cpu_percent=system, gpu_percent=gpu,
                                 gpu_memory_bytes=mem)
        if self._runq is not None and self._runq.available and hasattr(self.metrics, "run_queue"):
            self.metrics.run_queue(self._runq.delta())

    def __enter__(self) -> UtilSampler:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
