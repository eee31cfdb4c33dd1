"""Step benchmark: does the loader keep up with a real training step on the CPU?

One click log shaped like Criteo (label int8, 13 float32, 26 int64 ids, a list<int64>
of 0-20 ids), batch 8,192, and a consumer that copies every tensor of a batch (as a
host-to-device copy would) and then sleeps ``--step-ms`` for the GPU step. For each
loader: rows/s over a cached epoch and the fraction of wall time the training thread
waited for data (inside ``next()``). Median of ``--repeat`` passes, loaders interleaved,
each pass's files read once just before it (this VM pages out idle file pages), after
one unmeasured pass per loader (steady state: gpuload's first pass in a process also
fills its buffer pools, and fresh pages cost ~10 us each to fault in on this VM).

Then: the waiting fraction against the step time (a PNG), and the first epoch on an
empty cache against ``pq.read_table`` of the same columns, stage by stage.

    python benchmarks/bench_step.py                                  # 8M rows, prints the tables
    python benchmarks/bench_step.py --out docs/benchmarks.md --plot docs/step_starvation.png
    python benchmarks/bench_step.py --petastorm auto    # adds Petastorm 0.13.1, in a venv of its own made on first use
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.synth import write_clicklog

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_cpu import ideal_sequential, machine, replace_section, say, seconds, write_npy  # noqa: E402

DENSE, SPARSE = 13, 26
PER_COLUMN = {"label": "label", **{f"dense_{i}": f"dense_{i}" for i in range(DENSE)},
              **{f"cat_{i}": f"cat_{i}" for i in range(SPARSE)}, "history": "history"}
STACKED = {"label": "label", "dense": [f"dense_{i}" for i in range(DENSE)],
           "cat": [f"cat_{i}" for i in range(SPARSE)], "history": "history"}


def publish(text: str, out, work: pathlib.Path, remove: bool) -> None:
    """Print a benchmark's markdown ``text``, append it to ``out`` (a path, or None), and remove
    its ``work`` folder when ``remove`` (a temporary one)."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)
    if remove:
        shutil.rmtree(work, ignore_errors=True)


def consume(batch: dict) -> int:
    """Copy every tensor (a host-to-device copy's stand-in); returns the batch's rows."""
    for v in batch.values():
        if isinstance(v, Ragged):
            v.values.clone()
            v.offsets.clone()
        else:
            v.clone()
    return len(batch["label"])


def measure(batches, step_s: float) -> tuple[int, float, float]:
    """(rows, seconds, seconds waiting inside next()) of one pass with a ``step_s`` step."""
    it = iter(batches)
    rows = 0
    waited = 0.0
    t0 = time.perf_counter()
    while True:
        a = time.perf_counter()
        b = next(it, None)
        waited += time.perf_counter() - a
        if b is None:
            break
        rows += consume(b)
        if step_s:
            time.sleep(step_s)
    return rows, time.perf_counter() - t0, waited


def naive(files, bs: int):
    """``iter_batches`` + ``to_numpy`` per column, on the training thread, file order."""
    for f in files:
        for rb in pq.ParquetFile(f).iter_batches(batch_size=bs, columns=list(PER_COLUMN.values())):
            out = {}
            for name in PER_COLUMN:
                col = rb.column(name)
                if name == "history":
                    off = col.offsets.to_numpy().astype(np.int64)
                    out[name] = Ragged(torch.from_numpy(col.values.to_numpy()[off[0]:off[-1]]),
                                       torch.from_numpy(off - off[0]))
                else:
                    out[name] = torch.from_numpy(col.to_numpy())
            yield out


def warm(paths) -> None:
    """Read files once so the pass after this finds them in the page cache."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


class Loader:
    """A named loader: ``epoch(e)`` returns that epoch's batches; ``files`` are what it reads."""

    def __init__(self, name: str, epoch, files):
        self.name, self.epoch, self.files = name, epoch, files


