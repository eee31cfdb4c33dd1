"""The device object: resolving ``device=``, and the CPU path's :class:`gpuload.device.Host`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpuload
from gpuload.cache.store import ChunkCache
from gpuload.config import Options, Source
from gpuload.device import Host, open_device, resolve_device
from gpuload.handoff import HostHandoff
from gpuload.memory import HostPool
from gpuload.reader import open_reader

from conftest import write_parquet


@pytest.mark.auto_device
def test_auto_is_cpu_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "banana"])
def test_bad_device_names_the_setting(bad):
    with pytest.raises(gpuload.ConfigError, match="device="):
        resolve_device(bad)


def test_cuda_without_gpu_says_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(gpuload.GpuloadError, match="device='cuda' needs a CUDA GPU that torch can use: "):
        resolve_device("cuda")


def test_cpu_options_open_the_host_device():
    assert isinstance(open_device(Options(device="cpu")), Host)


def test_the_host_device_leaves_arrays_where_they_are_and_allocates_from_pools(tmp_path):
    host, pool = Host(), HostPool()
    cols = {"a": np.arange(4)}
    assert host.upload(cols) is cols
    perm = np.array([2, 0, 1])
    assert host.upload_index(perm) is perm
    assert host.host_alloc(pool) == pool.array
    with host.reading(), host.batching():  # the pipeline's two sides: nothing to enter on the CPU
        assert host.receive(host.handover(cols)) is cols
    cache = host.cache(Options(cache_dir=tmp_path / "c", max_cache_bytes=10, verify_checksums="always"), None, pool)
    assert isinstance(cache, ChunkCache) and cache.max_bytes == 10
    assert isinstance(host.handoff({}, None, pool), HostHandoff)
    decoder = object()
    assert host.decoder(decoder, None) is decoder and not host.gpu_decode
    host.check_bound(1 << 40, 1, "terms")  # max_device_bytes limits device memory only


def test_max_device_bytes_does_not_limit_the_cpu_path(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(1000, dtype=np.int64)})
    ds = gpuload.ParquetDataset(path, device="cpu", cache_dir=tmp_path / "c", max_device_bytes=1, batch_size=100)
    assert ds.device == torch.device("cpu") and sum(len(b["x"]) for b in ds) == 1000


def test_readers_open_on_the_device_of_their_options(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"x": np.arange(10, dtype=np.int64)})
    reader = open_reader(Source(path), Options(device="cpu", cache_dir=tmp_path / "c"))
    assert isinstance(reader.device, Host) and reader.device.torch_device == torch.device("cpu")


def test_the_cuda_device_offers_the_same_calls_through_its_context(tmp_path):
    """device.Cuda on a stand-in context (no GPU here): the pipeline's sides, uploads and cache
    reads go to the loader's DeviceContext; decoding is cuDF's only where asked."""
    import types

    from gpuload.gpu.decoder import GpuDecoder
    from gpuload.device import Cuda

    calls = []
    ctx = types.SimpleNamespace(device=torch.device("cuda", 1), reading=lambda: "read", batching=lambda: "batch",
                                handover=lambda c: ("ev", c), receive=lambda item: item[1],
                                upload=lambda c: calls.append("upload") or c, upload_index=lambda i: ("dev", i),
                                to_host=lambda c: c)
    dev = Cuda(ctx, gpu_decode=False)
    assert dev.torch_device == torch.device("cuda", 1) and dev.reading() == "read" and dev.batching() == "batch"
    assert dev.receive(dev.handover({"a": 1})) == {"a": 1} and dev.upload_index(3) == ("dev", 3)
    assert dev.upload({"a": 1}) == {"a": 1} and calls == ["upload"]
    assert dev.host_alloc(HostPool()) is None  # windows and batches are CuPy's
    cpu = object()
    assert dev.decoder(cpu, None) is cpu
    gpu = Cuda(ctx, gpu_decode=True).decoder(cpu, None)
    assert isinstance(gpu, GpuDecoder) and gpu.fallback is cpu and gpu.ctx is ctx
    cache = dev.cache(Options(cache_dir=tmp_path / "c", verify_checksums=False), None, HostPool())
    assert cache._to_host is ctx.to_host and cache._trust_writes and cache._read_fn is not None
    dev.check_bound(100, None, "terms")
    dev.check_bound(100, 100, "terms")
    with pytest.raises(gpuload.ConfigError, match=r"max_device_bytes=99: these settings may hold up to 100 bytes .*terms"):
        dev.check_bound(100, 99, "terms")
