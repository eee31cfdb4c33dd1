"""Overhead of measuring: a warm gpuload epoch with its built-in metrics off, on, and under ``gpuload.watch``.

One run generates a click log, builds the cache, and then iterates a
``ParquetDataset`` (CPU, warm cache; shuffle off and on) in four ways, interleaved
within every repetition (their order rotates) so that drift and neighbours hit them
alike: with its built-in metrics turned off (the reference), with them on (the
default), under ``gpuload.watch`` (utilisation sampling on, the default), and under
``gpuload.watch(sample_util=False)``; each watched loader is made once and iterated once
per epoch, as a training script would. The consumer only counts rows, so any cost of
watching shows against the loader alone (the strictest case). It also times the
recording calls themselves (``Metrics.span``, ``record``, ``consumer_wait``,
``queue_depth``) and watch's cost per ``next()``, and relates that cost to the time of
one batch at the bare rate. Target: under 1% overhead for batches of 65,536 rows.

    python benchmarks/bench_overhead.py                 # 2M rows, about a minute on 2 cores
    python benchmarks/bench_overhead.py --rows 1000000 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog
from gpuload.observe.watch import _measure


def epochs_rows_per_s(make_iterable, epochs: int) -> float:
    """Rows/s of ``epochs`` passes over ``make_iterable(epoch)`` with a row-counting consumer."""
    rows, t0 = 0, time.perf_counter()
    for e in range(epochs):
        for batch in make_iterable(e):
            rows += len(batch["label"])
    return rows / (time.perf_counter() - t0)


def metrics_off(ds) -> None:
    """Turn a dataset's built-in metrics into no-ops (every stage shares the one Metrics object)."""
    m = ds.metrics

    class _Off:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    off = _Off()
    for name in ("record", "consumer_wait", "consumer_end", "queue_depth"):
        setattr(m, name, lambda *a, **k: None)
    m.span = lambda *a, **k: off


def loader_passes(ds, ds_off, epochs: int, repeat: int, base_epoch: int) -> dict[str, list[float]]:
    """Rows/s of each variant, ``repeat`` times, the variants interleaved in rotating order.

    ``ds`` records its built-in metrics (the default); ``ds_off`` is the same dataset with
    them turned off. Each watched variant wraps ``ds`` once and is iterated once per
    epoch, as a training script would (``loader = gpuload.watch(ds)`` before the loop)."""
    loaders = {"built-in metrics off": (ds_off, ds_off), "bare (built-in metrics on, the default)": (ds, ds),
               "watch": (ds, gpuload.watch(ds)), "watch, sample_util=False": (ds, gpuload.watch(ds, sample_util=False))}

    def epochs_of(dataset, loader):
        def make(e):
            dataset.set_epoch(base_epoch + e)
            return loader
        return make

    names = list(loaders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(epochs_rows_per_s(epochs_of(*loaders[name]), epochs))
    return out


def per_call_ns(fn, n: int = 200_000) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t0) / n * 1e9)
    return best


def recording_costs(batch: dict) -> dict[str, float]:
    """Nanoseconds per call of each recording entry point, and of watch per next()."""
    m = gpuload.Metrics(max_events=10**7)

    def spans(n):
        for _ in range(n):
            with m.span("batch", nbytes=1, rows=1):
                pass

    def records(n):
        for _ in range(n):
            m.record("h2d", 0.0, 0.0, nbytes=1)

    def waits(n):
        for _ in range(n):
            m.consumer_wait(0.0, 0.0, rows=1, nbytes=1)

    def depths(n):
        for _ in range(n):
            m.queue_depth(2)

    batches = [batch] * 100_000

    def bare(n):
        for _ in range(n // len(batches)):
            for _ in batches:
                pass

    def watched(n):
        for _ in range(n // len(batches)):
            for _ in gpuload.watch(batches, sample_util=False):
                pass

    costs = {"Metrics.span (enter + exit)": per_call_ns(spans), "Metrics.record": per_call_ns(records),
             "Metrics.consumer_wait": per_call_ns(waits), "Metrics.queue_depth": per_call_ns(depths),
             "_measure (rows and bytes of one batch)": per_call_ns(lambda n: [_measure(batch) for _ in range(n)])}
    costs["watch, per next() (minus a bare for loop)"] = per_call_ns(watched) - per_call_ns(bare)
    w = gpuload.watch([batch])  # sampler on: its pause and resume are part of every pass
    costs["watch, per pass of one batch (utilisation sampler resumed and paused)"] = per_call_ns(
        lambda n: [None for _ in range(n) for _ in w], 2000)
    return costs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=9, help="measurements per variant (default 9)")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-overhead-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        cols, bs = clicklog_columns(), args.batch_size
        say(f"generating {args.rows:,} rows under {work} and building the cache ...")
        write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=65536)
        gpuload.build_cache(work / "data", work / "cache", cols)
        rows_md = []
        for shuffle, epochs in ((False, 12), (True, 2)):
            ds, ds_off = (gpuload.ParquetDataset(work / "data", cols, batch_size=bs, shuffle=shuffle,
                                                 cache_dir=work / "cache", device="cpu") for _ in range(2))
            metrics_off(ds_off)
            for d in (ds, ds_off):
                epochs_rows_per_s(lambda e: d, 1)  # page cache and checksums: every variant starts warm
            say(f"shuffle={shuffle}: {args.repeat} x 4 variants of {epochs} epochs ...")
            res = loader_passes(ds, ds_off, epochs, args.repeat, base_epoch=1)
            off = res["built-in metrics off"]
            bare_best = max(off)
            for name, xs in res.items():
                paired = statistics.median(x / b for x, b in zip(xs, off))
                rows_md.append(f"| shuffle={shuffle} | {name} | {max(xs) / 1e6:.2f} M | "
                               f"{statistics.median(xs) / 1e6:.2f} M | {max(xs) / bare_best:.3f}x | {paired:.3f}x |")
            batch_ms = bs / bare_best * 1e3
            ds.reset_stats()
            rows_md.append(f"| shuffle={shuffle} | (one batch of {bs:,} rows at the best bare rate) | "
                           f"{batch_ms:.3f} ms | | | |")
        batch = next(iter(ds))
        costs = recording_costs(batch)
        per_next_us = costs["watch, per next() (minus a bare for loop)"] / 1e3
        print(f"## Overhead of gpuload's metrics and of gpuload.watch ({args.rows:,} rows, batch_size {bs:,}, warm cache, CPU)\n")
        print("| dataset | loop | best rows/s | median rows/s | best vs best metrics-off | median of paired ratios |")
        print("|---|---|---:|---:|---:|---:|")
        print("\n".join(rows_md))
        print(f"\nEach rows/s is one measurement of several epochs; best and median of {args.repeat}. Paired "
              "ratio: a variant against the metrics-off loop measured next to it in the same repetition. Ratios above "
              "1 are noise.\n")
        print("| recording call | ns per call |")
        print("|---|---:|")
        for name, ns in costs.items():
            print(f"| {name} | {ns:,.0f} |")
        print(f"\nwatch costs {per_next_us:.1f} us per batch: "
              + "; ".join(f"{per_next_us * 1e-6 / (bs / r):.3%} of a {bs:,}-row batch at {r / 1e6:.0f} M rows/s"
                          for r in (10e6, 80e6)))
        print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python "
              f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, gpuload "
              f"{gpuload.__version__}; runtime {time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at "
              f"start, {os.getloadavg()[0]:.2f} at end")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
