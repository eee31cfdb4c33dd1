"""Shared test set-up.

* the ``gpu`` marker skips cleanly where the GPU path cannot run (no driver or CuPy, or
  whatever else :func:`gpuload.gpu.runtime.gpu_usable` wants); the ``cudf`` marker (with
  ``gpu``) also skips without the RAPIDS stack (pylibcudf, RMM, KvikIO). A run on a GPU
  node that must not pass by skipping sets ``GPULOAD_REQUIRE_GPU=1`` (the session fails
  without a driver or CuPy) or ``GPULOAD_REQUIRE_GPU=cudf`` (also without the RAPIDS stack;
  ``GPULOAD_REQUIRE_CUDF=1`` means the same): :func:`required_pieces`;
* the device guard: a test not marked ``gpu`` fails if a dataset (or anything else calling
  :func:`gpuload.device.resolve_device`) gets a CUDA device, or resolves ``device="auto"``
  (the default) at all, unless the test is marked ``auto_device``: on a GPU node ``"auto"``
  means CUDA tensors and cuDF decoding, so a test that reads values on the host passes
  ``device="cpu"`` (or the ``device`` fixture). :class:`DeviceGuard`;
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
  ``timeout`` seconds, kills it and every process it started, then fails the test;
* ``open_dataset(source, columns, cache, **kw)``: the tests' one dataset factory (``device="cpu"``
  unless given); ``dataset_factory(columns, **defaults)``: a module's opener with its own defaults;
* ``row_ids(batches)``: the ``row_id`` column of an epoch (a list of batches or a dataset) as one
  NumPy array; ``wait_until(condition, timeout)``: polls until ``condition()`` holds, or fails;
  ``run_with_timeout(fn, timeout)``: ``fn()`` on a thread, failing the test if it hangs;
* ``spawn(cmd)``: starts a process that is killed, with every process it started, when the test
  ends (if it still runs); ``kill_tree(proc)``; ``spawn_warm(code, *args)``: the same for
  ``python -c code`` (or a script), forked from a fork server that imported torch, pyarrow and
  gpuload once (:class:`Warm`: 3 s of CPU less a process; not for a process whose start is tested);
* the process guard: a test that starts a process (subprocess, multiprocessing, fork, a Dask
  cluster of processes, Spark, a notebook kernel...) must be marked ``slow``, or it fails:
  ``pytest -m "not slow"`` is the run a developer repeats every few minutes, and each process
  pays an interpreter's start and torch's import. :class:`ProcessGuard`;
* ``ARROW_READS_NULL_FIXED_LISTS``: whether this pyarrow reads fixed-size lists with null rows;
  child processes get this checkout on ``PYTHONPATH``, and ``tests/site`` (its ``sitecustomize`` freezes a
  process's objects as it exits: the collector's last passes over torch's cost about 1 s of CPU a process);
* every test's default cache folder (``$GPULOAD_CACHE_DIR``) is a folder of its own under its
  ``tmp_path``, and Dask's scratch space is under pytest's temporary root: no test writes to
  ``~/.cache/gpuload``, the working directory or fixed names in ``/tmp``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest_plugins = ["pytester"]  # tests/test_conftest.py runs this set-up in sessions of its own

# pyarrow before 26 cannot read fixed-size lists with null rows (apache/arrow#35692): test data has
# such rows only where it can, and tests/test_decode.py checks what gpuload says where it cannot
ARROW_READS_NULL_FIXED_LISTS = int(pa.__version__.split(".")[0]) >= 26

# The processes tests start (torchrun, the CLI, pytester sessions...) import gpuload from this
# checkout, installed or not (a GPU node runs the suite from a copy of the repository).
# tests/site's sitecustomize skips the collector's passes as each of them exits (about 1 s of CPU a process).
ROOT = str(Path(__file__).resolve().parent.parent)
SITE = str(Path(__file__).resolve().parent / "site")
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([ROOT, SITE, *filter(None, os.environ.get("PYTHONPATH", "")
                                                                                       .split(os.pathsep))]))

# Caches keep 10% of their disk free by default (gpuload.cache.space); a test machine's disk may
# be fuller than that, and the tests that assert what is cached must not depend on it: no reserve
# here (and in the processes tests start), except where tests/cache/test_space.py sets one.
os.environ["GPULOAD_CACHE_RESERVE"] = "0"

RAPIDS = ("cudf", "kvikio", "rmm")  # what the `cudf` marker needs: pylibcudf (gpu_status's "cudf"), KvikIO, RMM


def required_pieces(environ=os.environ) -> tuple[str, ...]:
    """The pieces a session must have instead of skipping tests that need them: ``()`` (skip
    cleanly), ``("driver", "cupy")`` for ``GPULOAD_REQUIRE_GPU=1``, and the RAPIDS stack too for
    ``GPULOAD_REQUIRE_GPU=cudf`` or ``GPULOAD_REQUIRE_CUDF=1``."""
    gpu, cudf = environ.get("GPULOAD_REQUIRE_GPU", ""), environ.get("GPULOAD_REQUIRE_CUDF", "")
    if gpu not in ("", "0", "1", "cudf") or cudf not in ("", "0", "1"):
        raise pytest.UsageError(f"GPULOAD_REQUIRE_GPU={gpu!r}, GPULOAD_REQUIRE_CUDF={cudf!r}: "
                                "use GPULOAD_REQUIRE_GPU=1 (driver and CuPy) or =cudf (also pylibcudf, RMM, KvikIO)")
    if gpu == "cudf" or cudf == "1":
        return ("driver", "cupy") + RAPIDS
    return ("driver", "cupy") if gpu == "1" else ()


def _status() -> dict:
    """gpuload's own report (driver, cupy, kvikio, cudf; None = usable), plus rmm: whether it is installed
    (not imported: importing RAPIDS modules has process-wide side effects a collection must not have)."""
    from gpuload.gpu.runtime import gpu_status

    status = dict(gpu_status())
    for name in ("kvikio", "rmm"):  # kvikio: where gpuload no longer reports it (optional for the GPU path)
        if name not in status:
            status[name] = None if importlib.util.find_spec(name) is not None else f"{name} is not installed"
    return status


def _why(status: dict, pieces) -> str | None:
    missing = {k: status.get(k) for k in pieces if status.get(k) is not None}
    return "; ".join(f"{k}: {v}" for k, v in missing.items()) or None


def skip_reasons(status: dict, usable: bool, required: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(reason to skip gpu tests, reason to skip cudf tests)`` (None: they run) from
    :func:`_status`, :func:`gpuload.gpu.runtime.gpu_usable` and :func:`required_pieces`.
    Raises :class:`pytest.UsageError` where a required piece is missing: a run on a GPU node
    that skipped its GPU tests would prove nothing."""
    missing = _why(status, required)
    if missing is not None:
        flag = "GPULOAD_REQUIRE_GPU=cudf" if "cudf" in required else "GPULOAD_REQUIRE_GPU=1"
        raise pytest.UsageError(f"{flag}, but the GPU path cannot run here: {missing}")
    # gpuload decides what the GPU path needs (KvikIO is optional once gpu_usable() says so); a
    # required run does not skip because of a piece it does not require: the tests fail instead
    gpu = None if usable or required else (_why(status, ("driver", "cupy")) or "gpu_usable() is False")
    cudf = gpu or (None if "cudf" in required else _why(status, RAPIDS))
    return gpu, cudf


