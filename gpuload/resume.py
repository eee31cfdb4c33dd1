"""Resume: the state of an epoch in progress, and the plan of what is left of it.

An epoch's order is a pure function of (fingerprint, seed, epoch, world size, rank)
(:mod:`gpuload.plan`), so where a run stands is a few numbers: the epoch and how many
batches every rank has taken. DDP ranks take the same number of batches, so the state is
the same on every rank: rank 0's state is enough to restore all of them.

Runs of an epoch
----------------
An epoch may be run in several *runs*, one per job that worked on it: ``[Run(W0, k0),
Run(W1, k1), ...]``, where run ``i`` had ``Wi`` ranks that took ``ki`` batches each (a
:class:`Run`; a state writes it as the list ``[Wi, ki]``). The first run follows the
ordinary plan for ``W0`` ranks (``Run(W0, k0, L)``, written ``[W0, k0, L]``: the
node-affine plan of ``W0 / L`` nodes of ``L`` ranks each, see :mod:`gpuload.plan`);
:class:`RunRows` is a run with its rows, batches and each rank's share. When a state is
restored on the same number of ranks (and the same plan) as its last run, that run
simply goes on at batch ``k``: the rest
is bit-identical to a run that was never interrupted. When it is restored on another
number of ranks, a new run begins, over the *rest* of the epoch:

* the rest is, rank after rank of the previous run, the rows each rank had not taken
  yet, in the order that rank would have taken them (so they stay shuffled);
* the new ranks split that stream as :mod:`gpuload.plan` splits an epoch (contiguous
  ranges, every rank the same number of batches, the tail balanced the same way), and
  take their rows in stream order.

So across the runs, every row of the epoch is delivered exactly once, except what the
plan's ``drop_last=True`` drops (fewer than ``W * batch_size`` rows per run) and, with
``drop_last=False``, a rest too small to give every new rank a row (fewer than ``W``
rows, or the ``rest % W`` rows that ``batch_size=1`` cannot balance), which is logged.
A new rank reads only the windows its rows come from: the chunks of the windows still
in progress, and those not started; never a window every row of which was taken.

The state (:meth:`gpuload.ParquetDataset.state_dict`) is a small JSON-serialisable dict::

    {"format": "gpuload.ParquetDataset", "version": 2, "epoch": 3,
     "runs": [[4, 120], [2, 10]],
     "dataset": {"source": "0x...", "rows": ..., "chunks": "0x...", "outputs": {...},
                 "seed": 0, "shuffle": true, "batch_size": 65536, "drop_last": false,
                 "shuffle_window": 4}}

``dataset`` holds what shapes the order; restoring into a dataset where any of it
differs raises a :class:`~gpuload.ConfigError` that names the fields. Its ``source``
(:func:`gpuload.sources.listing.fingerprint`) does not hold where local files lie: the same
files copied, moved or linked to another folder (a job that stages its data on local disk) resume.
Version 2: version 1's fingerprint held the files' paths and mtimes, so its orders differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from . import plan
from .convert import needed_columns
from .errors import ConfigError

__all__ = ["FORMAT", "VERSION", "Run", "Piece", "RunRows", "runs_of", "rest_of_epoch", "dropped_rows", "signature",
           "state_of", "check_state", "check_signature"]

FORMAT = "gpuload.ParquetDataset"
VERSION = 2  # 2: the order's fingerprint no longer holds the files' paths and mtimes (another order)


@dataclass(frozen=True)
class Run:
    """One run of an epoch: ``world`` ranks that took ``taken`` batches each; ``local``: the ranks
    per node of a node-affine first run (``shard="node"``), else None."""

    world: int
    taken: int
    local: int | None = None

    @classmethod
    def from_list(cls, saved: Sequence[int]) -> Run:
        """The run a state's ``[world, taken]`` or ``[world, taken, local]`` stands for."""
        return cls(*(int(v) for v in saved))

    def to_list(self) -> list[int]:
        """The run as a state writes it: ``[world, taken]``, or ``[world, taken, local]``."""
        return [self.world, self.taken] + ([] if self.local is None else [self.local])

    def took(self, batches: int = 1) -> Run:
        """The run after each of its ranks took ``batches`` more batches."""
        return Run(self.world, self.taken + batches, self.local)  # once per batch, on the training thread


@dataclass(frozen=True)
class Piece:
    """Positions ``[lo, hi)`` of window ``window`` of rank ``rank`` in the epoch's first run.

    Positions count in the window's permuted order (its row order without shuffling).
    """

    rank: int
    window: int
    lo: int
    hi: int


def _deliverable(total: int, world: int, batch_size: int, drop_last: bool) -> int:
    """How many of ``total`` rows ``world`` ranks can take with equal batch counts."""
    if drop_last:
        return total // (world * batch_size) * world * batch_size
    if batch_size == 1:
        return total - total % world
    return total if total >= world else 0


