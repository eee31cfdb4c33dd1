"""diagnose()'s what-if estimate against applying it: predicted and measured waiting, side by side.

A click log is read under a simulated step (``--step-ms``, a sleep: a GPU step) with one loader
thread, first epoch (empty cache) and a cached one, as ``gpuload profile`` runs them. Each
epoch's diagnosis estimates the waiting with other settings (:mod:`gpuload.observe.whatif`); the
top estimate is then applied (a new dataset with its settings, or, for a warm cache, the
cache the first run built) and the same epoch measured again. One row per epoch: the waiting
measured, the change recommended, the waiting it predicted and the waiting measured with it.

    python benchmarks/bench_whatif.py                  # 2M rows, 3 passes (median)
    python benchmarks/bench_whatif.py --rows 200000 --repeat 1
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
from gpuload.synth import write_clicklog
from gpuload.tools.profile import profile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_step import publish  # noqa: E402

COLUMNS = {"label": "label", "dense": [f"dense_{i}" for i in range(13)], "cat": [f"cat_{i}" for i in range(8)],
           "history": "history"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="passes; each figure is their median")
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=16_384)
    ap.add_argument("--chunk-mib", type=int, default=8, help="chunk_bytes in MiB (small: many chunks, a short startup)")
    ap.add_argument("--dir", type=pathlib.Path, default=None)
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    a = ap.parse_args(argv)
    work = a.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-whatif-"))
    data = work / "data"
    if not data.exists():
        write_clicklog(data, a.rows, files=8)
    kw = dict(batch_size=a.batch, device="cpu", num_threads=1, chunk_bytes=a.chunk_mib << 20)
    rows = {0: [], 1: []}
    for rep in range(a.repeat):
        cache = work / f"cache{rep}"
        shutil.rmtree(cache, ignore_errors=True)
        reports = profile(data, COLUMNS, epochs=2, step_ms=a.step_ms, cache_dir=cache, **kw)
        for e, r in enumerate(reports):
            for k, best in enumerate(r.diagnosis.what_if or ()):  # every estimate, applied
                again = work / f"again{rep}-{e}-{k}"
                shutil.rmtree(again, ignore_errors=True)
                if best.settings:  # a setting: the same epoch again with it (a cached epoch: its own cache built first)
                    ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=again, **{**kw, **best.settings})
                    if e == 1:
                        for _ in ds:  # epoch 0 fills the cache these settings read
                            pass
                        ds.reset_stats()
                else:  # a warm cache: the first epoch on the cache the first run built
                    ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=cache, **kw)
                ds.set_epoch(e)
                for _ in ds:
                    time.sleep(a.step_ms / 1e3)
                rows[e].append((r.stats.starvation, best.change, best.starvation, ds.stats().starvation, k))
            if not r.diagnosis.what_if:
                rows[e].append((r.stats.starvation, "none", None, None, 0))
    lines = [f"\n## What-if estimates against applying them ({datetime.date.today()})\n",
             f"{a.rows:,} click-log rows, batch {a.batch:,}, chunks of {a.chunk_mib} MiB, a {a.step_ms:g} ms simulated step, one loader thread; "
             f"median of {a.repeat} passes; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"load average {os.getloadavg()[0]:.2f} at the end.\n",
             "| epoch | waiting measured | change (estimates best first) | waiting predicted | waiting measured "
             "with it |", "|---|---:|---|---:|---:|"]
    for e, got in rows.items():
        measured = statistics.median(g[0] for g in got)
        changes = list(dict.fromkeys(g[1] for g in sorted(got, key=lambda g: g[4])))
        for change in [c for c in changes if c != "none"] or ["none"]:
            same = [g for g in got if g[1] == change]
            pred = statistics.median(g[2] for g in same) if same[0][2] is not None else None
            lines.append(f"| {'first (empty cache)' if e == 0 else 'cached'} | {measured:.1%} | {change} | "
                         + (f"{pred:.1%} | {statistics.median(g[3] for g in same):.1%} |" if pred is not None
                            else "- | - |"))
    publish("\n".join(lines) + "\n", a.out, work, a.dir is None)


if __name__ == "__main__":
    sys.exit(main())
