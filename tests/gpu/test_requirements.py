"""What ``device="cuda"`` needs, KvikIO's mode, and RMM's set-up: checked on any machine.

The CUDA pieces are stand-ins here (a CuPy module that says a device is available, torch's
availability checks patched, KvikIO / pylibcudf / RMM hidden by ``sys.modules[name] = None``),
so what is tested is gpuload's logic: which pieces it asks for, in which order it calls
torch and RMM, what it sets. ``tests/gpu/test_runtime.py`` and ``test_streams.py`` run the real
thing on a GPU.
"""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

import gpuload
from gpuload.gpu import rmm_pool
from gpuload.gpu import runtime as gpu
from gpuload.device import resolve_device

from conftest import write_parquet

_RAPIDS = ("kvikio", "kvikio.defaults", "kvikio.cufile_driver", "pylibcudf", "rmm", "rmm.mr", "rmm.allocators",
           "rmm.allocators.torch", "rmm.allocators.cupy", "cudf")


def _fake_cupy(devices: list | None = None) -> types.ModuleType:
    """A ``cupy`` whose ``cuda.is_available()`` is True; ``cuda.Device(i)`` appends ``i`` to
    ``devices`` on entry and ``-i - 1`` on exit, ``cuda.runtime.setDevice(i)`` ("setDevice", i)."""
    cp = types.ModuleType("cupy")

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            if devices is not None:
                devices.append(self.index)
            return self

        def __exit__(self, *exc):
            if devices is not None:
                devices.append(-self.index - 1)

    def set_device(index):
        if devices is not None:
            devices.append(("setDevice", index))

    cp.cuda = types.SimpleNamespace(is_available=lambda: True, Device=Device,
                                    runtime=types.SimpleNamespace(setDevice=set_device),
                                    set_allocator=lambda fn: cp.__dict__.setdefault("allocators", []).append(fn))
    return cp


_REAL_CUDA = torch.cuda.is_available()  # asked before any test stands in a GPU node


@pytest.fixture
def torch_and_cupy_only(monkeypatch):
    """A node with a driver, a CUDA torch and CuPy, and none of KvikIO, pylibcudf, RMM, cuDF
    (this CPU torch answers the availability checks as a CUDA build would; its first real
    device call still fails)."""
    for name in _RAPIDS:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("KVIKIO_COMPAT_MODE", raising=False)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)


# -- item 1: device="cuda" needs only torch and CuPy -----------------------------------------
@pytest.mark.fake_gpu
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_cuda_without_kvikio_or_cudf_reaches_its_first_device_call(tmp_path, torch_and_cupy_only, decode):
    """Every import and availability check passes; what fails is torch's first CUDA call (this
    torch has no CUDA), the loader's first stream: no ImportError, no GpuloadError naming
    KvikIO, pylibcudf or RMM."""
    if _REAL_CUDA:
        pytest.skip("this torch has CUDA: the first device call would not fail (the gpu tests run it for real)")
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(100, dtype=np.int64)})
    with pytest.raises(Exception) as got:
        gpuload.ParquetDataset(path, device="cuda", decode=decode, cache_dir=tmp_path / "c")
    assert not isinstance(got.value, (ImportError, gpuload.GpuloadError)), got.value
    assert "torch.cuda.Stream requires CUDA support" in str(got.value)
    last = got.traceback.cut(path=os.path.join("gpuload", "gpu", "streams.py"))  # gpuload's frames in streams.py
    assert any("self.read_stream = torch.cuda.Stream(self.index)" in str(entry.statement) for entry in last)
    assert os.environ["KVIKIO_COMPAT_MODE"] == "ON"  # for a libcudf read later: POSIX, no cuFile
    assert os.environ["KVIKIO_NTHREADS"] == "4"


