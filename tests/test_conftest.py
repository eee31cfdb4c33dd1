"""The shared test set-up itself: which GPU tests skip or fail the session, the device guard, the
process guard and the processes tests start (``spawn``, ``spawn_warm``).

Both are inert on a machine without a GPU (the GPU tests skip, ``"auto"`` resolves to the
CPU), so a GPU node is simulated here: a status that reports every piece usable, and a
``resolve_device`` that gives CUDA for ``"auto"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import gpuload
from gpuload.gpu import runtime

from conftest import (GUARD, PROCESSES, RAPIDS, DeviceGuard, ProcessGuard, _reap, open_dataset, python, stand_in,
                      required_pieces, row_ids, skip_reasons, spawn, spawn_warm, wait_until, write_parquet)

OK = {"driver": None, "cupy": None, "kvikio": None, "cudf": None, "rmm": None}


def _item(*markers, nodeid="tests/test_x.py::test_x"):
    return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if name in markers else None)


@pytest.mark.parametrize("environ, pieces", [
    ({}, ()), ({"GPULOAD_REQUIRE_GPU": "0"}, ()), ({"GPULOAD_REQUIRE_GPU": "1"}, ("driver", "cupy")),
    ({"GPULOAD_REQUIRE_GPU": "cudf"}, ("driver", "cupy") + RAPIDS),
    ({"GPULOAD_REQUIRE_GPU": "1", "GPULOAD_REQUIRE_CUDF": "1"}, ("driver", "cupy") + RAPIDS),
    ({"GPULOAD_REQUIRE_CUDF": "1"}, ("driver", "cupy") + RAPIDS),
])
def test_required_pieces_follow_the_environment(environ, pieces):
    assert required_pieces(environ) == pieces


@pytest.mark.parametrize("environ", [{"GPULOAD_REQUIRE_GPU": "yes"}, {"GPULOAD_REQUIRE_CUDF": "cudf"}])
def test_a_misspelt_requirement_stops_the_session(environ):
    with pytest.raises(pytest.UsageError, match="GPULOAD_REQUIRE_GPU=1 .*=cudf"):
        required_pieces(environ)


def test_a_full_gpu_node_skips_nothing():
    for required in ((), ("driver", "cupy"), ("driver", "cupy") + RAPIDS):
        assert skip_reasons(OK, True, required) == (None, None)


def test_without_a_gpu_both_kinds_skip_with_the_reason():
    status = {**OK, "driver": "no NVIDIA driver", "cudf": "ImportError: pylibcudf"}
    gpu, cudf = skip_reasons(status, False, ())
    assert gpu == "driver: no NVIDIA driver" and cudf == gpu


def test_torch_and_cupy_alone_run_the_gpu_tests_and_skip_the_cudf_ones():
    """The first step on the lent node: no pylibcudf, RMM or KvikIO. GPULOAD_REQUIRE_GPU=1 must not
    demand them (nor KvikIO, whatever gpu_status says of it): the cudf tests skip, the others run."""
    status = {**OK, "kvikio": "ModuleNotFoundError: kvikio", "cudf": "ModuleNotFoundError: pylibcudf",
              "rmm": "rmm is not installed"}
    for usable in (True, False):  # False: a gpuload that still wants KvikIO: its tests then fail, not skip
        gpu, cudf = skip_reasons(status, usable, required_pieces({"GPULOAD_REQUIRE_GPU": "1"}))
        assert gpu is None and "pylibcudf" in cudf and "kvikio" in cudf and "rmm" in cudf
    gpu, cudf = skip_reasons(status, True, ())
    assert gpu is None and cudf is not None
    gpu, _ = skip_reasons({**status, "cupy": "ModuleNotFoundError: cupy"}, False, ())
    assert "cupy" in gpu and "kvikio" not in gpu  # a machine without CuPy: skipped, saying why (KvikIO is optional)


@pytest.mark.parametrize("missing, flag", [("driver", "GPULOAD_REQUIRE_GPU=1"), ("cupy", "GPULOAD_REQUIRE_GPU=1")])
def test_a_required_gpu_piece_that_is_missing_stops_the_session(missing, flag):
    status = {**OK, missing: "not here"}
    with pytest.raises(pytest.UsageError, match=f"{flag}, but the GPU path cannot run here: {missing}: not here"):
        skip_reasons(status, False, required_pieces({"GPULOAD_REQUIRE_GPU": "1"}))


@pytest.mark.parametrize("missing", RAPIDS)
def test_a_required_rapids_piece_that_is_missing_stops_the_session(missing):
    status = {**OK, missing: "not here"}
    assert skip_reasons(status, True, required_pieces({"GPULOAD_REQUIRE_GPU": "1"}))[0] is None
    with pytest.raises(pytest.UsageError, match=f"GPULOAD_REQUIRE_GPU=cudf, but .*{missing}: not here"):
        skip_reasons(status, True, required_pieces({"GPULOAD_REQUIRE_GPU": "cudf"}))


# -- the device guard --------------------------------------------------------------------------
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_guard_rules():
    plain, gpu, auto = _item(), _item("gpu"), _item("auto_device")
    assert "resolves device='auto' (the default)" in DeviceGuard.problem(plain, "auto", CPU)
    assert "not marked gpu, but device='auto' gave cuda:0" in DeviceGuard.problem(plain, "auto", CUDA)
    assert "not marked gpu, but device='cuda' gave cuda:0" in DeviceGuard.problem(plain, "cuda", CUDA)
    assert DeviceGuard.problem(plain, "cpu", CPU) is None
    assert DeviceGuard.problem(plain, torch.device("cpu"), CPU) is None
    for requested, resolved in (("auto", CPU), ("auto", CUDA), ("cuda", CUDA)):
        assert DeviceGuard.problem(gpu, requested, resolved) is None
    assert DeviceGuard.problem(auto, "auto", CPU) is None and DeviceGuard.problem(auto, "auto", CUDA) is None
    assert DeviceGuard.problem(auto, "cuda", CUDA) is not None  # auto_device allows "auto", not an explicit CUDA
    assert DeviceGuard.problem(None, "auto", CUDA) is None  # between tests (collection): nobody to blame


@pytest.fixture
def as_item(request):
    """Run part of a test as if it were another item, for the device guard."""
    yield from stand_in(GUARD, request)


@pytest.fixture
def cuda_node(monkeypatch):
    """``device="auto"`` resolves to cuda:0, as on a GPU node (nothing else of CUDA is faked)."""
    monkeypatch.setattr(runtime, "gpu_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_guard_fails_a_dataset_that_would_get_cuda_on_a_gpu_node(tmp_path, as_item, cuda_node):
    path = write_parquet(tmp_path / "a.parquet", {"x": np.arange(10)})
    as_item(_item())
    with pytest.raises(pytest.fail.Exception, match="not marked gpu, but device='auto' gave cuda:0"):
        gpuload.ParquetDataset(path, cache_dir=tmp_path / "c")  # the default device
    with pytest.raises(pytest.fail.Exception, match="device='auto' gave cuda:0"):
        gpuload.build_cache(path, tmp_path / "c", device="auto")
    assert len(GUARD.violations) == 2
    as_item(_item("gpu"))  # a gpu test may: without a GPU it fails later (at the first device call), not here
    if torch.cuda.is_available():  # on a GPU node the dataset opens on the real device
        assert gpuload.ParquetDataset(path, cache_dir=tmp_path / "c").device.type == "cuda"
    else:
        with pytest.raises(Exception) as e:
            gpuload.ParquetDataset(path, cache_dir=tmp_path / "c")
        assert not isinstance(e.value, pytest.fail.Exception)
    assert GUARD.violations == []


def test_guard_records_what_another_thread_resolved(tmp_path, as_item, cuda_node):
    """A loader or builder thread cannot fail the test itself: the violation waits for teardown."""
    path = write_parquet(tmp_path / "a.parquet", {"x": np.arange(10)})
    as_item(_item())
    errors = []

    def open_there():
        try:
            gpuload.ParquetDataset(path, cache_dir=tmp_path / "c")
        except BaseException as e:  # noqa: BLE001 - whatever it is, it is not the guard's
            errors.append(e)

    t = threading.Thread(target=open_there)
    t.start()
    t.join()
    assert not any(isinstance(e, pytest.fail.Exception) for e in errors)
    assert len(GUARD.violations) == 1 and "device='auto' gave cuda:0" in GUARD.violations[0]


def test_guard_is_installed_where_gpuload_resolves_devices():
    import gpuload.device

    for module in (gpuload.device,):
        assert getattr(module.resolve_device, "__wrapped__", None) is GUARD.original, module.__name__


GUARDED = """
import threading
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, pytest
import gpuload


