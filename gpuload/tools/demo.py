"""The ``gpuload demo``: gpuload against a naive per-batch Parquet loop, same training step.

It writes a synthetic click log (:mod:`gpuload.synth`), runs two epochs through a
:class:`~gpuload.ParquetDataset` (the first builds the cache, the second reads it) and
one epoch through the loop people write by hand (pyarrow ``iter_batches`` ->
``to_pandas`` -> ``torch.tensor`` on the training thread), feeding each batch to the
same training step, and reports rows/s and the fraction of time spent waiting for data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..batch import Ragged
from ..synth import clicklog_columns
from ..observe.watch import watch

__all__ = ["LoopResult", "timed_loop", "naive_batches", "simulated_step", "MlpStep", "run_demo", "report"]


@dataclass(frozen=True)
class LoopResult:
    """One pass of a loader through a training step. Times in seconds."""

    name: str
    rows: int
    batches: int
    seconds: float
    waiting: float  # time the training thread spent inside next() on the loader

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else float("nan")

    @property
    def wait_fraction(self) -> float:
        """Fraction (0 to 1) of the loop's wall time spent waiting for the next batch."""
        return self.waiting / self.seconds if self.seconds else float("nan")


def timed_loop(name: str, batches: Iterable[dict], step: Callable[[dict], None],
               progress: Callable[[int], None] | None = None) -> LoopResult:
    """Feed every batch of ``batches`` to ``step``, timing the waits for data (with :func:`gpuload.watch`)."""
    loader = watch(batches, sample_util=False)
    for batch in loader:
        step(batch)
        if progress is not None:
            progress(len(batch["label"]))
    s = loader.stats()
    return LoopResult(name, s.rows, s.batches, s.wall_s, s.wait_s)


def _whole_batches(files, batch_size: int, names: list):
    """The files' rows in order, in tables of ``batch_size`` rows (the last may be short): each
    file's ``iter_batches``, its tail carried into the next file's first batch, so that the loop
    takes as many steps as gpuload's (a short batch at every file's end would add steps and
    flatter gpuload's epochs)."""
    pending, have = [], 0
    for path in files:
        for rb in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=names):
            pending.append(rb)
            have += rb.num_rows
            while have >= batch_size:
                t = pa.Table.from_batches(pending)
                yield t.slice(0, batch_size)
                rest = t.slice(batch_size)
                pending, have = rest.to_batches(), rest.num_rows
    if have:
        yield pa.Table.from_batches(pending)


def naive_batches(files, batch_size: int, columns: dict | None = None):
    """The hand-written loader: per batch, pyarrow -> pandas -> torch on the calling thread (batches
    of ``batch_size`` rows across file ends, as gpuload's)."""
    columns = columns or clicklog_columns()
    names = [c for v in columns.values() for c in ([v] if isinstance(v, str) else v)]
    for table in _whole_batches(files, batch_size, names):
        df = table.to_pandas()
        out = {}
        for name, cols in columns.items():
            if isinstance(cols, str) and df[cols].dtype == object:  # a list column
                lists = df[cols].to_list()
                lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
                offsets = torch.zeros(len(lists) + 1, dtype=torch.int64)
                offsets[1:] = torch.cumsum(lengths, 0)
                values = torch.tensor(np.concatenate(lists) if lists else [], dtype=torch.int64)
                out[name] = Ragged(values, offsets)
            elif isinstance(cols, str):
                out[name] = torch.tensor(df[cols].to_numpy())
            else:
                out[name] = torch.tensor(df[cols].to_numpy())
        yield out


def simulated_step(ms: float) -> Callable[[dict], None]:
    """A training step that takes ``ms`` milliseconds without using the CPU (a GPU step)."""
    def step(batch: dict) -> None:
        time.sleep(ms / 1000.0)
    return step


