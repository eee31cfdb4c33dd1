"""What every peer runner shares: the consumer, the epoch loop, row verification, peak RSS, the JSON line.

Imports only the standard library, NumPy and torch (psutil and pyarrow when present), so it runs in
every peer's venv, Petastorm's pyarrow 14 / NumPy 1 one included. A runner defines a :class:`Peer` and
calls :func:`main`; the harness (``benchmarks/bench_peers.py``) starts one process per runner and
consumer, reads the last line of its stdout (one JSON object) and keeps its stderr for failures.

A batch is a dict of torch tensors; a ragged column (``history``) is a ``(values, offsets)`` pair of
tensors, or an object with ``.values`` and ``.offsets`` (gpuload's ``Ragged``), or a padded
``[rows, n]`` tensor where the loader cannot batch lists (its notes say so).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

DENSE, SPARSE = 13, 26
SCALARS = ["row_id", "label"] + [f"dense_{i}" for i in range(DENSE)] + [f"cat_{i}" for i in range(SPARSE)]
COLUMNS = SCALARS + ["history"]


# -- the consumer ------------------------------------------------------------------------------------
def consume(batch: dict) -> int:
    """Copy every tensor (a host-to-device copy's stand-in); returns the batch's rows."""
    for v in batch.values():
        if isinstance(v, (tuple, list)):
            for t in v:
                t.clone()
        elif hasattr(v, "offsets"):
            v.values.clone()
            v.offsets.clone()
        else:
            v.clone()
    return len(batch["row_id"])


# -- conversions most runners need ---------------------------------------------------------------------
def arrow_to_torch(rb, columns=None) -> dict:
    """A pyarrow RecordBatch or Table -> {column: tensor}, lists as (values, offsets) rebased to 0."""
    import pyarrow as pa

    out = {}
    for name in columns or rb.schema.names:
        col = rb.column(name)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            off = np.asarray(col.offsets, dtype=np.int64)
            vals = col.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]]
            out[name] = (torch.from_numpy(vals), torch.from_numpy(off - off[0]))
        else:
            out[name] = torch.from_numpy(col.to_numpy(zero_copy_only=False))
    return out


def _rows(v) -> int:
    return len(v[1]) - 1 if isinstance(v, (tuple, list)) else len(v)


def _slice(v, a: int, b: int):
    if isinstance(v, (tuple, list)):
        off = v[1][a:b + 1]
        return v[0][int(off[0]):int(off[-1])], off - off[0]
    return v[a:b]


def _cat(parts):
    if isinstance(parts[0], (tuple, list)):
        vals = torch.cat([p[0] for p in parts])
        offs, base = [parts[0][1]], int(parts[0][1][-1])
        for p in parts[1:]:
            offs.append(p[1][1:] + base)
            base += int(p[1][-1])
        return vals, torch.cat(offs)
    return torch.cat(parts)


def rebatch(chunks, bs: int):
    """Chunks of any size (dicts of tensors / (values, offsets)) -> batches of exactly ``bs`` rows, the
    last one shorter; slices are views, only a batch that spans two chunks is copied."""
    pending, have = [], 0
    for c in chunks:
        n = _rows(c["row_id"])
        a = 0
        if pending:
            take = min(bs - have, n)
            pending.append({k: _slice(v, 0, take) for k, v in c.items()})
            have += take
            a = take
            if have < bs:
                continue
            yield {k: _cat([p[k] for p in pending]) for k in c}
            pending, have = [], 0
        while n - a >= bs:
            yield {k: _slice(v, a, a + bs) for k, v in c.items()}
            a += bs
        if a < n:
            pending, have = [{k: _slice(v, a, n) for k, v in c.items()}], n - a
    if pending:
        yield {k: _cat([p[k] for p in pending]) for k in pending[0]}


def pad_lists(values: np.ndarray, offsets: np.ndarray, n: int) -> np.ndarray:
    """Lists given by values/offsets -> [rows, n] int64, zero-padded or truncated."""
    lens = np.diff(offsets)
    row = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(len(values)) - np.repeat(offsets[:-1] - offsets[0], lens)
    out = np.zeros((len(lens), n), np.int64)
    keep = pos < n
    out[row[keep], pos[keep]] = values[keep]
    return out


# -- peak RSS of this process and every process it started ------------------------------------------------
class PeakRSS:
    """Samples the summed RSS of this process and its descendants (psutil) every ``interval`` seconds;
    :meth:`peak` is the largest sample, or at least this process's and its waited-for children's
    ``ru_maxrss``. Pages shared between processes (an object store, shared memory) count in each."""

    def __init__(self, interval: float = 0.1):
        self.max = 0
        self.interval = interval
        self._stop = threading.Event()
        try:
            import psutil
            self._me = psutil.Process()
        except ImportError:
            self._me = None
        self._t = threading.Thread(target=self._run, daemon=True, name="peak-rss")
        self._t.start()

    def _sample(self) -> int:
        total = 0
        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # exited meanwhile
                pass
        return total

    def _run(self):
        while self._me is not None and not self._stop.wait(self.interval):
            try:
                self.max = max(self.max, self._sample())
            except Exception:
                pass

    def peak(self) -> int:
        self._stop.set()
        ru = 1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        return max(self.max, ru)


# -- the runner's frame ---------------------------------------------------------------------------------------
class Peer:
    """One loader. ``prepare()`` converts the data into the loader's own format (its seconds count in the
    first epoch and are reported as conversion); ``epoch(e)`` returns that epoch's batches (0-based).
    ``shuffle``: what the loader shuffles, in words; ``notes``: its configuration; ``versions``: packages."""

    name = "?"
    shuffle = "none"

    def __init__(self, args):
        self.args = args
        self.notes: list[str] = []
        self.versions: dict = {}
        self.rows: int | None = None  # rows it delivers per epoch, when a row budget makes them fewer

    def prepare(self) -> None:
        pass

    def epoch(self, e: int):
        raise NotImplementedError

    def after_epoch(self, e: int) -> None:
        """Work that belongs to the epoch after its last batch (e.g. a cache's last durable write)."""

    def close(self) -> None:
        pass


def run_epoch(peer: Peer, e: int, n_rows: int, step_s: float, limit_s: float | None, prepare: bool) -> dict:
    """One epoch: seconds from asking for it (``prepare`` included for the first) to the end of its last
    step; waiting: inside ``next()`` (and ``prepare``); every delivered ``row_id`` marked once."""
    rows, waited, first, conv, truncated = 0, 0.0, None, 0.0, False
    t0 = time.perf_counter()
    if prepare:
        peer.prepare()
        conv = time.perf_counter() - t0
    if peer.rows is not None:  # a row budget, known once prepared
        n_rows = peer.rows
    seen = np.zeros(n_rows, np.uint8)
    it = iter(peer.epoch(e))
    waited = time.perf_counter() - t0
    while True:
        a = time.perf_counter()
        b = next(it, None)
        waited += time.perf_counter() - a
        if b is None:
            break
        if first is None:
            first = time.perf_counter() - t0
        ids = b["row_id"]
        ids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        seen[ids] += 1  # a row twice in one batch counts once here, but then rows > distinct rows below
        rows += consume(b)
        if step_s:
            time.sleep(step_s)
        if limit_s and time.perf_counter() - t0 > limit_s:
            truncated = True
            break
    if truncated:
        close = getattr(it, "close", None)
        if close:
            close()
    a = time.perf_counter()
    peer.after_epoch(e)
    waited += time.perf_counter() - a
    secs = time.perf_counter() - t0
    distinct = int(np.count_nonzero(seen))
    if truncated:
        ok = distinct == rows and int(seen.max(initial=0)) <= 1
        verified = f"{'partial' if ok else 'FAILED'}: {rows:,} of {n_rows:,} rows in the {limit_s:g} s limit, " \
                   f"{'each once' if ok else f'{distinct:,} distinct'}"
    else:
        ok = rows == n_rows and distinct == n_rows
        verified = True if ok else f"FAILED: {rows:,} rows delivered, {distinct:,} distinct of {n_rows:,}"
    out = {"epoch": e + 1, "rows": rows, "seconds": round(secs, 3), "rows_per_s": round(rows / secs, 1),
           "wait_fraction": round(waited / secs, 4), "first_batch_s": None if first is None else round(first, 3),
           "verified": verified}
    if prepare:
        out["conversion_s"] = round(conv, 3)
    if not ok or verified is not True:
        print(f"{peer.name} epoch {e + 1}: {verified}", file=sys.stderr)
    return out


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--data", required=True, help="folder of the click log's Parquet files")
    ap.add_argument("--work", required=True, help="a folder of this loader's own (its converted data, caches)")
    ap.add_argument("--rows", type=int, required=True, help="rows in the data (row_id 0 .. rows-1)")
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--threads", default="1", help="torch threads of the consumer: a number or 'default'")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--window", type=int, default=0, help="rows of gpuload's default shuffle window")
    ap.add_argument("--limit-s", type=float, default=0, help="stop an epoch after this many seconds (0: never)")
    ap.add_argument("--variant", default="", help="which configuration of the runner")
    ap.add_argument("--max-rows", type=int, default=0,
                    help="a loader that honours it converts and reads only the first row groups holding at least "
                         "this many rows, and is verified against those (0: all)")
    return ap


