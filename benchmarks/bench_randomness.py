"""Randomness benchmark: what block shuffling gives up against the full row shuffle.

A dataset sorted by label (the worst case for a windowed shuffle: every chunk holds one
label), and the same labels in random order, cut into chunks of about the rows the step benchmark's 64 MiB chunks hold, read
with each shuffle mode. For each mode:

* label balance: the standard deviation of the fraction of positives per batch, against
  a uniform shuffle of the whole dataset (binomial: ``sqrt(p (1 - p) / batch)``);
* pair co-occurrence: of the pairs of rows that share a batch in epoch 0, the fraction
  that share one again in epoch 1 (a uniform shuffle: about ``batch / rows``), and its
  ratio to the full row shuffle's;
* chunks per batch: how many chunks a batch's rows come from (median).

    python benchmarks/bench_randomness.py                          # prints the table
    python benchmarks/bench_randomness.py --out docs/benchmarks.md  # also rewrites its section there
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import gpuload

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_cpu import replace_section, say  # noqa: E402


def write_labels(folder: pathlib.Path, rows: int, positives: float, files: int, sort: bool) -> list[pathlib.Path]:
    """``rows`` rows in ``files`` files, a ``positives`` share labelled 1: sorted (label 0 first, then 1),
    or in random order."""
    folder.mkdir(parents=True, exist_ok=True)
    ones = int(rows * positives)
    label = (np.arange(rows) >= rows - ones).astype(np.int8)
    if not sort:
        label = np.random.default_rng(0).permutation(label)
    out = []
    for f, ids in enumerate(np.array_split(np.arange(rows, dtype=np.int64), files)):
        t = pa.table({"row_id": ids, "label": label[ids]})
        path = folder / f"part-{f:03d}.parquet"
        pq.write_table(t, path, row_group_size=65536)
        out.append(path)
    return out


def co_occurrence(b0: np.ndarray, b1: np.ndarray) -> float:
    """Of the row pairs sharing a batch in epoch 0 (batch ids ``b0``), the share that also shares one
    in epoch 1 (``b1``)."""
    def pairs(keys):
        _, c = np.unique(keys, return_counts=True)
        return float((c * (c - 1) // 2).sum())
    return pairs(b0 * (b1.max() + 1) + b1) / pairs(b0)


def measure(files, cache: pathlib.Path, bs: int, chunk_bytes: int, **kw) -> dict:
    ds = gpuload.ParquetDataset(files, {"row_id": "row_id", "label": "label"}, batch_size=bs, cache_dir=cache,
                                device="cpu", chunk_bytes=chunk_bytes, **kw)
    starts = np.cumsum([0] + [c.rows for c in ds.reader.chunks])
    batch_of, fractions, chunks = [], [], []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        b = np.empty(ds.num_rows, np.int64)
        for i, batch in enumerate(ds):
            ids = batch["row_id"].numpy()
            b[ids] = i
            if epoch == 0:
                fractions.append(float(batch["label"].numpy().mean()))
                chunks.append(len(np.unique(np.searchsorted(starts, ids, side="right"))))
        batch_of.append(b)
    return {"std": float(np.std(fractions)), "co": co_occurrence(*batch_of), "chunks": float(np.median(chunks)),
            "nchunks": len(ds.reader.chunks)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--chunk-rows", type=int, default=190_000,
                    help="rows per chunk, about what 64 MiB chunks of the step benchmark's rows hold")
    ap.add_argument("--positives", type=float, default=0.25)
    ap.add_argument("--blocks", default="64,256,1024,4096")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpuload-rand-"))
    try:
        chunk_bytes = args.chunk_rows * 9  # int64 + int8 per row
        bs, p = args.batch_size, args.positives
        modes = [("full row shuffle (default)", dict(shuffle=True))]
        modes += [(f"shuffle='block', block_rows={b}", dict(shuffle="block", block_rows=int(b)))
                  for b in args.blocks.split(",")]
        uniform_std, uniform_co = np.sqrt(p * (1 - p) / bs), (bs - 1) / (args.rows - 1)
        tables = []
        for sort in (True, False):
            files = write_labels(work / f"data{sort}", args.rows, p, 8, sort)
            got = {}
            for name, kw in modes:
                say(f"{'sorted' if sort else 'random'} labels: {name} ...")
                got[name] = measure(files, work / f"cache{sort}", bs, chunk_bytes, **kw)
            full = got[modes[0][0]]["co"]
            lines = [f"| mode ({'sorted by label' if sort else 'labels in random order'}) | label share per "
                     "batch: std | vs uniform | pairs sharing a batch again next epoch | vs full row shuffle "
                     "| chunks per batch (median) |", "|---|---:|---:|---:|---:|---:|"]
            lines.append(f"| uniform shuffle of the whole dataset (reference) | {uniform_std:.4f} | 1.0x | "
                         f"{uniform_co:.3%} | | |")
            for name, _ in modes:
                g = got[name]
                lines.append(f"| {name} | {g['std']:.4f} | {g['std'] / uniform_std:.1f}x | {g['co']:.3%} | "
                             f"{g['co'] / full:.1f}x | {g['chunks']:g} |")
            tables.append("\n".join(lines))
        table = "\n\n".join(tables)
        n = got[modes[0][0]]["nchunks"]
        info = {"dataset": f"{args.rows:,} rows ({p:.0%} positives), {n} chunks of about {args.chunk_rows:,} "
                           f"rows, shuffle_window 4, batch_size {bs:,}",
                "date": datetime.date.today().isoformat(),
                "command": "python benchmarks/bench_randomness.py " + " ".join(argv if argv is not None
                                                                             else sys.argv[1:])}
        print(table)
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        if args.out:
            replace_section(args.out, "## Shuffle randomness", "## Shuffle randomness\n\n" + table + "\n\n"
                            + "".join(f"* **{k}**: {v}\n" for k, v in info.items()) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
