"""Remote benchmark: gpuload on Parquet in S3 against the loops users write, side by side in one run.

Everything reads through a loopback S3 server (moto, ``gpuload.testing.S3Server``)
that adds a per-request latency and a bandwidth cap per response, so ratios, not
absolute seconds, are the result. Measured, on the click log of ``bench_cpu.py``:

1. first epoch at each ``--latencies`` (ms): gpuload on an empty cache against the loop
   users write first (s3fs ``fs.open`` -> ``pq.ParquetFile`` -> ``iter_batches`` ->
   ``to_numpy`` -> ``torch.from_numpy``), both feeding a simulated training step
   (``--step-ms`` of sleep per batch): rows/s and starvation (the fraction of wall time
   spent waiting for the next batch, the dataset's open included). Target at 20 ms:
   gpuload >= 5x;
2. cached epochs: gpuload on the remote source once its cache is full against gpuload
   on a local copy of the same files (cached too): rows/s ratio (target ~1) and the
   requests the server got during the cached epochs (target: no GET of a Parquet object);
3. restart: on ``--small-files`` small objects, the time from ``ParquetDataset(...)``
   to the first batch of a fully cached dataset against listing the objects and
   reading every footer (``pq.read_metadata`` through s3fs), at ``--restart-latency``
   (target: 20x less), and the requests the cached open makes.

    python benchmarks/bench_remote.py                        # 1M rows; prints the table (a few minutes on 2 cores)
    python benchmarks/bench_remote.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import gpuload
from gpuload.batch import Ragged
from gpuload.synth import clicklog_columns, write_clicklog

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import consume, machine as cpu_machine, replace_section, source_columns  # noqa: E402  (the CPU benchmark's helpers)

# the naive loop hands torch Arrow's read-only buffers, as users' loops do (zero copy)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


# -- the server ------------------------------------------------------------------------------------
def _serve(conn, latency_s: float, bandwidth: float | None) -> None:
    """Child process: one S3Server, driven by (command, argument) messages on ``conn``."""
    from gpuload.testing import S3Server

    with S3Server(latency_s=latency_s, bandwidth=bandwidth) as s3:
        conn.send(s3.storage_options)
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                conn.send(None)
                return
            if cmd == "faults":
                s3.faults.latency_s, s3.faults.bandwidth = arg
                conn.send(None)
            elif cmd == "upload":
                conn.send(s3.upload_folder(*arg))
            elif cmd == "requests":
                conn.send(dict(s3.requests))
            elif cmd == "reset":
                s3.reset_counts()
                conn.send(None)


class Server:
    """A loopback S3 server whose latency and bandwidth can change between measurements.

    By default it runs in a child process, so that its Python work (moto, werkzeug, the
    bandwidth throttle) does not hold the loaders' GIL; it still shares the machine's
    cores. ``in_process=True`` runs it on threads of this process instead.
    """

    def __init__(self, in_process: bool = False):
        self.in_process = in_process
        if in_process:
            from gpuload.testing import S3Server

            self._s3 = S3Server().start()
            self.storage_options = self._s3.storage_options
        else:
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child, 0.0, None), daemon=True)
            self._proc.start()
            self.storage_options = self._conn.recv()

    def _call(self, cmd: str, arg=None):
        self._conn.send((cmd, arg))
        return self._conn.recv()

    def set(self, latency_s: float, bandwidth: float | None) -> None:
        if self.in_process:
            self._s3.faults.latency_s, self._s3.faults.bandwidth = latency_s, bandwidth
        else:
            self._call("faults", (latency_s, bandwidth))

    def upload(self, folder, bucket: str, prefix: str) -> list[str]:
        if self.in_process:
            return self._s3.upload_folder(folder, bucket, prefix)
        return self._call("upload", (str(folder), bucket, prefix))

    def requests(self) -> collections.Counter:
        """(method, key) -> requests received since the last :meth:`reset`."""
        return collections.Counter(self._s3.requests if self.in_process else self._call("requests"))

    def reset(self) -> None:
        if self.in_process:
            self._s3.reset_counts()
        else:
            self._call("reset")

    def fresh_options(self) -> dict:
        """storage_options for a new s3fs instance (no listing cache, no pooled connections
        from an earlier measurement), as in a new process."""
        return {**self.storage_options, "skip_instance_cache": True}

    def close(self) -> None:
        if self.in_process:
            self._s3.stop()
        else:
            self._call("stop")
            self._proc.join(10)


class Requests:
    """What a server got during one measurement, by kind."""

    def __init__(self, counts: collections.Counter):
        self.parquet_get = sum(n for (m, k), n in counts.items() if m == "GET" and k.endswith(".parquet"))
        self.listing = sum(n for (m, k), n in counts.items() if m == "GET" and not k.endswith(".parquet"))
        self.head = sum(n for (m, _), n in counts.items() if m == "HEAD")
        self.other = sum(counts.values()) - self.parquet_get - self.listing - self.head
        self.total = sum(counts.values())

    def __str__(self) -> str:
        text = f"{self.parquet_get} Parquet GETs, {self.listing} listing GETs, {self.head} HEADs"
        return text + (f", {self.other} other" if self.other else "")


# -- the loaders -----------------------------------------------------------------------------------
def naive_batches(storage_options: dict, prefix: str, columns: dict, bs: int):
    """The loop users write first: s3fs file objects into pyarrow, per batch to_numpy -> torch.from_numpy,
    one file after the other on the training thread (s3fs's defaults: a readahead cache of 50 MiB blocks)."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options)
    names = source_columns(columns)
    for path in sorted(fs.glob(f"{prefix}*.parquet")):
        with fs.open(path, "rb") as fh:
            for rb in pq.ParquetFile(fh).iter_batches(batch_size=bs, columns=names):
                out = {}
                for name, cols in columns.items():
                    if isinstance(cols, list):
                        out[name] = torch.from_numpy(np.column_stack([rb.column(c).to_numpy() for c in cols]))
                        continue
                    col = rb.column(cols)
                    if pa.types.is_list(col.type):
                        off = col.offsets.to_numpy().astype(np.int64)
                        out[name] = Ragged(torch.from_numpy(col.values.to_numpy()[off[0]:off[-1]]),
                                           torch.from_numpy(off - off[0]))
                    else:
                        out[name] = torch.from_numpy(col.to_numpy())
                yield out


def gpuload_batches(url: str, columns: dict, storage_options: dict, cache: pathlib.Path, bs: int, keep: list,
                    server: "Server | None" = None, epoch: int = 0):
    """A gpuload dataset opened inside the first ``next()`` (so the open counts as waiting), then its batches.
    ``keep`` gets the dataset, the seconds its constructor took and the requests the server got until then."""
    t0 = time.perf_counter()
    ds = gpuload.ParquetDataset(url, columns, storage_options=storage_options, cache_dir=cache, batch_size=bs,
                                device="cpu")
    keep += [ds, time.perf_counter() - t0, None if server is None else Requests(server.requests())]
    ds.set_epoch(epoch)
    yield from ds


class Pass:
    """One pass of a loader through the training loop: rows, seconds, starvation."""

    def __init__(self, batches, step_s: float, budget_s: float | None = None):
        loader = gpuload.watch(batches, sample_util=False)
        t0 = time.perf_counter()
        self.rows = self.batches = 0
        self.capped = False
        for b in loader:
            self.rows += consume(b)
            self.batches += 1
            if step_s:
                time.sleep(step_s)
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                self.capped = True
                break
        self.seconds = time.perf_counter() - t0
        s = loader.stats()
        self.starvation = s.starvation
        self.wait_s = s.wait_s

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds


# -- measurements ----------------------------------------------------------------------------------
def first_epochs(server: Server, prefix: str, cols: dict, work: pathlib.Path, args, total_rows: int) -> dict:
    """Per latency: the best (fastest) gpuload and naive first epoch of ``--repeat`` passes, interleaved."""
    out = {}
    for lat_ms in args.latencies:
        server.set(lat_ms / 1e3, args.bandwidth)
        best: dict[str, Pass | None] = {"gpuload": None, "naive": None}
        extra = {}
        for r in range(args.repeat):
            say(f"first epoch at {lat_ms:g} ms, pass {r + 1}/{args.repeat} ...")
            order = ("gpuload", "naive") if r % 2 == 0 else ("naive", "gpuload")
            for name in order:
                if name == "gpuload":
                    cache = work / "cache-remote"
                    shutil.rmtree(cache, ignore_errors=True)
                    keep: list = []
                    server.reset()
                    p = Pass(gpuload_batches(f"s3://{prefix}", cols, server.fresh_options(), cache, args.batch_size,
                                             keep, server), args.step_ms / 1e3)
                    ds = keep[0]
                    t = time.perf_counter()
                    ds.reader.cache.flush()  # the last background cache writes: not part of the epoch, timed
                    flush = time.perf_counter() - t
                    st = ds.stats()
                    ds.close()
                    req = Requests(server.requests())
                    assert p.rows == total_rows, p.rows
                    if best["gpuload"] is None or p.seconds < best["gpuload"].seconds:
                        best["gpuload"] = p
                        extra = {"open_s": keep[1], "open_requests": keep[2], "starvation_ds": st.starvation,
                                 "footers_read": ds.reader.open_counts.get("footers_read"),
                                 "diagnosis": gpuload.diagnose(st),
                                 "remote": st.remote, "requests": req, "flush_s": flush}
                else:
                    server.reset()
                    p = Pass(naive_batches(server.fresh_options(), prefix, cols, args.batch_size),
                             args.step_ms / 1e3, budget_s=args.naive_budget_s)
                    p.requests = Requests(server.requests())
                    assert p.capped or p.rows == total_rows, p.rows
                    if best["naive"] is None or p.rows_per_s > best["naive"].rows_per_s:
                        best["naive"] = p
        extra["naive_requests"] = best["naive"].requests
        out[lat_ms] = (best["gpuload"], best["naive"], extra)
    return out


def cached_epochs(server: Server, prefix: str, cols: dict, work: pathlib.Path, args, files_local) -> dict:
    """gpuload on the remote source (cache full) against gpuload on the local copy (cached too):
    best rows/s of ``--repeat`` epochs each, interleaved, and the requests of the remote side."""
    lat = args.restart_latency
    server.set(lat / 1e3, args.bandwidth)
    say("cached epochs: building the local copy's cache ...")
    gpuload.build_cache(files_local, work / "cache-local", cols)
    if not any((work / "cache-remote").rglob("*.glc")):  # normally left full by the last first epoch
        server.set(0, None)
        gpuload.build_cache(f"s3://{prefix}", work / "cache-remote", cols, storage_options=server.fresh_options())
        server.set(lat / 1e3, args.bandwidth)
    server.reset()
    remote = gpuload.ParquetDataset(f"s3://{prefix}", cols, storage_options=server.fresh_options(),
                                    cache_dir=work / "cache-remote", batch_size=args.batch_size, device="cpu")
    open_req = Requests(server.requests())
    local = gpuload.ParquetDataset(files_local, cols, cache_dir=work / "cache-local", batch_size=args.batch_size,
                                   device="cpu")
    server.reset()
    remote.reset_stats()
    for ds in (remote, local):  # page cache and first-read checksums: both start warm
        ds.set_epoch(1)
        Pass(ds, 0.0)
    best = {"remote": 0.0, "local": 0.0}
    paired = []  # remote / local rows/s of each pass: robust to load that comes and goes
    for r in range(args.cached_repeat):
        say(f"cached epochs, pass {r + 1}/{args.cached_repeat} ...")
        rate = {}
        for name, ds in (("remote", remote), ("local", local)) if r % 2 == 0 else (("local", local),
                                                                                   ("remote", remote)):
            ds.set_epoch(2 + r)
            p = Pass(ds, 0.0)
            assert p.rows == ds.num_rows, p.rows
            best[name] = max(best[name], p.rows_per_s)
            rate[name] = p.rows_per_s
        paired.append(rate["remote"] / rate["local"])
    epoch_req = Requests(server.requests())
    counters = remote.reader.counters
    remote_stats = remote.stats().remote
    remote.close()
    return {"best": best, "open": open_req, "epochs": epoch_req, "latency": lat, "decoded": counters.decoded,
            "remote_stats": remote_stats, "epochs_n": args.cached_repeat + 1,
            "paired": sorted(paired)}


def restart(server: Server, prefix: str, cols: dict, work: pathlib.Path, args) -> dict:
    """Time to the first batch of a cached dataset of many small objects, against reading their footers."""
    lat = args.restart_latency
    cache = work / "cache-small"
    shutil.rmtree(cache, ignore_errors=True)
    out = {}
    if args.cold_open:
        server.set(lat / 1e3, args.bandwidth)
        say(f"restart: cold open of {args.small_files:,} objects at {lat:g} ms (informational) ...")
        server.reset()
        t0 = time.perf_counter()
        ds = gpuload.ParquetDataset(f"s3://{prefix}", cols, storage_options=server.fresh_options(), cache_dir=cache,
                                    batch_size=args.batch_size, device="cpu")
        out["cold_open_s"] = time.perf_counter() - t0
        out["cold_open_req"] = Requests(server.requests())
        ds.close()
    say("restart: building the cache at 0 ms ...")
    server.set(0, None)
    gpuload.build_cache(f"s3://{prefix}", cache, cols, storage_options=server.fresh_options())
    server.set(lat / 1e3, args.bandwidth)
    g, base, greq, breq = [], [], None, None
    for r in range(args.repeat):
        say(f"restart at {lat:g} ms, pass {r + 1}/{args.repeat} ...")
        server.reset()
        t0 = time.perf_counter()
        ds = gpuload.ParquetDataset(f"s3://{prefix}", cols, storage_options=server.fresh_options(), cache_dir=cache,
                                    batch_size=args.batch_size, device="cpu")
        t_open = time.perf_counter() - t0
        it = iter(ds)
        first = next(it)
        g.append(time.perf_counter() - t0)
        if g[-1] == min(g):
            out["open_s"] = t_open
        it.close()
        consume(first)
        req = Requests(server.requests())
        greq = req if greq is None or req.total > greq.total else greq  # the worst pass
        out["footers_cached"] = ds.reader.open_counts.get("footers_cached")
        out["footers_read"] = ds.reader.open_counts.get("footers_read")
        out["files"] = len(ds.reader.files)
        ds.close()
        server.reset()
        t0 = time.perf_counter()
        footers = read_footers(server.fresh_options(), prefix)
        base.append(time.perf_counter() - t0)
        assert len(footers) == args.small_files, len(footers)
        breq = Requests(server.requests())
    out.update(gpuload_s=g, baseline_s=base, gpuload_req=greq, baseline_req=breq, latency=lat)
    return out


def read_footers(storage_options: dict, prefix: str) -> list:
    """What a restart costs without gpuload: list the objects, read every footer (one after the other)."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options)
    out = []
    for path in sorted(fs.glob(f"{prefix}*.parquet")):
        with fs.open(path, "rb") as fh:
            out.append(pq.read_metadata(fh))
    return out


# -- report ----------------------------------------------------------------------------------------
def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def machine() -> str:
    import moto
    import s3fs

    return f"{cpu_machine()}, no GPU; s3fs {s3fs.__version__}, moto {moto.__version__}"


def _block_mib() -> str:
    import s3fs

    return f"{s3fs.S3FileSystem.default_block_size / 2**20:g}"


def git_revision() -> str:
    """The commit the benchmark ran on, and whether gpuload/ had uncommitted changes."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "gpuload"], cwd=root, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    if not diff:
        return f"git {rev}"
    import hashlib

    return f"git {rev} with uncommitted changes in gpuload/ (sha1 of `git diff HEAD -- gpuload`: " \
           f"{hashlib.sha1(diff).hexdigest()[:10]})"


def mrows(x: float) -> str:
    return f"{x / 1e6:.2f} M rows/s"


def build_table(first: dict, cached: dict, rs: dict, args, stored: int) -> tuple[str, list[str]]:
    """The markdown table, and one sentence per row on what it shows."""
    lines = ["| measurement | gpuload | baseline | ratio | target | met |", "|---|---:|---:|---:|---:|:---:|"]
    notes = []
    naive = "s3fs `fs.open` -> `pq.ParquetFile.iter_batches` -> `torch.from_numpy`"
    for lat, (g, n, extra) in first.items():
        ratio = g.rows_per_s / n.rows_per_s
        target = 5 if lat == 20 else None
        star = " (extrapolated: first {} batches)".format(n.batches) if n.capped else ""
        lines.append(f"| first epoch at {lat:g} ms: rows/s, starvation | {mrows(g.rows_per_s)}, {g.starvation:.0%} | "
                     f"{mrows(n.rows_per_s)}, {n.starvation:.0%}{star} ({naive}) | {ratio:.2f}x | "
                     f"{'>= 5x' if target else ''} | {'' if target is None else ('yes' if ratio >= target else 'no')} |")
        r, nr, orq = extra["remote"], extra["naive_requests"], extra["open_requests"]
        footers = extra["footers_read"] or 0
        scans = orq.parquet_get - footers
        scan_text = (f" and {scans} GETs of list-column chunks for the null check (footer statistics count empty "
                     "lists as nulls), which the epoch fetches again" if scans > 0 else "")
        notes.append(
            f"* **first epoch at {lat:g} ms**: gpuload (empty cache: open, fetch, decode, convert, cache write, "
            f"shuffle) delivers {mrows(g.rows_per_s)} and waits {g.starvation:.0%} of the time "
            f"({extra['starvation_ds']:.0%} after its open). The open takes {extra['open_s']:.2f} s of its "
            f"{g.seconds:.2f} s ({orq}: {footers} footers{scan_text}). "
            f"It fetched {r.bytes / 1e6:.0f} MB of the {stored / 1e6:.0f} MB stored, in {r.requests} requests "
            f"(p50/p90 {r.latency_p50_s * 1e3:.0f}/{r.latency_p90_s * 1e3:.0f} ms); its last cache writes ended "
            f"{extra['flush_s']:.2f} s after the last batch; `gpuload.diagnose(ds.stats())` names "
            f"`{extra['diagnosis'].limiting}`. The naive loop delivers {mrows(n.rows_per_s)}, waiting "
            f"{n.starvation:.0%}, in {nr.parquet_get} Parquet GETs ({nr.parquet_get / args.files:.1f} per object: "
            f"s3fs's readahead cache reads {_block_mib()} MiB blocks, so a smaller object comes in one GET after "
            f"the footer's): {ratio:.2f}x"
            + ("" if target is None else f", target >= {target}x {'met' if ratio >= target else 'not met'}") + ".")
    b = cached["best"]
    ratio = b["remote"] / b["local"]
    lines.append(f"| cached epoch (remote source at {cached['latency']:g} ms): rows/s | {mrows(b['remote'])} | "
                 f"{mrows(b['local'])} (gpuload on a local copy, cached) | {ratio:.2f}x | >= 0.9x (~1) | "
                 f"{'yes' if ratio >= 0.9 else 'no'} |")
    pr = cached["paired"]
    notes.append(f"* **cached epoch**: with its cache full, the remote source (at {cached['latency']:g} ms) gives "
                 f"{ratio:.2f}x the local copy's best rows/s (median of the {len(pr)} paired passes' ratios "
                 f"{pr[len(pr) // 2]:.2f}x, range {pr[0]:.2f}-{pr[-1]:.2f}x; consumer: a sum over every tensor, no sleep, so the loader "
                 "and not the step sets the pace; shuffle=True, the default).")
    e = cached["epochs"]
    lines.append(f"| requests during {cached['epochs_n']} cached epochs | {e.total} ({e}) | | | 0 Parquet GETs | "
                 f"{'yes' if e.parquet_get == 0 else 'no'} |")
    notes.append(f"* **requests during cached epochs**: the server got {e.total} requests in {cached['epochs_n']} "
                 f"cached epochs ({e}); opening the cached remote dataset made {cached['open'].total} "
                 f"({cached['open']}); chunks it decoded from Parquet: {cached['decoded']}; its own count: "
                 f"{cached['remote_stats']}.")
    gs, bs_ = min(rs["gpuload_s"]), min(rs["baseline_s"])
    ratio = gs / bs_
    lines.append(f"| restart, {args.small_files:,} cached objects at {rs['latency']:g} ms: s to first batch | "
                 f"{gs:.2f} s | {bs_:.2f} s (list + `pq.read_metadata` of every object via s3fs) | {ratio:.3f}x "
                 f"({1 / ratio:.0f}x less) | <= 0.05x (20x less) | {'yes' if ratio <= 0.05 else 'no'} |")
    notes.append(f"* **restart**: a new `ParquetDataset` over {rs['files']:,} fully cached objects reaches its "
                 f"first batch in {gs:.2f} s ({rs['open_s']:.2f} s of it in the constructor; footers: "
                 f"{rs['footers_cached']} from the cache, "
                 f"{rs['footers_read']} read), against {bs_:.2f} s to list the objects and read their footers one "
                 f"by one ({rs['baseline_req']}): {1 / ratio:.0f}x less.")
    q = rs["gpuload_req"]
    lines.append(f"| requests during the cached open (restart) | {q.total} ({q}) | {rs['baseline_req'].total} "
                 f"({rs['baseline_req']}) | | 0 Parquet GETs | {'yes' if q.parquet_get == 0 else 'no'} |")
    only_listing = q.parquet_get == 0 and q.other == 0
    notes.append(f"* **requests during the cached open**: {q}"
                 + ("; listing is the only traffic of a cached restart." if only_listing else
                    "; a cached restart should only list."))
    if "cold_open_s" in rs:
        c = rs["cold_open_s"]
        lines.append(f"| open, {args.small_files:,} objects, empty cache, at {rs['latency']:g} ms: s (informational) | "
                     f"{c:.2f} s ({rs['cold_open_req']}) | {bs_:.2f} s (list + `pq.read_metadata`) | {c / bs_:.2f}x | "
                     "| |")
        cr = rs["cold_open_req"]
        notes.append(f"* **open on an empty cache** (no target): gpuload's first open of the same objects takes "
                     f"{c:.2f} s, {c / bs_:.2f}x the footer loop: {cr} ({cr.total / args.small_files:.1f} per "
                     f"object; {c / max(1, cr.total) * 1e3:.0f} ms of open per request, at {rs['latency']:g} ms of "
                     "latency per request).")
    return "\n".join(lines), notes


def plot(first: dict, path: pathlib.Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats = list(first)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ("gpuload (empty cache)", "naive s3fs + iter_batches loop")
    for i, (style, label) in enumerate(zip(("o-", "s--"), labels)):
        ax.plot(lats, [100 * first[x][i].starvation for x in lats], style, label=label)
        ax2.plot(lats, [first[x][i].rows_per_s / 1e6 for x in lats], style, label=label)
    ax.set_ylabel("starvation: % of wall time waiting for data")
    ax.set_ylim(0, 100)
    ax2.set_ylabel("first epoch, million rows/s")
    ax2.set_ylim(0, None)
    for a in (ax, ax2):
        a.set_xlabel("per-request latency (ms)")
        a.set_xticks(lats)
        a.grid(alpha=0.3)
        a.legend(loc="lower left")
    fig.suptitle(f"First epoch from S3 (loopback moto, {args.bandwidth / 1e6:.0f} MB/s per response): {args.rows:,} rows, "
                 f"{args.step_ms:g} ms sleep per {args.batch_size:,}-row batch, 2-core VM", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_latencies(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--step-ms", type=float, default=4.0, help="simulated training step per batch, sleep (default 4)")
    ap.add_argument("--latencies", type=parse_latencies, default=[0.0, 20.0, 50.0],
                    help="per-request latencies in ms for the first epoch (default 0,20,50)")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="bytes/s per response (default 200e6)")
    ap.add_argument("--repeat", type=int, default=3, help="passes per measurement; the best is kept (default 3)")
    ap.add_argument("--cached-repeat", type=int, default=7,
                    help="cached epochs per loader, the best is kept (default 7: they are short)")
    ap.add_argument("--small-files", type=int, default=1000, help="objects of the restart dataset (default 1000)")
    ap.add_argument("--small-rows", type=int, default=300, help="rows per object of the restart dataset (default 300)")
    ap.add_argument("--restart-latency", type=float, default=20.0,
                    help="latency in ms of the cached-epoch and restart measurements (default 20)")
    ap.add_argument("--naive-budget-s", type=float, default=120.0,
                    help="stop a naive first epoch after this many seconds and extrapolate its rows/s (default 120)")
    ap.add_argument("--no-cold-open", dest="cold_open", action="store_false",
                    help="skip timing gpuload's open of the small objects on an empty cache")
    ap.add_argument("--server-in-process", action="store_true",
                    help="run the S3 server on threads of this process (default: a child process)")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Remote' section gets the results")
    ap.add_argument("--plot", type=pathlib.Path,
                    help="starvation vs latency figure (default with --out: remote_starvation.png beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-bench-remote-"))
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    if load0 > 0.5:
        say(f"warning: load average {load0:.2f} before starting; other processes will add noise")
    server = None
    try:
        cols = clicklog_columns()
        say(f"generating {args.rows:,} rows in {args.files} files and {args.small_files:,} objects of "
            f"{args.small_rows:,} rows under {work} ...")
        files = write_clicklog(work / "data", rows=args.rows, files=args.files, row_group_rows=65536)
        small = write_clicklog(work / "small", rows=args.small_files * args.small_rows, files=args.small_files,
                               row_group_rows=65536)
        server = Server(in_process=args.server_in_process)
        say("uploading ...")
        server.upload(work / "data", "gpuload-bench-click", "click/")
        server.upload(work / "small", "gpuload-bench-small", "small/")
        first = first_epochs(server, "gpuload-bench-click/click/", cols, work, args, args.rows)
        cached = cached_epochs(server, "gpuload-bench-click/click/", cols, work, args, work / "data")
        rs = restart(server, "gpuload-bench-small/small/", cols, work, args)
        stored = sum(p.stat().st_size for p in files)
        table, notes = build_table(first, cached, rs, args, stored)
        mib = stored / 2**20
        info = {
            "machine": machine() + " (a 2-core CPU VM shared with other jobs)",
            "server": (f"moto S3 on 127.0.0.1 ({'threads of this process' if args.server_in_process else 'a child process'}"
                       f", same cores), per-request latency as given, bandwidth capped at {args.bandwidth / 1e6:.0f} "
                       "MB/s per response (not in total: concurrent requests each get it)"),
            "dataset": (f"{args.rows:,} rows in {args.files} Parquet files ({mib:.0f} MiB, snappy, 65,536-row row "
                        f"groups, bench_cpu.py's click log); restart: {args.small_files:,} objects of "
                        f"{args.small_rows:,} rows ({sum(p.stat().st_size for p in small) / 2**20:.0f} MiB); "
                        f"batch_size {args.batch_size:,}; columns clicklog_columns() (dense [N,13] float32, sparse "
                        "[N,8] int64, label int8, history list<int64>)"),
            "consumer": (f"sum of every tensor plus a {args.step_ms:g} ms sleep per batch (first epochs), the sum "
                         f"only (cached epochs); torch.set_num_threads({args.torch_threads})"),
            "method": (f"best of {args.repeat} passes ({args.cached_repeat} for cached epochs, after one warm-up "
                       "epoch each), gpuload and the baseline interleaved; every first epoch and "
                       "restart uses a new s3fs instance (no listing cache or pooled connections from an earlier "
                       "pass); starvation = time inside next() / wall time, from the loop's first next() (the "
                       "dataset's open included) to its last batch"),
            "code": git_revision(),
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_remote.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average {load0:.2f} at start, "
                       f"{os.getloadavg()[0]:.2f} at end",
        }
        print(table)
        print()
        print("\n".join(notes))
        print()
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        figure = args.plot or (args.out.parent / "remote_starvation.png" if args.out else None)
        if figure:
            plot(first, figure, args)
            say(f"wrote {figure}")
        if args.out:
            fig_line = f"![starvation vs latency]({os.path.relpath(figure, args.out.parent)})\n\n" if figure else ""
            section = (f"## Remote\n\n{table}\n\nRows/s in millions, or seconds; ratio is gpuload / baseline "
                       "(rows/s: higher is better; seconds: lower is better).\n\n" + "\n".join(notes) + "\n\n"
                       + fig_line + "".join(f"* **{k}**: {v}\n" for k, v in info.items()))
            replace_section(args.out, "## Remote", section)
            say(f"wrote the '## Remote' section of {args.out}")
    finally:
        if server is not None:
            server.close()
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
