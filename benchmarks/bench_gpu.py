"""GPU benchmarks of gpuload, side by side in one run (ratios, not absolute seconds).

Measures, on one generated click log (cache on local disk):

1. cached epoch (device="cuda", batches on the GPU) against raw reads of the same cache
   files into device memory (GB/s ratio; target >= 0.8x): through pinned host memory
   (what gpuload does without GPUDirect Storage) and, where KvikIO is installed, with
   KvikIO;
2. cached epoch against the CPU path plus a host-to-device copy of every batch;
3. first epoch with cuDF decode against pyarrow decode plus copies (target >= 3x; only
   with cuDF: ``--decode cpu``, the default without pylibcudf, leaves it out);
4. a simulated training step of ``--step-ms`` on the GPU at batch 65536: the fraction
   of wall time the training thread waited for data (target < 5%), for a cached epoch
   and (no target; with cuDF) for a first epoch, whose decoding shares the GPU with the step.

``--grid 2:2,8:16`` also times cached epochs with each (``num_threads``, ``prefetch``) pair,
against the raw pinned reads: whether more cache reads in flight move a cached epoch.

``--quick`` measures only 1 and 4 (the cache filled by one first epoch): the short
bench of the first step on a GPU node with torch and CuPy alone (docs/gpu-testing.md).

Every gpuload pass also records where its time went, so a missed target can be
explained from the same run: ``--details FILE`` gets each pass's per-stage stats and
:func:`gpuload.diagnose` verdict, the KvikIO settings in effect, whether GPUDirect
Storage is available and how many chunks cuDF left to the CPU; ``--trace DIR`` writes a
Chrome trace (one track per loader thread, the training thread's waits) of the cold and
the cached pass, to open in https://ui.perfetto.dev.

Run on a GPU node (torch and CuPy; cuDF and KvikIO where installed)::

    python benchmarks/bench_gpu.py --rows 8000000 --dir /local/nvme/bench --out docs/benchmarks.md
    python benchmarks/bench_gpu.py --quick --rows 4000000 --json quick.json   # about a minute

Without a usable GPU it says why and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

import gpuload
import gpuload.gpu.runtime
from gpuload.cache.chunkfile import read_header, region_span
from gpuload.cache.directio import pread_all
from gpuload.synth import write_clicklog

COLUMNS = {"row_id": "row_id", "label": "label", "dense": [f"dense_{i}" for i in range(13)],
           "cats": [f"cat_{i}" for i in range(8)], "history": "history"}


def cache_spans(files) -> list[tuple[Path, int, int]]:
    """``(path, start, length)`` of the column regions of each cache file: what one read of it fetches."""
    spans = []
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            header, start = read_header(fd, p)
        finally:
            os.close(fd)
        spans.append((Path(p), start, region_span(header, start) - start))
    return spans


def _epoch(ds, epoch: int) -> tuple[float, int]:
    ds.set_epoch(epoch)
    t0 = time.perf_counter()
    rows = 0
    for b in ds:
        rows += len(b["row_id"])
    torch.cuda.synchronize()
    return time.perf_counter() - t0, rows


def _raw_kvikio(spans) -> tuple[float, int]:
    """Every cache file's regions read with one KvikIO pread each into one reused device buffer."""
    import cupy
    import kvikio

    buf = cupy.empty(max(s for _, _, s in spans), dtype=cupy.uint8)
    t0 = time.perf_counter()
    total = 0
    for p, start, span in spans:
        cf = kvikio.CuFile(p, "r")
        try:
            total += cf.pread(buf[:span], span, start).get()
        finally:
            cf.close()
    return time.perf_counter() - t0, total


def _raw_pinned(spans) -> tuple[float, int]:
    """Every cache file's regions read with ``preadv`` into pinned host memory and copied to one
    reused device buffer on a side stream: what gpuload does without GPUDirect Storage, with
    nothing else. Two host buffers take turns, so a read overlaps the previous copy."""
    size = max(s for _, _, s in spans)
    host = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    total = 0
    for k, (p, start, span) in enumerate(spans):
        buf, event = host[k % 2], copied[k % 2]
        event.synchronize()  # this buffer's previous copy is done (an event not recorded yet: at once)
        fd = os.open(p, os.O_RDONLY)
        try:
            total += pread_all(fd, buf.numpy()[:span], start)
        finally:
            os.close(fd)
        with torch.cuda.stream(stream):
            dev[:span].copy_(buf[:span], non_blocking=True)
            event.record(stream)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, total


