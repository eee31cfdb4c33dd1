"""Across ranks: every rank's figures gathered into one view, and the straggler named.

    view = ds.stats(all_ranks=True)    # under torch.distributed every rank calls it (a collective)
    print(view)                        # one row per rank: waiting, rows/s, what limits it, its cache
    gpuload.diagnose(view)             # the rank that waits most, how far it lags the median, and why

In a DDP job every rank steps together, so one rank starved of data holds back all of them:
the others wait in the gradient all-reduce, not in ``next()``. The rank whose training thread
waited most inside ``next()`` is therefore the one to look at; :func:`gpuload.diagnose` names
it when it waits at least ``gpuload.observe.diagnose.STRAGGLER`` (5 points) more than the median rank, with the causes
the figures show (a cold cache where the others read theirs, a remote source, busy CPUs) and
that rank's own diagnosis.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

from ..machine import cores as usable_cores
from .diagnose import diagnose
from .stats import Stats

__all__ = ["RankFigures", "RankStats", "gather"]


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures: its ``rank``, ``stats`` (a :class:`gpuload.Stats`), the chunks it
    ``decoded`` from Parquet and read ``cached``, its ``host`` and the ``cpus`` it may use there
    (:func:`gpuload.machine.cores`: its affinity and CPU quota)."""

    rank: int
    stats: Stats
    decoded: int
    cached: int
    host: str
    cpus: int


@dataclass(frozen=True)
class RankStats:
    """Every rank's :class:`RankFigures`, in rank order (``ranks``)."""

    ranks: list

    @property
    def timed(self) -> list:
        """The ranks that timed a pass (a rank that never iterated has no waiting to compare)."""
        return [r for r in self.ranks if r.stats.wall_s > 0] or list(self.ranks)

    @property
    def slowest(self) -> RankFigures:
        """The rank that waited the largest share of its time inside ``next()`` (of those timed)."""
        return max(self.timed, key=lambda r: (r.stats.starvation, r.stats.wait_s, -r.rank))

    @property
    def median_starvation(self) -> float:
        return statistics.median(r.stats.starvation for r in self.timed)

    def __str__(self) -> str:
        head = ("rank", "host", "waiting", "rows/s", "limited by", "chunks decoded", "cached", "remote requests")
        rows = []
        for r in self.ranks:
            s = r.stats
            limit = diagnose(s).limiting if s.wall_s > 0 else "-"
            rows.append((f"{r.rank}{' *' if r is self.slowest and len(self.ranks) > 1 else ''}", r.host,
                         f"{s.starvation:.1%}", f"{s.rows_per_s:,.0f}", limit, f"{r.decoded:,}", f"{r.cached:,}",
                         f"{s.remote.requests:,}" if s.remote is not None else "-"))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        lines = [" ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *rows]]
        lag = self.slowest.stats.starvation - self.median_starvation
        return "\n".join([f"gpuload stats of {len(self.ranks)} rank{'s' * (len(self.ranks) != 1)} "
                          f"(* waits most: {lag:+.1%} against the median rank)", *lines])


def _figures(stats: Stats, counters, rank: int) -> RankFigures:
    return RankFigures(rank, stats, int(getattr(counters, "decoded", 0)), int(getattr(counters, "from_cache", 0)),
                       socket.gethostname(), usable_cores())


def gather(stats: Stats, counters=None) -> RankStats:
    """Every rank's figures (a collective under ``torch.distributed``: every rank must call it;
    without a process group, this process's alone). ``counters``: the loader's chunk counters
    (``reader.counters``), or None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = _figures(stats, counters, dist.get_rank())
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        return RankStats(sorted(got, key=lambda r: r.rank))
    return RankStats([_figures(stats, counters, 0)])
