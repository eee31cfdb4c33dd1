"""The benchmark scripts still import and their machine-independent parts still work.

The benchmarks run by hand (the GPU one only on a GPU node, where device time is
scarce), so a helper renamed in the package must break here, not there.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gpuload
import gpuload.gpu.runtime
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


def test_bench_gpu_grid_pairs_and_refusals():
    import argparse

    import bench_gpu

    assert bench_gpu.parse_grid("2:2,8:16,") == ((2, 2), (8, 16))
    for bad in ("2", "a:1", "0:2", "2:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.replace("-", r"\-")):
            bench_gpu.parse_grid(bad)


def test_bench_gpu_without_a_gpu_says_why(capsys):
    if gpuload.gpu.runtime.gpu_usable():
        pytest.skip("a GPU is usable here")
    import bench_gpu

    assert bench_gpu.main(["--rows", "1000"]) == 2
    assert "no usable GPU" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_node_cudf_steps_fail_fast_without_the_rapids_stack(tmp_path):
    """The steps after `proof` need pylibcudf, RMM and KvikIO: without them they start nothing and
    say so in one line (on a GPU node a skipped GPU test must never read as a pass)."""
    if gpuload.gpu_status()["cudf"] is None:
        pytest.skip("pylibcudf is installed here")
    import gpu_node

    assert gpu_node.main(["run", "env", "gpu", "--out", str(tmp_path), "--limit", "240"]) == 1
    for step in ("env", "gpu"):
        log = (tmp_path / f"{step}.log").read_text()
        assert log.startswith(f"{step} needs the RAPIDS stack") and "pylibcudf" in log and "\n$ " not in log


def _gpu_unusable():
    if gpuload.gpu.runtime.gpu_usable():
        pytest.skip("a GPU is usable here")


@pytest.mark.slow
def test_gpu_node_proof_stops_at_the_first_device_use(tmp_path, capsys):
    """The rehearsal of the first call: it runs, writes its summary and JSON, and stops at the first
    device use, saying why, without starting the other parts."""
    _gpu_unusable()
    import gpu_node

    assert gpu_node.main(["run", "proof", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("PROOF STOPPED at env: the first device use failed: ")
    assert [line.split(":")[0] for line in out[:-1]] == [f"proof {name}" for name, *_ in gpu_node.PROOF]
    assert all(line.endswith("not run (stopped at env)") for line in out[1:-1])
    assert (tmp_path / "proof.log").read_text().splitlines() == out
    summary = json.loads((tmp_path / "proof.json").read_text())
    assert summary["ok"] is False and summary["stopped"].startswith("the first device use failed")
    assert summary["versions"]["torch"] == torch.__version__ and summary["device"] is None
    assert summary["parts"]["env"]["rc"] == 3 and summary["parts"]["bench"]["rc"] == "not run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proof-env.log", "proof.json", "proof.log"]


@pytest.mark.slow
def test_gpu_node_proof_parts_fail_where_they_would_only_skip(tmp_path):
    """--keep-going runs every part here: each pytest part fails (GPULOAD_REQUIRE_GPU=1) instead of
    passing with its GPU tests skipped, the bench exits 2; at most 8 files, as the lent node returns."""
    _gpu_unusable()
    import gpu_node

    assert gpu_node.main(["run", "proof", "--out", str(tmp_path), "--keep-going"]) == 1
    summary = json.loads((tmp_path / "proof.json").read_text())
    parts = summary["parts"]
    assert list(parts) == [name for name, *_ in gpu_node.PROOF] and not any(p["ok"] for p in parts.values())
    for name, p in parts.items():
        log = (tmp_path / p["log"]).read_text()
        if name not in ("env", "bench"):
            assert p["rc"] == 4 and "GPULOAD_REQUIRE_GPU=1, but the GPU path cannot run here: driver" in log, name
            assert "cudf" not in log.split("cannot run here:")[1].split(";")[0]  # not demanded
    assert parts["bench"]["rc"] == 2 and "no usable GPU" in (tmp_path / "proof-bench.log").read_text()
    assert len(list(tmp_path.iterdir())) <= 8


_COLLECT = """
import contextlib, io, json, sys
import pytest
found = {}
for name, args in json.loads(sys.argv[1]).items():
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--assert=plain", *args])
    assert rc == 0, (name, rc, out.getvalue()[-3000:])
    found[name] = [line for line in out.getvalue().splitlines() if "::" in line]
print(json.dumps(found))
"""


def _collected(parts: dict[str, list[str]]) -> dict[str, list[str]]:
    """The test ids each part's pytest arguments collect (``-n`` and ``-v`` left out), in one
    process: the second collection reuses the first one's imports (torch's, the tests'); without
    assertion rewriting, most of a collection's time."""
    ids = {name: [a for k, a in enumerate(args) if a not in ("-n", "-v") and (k == 0 or args[k - 1] != "-n")]
           for name, args in parts.items()}
    r = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps(ids)], cwd=BENCH.parent, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "GPULOAD_REQUIRE_GPU": "0"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.slow