def _warm_page_cache(files) -> None:
    """Read every file once, so that both sides of a comparison start from the page cache
    (this VM-like hosts drop idle file pages within a minute)."""
    for p in files:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def _host_plus_copy(data, cache, epoch, **kw) -> float:
    """The CPU path with a pageable host-to-device copy of every batch (what a CPU loader gives a GPU)."""
    ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cache, device="cpu", shuffle=True, **kw)
    ds.set_epoch(epoch)
    t0 = time.perf_counter()
    for b in ds:
        for v in b.values():
            (v.values if isinstance(v, gpuload.Ragged) else v).to("cuda", non_blocking=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ds.reader.cache.flush()  # its cache writes do not run into the next measurement
    return seconds


def _sleep_cycles_per_ms() -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / ((time.perf_counter() - t0) * 1e3)


def _starvation(ds, step_ms: float, epoch: int) -> tuple[float, float, float]:
    """(starvation, mean step ms, starvation after the first batch) of one epoch under a GPU step of
    ``step_ms``, from ``ds.stats()``. The last leaves out the pass's first ``next()`` (the loader's
    start: its first window read), which weighs much in a short epoch."""
    cycles = int(_sleep_cycles_per_ms() * step_ms)
    ds.set_epoch(epoch)
    ds.reset_stats()
    for b in ds:
        torch.cuda._sleep(cycles)  # the model's work, on the current stream
        b["dense"].sum().item()  # like loss.item(): the host waits for the step
    s = ds.stats()
    steady = (s.wait_s - s.first_wait_s) / (s.wall_s - s.first_wait_s) if s.wall_s > s.first_wait_s else 0.0
    return s.starvation, s.step_mean_s * 1e3, steady


class _Notes:
    """What each gpuload pass spent its time on (``--details``) and its trace (``--trace``)."""

    def __init__(self, trace_dir: str | None):
        self.lines: list[str] = []
        self.trace_dir = Path(trace_dir) if trace_dir else None

    def add(self, name: str, ds) -> None:
        s = ds.stats()
        self.lines += [f"## {name}", "", str(s), "", f"diagnose: {gpuload.diagnose(s)}", ""]
        decode = ds.reader.decode
        if hasattr(decode, "fallbacks"):
            self.lines.append(f"chunks decoded on the CPU because cuDF could not: {decode.fallbacks}\n")
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            ds.metrics.write_trace(self.trace_dir / f"{name.replace(' ', '_')}.json")


def dist_version(*names: str) -> str:
    """Version of the first installed distribution of ``names`` (e.g. the cu13 and cu12 wheels), or "-"."""
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return "-"


def _versions() -> str:
    dist = dist_version
    text = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"cupy {dist('cupy-cuda13x', 'cupy-cuda12x', 'cupy')}, "
            f"pylibcudf {dist('pylibcudf-cu13', 'pylibcudf-cu12', 'pylibcudf')}, "
            f"kvikio {dist('kvikio-cu13', 'kvikio-cu12', 'kvikio')}, driver {_driver()}")
    if not _has("kvikio"):
        return text + "; no KvikIO: cache reads through pinned memory"
    import kvikio
    import kvikio.cufile_driver

    try:
        gds = kvikio.cufile_driver.get("is_gds_available")
    except Exception as e:  # no cuFile library: compat mode only
        gds = f"unknown ({type(e).__name__})"
    return (text + f"; KvikIO compat mode {kvikio.defaults.get('compat_mode')}, "
            f"{kvikio.defaults.get('num_threads')} threads, GDS available: {gds}")


def _has(module: str) -> bool:
    """Whether ``module`` imports (pylibcudf, kvikio): what this run can measure."""
    try:
        __import__(module)
        return True
    except Exception:  # not installed, or broken: either way not measured
        return False


