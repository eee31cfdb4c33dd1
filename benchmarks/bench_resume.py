"""Resume benchmark: the time to the first batch after a restart, by where the epoch stood.

A restarted job opens the dataset again, restores the loader's state and takes its
first batch. With gpuload that costs what starting an epoch costs, wherever the state
was taken; a loader without state must replay the batches already seen (what
torchdata's ``StatefulDataLoader`` does for an ``IterableDataset`` that has no
``state_dict``). Both are measured side by side in one run on a full cache, by the
position of the state: the epoch's start, its middle, its last batch. The cache files
are read once just before each pass, so that they come from memory on this VM (which
pages out idle file pages).

    python benchmarks/bench_resume.py                       # 4M rows, prints the table
    python benchmarks/bench_resume.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import consume, machine, mib, report  # noqa: E402  (the CPU benchmark's helpers)


NOTE = ("A restore costs about what starting an epoch costs (open the dataset, load one shuffle window, cut a"
        " batch), wherever the state was taken: the state names the position, and only the window it falls in"
        " and those after it are read. Replaying to the position costs in proportion to it: at the last batch"
        ", a whole cached epoch (here 4M rows from memory; from disk, or with a first epoch still to decode, "
        "far more).")


def warm(cache: pathlib.Path) -> None:
    """Read every cache file once, so that the pass reads them from memory."""
    for f in cache.rglob("*.glc"):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


class Counting:
    """Counts the chunks a dataset loads."""

    def __init__(self, ds):
        self.n, load = 0, ds.reader.load

        def counted(i):
            self.n += 1
            return load(i)

        ds.reader.load = counted


def open_ds(files, cache, bs):
    return gpuload.ParquetDataset(files, clicklog_columns(), batch_size=bs, cache_dir=cache, device="cpu")


def resumed(files, cache, bs, state) -> tuple[float, int]:
    """(seconds to the first batch, chunks loaded) of a restart from ``state``: open, restore, next()."""
    t0 = time.perf_counter()
    ds = open_ds(files, cache, bs)
    count = Counting(ds)
    ds.load_state_dict(state)
    ds.set_epoch(state["epoch"])
    it = iter(ds)
    consume(next(it))
    t = time.perf_counter() - t0
    it.close()
    return t, count.n


def replayed(files, cache, bs, epoch, k) -> tuple[float, int]:
    """The same without a state: open, then skip the first ``k`` batches of the epoch."""
    t0 = time.perf_counter()
    ds = open_ds(files, cache, bs)
    count = Counting(ds)
    ds.set_epoch(epoch)
    it = iter(ds)
    for b in itertools.islice(it, k):
        consume(b)  # a replay yields each batch; the training loop only drops it
    consume(next(it))
    t = time.perf_counter() - t0
    it.close()
    return t, count.n


def state_at(files, cache, bs, epoch, k) -> dict:
    ds = open_ds(files, cache, bs)
    ds.set_epoch(epoch)
    it = iter(ds)
    for _ in itertools.islice(it, k):
        pass
    state = ds.state_dict()
    it.close()
    return state


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=3, help="passes per measurement; the median is kept (default 3)")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Resume' section gets the results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-resume-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        bs, epoch = args.batch_size, 1
        print(f"generating {args.rows:,} rows in {args.files} files under {work} ...", file=sys.stderr)
        files = write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=65536)
        cache = work / "cache"
        gpuload.build_cache(files, cache, clicklog_columns())
        ds = open_ds(files, cache, bs)
        k = len(ds)
        positions = {"start of the epoch (batch 0)": 0, f"middle (batch {k // 2})": k // 2,
                     f"last batch (batch {k - 1})": k - 1}
        states = {name: state_at(files, cache, bs, epoch, at) for name, at in positions.items()}
        rows = []
        for name, at in positions.items():
            g, r = [], []
            for i in range(args.repeat):  # interleaved, in turn first, each after a warm-up read of the cache
                for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                    gc.collect()
                    warm(cache)
                    if which == 0:
                        g.append(resumed(files, cache, bs, states[name]))
                    else:
                        r.append(replayed(files, cache, bs, epoch, at))
            rows.append((name, statistics.median(t for t, _ in g), g[0][1], statistics.median(t for t, _ in r),
                         r[0][1]))
        start = rows[0][1]
        lines = ["| state taken at | gpuload: open, restore, first batch | chunks loaded | "
                 "without a state: replay to it | chunks loaded | replay / gpuload | gpuload / epoch start |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for name, g, g_chunks, r, r_chunks in rows:
            lines.append(f"| {name} | {g:.3f} s | {g_chunks} | {r:.3f} s | {r_chunks} | {r / g:.1f}x "
                         f"| {g / start:.2f}x |")
        size = len(json.dumps(states[next(iter(states))]))
        chunks, windows = len(ds.reader.chunks), -(-len(ds.reader.chunks) // ds.options.shuffle_window)
        info = {
            "machine": machine(),
            "dataset": (f"{args.rows:,} rows, {args.files} Parquet files, {mib(files):.0f} MiB; cache {chunks} chunks "
                        f"({windows} shuffle windows of {ds.options.shuffle_window}), {k} batches of {bs:,} per "
                        f"epoch; outputs of bench_cpu.py's click log; epoch {epoch}, shuffled"),
            "what is timed": "a fresh ParquetDataset: open (footers and chunk list from the cache), "
                             "load_state_dict, set_epoch, next() and a sum over the batch; the replay opens, "
                             "set_epoch, takes and sums the batches before the position, then the next one",
            "chunks loaded": "by the time the first batch arrived, the loads started ahead (prefetch) included",
            "state": f"{size} bytes of JSON",
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_resume.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        table = "\n".join(lines)
        report(table, info, args.out, "## Resume", f"Median of {args.repeat} passes. {NOTE}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
