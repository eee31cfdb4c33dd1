"""The same rows in a few large Parquet files and in many small ones (what a Spark job with many
partitions writes), side by side: ``pq.read_table``, gpuload's open, its first epoch and a cached one,
and a restart (the dataset opened again with every chunk cached, up to its first batch).

gpuload caches a chunk per run of row groups of one file, so a small file is a chunk of its own:
each costs a footer, a cache file with its fsync and rename, and a load per epoch. Each pass is a
process of its own (the files read alternate between the two layouts); every figure is the median
of ``--repeat`` passes. The consumer is ``bench_peers.py``'s (``clone()`` of every tensor, then a
sleep of ``--step-ms``). "Limited by" is what ``gpuload.diagnose`` says of the first epoch.

    python benchmarks/bench_small_files.py                        # 2M rows: 4 files and 400
    python benchmarks/bench_small_files.py --files 8,1000 --repeat 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's gpuload, in the passes' processes too


def one_pass(a) -> dict:
    """A child process's pass over ``a.data``: read_table, then open, first and cached epoch."""
    import pyarrow.parquet as pq
    import torch

    import gpuload
    from bench_step import measure
    from gpuload.synth import clicklog_columns

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    table = pq.read_table(a.data)
    read_s = time.perf_counter() - t0
    del table
    cache = pathlib.Path(a.cache)
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    ds = gpuload.ParquetDataset(a.data, clicklog_columns(), batch_size=a.batch, cache_dir=cache, device="cpu")
    open_s = time.perf_counter() - t0
    rows, first_s, first_wait = measure(ds, a.step_ms / 1e3)
    t1 = time.perf_counter()
    ds.reader.cache.flush()
    first_s += open_s + time.perf_counter() - t1
    d = gpuload.diagnose(ds.stats())
    limited = f"{d.limiting}: {d.message.split(';')[0]}"
    ds.set_epoch(1)
    rows2, cached_s, cached_wait = measure(ds, a.step_ms / 1e3)
    assert rows == rows2 == ds.num_rows and ds.reader.counters.decoded == len(ds.reader.chunks)
    chunks = len(ds.reader.chunks)
    ds.close()
    t0 = time.perf_counter()  # a restart: the whole dataset cached, opened again up to its first batch
    ds = gpuload.ParquetDataset(a.data, clicklog_columns(), batch_size=a.batch, cache_dir=cache, device="cpu")
    reopen_s = time.perf_counter() - t0
    next(iter(ds))
    restart_s = time.perf_counter() - t0
    assert ds.reader.counters.decoded == 0 and len(ds.reader.cached_at_open) == chunks
    out = {"files": len(list(pathlib.Path(a.data).glob("*.parquet"))), "chunks": chunks,
           "rows": rows, "read_s": read_s, "open_s": open_s, "first_s": first_s, "first_wait": first_wait,
           "cached_s": cached_s, "cached_wait": cached_wait, "limited": limited, "reopen_s": reopen_s,
           "restart_s": restart_s}
    ds.close()
    shutil.rmtree(cache, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", default="4,400", help="file counts to compare, comma-separated (default 4,400)")
    ap.add_argument("--repeat", type=int, default=3, help="passes per layout; each figure is their median")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    ap.add_argument("--data", help=argparse.SUPPRESS)  # a child pass
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.data:
        print(json.dumps(one_pass(a)))
        return 0
    from gpuload.synth import write_clicklog

    counts = [int(f) for f in a.files.split(",")]
    if len(counts) < 2 or min(counts) < 1:
        ap.error(f"--files {a.files}: give two or more file counts of at least 1, e.g. --files 4,400")
    work = a.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-small-files-"))
    data = {n: work / f"rows{a.rows}-files{n}" for n in counts}  # a --dir kept for another --rows: other files
    for n in counts:
        if not data[n].exists():
            write_clicklog(data[n], a.rows, files=n)
    load0 = os.getloadavg()[0]
    runs: dict = {n: [] for n in counts}
    for _ in range(a.repeat):
        for n in counts:
            out = subprocess.run([sys.executable, __file__, "--data", str(data[n]), "--cache",
                                  str(work / "cache"), "--batch", str(a.batch), "--step-ms", str(a.step_ms)],
                                 capture_output=True, text=True, cwd=HERE.parent)
            if out.returncode:
                sys.exit(f"bench_small_files: the pass over {n} files failed (exit {out.returncode}):\n"
                         + out.stderr[-3000:])
            runs[n].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def med(n, what):
        return statistics.median(r[what] for r in runs[n])

    rows = runs[counts[0]][0]["rows"]
    lines = [f"\n## Many small files (CPU, {datetime.date.today()})\n",
             f"{rows:,} click-log rows written as {' and as '.join(str(n) for n in counts)} files, batch {a.batch:,}, "
             f"a consumer that clones every tensor and sleeps {a.step_ms:g} ms; first epoch = open + epoch on an "
             f"empty cache + the last fsync; median of {a.repeat} passes per layout, alternating, each a process of "
             f"its own; {platform.machine()}, {os.cpu_count()} cores, load average {load0:.2f} at the start, "
             f"{os.getloadavg()[0]:.2f} at the end.\n",
             "| files | rows a file | chunks | pq.read_table s | open s | first epoch s | rows/s | waiting | "
             f"cached epoch s | rows/s | restart: open s, first batch s | first epoch vs {counts[0]} files | "
             "limited by (first epoch) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in counts:
        f_s, c_s = med(n, "first_s"), med(n, "cached_s")
        lines.append(f"| {n:,} | {rows // n:,} | {runs[n][0]['chunks']:,} | {med(n, 'read_s'):.2f} | "
                     f"{med(n, 'open_s'):.2f} | {f_s:.2f} | {rows / f_s / 1e6:.2f} M | {med(n, 'first_wait') / f_s:.0%} "
                     f"| {c_s:.2f} | {rows / c_s / 1e6:.2f} M | {med(n, 'reopen_s'):.2f}, {med(n, 'restart_s'):.2f} | "
                     f"{f_s / med(counts[0], 'first_s'):.2f}x | "
                     f"{runs[n][-1]['limited']} |")
    from bench_step import publish

    publish("\n".join(lines) + "\n", a.out, work, remove=a.dir is None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