def test_gpu_node_proof_parts_select_what_they_claim():
    """Each pytest part of the proof collects the tests it names, none that needs cuDF, and the
    `gpu` part everything else marked gpu (none of the named ones twice)."""
    import gpu_node

    from test_equivalence import CONFIGS

    parts = _collected({name: how for name, _, _, how in gpu_node.PROOF if isinstance(how, list)})
    assert sorted(parts["identity"]) == sorted(f"{gpu_node._IDENTITY}[cuda-arrow-{c}]" for c in CONFIGS)
    assert parts["memory"] == [gpu_node._MEMORY]
    assert parts["streams"] == [f"{gpu_node._BUSY}[{case}-torch]" for case in ("0-dataset", "1-dataset", "0-mix")]
    rest = parts["gpu"]
    assert "tests/cache/test_store.py::test_concurrent_processes_build_each_chunk_once[cuda]" in rest
    assert "tests/gpu/test_runtime.py::test_caches_are_shared_between_cpu_and_gpu" in rest
    named = {t for name in ("identity", "memory", "streams") for t in parts[name]}
    assert not named & set(rest)
    everything = [t for p in parts.values() for t in p]
    assert not [t for t in everything if "cudf" in t or "rmm" in t or "[cpu" in t], everything


def test_gpu_node_counts_come_from_junit(tmp_path):
    import gpu_node

    (tmp_path / "r.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="t1"/><testcase classname="tests.a" name="t2"><failure/></testcase>'
        '</testsuite></testsuites>')
    assert gpu_node._junit_counts(tmp_path / "r.xml") == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1,
                                                         "first_failure": "tests.a::t2"}
    assert gpu_node._junit_counts(tmp_path / "none.xml") is None


@pytest.mark.slow
def test_gpu_node_stops_a_step_and_everything_it_started(tmp_path):
    import gpu_node

    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    rc = gpu_node._run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "x.log", 1.5)
    assert rc == 124 and time.monotonic() - t0 < 30
    assert "stopped after 2 s" in (tmp_path / "x.log").read_text()
    stat = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    for _ in range(50):  # the grandchild went with it: gone, or a zombie nobody has reaped yet
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"still running: {stat.read_text()}")


def test_gpu_node_proof_is_a_call_of_its_own(tmp_path):
    import gpu_node

    with pytest.raises(SystemExit, match="'proof' is a call of its own"):
        gpu_node.main(["run", "proof", "env", "--out", str(tmp_path)])