_SKIPS = pytest.StashKey[tuple]()


def pytest_collection_modifyitems(config, items):
    gpu, cudf = config.stash[_SKIPS]
    for item in items:
        # get_closest_marker, not item.keywords: keywords hold folder names (tests/gpu)
        if gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {gpu}"))
        elif cudf is not None and item.get_closest_marker("cudf") is not None:
            item.add_marker(pytest.mark.skip(reason=f"cudf test: {cudf}"))


class DeviceGuard:
    """Wraps :func:`gpuload.device.resolve_device` (wherever gpuload imported it) for the whole
    session, and checks each resolution against the test running (:attr:`item`).

    A test not marked ``gpu`` may not get a CUDA device, nor resolve ``device="auto"`` unless it is
    marked ``auto_device`` (it means to run on whatever "auto" picks and copes with CUDA tensors)
    or ``fake_gpu`` (it stands in a GPU node on purpose, with torch and CuPy patched, and stops
    at the first real device call).
    On the training thread the resolution fails the test at once; on any other thread it is
    recorded, and the test fails at teardown (the ``_guards`` fixture).
    """

    def __init__(self):
        self.item = None
        self.original = None
        self.violations: list[str] = []

    @staticmethod
    def problem(item, requested, resolved) -> str | None:
        """Why ``item`` may not resolve ``requested`` to ``resolved`` (a torch.device), or None."""
        if item is None or item.get_closest_marker("gpu") is not None or item.get_closest_marker("fake_gpu"):
            return None
        auto = str(requested) == "auto"
        marked_auto = item.get_closest_marker("auto_device") is not None
        if auto and marked_auto:
            return None
        if resolved.type == "cuda":
            return (f"{item.nodeid}: not marked gpu, but device={str(requested)!r} gave {resolved}: pass "
                    "device='cpu' (or use the `device` fixture), or mark the test gpu")
        if auto:
            return (f"{item.nodeid}: resolves device='auto' (the default): on a GPU node its batches would be "
                    "CUDA tensors decoded by cuDF. Pass device='cpu' (or use the `device` fixture), or mark the "
                    "test auto_device if it means to run on whatever device 'auto' picks")
        return None

    def install(self) -> None:
        import sys

        import gpuload.device

        if self.original is not None:
            return
        self.original = original = gpuload.device.resolve_device

        def resolve_device(device):
            resolved = original(device)
            why = self.problem(self.item, device, resolved)
            if why is not None:
                self.violations.append(why)
                if threading.current_thread() is threading.main_thread():
                    pytest.fail(why, pytrace=False)
            return resolved

        resolve_device.__wrapped__ = original
        resolve_device.__doc__ = original.__doc__
        for name, module in list(sys.modules.items()):  # gpuload.device, and modules that imported it from there
            ours = name == "gpuload" or name.startswith("gpuload.")
            if ours and getattr(module, "resolve_device", None) is original:
                module.resolve_device = resolve_device