def parse_grid(text: str) -> tuple[tuple[int, int], ...]:
    """``"2:2,8:16"`` -> ``((2, 2), (8, 16))``: (num_threads, prefetch) pairs for ``--grid``."""
    pairs = []
    for item in filter(None, text.split(",")):
        threads, _, prefetch = item.partition(":")
        try:
            pair = int(threads), int(prefetch)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not num_threads:prefetch (two integers)") from None
        if pair[0] < 1 or pair[1] < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: num_threads must be >= 1 and prefetch >= 0")
        pairs.append(pair)
    return tuple(pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", choices=["auto", "gpu", "cpu"], default="auto",
                    help="first-epoch decode on the GPU: gpu (cuDF), cpu (pyarrow + copies), auto (cuDF if installed)")
    ap.add_argument("--threads", type=int, default=None,
                    help="num_threads of every gpuload pass, GPU and CPU alike (default: gpuload's)")
    ap.add_argument("--quick", action="store_true", help="only the cached epoch against raw reads, and starvation")
    ap.add_argument("--grid", type=parse_grid, default=(),
                    help="also time cached epochs with each num_threads:prefetch pair, e.g. 2:2,2:8,8:16 "
                         "(each against the raw pinned reads)")
    ap.add_argument("--dir", default=None, help="work folder on the local NVMe (default: a temporary one)")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    ap.add_argument("--details", default=None, help="write each pass's stage stats and diagnosis to this file")
    ap.add_argument("--trace", default=None, help="write Chrome traces of the cold and cached passes into this folder")
    a = ap.parse_args(argv)
    if not gpuload.gpu.runtime.gpu_usable():
        print("bench_gpu: no usable GPU here:", gpuload.gpu_status())
        return 2
    cudf = a.decode == "gpu" or (a.decode == "auto" and _has("pylibcudf"))
    decode = "gpu" if cudf else "cpu"

    work = Path(a.dir or tempfile.mkdtemp(prefix="gpuload-bench-"))
    data = work / "data"
    parquet = write_clicklog(data, a.rows, files=a.files)
    kw = dict(batch_size=a.batch, shuffle=True, seed=0)
    threads = {} if a.threads is None else {"num_threads": a.threads}
    kw.update(threads)
    notes = _Notes(a.trace)
    res = {}
    seconds: dict[str, list] = {}

    # 3. first epoch: cuDF decode vs pyarrow decode + copies (fresh cache each time, files in the page cache);
    # without cuDF once each, to fill the caches the cached epochs read (--quick: the GPU's only)
    cold_gpu, cold_cpu = [], []
    compare = cudf and not a.quick
    for r in range(a.repeat if compare else 1):
        for name, out in (("gpu", cold_gpu),) if a.quick else (("gpu", cold_gpu), ("cpu", cold_cpu)):
            cache = work / f"cold-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            _warm_page_cache(parquet)
            if name == "gpu":
                ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cache, device="cuda", decode=decode, **kw)
                out.append(_epoch(ds, 0)[0])
                if r == 0:
                    notes.add(f"first epoch, {'cuDF' if cudf else 'pyarrow'} decode", ds)
                ds.reader.cache.flush()
            else:
                out.append(_host_plus_copy(data, cache, 0, **threads))
    seconds.update(cold_gpu=cold_gpu, cold_cpu=cold_cpu)
    if compare:
        res["first epoch: cuDF decode vs pyarrow decode + H2D copies"] = (min(cold_cpu) / min(cold_gpu), ">= 3x")

    # 1./2. cached epochs
    cache = work / "cold-gpu"
    files = sorted(cache.rglob("*.glc"))
    spans = cache_spans(files)
    ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cache, device="cuda", **kw)
    _epoch(ds, 1)  # every file read once (verify-once) before timing
    warm = []
    for r in range(a.repeat):
        _warm_page_cache(files)
        ds.reset_stats()
        warm.append(_epoch(ds, 2 + r))
    notes.add("cached epoch", ds)
    region_bytes = sum(s for _, _, s in spans)
    gbps_gl = region_bytes / min(t for t, _ in warm) / 1e9
    gbps = {"gpuload": gbps_gl}
    raws = {"pinned": _raw_pinned, **({"kvikio": _raw_kvikio} if _has("kvikio") else {})}
    for name, read in raws.items():
        raw = []
        for _ in range(a.repeat):
            _warm_page_cache(files)
            raw.append(read(spans))
        gbps[name] = max(n / t for t, n in raw) / 1e9
        seconds[f"raw_{name}"] = [t for t, _ in raw]
        what = "pinned-memory reads" if name == "pinned" else "KvikIO reads"
        res[f"cached epoch vs raw {what} of the cache files (GB/s)"] = (gbps_gl / gbps[name], ">= 0.8x")
    seconds["warm"] = [t for t, _ in warm]
    for threads_n, prefetch in a.grid:  # how far more loads in flight move the cached epoch
        grid_kw = {**kw, "num_threads": threads_n, "prefetch": prefetch}
        ds_grid = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cache, device="cuda", **grid_kw)
        _epoch(ds_grid, 1)  # as above: its first read of each file checks it
        times = []
        for r in range(a.repeat):
            _warm_page_cache(files)
            times.append(_epoch(ds_grid, 2 + r)[0])
        ds_grid.close()
        seconds[f"warm_{threads_n}_{prefetch}"] = times
        res[f"cached epoch, num_threads={threads_n}, prefetch={prefetch}, vs raw pinned-memory reads"] = (
            region_bytes / min(times) / 1e9 / gbps["pinned"], "-")
    if not a.quick:
        host = []
        for r in range(a.repeat):
            _warm_page_cache(sorted((work / "cold-cpu").rglob("*.glc")))
            host.append(_host_plus_copy(data, work / "cold-cpu", 2 + r, **threads))
        seconds["host"] = host
        res["cached epoch vs CPU path + H2D copies"] = (min(host) / min(t for t, _ in warm), "> 1x")

    # 4. starvation at a few ms per step
    frac, step, steady = min((_starvation(ds, a.step_ms, 10 + r) for r in range(a.repeat)), key=lambda x: x[0])
    res[f"training thread waiting, {a.step_ms:g} ms GPU step, batch {a.batch}"] = (frac, "< 5%")
    res[f"training thread waiting after each epoch's first batch, {a.step_ms:g} ms GPU step"] = (steady, "-")
    notes.add(f"cached epoch under a {a.step_ms:g} ms step", ds)
    if cudf and not a.quick:
        # the first epoch under the same step: cuDF decodes on the loader stream, beside the step's kernels
        cold = work / "cold-step"
        shutil.rmtree(cold, ignore_errors=True)
        _warm_page_cache(parquet)
        ds_cold = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cold, device="cuda", decode="gpu", **kw)
        frac_cold, _, _ = _starvation(ds_cold, a.step_ms, 0)
        res[f"first epoch (cuDF decode): training thread waiting, {a.step_ms:g} ms GPU step"] = (frac_cold, "-")
        notes.add(f"first epoch under a {a.step_ms:g} ms step", ds_cold)
        ds_cold.reader.cache.flush()

    props = torch.cuda.get_device_properties(0)
    lines = [f"\n## GPU: {props.name}{' (quick)' if a.quick else ''}\n",
             f"{a.rows:,} rows in {a.files} files, {region_bytes / 2**30:.2f} GiB of cached columns, batch {a.batch}, "
             f"best of {a.repeat}, {a.threads or 'default'} loader threads. {_versions()}.\n",
             "| measurement | result | target |", "|---|---|---|"]
    for k, (v, target) in res.items():
        lines.append(f"| {k} | {v:.1%} |" if "waiting" in k else f"| {k} | {v:.2f}x |")
        lines[-1] += f" {target} |"
    raw_text = "; ".join(f"raw {k} {v:.1f} GB/s" for k, v in gbps.items() if k != "gpuload")
    cold_text = f"{min(cold_gpu):.2f} s ({'cuDF' if cudf else 'pyarrow + copies'})"
    if cold_cpu:
        cold_text += f" and {min(cold_cpu):.2f} s (CPU path + H2D copies)"
    lines.append(f"\ncached epoch {gbps_gl:.1f} GB/s; {raw_text}; first epoch {cold_text}; mean step {step:.2f} ms.")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": props.name, "rows": a.rows, "quick": a.quick, "decode": decode, "threads": a.threads,
                                            "cached_bytes": region_bytes, "results": res, "gbps": gbps,
                                            "starvation": frac, "starvation_after_first": steady, "step_ms": step, "versions": _versions(),
                                            "seconds": seconds}, indent=1))
    if a.details:
        Path(a.details).write_text("\n".join(notes.lines))
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        return os.environ.get("NVIDIA_DRIVER_VERSION", "unknown")


if __name__ == "__main__":
    sys.exit(main())
