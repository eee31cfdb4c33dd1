"""The benchmark scripts still import and their machine-independent parts still work.

The benchmarks run by hand (the GPU one only on a GPU node, where device time is
scarce), so a helper renamed in the package must break here, not there.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest

import gpuload
from gpuload.cache.chunkfile import ALIGN, columns_from_buffer, read_header
from gpuload.synth import write_clicklog

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:  # an optional package of its own (petastorm, boto3, ...)
        if e.name and (e.name.split(".")[0] in ("gpuload", *SCRIPTS)):
            raise
        pytest.skip(f"{name} needs {e.name}")


def test_bench_gpu_spans_are_the_cached_regions(tmp_path):
    """What bench_gpu reads with raw KvikIO is exactly each cache file's column regions."""
    import bench_gpu

    data = tmp_path / "data"
    write_clicklog(data, 20_000, files=2, row_group_rows=2_500)
    gpuload.build_cache(data, tmp_path / "cache", bench_gpu.COLUMNS, chunk_bytes=1 << 20, device="cpu")
    files = sorted((tmp_path / "cache").rglob("*.glc"))
    spans = bench_gpu.cache_spans(files)
    assert [p for p, _, _ in spans] == files and len(files) >= 2
    for path, start, length in spans:
        assert start % ALIGN == 0 and 0 < length and start + length <= path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            header = read_header(fd, path)[0]
            buf = np.empty(length, np.uint8)
            assert os.preadv(fd, [buf], start) == length
        finally:
            os.close(fd)
        cols = columns_from_buffer(buf, header, path, True, base=start)  # every region's checksum matches
        assert set(cols) >= {"row_id", "dense", "history"}


def test_bench_gpu_without_a_gpu_says_why(capsys):
    if gpuload.gpu.runtime.gpu_usable():
        pytest.skip("a GPU is usable here")
    import bench_gpu

    assert bench_gpu.main(["--rows", "1000"]) == 2
    assert "no usable GPU" in capsys.readouterr().out


def test_gpu_node_runner_fails_where_the_gpu_tests_would_only_skip(tmp_path):
    """On a GPU node the runner must not report a green run of skipped GPU tests."""
    if gpuload.gpu.runtime.gpu_usable():
        pytest.skip("a GPU is usable here")
    import gpu_node

    assert gpu_node.main(["run", "gpu", "--out", str(tmp_path), "--limit", "240"]) == 1
    log = (tmp_path / "gpu.log").read_text()
    assert "GPULOAD_REQUIRE_GPU=1, but the GPU path cannot run here" in log