GUARD = DeviceGuard()


def pytest_configure(config):
    """Before collection, and before pytest-xdist starts workers: a required piece that is missing
    ends the session here, in one line, instead of in every worker's collection."""
    from gpuload.gpu.runtime import gpu_usable

    config.stash[_SKIPS] = skip_reasons(_status(), gpu_usable(), required_pieces())
    GUARD.install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    GUARD.item, GUARD.violations = item, []


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


@pytest.fixture(params=[("cpu", "auto"), pytest.param(("cuda", "gpu"), marks=[pytest.mark.gpu, pytest.mark.cudf]),
                        pytest.param(("cuda", "cpu"), marks=pytest.mark.gpu)], ids=["cpu", "cuda-cudf", "cuda-arrow"])
def device_decode(request) -> tuple[str, str]:
    """``(device, decode)``: the CPU path; on a GPU, cuDF decoding (marked ``cudf``) and pyarrow
    decoding + copies (which needs only torch and CuPy)."""
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
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not gpuload_threads(include_writer), timeout, interval=0.02)
    return gpuload_threads(include_writer)


@pytest.fixture
def no_leftover_threads(request):
    """The test leaves no gpuload thread behind (checked only when it passed: a failure's
    traceback keeps its iterators alive)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    if gpuload_threads():
        gc.collect()  # an iterator left in a reference cycle stops its threads when collected
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    proc = spawn(cmd, env=env, stderr=subprocess.STDOUT, text=False)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])}...: still running after {timeout} s (a rank hung?)\n"
                    + out.decode(errors="replace")[-6000:])
    return proc.returncode, out.decode(errors="replace")


# ---------------------------------------------------------------------------------------
# processes: the guard, spawn(), kill_tree()
# ---------------------------------------------------------------------------------------

class ProcessGuard:
    """Fails a test not marked ``slow`` that starts a process (``subprocess``, ``multiprocessing``,
    ``os.fork``/``posix_spawn``/``system``; from any thread, fixtures included): each process pays
    an interpreter's start and torch's import, which ``pytest -m "not slow"`` must not. The start
    goes ahead (refusing it could hang the test: a Dask cluster waits for workers that never
    come) and the test fails at teardown, naming what it started (the ``_guards`` fixture).
    Tests marked ``gpu`` are left alone (the GPU stack's own imports may start helpers this
    machine cannot vouch for); those that start processes are marked ``slow`` by hand.
    :attr:`item`: the test running (None between tests: pytest-xdist starts its workers outside
    any test)."""

    def __init__(self):
        self.item = None
        self.violations: list[str] = []
        self.installed = False

    def problem(self, what: str) -> str | None:
        item = self.item
        if item is None or item.get_closest_marker("slow") is not None or item.get_closest_marker("gpu"):
            return None
        return (f"{item.nodeid}: starts a process ({what}) but is not marked slow: mark it "
                "@pytest.mark.slow, or test the same thing in this process")

    def check(self, what) -> None:
        why = self.problem(str(what)[:200])
        if why is not None:
            self.violations.append(why)

    def install(self) -> None:
        import multiprocessing.process

        if self.installed:
            return
        self.installed = True
        guard = self

        def wrap(owner, name, describe):
            original = getattr(owner, name, None)
            if original is None:
                return

            def guarded(*args, **kwargs):
                guard.check(describe(*args, **kwargs))
                return original(*args, **kwargs)

            guarded.__wrapped__ = original
            setattr(owner, name, guarded)

        wrap(subprocess.Popen, "_execute_child", lambda self, args, *a, **k: f"subprocess: {args!r}")
        wrap(multiprocessing.process.BaseProcess, "start", lambda self: f"multiprocessing: {self!r}")
        for name in ("fork", "forkpty"):
            wrap(os, name, lambda *a, _n=name: f"os.{_n}()")
        for name in ("posix_spawn", "posix_spawnp", "system"):
            wrap(os, name, lambda cmd, *a, _n=name, **k: f"os.{_n}: {cmd!r}")


PROCESSES = ProcessGuard()


@pytest.fixture(scope="session", autouse=True)
def _process_guard_installed():
    PROCESSES.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    PROCESSES.item, PROCESSES.violations = item, []
    try:
        yield
    finally:
        PROCESSES.item = None


@pytest.fixture(autouse=True)
def _guards(request):
    """Fails a test that passed while it (or a thread of it) resolved a device it may not have
    (:class:`DeviceGuard`) or started a process it may not have (:class:`ProcessGuard`)."""
    failed = request.session.testsfailed
    yield
    found = GUARD.violations + PROCESSES.violations
    if found and request.session.testsfailed == failed:
        pytest.fail("\n".join(dict.fromkeys(found)), pytrace=False)


def stand_in(guard, request):
    """For a fixture: ``set_item(item)`` runs the rest of the test as if it were ``item`` for
    ``guard`` (GUARD or PROCESSES); the test's own item, with no violation left, after."""

    def set_item(item):
        guard.item, guard.violations = item, []

    yield set_item
    guard.item, guard.violations = request.node, []