def files(args) -> list[str]:
    return sorted(os.path.join(args.data, f) for f in os.listdir(args.data) if f.endswith(".parquet"))


def row_groups(args) -> tuple[list, int]:
    """((path, row group) of the data in file order, their rows): all of them, or the first holding at least
    ``--max-rows`` rows (row_id runs 0 .. rows-1 in file order, so those rows are 0 .. their count - 1)."""
    import pyarrow.parquet as pq

    items, n = [], 0
    for p in files(args):
        md = pq.ParquetFile(p).metadata
        for i in range(md.num_row_groups):
            if args.max_rows and n >= args.max_rows:
                return items, n
            items.append((p, i))
            n += md.row_group(i).num_rows
    return items, n


def main(make_peer, doc: str, argv=None) -> None:
    args = parser(doc).parse_args(argv)
    if args.threads != "default":
        torch.set_num_threads(int(args.threads))
    # a training script runs torch on its training thread (building the model) before any loader starts,
    # which fixes that thread's intra-op threads: as here. Else a loader that calls torch.set_num_threads
    # on a thread of its own (torchdata.nodes' thread workers call it with 1) would make the consumer's
    # copies single-threaded, and the multi-threaded consumer's rows would measure a 1-thread one
    torch.get_num_threads()
    rss = PeakRSS()
    t0 = time.perf_counter()
    peer = make_peer(args)
    setup = time.perf_counter() - t0
    epochs = []
    try:
        for e in range(args.epochs):
            epochs.append(run_epoch(peer, e, args.rows, args.step_ms / 1e3, args.limit_s or None, prepare=e == 0))
            print(json.dumps(epochs[-1]), file=sys.stderr, flush=True)
    finally:
        peer.close()
    versions = {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
                **peer.versions}
    try:
        import pyarrow
        versions.setdefault("pyarrow", pyarrow.__version__)
    except ImportError:
        pass
    if peer.rows is not None and peer.rows < args.rows:
        peer.notes.append(f"row budget: the first {peer.rows:,} of {args.rows:,} rows (whole row groups), "
                          "converted and read each epoch")
    print(json.dumps({"loader": peer.name, "shuffle": peer.shuffle, "epochs": epochs, "peak_rss_bytes": rss.peak(),
                      "torch_threads": torch.get_num_threads(), "setup_s": round(setup, 3),
                      "versions": versions, "notes": "; ".join(peer.notes)}), flush=True)


