#!/usr/bin/env python3
"""The GPU proof on a GPU node without network, in steps that each fit one short call.

docs/gpu-testing.md has the whole sequence, with each call's carry and expected duration.

First, with nothing carried (the node's torch and CuPy alone; no cuDF, RMM or KvikIO)::

    python3 benchmarks/gpu_node.py run proof            # about 4 minutes, stops by --limit (270 s)

``proof`` runs, each part with its own time cap and log: ``env`` (versions, the device,
``gpuload.gpu_status()``, and the first device use: a tensor through CuPy and DLPack and
back; the proof stops here, saying why, if it fails), ``identity`` (every type bit for bit
against pyarrow on the GPU with ``decode="cpu"``: 1 and 3 ranks, shuffled, lists, stacked
groups), ``memory`` (20 cached epochs with flat device memory), ``streams`` (a consumer
running kernels on two streams while batches arrive, every value checked), ``bench``
(``bench_gpu.py --quick``: cached epoch GB/s against raw pinned-memory reads, starvation at
a 4 ms step) and ``gpu`` (every other test marked ``gpu`` and not ``cudf``). It writes
``proof.log`` (the summary), ``proof-<part>.log`` and ``proof.json`` (pass, fail and skip
counts, seconds, the bench numbers, versions, device) to ``$OUT`` or ``--out``.
``--keep-going`` runs every part even when ``env`` failed (a rehearsal on a machine
without a GPU: each part then fails at its first device use).

Then the RAPIDS stack (cuDF's pylibcudf, RMM, KvikIO: ``../shared/gpu/bundle.py``) and the
test wheels the GPU tests of remote objects need; here, on a machine with PyPI::

    python benchmarks/gpu_node.py wheels --out .gpu-test-wheels     # 19 wheels, 28 MiB

and there, once the bundle is installed, any steps in order::

    python3 benchmarks/gpu_node.py run install env gpu --limit 150
    python3 benchmarks/gpu_node.py run bench suite --limit 180

Steps: ``install`` (the test wheels into the site folder), ``env`` (versions, the GPU,
``gpuload.gpu_status()``, KvikIO's settings and a one-file check that the CPU, cuDF and
pyarrow-plus-copy paths give the same batches), ``gpu`` (``pytest -m gpu -v``), ``bench``
(``benchmarks/bench_gpu.py``, 4M rows, with its details, JSON and traces), ``profile``
(``benchmarks/profile_threads.py`` at ``--rows``: each thread's time in a first epoch, decoded
by cuDF where it is installed, and in cached epochs), ``suite`` (every test not
marked ``gpu``, with a GPU present). Each but ``install`` and ``profile`` needs the RAPIDS stack (it says so in one line and
does not start without it) and runs under ``GPULOAD_REQUIRE_GPU=cudf``; ``proof`` needs only
torch and CuPy and runs under ``GPULOAD_REQUIRE_GPU=1``: a test that would skip for want of
what the step needs fails the step instead. Each writes ``<step>.log`` (and its results) to
``$OUT`` or ``--out`` (at most 8 files per call come back from the lent node), stops at its own
cap or at ``--limit`` seconds for the whole call, and the last lines sum up every step.
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

# What the test suite needs beyond gpuload's own dependencies and the gpu stack: "remote" for the
# GPU tests of remote objects (tests/sources/test_remote.py: an S3 server and s3fs) and the peers that
# benchmarks/gpu_peers.sh runs (torchdata), "all" for every test.
TEST_NEEDS = {"remote": ["moto[s3]>=5", "flask", "flask-cors", "s3fs>=2024.2", "torchdata>=0.8"],
              "all": ["moto[s3,server]>=5", "s3fs>=2024.2", "dask[distributed]>=2024.1", "torchdata>=0.8",
                      "hypothesis>=6", "werkzeug>=3", "aiohttp>=3.9"]}
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
                           "--report", str(report), "--target", str(out / ".resolve"), *common, *TEST_NEEDS[a.set]])
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
RAPIDS = ["pylibcudf", "rmm", "kvikio"]  # what the steps after `proof` need (the bundle installs them)
STEP_CAP = {"install": 60, "env": 60, "gpu": 180, "bench": 120, "profile": 120, "suite": 600}  # seconds, each at most


def _env(require: str = "cudf") -> dict:
    """The child processes' environment: the repository and the site folders on PYTHONPATH, and
    ``GPULOAD_REQUIRE_GPU`` (tests fail, not skip, where the step's GPU stack is not usable)."""
    env = dict(os.environ, GPULOAD_REQUIRE_GPU=require)
    env.pop("GPULOAD_REQUIRE_CUDF", None)
    paths = [str(ROOT)] + [str(s) for s in SITES if s.is_dir()] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], log: Path, seconds: float, require: str = "cudf") -> int:
    """Run ``cmd`` in the repository root with output appended to ``log``; 124 when it ran out of
    time (then it and every process it started are killed), 127 when it could not start."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(c if len(c) < 200 else c.strip().splitlines()[0] + " ..." for c in cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(require), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:  # no such program here
            f.write(f"[gpu_node] {e}\n")
            return 127
        try:
            return proc.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
            f.write(f"\n[gpu_node] stopped after {seconds:.0f} s\n")
            return 124


def _missing(modules: list[str], require: str = "cudf") -> str | None:
    """None if every module imports in the steps' environment, else one line naming the first that does not."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n" \
           "    except Exception as e:\n        sys.exit(f'{m}: {type(e).__name__}: {e}')"
    r = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, env=_env(require), capture_output=True,
                       text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


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
import pyarrow as pa, pyarrow.parquet as pq
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
import kvikio, kvikio.cufile_driver
print("kvikio compat mode", kvikio.defaults.get("compat_mode"), "threads", kvikio.defaults.get("num_threads"))
try:
    print("GDS available:", kvikio.cufile_driver.get("is_gds_available"))
