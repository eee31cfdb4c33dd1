"""The GPU path: device selection everywhere; decode, cache reads, batching and hand-off on a GPU.

Tests marked ``gpu`` run where the GPU path can run (a driver and CuPy) and skip cleanly
elsewhere; those also marked ``cudf`` need the RAPIDS stack (pylibcudf, RMM, KvikIO). The
others check, on any machine, what a
user without a GPU meets: the error that names the missing piece, the CPU fallback,
and the shared pieces the GPU path is built from.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.cache.chunkfile import columns_from_buffer, read_chunk, read_regions, write_chunk
from gpuload.cache.paths import ChunkKey
from gpuload.cache.store import ChunkCache
from gpuload.gpu import runtime as gpu
from gpuload.device import resolve_device

from conftest import open_dataset, write_parquet
from typecases import RICH_COLUMNS, RICH_FILL, rich_table


# -- any machine -------------------------------------------------------------------------
def _status(**missing):
    base = {"driver": None, "cupy": None, "kvikio": None, "cudf": None}
    base.update(missing)
    return lambda: base


@pytest.mark.parametrize("piece,named", [("driver", "a CUDA GPU that torch can use"), ("cupy", "CuPy")])
def test_cuda_without_a_piece_names_it(monkeypatch, piece, named):
    monkeypatch.setattr(gpu, "gpu_status", _status(**{piece: "not here"}))
    with pytest.raises(gpuload.GpuloadError, match=f"device='cuda' needs {named}: not here"):
        gpu.require_gpu("cuda", "auto")


def test_cuda_without_kvikio_runs(monkeypatch):
    """KvikIO only serves GPUDirect Storage: without it every cache read goes through pinned memory."""
    monkeypatch.setattr(gpu, "gpu_status", _status(kvikio="optional, only for GPUDirect Storage reads"))
    assert gpu.require_gpu("cuda", "auto") is True
    assert gpu.require_gpu("cuda", "cpu") is False


def test_missing_cudf_decodes_on_the_cpu_unless_gpu_decode_is_asked(monkeypatch, caplog):
    monkeypatch.setattr(gpu, "gpu_status", _status(cudf="ImportError: no cudf"))
    with caplog.at_level(logging.INFO, logger="gpuload"):
        assert gpu.require_gpu("cuda", "auto") is False
    assert [r for r in caplog.records if "pylibcudf is not importable" in r.getMessage()]
    with pytest.raises(gpuload.GpuloadError, match="decode='gpu' needs pylibcudf"):
        gpu.require_gpu("cuda", "gpu")
    assert gpu.require_gpu("cuda", "cpu") is False
    monkeypatch.setattr(gpu, "gpu_status", _status())
    assert gpu.require_gpu("cuda", "auto") is True


@pytest.mark.auto_device
def test_auto_without_gpu_path_is_cpu_with_one_info_line(monkeypatch, caplog):
    monkeypatch.setattr(gpu, "gpu_usable", lambda: False)
    monkeypatch.setattr(gpu, "gpu_status", _status(driver="no driver"))
    with caplog.at_level(logging.INFO, logger="gpuload"):
        assert resolve_device("auto") == torch.device("cpu")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "loading on the CPU" in lines[0] and "driver: no driver" in lines[0]


def test_this_machine_reports_why_cuda_is_unusable():
    if gpu.gpu_usable():
        pytest.skip("the GPU path can run here")
    with pytest.raises(gpuload.GpuloadError, match="needs (a CUDA GPU that torch can use|CuPy)"):
        gpuload.ParquetDataset([], device="cuda")


def test_share_rmm_pool_names_what_is_missing(monkeypatch):
    """No rmm, or an rmm without a torch allocator (what rmm gives where torch has no CUDA or
    sees no GPU): a GpuloadError saying so, and nothing changed."""
    import types

    from gpuload.gpu import rmm_pool

    monkeypatch.setattr(rmm_pool, "_state", {"device": None, "initial": None})
    monkeypatch.setitem(sys.modules, "rmm", None)
    with pytest.raises(gpuload.GpuloadError, match="share_rmm_pool needs rmm"):
        gpuload.share_rmm_pool()
    rmm = types.ModuleType("rmm")
    rmm.mr = types.ModuleType("rmm.mr")
    rmm.allocators = types.ModuleType("rmm.allocators")
    rmm.allocators.cupy = types.SimpleNamespace(rmm_cupy_allocator=object())
    rmm.allocators.torch = types.SimpleNamespace(rmm_torch_allocator=None)
    for name, mod in (("rmm", rmm), ("rmm.mr", rmm.mr), ("rmm.allocators", rmm.allocators),
                      ("rmm.allocators.cupy", rmm.allocators.cupy),
                      ("rmm.allocators.torch", rmm.allocators.torch)):
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(gpuload.GpuloadError, match="rmm has no torch allocator"):
        gpuload.share_rmm_pool()
    assert rmm_pool.shared_device() is None


def test_gds_is_used_only_where_it_really_works(monkeypatch, tmp_path):
    """KvikIO's AUTO mode only checks that libcufile loads; gpuload also wants the driver's
    word and cuFile's configuration file before it reads the cache by GPUDirect Storage
    (and gives libcudf compat mode otherwise: tests/gpu/test_requirements.py)."""
    import types

    state = {"gds": True}

    def driver_get(name):
        if state["gds"] is None:
            raise RuntimeError("cuFile driver not loaded")
        return state["gds"]

    kvikio = types.ModuleType("kvikio")
    kvikio.cufile_driver = types.SimpleNamespace(get=driver_get)
    for name, mod in (("kvikio", kvikio), ("kvikio.cufile_driver", kvikio.cufile_driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    config = tmp_path / "cufile.json"
    config.write_text("{}")
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(config))
    assert gpu._gds_usable() is True
    state["gds"] = None
    assert gpu._gds_usable() is False  # no driver
    state["gds"] = False
    assert gpu._gds_usable() is False  # no GDS
    state["gds"] = True
    monkeypatch.delenv("CUFILE_ENV_PATH_JSON")
    assert gpu._gds_usable() is os.path.exists("/etc/cufile.json")  # no configuration, no GDS


@pytest.mark.parametrize("kwargs, name", [({"decode": "fpga"}, "decode"), ({"kvikio_compat": "yes"}, "kvikio_compat"),
                                          ({"kvikio_threads": 0}, "kvikio_threads"),
                                          ({"max_device_bytes": 0}, "max_device_bytes")])
def test_gpu_settings_are_validated(tmp_path, kwargs, name):
    path = write_parquet(tmp_path / "a.parquet", {"x": np.arange(10)})
    with pytest.raises(gpuload.ConfigError, match=name):
        gpuload.ParquetDataset(path, device="cpu", cache_dir=tmp_path / "c", **kwargs)


def test_regions_are_found_from_any_base_offset(tmp_path):
    cols = {"a": np.arange(1000, dtype=np.float32),
            "r": Ragged(np.arange(7, dtype=np.int64), np.array([0, 3, 3, 7], np.int64))}
    cols["a"] = cols["a"][:3]
    path = tmp_path / "c.glc"
    write_chunk(path, cols, _key(3))
    header, full = read_chunk(path)
    raw = np.fromfile(path, np.uint8)
    start = min(r["offset"] for r in header["regions"])  # what the device reader fetches
    got = columns_from_buffer(raw[start:], header, path, True, base=start)
    assert got["a"].tolist() == [0.0, 1.0, 2.0]
    assert got["r"].values.tolist() == list(range(7)) and got["r"].offsets.tolist() == [0, 3, 3, 7]


def _key(rows: int, outputs=(("a", "scalar", "<i8", 1),)) -> ChunkKey:
    return ChunkKey("/data/x.parquet", 1, 2, "0123456789abcdef", 0, 1, rows, outputs)


@pytest.mark.parametrize("trust", [True, False])
def test_cache_uses_the_read_and_to_host_hooks(tmp_path, trust):
    calls = []

    def read(fd, p, want, verify, seen):
        calls.append(("read", seen is not None and os.fstat(fd).st_ino in {i[1] for i in seen}))
        return read_regions(fd, p, want, verify, seen)[1]

    def to_host(cols):
        calls.append(("to_host",))
        return {k: np.array(v) for k, v in cols.items()}

    cache = ChunkCache(tmp_path, read=read, to_host=to_host, trust_writes=trust)
    from gpuload.cache.chunkfile import spec_hash

    desc = [{"name": "a", "kind": "scalar", "dtype": "<i8", "width": 1}]
    key = ChunkKey("/data/x.parquet", 1, 2, spec_hash(desc), 0, 1, 5, (("a", "scalar", "<i8", 1),), desc)
    cols, cached = cache.load(key, lambda: {"a": np.arange(5)})
    assert not cached
    cache.flush()
    # with trust_writes the file this cache wrote counts as checked before any read of it
    assert len(cache._verified) == (1 if trust else 0)
    cols, cached = cache.load(key, lambda: pytest.fail("rebuilt a cached chunk"))
    assert cached and cols["a"].tolist() == [0, 1, 2, 3, 4]
    assert ("to_host",) in calls
    reads = [c for c in calls if c[0] == "read"]
    assert reads[-1][1] is trust  # the read was told the file was already checked only when trusted
    assert len(cache._verified) == 1  # checked now either way


# -- on a GPU ------------------------------------------------------------------------------
def _write_rich(tmp_path, n=60_000, files=3):
    paths = []
    for i in range(files):
        paths.append(write_parquet(tmp_path / "data" / f"p{i}.parquet", rich_table(n // files, seed=i),
                                   row_group_size=5_000))
    return tmp_path / "data"


def _epoch(ds, epoch=0) -> list[dict]:
    ds.set_epoch(epoch)
    out = []
    for b in ds:
        out.append({k: (Ragged(v.values.cpu().numpy(), v.offsets.cpu().numpy()) if isinstance(v, Ragged)
                        else v.cpu().numpy()) for k, v in b.items()})
    return out


def _assert_same(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], Ragged):
                assert np.array_equal(x[k].offsets, y[k].offsets), k
                assert x[k].values.dtype == y[k].values.dtype and x[k].values.tobytes() == y[k].values.tobytes(), k
            else:
                assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
                assert x[k].tobytes() == y[k].tobytes(), k  # bit-identical, NaNs included


def _ds(data, cache, device, **kw):
    kw.setdefault("batch_size", 4096)
    kw.setdefault("chunk_bytes", 1 << 20)
    return open_dataset(data, RICH_COLUMNS, cache, fill_nulls=RICH_FILL, device=device, **kw)


@pytest.mark.gpu
def test_caches_are_shared_between_cpu_and_gpu(tmp_path):
    data = _write_rich(tmp_path)
    ref = _epoch(_ds(data, tmp_path / "ref", "cpu"))
    # written by the CPU, read by the GPU
    gpuload.build_cache(data, tmp_path / "a", RICH_COLUMNS, fill_nulls=RICH_FILL, chunk_bytes=1 << 20, device="cpu")
    g = _ds(data, tmp_path / "a", "cuda")
    _assert_same(ref, _epoch(g))
    assert g.reader.counters.decoded == 0
    # written by the GPU, read by the CPU (and byte-identical files)
    gpuload.build_cache(data, tmp_path / "b", RICH_COLUMNS, fill_nulls=RICH_FILL, chunk_bytes=1 << 20, device="cuda")
    c = _ds(data, tmp_path / "b", "cpu")
    _assert_same(ref, _epoch(c))
    assert c.reader.counters.decoded == 0
    a_files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.glc"))
    b_files = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.glc"))
    assert a_files == b_files
    for p in a_files:  # same regions, same checksums (the header's build time differs)
        ha = read_chunk(tmp_path / "a" / p)[0]
        hb = read_chunk(tmp_path / "b" / p)[0]
        assert ha["regions"] == hb["regions"]


@pytest.mark.gpu
def test_gpu_batches_are_zero_copy_views_of_the_loader_buffer(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(200_000, dtype=np.float32)}, row_group_size=200_000)
    ds = gpuload.ParquetDataset(path, ["x"], batch_size=10_000, shuffle=False, device="cuda", cache_dir=tmp_path / "c")
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = list(ds)
        ptrs = [b["x"].data_ptr() for b in batches]
        # one chunk: every batch is a slice of the same device buffer, at its row offset
        assert ptrs == [ptrs[0] + i * 10_000 * 4 for i in range(20)]
        assert batches[0]["x"].device.type == "cuda"
        assert torch.equal(torch.cat([b["x"] for b in batches]).cpu(), torch.arange(200_000, dtype=torch.float32))


@pytest.mark.gpu
def test_gpu_memory_is_bounded_and_does_not_grow(tmp_path):
    """20 cached epochs: torch's allocated and reserved memory and CuPy's pool stay flat."""
    import cupy

    data = _write_rich(tmp_path, n=90_000)
    ds = _ds(data, tmp_path / "c", "cuda", shuffle=True, shuffle_window=2, prefetch=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cold = torch.cuda.memory_allocated()
    _epoch(ds, 0)  # decoded (with cuDF where it is installed): the bound holds while decoding too
    assert torch.cuda.max_memory_allocated() - cold <= ds.device_bytes_bound
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    after, reserved, pool = [], [], []
    for epoch in range(1, 21):
        ds.set_epoch(epoch)
        for _ in ds:
            pass
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        reserved.append(torch.cuda.memory_reserved())
        pool.append(cupy.get_default_memory_pool().total_bytes())
    assert max(after) <= base + (1 << 20), after  # nothing kept across epochs
    assert torch.cuda.max_memory_allocated() - base <= ds.device_bytes_bound
    # after a few epochs of warm-up, torch's cache holds what one epoch needs: at most one more
    # large segment (20 MiB) over the last 15 epochs; gpuload allocates nothing from CuPy's pool
    assert max(reserved[5:]) - reserved[5] <= 20 << 20, [r >> 20 for r in reserved]
    assert len(set(pool[5:])) == 1, pool
    with pytest.raises(gpuload.ConfigError, match="max_device_bytes"):
        _ds(data, tmp_path / "c", "cuda", max_device_bytes=ds.device_bytes_bound - 1)


@pytest.mark.gpu
@pytest.mark.cudf
def test_kvikio_settings_survive_cudf_reads(tmp_path):
    import kvikio.defaults

    data = _write_rich(tmp_path)
    ds = _ds(data, tmp_path / "c", "cuda", decode="gpu", kvikio_threads=3, kvikio_compat="auto")
    _epoch(ds, 0)
    assert kvikio.defaults.get("num_threads") == 3
    # "auto": AUTO only where GPUDirect Storage really works, else compat mode (POSIX reads)
    assert kvikio.defaults.get("compat_mode") == (kvikio.CompatMode.AUTO if ds.reader.device.ctx.gds else kvikio.CompatMode.ON)
    assert os.environ["KVIKIO_COMPAT_MODE"] == ("AUTO" if ds.reader.device.ctx.gds else "ON")


@pytest.mark.gpu
def test_corrupt_cache_is_rebuilt_on_the_gpu(tmp_path):
    data = _write_rich(tmp_path)
    ref = _epoch(_ds(data, tmp_path / "ref", "cpu"))
    gpuload.build_cache(data, tmp_path / "c", RICH_COLUMNS, fill_nulls=RICH_FILL, chunk_bytes=1 << 20)
    victim = sorted((tmp_path / "c").rglob("*.glc"))[0]
    raw = bytearray(victim.read_bytes())
    region = read_chunk(victim, verify=False)[0]["regions"][0]
    raw[region["offset"] + region["nbytes"] // 2] ^= 0xFF  # inside a region, not in the alignment padding
    victim.write_bytes(bytes(raw))
    g = _ds(data, tmp_path / "c", "cuda")  # a new process would verify on first read: so does a new dataset
    _assert_same(ref, _epoch(g))
    assert g.reader.counters.decoded == 1


_BUSY_CONSUMER = textwrap.dedent("""
    import sys, numpy as np, torch, gpuload
    allocator, device, data, cache, kind = sys.argv[1:6]
    if allocator == "rmm":  # first: torch.cuda.set_device initialises torch's allocator, which then stays
        gpuload.share_rmm_pool(device=torch.device(device).index)
    torch.cuda.set_device(torch.device(device))
    kw = dict(batch_size=256, shuffle=True, chunk_bytes=1 << 19)

    def make(where, folder):  # a dataset, or a Mix of two (its steps are its own tensors, made on its stream)
        one = lambda seed, c: gpuload.ParquetDataset(data, device=where, cache_dir=c, seed=seed, **kw)
        if kind == "dataset":
            return one(3, folder)
        return gpuload.Mix({"a": one(3, folder + "-a"), "b": one(4, folder + "-b")}, {"a": 0.6, "b": 0.4})

    cpu, ds = make("cpu", cache + "-cpu"), make(device, cache)
    side = torch.cuda.Stream()
    for epoch in (0, 1):  # decoded, then from the cache
        cpu.set_epoch(epoch)
        want = np.concatenate([b["x"].numpy() for b in cpu])
        ds.set_epoch(epoch)
        xs = torch.empty(len(want), dtype=torch.int64, device=device)
        ys = torch.empty(len(want), dtype=torch.float64, device=device)
        pos = batches = 0
        for b in ds:  # no host synchronisation until the epoch ends
            torch.cuda._sleep(200_000)  # the step's kernels come first: the batch must hold still meanwhile
            churn = torch.empty(1 << 18, device=device).fill_(-1.0)  # the consumer allocates and writes too
            k = len(b["x"])
            xs[pos:pos + k].copy_(b["x"])
            side.wait_stream(torch.cuda.current_stream())  # a side stream reads the batch as well
            with torch.cuda.stream(side):
                ys[pos:pos + k].copy_(b["y"] * 2)
            torch.cuda.current_stream().wait_stream(side)  # and the batch is released after that read
            pos += k
            batches += 1
            del b, churn
        torch.cuda.synchronize()
        assert batches > 1000 * (kind == "dataset") + 500 and pos == len(want)
        got = xs.cpu().numpy()
        assert np.array_equal(got, want), (epoch, int((got != want).sum()))
        assert np.array_equal(ys.cpu().numpy(), got * 6.0), epoch
    print("ok")