def collate_rows(samples: list) -> dict:
    """Per-row samples (dicts of scalars and NumPy arrays, ``history`` of any length) -> one batch: scalars
    and fixed-size arrays stacked, ``history`` as (values, offsets)."""
    out = {}
    for k in samples[0]:
        vals = [s[k] for s in samples]
        if k == "history":
            lens = np.fromiter((len(v) for v in vals), np.int64, len(vals))
            off = np.zeros(len(vals) + 1, np.int64)
            np.cumsum(lens, out=off[1:])
            out[k] = (torch.from_numpy(np.concatenate(vals).astype(np.int64, copy=False)), torch.from_numpy(off))
        else:
            out[k] = torch.from_numpy(np.stack(vals) if isinstance(vals[0], np.ndarray) else np.asarray(vals))
    return out


def row_samples(table):
    """A pyarrow Table of the click log's columns -> per-row dicts: row_id, label, dense [13] float32,
    cat [26] int64, history (int64, variable length); what the per-row formats (MDS, litdata) store."""
    n = table.num_rows
    dense = np.stack([table.column(f"dense_{i}").to_numpy() for i in range(DENSE)], axis=1)
    cat = np.stack([table.column(f"cat_{i}").to_numpy() for i in range(SPARSE)], axis=1)
    rid, label = table.column("row_id").to_numpy(), table.column("label").to_numpy()
    h = table.column("history").combine_chunks()
    off = np.asarray(h.offsets, dtype=np.int64)
    hv = h.values.to_numpy()
    for i in range(n):
        yield {"row_id": int(rid[i]), "label": int(label[i]), "dense": dense[i], "cat": cat[i],
               "history": hv[off[i]:off[i + 1]]}