@pytest.mark.fake_gpu
def test_gpu_decode_without_pylibcudf_names_what_it_needs(tmp_path, torch_and_cupy_only):
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(100, dtype=np.int64)})
    with pytest.raises(gpuload.GpuloadError, match=r"decode='gpu' needs pylibcudf \(and, through it, RMM and KvikIO\)"):
        gpuload.ParquetDataset(path, device="cuda", decode="gpu", cache_dir=tmp_path / "c")


@pytest.mark.fake_gpu
def test_status_calls_kvikio_optional_and_nothing_requires_it(torch_and_cupy_only, caplog):
    status = gpu.gpu_status()
    assert status["driver"] is None and status["cupy"] is None
    assert status["kvikio"].startswith("optional, only for GPUDirect Storage")
    assert status["cudf"] is not None
    assert gpu.missing_pieces(status) == {}
    assert gpu.gpu_usable()
    assert gpu.require_gpu("cuda", "cpu") is False
    with caplog.at_level(logging.INFO, logger="gpuload"):
        assert gpu.require_gpu("cuda", "auto") is False  # decodes on the CPU, says so
    assert any("pylibcudf is not importable" in r.getMessage() for r in caplog.records)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_missing_pieces_are_the_driver_and_cupy_only():
    s = {"driver": None, "cupy": "no cupy", "kvikio": "optional, ...", "cudf": "no"}
    assert gpu.missing_pieces(s) == {"cupy": "no cupy"}
    assert gpu.REQUIRED == ("driver", "cupy")


# -- item 2: libcudf gets compat mode unless GDS really works ---------------------------------
@pytest.mark.parametrize("compat, gds, mode", [("auto", False, "ON"), ("auto", True, "AUTO"), ("on", True, "ON"),
                                               ("on", False, "ON"), ("off", False, "OFF"), ("off", True, "OFF")])
def test_kvikio_mode(compat, gds, mode):
    assert gpu.kvikio_mode(compat, gds) == mode


def test_kvikio_mode_refuses_other_values():
    with pytest.raises(gpuload.ConfigError, match="kvikio_compat"):
        gpu.kvikio_mode("maybe", False)


def _fake_kvikio(monkeypatch, gds):
    calls = {"set": [], "driver": 0}
    kvikio = types.ModuleType("kvikio")
    kvikio.CompatMode = enum.Enum("CompatMode", "ON OFF AUTO")

    def driver_get(name):
        calls["driver"] += 1
        if gds is None:
            raise RuntimeError("cuFile driver not loaded")
        return gds

    kvikio.defaults = types.SimpleNamespace(set=lambda cfg: calls["set"].append(cfg))
    kvikio.cufile_driver = types.SimpleNamespace(get=driver_get)
    for name, mod in (("kvikio", kvikio), ("kvikio.defaults", kvikio.defaults),
                      ("kvikio.cufile_driver", kvikio.cufile_driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    return kvikio, calls


@pytest.mark.parametrize("gds, config, mode", [(True, True, "AUTO"), (False, True, "ON"), (None, True, "ON"),
                                               (True, False, "ON")])
def test_auto_is_compat_unless_gds_really_works(monkeypatch, tmp_path, gds, config, mode):
    """The cuFile driver must say GDS is available and cuFile's configuration file must exist;
    otherwise libcudf and KvikIO get compat mode ON (POSIX reads), in the environment (read
    at libcudf's first read) and in KvikIO's defaults (after it)."""
    kvikio, calls = _fake_kvikio(monkeypatch, gds)
    monkeypatch.delenv("KVIKIO_COMPAT_MODE", raising=False)
    if config:
        (tmp_path / "cufile.json").write_text("{}")
        monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "cufile.json"))
    else:
        monkeypatch.delenv("CUFILE_ENV_PATH_JSON", raising=False)
        monkeypatch.setattr(gpu.os.path, "exists", lambda p: False if p == "/etc/cufile.json" else os.path.exists(p))
    assert gpu.configure_kvikio(3, "auto") is (mode == "AUTO")
    assert os.environ["KVIKIO_COMPAT_MODE"] == mode and os.environ["KVIKIO_NTHREADS"] == "3"
    assert calls["set"] == [{"compat_mode": getattr(kvikio.CompatMode, mode), "num_threads": 3}]


