"""Peers benchmark: gpuload beside the loaders users would pick instead, on the same data, consumer and step.

One click log (``gpuload.synth.write_clicklog``: row_id, label, 13 float32, 26 int64 ids, a list<int64> of
0-20 ids), batch 8,192, and the consumer of ``bench_step.py`` (``clone()`` of every tensor, then a sleep of
``--step-ms``). Every loader runs in a process of its own (``benchmarks/peers/<runner>.py``), with the
project's interpreter where it installs beside gpuload's dependencies, otherwise with a venv of its own,
``.venv-peer-<name>`` at the repository's root, made on first use (Petastorm: ``.venv-petastorm``, the
recipe of ``bench_step.py``). Each process runs two epochs: the first from Parquet (any conversion into
the loader's own format or cache counts in it, and is also reported alone) and a second, cached one;
it marks every delivered ``row_id`` and fails the row unless each row came exactly once. Peak RSS is the
largest sampled sum over the process and its children. Once per consumer: ``--threads 1,default``
(``torch.set_num_threads(1)``, and torch's default).

    python benchmarks/bench_peers.py                                      # 8M rows, every loader
    python benchmarks/bench_peers.py --rows 300000 --loaders gpuload,naive,ideal,ideal-window
    python benchmarks/bench_peers.py --out docs/benchmarks.md --workdir /tmp/peers --keep
    python benchmarks/bench_peers.py --loaders ideal,gpuload,gpuload-block,daft --threads 1 --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RUNNERS = HERE / "peers"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(RUNNERS))

from bench_cpu import OtherCPU, machine, replace_section, say  # noqa: E402
from bench_step import DENSE, SPARSE, petastorm_python  # noqa: E402

#: pip installs of each peer venv, in order (torch first, from the CPU wheel, so a peer's torch
#: requirement is met without pulling CUDA); ``.venv-peer-<key>`` at the repository's root
VENVS = {
    "ray": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "aiohttp", "ray[data]"]],
    "daft": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "daft"]],
    "lance": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "pylance"]],
    "streaming": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "pyarrow", "mosaicml-streaming"]],
    "litdata": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "pyarrow", "litdata"]],
    "datasets": [["torch==2.13.0"], ["torch==2.13.0", "numpy", "psutil", "datasets"]],
}


class Spec:
    """One loader: its runner file, variant, venv (None: the project's; "petastorm": bench_step's) and the
    default time limit of an epoch (0: none) and row budget (0: all rows; whole row groups in file order,
    for a runner that honours it) for loaders far too slow for the whole data."""

    def __init__(self, runner, variant="", venv=None, limit_s=0.0, max_rows=0):
        self.runner, self.variant, self.venv, self.limit_s, self.max_rows = runner, variant, venv, limit_s, max_rows


LOADERS = {
    "read_table": Spec("reference.py", "read_table"),
    "ideal": Spec("reference.py", "ideal_seq"),
    "ideal-window": Spec("reference.py", "ideal_window"),
    "ideal-block": Spec("reference.py", "ideal_block"),  # gpuload-block's shuffle strength
    "ideal-window-stacked": Spec("reference.py", "ideal_window_stacked"),  # gpuload-stacked's outputs and shuffle
    "gpuload": Spec("gpuload_runner.py", "default"),
    "gpuload-noshuffle": Spec("gpuload_runner.py", "noshuffle"),
    "gpuload-block": Spec("gpuload_runner.py", "block"),
    "gpuload-stacked": Spec("gpuload_runner.py", "stacked"),
    "gpuload-nice": Spec("gpuload_runner.py", "nice"),
    "gpuload-buffered": Spec("gpuload_runner.py", "buffered"),
    "gpuload-off": Spec("gpuload_runner.py", "off"),  # cache_io="off": a job of one epoch
    "gpuload-chunks": Spec("gpuload_runner.py", "chunks"),  # shuffle="chunks": torchdata.nodes' shuffle
    "gpuload-chunks-off": Spec("gpuload_runner.py", "chunks-off"),
    "gpuload-wide": Spec("gpuload_runner.py", "wide"),  # num_threads for every core: for many-core nodes
    "naive": Spec("reference.py", "naive"),
    "torch-dataloader": Spec("torch_loaders.py", "dataloader"),
    "torchdata-nodes": Spec("torch_loaders.py", "nodes"),
    "polars": Spec("polars_runner.py"),
    "ray": Spec("ray_runner.py", venv="ray"),
    "daft": Spec("daft_runner.py", venv="daft"),
    "lance": Spec("lance_runner.py", "take", venv="lance", limit_s=120),  # ~12k rows/s at 8M rows: 11 min an epoch
    "lance-scan": Spec("lance_runner.py", "scan", venv="lance"),
    "streaming": Spec("streaming_runner.py", venv="streaming", limit_s=300, max_rows=2_000_000),
    "litdata": Spec("litdata_runner.py", venv="litdata", limit_s=150, max_rows=500_000),
    "hf-datasets": Spec("hf_datasets_runner.py", venv="datasets", limit_s=150),
    "hf-iterable": Spec("hf_datasets_runner.py", "iterable", venv="datasets"),  # its documented fast shuffle
    "petastorm": Spec("petastorm_runner.py", venv="petastorm"),
}
#: what runs in the project's venv only (the test's set; no installs)
LOCAL = [k for k, s in LOADERS.items() if s.venv is None]


def venv_python(name: str | None) -> str:
    """The interpreter for a runner: this one, or a peer's venv made on first use."""
    if name is None:
        return sys.executable
    if name == "petastorm":
        return petastorm_python("auto")
    venv = ROOT / f".venv-peer-{name}"
    python = venv / "bin" / "python"
    if not python.exists():
        say(f"making {venv} ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for pkgs in VENVS[name]:
            subprocess.run([str(python), "-m", "pip", "install", "-q", *pkgs], check=True)
    return str(python)


def shuffle_window_rows(files, work: pathlib.Path, bs: int) -> int:
    """Rows of gpuload's default shuffle window on this data (chunks per window x rows per chunk), what the
    ideal windowed loader and peers with a shuffle buffer are given."""
    import gpuload
    from gpuload_runner import PER_COLUMN

    ds = gpuload.ParquetDataset(files, PER_COLUMN, batch_size=bs, cache_dir=work / "window-probe", device="cpu")
    return ds.options.shuffle_window * round(ds.num_rows / len(ds.reader.chunks))


def run_one(key: str, spec: Spec, args, data: pathlib.Path, work: pathlib.Path, rows: int, window: int,
            threads: str) -> dict:
    """Runs one loader at one consumer in a process of its own; its JSON, or {"error": why}."""
    out_dir = work / "run" / f"{key}-t{threads}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    limit = spec.limit_s if args.limit_s is None else args.limit_s
    try:
        python = venv_python(spec.venv)
    except Exception as e:  # noqa: BLE001  (a venv that cannot be made is a row saying so)
        return {"error": f"no venv: {e}"}
    cmd = [python, str(RUNNERS / spec.runner), "--data", str(data), "--work", str(out_dir), "--rows", str(rows),
           "--batch-size", str(args.batch_size), "--step-ms", str(args.step_ms), "--threads", threads,
           "--window", str(window), "--limit-s", str(limit), "--variant", spec.variant,
           "--max-rows", str(spec.max_rows if args.max_rows is None else args.max_rows)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) if spec.venv is None else ""
    say(f"{key} ({threads} thread{'s' if threads != '1' else ''}): " + " ".join(cmd[1:2]))
    t0 = time.perf_counter()
    # a session of its own: on a timeout the runner and every process it started (workers, Ray's daemons) go
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        say(f"  {key} timed out after {args.timeout:g} s:\n{stderr[-3000:]}")
        return {"error": f"timed out after {args.timeout:g} s (--timeout)"}
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        say(f"  {key} failed ({p.returncode}):\n{stderr[-3000:]}")
        return {"error": f"exit {p.returncode}: " + (stderr.strip().splitlines() or ["?"])[-1][:300]}
    res = json.loads(lines[-1])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    for ep in res["epochs"]:
        say(f"  epoch {ep['epoch']}: {ep['rows_per_s'] / 1e6:.3f} M rows/s, waiting {ep['wait_fraction']:.0%}, "
            f"verified {ep['verified']}")
    return res


def combine(runs: list[dict]) -> dict:
    """One loader's repeated runs (interleaved with the others', ``--repeat``) as one result: each epoch's
    medians (rows/s, seconds, waiting, first batch, conversion), its rows/s range over the runs that
    succeeded (``rows_per_s_range``, with ``runs`` and ``failed``), the median peak RSS; an epoch is
    verified only if it was in every run. A single run is returned as it is; all failed: the first error."""
    good = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not good:
        return runs[0]
    out = dict(good[0])
    epochs = []
    for i in range(min(len(r["epochs"]) for r in good)):
        eps = [r["epochs"][i] for r in good]
        ep = dict(eps[0])
        for k in ("rows_per_s", "seconds", "wait_fraction", "first_batch_s", "conversion_s"):
            xs = [e[k] for e in eps if e.get(k) is not None]
            if xs:
                ep[k] = round(statistics.median(xs), 1 if k == "rows_per_s" else 4)
        ep["rows_per_s_range"] = [min(e["rows_per_s"] for e in eps), max(e["rows_per_s"] for e in eps)]
        ep["verified"] = next((e["verified"] for e in eps if e["verified"] is not True), True)
        epochs.append(ep)
    out["epochs"] = epochs
    out["peak_rss_bytes"] = statistics.median(r["peak_rss_bytes"] for r in good)
    out["runs"], out["failed"] = len(good), [r["error"] for r in runs if "error" in r]
    return out


# -- the report -----------------------------------------------------------------------------------------------
def _rate(x: float) -> str:
    return f"{x / 1e6:.2f} M" if x >= 1e5 else f"{x / 1e3:.1f} k"


def _rates(ep: dict) -> str:
    """An epoch's rows/s; with repeated runs, their median and range."""
    lo_hi = ep.get("rows_per_s_range")
    if not lo_hi or lo_hi[0] == lo_hi[1]:
        return _rate(ep["rows_per_s"])
    return f"{_rate(ep['rows_per_s'])} ({_rate(lo_hi[0])}-{_rate(lo_hi[1])})"


def _verified(res: dict, total: int) -> str:
    bad = [f"epoch {ep['epoch']}: {ep['verified']}" for ep in res["epochs"] if ep["verified"] is not True]
    if bad:
        return "; ".join(bad)
    budget = res["epochs"][0]["rows"]
    return "yes" if budget >= total else f"yes, of its {budget:,}-row budget"


def _failed(res: dict) -> str:
    failed = res.get("failed")
    return f"; {len(failed)} of {res['runs'] + len(failed)} runs failed: {failed[0]}" if failed else ""


def table(results: dict, threads: str, total: int) -> str:
    """One consumer's table: a row per loader, ratios against gpuload's default (gpuload / the loader)."""
    ref = results.get(("gpuload", threads))
    ref = None if ref is None or "error" in ref else ref["epochs"]
    lines = ["| loader | shuffle | 1st epoch rows/s | waiting | first batch | of which conversion "
             "| cached epoch rows/s | waiting | peak RSS | gpuload default / this (1st, cached) | every row once |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (key, t), res in results.items():
        if t != threads:
            continue
        if "error" in res:
            lines.append(f"| {key} | | | | | | | | | | not run: {res['error']} |")
            continue
        eps = res["epochs"]
        e1, e2 = eps[0], eps[-1]
        conv = e1.get("conversion_s") or 0
        ratio = "" if ref is None or len(eps) < 2 else \
            f"{ref[0]['rows_per_s'] / e1['rows_per_s']:.2f}x, {ref[-1]['rows_per_s'] / e2['rows_per_s']:.2f}x"
        lines.append(
            f"| {res['loader']} | {res['shuffle']} | {_rates(e1)} | {e1['wait_fraction']:.0%} "
            f"| {e1['first_batch_s'] if e1['first_batch_s'] is not None else '-'} s | {conv:.2f} s "
            f"| {_rates(e2)} | {e2['wait_fraction']:.0%} | {res['peak_rss_bytes'] / 2**30:.2f} GiB "
            f"| {ratio} | {_verified(res, total)}{_failed(res)} |")
    return "\n".join(lines)


def replace_block(path: pathlib.Path, block: str) -> None:
    """Replace what lies between the peers markers of ``path`` (they must be there)."""
    start, end = "<!-- peers:start -->\n", "<!-- peers:end -->"
    text = path.read_text()
    a, b = text.index(start) + len(start), text.index(end)
    path.write_text(text[:a] + block + text[b:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loaders", default=",".join(LOADERS),
                    help="comma-separated, from: " + ", ".join(LOADERS) + "; 'local': those in this venv")
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--threads", default="1,default", help="consumer torch threads, comma-separated ('default': "
                                                           "torch's own count)")
    ap.add_argument("--limit-s", type=float, default=None,
                    help="stop every epoch after this many seconds (default: the slow peers' own limits, "
                         "300 s for streaming, 150 s for litdata and hf-datasets; 0: none)")
    ap.add_argument("--max-rows", type=int, default=None,
                    help="row budget of the loaders that honour one (default: their own: 2,000,000 for "
                         "streaming and 500,000 for litdata, whose per-row conversions run at ~60k and ~10k rows/s "
                         "here; 0: all rows)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every loader, in interleaved rounds (each round runs every loader once); the "
                         "tables show each epoch's median rows/s and, in brackets, the range (default 1)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a loader's process is killed")
    ap.add_argument("--workdir", type=pathlib.Path, help="default: a temporary folder, removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the work folder and every loader's converted data")
    ap.add_argument("--json", type=pathlib.Path, help="also write every result as JSON here")
    ap.add_argument("--merge", type=pathlib.Path,
                    help="an earlier run's --json: its rows for the loaders not run now are kept (the tables say "
                         "which rows come from which run)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose '## Peers' section gets the results")
    ap.add_argument("--readme", type=pathlib.Path,
                    help="markdown file whose block between '<!-- peers:start -->' and '<!-- peers:end -->' gets "
                         "the first consumer's table with the machine, date and load average")
    args = ap.parse_args(argv)
    keys = LOCAL if args.loaders == "local" else [k.strip() for k in args.loaders.split(",") if k.strip()]
    unknown = [k for k in keys if k not in LOADERS]
    if unknown:
        ap.error(f"unknown loaders {unknown}; known: {', '.join(LOADERS)}")
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: give at least 1 run per loader")
    threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="gpuload-peers-"))
    t_start, load0, other = time.perf_counter(), os.getloadavg(), OtherCPU().start()
    if load0[0] > 0.5:
        say(f"warning: load average {load0[0]:.2f} at start; the numbers will be noisy")
    try:
        from gpuload.synth import write_clicklog

        data = work / "data"
        if not list(data.glob("*.parquet")):
            say(f"generating {args.rows:,} rows in {args.files} files under {data} ...")
            write_clicklog(data, rows=args.rows, files=args.files, dense=DENSE, sparse=SPARSE, list_max=20)
        files = sorted(data.glob("*.parquet"))
        import pyarrow.parquet as pq
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        window = shuffle_window_rows(files, work, args.batch_size)
        say(f"{rows:,} rows; gpuload's default shuffle window: {window:,} rows")
        runs: dict = {}
        for r in range(args.repeat):  # rounds: a slow minute of a shared machine hits one run of each loader
            if args.repeat > 1:
                say(f"round {r + 1} of {args.repeat}")
            for key in keys:
                for t in threads:
                    runs.setdefault((key, t), []).append(run_one(key, LOADERS[key], args, data, work, rows, window, t))
        results = {kt: combine(rs) for kt, rs in runs.items()}
        load1, other = os.getloadavg(), other.stop()
        merged = None
        if args.merge:  # an earlier run's rows for the loaders not run now, in the loaders' order
            earlier = json.loads(args.merge.read_text())
            kept = {(r["key"], r["threads"]): {k: v for k, v in r.items() if k not in ("key", "threads")}
                    for r in earlier["results"] if r["key"] in LOADERS and r["key"] not in keys}
            results = {(k, t): (results.get((k, t)) or kept[(k, t)]) for k in LOADERS for t in threads
                       if (k, t) in results or (k, t) in kept}
            merged = (f"rows of {', '.join(keys)} from this run; the others from the run of "
                      f"{earlier['info'].get('date', '?')} ({earlier['info'].get('command', '?')}), same machine "
                      f"and data")
        bad = [f"{k} ({t})" for (k, t), r in results.items()
               if "error" not in r and any(ep["verified"] is not True and not str(ep["verified"]).startswith("partial")
                                           for ep in r["epochs"])]
        tables = "\n\n".join(f"Consumer with torch threads = {t}:\n\n" + table(results, t, rows) for t in threads)
        versions: dict = {}  # one line per distinct set of versions (a venv), naming its loaders
        for (key, _), r in results.items():
            if "error" not in r:
                vs = ", ".join(f"{p} {v}" for p, v in sorted(r["versions"].items()))
                if key not in versions.setdefault(vs, []):
                    versions[vs].append(key)
        notes = {key: r["notes"] for (key, _), r in results.items() if "error" not in r and r.get("notes")}
        info = {}
        # the machine was busy before (the load average at the start), or others ran meanwhile (their CPU:
        # the load average at the end counts the benchmark's own processes)
        if rows != 8_000_000 or load0[0] > 0.5 or not other.quiet():
            info["caution"] = (f"{rows:,} rows" + (" (not the benchmark's 8,000,000)" if rows != 8_000_000 else "")
                               + f", load average {load0[0]:.2f} at the start, {other.text()}: a smoke run, "
                                 f"not a result")
        info |= {
            "machine": machine(),
            "dataset": f"{rows:,} rows in {len(files)} Parquet files (snappy, row groups of 65,536), "
                       f"{sum(f.stat().st_size for f in files) / 2**20:.0f} MiB: row_id, label, 13 dense, "
                       f"26 cat, history list<int64>; batch_size {args.batch_size:,}",
            "consumer": f"clone() of every tensor, then sleep {args.step_ms:g} ms; row_ids marked (every row "
                        f"once per epoch or the row says FAILED); torch threads {', '.join(threads)}",
            **({"repeats": f"{args.repeat} interleaved rounds (each runs every loader once); rows/s: the median, "
                              f"in brackets the range; waiting, first batch, conversion and peak RSS: medians"}
               if args.repeat > 1 else {}),
            "epochs": "1st: from Parquet, including opening the loader and any conversion into its own format "
                      "or cache (also shown alone); cached: the 2nd epoch in the same process. Waiting: share of "
                      "the epoch the training thread spent outside its step (conversion included). Peak RSS: the "
                      "largest sampled sum over the loader's process and its children (shared pages count in "
                      "each), or ru_maxrss",
            "gpuload's default shuffle window": f"{window:,} rows",
            "loaders' configuration": "; ".join(f"**{k}**: {v}" for k, v in notes.items()),
            "versions": "; ".join(f"{', '.join(ks)}: {vs}" for vs, ks in versions.items()),
            "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "command": "python benchmarks/bench_peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            **({"merged": merged} if merged else {}),
            "runtime": f"{time.perf_counter() - t_start:.0f} s; load average (1, 5, 15 min) "
                       f"{', '.join(f'{x:.2f}' for x in load0)} at start, "
                       f"{', '.join(f'{x:.2f}' for x in load1)} at end; {other.text()}",
        }
        print(tables)
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        if args.json:
            args.json.write_text(json.dumps({"info": info, "results": [{"key": k, "threads": t, **r}
                                                                        for (k, t), r in results.items()]},
                                            indent=1))
        if args.out:
            section = "## Peers\n\n" + tables + "\n\n" + "".join(f"* **{k}**: {v}\n" for k, v in info.items())
            replace_section(args.out, "## Peers", section + "\n")
        if args.readme:
            block = (f"Consumer with torch threads = {threads[0]} ({info['dataset']}; {info['machine']}; "
                     f"{info['date']}; {info['runtime']}" + (f"; {info['merged']}" if "merged" in info else "")
                     + (f"; caution: {info['caution']}" if "caution" in info else "")
                     + "):\n\n" + table(results, threads[0], rows) + "\n")
            replace_block(args.readme, block)
        if bad:
            say("FAILED verification: " + ", ".join(bad))
        return 1 if bad else 0
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