class RunRows:
    """A :class:`Run` with its rows: ``world`` ranks over ``total`` rows, each taking ``taken`` batches.

    With ``per_rank`` (node-affine sharding, a first run only), every rank takes exactly
    ``per_rank`` rows of its own stream; ``total`` is then ``world * per_rank``.
    """

    def __init__(self, world: int, taken: int, total: int, batch_size: int, drop_last: bool,
                 per_rank: int | None = None):
        self.world, self.taken, self.total, self.per_rank = world, taken, total, per_rank
        self._batch, self._drop = batch_size, drop_last
        if per_rank is not None:
            self.batches = len(plan.even_batch_sizes(per_rank, batch_size))
        else:
            self.batches = plan.num_batches(total, world, batch_size, drop_last) if total else 0

    def span(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s ``[start, stop)`` of the run's stream of rows."""
        if self.per_rank is not None:
            return rank * self.per_rank, (rank + 1) * self.per_rank
        return plan.rank_range(self.total, self.world, rank, self._batch, self._drop) if self.total else (0, 0)

    def sizes(self, rank: int) -> plan.BatchSizes:
        if self.per_rank is not None:
            return plan.even_batch_sizes(self.per_rank, self._batch)
        if not self.batches:
            return plan.BatchSizes(0, self._batch, ())
        return plan.batch_sizes(self.total, self.world, rank, self._batch, self._drop)

    def taken_rows(self, rank: int) -> int:
        """Rows rank ``rank`` has taken (its first ``taken`` batches)."""
        return self.sizes(rank).rows_before(self.taken)

    def rest(self, rank: int) -> int:
        start, stop = self.span(rank)
        return stop - start - self.taken_rows(rank)

    def left(self) -> int:
        """Rows of the run not taken yet, over all its ranks (a run with no rows has any number
        of ranks: a state's world sizes are not trusted to be small)."""
        return sum(self.rest(r) for r in range(self.world)) if self.total else 0

    @property
    def complete(self) -> bool:
        return self.taken == self.batches


def runs_of(total: int, runs: Sequence[Run], batch_size: int, drop_last: bool,
            node_rows: Callable[[int, int], int] | None = None) -> list[RunRows]:
    """The :class:`RunRows` of an epoch of ``total`` rows run as ``runs``.

    A first run with ``local`` set was node-affine: ``node_rows(world, local)`` gives the rows
    each of its ranks takes (:func:`gpuload.nodeplan.node_shares`). Raises :class:`ConfigError`
    where the runs are impossible (more batches taken than a run has, ranks that could not
    share the epoch).
    """
    out: list[RunRows] = []
    for i, (world, taken, local) in enumerate((r.world, r.taken, r.local) for r in runs):
        per = None
        if i == 0 and local is not None:
            if node_rows is None:
                raise ConfigError("state: its epoch ran node-affine (shard='node'), which this dataset cannot plan")
            try:
                per = node_rows(world, local)
            except ConfigError as e:
                raise ConfigError(f"state: its epoch ran on {world // local} nodes of {local} ranks, which "
                                  f"this dataset cannot have ({e}); the state was not saved from this dataset") from None
            rows = world * per
        elif i == 0:
            if not plan.feasible(total, world, batch_size, drop_last):
                raise ConfigError(f"state: {total:,} rows cannot be shared by world_size={world} ranks with "
                                  f"batch_size={batch_size}; the state was not saved from this dataset")
            rows = total
        else:
            offered = out[-1].left()
            rows = _deliverable(offered, world, batch_size, drop_last)
        run = RunRows(world, taken, rows, batch_size, drop_last, per)
        if not 0 <= taken <= run.batches:
            raise ConfigError(f"state: run {i} ({world} ranks) took {taken} batches, but it has {run.batches}; "
                              "the state was not saved from this dataset")
        out.append(run)
    return out


def dropped_rows(runs: Sequence[RunRows]) -> int:
    """Rows of the rest of the epoch that the last run cannot give out evenly (0 for one run)."""
    if len(runs) < 2:
        return 0
    return runs[-2].left() - runs[-1].total


def _slice_windows(rows: Sequence[int], rank: int, a: int, b: int) -> list[Piece]:
    pieces, pos = [], 0
    for w, n in enumerate(rows):
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            pieces.append(Piece(rank, w, lo - pos, hi - pos))
        pos += n
        if pos >= b:
            break
    return pieces


def rest_of_epoch(window_rows: Callable[[int], Sequence[int]], runs: Sequence[RunRows],
                  rank: int) -> tuple[list[Piece], plan.BatchSizes]:
    """What rank ``rank`` of the last run still yields: its pieces of windows, and batch sizes.

    ``window_rows(q)``: the rows of each window of rank ``q`` in the epoch's first run.
    """

    def pieces(i: int, q: int, a: int, b: int) -> list[Piece]:  # rows [a, b) of rank q's stream in run i
        if a >= b:
            return []
        if i == 0:
            return _slice_windows(window_rows(q), q, a, b)
        prev, start = runs[i - 1], runs[i].span(q)[0]
        a, b = a + start, b + start  # rows of the previous run's rest, rank after rank
        rest = np.array([prev.rest(p) for p in range(prev.world)], dtype=np.int64)
        ends = np.cumsum(rest)
        out: list[Piece] = []
        for p in range(int(np.searchsorted(ends, a, side="right")), prev.world):
            lo_p = int(ends[p] - rest[p])
            if lo_p >= b:
                break
            lo, hi = max(a, lo_p), min(b, int(ends[p]))
            if lo < hi:
                skip = prev.taken_rows(p) - lo_p
                out.extend(pieces(i - 1, p, lo + skip, hi + skip))
        return out

    last = runs[-1]
    start, stop = last.span(rank)
    merged: list[Piece] = []  # neighbouring parts of one window (after several runs) are read once
    for p in pieces(len(runs) - 1, rank, last.taken_rows(rank), stop - start):
        q = merged[-1] if merged else None
        if q is not None and (q.rank, q.window, q.hi) == (p.rank, p.window, p.lo):
            merged[-1] = Piece(q.rank, q.window, q.lo, p.hi)
        else:
            merged.append(p)
    return merged, last.sizes(rank).after(last.taken)


def signature(reader, options) -> dict:
    """What shapes the order of a dataset of ``reader`` (a :class:`gpuload.reader.ChunkReader`) and
    ``options`` (its :class:`gpuload.config.Options`), as the ``dataset`` field of a state: the files'
    fingerprint, rows and chunks, each output's columns (a transform's: every column it is given), and
    the order's settings (``shuffle`` as given: ``"block"`` is recorded as True with its ``block_rows``,
    ``"chunks"`` as itself; ``filter``: the key of its ``filters=``, written only when there is one;
    ``files``: how many files the source listed, for messages: a state saved before it was recorded has none)."""
    r, o = reader, options
    given = needed_columns(r.specs) if r.source.transform is not None else None
    # each chunk's row groups; a pack's files after its first marked by a negative file number
    layout = np.array([(p.file if j == 0 else -1 - p.file, p.rg_start, p.rg_stop) for c in r.chunks
                       for j, p in enumerate(c.pieces)], dtype=np.int64).reshape(-1, 3)
    return {"source": f"{r.fingerprint:#018x}", "rows": int(r.num_rows),
            "chunks": f"{xxhash.xxh3_64_intdigest(layout.tobytes()):#018x}",
            "outputs": {s.name: given or list(s.columns) for s in r.outputs},
            "seed": int(o.seed), "shuffle": o.shuffle if o.shuffle == "chunks" else bool(o.shuffle),
            "batch_size": int(o.batch_size), "drop_last": bool(o.drop_last), "shuffle_window": int(o.shuffle_window),
            **({} if o.block is None else {"block_rows": int(o.block)}),
            **({} if r.source.filters is None else {"filter": r.source.filters.key}), "files": len(r.files)}


def check_signature(saved: dict, here: dict) -> None:
    """Raise :class:`ConfigError` naming every field where ``saved`` and ``here`` differ.

    A chunk layout that differs where the files, rows or columns do is not named again
    (it follows from them).
    """
    diffs = []
    if saved.get("outputs") != here["outputs"]:
        diffs.append(f"outputs: the columns differ ({_outputs(saved.get('outputs'))} in the state, "
                     f"{_outputs(here['outputs'])} here)")
    if saved.get("source") != here["source"]:
        count = "" if saved.get("files") in (None, here.get("files")) else \
            f"{saved['files']} files in the state, {here.get('files')} here; "
        diffs.append(f"source: the source files differ ({count}other names below their folder, or files "
                     "rewritten since: a file counts by its name there, its size, partition keys and, locally, its "
                     "footer, remotely its ETag or version and last-modified time; a local folder may lie elsewhere)")
    explained = bool(diffs) or saved.get("rows") != here["rows"]
    layout = saved.get("chunks") != here["chunks"] and not explained  # the same files cut otherwise: said first
    if layout:
        diffs.append("chunks: the chunk layout differs (another chunk_bytes, or pack_files: a state saved before "
                     "gpuload packed small files several to a chunk resumes with pack_files=False)")
    modes = (saved.get("block_rows") is None) != (here.get("block_rows") is None)  # blocks on one side only
    for key in ("rows", "seed", "shuffle", "batch_size", "drop_last", "shuffle_window", "block_rows", "filter"):
        if saved.get(key) == here.get(key) or (modes and key == "shuffle"):
            continue
        if modes and key == "block_rows":  # named as the user set it: shuffle=True, False or 'block'
            diffs.append(f"shuffle: {_shuffle(saved)} in the state, {_shuffle(here)} here")
        elif key == "shuffle_window" and layout:  # the default's follows the chunks' sizes
            diffs.append(f"shuffle_window: {saved[key]!r} in the state, {here.get(key)!r} here (the default's "
                         "follows the chunks)")
        elif key == "shuffle_window" and isinstance(saved.get(key), int):  # the default's depends on chunk sizes
            diffs.append(f"shuffle_window: {saved[key]!r} in the state, {here.get(key)!r} here (give "
                         f"shuffle_window={saved[key]} to restore it)")
        else:
            diffs.append(f"{key}: {saved.get(key)!r} in the state, {here.get(key)!r} here")
    if diffs:
        raise ConfigError("the state was saved from another dataset: " + "; ".join(diffs)
                          + ". Open the dataset as it was when the state was saved, or do not load the state "
                            "(the epoch then starts from its first batch)")


def _shuffle(signature: dict) -> str:
    """The shuffle setting a signature was made with, as the user gives it."""
    if signature.get("block_rows") is not None:
        return f"shuffle='block' (block_rows={signature['block_rows']})"
    s = signature.get("shuffle")
    return f"shuffle={s!r}" if s == "chunks" else f"shuffle={bool(s)}"


def _outputs(outputs) -> str:
    if not isinstance(outputs, dict):
        return repr(outputs)
    return ", ".join(f"{k}={'+'.join(v)}" if isinstance(v, list) else f"{k}={v}" for k, v in outputs.items())


def state_of(epoch: int, runs: Sequence[Run], dataset: dict) -> dict:
    """The state of epoch ``epoch`` run as ``runs`` in the dataset of signature ``dataset``."""
    return {"format": FORMAT, "version": VERSION, "epoch": epoch, "runs": [r.to_list() for r in runs],
            "dataset": dataset}


def check_state(sd) -> tuple[int, tuple[Run, ...], dict]:
    """Validate a state's structure; returns ``(epoch, runs, dataset signature)``."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ConfigError(f"load_state_dict: not a gpuload ParquetDataset state (format={_peek(sd)!r}); pass "
                          "what ParquetDataset.state_dict() returned")
    version = sd.get("version")
    if version == 1:
        raise ConfigError("load_state_dict: a state of version 1, saved by an older gpuload whose shuffle orders "
                          "differ from this one's (they depended on where the files lay): it cannot be resumed "
                          "exactly. Do not load it (the epoch then starts from its first batch), or finish the run "
                          "with the gpuload that saved it")
    if version != VERSION:
        raise ConfigError(f"load_state_dict: state version {version!r}; this gpuload reads version {VERSION} "
                          f"(a newer gpuload saved it?)")
    epoch, runs, dataset = sd.get("epoch"), sd.get("runs"), sd.get("dataset")

    def is_int(v, low):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    if not is_int(epoch, 0):
        raise ConfigError(f"load_state_dict: epoch={epoch!r} must be a non-negative integer")
    if (not isinstance(runs, (list, tuple)) or not runs
            or not all(isinstance(r, (list, tuple)) and len(r) in (2, 3) and all(is_int(v, 1) for v in r[::2])
                       and is_int(r[1], 0) and (len(r) == 2 or i == 0) for i, r in enumerate(runs))):
        raise ConfigError(f"load_state_dict: runs={runs!r} must be a non-empty list of [world_size, batches] "
                          "(the first one may add its local_world_size)")
    if len(runs[0]) == 3 and runs[0][0] % runs[0][2]:
        raise ConfigError(f"load_state_dict: runs[0]={list(runs[0])!r}: {runs[0][0]} ranks cannot be nodes of "
                          f"{runs[0][2]} ranks each (the same number on every node); the state was not saved by "
                          "gpuload")
    if not isinstance(dataset, dict):
        raise ConfigError("load_state_dict: the state has no 'dataset' description")
    outputs = dataset.get("outputs")
    if not (isinstance(outputs, dict) and all(isinstance(k, str) and isinstance(v, list) and v
                                              and all(isinstance(c, str) for c in v) for k, v in outputs.items())):
        raise ConfigError(f"load_state_dict: dataset.outputs={outputs!r} must map each output's name to the list "
                          "of its column names; the state was not saved by gpuload")
    return epoch, tuple(Run.from_list(r) for r in runs), dataset


def _peek(sd) -> object:
    return sd.get("format") if isinstance(sd, dict) else type(sd).__name__


