"""A Python-bound training step under each loader: how much each slows the step, side by side.

A GPU training step is mostly Python launching kernels. This step is ``--ops`` tiny torch
additions on the training thread (no sleep): its time alone is measured in each loader's own
process before the loader starts, then under the loader in epochs after the first (gpuload's
cached ones), every row checked once per epoch. Loaders: gpuload (default row shuffle and
``shuffle=False``), a torchdata.nodes pipeline (threads) and a torch DataLoader (worker
processes) over row groups, as ``bench_peers.py`` configures them. Each runs in a process of its
own, in interleaved rounds; the table gives medians over rounds and epochs.

    python benchmarks/bench_python_step.py                       # 8M rows, 2 rounds
    python benchmarks/bench_python_step.py --rows 1000000 --repeat 1 --workdir /tmp/pystep
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = pathlib.Path(__file__).parent
LOADERS = ("gpuload", "gpuload-noshuffle", "torchdata-nodes", "torch-dataloader")


def _step(ops: int):
    import torch

    x = torch.ones(16)

    def step():
        y = x
        for _ in range(ops):
            y = y + x
        return y
    return step


def run_one(loader: str, data: str, rows: int, ops: int, epochs: int, batch_size: int) -> dict:
    """In this process: the step alone, then ``epochs`` epochs of ``loader`` under it (the first not reported)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    sys.path[:0] = [str(HERE / "peers"), str(HERE)]
    step = _step(ops)
    for _ in range(50):
        step()
    t0 = time.perf_counter()
    for _ in range(300):
        step()
    alone = (time.perf_counter() - t0) / 300
    from gpuload_runner import Gpuload
    from torch_loaders import DataLoaderPeer, NodesPeer

    make, variant = {"gpuload": (Gpuload, "default"), "gpuload-noshuffle": (Gpuload, "noshuffle"),
                     "torchdata-nodes": (NodesPeer, ""), "torch-dataloader": (DataLoaderPeer, "")}[loader]
    out = []
    with tempfile.TemporaryDirectory(prefix="pystep-") as work:  # the loader's cache, removed with it
        peer = make(types.SimpleNamespace(data=data, batch_size=batch_size, work=work, rows=rows, max_rows=0,
                                          variant=variant, window=0))
        peer.prepare()
        for e in range(epochs):
            seen = np.zeros(rows, np.uint8)
            in_step, n, t0 = 0.0, 0, time.perf_counter()
            for b in peer.epoch(e):
                seen[b["row_id"].numpy()] += 1
                a = time.perf_counter()
                step()
                in_step += time.perf_counter() - a
                n += 1
            peer.after_epoch(e)
            secs = time.perf_counter() - t0
            if not (seen == 1).all():
                raise SystemExit(f"{loader} epoch {e}: {int((seen == 1).sum()):,} of {rows:,} rows delivered once")
            if e:
                out.append({"epoch_s": secs, "step_ms": in_step / n * 1e3, "waiting": (secs - in_step) / secs})
        peer.close()
    return {"loader": loader, "alone_ms": alone * 1e3, "epochs": out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--ops", type=int, default=1500, help="tiny torch additions per step (about 2-3 ms here)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is not reported")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--workdir", default=None, help="where the data is (made if missing); default a temporary folder")
    ap.add_argument("--out", default=None, help="markdown file to append the table to")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one loader in this process
    args = ap.parse_args(argv)
    if args.one:
        data = os.path.join(args.workdir, "data")
        print(json.dumps(run_one(args.one, data, args.rows, args.ops, args.epochs, args.batch_size)))
        return
    loaders = [x for x in args.loaders.split(",") if x]
    unknown = set(loaders) - set(LOADERS)
    if unknown:
        raise SystemExit(f"--loaders: unknown {sorted(unknown)} (choose from {', '.join(LOADERS)})")
    sys.path.insert(0, str(HERE))
    from bench_step import publish

    remove = args.workdir is None
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="pystep-"))
    data = work / "data"
    if not data.exists():
        from gpuload.synth import write_clicklog

        sys.path.insert(0, str(HERE / "peers"))
        from common import DENSE, SPARSE

        write_clicklog(data, rows=args.rows, files=args.files, dense=DENSE, sparse=SPARSE, list_max=20)
    load0 = os.getloadavg()
    results: dict[str, list] = {x: [] for x in loaders}
    for r in range(args.repeat):
        for x in loaders:
            cmd = [sys.executable, __file__, "--one", x, "--workdir", str(work), "--rows", str(args.rows),
                   "--ops", str(args.ops), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if got.returncode:
                err = got.stderr.strip()
                raise SystemExit(f"{x}: {err.splitlines()[-1] if err else got.returncode}")
            results[x].append(json.loads(got.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, {x}: done", file=sys.stderr)
    lines = ["", f"### A Python-bound step under each loader ({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             "| loader | epoch | step alone | step under the loader | slowdown | waiting |",
             "|---|---:|---:|---:|---:|---:|"]
    for x in loaders:
        eps = [e for run in results[x] for e in run["epochs"]]
        alone = statistics.median(run["alone_ms"] for run in results[x])
        under = statistics.median(e["step_ms"] for e in eps)
        slow = statistics.median(e["step_ms"] / run["alone_ms"] for run in results[x] for e in run["epochs"])
        lines.append(f"| {x} | {statistics.median(e['epoch_s'] for e in eps):.2f} s | {alone:.2f} ms | {under:.2f} ms"
                     f" | {slow:.2f}x | {statistics.median(e['waiting'] for e in eps):.0%} |")
    lines += ["", f"{args.rows:,} rows, batch {args.batch_size:,}, step: {args.ops:,} additions of 16-element "
              f"tensors on the training thread (torch threads 1); medians of {args.repeat} interleaved rounds x "
              f"{args.epochs - 1} epochs after the first; every row once per epoch; {platform.processor() or 'CPU'}, "
              f"{os.cpu_count()} cores; load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end", ""]
    publish("\n".join(lines), args.out, work, remove)


if __name__ == "__main__":
    main()
