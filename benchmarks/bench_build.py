"""Build benchmark: ``build_cache`` serial against a Dask cluster, rows/s, side by side.

The same click log is converted into an empty cache folder by ``build_cache`` in this
process (its own decode threads) and by ``build_cache(client=...)`` on a
``distributed.LocalCluster`` of ``--workers`` worker processes (or, with ``--device
cuda``, a ``dask_cuda.LocalCUDACluster``: one worker per GPU, decoding with cuDF).
Passes alternate, each into a fresh folder; the Parquet files are read once before each
pass so they come from memory. The cluster starts once, outside the timed passes (its
start is reported apart).

    python benchmarks/bench_build.py                       # 4M rows, 2 workers
    python benchmarks/bench_build.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import machine, mib, report  # noqa: E402  (the CPU benchmark's helpers)


NOTE = ('On this 2-core VM a cluster has nothing to add: the serial build already keeps both cores busy, and '
        'the cluster adds a scheduler, a round trip per chunk and one listing of the source per worker. It pa'
        'ys where one process cannot use the machine: many cores, several nodes, one GPU per worker (dask-cud'
        'a). Not measured on a GPU machine yet.')


def read_files(files) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def start_cluster(workers: int, threads: int, device: str):
    import logging

    import distributed

    logging.getLogger("distributed").setLevel(logging.ERROR)
    if device.startswith("cuda"):
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(n_workers=workers, threads_per_worker=threads, dashboard_address=None)
    else:
        cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True,
                                           dashboard_address=None, silence_logs=logging.ERROR)
    return cluster, distributed.Client(cluster)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--chunk-mib", type=float, default=16, help="chunk size bound (default 16: 2 or more per file)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="decode threads per worker (default 1)")
    ap.add_argument("--serial-threads", type=int, default=2, help="decode threads of the serial build (default 2)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a dask-cuda cluster and cuDF decode")
    ap.add_argument("--repeat", type=int, default=3, help="passes per side; the median is kept (default 3)")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Cache builds' section gets the results")
    args = ap.parse_args(argv)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-build-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        print(f"generating {args.rows:,} rows in {args.files} files under {work} ...", file=sys.stderr)
        files = write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=65536)
        cols, chunk = clicklog_columns(), int(args.chunk_mib * 2**20)
        t0 = time.perf_counter()
        cluster, client = start_cluster(args.workers, args.threads, args.device)
        started = time.perf_counter() - t0
        serial, parallel, summary = [], [], None
        try:
            for i in range(args.repeat):
                for side in (("serial", "cluster") if i % 2 == 0 else ("cluster", "serial")):
                    cache = work / f"cache-{side}-{i}"
                    read_files(files)
                    t0 = time.perf_counter()
                    if side == "serial":
                        summary = gpuload.build_cache(files, cache, cols, chunk_bytes=chunk,
                                                      num_threads=args.serial_threads, device=args.device)
                        serial.append(time.perf_counter() - t0)
                    else:
                        gpuload.build_cache(files, cache, cols, chunk_bytes=chunk, num_threads=args.threads,
                                            device=args.device, client=client)
                        parallel.append(time.perf_counter() - t0)
                    shutil.rmtree(cache, ignore_errors=True)
        finally:
            client.close()
            cluster.close()
        s, p = statistics.median(serial), statistics.median(parallel)
        kind = "dask_cuda.LocalCUDACluster" if args.device.startswith("cuda") else "distributed.LocalCluster"
        table = "\n".join([
            "| build | rows/s | seconds | vs serial |", "|---|---:|---:|---:|",
            f"| serial `build_cache` ({args.serial_threads} decode threads) | {args.rows / s / 1e6:.2f} M | "
            f"{s:.2f} | 1.00x |",
            f"| `build_cache(client=...)`, {kind}, {args.workers} workers x {args.threads} thread | "
            f"{args.rows / p / 1e6:.2f} M | {p:.2f} | {s / p:.2f}x |"])
        info = {
            "machine": machine(),
            "dataset": (f"{args.rows:,} rows, {args.files} Parquet files, {mib(files):.0f} MiB; "
                        f"{summary.chunks} chunks of at most {args.chunk_mib:g} MiB; bench_cpu.py's click log "
                        f"outputs; device {args.device}"),
            "cluster start": f"{started:.1f} s (not in the timed passes)",
            "passes": f"serial {', '.join(f'{x:.2f}' for x in serial)} s; cluster "
                      f"{', '.join(f'{x:.2f}' for x in parallel)} s (median kept)",
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_build.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        report(table, info, args.out, "## Cache builds", NOTE)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
