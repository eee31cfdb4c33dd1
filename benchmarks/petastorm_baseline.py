"""Petastorm 0.13.1 baseline: a local-disk-cached batch loader, read cold then warm.

Runs in its own venv, not the project's: petastorm 0.13.1 uses pyarrow's legacy
``ParquetDataset`` (gone in pyarrow 15) and NumPy 1 names (``np.unicode_``).
Set-up that works (Python 3.11; pyspark is a declared dependency but
``make_batch_reader`` never imports it, hence ``--no-deps``)::

    python3.11 -m venv /work/pst-venv
    /work/pst-venv/bin/pip install torch==2.13.0
    /work/pst-venv/bin/pip install numpy==1.26.4 pyarrow==14.0.2 pandas==2.1.4 \
        dill diskcache future packaging psutil pyzmq six fsspec "setuptools<70"
    /work/pst-venv/bin/pip install --no-deps petastorm==0.13.1

Run::

    /work/pst-venv/bin/python benchmarks/petastorm_baseline.py --files /tmp/b15/data2m --cache-dir /tmp/pst

Every epoch opens a new ``make_batch_reader`` (thread pool, ``num_epochs=1``) on
the same ``local-disk`` cache in a fresh folder under ``--cache-dir``: epoch 1 reads
Parquet and fills the cache, later epochs read the cache. ``BatchedDataLoader``
regroups the row groups into batches of ``--batch-size`` rows, one tensor per
column. The consumer clones every tensor (standing in for a host-to-device copy)
and sleeps ``--step-ms``. An epoch's seconds run from opening the reader to the end
of the last step; its wait is the time spent in ``next()`` (the first wait includes
opening the reader). Petastorm cannot batch variable-length lists, so ``history``
is dropped unless ``--pad-history N`` pads/truncates it to N values in a
``TransformSpec`` (applied before caching, so only epoch 1 pays for it).
Prints one JSON line on stdout; petastorm's own output goes to stderr.
"""
import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

DEFAULT_COLUMNS = ["label"] + [f"dense_{i}" for i in range(13)] + [f"cat_{i}" for i in range(26)] + ["history"]


def parquet_urls(spec):
    """A directory -> its file:// URL; otherwise a glob -> a sorted list of file:// URLs."""
    if os.path.isdir(spec):
        return "file://" + os.path.abspath(spec)
    paths = sorted(glob.glob(spec))
    if not paths:
        sys.exit(f"no parquet files match {spec!r}")
    return ["file://" + os.path.abspath(p) for p in paths]


def pad_history_spec(n):
    """A TransformSpec turning the list column ``history`` into fixed [n] int64 rows (zero-padded)."""
    from petastorm import TransformSpec

    def pad(df):
        lists = df["history"].values
        lens = np.fromiter((len(v) for v in lists), np.int64, len(lists))
        flat = np.concatenate(list(lists)).astype(np.int64) if lens.sum() else np.empty(0, np.int64)
        row = np.repeat(np.arange(len(lists)), lens)
        pos = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        out = np.zeros((len(lists), n), np.int64)
        keep = pos < n
        out[row[keep], pos[keep]] = flat[keep]
        df["history"] = list(out)
        return df

    return TransformSpec(pad, edit_fields=[("history", np.int64, (n,), False)])


def run_epoch(epoch, urls, columns, args, cache_location, transform_spec):
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    rows, wait = 0, 0.0
    t0 = time.perf_counter()
    reader = make_batch_reader(
        urls, schema_fields=columns, num_epochs=1, workers_count=args.workers,
        reader_pool_type="thread", shuffle_rows=False, shuffle_row_groups=False,
        cache_type="local-disk", cache_location=cache_location, cache_size_limit=1 << 40,
        cache_row_size_estimate=1024, cache_extra_settings={"cleanup": False},
        transform_spec=transform_spec)
    try:
        step_end = t0
        for batch in BatchedDataLoader(reader, batch_size=args.batch_size):
            wait += time.perf_counter() - step_end
            for t in batch.values():
                t.clone()
            rows += len(next(iter(batch.values())))
            time.sleep(args.step_ms / 1000.0)
            step_end = time.perf_counter()
    finally:  # not `with reader`: its __exit__ deletes the cache folder and prints to stdout
        reader.stop()
        reader.join()
    seconds = time.perf_counter() - t0
    return {"epoch": epoch, "rows": rows, "seconds": round(seconds, 3),
            "rows_per_s": round(rows / seconds, 1), "wait_fraction": round(wait / seconds, 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", required=True, help="a directory of parquet files or a glob")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--cache-dir", default=tempfile.gettempdir(),
                   help="a fresh petastorm-* cache folder is made (and removed) under it")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--columns", default=",".join(DEFAULT_COLUMNS), help="comma-separated")
    p.add_argument("--pad-history", type=int, default=0, metavar="N",
                   help="pad/truncate history to N values instead of dropping it (0: drop)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--keep-cache", action="store_true")
    args = p.parse_args()

    import diskcache, pandas, petastorm, pyarrow, torch
    torch.set_num_threads(1)
    columns = [c for c in args.columns.split(",") if c]
    notes = [f"make_batch_reader thread pool, workers={args.workers}, local-disk cache; "
             f"no shuffling; BatchedDataLoader batch_size={args.batch_size}; consumer: clone + sleep {args.step_ms} ms"]
    spec = None
    if "history" in columns and args.pad_history > 0:
        spec = pad_history_spec(args.pad_history)
        notes.append(f"history padded/truncated to {args.pad_history} values by a TransformSpec (cached padded)")
    elif "history" in columns:
        columns.remove("history")
        notes.append("history dropped: petastorm's batch reader raises on variable-length lists "
                     "(use --pad-history N to pad it in a TransformSpec)")
    notes.append(f"{len(columns)} columns")

    urls = parquet_urls(args.files)
    os.makedirs(args.cache_dir, exist_ok=True)
    cache_location = tempfile.mkdtemp(prefix="petastorm-", dir=args.cache_dir)
    epochs = []
    try:
        with contextlib.redirect_stdout(sys.stderr):
            for e in range(1, args.epochs + 1):
                epochs.append(run_epoch(e, urls, columns, args, cache_location, spec))
                print(json.dumps(epochs[-1]), file=sys.stderr)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_location) for f in fs)
        notes.append(f"cache size {size / 2**20:.0f} MiB")
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_location, ignore_errors=True)
    versions = {"petastorm": petastorm.__version__, "pyarrow": pyarrow.__version__, "numpy": np.__version__,
                "pandas": pandas.__version__, "torch": torch.__version__, "diskcache": diskcache.__version__,
                "python": sys.version.split()[0]}
    print(json.dumps({"loader": f"petastorm {petastorm.__version__}", "versions": versions,
                      "epochs": epochs, "notes": "; ".join(notes)}))


if __name__ == "__main__":
    main()