def _data(tmp_path):
    pq.write_table(pa.table({"x": np.arange(10)}), tmp_path / "a.parquet")
    return tmp_path / "a.parquet"


def test_default_device(tmp_path):
    list(gpuload.ParquetDataset(_data(tmp_path), cache_dir=tmp_path / "c"))


def test_default_device_on_a_thread(tmp_path):
    t = threading.Thread(target=lambda: gpuload.ParquetDataset(_data(tmp_path), cache_dir=tmp_path / "c"))
    t.start()
    t.join()


def test_explicit_cpu(tmp_path):
    list(gpuload.ParquetDataset(_data(tmp_path), cache_dir=tmp_path / "c", device="cpu"))


@pytest.mark.auto_device
def test_auto_on_purpose(tmp_path):
    list(gpuload.ParquetDataset(_data(tmp_path), cache_dir=tmp_path / "c"))
"""


def _session(pytester, **files):
    """A pytest session of its own with this conftest and ``files`` (name -> source): its result."""
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(**files)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: x\n    cudf: x\n    auto_device: x\n    slow: x\n")
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")


@pytest.mark.slow  # a pytest session of its own
def test_guard_in_a_real_session(pytester):
    """The hooks and the teardown check, in a pytest session of their own with this conftest."""
    r = _session(pytester, test_guarded=GUARDED)
    r.assert_outcomes(passed=3, failed=1, errors=1)
    out = r.stdout.str()
    # on a machine without a GPU, what would happen on one; on a GPU node, what did
    said = "not marked gpu, but device='auto' gave cuda:0" if torch.cuda.is_available() else "resolves device='auto'"
    assert f"test_guarded.py::test_default_device: {said}" in out
    assert "ERROR at teardown of test_default_device_on_a_thread" in out  # a thread's resolution, found at teardown
    assert f"test_guarded.py::test_default_device_on_a_thread: {said}" in out


# -- the process guard, spawn(), the helpers ---------------------------------------------------
def test_process_guard_rules():
    plain, slow, gpu = _item(), _item("slow"), _item("gpu")
    guard = ProcessGuard()
    guard.item = plain
    assert "tests/test_x.py::test_x: starts a process (subprocess: ['x']) but is not marked slow" in guard.problem(
        "subprocess: ['x']")
    for item in (slow, gpu, None):  # a slow test may; a gpu test is checked by hand; between tests, nobody to blame
        guard.item = item
        assert guard.problem("subprocess: ['x']") is None


@pytest.fixture
def as_process_item(request):
    """Run part of a test as if it were another item, for the process guard."""
    yield from stand_in(PROCESSES, request)


def test_process_guard_sees_every_way_to_start_one(as_process_item, monkeypatch):
    """subprocess, multiprocessing, os.fork, posix_spawn and system each reach the guard before they
    start anything (here: a guard that raises, so that nothing starts)."""
    import multiprocessing
    import os
    import subprocess

    class Started(Exception):
        pass

    def refuse(what):
        PROCESSES.violations.append(what)
        raise Started(what)

    monkeypatch.setattr(PROCESSES, "check", refuse)
    as_process_item(_item())
    for start in (lambda: subprocess.run(["true"]), lambda: multiprocessing.Process(target=print).start(),
                  os.fork, lambda: os.posix_spawn("/bin/true", ["true"], {}), lambda: os.system("true")):
        with pytest.raises(Started):
            start()
    assert [w.split(":")[0].split("(")[0] for w in PROCESSES.violations] == [
        "subprocess", "multiprocessing", "os.fork", "os.posix_spawn", "os.system"]


@pytest.mark.slow  # spawn() starts one
def test_spawn_kills_what_it_started_and_its_children():
    import psutil

    proc = spawn(python("import subprocess, sys, time, sitecustomize\n"
                        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                        "print(child.pid, sitecustomize.__file__, flush=True)\ntime.sleep(600)"))
    pid, site = proc.stdout.readline().split()
    assert Path(site).parent == Path(__file__).parent / "site"  # a process the tests start skips the exit's GC
    child = psutil.Process(int(pid))
    assert proc.poll() is None and child.is_running()
    _reap()  # what the fixture does when the test ends
    assert proc.returncode is not None and proc.stdout.closed
    child.wait(timeout=30)  # gone (it was a grandchild: reaped by init)


@pytest.mark.slow  # starts a process
def test_the_tests_sitecustomize_twice_on_the_path_runs_once(tmp_path):
    site = Path(__file__).parent / "site"
    (tmp_path / "twin").symlink_to(site)
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "sitecustomize.py").write_text((site / "sitecustomize.py").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(tmp_path / "twin"), str(tmp_path / "copy")])}
    r = subprocess.run([sys.executable, "-c", "import atexit, sys; print(sys._gpuload_tests_site, atexit._ncallbacks())"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "True 1\n", "")


@pytest.mark.slow  # spawn_warm() starts processes (and, once per worker, the fork server)
def test_a_warm_process_runs_its_code_as_python_c_would(tmp_path, monkeypatch):
    import signal

    monkeypatch.setenv("WARM_TEST", "from the test")
    monkeypatch.chdir(tmp_path)
    code = ("import atexit, os, sys\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "print(sys.argv[1:], os.environ['WARM_TEST'], os.getcwd(), os.getpgid(0) == os.getpid(), flush=True)\n"
            "print('to stderr', file=sys.stderr)\n"
            "sys.exit(int(sys.argv[2]))")
    proc = spawn_warm(code, "one", 3)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and err == "to stderr\n"
    assert out == f"['one', '3'] from the test {tmp_path} True\natexit ran\n"
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__file__, sys.argv, sys.path[0], __name__, sep='|')")
    out, _ = spawn_warm(script, "x").communicate(timeout=60)
    assert out.split("|") == [str(script), str([str(script), "x"]), str(tmp_path), "__main__\n"]
    code = ("import pickle, sys, tempfile\n"
            "class Kept: pass\n"
            "sys.kept = tempfile.TemporaryDirectory(dir=sys.argv[1])  # removed at exit by weakref.finalize\n"
            "print(type(pickle.loads(pickle.dumps(Kept()))).__module__, flush=True)")
    (tmp_path / "kept").mkdir()
    out, err = spawn_warm(code, tmp_path / "kept").communicate(timeout=60)
    assert out == "__main__\n" and not err and not list((tmp_path / "kept").iterdir())
    failing = spawn_warm("raise ValueError('bad input')", env={"PATH": os.environ["PATH"]})
    out, err = failing.communicate(timeout=60)
    assert failing.returncode == 1 and "Traceback" in err and "ValueError: bad input" in err
    sleeper = spawn_warm("import time; time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.1)
    assert sleeper.poll() is None
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    left = spawn_warm("import time; time.sleep(600)")
    _reap()  # what the fixture does when the test ends
    assert left.returncode == -signal.SIGKILL


def test_row_ids_of_batches_and_of_nothing():
    batches = [{"row_id": torch.tensor([3, 1])}, {"row_id": np.array([2])}, {"row_id": [7]}]
    assert row_ids(batches).tolist() == [3, 1, 2, 7]
    assert row_ids([]).dtype == np.int64 and len(row_ids([])) == 0
    assert row_ids([{"id": torch.arange(2)}], "id").tolist() == [0, 1]


def test_wait_until_returns_what_held_or_fails():
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3 and "ok", timeout=5, interval=0) == "ok"
    with pytest.raises(AssertionError, match="timed out after 0.01 s: nothing"):
        wait_until(lambda: False, timeout=0.01, what="nothing")


def test_each_test_has_its_own_default_cache(tmp_path):
    import os

    from gpuload.cache.store import default_cache_dir

    assert default_cache_dir() == tmp_path / "default-cache" == Path(os.environ["GPULOAD_CACHE_DIR"])
    path = write_parquet(tmp_path / "a.parquet", {"x": np.arange(10)})
    ds = open_dataset(path)  # no cache_dir=: the test's own
    list(ds)
    ds.reader.cache.flush()
    assert list((tmp_path / "default-cache").rglob("*.glc"))


PROCESS_GUARDED = """
import subprocess, sys
import pytest


def test_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_none():
    pass
"""


@pytest.mark.slow  # a pytest session of its own
def test_process_guard_in_a_real_session(pytester):
    r = _session(pytester, test_processes=PROCESS_GUARDED)
    r.assert_outcomes(passed=3, errors=1)  # test_unmarked passed, then failed at teardown
    out = r.stdout.str()
    assert "ERROR at teardown of test_unmarked" in out
    assert "test_processes.py::test_unmarked: starts a process (subprocess: [" in out and "not marked slow" in out