_SPAWNED: list = []  # what spawn() and spawn_warm() started during the running test (Popen, Warm)


def kill_tree(proc: "subprocess.Popen | Warm") -> None:
    """SIGKILL ``proc``, its process group where it leads one, and every process it started
    (also those that left its group); wait until ``proc`` is gone."""
    import psutil

    if proc.poll() is not None:
        return  # ended, and reaped: its pid may be another process's now
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def spawn(cmd, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd)`` (arguments made strings) in a session of its own, stdout and
    stderr piped as text unless given; whatever of it still runs when the test ends is killed
    with every process it started (:func:`kill_tree`, the ``_reap_spawned`` fixture). A test
    that spawns is marked ``slow`` (the process guard)."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True,
              **kwargs}
    proc = subprocess.Popen([str(c) for c in cmd], **kwargs)
    _SPAWNED.append(proc)
    return proc


def python(code: str, *args) -> list[str]:
    """The command that runs ``code`` in a fresh interpreter of this one, with ``args``."""
    return [sys.executable, "-c", code, *map(str, args)]


# What a warm process runs in the fork server's child: ``python -c code *args`` as a fresh interpreter would
# (a session of its own, its output in files, the test's environment and folder, ``atexit`` at the end)
_WARM_MAIN = """
import atexit, os, sys, threading, types
os.setsid()
for fd, path in ((0, os.devnull), (1, spec["out"]), (2, spec["err"])):
    f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
os.chdir(spec["cwd"])
os.environ.clear()
os.environ.update(spec["env"])
script = spec["script"]
sys.argv = [script or "-c", *spec["args"]]
if script:
    sys.path.insert(0, os.path.dirname(script))
main = types.ModuleType("__main__")  # what the code defines is __main__'s, as in python -c (pickles by name)
main.__dict__.update(__builtins__=__builtins__, **({"__file__": script} if script else {}))
sys.modules["__main__"] = main
try:
    exec(compile(spec["code"], script or "<string>", "exec"), main.__dict__)
finally:  # what an interpreter does as it ends (the fork server's handlers are those its imports registered,
    threading._shutdown()  # as a fresh interpreter's would be)
    atexit._run_exitfuncs()
"""

