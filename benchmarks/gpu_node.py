#!/usr/bin/env python3
"""The GPU proof on a GPU node without network, in steps that each fit one short call.

Two halves (docs/gpu-testing.md has the whole sequence):

Here, on a machine with PyPI (no GPU needed), the wheels the test suite needs that the
node lacks (moto, s3fs, dask, torchdata and their dependencies, about 41 MiB)::

    python benchmarks/gpu_node.py wheels --out .gpu-test-wheels

There, from the repository root, with the RAPIDS stack installed (cuDF, KvikIO, RMM:
see docs/gpu-testing.md), any steps in order::

    python3 benchmarks/gpu_node.py run install env gpu     # --wheels .gpu-test-wheels
    python3 benchmarks/gpu_node.py run suite
    python3 benchmarks/gpu_node.py run bench

Steps: ``install`` (the test wheels into the site folder), ``env`` (versions, the GPU,
``gpuload.gpu_status()``, KvikIO's settings and a one-file check that the CPU, cuDF and
pyarrow-plus-copy paths give the same batch), ``gpu`` (``pytest -m gpu -v``), ``suite``
(the whole suite, ``-n 8``), ``bench`` (``benchmarks/bench_gpu.py`` at 8M rows, with
its details, JSON and traces). Each writes ``<step>.log`` (and its results) to ``$OUT``
or ``--out`` (at most 8 files per call come back from the lent node), stops at
``--limit`` seconds for the whole call, and the last lines sum up every step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(os.environ.get("GPUSITE", "/tmp/site"))
SITES = [SITE, Path("/opt/wheelhouse/site")]  # bundle.py's install.sh, wheelhouse.py's unpack.sh

# What the test suite needs beyond gpuload's own dependencies and the gpu stack.
TEST_NEEDS = ["moto[s3,server]>=5", "s3fs>=2024.2", "dask[distributed]>=2024.1", "torchdata>=0.8", "hypothesis>=6",
              "werkzeug>=3", "aiohttp>=3.9"]
# Packages the lent GPU nodes' image already has (read on one of them, 2026-11-17): not shipped.
# fsspec is left out of it on purpose: s3fs pins fsspec to its own version, so it ships with it.
NODE_HAS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheels(a) -> int:
    """Resolve TEST_NEEDS for the node's Python and download what the node lacks."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    have = {_norm(n) for n in (Path(a.have).read_text().split() if a.have else NODE_HAS)}
    have = {n.split("==")[0] for n in have}
    common = ["--only-binary=:all:", "--python-version", a.python, "--implementation", "cp",
              *[x for p in PLATFORMS for x in ("--platform", p)]]
    report = out / "resolve.json"
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                           "--report", str(report), "--target", str(out / ".resolve"), *common, *TEST_NEEDS])
    shutil.rmtree(out / ".resolve", ignore_errors=True)
    pins = []
    for item in json.loads(report.read_text())["install"]:
        name = _norm(item["metadata"]["name"])
        if name not in have and not name.startswith("nvidia-"):  # torch comes with the node, and its CUDA
            pins.append(f"{item['metadata']['name']}=={item['metadata']['version']}")
    report.unlink()
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(out), *common,
                           *pins])
    size = sum(p.stat().st_size for p in out.glob("*.whl"))
    print(f"{len(pins)} wheels, {size / 2**20:.0f} MiB in {out}: send it along with the 'install' step")
    return 0


# -- on the node -------------------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ, GPULOAD_REQUIRE_GPU="1")  # tests fail, not skip, where the GPU stack is not usable
    paths = [str(ROOT)] + [str(s) for s in SITES if s.is_dir()] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], log: Path, seconds: float) -> int:
    """Run ``cmd`` in the repository root with output appended to ``log``; 124 when it ran out of time."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(c if len(c) < 200 else c.strip().splitlines()[0] + " ..." for c in cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(seconds, 1)).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu_node] stopped after {seconds:.0f} s\n")
            return 124
        except OSError as e:  # no such program here
            f.write(f"[gpu_node] {e}\n")
            return 127


ENV_CHECK = r"""
import importlib, json, sys, tempfile
import numpy as np, torch
import gpuload
from gpuload.gpu import runtime as gpu
sys.path.insert(0, "benchmarks")
from bench_gpu import dist_version as v

print("python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda, "| numpy",
      np.__version__, "| pyarrow", v("pyarrow"), "| cupy", v("cupy-cuda13x", "cupy-cuda12x"), "| pylibcudf",
      v("pylibcudf-cu13", "pylibcudf-cu12"), "| kvikio", v("kvikio-cu13", "kvikio-cu12"), "| rmm",
      v("rmm-cu13", "rmm-cu12"))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print("gpu_status:", json.dumps(gpuload.gpu_status()))
for name in ("pylibcudf", "kvikio", "rmm", "cudf"):
    try:
        importlib.import_module(name)
        print("import", name, "ok")
    except Exception as e:
        print("import", name, "FAILED:", type(e).__name__, e)
if not gpu.gpu_usable():
    sys.exit("the GPU path cannot run here")
