"""The shared test set-up itself: which GPU tests skip or fail the session, and the device guard.

Both are inert on a machine without a GPU (the GPU tests skip, ``"auto"`` resolves to the
CPU), so a GPU node is simulated here: a status that reports every piece usable, and a
``resolve_device`` that gives CUDA for ``"auto"``.
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

import gpuload
from gpuload.gpu import runtime

from conftest import GUARD, RAPIDS, DeviceGuard, required_pieces, skip_reasons, write_parquet

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
    """Run part of a test as if it were another item (restored, with no violation left, after)."""

    def set_item(item):
        GUARD.item, GUARD.violations = item, []

    yield set_item
    GUARD.item, GUARD.violations = request.node, []


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
    as_item(_item("gpu"))  # a gpu test may: here the device is fake, so it fails later, not in the guard
    with pytest.raises(Exception) as e:
        gpuload.ParquetDataset(path, cache_dir=tmp_path / "c")
    assert not isinstance(e.value, pytest.fail.Exception) and GUARD.violations == []


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
    import gpuload.build
    import gpuload.dataset
    import gpuload.handoff

    for module in (gpuload.handoff, gpuload.dataset, gpuload.build):
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


@pytest.mark.slow  # a pytest session of its own
def test_guard_in_a_real_session(pytester):
    """The hooks and the teardown check, in a pytest session of their own with this conftest."""
    from pathlib import Path

    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_guarded=GUARDED)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: x\n    cudf: x\n    auto_device: x\n")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    r.assert_outcomes(passed=3, failed=1, errors=1)
    out = r.stdout.str()
    assert "test_guarded.py::test_default_device: resolves device='auto' (the default)" in out
    assert "ERROR at teardown of test_default_device_on_a_thread" in out  # a thread's resolution, found at teardown
    assert "test_guarded.py::test_default_device_on_a_thread: resolves device='auto'" in out
