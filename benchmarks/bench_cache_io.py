"""First and cached epochs with the cache written and read around the page cache (``cache_io="direct"``)
against through it (``"buffered"``), side by side.

Each pass is a process of its own (so its CPU time is its own): an empty cache folder, the first epoch
(open, decode, convert, cache write, the last ``fsync``), then a cached epoch, under the consumer of
``bench_peers.py`` (``clone()`` of every tensor, then a sleep of ``--step-ms``). Passes alternate
between the two modes; each figure is the median of ``--repeat`` passes. CPU seconds are the
process's (every thread, user + system). "Resident" is the share of the cache files' pages in the page
cache after the first epoch. ``cache_io="auto"`` (the default) is direct, its reads turning buffered after
a pass they limited (:func:`gpuload.memory.cache_io_modes`); this benchmark forces each mode on one dataset.

    python benchmarks/bench_cache_io.py                       # 8M rows, 3 passes each
    python benchmarks/bench_cache_io.py --rows 1000000 --repeat 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
MODES = ("buffered", "direct")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _epoch(ds, step_s: float) -> dict:
    """One epoch under the consumer (bench_step's): seconds, CPU seconds, rows, seconds spent waiting."""
    from bench_step import measure

    c0 = _cpu()
    rows, seconds, waited = measure(ds, step_s)
    return {"s": seconds, "cpu_s": _cpu() - c0, "rows": rows, "wait": waited}


def _resident(folder: pathlib.Path) -> float:
    """Share of the chunk files' pages in the page cache."""
    from gpuload.cache.directio import resident_share

    sizes = [(p, p.stat().st_size) for p in folder.rglob("*.glc")]
    total = sum(s for _, s in sizes)
    return sum(resident_share(p) * s for p, s in sizes) / max(1, total)


def one_pass(a) -> dict:
    """A child process's pass: first epoch on an empty cache, then a cached one."""
    import torch

    import gpuload
    from gpuload.synth import clicklog_columns

    torch.set_num_threads(1)
    cache = pathlib.Path(a.cache)
    shutil.rmtree(cache, ignore_errors=True)
    t0, c0 = time.perf_counter(), _cpu()
    ds = gpuload.ParquetDataset(a.data, clicklog_columns(), batch_size=a.batch, cache_dir=cache, device="cpu",
                                cache_io=a.mode)
    opened = {"s": time.perf_counter() - t0, "cpu_s": _cpu() - c0}
    first = _epoch(ds, a.step_ms / 1e3)
    t1, c1 = time.perf_counter(), _cpu()
    ds.reader.cache.flush()
    first["s"] += opened["s"] + time.perf_counter() - t1
    first["cpu_s"] += opened["cpu_s"] + _cpu() - c1
    resident = _resident(cache)
    ds.set_epoch(1)
    cached = _epoch(ds, a.step_ms / 1e3)
    assert ds.reader.counters.decoded == len(ds.reader.chunks), "the cached epoch decoded Parquet"
    assert first["rows"] == cached["rows"] == ds.num_rows
    return {"mode": a.mode, "cache_io": ds.reader.cache_io, "first": first, "cached": cached,
            "resident": resident, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="passes per mode; each figure is their median")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child pass
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mode:
        print(json.dumps(one_pass(a)))
        return
    sys.path.insert(0, str(HERE.parent))
    from gpuload.synth import write_clicklog

    work = a.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-cache-io-"))
    data = work / "data"
    if not data.exists():
        write_clicklog(data, a.rows, files=8)
    load0 = os.getloadavg()[0]
    runs: dict = {m: [] for m in MODES}
    for _ in range(a.repeat):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--data", str(data), "--cache",
                                  str(work / "cache"), "--batch", str(a.batch), "--step-ms", str(a.step_ms)],
                                 check=True, capture_output=True, text=True, cwd=HERE.parent)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    shutil.rmtree(work / "cache", ignore_errors=True)

    def med(mode, epoch, what):
        return statistics.median(r[epoch][what] if epoch else r[what] for r in runs[mode])

    rows = runs[MODES[0]][0]["first"]["rows"]
    lines = [f"\n## Cache files around the page cache: cache_io (CPU, {datetime.date.today()})\n",
             f"{rows:,} click-log rows in 8 files, batch {a.batch:,}, a consumer that clones every tensor and "
             f"sleeps {a.step_ms:g} ms; first epoch = open + epoch on an empty cache + the last fsync; median of "
             f"{a.repeat} passes per mode, alternating, each a process of its own; {platform.machine()}, "
             f"{os.cpu_count()} cores, load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end.\n",
             "| cache_io | first epoch s | rows/s | CPU s | waiting | cache pages resident after | cached epoch s | "
             "rows/s | CPU s | waiting | peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODES:
        f_s, c_s = med(m, "first", "s"), med(m, "cached", "s")
        lines.append(f"| {m}{'' if all(r['cache_io'] == m for r in runs[m]) else ' (refused)'} | "
                     f"{f_s:.2f} | {rows / f_s / 1e6:.2f} M | {med(m, 'first', 'cpu_s'):.1f} | "
                     f"{med(m, 'first', 'wait') / f_s:.0%} | {med(m, None, 'resident'):.0%} | {c_s:.2f} | "
                     f"{rows / c_s / 1e6:.2f} M | {med(m, 'cached', 'cpu_s'):.1f} | {med(m, 'cached', 'wait') / c_s:.0%} "
                     f"| {med(m, None, 'peak_rss') / 2**30:.2f} GiB |")
    lines.append(f"\ndirect / buffered: first epoch **{med('buffered', 'first', 's') / med('direct', 'first', 's'):.2f}x** "
                 f"as fast, {med('direct', 'first', 'cpu_s') / med('buffered', 'first', 'cpu_s'):.2f}x the CPU; cached "
                 f"epoch {med('buffered', 'cached', 's') / med('direct', 'cached', 's'):.2f}x as fast.\n")
    from bench_step import publish

    publish("\n".join(lines), a.out, work, remove=a.dir is None)


if __name__ == "__main__":
    sys.exit(main())