def gpuload_loader(name: str, files, cols: dict, cache: pathlib.Path, bs: int, **kw) -> Loader:
    ds = gpuload.ParquetDataset(files, cols, batch_size=bs, cache_dir=cache, device="cpu", **kw)
    gpuload.build_cache(files, cache, cols, layout=ds.options.layout,
                        shuffle="block" if ds.options.block_rows else True,
                        block_rows=ds.options.block_rows or 256)

    def epoch(e: int):
        ds.set_epoch(e)
        return ds

    return Loader(name, epoch, lambda: sorted(cache.rglob("*.glc")))


def loaders(files, work: pathlib.Path, bs: int, block_rows: int) -> list[Loader]:
    npy = work / "npy"
    write_npy(files, PER_COLUMN, npy)
    say("building the caches ...")
    return [
        Loader("naive iter_batches + to_numpy (no cache, no shuffle)", lambda e: naive(files, bs), lambda: files),
        Loader("ideal: .npy per column, mmap, sliced in order", lambda e: ideal_sequential(npy, PER_COLUMN, bs),
               lambda: sorted(npy.glob("*.npy"))),
        gpuload_loader("gpuload, no shuffle, one output per column", files, PER_COLUMN, work / "c_seq", bs,
                       shuffle=False),
        gpuload_loader("gpuload, shuffled (default), one output per column", files, PER_COLUMN, work / "c_rows", bs),
        gpuload_loader("gpuload, shuffled, one output per column, layout='columns'", files, PER_COLUMN,
                       work / "c_cols", bs, layout="columns"),
        gpuload_loader("gpuload, shuffled, stacked groups (label, dense [13], cat [26], history)", files, STACKED,
                       work / "c_stack", bs),
        gpuload_loader(f"gpuload, shuffle='block' ({block_rows} rows), one output per column", files, PER_COLUMN,
                       work / "c_block", bs, shuffle="block", block_rows=block_rows),
    ]


def passes(ls: list[Loader], step_s: float, repeat: int, first_epoch: int) -> dict:
    """Per loader: (median rows/s, median waiting fraction, every pass's (rows/s, waiting))."""
    got: dict[str, list] = {ld.name: [] for ld in ls}
    for ld in ls:  # steady state: a loader's first pass in a process also fills its buffer pools
        measure(ld.epoch(first_epoch - 1), 0.0)
    for r in range(repeat):
        for ld in ls:
            warm(ld.files())
            rows, secs, waited = measure(ld.epoch(first_epoch + r), step_s)
            got[ld.name].append((rows / secs, waited / secs))
        say(f"  pass {r + 1}/{repeat} at {step_s * 1e3:g} ms: "
            + ", ".join(f"{got[ld.name][-1][0] / 1e6:.2f} M" for ld in ls))
    return {k: (statistics.median(x for x, _ in v), statistics.median(w for _, w in v), v) for k, v in got.items()}


PETASTORM_VENV = pathlib.Path(__file__).resolve().parent.parent / ".venv-petastorm"
PETASTORM_SETUP = [  # petastorm_baseline.py's docstring says why these versions
    ["torch==2.13.0"],
    ["numpy==1.26.4", "pyarrow==14.0.2", "pandas==2.1.4", "dill", "diskcache", "future", "packaging", "psutil",
     "pyzmq", "six", "fsspec", "setuptools<70"],
    ["--no-deps", "petastorm==0.13.1"],
]


def petastorm_python(arg: str) -> str:
    """The interpreter for ``--petastorm``: the one given, or with ``auto`` the venv ``.venv-petastorm``
    at the repository's root, made on first use (a few hundred MB from PyPI)."""
    if arg != "auto":
        return arg
    python = PETASTORM_VENV / "bin" / "python"
    if not python.exists():
        say(f"making {PETASTORM_VENV} for Petastorm 0.13.1 ...")
        subprocess.run([sys.executable, "-m", "venv", str(PETASTORM_VENV)], check=True)
        for pkgs in PETASTORM_SETUP:
            subprocess.run([str(python), "-m", "pip", "install", "-q", *pkgs], check=True)
    return str(python)