class MlpStep:
    """A small real model: embeddings of the ids and history, an MLP over everything, SGD."""

    def __init__(self, dense: int = 13, sparse: int = 8, ids: int = 100_000, dim: int = 16, seed: int = 0,
                 device="cpu"):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.emb = torch.nn.EmbeddingBag(ids, dim, mode="sum")
        self.cat = torch.nn.Embedding(ids, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dense + dim * (sparse + 1), 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))
        for m in (self.emb, self.cat, self.mlp):
            m.to(self.device)
        params = list(self.emb.parameters()) + list(self.cat.parameters()) + list(self.mlp.parameters())
        self.opt = torch.optim.SGD(params, lr=0.01)
        self.loss = None

    def __call__(self, batch: dict) -> None:
        batch = {k: Ragged(*(t.to(self.device) for t in v)) if isinstance(v, Ragged) else v.to(self.device)
                 for k, v in batch.items()}  # no-op for batches already there
        hist = batch["history"]
        h = self.emb(hist.values, hist.offsets[:-1])
        c = self.cat(batch["sparse"]).flatten(1)
        x = torch.cat([torch.log1p(batch["dense"].float()), c, h], 1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), batch["label"].float())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.loss = loss.detach().item()


def run_demo(workdir, *, rows: int = 2_000_000, files: int = 8, batch_size: int = 16384, step_ms: float = 5.0,
             model: str = "sim", device: str = "auto", progress=None, say=print) -> list[LoopResult]:
    """Run the demo in ``workdir``; returns the three :class:`LoopResult` (cold, warm, naive).

    Parameters
    ----------
    workdir : folder for the generated data and cache (pathlib.Path).
    rows, files : size of the synthetic click log (default 2,000,000 rows in 8 files).
    batch_size : rows per batch (default 16384).
    step_ms : duration of the simulated training step in milliseconds (default 5).
    model : ``"sim"`` (simulated step) or ``"mlp"`` (a small real model on ``device``).
    device : where gpuload puts batches (``"auto"``, ``"cpu"``, ``"cuda"``).
    progress : optional ``progress(name, total_rows)`` -> callable(rows) for progress bars.
    say : where status lines go.
    """
    from ..dataset import ParquetDataset
    from ..device import resolve_device
    from ..synth import write_clicklog

    dev = resolve_device(device)  # a bad device fails before any data is generated
    t0 = time.perf_counter()
    paths = write_clicklog(workdir / "data", rows=rows, files=files, row_group_rows=65536)
    say(f"generated {rows:,} rows in {files} Parquet files ({sum(p.stat().st_size for p in paths) / 2**20:.0f} MiB) "
        f"in {time.perf_counter() - t0:.1f} s")
    ds = ParquetDataset(workdir / "data", columns=clicklog_columns(), batch_size=batch_size,
                        cache_dir=workdir / "cache", device=device)
    step = MlpStep(device=dev) if model == "mlp" else simulated_step(step_ms)
    bar = progress or (lambda name, total: None)
    results = []
    for epoch, name in ((0, "gpuload, epoch 1 (decode + build cache)"), (1, "gpuload, epoch 2 (from cache)")):
        ds.set_epoch(epoch)
        ds.preload_next = epoch == 0  # the last epoch loads nothing ahead for an epoch that will not come
        results.append(timed_loop(name, ds, step, bar(name, rows)))
    results.append(timed_loop("naive pyarrow->pandas->torch", naive_batches(paths, batch_size), step,
                              bar("naive loop", rows)))
    return results


def report(results: list[LoopResult]) -> str:
    """A plain-text table of demo results, with the speed-up over the last (naive) row."""
    base = results[-1].rows_per_s
    lines = [f"{'loader':44} {'rows/s':>12} {'waiting for data':>17} {'vs naive':>9}"]
    for r in results:
        lines.append(f"{r.name:44} {r.rows_per_s:12,.0f} {r.wait_fraction:16.1%} {r.rows_per_s / base:8.1f}x")
    return "\n".join(lines)
