"""Plan: chunks, epoch order, shards and batch sizes, as pure functions.

Nothing here does I/O. The order of rows a rank sees is a function of
``(dataset fingerprint, seed, epoch, world_size, rank)`` and of nothing else: not of
the cache state, the device, thread counts or prefetch depth.

How an epoch is laid out
------------------------
1. The dataset is cut into *chunks*: runs of consecutive row groups of one file, of at
   most ``chunk_bytes`` converted bytes (a larger row group is a chunk of its own). Small
   files (of a source of 64 or more), each a chunk of less than an eighth of ``chunk_bytes``,
   are *packed*, several consecutive ones into one chunk (:func:`gpuload.packs.pack_small`):
   each chunk costs a cache file, its writes and checks, whatever its rows.
2. With ``shuffle=True`` (and ``"block"`` and ``"chunks"``) the chunk order is a permutation
   drawn from ``(fingerprint, seed, epoch)``; it is the same on every rank.
3. The rows of the chunks, in that order, form one stream of ``N`` rows. Rank ``r``
   takes the contiguous range ``[start_r, stop_r)`` of it, so shard membership changes
   with the seed and the epoch, and each rank reads only about ``N / world_size`` rows.
4. A rank groups its chunk pieces into windows of ``shuffle_window`` chunks and
   permutes the rows of each window (seeded by the above plus ``rank`` and the
   window's index). Batches are cut across window boundaries. Block shuffling
   (``shuffle="block"``) permutes blocks of ``block_rows`` consecutive rows instead
   (:func:`block_permutation`); those rows were permuted once when the chunk was cached.
   ``shuffle="chunks"`` permutes no rows: each chunk's rows come in file order.

How the tail is balanced
------------------------
``drop_last=False``: ranks get ``N // W`` or ``N // W + 1`` rows (every row exactly
once) and every rank yields ``K = ceil(ceil(N / W) / batch_size)`` batches. Batches are
full except the last; a rank whose rows would leave its last batch empty splits its
last full batch into two halves instead. This needs every rank to have at least ``K``
rows; only ``N < W`` or ``batch_size == 1`` with ``N % W != 0`` fail that, and are
refused with a :class:`~gpuload.ConfigError`. An epoch that would yield no batch at
all (no rows, or ``drop_last=True`` with fewer than ``W * batch_size`` rows) is
refused too, rather than training on nothing.

``drop_last=True``: every rank yields ``K = N // (W * batch_size)`` full batches; the
last ``N - K * W * batch_size`` rows of the epoch's stream are not delivered (with
shuffling, different rows each epoch).

Node-affine sharding (``shard="node"``) is planned in :mod:`gpuload.nodeplan`.

Resuming
--------
A position in an epoch is the number of batches every rank has taken. On the same
number of ranks the plan above simply goes on from there; on another number of ranks
the rest of the epoch is split among the new ranks by the same rules (every row once,
equal batch counts). :mod:`gpuload.resume` holds that plan and the state's format.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, setting

__all__ = [
    "MAX_KEY", "Chunk", "Segment", "make_chunks", "chunk_order", "rank_range", "rank_segments",
    "num_batches", "batch_sizes", "BatchSizes", "check_balance", "feasible", "trim", "windows", "window_permutation",
    "even_batch_sizes", "seeded_rng",
]


@dataclass(frozen=True)
class Chunk:
    """A run of row groups ``[rg_start, rg_stop)`` of file number ``file``; or a *pack*: the
    chunks ``parts`` (each a whole small file's, of consecutive files), one after another,
    whose ``rows`` and ``nbytes`` it sums (``file``, ``rg_start`` and ``rg_stop`` are then its
    first part's: iterate :attr:`pieces` for what a chunk reads; :mod:`gpuload.packs`)."""

    file: int
    rg_start: int
    rg_stop: int
    rows: int
    nbytes: int  # estimated converted bytes
    parts: tuple = ()  # a pack's chunks, one per file, in file order; () for a chunk of one file

    @property
    def pieces(self) -> tuple["Chunk", ...]:
        """The runs of row groups of one file each that the chunk's rows are, in order."""
        return self.parts or (self,)


@dataclass(frozen=True)
class Segment:
    """Rows ``[lo, hi)`` of chunk number ``chunk``."""

    chunk: int
    lo: int
    hi: int


def make_chunks(row_groups: Sequence[Sequence[tuple[int, int]]], chunk_bytes: int) -> list[Chunk]:
    """Cut files into chunks.

    Parameters
    ----------
    row_groups : per file, per row group, ``(rows, estimated converted bytes)``, or None for a
        row group left out (a row filter excludes it): no chunk spans it.
    chunk_bytes : upper bound of a chunk's converted bytes (a single larger row group
        still forms one chunk).
    """
    chunks = []
    for f, groups in enumerate(row_groups):
        start, rows, size = 0, 0, 0
        for g, got in enumerate(groups):
            if got is None or (g > start and size + got[1] > chunk_bytes):
                if rows:  # row groups with no rows make no chunk
                    chunks.append(Chunk(f, start, g, rows, size))
                start, rows, size = g + (got is None), 0, 0
            if got is not None:
                rows, size = rows + got[0], size + got[1]
        if len(groups) > start and rows:
            chunks.append(Chunk(f, start, len(groups), rows, size))
    return chunks


MAX_KEY = 2**63 - 1  #: the largest seed and epoch: the order's generators are keyed on 63 bits


def seeded_rng(*key: int) -> np.random.Generator:
    """A generator drawn from the integers ``key`` alone (each kept to 63 bits): the same on every
    machine, rank and run."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) & MAX_KEY for k in key])))


def chunk_order(n_chunks: int, *, fingerprint: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's chunk order (identical on every rank)."""
    if not shuffle:
        return np.arange(n_chunks)
    return seeded_rng(fingerprint, seed, epoch, 0).permutation(n_chunks)


def rank_range(total: int, world: int, rank: int, batch_size: int, drop_last: bool) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` rows of the epoch's stream of ``total`` rows."""
    if drop_last:
        per = (total // (world * batch_size)) * batch_size
        return rank * per, (rank + 1) * per
    q, r = divmod(total, world)
    start = rank * q + min(rank, r)
    return start, start + q + (rank < r)


def num_batches(total: int, world: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank yields per epoch (``len(dataset)``)."""
    if drop_last:
        return total // (world * batch_size)
    return _ceil_div(_ceil_div(total, world), batch_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def feasible(total: int, world: int, batch_size: int, drop_last: bool) -> bool:
    """Whether ``world`` ranks get equal, non-empty batch counts (see the module doc)."""
    if total < 1 or world < 1 or batch_size < 1:
        return False
    if drop_last:
        return total >= world * batch_size
    return total >= world and not (batch_size == 1 and total % world)


def check_balance(total: int, world: int, batch_size: int, drop_last: bool) -> None:
    """Raise :class:`ConfigError` when ranks cannot get equal, non-empty batch counts.

    The message names only changes that work: with ``drop_last=False`` the failures are
    fewer rows than ranks, and ``batch_size=1`` with a row count that ``world`` does not
    divide; with ``drop_last=True``, fewer rows than ``world * batch_size``.
    """
    if batch_size < 1:
        raise ConfigError(f"{setting('batch_size', batch_size)} must be at least 1")
    if world < 1:
        raise ConfigError(f"world_size={world} must be at least 1")
    if total == 0:
        raise ConfigError("the source holds no rows: check that it names the files you mean")
    if feasible(total, world, batch_size, drop_last):
        return
    fixes = []
    if drop_last and total // world >= 1:
        fixes.append(f"{setting('batch_size', total // world)} or less")
    for w in (total // batch_size if drop_last else total, total):
        if 1 <= w < world and feasible(total, w, batch_size, drop_last):
            fixes.append(f"at most {w:,} ranks")
            break
    if not drop_last and batch_size == 1 and feasible(total, world, 2, False):
        fixes.append(f"{setting('batch_size', 2)} or more (a short rank's last batch is then split in two)")
    if not drop_last and feasible(total, world, batch_size, True):
        fixes.append(f"drop_last=True (drops {total % world} rows)")
    if drop_last and feasible(total, world, batch_size, False):
        fixes.append("drop_last=False")
    if drop_last and not fixes and feasible(total, min(world, total), 1, True):
        fixes.append(f"{setting('batch_size', 1)} on at most {min(world, total):,} ranks")
    if not drop_last and batch_size == 1 and total >= world:
        fixes.append(f"a world_size that divides {total:,}")
    if drop_last:
        why = (f"{total:,} rows give no full batch of {setting('batch_size', batch_size)} to each of world_size={world} "
               f"ranks, so drop_last=True would drop them all")
    elif total < world:
        why = (f"{total:,} rows cannot be split over world_size={world} ranks: every rank needs at least one row "
               "whatever the batch_size")
    else:
        why = f"{total:,} rows over {world} ranks with {setting('batch_size', 1)} leave some ranks one batch short"
    raise ConfigError(f"{why}; use " + ", or ".join(fixes) if fixes else why + "; use more data")


class BatchSizes(Sequence):
    """The sizes of a rank's batches in one epoch, in constant memory: ``k - 1`` batches of
    ``batch_size`` rows, then a ``tail`` of one or two batches."""

    def __init__(self, k: int, batch_size: int, tail: Sequence[int]):
        self._full, self._batch, self._tail = k - len(tail), batch_size, tuple(tail)

    def __len__(self) -> int:
        return self._full + len(self._tail)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._batch if i < self._full else self._tail[i - self._full]

    def __eq__(self, other) -> bool:
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def rows_before(self, k: int) -> int:
        """Rows in the first ``k`` batches (``0 <= k <= len(self)``)."""
        if not 0 <= k <= len(self):
            raise IndexError(k)
        return min(k, self._full) * self._batch + sum(self._tail[:max(0, k - self._full)])

    def after(self, k: int) -> BatchSizes:
        """The sizes of the batches after the first ``k``."""
        if not 0 <= k <= len(self):
            raise IndexError(k)
        if k <= self._full:
            return BatchSizes(len(self) - k, self._batch, self._tail)
        return BatchSizes(len(self) - k, self._batch, self._tail[k - self._full:])

    def __repr__(self) -> str:
        return f"BatchSizes({self._full} x {self._batch} + {list(self._tail)})"


def batch_sizes(total: int, world: int, rank: int, batch_size: int, drop_last: bool) -> BatchSizes:
    """Sizes of the batches rank ``rank`` yields; same count on every rank (see module doc).

    Memory is constant, whatever the number of batches.
    """
    check_balance(total, world, batch_size, drop_last)
    k = num_batches(total, world, batch_size, drop_last)
    start, stop = rank_range(total, world, rank, batch_size, drop_last)
    n = stop - start
    last = n - (k - 1) * batch_size
    if last == 0:  # one row short of the other ranks: halve the last full batch
        return BatchSizes(k, batch_size, [batch_size - batch_size // 2, batch_size // 2])
    return BatchSizes(k, batch_size, [last])


def rank_segments(chunk_rows: Sequence[int], order: Sequence[int], start: int, stop: int) -> list[Segment]:
    """The pieces of chunks (in ``order``) that cover stream rows ``[start, stop)``."""
    segs, pos = [], 0
    for c in order:
        n = int(chunk_rows[c])
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            segs.append(Segment(int(c), lo, hi))
        pos += n
        if pos >= stop:
            break
    return segs


def trim(segments: Sequence[Segment], lo: int, hi: int) -> list[Segment]:
    """The pieces of ``segments`` that hold rows ``[lo, hi)`` of their concatenation."""
    out, pos = [], 0
    for s in segments:
        n = s.hi - s.lo
        a, b = max(lo - pos, 0), min(hi - pos, n)
        if a < b:
            out.append(Segment(s.chunk, s.lo + a, s.lo + b))
        pos += n
        if pos >= hi:
            break
    return out


def windows(segments: Sequence[Segment], size: int) -> list[list[Segment]]:
    """Consecutive groups of ``size`` segments (the last may be shorter)."""
    if size < 1:
        raise ConfigError(f"shuffle_window={size} must be at least 1 chunk")
    return [list(segments[i:i + size]) for i in range(0, len(segments), size)]


def window_permutation(n: int, *, fingerprint: int, seed: int, epoch: int, rank: int, window: int) -> np.ndarray:
    """Row permutation of window number ``window`` of ``rank`` (int64, length ``n``)."""
    return seeded_rng(fingerprint, seed, epoch, 1 + rank, window).permutation(n).astype(np.int64, copy=False)


def block_permutation(n: int, block_rows: int, *, fingerprint: int, seed: int, epoch: int, rank: int,
                      window: int) -> np.ndarray:
    """Row permutation of a window of ``n`` rows in block-shuffle mode (int64, length ``n``).

    The window's rows are cut into blocks of ``block_rows`` consecutive rows (the last one
    may be shorter), the blocks are permuted (seeded as :func:`window_permutation`) and
    each block keeps its rows in order: a gather becomes ``ceil(n / block_rows)`` short
    copies. The rows inside a block were permuted once when the chunk was cached
    (:func:`chunk_row_permutation`), so a block is a random sample of its chunk.
    """
    nb = -(-n // block_rows)
    if nb == 0:
        return np.zeros(0, dtype=np.int64)
    order = seeded_rng(fingerprint, seed, epoch, 1 + rank, window).permutation(nb)
    starts = order * block_rows
    lengths = np.minimum(starts + block_rows, n) - starts
    out = np.ones(n, dtype=np.int64)  # steps: +1 inside a block, a jump at each block's start
    heads = np.zeros(nb, dtype=np.int64)
    np.cumsum(lengths[:-1], out=heads[1:])
    out[heads[0]] = starts[0]
    out[heads[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(out, out=out)


def chunk_row_permutation(rows: int, identity: str) -> np.ndarray:
    """The permutation applied once to a chunk's rows when it is cached for block shuffling
    (int64, length ``rows``): a pure function of the chunk's identity ``identity`` (its
    source file's size, version tag and row groups: part of what its cache key holds, and not its
    path, so the same files elsewhere are permuted alike), so a chunk file is the same whoever
    builds it, and any seed can use it."""
    key = int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little")
    return seeded_rng(key, 3).permutation(rows).astype(np.int64)


def even_batch_sizes(rows: int, batch_size: int) -> BatchSizes:
    """Sizes of the batches of a rank that takes ``rows`` rows: full ones, then the rest."""
    if rows <= 0:
        return BatchSizes(0, batch_size, ())
    k = -(-rows // batch_size)
    return BatchSizes(k, batch_size, [rows - (k - 1) * batch_size])