except Exception as e:
    print("GDS available: unknown,", type(e).__name__, e)
ok = all(got == batches[("cpu", "auto", k[2])] for k, got in batches.items())
print("ENV OK" if ok else "ENV FAILED")
sys.exit(0 if ok else 1)
"""


def _pytest(extra: list[str], junit: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra"]
    if importlib.util.find_spec("pytest_timeout"):  # on the node: a hung test fails alone, not the whole call
        cmd += ["-o", "timeout=240"]
    if junit is not None:
        cmd += [f"--junitxml={junit}"]
    return cmd + extra


# -- proof: the first call, with nothing carried ---------------------------------------------
PROOF_ENV = r"""
import json, platform, subprocess, sys
import numpy as np, torch
sys.path.insert(0, "benchmarks")
from bench_gpu import dist_version as v

info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "numpy": np.__version__, "pyarrow": v("pyarrow"), "cupy": v("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "pylibcudf": v("pylibcudf-cu13", "pylibcudf-cu12"), "rmm": v("rmm-cu13", "rmm-cu12"),
        "kvikio": v("kvikio-cu13", "kvikio-cu12")}
try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip() or None
except OSError:
    info["driver"] = None
print("versions:", json.dumps(info))
import gpuload
from gpuload.gpu import runtime

status = gpuload.gpu_status()
print("gpu_status:", json.dumps(status))
try:  # the first device use: a tensor through CuPy and DLPack and back
    x = torch.arange(1 << 20, dtype=torch.int64, device="cuda")
    import cupy

    y = torch.from_dlpack(cupy.cumsum(cupy.from_dlpack(x)))
    assert int(y[-1]) == (1 << 20) * ((1 << 20) - 1) // 2, "cupy.cumsum of a torch tensor gave a wrong value"
    p = torch.cuda.get_device_properties(0)
    info["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
except BaseException as e:
    missing = "; ".join(f"{k}: {s}" for k, s in status.items() if s is not None and k in ("driver", "cupy"))
    print(f"PROOF STOP: the first device use failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
          + (f" ({missing})" if missing else ""))
    print("PROOF_INFO", json.dumps(info))
    sys.exit(3)
print("device:", info["device"])
if not runtime.gpu_usable():
    wants = "; ".join(f"{k}: {s}" for k, s in status.items() if s is not None)
    print(f"PROOF STOP: the device works, but gpuload.gpu.runtime.gpu_usable() is False ({wants}): this gpuload "
          "needs more than torch and CuPy for device='cuda'")
    print("PROOF_INFO", json.dumps(info))
    sys.exit(4)
print("PROOF_INFO", json.dumps(info))
print("ENV OK")
"""

_BUSY = "tests/gpu/test_runtime.py::test_batches_hold_still_under_a_busy_consumer"
_MEMORY = "tests/gpu/test_runtime.py::test_gpu_memory_is_bounded_and_does_not_grow"
_IDENTITY = "tests/test_equivalence.py::test_every_type_is_exact_on_every_device"
_NOT_CUDF = ["-m", "gpu and not cudf"]
# (part, what it proves, its cap in seconds, how: "env", "bench" or pytest arguments); the catch-all last
PROOF = [
    ("env", "versions, the device, gpu_status(); a tensor through CuPy and DLPack and back", 45, "env"),
    ("identity", "every type bit for bit against pyarrow on the GPU with decode='cpu': 1 and 3 ranks, shuffled "
                 "(rows, columns, blocks), ordered, lists and stacked groups, cold and cached", 75,
     [_IDENTITY, *_NOT_CUDF, "-v", "-n", "4"]),
    ("memory", "20 cached epochs: device memory flat, the bound held", 45, [_MEMORY, "-v"]),
    ("streams", "a consumer running kernels on two streams while batches arrive: every value checked", 45,
     [_BUSY, *_NOT_CUDF, "-v"]),
    ("bench", "bench_gpu.py --quick: cached epoch GB/s against raw pinned-memory reads, starvation at a 4 ms step",
     100, "bench"),
    ("gpu", "every other test marked gpu and not cudf", 90,
     ["tests", *_NOT_CUDF, "-v", "-n", "4", *(x for t in (_IDENTITY, _MEMORY, _BUSY) for x in ("--deselect", t))]),
]


def _junit_counts(path: Path) -> dict | None:
    """passed/failed/errors/skipped of a pytest run, from its JUnit XML (None: no report, e.g. a usage error)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    first = next((f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None), None)
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "first_failure": first}


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    stop = [line for line in lines if line.startswith(("PROOF STOP", "ERROR: ", "bench_gpu: "))]
    return (stop or lines or [""])[-1][:300]