import kvikio, kvikio.cufile_driver, pyarrow as pa, pyarrow.parquet as pq
d = tempfile.mkdtemp()
n = 100_000
pq.write_table(pa.table({"x": np.arange(n), "y": np.random.default_rng(0).random(n),
                         "l": pa.array([[i, i + 1] for i in range(n)])}), d + "/a.parquet", row_group_size=20_000)
batches = {}
for dev, dec in (("cpu", "auto"), ("cuda", "gpu"), ("cuda", "cpu")):
    ds = gpuload.ParquetDataset(d + "/a.parquet", batch_size=10_000, seed=1, device=dev, decode=dec,
                                cache_dir=f"{d}/{dev}-{dec}")
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches[(dev, dec, epoch)] = [{k: (t.values.cpu().numpy().tobytes() + t.offsets.cpu().numpy().tobytes()
                                           if isinstance(t, gpuload.Ragged) else t.cpu().numpy().tobytes())
                                       for k, t in b.items()} for b in ds]
    if dec == "gpu":
        print("cuDF decoded", ds.reader.counters.decoded, "chunks,", ds.reader.decode.fallbacks, "fell back to the CPU")
for key, got in batches.items():
    print(key, "identical to the CPU's" if got == batches[("cpu", "auto", key[2])] else "DIFFERENT")
print("kvikio compat mode", kvikio.defaults.get("compat_mode"), "threads", kvikio.defaults.get("num_threads"))
try:
    print("GDS available:", kvikio.cufile_driver.get("is_gds_available"))
except Exception as e:
    print("GDS available: unknown,", type(e).__name__, e)
ok = all(got == batches[("cpu", "auto", k[2])] for k, got in batches.items())
print("ENV OK" if ok else "ENV FAILED")
sys.exit(0 if ok else 1)
"""


def _pytest(extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra"]
    if importlib.util.find_spec("pytest_timeout"):  # on the node: a hung test fails alone, not the whole call
        cmd += ["-o", "timeout=300"]
    return cmd + extra


def run(a) -> int:
    out = Path(a.out or os.environ.get("OUT") or ROOT / "gpu-node-logs")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.limit
    summary: list[str] = []
    for step in a.steps:
        left = deadline - time.monotonic() - 5
        if left <= 10:
            summary.append(f"{step}: not run (the call's {a.limit:.0f} s are spent)")
            continue
        log = out / f"{step}.log"
        t0 = time.monotonic()
        if step == "install":
            wheels_dir = Path(a.wheels)
            found = sorted(wheels_dir.glob("*.whl"))
            rc = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, found)], log, left) \
                if found else 2
            if not found:
                log.write_text(f"no wheels in {wheels_dir}\n")
        elif step == "env":
            _run(["nvidia-smi"], log, 30)
            rc = _run([sys.executable, "-c", ENV_CHECK], log, left)
        elif step == "gpu":
            rc = _run(_pytest(["-m", "gpu", "-v"]), log, left)
        elif step == "suite":
            rc = _run(_pytest(["-q", "-n", str(a.workers)]), log, left)
        elif step == "bench":
            work = Path(a.bench_dir)
            traces = work / "traces"
            rc = _run([sys.executable, "benchmarks/bench_gpu.py", "--rows", str(a.rows), "--dir", str(work),
                       "--out", str(out / "bench.md"), "--json", str(out / "bench.json"), "--details",
                       str(out / "bench-details.md"), "--trace", str(traces)], log, left)
            if traces.is_dir():
                with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
                    tar.add(traces, arcname="traces")
        else:
            raise SystemExit(f"unknown step {step!r}: install, env, gpu, suite or bench")
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        summary.append(f"{step}: exit {rc} in {time.monotonic() - t0:.0f} s | {tail[0][:200]}")
    print("\n".join(summary))
    return 0 if all(" exit 0 " in line for line in summary) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="here: download the test wheels the node lacks")
    w.add_argument("--out", default=".gpu-test-wheels")
    w.add_argument("--python", default="3.12", help="the node's Python version")
    w.add_argument("--have", default=None, help="a file of the node's packages (pip freeze); default: the lent node's")
    r = sub.add_parser("run", help="there: run steps of the GPU proof")
    r.add_argument("steps", nargs="+")
    r.add_argument("--out", default=None, help="log folder (default: $OUT, else gpu-node-logs/)")
    r.add_argument("--limit", type=float, default=570, help="seconds for all the steps of this call (default 570)")
    r.add_argument("--wheels", default=".gpu-test-wheels", help="the 'install' step's wheel folder")
    r.add_argument("--workers", type=int, default=8, help="pytest-xdist workers for 'suite'")
    r.add_argument("--rows", type=int, default=8_000_000, help="bench_gpu rows")
    r.add_argument("--bench-dir", default="/tmp/gpuload-bench", help="bench_gpu work folder (local disk)")
    a = ap.parse_args(argv)
    return wheels(a) if a.cmd == "wheels" else run(a)


if __name__ == "__main__":
    sys.exit(main())
