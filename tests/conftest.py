"""Shared test set-up.

* the ``gpu`` marker skips cleanly where the GPU path cannot run (no driver, CuPy or KvikIO);
  with ``GPULOAD_REQUIRE_GPU=1`` (a run on a GPU node) the session fails instead, and
  also without pylibcudf;
* ``device``: runs a test once with ``"cpu"`` and once with ``"cuda"`` (marked ``gpu``);
  ``device_decode``: ``(device, decode)`` for the CPU and both GPU decoders;
* ``tmp_cache``: a fresh, empty cache directory under ``tmp_path`` (also set as
  ``$GPULOAD_CACHE_DIR``, so a dataset opened without ``cache_dir=`` never touches
  ``~/.cache``);
* ``write_parquet(path, table, row_group_size)``: a plain function (``from conftest
  import write_parquet``) and a fixture of the same name returning it;
* ``no_leftover_threads``: fails a test that passed but left a gpuload thread running
  (``pytestmark = pytest.mark.usefixtures("no_leftover_threads")`` in a module);
* ``record_loads(ds)``: the chunk indices a dataset loads from now on, in order;
* ``ManualClock``: a clock for ``Metrics(clock=...)`` that moves only when a test moves it;
* ``free_port()``: a free TCP port on localhost; ``run_launch(cmd, timeout)``: runs a launcher
  (torchrun, ``accelerate launch``, a Lightning script) in its own session and, past
  ``timeout`` seconds, kills it and every process it started, then fails the test.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _gpu_reason() -> str | None:
    from gpuload.gpu.runtime import gpu_status

    missing = {k: v for k, v in gpu_status().items() if v is not None and k != "cudf"}
    return None if not missing else "; ".join(f"{k}: {v}" for k, v in missing.items())


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if os.environ.get("GPULOAD_REQUIRE_GPU") == "1":  # a run on a GPU node: a skipped GPU test would prove nothing
        from gpuload.gpu.runtime import gpu_status

        reason = reason or gpu_status()["cudf"]
        if reason is not None:
            raise pytest.UsageError(f"GPULOAD_REQUIRE_GPU=1, but the GPU path cannot run here: {reason}")
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds folder names (tests/gpu)
            item.add_marker(skip)


def write_parquet(path, table, row_group_size: int | None = None, **kwargs) -> Path:
    """Write ``table`` (a ``pa.Table`` or a dict of columns) to ``path`` with row groups
    of ``row_group_size`` rows (None: one row group); creates parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(table, pa.Table):
        table = pa.table(table)
    pq.write_table(table, path, row_group_size=row_group_size or max(table.num_rows, 1), **kwargs)
    return path


@pytest.fixture(name="write_parquet")
def _write_parquet_fixture():
    return write_parquet


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Runs a test body on the CPU and, where the GPU path can run, on the GPU."""
    return request.param


@pytest.fixture(params=[("cpu", "auto"), pytest.param(("cuda", "gpu"), marks=pytest.mark.gpu),
                        pytest.param(("cuda", "cpu"), marks=pytest.mark.gpu)], ids=["cpu", "cuda-cudf", "cuda-arrow"])
def device_decode(request) -> tuple[str, str]:
    """``(device, decode)``: the CPU path; on a GPU, cuDF decoding and pyarrow decoding + copies."""
    if request.param == ("cuda", "gpu"):
        pytest.importorskip("pylibcudf")
    return request.param


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(path))
    return path


class ManualClock:
    """A clock for ``Metrics(clock=...)``: seconds that move only when the test moves them."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def gpuload_threads(include_writer=True) -> list[str]:
    """Names of the live gpuload threads (the cache writer's optional)."""
    names = [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("gpuload")]
    return names if include_writer else [n for n in names if not n.startswith("gpuload-write")]


def wait_no_threads(include_writer=True, timeout=3.0) -> list[str]:
    """Wait up to ``timeout`` seconds for gpuload's threads to end; returns those still running."""
    t0 = time.monotonic()
    while gpuload_threads(include_writer) and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return gpuload_threads(include_writer)


@pytest.fixture
def no_leftover_threads(request):
    """The test leaves no gpuload thread behind (checked only when it passed: a failure's
    traceback keeps its iterators alive)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    gc.collect()
    left = wait_no_threads(include_writer=True, timeout=5.0)
    assert not left, f"gpuload threads still running after the test: {left}"


def record_loads(ds) -> list[int]:
    """A list that receives the index of every chunk ``ds`` loads (cache read or decode) from now on."""
    loaded, load = [], ds.reader.load

    def recording(i):
        loaded.append(i)
        return load(i)

    ds.reader.load = recording
    return loaded


def at_once(*calls) -> list:
    """Run each of ``calls`` on its own thread, all released together; their results, in order
    (the first exception, if any, raised here)."""
    results, errors, start = [None] * len(calls), [], threading.Barrier(len(calls))

    def run(k):
        start.wait()
        try:
            results[k] = calls[k]()
        except BaseException as e:  # raised on the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launcher's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_launch(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` (a launcher and the processes it starts) in a new session; return its exit
    status and output. Past ``timeout`` seconds every process of the session (and any child
    that left it) is killed and the test fails: a hung rank must not hang the suite."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])}...: still running after {timeout} s (a rank hung?)\n"
                    + out.decode(errors="replace")[-6000:])
    return proc.returncode, out.decode(errors="replace")