def proof(a, out: Path) -> int:
    """The first call: every part of PROOF in turn; proof.log, proof-<part>.log, proof.json."""
    import tempfile

    t_start = time.monotonic()
    deadline = t_start + a.limit
    work = Path(tempfile.mkdtemp(prefix="gpuload-proof-"))
    summary = {"step": "proof", "ok": False, "stopped": None, "limit_s": a.limit, "parts": {}, "versions": None,
               "device": None, "bench": None}
    lines = []

    def say(text):
        lines.append(text)
        print(text, flush=True)

    for name, proves, cap, how in PROOF:
        left = deadline - time.monotonic() - 5
        part = {"proves": proves, "log": f"proof-{name}.log", "ok": False, "rc": None, "seconds": 0.0}
        summary["parts"][name] = part
        if summary["stopped"] and not a.keep_going:
            part["rc"] = "not run"
            say(f"proof {name}: not run (stopped at env)")
            continue
        if left <= 10:
            part["rc"] = "not run"
            say(f"proof {name}: not run (the call's {a.limit:.0f} s are spent)")
            continue
        log = out / part["log"]
        log.write_text(f"# {name}: {proves}\n")
        t0 = time.monotonic()
        if how == "env":
            _run(["nvidia-smi"], log, 30, require="1")
            rc = _run([sys.executable, "-c", PROOF_ENV], log, min(cap, left), require="1")
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("PROOF_INFO "):
                    info = json.loads(line[len("PROOF_INFO "):])
                    summary["versions"] = {k: v for k, v in info.items() if k != "device"}
                    summary["device"] = info.get("device")
            part["ok"] = rc == 0
        elif how == "bench":
            bench_json = work / "bench.json"
            rc = _run([sys.executable, "benchmarks/bench_gpu.py", "--quick", "--rows", str(a.proof_rows), "--repeat",
                       "3", "--dir", str(work / "bench"), "--json", str(bench_json)], log, min(cap, left), require="1")
            if bench_json.exists():
                summary["bench"] = json.loads(bench_json.read_text())
            part["ok"] = rc == 0 and summary["bench"] is not None
        else:
            junit = work / f"{name}.xml"
            rc = _run(_pytest(how, junit), log, min(cap, left), require="1")
            part["tests"] = _junit_counts(junit)
            t = part["tests"] or {}
            part["ok"] = rc == 0 and t.get("passed", 0) > 0
        part["rc"], part["seconds"] = rc, round(time.monotonic() - t0, 1)
        counts = part.get("tests")
        detail = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                  f"{counts['skipped']} skipped" if counts else _last_line(log))
        if counts and not part["ok"]:
            detail += f" | {counts['first_failure'] or _last_line(log)}"
        say(f"proof {name}: {'ok' if part['ok'] else 'FAILED'} (exit {rc}) in {part['seconds']:.0f} s | {detail}")
        if name == "env" and not part["ok"]:
            summary["stopped"] = _last_line(log).removeprefix("PROOF STOP: ")
    b = summary["bench"]
    if b:
        say(f"proof bench: cached epoch {b['gbps']['gpuload']:.1f} GB/s, raw pinned reads {b['gbps']['pinned']:.1f} "
            f"GB/s; training thread waiting {b['starvation']:.1%} at a {b['step_ms']:.1f} ms step")
    summary["ok"] = all(p["ok"] for p in summary["parts"].values())
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    if summary["ok"]:
        say(f"PROOF OK in {summary['seconds']:.0f} s")
    elif summary["stopped"]:
        say(f"PROOF STOPPED at env: {summary['stopped']}")
    else:
        say("PROOF FAILED: " + ", ".join(n for n, p in summary["parts"].items() if not p["ok"]))
    (out / "proof.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "proof.log").write_text("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["ok"] else 1


def run(a) -> int:
    out = Path(a.out or os.environ.get("OUT") or ROOT / "gpu-node-logs")
    out.mkdir(parents=True, exist_ok=True)
    if "proof" in a.steps:
        if a.steps != ["proof"]:
            raise SystemExit("'proof' is a call of its own: run it alone")
        return proof(a, out)
    deadline = time.monotonic() + a.limit
    summary: list[str] = []
    for step in a.steps:
        if step not in STEP_CAP:
            raise SystemExit(f"unknown step {step!r}: proof, install, env, gpu, bench, profile or suite")
    for step in a.steps:
        left = min(STEP_CAP[step], deadline - time.monotonic() - 5)
        if left <= 10:
            summary.append(f"{step}: not run (the call's {a.limit:.0f} s are spent)")
            continue
        log = out / f"{step}.log"
        t0 = time.monotonic()
        needs = None if step in ("install", "profile") else _missing(RAPIDS)
        if needs is not None:  # fail fast, in one line, before starting anything
            rc = 2
            log.write_text(f"{step} needs the RAPIDS stack (stage the bundle's loads and run its install.sh "
                           f"first): {needs}\n")
        elif step == "install":
            wheels_dir = Path(a.wheels)
            found = sorted(wheels_dir.glob("*.whl"))
            rc = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, found)], log, left) \
                if found else 2
            if not found:
                log.write_text(f"install needs the test wheels: no wheels in {wheels_dir} (carry it)\n")
        elif step == "env":
            _run(["nvidia-smi"], log, 30)
            rc = _run([sys.executable, "-c", ENV_CHECK], log, left)
        elif step == "gpu":
            rc = _run(_pytest(["-m", "gpu", "-v", "-n", "4"]), log, left)
        elif step == "profile":  # where each thread's time goes, first epoch (cuDF where installed) and cached
            rc = _run([sys.executable, "benchmarks/profile_threads.py", "--rows", str(a.rows), "--dir",
                       str(Path(a.bench_dir) / "profile")], log, left)
        elif step == "suite":
            # -v: each test's outcome is in the log as it ends, so a call stopped at its limit still names
            # its failures (with -q they are listed only at the end: 4 went unnamed on the H200, 2026-11-27)
            rc = _run(_pytest(["-v", "-m", "not gpu", "-n", str(a.workers)]), log, left)
        else:  # bench
            work = Path(a.bench_dir)
            traces = work / "traces"
            rc = _run([sys.executable, "benchmarks/bench_gpu.py", "--rows", str(a.rows), "--repeat", "2", "--dir",
                       str(work), "--out", str(out / "bench.md"), "--json", str(out / "bench.json"), "--details",
                       str(out / "bench-details.md"), "--trace", str(traces)], log, left)
            if traces.is_dir():
                with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
                    tar.add(traces, arcname="traces")
        summary.append(f"{step}: exit {rc} in {time.monotonic() - t0:.0f} s | {_last_line(log)[:200]}")
    print("\n".join(summary))
    return 0 if all(" exit 0 " in line for line in summary) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="here: download the test wheels the node lacks")
    w.add_argument("--out", default=".gpu-test-wheels")
    w.add_argument("--python", default="3.12", help="the node's Python version")
    w.add_argument("--have", default=None, help="a file of the node's packages (pip freeze); default: the lent node's")
    w.add_argument("--set", choices=sorted(TEST_NEEDS), default="remote",
                   help="remote: what the GPU tests of remote objects need (default); all: every test's")
    r = sub.add_parser("run", help="there: run steps of the GPU proof")
    r.add_argument("steps", nargs="+", help="proof (alone), or any of install, env, gpu, bench, profile, suite")
    r.add_argument("--out", default=None, help="log folder (default: $OUT, else gpu-node-logs/)")
    r.add_argument("--limit", type=float, default=None,
                   help="seconds for all the steps of this call (default: 270 for proof, else 570)")
    r.add_argument("--keep-going", action="store_true", help="proof: run every part even if env failed")
    r.add_argument("--proof-rows", type=int, default=4_000_000, help="proof: bench_gpu --quick rows")
    r.add_argument("--wheels", default=".gpu-test-wheels", help="the 'install' step's wheel folder")
    r.add_argument("--workers", type=int, default=12, help="pytest-xdist workers for 'suite'")
    r.add_argument("--rows", type=int, default=4_000_000, help="bench_gpu rows")
    r.add_argument("--bench-dir", default="/tmp/gpuload-bench", help="bench_gpu work folder (local disk)")
    a = ap.parse_args(argv)
    if a.cmd == "wheels":
        return wheels(a)
    if a.limit is None:
        a.limit = 270.0 if a.steps == ["proof"] else 570.0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
