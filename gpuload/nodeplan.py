"""Node-affine sharding (``shard="node"``): which chunks each node owns, and each local
rank's pieces of them, as pure functions (no I/O), beside :mod:`gpuload.plan`.

For many nodes with a local cache each. The chunks are assigned to the ``M`` nodes once,
from ``(fingerprint, seed, M)``: largest first, each to the node with the fewest rows so
far (ties in a seeded random order), so nodes differ by at most one chunk's rows. The
assignment holds for every epoch, so a node caches only its share and its later epochs
are warm. Each epoch permutes a node's chunks (seeded by the epoch and the node); its
``L`` local ranks take consecutive ranges of that stream and shuffle them in windows
as :mod:`gpuload.plan` says. Global rank ``r`` is local rank ``r % L`` of node
``r // L`` (torchrun's layout).

Every rank takes the same number of rows, ``R = min over nodes (N_node // L)`` (rounded
down to a multiple of ``batch_size`` with ``drop_last=True``), so batch counts are equal
and each row is delivered at most once. A node leaves ``N_node - L * R`` rows out per
epoch: fewer than one chunk's rows plus ``L`` (plus up to a batch per rank with
``drop_last=True``). Shuffled, the node's stream starts at a random row each epoch and
wraps around, so those are other rows each epoch, anywhere in its chunks; without
shuffling, the same rows (the end of the node's last chunk) every epoch.
:func:`node_shares` tells how many.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .errors import ConfigError, setting
from .plan import Segment, rank_segments, seeded_rng

__all__ = ["node_chunks", "node_rank_rows", "node_shares", "node_segments"]


def node_chunks(chunk_rows: Sequence[int], nodes: int, *, fingerprint: int, seed: int) -> list[np.ndarray]:
    """The chunks each of ``nodes`` nodes owns in every epoch (see the module doc), ascending."""
    if nodes < 1:
        raise ConfigError(f"nodes={nodes} must be at least 1")
    tie = seeded_rng(fingerprint, seed, 2, nodes).permutation(len(chunk_rows))
    rows = np.asarray(chunk_rows, dtype=np.int64)
    order = np.lexsort((tie, -rows))  # largest first; equal sizes in a seeded order
    heap = [(0, n) for n in range(nodes)]
    owned: list[list[int]] = [[] for _ in range(nodes)]
    for c in order:
        total, n = heapq.heappop(heap)
        owned[n].append(int(c))
        heapq.heappush(heap, (total + int(rows[c]), n))
    return [np.array(sorted(o), dtype=np.int64) for o in owned]


def node_rank_rows(node_rows: Sequence[int], local_world: int, batch_size: int, drop_last: bool) -> int:
    """Rows every rank takes per epoch in node-affine mode (the same on every rank)."""
    per = min(int(n) for n in node_rows) // local_world
    return per // batch_size * batch_size if drop_last else per


def node_shares(chunk_rows: Sequence[int], nodes: int, local_world: int, batch_size: int, drop_last: bool, *,
                fingerprint: int, seed: int) -> tuple[list[np.ndarray], int, list[int]]:
    """(chunks per node, rows per rank, rows each node leaves undelivered per epoch).

    Raises :class:`ConfigError` when some rank would get no batch (at once when there are more
    nodes than chunks: a node without a chunk has no rows, and nothing is computed per node).
    """
    if nodes > len(chunk_rows):
        raise ConfigError(f"shard='node': the smallest of {nodes:,} nodes' shares holds 0 rows ({nodes:,} nodes for "
                          f"{len(chunk_rows):,} chunks), too few for {local_world} local ranks; use fewer nodes or "
                          "ranks, smaller chunks (chunk_bytes), or shard='global'")
    owned = node_chunks(chunk_rows, nodes, fingerprint=fingerprint, seed=seed)
    totals = [int(np.asarray(chunk_rows, dtype=np.int64)[o].sum()) for o in owned]
    per = node_rank_rows(totals, local_world, batch_size, drop_last)
    if per < 1:
        smallest = min(totals)
        raise ConfigError(
            f"shard='node': the smallest of {nodes} nodes' shares holds {smallest:,} rows, too few for "
            f"{local_world} local ranks" + (f" with {setting('batch_size', batch_size)} and drop_last=True" if drop_last else "")
            + "; use fewer nodes or ranks, smaller chunks (chunk_bytes), or shard='global'")
    return owned, per, [t - local_world * per for t in totals]


def node_segments(chunk_rows: Sequence[int], owned: np.ndarray, *, node: int, local_rank: int, per_rank: int,
                  fingerprint: int, seed: int, epoch: int, shuffle: bool) -> list[Segment]:
    """Local rank ``local_rank``'s pieces of its node's chunks this epoch (``per_rank`` rows).

    Shuffled, the node's stream (its chunks in the epoch's order) starts at a random row
    and wraps around, so the rows left out are a run at a random place: any row may be.
    """
    if not shuffle:
        return rank_segments(chunk_rows, owned, local_rank * per_rank, (local_rank + 1) * per_rank)
    rng = seeded_rng(fingerprint, seed, epoch, 3, node)
    order = owned[rng.permutation(len(owned))]
    total = int(sum(int(chunk_rows[c]) for c in owned))
    start = int(rng.integers(total)) + local_rank * per_rank
    first = min(start % total + per_rank, total)  # [start, first) before the wrap, then from the stream's start
    segs = rank_segments(chunk_rows, order, start % total, first)
    return segs + rank_segments(chunk_rows, order, 0, per_rank - (first - start % total))
