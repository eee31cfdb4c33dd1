"""CPU benchmark: gpuload against the ideal cache, the naive loop and pyarrow read_table.

All loaders run in one process, on one generated click log, and feed the same
consumer (a sum over every tensor, so views are not free). Every number is the best
of ``--repeat`` passes; warm passes interleave the loaders so that drift and neighbours
hit them alike; each cold pass starts from an empty cache folder, and read_table runs
back to back (its best case: the strictest baseline). Parquet files and the ideal's
``.npy`` files are in the page cache; gpuload's cache files go around it (``O_DIRECT``, its
default ``cache_io="auto"`` on the CPU), read from the disk each epoch (only the cold epoch
writes, with fsync).

    python benchmarks/bench_cpu.py                       # 4M rows, prints the table
    python benchmarks/bench_cpu.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import gpuload
from gpuload.batch import Ragged, take
from gpuload.tools.demo import naive_batches
from gpuload.synth import clicklog_columns, write_clicklog

# the ideal cache hands torch read-only mmap views on purpose (zero copy)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def consume(batch: dict) -> int:
    """The training step stand-in: touch every tensor; returns the batch's rows."""
    for v in batch.values():
        if isinstance(v, Ragged):
            v.values.sum()
            int(v.offsets[-1])
        else:
            v.sum()
    return len(batch["label"])


def run_loop(batches) -> tuple[int, float]:
    """(rows, seconds) of feeding every batch to :func:`consume`."""
    t0, rows = time.perf_counter(), 0
    for b in batches:
        rows += consume(b)
    return rows, time.perf_counter() - t0


# -- the ideal cache: .npy files per output, memory-mapped --------------------------------------
def write_npy(files, columns: dict, folder: pathlib.Path, permute_chunks: int = 0) -> None:
    """Convert the dataset once into one .npy per output (history: values + offsets).
    ``permute_chunks``: rows permuted once within each run of that many rows (a block shuffle's
    cache, as gpuload permutes each chunk's rows when caching it; default 0: file order)."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pq.read_table(files, columns=source_columns(columns))
    if permute_chunks:
        rng = np.random.default_rng(0)
        n = table.num_rows
        table = table.take(np.concatenate([a + rng.permutation(min(permute_chunks, n - a))
                                           for a in range(0, n, permute_chunks)]))
    for name, cols in columns.items():
        if isinstance(cols, list):  # stacked group -> [N, k] C-contiguous
            arr = np.empty((table.num_rows, len(cols)), dtype=table.schema.field(cols[0]).type.to_pandas_dtype())
            for j, c in enumerate(cols):
                arr[:, j] = table.column(c).to_numpy()
            np.save(folder / f"{name}.npy", arr)
        elif pa.types.is_list(table.schema.field(cols).type):
            lists = table.column(cols).combine_chunks()
            off = np.asarray(lists.offsets, dtype=np.int64)
            np.save(folder / f"{name}.values.npy", lists.values.to_numpy()[off[0]:off[-1]])
            np.save(folder / f"{name}.offsets.npy", off - off[0])
        else:
            np.save(folder / f"{name}.npy", table.column(cols).to_numpy())


def open_npy(folder: pathlib.Path, columns: dict) -> dict:
    """Memory-map every output (opened afresh each epoch, as a training script would per run)."""
    def load(p):
        return np.asarray(np.load(folder / p, mmap_mode="r"))
    return {n: Ragged(load(f"{n}.values.npy"), load(f"{n}.offsets.npy")) if (folder / f"{n}.values.npy").exists()
            else load(f"{n}.npy") for n in columns}


def to_torch(cols: dict) -> dict:
    return {k: Ragged(torch.from_numpy(v.values), torch.from_numpy(v.offsets)) if isinstance(v, Ragged)
            else torch.from_numpy(v) for k, v in cols.items()}


def ideal_sequential(folder: pathlib.Path, columns: dict, bs: int):
    """Consecutive batches as views of the mmap'd arrays (offsets rebased: a small copy)."""
    arrs = open_npy(folder, columns)
    n = len(arrs["label"])
    for a in range(0, n, bs):
        b = min(a + bs, n)
        out = {}
        for k, v in arrs.items():
            if isinstance(v, Ragged):
                off = v.offsets[a:b + 1]
                out[k] = Ragged(v.values[off[0]:off[-1]], off - off[0])
            else:
                out[k] = v[a:b]
        yield to_torch(out)