def test_bench_mix_compares_the_mixes_with_one_source(tmp_path):
    import bench_mix

    out = tmp_path / "bench.md"
    bench_mix.main(["--rows", "30000", "--repeat", "1", "--batch", "2048", "--step-ms", "0", "--dir",
                    str(tmp_path / "w"), "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| one source", "| mix, 1 batch per step", "| mix, 4 batches per step"]
    assert rows[0].endswith("| 1.00x |")
    steps = [int(r.split(" | ")[1].replace(",", "")) for r in rows]
    assert steps[0] == -(-30000 // 2048) and steps[1] > steps[0]  # 'repeat': the 0.2 source read whole


def test_bench_whatif_applies_each_estimate(tmp_path):
    import bench_whatif

    out = tmp_path / "bench.md"
    bench_whatif.main(["--rows", "200000", "--repeat", "1", "--chunk-mib", "1", "--dir", str(tmp_path / "w"),
                       "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| first") or line.startswith("| cached")]
    assert rows and {r.split(" | ")[0] for r in rows} <= {"| first (empty cache)", "| cached"}
    for r in rows:  # an estimate carries its prediction and the waiting measured with it applied
        cells = r.strip("|").split(" | ")
        assert cells[2] == "none" or (cells[3].endswith("%") and cells[4].rstrip(" |").endswith("%"))


def test_bench_drives_compares_two_folders_with_one(tmp_path):
    import bench_drives

    out = tmp_path / "bench.md"
    bench_drives.main(["--rows", "60000", "--repeat", "1", "--batch", "4096", "--threads", "2", "--dir",
                       str(tmp_path / "w"), "--out", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| one folder") or line.startswith("| two folders")]
    assert len(rows) == 2 and all(float(r.rsplit("|", 2)[1].replace(",", "")) > 0 for r in rows)
    assert "striped / one folder:" in text
    # the striped chunks are the single folder's, each in the folder its rendezvous order names first
    # (which folder that is depends on the temporary paths: all of them may land in one)
    from types import SimpleNamespace

    from gpuload.cache.drives import Drives

    w = tmp_path / "w"
    drives = Drives([w / "a", w / "b"])
    placed = {p.relative_to(w / f).as_posix(): i for i, f in enumerate("ab") for p in (w / f).rglob("*.glc")}
    assert sorted(placed) == sorted(p.relative_to(w / "one").as_posix() for p in (w / "one").rglob("*.glc"))
    assert len(placed) >= 8 and all(drives.order(SimpleNamespace(relpath=lambda r=r: r))[0] == i
                                    for r, i in placed.items())


def test_bench_small_files_pass_makes_a_chunk_of_each_small_file_and_refuses_one_layout(tmp_path, capsys):
    """One pass of bench_small_files (in this process): every row in both epochs, a chunk per file,
    a reason the first epoch waited, a restart that decodes nothing, its cache removed; ``--files``
    with one count is refused."""
    from types import SimpleNamespace

    import bench_small_files

    write_clicklog(tmp_path / "d", 6000, files=12)
    threads = torch.get_num_threads()  # a pass sets 1 (its process's own, normally): not for the next tests here
    try:
        r = bench_small_files.one_pass(SimpleNamespace(data=str(tmp_path / "d"), cache=str(tmp_path / "c"),
                                                       batch=1024, step_ms=0))
    finally:
        torch.set_num_threads(threads)
    assert (r["files"], r["chunks"], r["rows"]) == (12, 12, 6000)
    assert r["first_s"] >= r["open_s"] > 0 and r["cached_s"] > 0 and r["read_s"] > 0
    assert r["restart_s"] >= r["reopen_s"] > 0  # a restart decodes nothing (the pass asserts it)
    assert re.fullmatch(r"[a-z_]+: \S.*", r["limited"]), r["limited"]  # diagnose's stage, then its message
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit) as e:
        bench_small_files.main(["--files", "400"])
    assert e.value.code == 2 and "--files 400: give two or more file counts" in capsys.readouterr().err


def test_profile_threads_names_each_thread_groups_lines(tmp_path):
    """The sampling profile of a first and a cached epoch: every loader thread group is
    sampled and its time lands on gpuload's own lines."""
    import profile_threads

    out = tmp_path / "prof.txt"
    assert profile_threads.main(["--rows", "60000", "--files", "2", "--device", "cpu", "--epochs", "2",
                                 "--dir", str(tmp_path / "w"), "--out", str(out)]) == 0
    text = out.read_text()
    first, cached = text.split("## 2 cached epochs")
    for part in (first, cached):
        assert "### gpuload-producer:" in part and "### gpuload-load:" in part and "### MainThread:" in part
    assert "read_columns" in first and "read_columns" not in cached  # Parquet decoded in the first epoch alone
    assert text.count("epoch ") >= 4


def test_profile_threads_groups_executor_threads():
    import profile_threads

    assert [profile_threads.Sampler.group(n) for n in ("gpuload-load_3", "gpuload-producer", "MainThread",
                                                       "Thread-2 (run)", "a_b")] == \
        ["gpuload-load", "gpuload-producer", "MainThread", "Thread-2 (run)", "a_b"]


@pytest.mark.slow
def test_gpu_node_profile_step_runs_without_the_rapids_stack(tmp_path):
    """The node's ``profile`` step needs no cuDF: here it profiles on the CPU, into profile.log."""
    import gpu_node

    assert gpu_node.main(["run", "profile", "--rows", "60000", "--out", str(tmp_path), "--bench-dir",
                          str(tmp_path / "b"), "--limit", "200"]) == 0
    log = (tmp_path / "profile.log").read_text()
    assert "## first epoch" in log and "### gpuload-producer:" in log and "cached epochs" in log


@pytest.mark.slow
def test_bench_python_step_measures_each_loader_in_a_process_of_its_own(tmp_path):
    import bench_python_step

    out = tmp_path / "bench.md"
    bench_python_step.main(["--rows", "30000", "--files", "2", "--repeat", "1", "--epochs", "2", "--ops", "50",
                            "--loaders", "gpuload,gpuload-noshuffle,torchdata-nodes", "--workdir", str(tmp_path / "w"),
                            "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| gpuload", "| gpuload-noshuffle", "| torchdata-nodes"]
    for r in rows:  # an epoch, the step alone and under the loader, its ratio, the waiting
        cells = r.strip("| ").split(" | ")
        assert cells[1].endswith(" s") and cells[2].endswith(" ms") and cells[4].endswith("x") and cells[5].endswith("%")
    with pytest.raises(SystemExit, match="--loaders: unknown"):
        bench_python_step.main(["--loaders", "petastorm", "--workdir", str(tmp_path / "none")])
    assert not (tmp_path / "none").exists()  # refused before any data is written