""")


@pytest.mark.slow  # a process of its own
@pytest.mark.gpu
@pytest.mark.parametrize("allocator", ["torch", pytest.param("rmm", marks=pytest.mark.cudf)])
@pytest.mark.parametrize("index, kind", [(0, "dataset"), (1, "dataset"), (0, "mix")])
def test_batches_hold_still_under_a_busy_consumer(tmp_path, allocator, index, kind):
    """Thousands of batches used without host synchronisation, after a delay, by the current
    stream and a side stream, while the consumer allocates and writes memory of its own: every
    value equals the CPU path's. With torch's caching allocator (record_stream) and with the
    RMM pool shared by share_rmm_pool (whose torch allocator ignores record_stream), on the
    first GPU and, where there is one, on a second (the pool is made on the device given); a
    Mix's steps too (the mix's own tensors, guarded as a batch_transform's are)."""
    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} GPUs")
    n = 400_000
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(n, dtype=np.int64),
                                                  "y": (np.arange(n) * 3).astype(np.float64)}, row_group_size=20_000)
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)  # keep the GPU stack's
    out = subprocess.run([sys.executable, "-c", _BUSY_CONSUMER, allocator, f"cuda:{index}", str(path),
                          str(tmp_path / "c"), kind], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": pythonpath})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.cudf
def test_share_rmm_pool_after_torch_allocated_is_refused():
    torch.zeros(1, device="cuda")
    with pytest.raises(gpuload.GpuloadError, match="share_rmm_pool"):
        gpuload.share_rmm_pool()



def test_every_row_once_and_same_order_on_each_device(tmp_path, device):
    """One body on the CPU and, where present, the GPU: rows exactly once, order fixed by (seed, epoch)."""
    n = 23_456
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(n, dtype=np.int64)}, row_group_size=1_000)
    kw = dict(batch_size=1_000, chunk_bytes=16_384, cache_dir=tmp_path / "c", device=device, seed=5)
    for world in (1, 2):
        seen = []
        for rank in range(world):
            ds = gpuload.ParquetDataset(path, rank=rank, world_size=world, **kw)
            first = [b["x"].cpu().numpy() for b in (ds.set_epoch(3) or ds)]
            again = [b["x"].cpu().numpy() for b in (ds.set_epoch(3) or ds)]  # now from the cache
            assert len(first) == len(ds) and all(np.array_equal(a, b) for a, b in zip(first, again))
            seen.append(np.concatenate(first))
        assert len(seen[0]) == len(seen[-1]) or abs(len(seen[0]) - len(seen[-1])) == 1
        assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(n))
