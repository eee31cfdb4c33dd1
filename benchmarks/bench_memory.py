"""Host memory benchmark: peak RSS of the CPU path against ``ParquetDataset.host_bytes_bound``.

Each configuration runs in a fresh process: it imports numpy, pyarrow, torch and gpuload
(and s3fs for a remote source), notes its RSS (the baseline), opens the dataset, notes
the RSS again, then runs ``--epochs`` epochs (the first decodes into an empty cache, the
next read it) under a trivial step, sampling its RSS every 5 ms; the peak is the larger
of that and the kernel's high-water mark (``VmHWM``, which, unlike ``ru_maxrss``, does
not carry over the parent's peak through ``fork`` and ``exec``). Reported: the peak above the baseline, the peak
above the opened dataset (what the bound covers: the dataset's footers and plan, and what
the open-time checks read, come before it), and the bound.

Remote configurations read the same files from a loopback S3 server
(``gpuload.testing.S3Server``, moto) running in this, the parent, process, so that the
measured process holds only the client's side.

    python benchmarks/bench_memory.py                        # 4M rows; about 2 minutes on 2 cores
    python benchmarks/bench_memory.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

#: (name, remote, chunk MiB, other dataset settings)
CONFIGS = [
    ("local, 64 MiB chunks (defaults)", False, 64, {}),
    ("local, 16 MiB chunks", False, 16, {}),
    ("local, 4 MiB chunks, shuffle_window 2, prefetch 1", False, 4, {"shuffle_window": 2, "prefetch": 1}),
    ("local, 16 MiB chunks, shuffle=False", False, 16, {"shuffle": False}),
    ("local, 16 MiB chunks, 4 threads", False, 16, {"num_threads": 4}),
    ("remote (S3), 64 MiB chunks (defaults)", True, 64, {}),
    ("remote (S3), 16 MiB chunks, 128 MiB read-ahead", True, 16, {"remote": {"readahead_bytes": 128 << 20,
                                                                             "max_inflight_bytes": 64 << 20}}),
]

NOTE = ("The bound holds in every configuration. The first epoch decodes and peaks highest: its decode "
        "term (per loader thread a chunk's Arrow table, converted and packed arrays) adds to the windows "
        "and batches; cached epochs stay below it. A remote source adds its read-ahead and requests in "
        "flight (768 MiB by default: `remote={'readahead_bytes': ..., 'max_inflight_bytes': ...}` lowers "
        "them). Opening the dataset (footers, the plan, the null checks' reads) comes before the bound and is "
        "shown apart.")

CHILD = r"""
import json, sys, threading, time
import psutil
import numpy, pyarrow, torch
import gpuload
from gpuload.synth import clicklog_columns
spec = json.loads(sys.argv[1])
if spec["remote"]:
    import s3fs  # noqa: F401  (the client's import is part of the baseline)
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def sample():
    while not stop.wait(0.005):
        peak[0] = max(peak[0], proc.memory_info().rss)
threading.Thread(target=sample, daemon=True).start()
ds = gpuload.ParquetDataset(spec["source"], clicklog_columns(), cache_dir=spec["cache"], device="cpu",
                            chunk_bytes=int(spec["chunk_mib"] * 2**20), storage_options=spec.get("storage_options"),
                            **spec["kwargs"])
opened = proc.memory_info().rss
epochs = []
for e in range(spec["epochs"]):
    ds.set_epoch(e)
    t0 = time.perf_counter()
    n = sum(len(b["label"]) for b in ds)
    ds.reader.cache.flush()
    epochs.append(time.perf_counter() - t0)
    assert n == ds.num_rows
stop.set()
hwm = next((int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")), 0)
top = max(peak[0], hwm)
print(json.dumps({"base": base, "opened": opened, "peak": top, "bound": ds.host_bytes_bound,
                  "terms": vars(ds.reader.host_budget()), "chunks": len(ds.reader.chunks),
                  "max_chunk": ds.reader.max_chunk_bytes(), "epochs": epochs}))
"""


def run_one(spec: dict) -> dict:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{spec['name']}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    from bench_cpu import machine, mib, report  # the CPU benchmark's helpers
    from gpuload.synth import write_clicklog

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2, help="epochs per configuration (default 2: cold, then cached)")
    ap.add_argument("--only", help="run only the configurations whose name contains this")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Host memory' section gets the results")
    args = ap.parse_args(argv)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-memory-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    configs = [c for c in CONFIGS if args.only is None or args.only in c[0]]
    rows, results = [], []
    try:
        print(f"generating {args.rows:,} rows in {args.files} files under {work} ...", file=sys.stderr)
        files = write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=16384)
        server = None
        if any(c[1] for c in configs):
            from gpuload.testing import S3Server

            server = S3Server().__enter__()
            server.upload_folder(work / "data", "membench", "clicks/")
        try:
            for k, (name, remote, chunk_mib, kwargs) in enumerate(configs):
                print(f"{name} ...", file=sys.stderr)
                spec = {"name": name, "remote": remote, "chunk_mib": chunk_mib, "kwargs": kwargs,
                        "epochs": args.epochs, "cache": str(work / f"cache-{k}"),
                        "source": "s3://membench/clicks/" if remote else str(work / "data"),
                        "storage_options": server.storage_options if remote else None}
                got = run_one(spec)
                shutil.rmtree(work / f"cache-{k}", ignore_errors=True)
                results.append((name, got))
                over_base, over_open = got["peak"] - got["base"], got["peak"] - got["opened"]
                rows.append(f"| {name} | {got['max_chunk'] / 2**20:.1f} MiB x {got['chunks']} | "
                            f"{(got['opened'] - got['base']) / 2**20:,.0f} | {over_base / 2**20:,.0f} | "
                            f"{over_open / 2**20:,.0f} | {got['bound'] / 2**20:,.0f} | "
                            f"{over_open / got['bound']:.0%} | {'yes' if over_open <= got['bound'] else '**no**'} |")
        finally:
            if server is not None:
                server.__exit__(None, None, None)
        table = "\n".join(["| configuration | largest chunk x chunks | open, MiB | peak above imports, MiB | "
                           "peak above open, MiB | host_bytes_bound, MiB | of the bound | within |",
                           "|---|---|---:|---:|---:|---:|---:|---|", *rows])
        terms = "; ".join(f"{name}: " + ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in got["terms"].items() if v)
                          for name, got in results[:1] + [r for r in results if "remote" in r[0]][:1])
        info = {
            "machine": machine(),
            "dataset": f"{args.rows:,} rows, {args.files} Parquet files, {mib(files):.0f} MiB (bench_cpu.py's click "
                       "log, clicklog_columns()); batch_size 65,536, num_threads 2, device cpu unless said",
            "measure": f"RSS after the imports, after the open, and its peak over {args.epochs} epochs (cold, then "
                       "cached), each configuration in a fresh process",
            "bound terms (MiB)": terms,
            "epochs (s)": "; ".join(f"{n}: " + ", ".join(f"{s:.1f}" for s in g["epochs"]) for n, g in results),
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        report(table, info, args.out, "## Host memory", NOTE)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