def test_compat_on_does_not_ask_the_cufile_driver(monkeypatch):
    kvikio, calls = _fake_kvikio(monkeypatch, True)
    assert gpu.configure_kvikio(2, "on") is False
    assert calls["driver"] == 0 and os.environ["KVIKIO_COMPAT_MODE"] == "ON"


def test_configure_without_kvikio_sets_the_environment_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "AUTO")
    assert gpu.configure_kvikio(5, "auto") is False
    assert os.environ["KVIKIO_COMPAT_MODE"] == "ON" and os.environ["KVIKIO_NTHREADS"] == "5"


# -- item 2: share_rmm_pool before torch's CUDA state, on the device given ------------------
class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


class _MR:
    """Stand-ins for rmm.mr's resource types."""

    class CudaMemoryResource:
        pass

    class CudaAsyncMemoryResource:
        pass

    class PoolMemoryResource:
        def __init__(self, upstream, initial_pool_size=None):
            self.upstream, self.initial = upstream, initial_pool_size


@pytest.fixture
def fake_rmm(monkeypatch):
    """rmm, its allocators and rmm.mr (per-device resources: plain CudaMemoryResource), and a
    CuPy; ``rec.calls`` records (name, args, kwargs) in order. torch.cuda.set_device and
    current_device fail the test: share_rmm_pool must not touch torch's CUDA state."""
    rec = _Recorder()
    devices: list = []
    resources: dict = {}
    rmm = types.ModuleType("rmm")
    rmm.reinitialize = rec("rmm.reinitialize")  # would go back to device 0 afterwards: must not be used
    mr = types.ModuleType("rmm.mr")
    mr.CudaMemoryResource, mr.CudaAsyncMemoryResource = _MR.CudaMemoryResource, _MR.CudaAsyncMemoryResource
    mr.PoolMemoryResource = _MR.PoolMemoryResource
    mr.get_per_device_resource = lambda i: resources.setdefault(i, _MR.CudaMemoryResource())

    def set_per_device_resource(i, r):
        rec.calls.append(("set_per_device_resource", (i, type(r).__name__, list(devices)), {}))
        resources[i] = r

    mr.set_per_device_resource = set_per_device_resource
    rmm.mr = mr
    alloc_torch = types.SimpleNamespace(rmm_torch_allocator=object())
    alloc_cupy = types.SimpleNamespace(rmm_cupy_allocator=object())
    rmm.allocators = types.SimpleNamespace(torch=alloc_torch, cupy=alloc_cupy)
    for name, mod in (("rmm", rmm), ("rmm.mr", mr), ("rmm.allocators", rmm.allocators),
                      ("rmm.allocators.torch", alloc_torch), ("rmm.allocators.cupy", alloc_cupy)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(devices))
    monkeypatch.setattr(rmm_pool, "_state", {"device": None, "initial": None})
    monkeypatch.setattr(rmm_pool, "_ORDERED", set())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", rec("change_current_allocator"))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    for name in ("set_device", "current_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail("share_rmm_pool touched torch's CUDA state"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    rec.resources, rec.alloc = resources, alloc_torch
    return rec


def test_share_rmm_pool_swaps_torch_first_then_makes_the_pool_on_the_given_device(fake_rmm):
    gpuload.share_rmm_pool(1 << 30, device="cuda:1")
    names = [c[0] for c in fake_rmm.calls]
    assert names == ["change_current_allocator", "set_per_device_resource"]
    assert fake_rmm.calls[0][1] == (fake_rmm.alloc.rmm_torch_allocator,)
    # made with cuda:1 current (selected by the CUDA runtime, not torch), which stays current
    assert fake_rmm.calls[1][1] == (1, "PoolMemoryResource", [("setDevice", 1)])
    assert fake_rmm.resources[1].initial == 1 << 30
    assert rmm_pool.shared_device() == 1 and rmm_pool.torch_uses_rmm()
    assert sys.modules["cupy"].allocators == [sys.modules["rmm.allocators.cupy"].rmm_cupy_allocator]
    gpuload.share_rmm_pool(device=1)  # again on the same device: nothing more
    assert len(fake_rmm.calls) == 2
    with pytest.raises(gpuload.GpuloadError, match="already on cuda:1"):
        gpuload.share_rmm_pool(device=0)


def test_share_rmm_pool_after_torch_initialised_cuda_is_refused_and_changes_nothing(fake_rmm, monkeypatch):
    """torch.cuda.set_device() alone initialises torch's caching allocator (nothing allocated
    yet), after which torch refuses any other allocator: refused whenever torch is initialised."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(gpuload.GpuloadError, match=r"before torch.cuda.set_device\(local_rank\)"):
        gpuload.share_rmm_pool(device=0)
    assert fake_rmm.calls == [] and rmm_pool.shared_device() is None


def test_share_rmm_pool_when_torch_refuses_changes_nothing(fake_rmm, monkeypatch):
    def refuse(allocator):
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", refuse)
    with pytest.raises(gpuload.GpuloadError, match="torch refused the RMM allocator"):
        gpuload.share_rmm_pool(device=0)
    assert fake_rmm.calls == [] and rmm_pool.shared_device() is None


def test_share_rmm_pool_takes_local_rank_by_default(fake_rmm, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    gpuload.share_rmm_pool()
    assert fake_rmm.calls[1][1][0] == 1


@pytest.mark.parametrize("count, local_rank, want", [(2, None, 0), (4, "3", 3), (1, "3", 0), (8, "0", 0)])
def test_default_device(count, local_rank, want):
    assert rmm_pool.default_device(count, local_rank) == want


@pytest.mark.parametrize("count, local_rank", [(2, "3"), (2, "x")])
def test_default_device_refuses_what_it_cannot_tell(count, local_rank):
    with pytest.raises(gpuload.GpuloadError, match="pass device="):
        rmm_pool.default_device(count, local_rank)


def test_share_rmm_pool_names_a_bad_device(fake_rmm):
    with pytest.raises(gpuload.GpuloadError, match="not a CUDA device"):
        gpuload.share_rmm_pool(device="cpu")


# -- item 2: RMM per dataset device -------------------------------------------------------------
def test_a_dataset_on_another_device_gets_a_pool_there_while_nothing_ran_on_it(fake_rmm, monkeypatch):
    gpuload.share_rmm_pool(123, device=0)
    monkeypatch.setattr(rmm_pool, "_has_context", lambda i: False)
    rmm_pool.prepare_device(0)  # the shared pool's device: nothing to do
    rmm_pool.prepare_device(1)
    made = [c for c in fake_rmm.calls if c[0] == "set_per_device_resource"][1:]  # after share_rmm_pool's
    assert made == [("set_per_device_resource", (1, "PoolMemoryResource", [("setDevice", 0), 1]), {})]  # cuda:1 current
    assert fake_rmm.resources[1].initial == 123
    rmm_pool.prepare_device(1)
    assert len([c for c in fake_rmm.calls if c[0] == "set_per_device_resource"]) == 2


def test_a_dataset_on_another_device_where_cuda_ran_is_refused(fake_rmm, monkeypatch):
    gpuload.share_rmm_pool(device=0)
    monkeypatch.setattr(rmm_pool, "_has_context", lambda i: True)
    with pytest.raises(gpuload.GpuloadError, match=r"share_rmm_pool\(device=1\)"):
        rmm_pool.prepare_device(1)
    assert [c[1][0] for c in fake_rmm.calls if c[0] == "set_per_device_resource"] == [0]  # share_rmm_pool's only


def test_without_a_shared_pool_opening_a_device_needs_no_rmm(monkeypatch):
    monkeypatch.setattr(rmm_pool, "_state", {"device": None, "initial": None})
    monkeypatch.setitem(sys.modules, "rmm", None)
    rmm_pool.prepare_device(3)  # imports nothing


def test_decode_makes_each_devices_resource_stream_ordered(fake_rmm):
    fake_rmm.resources[1] = _MR.PoolMemoryResource(None)  # chosen by the process: kept
    rmm_pool.stream_ordered(0)
    rmm_pool.stream_ordered(1)
    rmm_pool.stream_ordered(0)
    made = [c for c in fake_rmm.calls if c[0] == "set_per_device_resource"]
    assert made == [("set_per_device_resource", (0, "CudaAsyncMemoryResource", [0]), {})]


def test_decode_never_replaces_the_resource_torch_allocates_from(fake_rmm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "pluggable")  # the user's own RMM allocator
    rmm_pool.stream_ordered(0)
    assert not [c for c in fake_rmm.calls if c[0] == "set_per_device_resource"]


_TORCH_AND_CUPY_ONLY = """
import sys
for name in ("kvikio", "pylibcudf", "rmm", "cudf"):
    sys.modules[name] = None  # as on a node that has none of them
import numpy as np, torch, gpuload
data, cache = sys.argv[1:3]
assert gpuload.gpu_status()["kvikio"].startswith("optional")
for decode in ("cpu", "auto"):
    kw = dict(batch_size=1000, chunk_bytes=1 << 16, seed=1, shuffle=True)
    want = [b["x"].numpy() for b in gpuload.ParquetDataset(data, device="cpu", cache_dir=cache + "-cpu", **kw)]
    for epoch in (0, 1):  # decoded with pyarrow and uploaded, then read from the cache into device memory
        ds = gpuload.ParquetDataset(data, device="cuda", decode=decode, cache_dir=cache + decode, **kw)
        got = [b["x"] for b in ds]
        assert got[0].device.type == "cuda"
        assert all(np.array_equal(g.cpu().numpy(), w) for g, w in zip(got, want)) and len(got) == len(want)
print("ok")
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.gpu
def test_a_gpu_node_with_only_torch_and_cupy_runs_the_gpu_path(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(50_000, dtype=np.int64)}, row_group_size=5_000)
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _TORCH_AND_CUPY_ONLY, str(path), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": pythonpath})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]