WARM_PRELOAD = ("numpy", "pyarrow.parquet", "torch", "gpuload.dataset", "gpuload.cache.store")


class Warm:
    """``python -c code *args`` (or ``python script *args``, ``code`` a :class:`Path`) forked from a warm
    interpreter: multiprocessing's fork server, which
    imported :data:`WARM_PRELOAD` once per test worker, so the process starts in milliseconds instead
    of paying torch's import (about 3 s of CPU here). A real process (SIGKILL ends it where it is),
    in a session of its own, with the test's environment (``env`` replaces it) and working folder,
    ``sys.argv``, ``atexit`` at the end and, for an uncaught exception, a traceback on stderr and
    exit status 1. stdout and stderr go to files that :meth:`communicate` returns as text. The
    methods of ``subprocess.Popen`` that the tests and :func:`kill_tree` use: ``pid``, ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``terminate``. Started with
    :func:`spawn_warm`. Unlike a fresh interpreter: ``sys.path`` is the test worker's (``PYTHON*``
    variables read at start-up are not read again), the fork server's seeded state (hash seed, NumPy's
    and torch's global generators) is every child's, multiprocessing starts its processes with the
    fork server, a Ctrl-C exits with status 1, and the interpreter's own shut-down is left out (the
    ``atexit`` handlers run, then the process ends). For a process whose start or end is under test
    (imports, the CLI, peak memory, a GPU context torn down), use :func:`spawn`."""

    stdin = stdout = stderr = None

    def __init__(self, code: "str | Path", *args, env: dict | None = None):
        import multiprocessing.util
        import tempfile

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(WARM_PRELOAD))
        if len(tempfile.gettempdir()) > 40 and os.path.isdir("/tmp"):
            # the fork server's socket is made in multiprocessing's temporary folder, kept for the worker's
            # life: under pytest's temporary root (conftest sets it as tempfile's) its path could pass the
            # 107 characters a Unix socket's may have
            with _tempdir("/tmp"):
                multiprocessing.util.get_temp_dir()
        self._files = Path(tempfile.mkdtemp(prefix="warm-"))
        script = str(Path(code).resolve()) if isinstance(code, Path) else None
        spec = {"code": Path(script).read_text() if script else code, "script": script,
                "args": [str(a) for a in args], "env": dict(os.environ if env is None else env),
                "cwd": os.getcwd(), "out": str(self._files / "out"), "err": str(self._files / "err")}
        self.args = [script] if script else ["-c", code]
        self.args += spec["args"]
        self._proc = ctx.Process(target=exec, args=(_WARM_MAIN, {"spec": spec}), daemon=False)
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return tuple((self._files / name).read_text(errors="replace") if (self._files / name).exists() else ""
                     for name in ("out", "err"))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


