"""Categorical features on the CPU: Criteo-format data end to end, and the hashing rate.

One process, one generated dataset (``gpuload.synth.write_criteo``: 13 integer columns
with nulls, 26 hexadecimal string columns with nulls, a label), side by side:

* the hashing rate of one string column already in memory: gpuload's vectorised XXH64
  (``gpuload.categorical.hash_ids``), the same hash value by value with the ``xxhash``
  package (what a hand-written loop does), and pandas' own vectorised hash
  (``pd.util.hash_array``); decoding that column from Parquet beside them;
* epochs of the whole dataset, batch 65,536: gpuload's first epoch (hash and cache; and with
  counted vocabularies, the counting pass included), its cached epoch, and the pipeline a
  user would write instead (per row group: pyarrow ->
  pandas, ``hash_array`` of each string column modulo the buckets, ints filled, torch),
  which does all that work again every epoch (its ids differ: pandas hashes with SipHash);
* the cache's size against the Parquet files'.

    python benchmarks/bench_categorical.py                  # 2M rows, prints the table
    python benchmarks/bench_categorical.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shutil
import tempfile
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash

import gpuload
from gpuload.categorical import hash_ids
from gpuload.synth import criteo_columns, write_criteo

BUCKETS = 2**22


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def hashing_rates(files, repeat: int) -> dict:
    """Values per second of each way to hash column C1 (nulls included), and of decoding it."""
    col = pq.read_table(files, columns=["C1"]).column("C1").cast(pa.string()).combine_chunks()
    n = len(col)
    enc = gpuload.Hash(BUCKETS)
    want = hash_ids(col, enc)

    def loop():  # from the Arrow column, value by value (its Python strings made on the way)
        return np.array([0 if v is None else 1 + xxhash.xxh64_intdigest(v.encode()) % BUCKETS
                         for v in col.to_pylist()], np.int64)

    assert np.array_equal(loop(), want)  # the reference, value by value
    series = pd.Series(col.to_pandas())
    out = {
        "gpuload vectorised XXH64": n / _best(lambda: hash_ids(col, enc), repeat),
        "xxhash package, value by value (from Arrow)": n / _best(loop, 1),
        "pandas hash_array (SipHash, vectorised)": n / _best(
            lambda: pd.util.hash_array(series.fillna("").to_numpy(object)), repeat),
        "decoding the column (pq.read_table)": n / _best(lambda: pq.read_table(files, columns=["C1"]), repeat),
    }
    return out


def user_pipeline(files, batch: int):
    """What a user writes without gpuload: per row group, pyarrow -> pandas, hash each string
    column (pandas' vectorised hash, modulo the buckets; null 0), fill the ints, to torch."""
    cols = criteo_columns()
    for f in files:
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            df = pf.read_row_group(g, columns=["label", *cols["ints"], *cols["cats"]]).to_pandas()
            ints = torch.from_numpy(df[cols["ints"]].fillna(0).to_numpy(np.int32))
            cats = np.empty((len(df), len(cols["cats"])), np.int64)
            for j, c in enumerate(cols["cats"]):
                s = df[c]
                h = pd.util.hash_array(s.fillna("").to_numpy(object))
                cats[:, j] = np.where(s.isna().to_numpy(), 0, (h % np.uint64(BUCKETS)).astype(np.int64) + 1)
            label = torch.from_numpy(df["label"].to_numpy())
            cats = torch.from_numpy(cats)
            for s in range(0, len(df), batch):
                yield {"label": label[s:s + batch], "ints": ints[s:s + batch], "cats": cats[s:s + batch]}


def _epoch(batches) -> tuple[int, float]:
    t0, rows = time.perf_counter(), 0
    for b in batches:
        b["cats"].sum()
        rows += len(b["label"])
    return rows, time.perf_counter() - t0


def epochs(files, data: pathlib.Path, work: pathlib.Path, batch: int, repeat: int) -> dict:
    kw = dict(columns=criteo_columns(), fill_nulls=0, batch_size=batch, device="cpu", shuffle=False)
    out = {}
    for name, enc in (("first", gpuload.Hash(BUCKETS)), ("vocab", gpuload.Vocab(min_count=2))):
        times, opens = [], []
        for r in range(repeat):
            cache = work / f"cache-{name}-{r}"
            shutil.rmtree(cache, ignore_errors=True)
            t0 = time.perf_counter()
            ds = gpuload.ParquetDataset(data, cache_dir=cache, categorical=enc, **kw)  # Vocab: counts all 26 here
            opens.append(time.perf_counter() - t0)
            rows, t = _epoch(ds)
            ds.reader.cache.flush()
            times.append(opens[-1] + t)
        out[name], out[f"{name}_open"] = min(times), min(opens)
        if name == "first":
            out["cached"] = min(_epoch(ds)[1] for _ in range(repeat))
            cache_bytes = sum(p.stat().st_size for p in (work / "cache-first-0").rglob("*") if p.is_file())
        else:
            out["vocab_sizes"] = [len(ds.vocabulary(c)) for c in criteo_columns()["cats"]]
    out["user"] = min(_epoch(user_pipeline(files, batch))[1] for _ in range(repeat))
    return {**out, "rows": rows, "cache_bytes": cache_bytes, "parquet_bytes": sum(os.path.getsize(f) for f in files)}


def table(rates: dict, ep: dict, args) -> str:
    rows = ep["rows"]
    lines = ["\n## Categorical features (CPU)\n",
             f"{rows:,} Criteo-format rows (`gpuload.synth.write_criteo`: 13 int32 columns, 26 hex-string columns, "
             f"both with nulls) in {args.files} snappy files; `gpuload.Hash(buckets=2**22)` on every string column, "
             f"batch {args.batch:,}, no shuffle, best of {args.repeat}; {platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, pyarrow {pa.__version__}, pandas {pd.__version__}; "
             f"{datetime.date.today().isoformat()}.\n",
             "| hashing one string column (C1, in memory) | values/s | vs gpuload |", "|---|---:|---:|"]
    base = rates["gpuload vectorised XXH64"]
    for k, v in rates.items():
        lines.append(f"| {k} | {v / 1e6:.1f} M | {v / base:.2f}x |")
    lines += ["", "| epoch of every column | seconds | rows/s | vs the user's pipeline |", "|---|---:|---:|---:|"]
    for name, key in (("gpuload, first epoch with `Hash` (open, hash, convert, cache)", "first"),
                      ("gpuload, first epoch with `Vocab(min_count=2)` (open and count 26 columns, convert, cache)",
                       "vocab"),
                      ("gpuload, cached epoch", "cached"),
                      ("user's pipeline (pyarrow -> pandas hash -> torch), every epoch", "user")):
        lines.append(f"| {name} | {ep[key]:.2f} | {rows / ep[key] / 1e6:.2f} M | {ep['user'] / ep[key]:.2f}x |")
    sizes = ep["vocab_sizes"]
    lines.append(f"\nThe vocabulary pass (opening with `Vocab`: every value of the 26 string columns counted, "
                 f"{26 * rows:,} values, nulls included) took {ep['vocab_open']:.2f} s against {ep['first_open']:.2f} s "
                 f"to open with `Hash` ({26 * rows / max(ep['vocab_open'] - ep['first_open'], 1e-9) / 1e6:.1f} M values/s "
                 f"counted); vocabularies of {min(sizes):,} to {max(sizes):,} values.")
    lines.append(f"\nCache {ep['cache_bytes'] / 2**20:.0f} MiB against {ep['parquet_bytes'] / 2**20:.0f} MiB of "
                 f"Parquet ({ep['cache_bytes'] / ep['parquet_bytes']:.2f}x): 26 int64 ids and 13 int32 per row, "
                 "uncompressed, against dictionary-encoded, compressed strings.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=pathlib.Path, help="work folder (default: a temporary one, removed after)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to which the table is appended")
    args = ap.parse_args(argv)
    work = args.dir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-cat-"))
    try:
        data = work / "criteo"
        files = sorted(data.glob("*.parquet")) or write_criteo(data, args.rows, files=args.files)
        rates = hashing_rates(files, args.repeat)
        ep = epochs(files, data, work, args.batch, args.repeat)
        text = table(rates, ep, args)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
