"""Epochs: what a rank reads in an epoch, from the plan of the dataset's chunks and the
runs of an epoch (restored ones included).

:class:`EpochPlan` ties :mod:`gpuload.plan` (order, shards, node shares, permutations) and
:mod:`gpuload.resume` (runs of an epoch, its rest) to one dataset's chunks and options;
:class:`Position` is where an epoch stands, and :class:`Rest` what a rank yields from
there on: the windows it loads, the rows it takes from each (a :class:`Take`) and its
batch sizes. Everything here is pure: the same inputs give the same windows,
permutations and batch sizes on every rank, run and device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from . import nodeplan, plan, resume
from .ranks import Ranks
from .resume import Run

__all__ = ["Position", "Take", "Rest", "EpochPlan"]

log = logging.getLogger("gpuload")


class Position:
    """Where an epoch stands: its runs (:class:`gpuload.resume.Run`, the last one going on), the
    ranks that run them (None: a restored position not yet fitted to this dataset's ranks), and
    whether an iteration is ``running`` it.

    A restored position also keeps ``raw`` (its runs as saved, less trailing runs that took no
    batch), ``complete`` (whether its epoch was over as saved) and ``warned`` (the world size
    its resume was logged for).
    """

    def __init__(self, epoch: int, runs: tuple[Run, ...], ranks: Ranks | None = None):
        self.epoch, self.runs, self.ranks, self.running = epoch, runs, ranks, False
        self.raw, self.complete, self.warned = runs, False, None

    def take(self) -> None:
        """Count one more batch handed out (by each rank of the last run)."""
        self.runs = self.runs[:-1] + (self.runs[-1].took(),)


@dataclass(frozen=True)
class Take:
    """The rows a rank takes from one window: window ``window`` of rank ``rank`` in the epoch's
    first run (the window's key), positions ``[lo, hi)`` of each of ``spans`` in turn.

    Positions count in the window's permuted order (its row order without shuffling).
    """

    rank: int
    window: int
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Rest:
    """What a rank yields from a position to the end of its epoch: for each window it reads, the
    chunk segments it ``loads`` and the rows it ``takes`` from them; the batch ``sizes``."""

    loads: list[list[plan.Segment]]
    takes: list[Take]
    sizes: plan.BatchSizes


class EpochPlan:
    """The epochs of one dataset: ``chunk_rows`` rows per chunk (``reader.chunks``), its
    ``fingerprint`` and :class:`gpuload.config.Options`."""

    def __init__(self, chunk_rows: list[int], fingerprint: int, options):
        self.rows, self.fingerprint, self.options = chunk_rows, fingerprint, options
        self.num_rows = sum(chunk_rows)
        self._checked: set[tuple[int, int | None]] = set()  # (world, local) layouts checked
        self._node_plans: dict[tuple[int, int], tuple] = {}

    @property
    def shuffled(self) -> bool:
        """Whether epochs permute the rows of each window (``shuffle=True`` or ``"block"``; the chunk order
        is permuted in every mode but ``shuffle=False``)."""
        return self.options.shuffled

    def check(self, ranks: Ranks) -> Ranks:
        """Refuse ranks that cannot share the dataset (once per layout); returns them."""
        if (ranks.world, ranks.local) not in self._checked:
            o = self.options
            if ranks.local is None:
                plan.check_balance(self.num_rows, ranks.world, o.batch_size, o.drop_last)
            else:
                self.node_plan(ranks.world, ranks.local)  # refuses a node share too small
            self._checked.add((ranks.world, ranks.local))
        return ranks

    def node_plan(self, world: int, local: int) -> tuple:
        """(chunks per node, rows per rank, rows undelivered per node) for ``world`` ranks, ``local`` per node."""
        if (world, local) not in self._node_plans:
            o = self.options
            self._node_plans[world, local] = nodeplan.node_shares(
                self.rows, world // local, local, o.batch_size, o.drop_last, fingerprint=self.fingerprint,
                seed=o.seed)
        return self._node_plans[world, local]

    @staticmethod
    def first_run(ranks: Ranks) -> tuple[Run, ...]:
        """The runs of an epoch not started yet: one run of these ranks."""
        return (Run(ranks.world, 0, ranks.local),)

    def runs(self, runs: tuple[Run, ...]) -> list[resume.RunRows]:
        """The :class:`gpuload.resume.RunRows` of an epoch's runs (refuses impossible ones)."""
        o = self.options
        return resume.runs_of(self.num_rows, runs, o.batch_size, o.drop_last,
                              lambda world, local: self.node_plan(world, local)[1])

    def first(self, ranks: Ranks) -> resume.RunRows:
        """The run of a whole epoch on these ranks."""
        return self.runs(self.first_run(ranks))[0]

    def go_on(self, p: Position, ranks: Ranks, warn: bool) -> tuple[Run, ...]:
        """The runs with which ``ranks`` go on with the restored position ``p``: its last run (the same
        ranks and plan), else a new run over the rest of its epoch (elastic), logged once with ``warn``."""
        runs = p.raw
        if len(runs) == 1 and runs[0].taken == 0:  # nothing taken yet: the epoch as these ranks run it
            return self.first_run(ranks)
        # the same ranks go on with the last run; a first run also needs the same plan (node-affine or not)
        same = runs[-1].world == ranks.world and (len(runs) > 1 or runs[0].local == ranks.local)
        if same or p.complete:
            return runs
        runs += (Run(ranks.world, 0),)  # elastic: a new run over the rest of the epoch
        if not warn or p.warned == ranks.world:
            return runs
        p.warned = ranks.world
        first = runs[0]
        if first.local is not None or ranks.local is not None:
            was = "global" if first.local is None else f"{first.world // first.local} nodes x {first.local}"
            now = "global" if ranks.local is None else f"{ranks.world // ranks.local} nodes x {ranks.local}"
            log.warning("gpuload: epoch %d ran with shard layout %s and resumes on %s ranks: the rest of this "
                        "epoch is shared by the new ranks, each reading the chunks its rows come from (not "
                        "cached on its node yet: decoded from the source); later epochs give each node its "
                        "share of the new layout, cached as it is first read", p.epoch, was, now)
        dropped = resume.dropped_rows(self.runs(runs))
        if dropped:
            log.warning("gpuload: epoch %d resumes on %d ranks: the last %d of its rows left cannot be shared "
                        "evenly (equal batch counts per rank) and are not delivered", p.epoch, ranks.world, dropped)
        return runs

    def windows(self, epoch: int, world: int, rank: int, local: int | None = None) -> list[list[plan.Segment]]:
        """Rank ``rank``'s windows in an epoch run by ``world`` ranks (node-affine: ``local`` per node)."""
        o, rows = self.options, self.rows
        if local is not None:
            owned, per, _ = self.node_plan(world, local)
            segments = nodeplan.node_segments(rows, owned[rank // local], node=rank // local, local_rank=rank % local,
                                              per_rank=per, fingerprint=self.fingerprint, seed=o.seed, epoch=epoch,
                                              shuffle=o.chunks_shuffled)
        else:
            order = plan.chunk_order(len(rows), fingerprint=self.fingerprint, seed=o.seed, epoch=epoch,
                                     shuffle=o.chunks_shuffled)
            start, stop = plan.rank_range(self.num_rows, world, rank, o.batch_size, o.drop_last)
            segments = plan.rank_segments(rows, order, start, stop)
        return plan.windows(segments, o.shuffle_window)

    def rest(self, p: Position, rank: int) -> Rest:
        """What rank ``rank`` of ``p``'s last run yields from ``p`` on."""
        runs = self.runs(p.runs)
        if runs[-1].complete:
            return Rest([], [], plan.BatchSizes(0, self.options.batch_size, ()))
        base: dict[int, list[list[plan.Segment]]] = {}  # windows of ranks of the epoch's first run

        def windows_of(q: int) -> list[list[plan.Segment]]:
            if q not in base:
                base[q] = self.windows(p.epoch, runs[0].world, q, p.runs[0].local)
            return base[q]

        pieces, sizes = resume.rest_of_epoch(lambda q: [sum(s.hi - s.lo for s in w) for w in windows_of(q)],
                                             runs, rank)
        takes: list[Take] = []  # pieces of one window come one after another: read it once
        for c in pieces:
            if takes and (takes[-1].rank, takes[-1].window) == (c.rank, c.window):
                takes[-1] = Take(c.rank, c.window, takes[-1].spans + ((c.lo, c.hi),))
            else:
                takes.append(Take(c.rank, c.window, ((c.lo, c.hi),)))
        # shuffled, a window is loaded whole to permute it; in file order, only the rows taken
        loads = [windows_of(t.rank)[t.window] if self.shuffled else
                 [s for lo, hi in t.spans for s in plan.trim(windows_of(t.rank)[t.window], lo, hi)] for t in takes]
        return Rest(loads, takes, sizes)

    def permutation(self, epoch: int, take: Take, n: int) -> np.ndarray:
        """The rows ``take`` takes from its window of ``n`` rows in ``epoch``, as positions in the window
        (int64): the window's permutation (of rows, or of blocks with ``shuffle="block"``, see
        :mod:`gpuload.plan`) cut to the take's spans. For shuffled epochs (in file order a window's
        rows are taken as loaded)."""
        o = self.options
        key = dict(fingerprint=self.fingerprint, seed=o.seed, epoch=epoch, rank=take.rank, window=take.window)
        perm = plan.window_permutation(n, **key) if o.block is None else \
            plan.block_permutation(n, o.block, **key)
        if len(take.spans) == 1:
            lo, hi = take.spans[0]
            return perm[lo:hi]
        return np.concatenate([perm[lo:hi] for lo, hi in take.spans])
