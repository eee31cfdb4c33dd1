"""Where each of gpuload's threads spends an epoch: a sampling profile of every thread.

Every ``--interval`` (0.5 ms) a sampler thread reads every thread's Python stack
(``sys._current_frames``); per thread group (the loader threads, the window thread, the
producer, the writer, the training thread) it prints the lines the samples ended in and
the functions on their stacks, in seconds. A line inside a call that releases the GIL
(a read, a CUDA synchronisation, a kernel launch) counts as that line. It needs nothing
beyond gpuload, so it runs on a GPU node as it is, where cProfile cannot (Python 3.12
allows one profiler at a time, and gpuload's threads are many).

One generated click log (``gpuload.synth``), the columns of ``bench_gpu.py``; a first
epoch (which fills the cache), one epoch to verify it, then ``--epochs`` cached epochs::

    python benchmarks/profile_threads.py --rows 8000000 --device cuda --decode gpu --out prof.txt
    python benchmarks/profile_threads.py --rows 1000000 --device cpu     # about 20 s here

On a lent GPU node (docs/gpu-testing.md) the 8M-row run takes about 25 s.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import gpuload
from gpuload.synth import write_clicklog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import COLUMNS  # noqa: E402


class Sampler:
    """Samples every other thread's stack every ``interval`` seconds while in a ``with`` block."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.samples, self.wall = interval, 0, 0.0
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    @staticmethod
    def group(name: str) -> str:
        """A thread's group: its name without an executor's ``_N`` suffix."""
        head, _, tail = name.rpartition("_")
        return head if head and tail.isdigit() else name

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = self.group(names.get(ident, "?"))
                code = frame.f_code
                self.leaf[group][f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    key = f"{Path(code.co_filename).name}:{code.co_firstlineno} {code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[group][key] += 1
                    frame = frame.f_back
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._t0

    def report(self, title: str, top: int = 20) -> str:
        """Per thread group (busiest first): seconds per line and per function on the stack."""
        per = self.wall / max(self.samples, 1)
        lines = [f"## {title}: {self.samples} samples over {self.wall:.3f} s ({per * 1e3:.2f} ms apart)"]
        for group in sorted(self.leaf, key=lambda g: -sum(self.leaf[g].values())):
            lines.append(f"\n### {group}: {sum(self.leaf[group].values()) * per:.3f} s sampled\nlines:")
            lines += [f"  {n * per:8.3f} s  {k}" for k, n in self.leaf[group].most_common(top)]
            lines.append("functions (inclusive):")
            lines += [f"  {n * per:8.3f} s  {k}" for k, n in self.inclusive[group].most_common(top)]
        return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decode", choices=["auto", "gpu", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=None, help="num_threads (default: gpuload's)")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--shuffle", choices=["rows", "block", "none"], default="rows",
                    help="shuffle=True, 'block' or False")
    ap.add_argument("--epochs", type=int, default=3, help="cached epochs sampled together")
    ap.add_argument("--interval", type=float, default=0.0005, help="seconds between samples")
    ap.add_argument("--dir", default=None, help="work folder, emptied first (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    a = ap.parse_args(argv)
    work = Path(a.dir or tempfile.mkdtemp(prefix="gpuload-profile-"))
    shutil.rmtree(work / "data", ignore_errors=True)  # the first epoch decodes: no earlier data or cache
    shutil.rmtree(work / "cache", ignore_errors=True)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    report: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        report.append(text)

    try:
        write_clicklog(work / "data", a.rows, files=a.files)
        kw = {} if a.threads is None else {"num_threads": a.threads}
        ds = gpuload.ParquetDataset(work / "data", COLUMNS, cache_dir=work / "cache", device=a.device,
                                    decode=a.decode, batch_size=a.batch, seed=0, **kw,
                                    shuffle={"rows": True, "block": "block", "none": False}[a.shuffle])

        def epoch(e: int) -> None:
            ds.set_epoch(e)
            t0 = time.perf_counter()
            n = sum(1 for _ in ds)
            sync()
            say(f"epoch {e}: {time.perf_counter() - t0:.3f} s, {n} batches")

        ds.reset_stats()
        with Sampler(a.interval) as first:
            epoch(0)
        say(str(ds.stats()))
        say(first.report(f"first epoch, device={a.device}, decode={a.decode}"))
        ds.reader.cache.flush()
        epoch(1)  # the cache's first read (its checksums checked once), not sampled
        ds.reset_stats()
        with Sampler(a.interval) as cached:
            for e in range(2, 2 + a.epochs):
                epoch(e)
        say(str(ds.stats()))
        say(cached.report(f"{a.epochs} cached epochs, device={a.device}"))
        ds.close()
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    if a.out:
        Path(a.out).write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