#: rows of the ideal's "chunks" (the runs whose order a shuffled epoch permutes): the row group size of
#: the benchmarks' data, about gpuload's chunk
CHUNK_ROWS = 65_536


def in_order(make, n: int, threads: int = 2, ahead: int = 4):
    """``make(0)``, ..., ``make(n - 1)``, computed on ``threads`` threads up to ``ahead`` items ahead
    of the one handed out, yielded in order (a hand-written loader's prefetch; NumPy's gathers let
    go of the GIL). An exception in ``make`` comes out where its item would."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ideal")
    pending = collections.deque()
    try:
        for i in range(n):
            pending.append(pool.submit(make, i))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=False)


def _windows(n: int, window: int, chunk_rows: int, rng: np.random.Generator):
    """The epoch's windows: lists of ``(start, stop)`` row ranges of chunks of ``chunk_rows`` rows,
    the chunk order permuted, about ``window`` rows (whole chunks) a window."""
    chunks = [(a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]
    order = [chunks[i] for i in rng.permutation(len(chunks))]
    per = max(1, round(window / chunk_rows))
    return [order[w:w + per] for w in range(0, len(order), per)]


def _gathered(arrs: dict, idx: np.ndarray, bs: int, threads: int):
    """Batches of the rows ``idx`` (``bs`` a batch, cut across windows), gathered ahead on ``threads``."""
    return in_order(lambda i: to_torch(take(arrs, idx[i * bs:(i + 1) * bs])), -(-len(idx) // bs), threads)


def ideal_shuffled(folder: pathlib.Path, columns: dict, bs: int, window: int, seed: int, threads: int = 2,
                   chunk_rows: int = CHUNK_ROWS):
    """gpuload's default shuffle, by hand: chunks of ``chunk_rows`` rows in a permuted order, rows
    permuted within windows of about ``window`` rows of them, batches gathered straight from the
    mmap on ``threads`` threads ahead of the consumer."""
    arrs = open_npy(folder, columns)
    rng = np.random.default_rng(seed)
    parts = []
    for w in _windows(len(arrs["label"]), window, chunk_rows, rng):
        rows = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in w])
        parts.append(rows[rng.permutation(len(rows))])
    return _gathered(arrs, np.concatenate(parts), bs, threads)


def ideal_blocks(folder: pathlib.Path, columns: dict, bs: int, window: int, block: int, seed: int,
                 threads: int = 2, chunk_rows: int = CHUNK_ROWS):
    """gpuload's ``shuffle="block"``, by hand, over a cache whose rows were permuted within each
    chunk once (:func:`write_npy` with ``permute_chunks``): chunks in a permuted order, blocks of
    ``block`` consecutive rows of a chunk permuted within windows of about ``window`` rows, batches
    gathered from the mmap on ``threads`` threads ahead of the consumer (a flat output's blocks in one
    fancy index of its ``[blocks, block]`` view, a list's values one slice per block)."""
    arrs = open_npy(folder, columns)
    rng = np.random.default_rng(seed)
    parts = []
    for w in _windows(len(arrs["label"]), window, chunk_rows, rng):
        starts = np.concatenate([np.arange(a, b, block, dtype=np.int64) for a, b in w])
        stops = np.concatenate([np.minimum(np.arange(a, b, block, dtype=np.int64) + block, b) for a, b in w])
        pick = rng.permutation(len(starts))
        starts, lens = starts[pick], (stops - starts)[pick]
        # the rows of the blocks in their new order: each block's start, then +1 along the block
        parts.append(np.repeat(starts - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(lens.sum()))
    idx, n = np.concatenate(parts), len(arrs["label"])
    full = n // block  # a flat output's whole blocks, as a [blocks, block] view: one fancy index gathers a batch
    views = {k: v[:full * block].reshape(full, block, *v.shape[1:]) for k, v in arrs.items()
             if not isinstance(v, Ragged)}
    ramp = np.arange(block)

    def make(i):
        rows = idx[i * bs:(i + 1) * bs]
        firsts = rows[::block]
        whole = (len(rows) % block == 0 and not (firsts % block).any() and firsts.max() < full * block
                 and np.array_equal(rows.reshape(-1, block), firsts[:, None] + ramp))
        if not whole:  # a batch near the short last block: by rows
            return to_torch(take(arrs, rows))
        out = {}  # every block of the batch whole
        for k, v in arrs.items():
            if k in views:
                out[k] = views[k][firsts // block].reshape(-1, *views[k].shape[2:])
            else:  # a list: its values one slice per block, its offsets from the rows' lengths
                lo, hi = v.offsets[firsts], v.offsets[firsts + block]
                lengths = v.offsets[rows + 1] - v.offsets[rows]
                out[k] = Ragged(np.concatenate([v.values[a:b] for a, b in zip(lo, hi)]),
                                np.concatenate([[0], np.cumsum(lengths)]))
        return to_torch(out)

    return in_order(make, -(-len(idx) // bs), threads)

# -- helpers -----------------------------------------------------------------------------------------
def source_columns(columns: dict) -> list[str]:
    return [c for v in columns.values() for c in ([v] if isinstance(v, str) else v)]


def mib(paths) -> float:
    return sum(p.stat().st_size for p in paths) / 2**20


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or "unknown CPU")
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, numpy {np.__version__}, pyarrow {pa.__version__}, "
            f"torch {torch.__version__}, gpuload {gpuload.__version__}")


class OtherCPU:
    """CPU seconds the rest of the machine used while a benchmark ran: every core's busy time
    (``/proc/stat``: user, nice, system, irq, softirq) less this process's and its reaped
    children's (``os.times``), and the hypervisor's steal time, from ``start()`` to ``stop()``.
    A run is quiet when the others used little: the load average cannot tell, as it counts the
    benchmark's own processes. Linux only (elsewhere ``text()`` says it was not measured).
    A daemon a loader starts and does not reap (reparented to init) counts as another's."""

    def __init__(self):
        self.busy = self.steal = self.ours = self.wall = None

    @staticmethod
    def _stat() -> tuple[float, float] | None:
        try:
            f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        return sum(f[i] for i in (0, 1, 2, 5, 6)) / tick, (f[7] if len(f) > 7 else 0) / tick

    @staticmethod
    def _ours() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def start(self) -> "OtherCPU":
        self._t0, self._s0, self._o0 = time.perf_counter(), self._stat(), self._ours()
        return self

    def stop(self) -> "OtherCPU":
        s1 = self._stat()
        self.wall = time.perf_counter() - self._t0
        if self._s0 is not None and s1 is not None:
            self.ours = self._ours() - self._o0
            self.busy, self.steal = s1[0] - self._s0[0], s1[1] - self._s0[1]
        return self

    @property
    def others(self) -> float | None:
        """CPU seconds of other processes (never below 0: the counters tick at different times)."""
        return None if self.busy is None else max(0.0, self.busy - self.ours)

    def quiet(self, share: float = 0.1) -> bool:
        """Whether others and steal together used under ``share`` of one core over the run."""
        return self.others is not None and self.others + self.steal < share * self.wall

    def text(self) -> str:
        if self.others is None:
            return "other processes' CPU not measured (no /proc/stat)"
        return (f"other processes used {self.others:.0f} CPU s and the hypervisor stole {self.steal:.0f} s "
                f"({(self.others + self.steal) / self.wall:.0%} of one core) while the benchmark's own used "
                f"{self.ours:.0f} s")


def cold_epoch(files, cols: dict, cache: pathlib.Path, bs: int, shuffle: bool) -> tuple[float, float]:
    """(seconds, of which waiting for the last cache writes) of epoch 0 into an empty cache folder."""
    shutil.rmtree(cache, ignore_errors=True)
    ds = gpuload.ParquetDataset(files, cols, batch_size=bs, shuffle=shuffle, cache_dir=cache, device="cpu")
    t0 = time.perf_counter()
    n, _ = run_loop(ds)
    t1 = time.perf_counter()
    ds.reader.cache.flush()  # the last background cache writes count toward the cold epoch
    assert n == ds.num_rows, n
    return time.perf_counter() - t0, time.perf_counter() - t1


def cold_passes(files, cols: dict, work: pathlib.Path, bs: int, R: int) -> dict:
    """Seconds of: read_table (R + 1 calls back to back: its best case, the strictest baseline), then R
    times a cold epoch with and without shuffling and build_cache, each into an empty cache folder."""
    names = source_columns(cols)
    t = {"read": [timed(lambda: pq.read_table(files, columns=names)) for _ in range(R + 1)],
         "cold": [], "flush": [], "cold_seq": [], "build": []}
    for r in range(R):
        say(f"cold pass {r + 1}/{R} ...")
        for key, shuffle, folder in (("cold", True, "cache"), ("cold_seq", False, "cache2")):
            secs, flush = cold_epoch(files, cols, work / folder, bs, shuffle)
            t[key].append(secs)
            if shuffle:
                t["flush"].append(flush)
        shutil.rmtree(work / "cache2")
        t["build"].append(gpuload.build_cache(files, work / "cache2", cols).seconds)
        shutil.rmtree(work / "cache2")
    return t


def warm_passes(files, cols: dict, work: pathlib.Path, bs: int, R: int) -> tuple[dict, int]:
    """Best rows/s of each warm loader over R passes, loaders interleaved so drift hits them alike."""
    seq, shuf = (gpuload.ParquetDataset(files, cols, batch_size=bs, shuffle=sh, cache_dir=work / "cache",
                                        device="cpu") for sh in (False, True))
    window = shuf.options.shuffle_window * round(shuf.num_rows / len(shuf.reader.chunks))  # rows, about
    best = {k: 0.0 for k in ("g_seq", "i_seq", "g_shuf", "i_shuf", "naive")}
    for r in range(R):
        say(f"warm pass {r + 1}/{R} ...")
        shuf.set_epoch(1 + r)
        for key, batches in (("g_seq", seq), ("i_seq", ideal_sequential(work / "npy", cols, bs)),
                             ("g_shuf", shuf), ("i_shuf", ideal_shuffled(work / "npy", cols, bs, window, 1 + r)),
                             ("naive", naive_batches(files, bs, cols))):
            n, s = run_loop(batches)
            assert n == shuf.num_rows, (key, n)
            best[key] = max(best[key], n / s)
    return best, window


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=5, help="passes per measurement; the best is kept (default 5)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads of the consumer (default 1: an OpenMP team spinning on a "
                         "small machine measures scheduling, not the loaders)")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## CPU' section gets the results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    if load0 > 0.5:
        say(f"warning: load average {load0:.2f} before starting; other processes will add noise")
    try:
        cols, bs, R = clicklog_columns(), args.batch_size, args.repeat
        say(f"generating {args.rows:,} rows in {args.files} files under {work} ...")
        files = write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=65536)
        write_npy(files, cols, work / "npy")
        t = cold_passes(files, cols, work, bs, R)
        best, window = warm_passes(files, cols, work, bs, R)
        i = min(range(R), key=t["cold"].__getitem__)
        naive, read = "naive pyarrow->pandas->torch loop", "pq.read_table of the same columns"
        table = markdown_table([
            ("warm epoch, shuffle=False: rows/s", best["g_seq"], best["i_seq"], "ideal: mmap .npy, sliced", ">=", 0.9),
            ("warm epoch, shuffle=True: rows/s", best["g_shuf"], best["i_shuf"],
             f"ideal: mmap .npy, gathered in windows of {window:,} rows", ">=", 0.9),
            ("warm epoch, shuffle=True: rows/s", best["g_shuf"], best["naive"], naive, ">=", 10),
            ("warm epoch, shuffle=False: rows/s", best["g_seq"], best["naive"], naive, ">=", 10),
            ("cold epoch, shuffle=True: s", t["cold"][i], min(t["read"]), read, "<=", 1.3),
            ("cold epoch, shuffle=False: s", min(t["cold_seq"]), min(t["read"]), read, "", None),
            ("gpuload.build_cache: s", min(t["build"]), min(t["read"]), read, "", None)])
        glc = list((work / "cache").rglob("*.glc"))
        info = {
            "machine": machine(),
            "dataset": (f"{args.rows:,} rows, {args.files} Parquet files (snappy, 65,536-row row groups), "
                        f"{mib(files):.0f} MiB; gpuload cache {len(glc)} chunks, {mib(glc):.0f} MiB; .npy ideal cache "
                        f"{mib(list((work / 'npy').glob('*.npy'))):.0f} MiB; batch_size {bs:,}; outputs dense [N,13] "
                        "float32, sparse [N,8] int64, label int8, history list<int64> (Ragged)"),
            "consumer": f"sum of every tensor (history: values.sum() and offsets[-1]), "
                        f"torch.set_num_threads({args.torch_threads})",
            "cold passes": (f"best epoch {t['cold'][i]:.2f} s, of which {t['flush'][i]:.2f} s waiting for the last "
                            f"cache writes; epochs {seconds(t['cold'])}; shuffle=False epochs "
                            f"{seconds(t['cold_seq'])}; build_cache {seconds(t['build'])}; "
                            f"read_table (back to back) {seconds(t['read'])}"),
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        print(table)
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        if args.out:
            write_section(args.out, table, info, R)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def seconds(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs) + " s"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def markdown_table(rows) -> str:
    lines = ["| measurement | gpuload | baseline | ratio | target | met |", "|---|---:|---:|---:|---:|:---:|"]
    for what, g, b, base, op, target in rows:
        fmt = (lambda x: f"{x:.2f} s") if what.endswith(": s") else (lambda x: f"{x / 1e6:.2f} M")
        ratio = g / b
        met = "" if target is None else ("yes" if (ratio >= target if op == ">=" else ratio <= target) else "no")
        tgt = "" if target is None else f"{op} {target}x"
        lines.append(f"| {what} | {fmt(g)} | {fmt(b)} ({base}) | {ratio:.2f}x | {tgt} | {met} |")
    return "\n".join(lines)


def write_section(path: pathlib.Path, table: str, info: dict, repeat: int) -> None:
    """Replace the '## CPU' section of ``path`` (created with a GPU placeholder if missing)."""
    section = (f"## CPU\n\n{table}\n\n"
               f"Rows/s in millions (M), or seconds (s). Every number is the best of {repeat} passes; ratio is "
               "gpuload / baseline (rows/s: higher is better; seconds: lower is better).\n\n"
               + "".join(f"* **{k}**: {v}\n" for k, v in info.items()) + "\n")
    text = path.read_text() if path.exists() else "# Benchmarks\n\n## CPU\n\n## GPU\n\nNo GPU measurement yet.\n"
    head, sep, rest = text.partition("## CPU\n")
    tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
    path.write_text((head if sep else text + "\n") + section + tail.lstrip("\n"))


def report(table: str, info: dict, out: pathlib.Path | None, heading: str, note: str = "") -> None:
    """Print the table and its details; with ``out``, make them the ``heading`` section of that file."""
    print(table)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    if out:
        replace_section(out, heading, f"{heading}\n\n{table}\n\n" + (f"{note}\n\n" if note else "")
                        + "".join(f"* **{k}**: {v}\n" for k, v in info.items()) + "\n")


def replace_section(path: pathlib.Path, heading: str, section: str) -> None:
    """Replace the ``heading`` section of ``path`` (up to the next '## '), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    head, sep, rest = text.partition(heading + "\n")
    if sep:
        i = rest.find("\n## ")
        tail = rest[i + 1:] if i >= 0 else ""
        path.write_text(head + section + ("\n" + tail if tail else ""))
    else:
        path.write_text(text.rstrip("\n") + "\n\n" + section)


if __name__ == "__main__":
    main()
