"""Work done once at cache time (``transform=``, ``filters=``) against the same work in the training loop.

One process, one generated Criteo-format dataset (``gpuload.synth.write_criteo``: 13 integer
count columns with nulls, filled with 0), batch 65,536, no shuffle, a simulated training step
that copies each batch and sleeps ``--step-ms`` (default 2 ms), side by side in interleaved passes:

* **cached**: ``transform=gpuload.Transform(features)`` (log1p and bucketize of the 13 counts,
  stacked): computed once per chunk when the cache is built, then read from the cache;
* **in the loop**: the same dataset without a transform, the training loop calling
  ``features`` on every batch before its step (what users do today);
* **batch_transform**: the same function as ``batch_transform=``, on gpuload's producer
  thread (for work that must differ each epoch; here the same work, to show where it runs);
* **filtered**: ``filters=`` keeping the last 10% of rows (``row_id`` rises through the files,
  so the statistics exclude the other row groups), against **all rows, filtered in the loop**
  (the same rows kept by a mask on each batch).

Each row: cached-epoch rows/s, the training thread's time waiting inside ``next()`` and the
time it spent on that work itself, and the ratio to the same work done in the loop. The first epoch (the
build) is timed too.

    python benchmarks/bench_transform.py                 # 2M rows, best of 3, prints the table
    python benchmarks/bench_transform.py --rows 200000 --repeat 1
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

import torch

import gpuload
from gpuload.synth import write_criteo

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_step import measure, publish  # noqa: E402

EDGES = torch.tensor([0.5, 1.5, 3.5, 7.5, 15.5, 31.5, 63.5, 127.5, 255.5, 511.5, 1023.5])
COLUMNS = {"row_id": "row_id", "label": "label", "counts": [f"I{i}" for i in range(1, 14)]}


def features(o: dict) -> dict:
    """log1p and bucketize of the 13 counts (clipped at 0): the features of a DLRM-style model."""
    counts = o["counts"].to(torch.float32).clamp(min=0)
    return {"label": o["label"], "dense": torch.log1p(counts), "bucket": torch.bucketize(counts, EDGES.to(counts.device))}


def _epoch(ds, step_s: float, loop=None) -> tuple[float, float, float, int]:
    """(seconds, seconds waiting in next(), seconds in ``loop``, rows) of one epoch, ``loop(batch)``
    run on the training thread on each batch (None: nothing), the consumer copying each batch
    (:func:`bench_step.consume`) and sleeping ``step_s``."""
    spent = 0.0

    def batches():
        nonlocal spent
        for b in ds:
            if loop is not None:  # the training thread's own work: timed apart from the wait
                a = time.perf_counter()
                b = loop(b)
                spent += time.perf_counter() - a
            yield b

    rows, sec, waited = measure(batches(), step_s)
    return sec, waited - spent, spent, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved passes; each row keeps its best")
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    a = ap.parse_args(argv)
    work = a.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-cachetime-"))
    data = work / "criteo"
    if not data.exists():
        write_criteo(data, a.rows, files=4)
    step = a.step_ms / 1000
    kw = dict(batch_size=a.batch, shuffle=False, device="cpu", fill_nulls={f"I{i}": 0 for i in range(1, 14)})
    cut = int(a.rows * 0.9)

    def last_tenth(b):
        keep = b["row_id"] >= cut
        return {k: v[keep] for k, v in b.items()}

    modes = {  # name: (dataset keywords, work in the loop, the mode it is compared with)
        "cached (transform=)": (dict(transform=gpuload.Transform(features, key="bench-features-v1")), None,
                                "features in the loop"),
        "features in the loop": ({}, features, "features in the loop"),
        "batch_transform=": (dict(batch_transform=lambda b, g: features(b)), None, "features in the loop"),
        "filtered (filters=, 10% kept)": (dict(filters=[("row_id", ">=", cut)]), None, "all rows, filtered in the loop"),
        "all rows, filtered in the loop": ({}, last_tenth, "all rows, filtered in the loop")}
    first, best = {}, {}

    def run(m):
        extra, loop, _ = modes[m]
        ds = gpuload.ParquetDataset(data, COLUMNS, cache_dir=work / "cache" / str(list(modes).index(m)), **kw,
                                    **extra)
        return _epoch(ds, step, loop)

    for m in modes:  # the first epoch builds each mode's cache
        shutil.rmtree(work / "cache" / str(list(modes).index(m)), ignore_errors=True)
        first[m] = run(m)
    for _ in range(a.repeat):
        for m in modes:
            got = run(m)
            if m not in best or got[0] < best[m][0]:
                best[m] = got
    lines = [f"\n## Work at cache time ({datetime.date.today()})\n",
             f"{a.rows:,} Criteo-format rows; features: the 13 count columns (nulls filled with 0) -> log1p and "
             f"bucketize (11 edges); filter: the last 10% of rows by row_id; batch {a.batch:,}, no shuffle, a "
             f"consumer copying each batch and a {a.step_ms:g} ms step, best of {a.repeat} interleaved passes; "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.\n",
             "| mode | first epoch s | cached epoch rows/s | waiting in next() | work on the training thread "
             "| epoch vs the same in the loop |", "|---|---:|---:|---:|---:|---:|"]
    for m, (sec, waited, work_s, rows) in best.items():
        base = best[modes[m][2]][0]
        lines.append(f"| {m} | {first[m][0]:.2f} | {rows / sec / 1e6:.2f} M | {waited / sec:.1%} | "
                     f"{work_s:.3f} s | {base / sec:.2f}x |")
    publish("\n".join(lines) + "\n", a.out, work, a.dir is None)


if __name__ == "__main__":
    main()