def petastorm(python: str, data: pathlib.Path, work: pathlib.Path, bs: int, step_ms: float) -> dict | None:
    """Petastorm 0.13.1's cached epoch, run by ``python`` (a venv with petastorm) in a subprocess."""
    script = pathlib.Path(__file__).with_name("petastorm_baseline.py")
    cmd = [python, str(script), "--files", str(data), "--batch-size", str(bs), "--cache-dir", str(work / "pst"),
           "--epochs", "2", "--step-ms", str(step_ms), "--pad-history", "20"]
    say("petastorm: " + " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        say(f"petastorm failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_write_gbps(folder: pathlib.Path, nbytes: int = 1 << 30) -> float:
    """GB/s of writing ``nbytes`` to a new file in ``folder`` and fsyncing it (what a cache build's
    writes cost at best here)."""
    block = np.ones(64 << 20, np.uint8)
    path = folder / "disk-probe"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // block.nbytes):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    path.unlink()
    return nbytes / secs / 1e9


def cold(files, work: pathlib.Path, bs: int, repeat: int) -> dict:
    """First epoch (default settings, empty cache) vs ``pq.read_table`` and ``build_cache``: seconds per
    pass (opening the dataset; the epoch until its last batch; until its last cache write is durable),
    the stage spans of each epoch, the cache's size and the disk's write speed."""
    names = [c for v in PER_COLUMN.values() for c in ([v] if isinstance(v, str) else v)]
    t = {k: [] for k in ("read_table", "open", "batches", "epoch", "build_cache", "stages")}
    cache = work / "cold"
    for r in range(repeat):
        say(f"  cold pass {r + 1}/{repeat} ...")
        warm(files)
        t0 = time.perf_counter()
        pq.read_table(files, columns=names)
        t["read_table"].append(time.perf_counter() - t0)
        shutil.rmtree(cache, ignore_errors=True)
        warm(files)
        t0 = time.perf_counter()
        ds = gpuload.ParquetDataset(files, PER_COLUMN, batch_size=bs, cache_dir=cache, device="cpu")
        t1 = time.perf_counter()
        measure(ds, 0.0)
        t2 = time.perf_counter()
        ds.reader.cache.flush()  # the last background cache writes count toward the first epoch
        t3 = time.perf_counter()
        t["open"].append(t1 - t0)
        t["batches"].append(t2 - t1)
        t["epoch"].append(t3 - t1)
        t["stages"].append({k: round(v.seconds, 2) for k, v in ds.stats().stages.items()})
        t["cache_bytes"] = sum(f.stat().st_size for f in cache.rglob("*.glc"))
        shutil.rmtree(cache)
        warm(files)
        t["build_cache"].append(gpuload.build_cache(files, cache, PER_COLUMN).seconds)
        shutil.rmtree(cache)
    t["disk_gbps"] = disk_write_gbps(work)
    return t


def plot(sweep: dict, steps: list[float], path: pathlib.Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, waits in sweep.items():
        ax.plot(steps, [100 * w for w in waits], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xticks(steps, [f"{s:g}" for s in steps])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("simulated step time per 8,192-row batch (ms)")
    ax.set_ylabel("training thread waiting for data (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Waiting fraction against step time (CPU, cached epoch)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--sweep", default="0.5,1,2,5", help="step times (ms) of the plot; '' skips it")
    ap.add_argument("--block-rows", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="passes per number; the median is kept (default 3)")
    ap.add_argument("--petastorm", metavar="PYTHON",
                    help="a Python with petastorm 0.13.1 (petastorm_baseline.py), or 'auto': make .venv-petastorm")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Step' section gets the results")
    ap.add_argument("--plot", type=pathlib.Path, help="PNG of the waiting fraction against the step time")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the consumer's copies: an OpenMP team would spin against the loader threads
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-step-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        bs = args.batch_size
        data = work / "data"
        if not list(data.glob("*.parquet")):
            say(f"generating {args.rows:,} rows in {args.files} files under {data} ...")
            write_clicklog(data, rows=args.rows, files=args.files, dense=DENSE, sparse=SPARSE, list_max=20)
        files = sorted(data.glob("*.parquet"))
        ls = loaders(files, work, bs, args.block_rows)
        say(f"cached epochs, step {args.step_ms:g} ms ...")
        main_ = passes(ls, args.step_ms / 1e3, args.repeat, first_epoch=1)
        pst = petastorm(petastorm_python(args.petastorm), data, work, bs, args.step_ms) if args.petastorm else None
        steps = [float(s) for s in args.sweep.split(",") if s]
        sweep = {ld.name: [] for ld in ls}
        for s in steps:
            say(f"sweep: step {s:g} ms ...")
            for name, (_, w, _) in passes(ls, s / 1e3, 1, first_epoch=10).items():
                sweep[name].append(w)
        say("first epoch ...")
        c = cold(files, work, bs, args.repeat)
        ideal = main_[ls[1].name][0]
        lines = ["| loader (cached epoch) | rows/s | training thread waiting | vs ideal |", "|---|---:|---:|---:|"]
        for ld in ls:
            r, w, _ = main_[ld.name]
            lines.append(f"| {ld.name} | {r / 1e6:.2f} M | {w:.0%} | {r / ideal:.2f}x |")
        if pst is not None:
            e = pst["epochs"][-1]
            lines.append(f"| {pst['loader']}, local-disk cache, epoch 2 | {e['rows_per_s'] / 1e6:.2f} M | "
                         f"{e['wait_fraction']:.0%} | {e['rows_per_s'] / ideal:.2f}x |")
        med = {k: statistics.median(c[k]) for k in ("read_table", "open", "batches", "epoch", "build_cache")}
        i = sorted(range(len(c["epoch"])), key=c["epoch"].__getitem__)[len(c["epoch"]) // 2]
        floor = c["cache_bytes"] / (c["disk_gbps"] * 1e9)
        lines += ["", "| first epoch (empty cache) | seconds | vs read_table |", "|---|---:|---:|"]
        for k, what in (("read_table", "pq.read_table of the same columns"),
                        ("open", "gpuload: opening the dataset (footers, checks)"),
                        ("batches", "gpuload epoch 0, shuffled, one output per column, no step: until its last batch"),
                        ("epoch", "the same, until its last cache write is durable (fsync)"),
                        ("build_cache", "gpuload.build_cache (no batching)")):
            lines.append(f"| {what} | {med[k]:.2f} s | {med[k] / med['read_table']:.2f}x |")
        lines.append(f"| writing the cache's {c['cache_bytes'] / 2**30:.2f} GiB at this disk's "
                     f"{c['disk_gbps']:.2f} GB/s (write + fsync), alone | {floor:.2f} s | "
                     f"{floor / med['read_table']:.2f}x |")
        table = "\n".join(lines)
        info = {
            "machine": machine(),
            "dataset": f"{args.rows:,} rows in {args.files} Parquet files (snappy), "
                       f"{sum(f.stat().st_size for f in files) / 2**20:.0f} MiB; batch_size {bs:,}",
            "consumer": f"clone() of every tensor, then sleep {args.step_ms:g} ms; torch.set_num_threads(1)",
            "passes": "; ".join(f"{k}: " + ", ".join(f"{r / 1e6:.2f} M/{w:.0%}" for r, w in v[2])
                                for k, v in main_.items()),
            "sweep (waiting at " + ", ".join(f"{s:g}" for s in steps) + " ms)":
                "; ".join(f"{k}: " + ", ".join(f"{w:.0%}" for w in v) for k, v in sweep.items()),
            "first epoch": f"read_table {seconds(c['read_table'])}; open {seconds(c['open'])}; epoch until the last "
                           f"batch {seconds(c['batches'])}, until durable {seconds(c['epoch'])}; build_cache "
                           f"{seconds(c['build_cache'])}; stage busy seconds of the median epoch (summed over "
                           f"threads; cache_write is the writer thread's wall time, mostly waiting for the disk): "
                           f"{c['stages'][i]}",
            "petastorm": "not run (pass --petastorm PYTHON)" if pst is None else json.dumps(pst),
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        print(table)
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        if args.plot and steps:
            plot(sweep, steps, args.plot)
        if args.out:
            section = "## Step\n\n" + table + "\n\n" + "".join(f"* **{k}**: {v}\n" for k, v in info.items())
            if args.plot and steps:
                section += f"\n![waiting against step time]({os.path.relpath(args.plot, args.out.parent)})\n"
            replace_section(args.out, "## Step", section + "\n")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