_RMM_ORDER = textwrap.dedent("""
    import sys, torch, gpuload
    index, order = int(sys.argv[1]), sys.argv[2]
    if order == "set_device first":  # what the README used to advise: torch's allocator is initialised
        torch.cuda.set_device(index)
        try:
            gpuload.share_rmm_pool(device=index)
        except gpuload.GpuloadError as e:
            assert "before torch.cuda.set_device" in str(e), e
            assert torch.cuda.get_allocator_backend() == "native"
            print("ok")
        sys.exit(0)
    gpuload.share_rmm_pool(device=index)
    assert not torch.cuda.is_initialized()
    if index:  # the pool was made on its device without a CUDA context on device 0
        assert not torch._C._cuda_hasPrimaryContext(0)
    torch.cuda.set_device(index)
    x = torch.ones(1 << 20, device="cuda") * 2
    assert torch.cuda.get_allocator_backend() == "pluggable" and float(x.sum()) == 2 << 20
    import rmm.mr
    assert type(rmm.mr.get_per_device_resource(index)).__name__ == "PoolMemoryResource"
    print("ok")
""")


@pytest.mark.slow  # a process of its own
@pytest.mark.gpu
@pytest.mark.cudf  # RMM
@pytest.mark.parametrize("order", ["share first", "set_device first"])
@pytest.mark.parametrize("index", [0, 1])
def test_share_rmm_pool_goes_before_set_device(tmp_path, order, index):
    """The README's DDP order: share_rmm_pool(device=local_rank), then torch.cuda.set_device. The
    other order is refused with that advice (torch cannot swap an initialised allocator)."""
    pytest.importorskip("rmm")
    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} GPUs")
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _RMM_ORDER, str(index), order], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": pythonpath})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]