@contextlib.contextmanager
def _tempdir(path: str):
    import tempfile

    before, tempfile.tempdir = tempfile.tempdir, path
    try:
        yield
    finally:
        tempfile.tempdir = before


def spawn_warm(code: "str | Path", *args, env: dict | None = None) -> Warm:
    """:class:`Warm` ``(code, *args)``, killed with every process it started when the test ends (if it
    still runs), as :func:`spawn` does. A test that spawns is marked ``slow`` (the process guard)."""
    proc = Warm(code, *args, env=env)
    _SPAWNED.append(proc)
    return proc


def _reap() -> None:
    while _SPAWNED:
        proc = _SPAWNED.pop()
        kill_tree(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


atexit.register(_reap)  # a run stopped in the middle of a test (Ctrl-C) leaves nothing running either


@pytest.fixture(autouse=True)
def _reap_spawned():
    yield
    _reap()


# ---------------------------------------------------------------------------------------
# waiting, datasets, row ids
# ---------------------------------------------------------------------------------------

def wait_until(condition, timeout: float = 30.0, interval: float = 0.005, what: str = ""):
    """Poll ``condition()`` every ``interval`` seconds until it returns something true, and
    return that; fail after ``timeout`` seconds (a bound on a wait, never a measurement)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < end, f"timed out after {timeout} s{': ' + what if what else ''}"
        time.sleep(interval)


def run_with_timeout(fn, timeout: float = 20.0):
    """``fn()`` on a thread of its own; its result (its exception raised here). Fails the test if it
    has not returned after ``timeout`` seconds: a loader that hangs fails instead of hanging the run."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "timed out: the loader hangs"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def open_dataset(source, columns=None, cache=None, **kw):
    """The tests' one dataset factory: ``gpuload.ParquetDataset(source, columns, cache_dir=cache,
    **kw)`` with ``device="cpu"`` unless given (the device guard); ``cache=None`` is the test's
    own default cache folder (``$GPULOAD_CACHE_DIR``)."""
    import gpuload

    kw.setdefault("device", "cpu")
    return gpuload.ParquetDataset(source, columns, cache_dir=cache, **kw)


def dataset_factory(columns=None, **defaults):
    """A test module's opener, ``open(source, cache=None, columns=<these>, **kw)``: :func:`open_dataset`
    with ``defaults`` (``kw`` overrides them), e.g. ``_ds = dataset_factory(COLUMNS, batch_size=997)``."""
    default_columns = columns

    def open_(source, cache=None, columns=default_columns, **kw):
        return open_dataset(source, columns, cache, **{**defaults, **kw})

    return open_


@pytest.fixture(scope="module")
def click(tmp_path_factory):
    """The click log of tests/reference.py (its ``Data``), written once per test module."""
    from reference import click_data

    return click_data(tmp_path_factory)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    """One file of 6,000 rows beside 70 files of 20-60 rows each (``row_id``, ``x`` float64, ``tags``
    list<int64>), written once per test module: (folder, paths, rows). 71 files, 64 or more: the small
    ones are packed, several to a chunk (:func:`gpuload.packs.pack_small`)."""
    root = tmp_path_factory.mktemp("small_files")
    rng = np.random.default_rng(3)
    start, paths = 0, []
    for i, n in enumerate([6000] + [int(k) for k in rng.integers(20, 61, 70)]):
        ids = np.arange(start, start + n)
        tags = pa.array([[int(j)] * int(j % 4) for j in ids], pa.list_(pa.int64()))
        paths.append(write_parquet(root / f"part-{i:03}.parquet", {"row_id": ids, "x": rng.random(n), "tags": tags}))
        start += n
    return root, paths, start


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The mixed-type source of tests/reference.py (its ``Data``), written once per test module."""
    from reference import mixed_data

    return mixed_data(tmp_path_factory)


def row_ids(batches, key: str = "row_id") -> np.ndarray:
    """The ``key`` column of ``batches`` (batches, or a dataset: one epoch of it) as one array."""
    parts = [b[key] for b in batches]
    return (np.concatenate([t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in parts]) if parts
            else np.zeros(0, np.int64))


# ---------------------------------------------------------------------------------------
# where tests write: nothing outside pytest's temporary folders
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _scratch_outside_home(tmp_path_factory):
    """For the session (module-scoped fixtures and child processes included): the default cache
    folder, Dask's scratch space and temporary files (``tempfile``, ``$TMPDIR``: torchrun's
    ``torchelastic_*`` folders, torch's compile cache) are under pytest's temporary root, not
    ``~/.cache/gpuload``, ``/tmp/dask-scratch-space`` and ``/tmp``."""
    import tempfile

    base = tmp_path_factory.mktemp("scratch")
    (base / "tmp").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULOAD_CACHE_DIR", str(base / "default-cache"))
        mp.setenv("DASK_TEMPORARY_DIRECTORY", str(base / "dask"))
        mp.setenv("TMPDIR", str(base / "tmp"))
        mp.setattr(tempfile, "tempdir", str(base / "tmp"))
        if "dask.config" in sys.modules:  # imported already (a test module's import): read at import only
            import dask.config

            mp.setitem(dask.config.config, "temporary-directory", str(base / "dask"))
        yield


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """A test's default cache folder is its own: ``tmp_path / "default-cache"`` (made on first
    use by whatever opens it); ``tmp_cache`` below sets another."""
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(tmp_path / "default-cache"))


@pytest.fixture
def cli(capsys):
    """``run``, in this process: ``main(args)`` (argparse's own errors exit through SystemExit),
    its exit status and what it printed, as a CompletedProcess."""

    def call(*args):
        capsys.readouterr()
        try:
            from gpuload.tools.cli import main

            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["gpuload", *args], rc, out, err)

    return call


def _tmpfs(path: Path, **opts) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    o = ",".join(f"{k}={v}" for k, v in opts.items())
    return subprocess.run(["mount", "-t", "tmpfs", "-o", o, "tmpfs", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def tiny_fs(tmp_path):
    """``make(name, **tmpfs options)``: a small tmpfs mounted at ``tmp_path / name`` (a real
    filesystem that fills, or can be remounted read-only); skips where this process may not
    mount (root and mount rights); unmounted after the test."""
    mounted = []

    def make(name, **opts):
        p = tmp_path / name
        if os.geteuid() != 0 or not _tmpfs(p, **opts):
            pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
        mounted.append(p)
        return p

    yield make
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def pytest_collection_finish(session):
    """Everything imported and collected so far (torch, pyarrow, the test modules) moved out of the
    garbage collector's reach: each full collection (the leftover-threads check's, Python's own)
    then scans only what tests made since (0.2 s less a collection in a worker, a quarter of the
    quick tests' time)."""
    gc.collect()
    gc.freeze()
