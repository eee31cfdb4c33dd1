"""Cached epochs striped over two cache folders against one folder, side by side.

A click log is cached once in one folder and once striped over two (``cache_dir=[a, b]``);
then cached epochs are read from each, alternating, with the chunk files' pages dropped
from the OS page cache before every epoch (``posix_fadvise(DONTNEED)``: the reads come from
the drive, where the filesystem honours it; tmpfs keeps its pages in memory by nature).
Rows/s are the median of ``--repeat`` epochs; the ratio is striped / one folder. On a
node with several NVMe drives, pass one folder per drive (``--one /nvme0/b --two
/nvme0/b:/nvme1/b``); by default both striped folders are on the work folder's disk, which
measures the overhead of striping, not a second drive's bandwidth.

    python benchmarks/bench_drives.py                         # 4M rows, 5 epochs each
    python benchmarks/bench_drives.py --two /tmp/a:/dev/shm/b --rows 1000000
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.synth import clicklog_columns, write_clicklog

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_step import publish  # noqa: E402


def drop_pages(folders) -> int:
    """Ask the OS to drop the cached pages of every chunk file under ``folders``; files seen."""
    n = 0
    for folder in folders:
        for p in pathlib.Path(folder).rglob("*.glc"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def epoch(ds) -> tuple[int, float]:
    """(rows, seconds) of one epoch, each batch's tensors summed (nobody reads a view for free)."""
    t0, rows = time.perf_counter(), 0
    for b in ds:
        for v in b.values():
            (v.values if isinstance(v, Ragged) else v).sum()
        rows += len(b["label"])
    return rows, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--repeat", type=int, default=5, help="cached epochs per layout; each figure is their median")
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--threads", type=int, default=4, help="loader threads (num_threads)")
    ap.add_argument("--one", help="the single cache folder (default: <dir>/one)")
    ap.add_argument("--two", help="the striped folders, separated by os.pathsep (default: <dir>/a and <dir>/b)")
    ap.add_argument("--dir", type=pathlib.Path, default=None)
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    a = ap.parse_args(argv)
    work = a.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-drives-"))
    data = work / "data"
    if not data.exists():
        write_clicklog(data, a.rows, files=8)
    layouts = {"one folder": [a.one or str(work / "one")],
               "two folders": (a.two.split(os.pathsep) if a.two else [str(work / "a"), str(work / "b")])}
    kw = dict(batch_size=a.batch, device="cpu", num_threads=a.threads)
    for folders in layouts.values():  # caches built and checked complete
        for f in folders:
            shutil.rmtree(f, ignore_errors=True)
        gpuload.build_cache(data, folders if len(folders) > 1 else folders[0], clicklog_columns(), progress=False)
    speeds: dict = {name: [] for name in layouts}
    for rep in range(a.repeat):
        for name, folders in layouts.items():
            ds = gpuload.ParquetDataset(data, clicklog_columns(), cache_dir=folders if len(folders) > 1 else folders[0],
                                        seed=rep, **kw)
            drop_pages(folders)
            rows, secs = epoch(ds)
            assert ds.reader.counters.decoded == 0, "the cache was not complete"
            speeds[name].append(rows / secs)
    one, two = (statistics.median(v) for v in speeds.values())
    lines = [f"\n## Cached epochs over two cache folders ({datetime.date.today()})\n",
             f"{a.rows:,} click-log rows, batch {a.batch:,}, {a.threads} loader threads, page cache dropped before "
             f"each epoch; median of {a.repeat}; {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, load average {os.getloadavg()[0]:.2f} at the end.\n",
             "| layout | folders | rows/s |", "|---|---|---:|",
             f"| one folder | {layouts['one folder'][0]} | {one:,.0f} |",
             f"| two folders | {', '.join(layouts['two folders'])} | {two:,.0f} |",
             f"\nstriped / one folder: **{two / one:.2f}x**\n"]
    publish("\n".join(lines), a.out, work, a.dir is None)


if __name__ == "__main__":
    sys.exit(main())
