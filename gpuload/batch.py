"""Batch: shuffle windows of chunks and slice them into batches.

A *column set* is ``{output name: array or Ragged}`` holding the same number of rows in
every output. The functions here work on NumPy arrays and, unchanged, on CuPy arrays
(the array module is taken from the arrays themselves), so the CPU and GPU paths share
one batching implementation and therefore one order.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

__all__ = ["Ragged", "nrows", "take", "permute_rows", "rows", "concat", "Batcher", "nbytes", "Parts", "long_runs"]

RUN_ROWS = 16  # mean rows per run of a permutation from which copying runs beats gathering rows


class Ragged(NamedTuple):
    """A variable-length list column of a batch.

    ``values`` holds every list's elements back to back; ``offsets`` (int64, length
    rows + 1, ``offsets[0] == 0``) marks where row ``i`` starts and ends:
    ``values[offsets[i]:offsets[i + 1]]``. Both are torch tensors in a batch (NumPy or
    CuPy arrays inside the pipeline).
    """

    values: object
    offsets: object


def _xp(a):
    """The array module (numpy or cupy) of ``a``."""
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np


def nrows(cols: dict) -> int:
    """Number of rows of a column set."""
    for v in cols.values():
        return len(v.offsets) - 1 if isinstance(v, Ragged) else len(v)
    return 0


def nbytes(cols: dict) -> int:
    """Bytes held by a column set (:class:`gpuload.layout.Pieces` included)."""
    total = 0
    for v in cols.values():
        total += v.values.nbytes + v.offsets.nbytes if isinstance(v, Ragged) else v.nbytes
    return total


def rows(cols: dict, start: int, stop: int) -> dict:
    """Rows ``start:stop`` of a column set; views for dense outputs, no data copy."""
    out = {}
    for k, v in cols.items():
        if isinstance(v, Ragged):
            off = v.offsets[start:stop + 1]
            out[k] = Ragged(v.values[int(off[0]):int(off[-1])], off - off[0])
        else:
            out[k] = v[start:stop]
    return out


def _empty(xp, shape, dtype, alloc):
    """An uninitialised array: from ``alloc(shape, dtype)`` when given (NumPy only)."""
    return xp.empty(shape, dtype=dtype) if alloc is None or xp is not np else alloc(shape, dtype)


# Host gathers pass mode="wrap" to np.take: their indices are in range by construction (a
# permutation of the window's rows; positions inside the offsets' spans), and with the default
# "raise" NumPy gathers into a buffer of its own and copies that into ``out`` (its docs say so):
# 25-35% of a gather's time on this project's batches.
_GATHER_MODE = "wrap"

_counts = np.arange(0, dtype=np.int64)  # 0, 1, 2, ...: kept, read-only, grown on demand


def _counting(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) without making it: a view of a kept, read-only one (a new array
    of a batch's values, fresh memory each time, cost the ragged gather half its time here)."""
    global _counts
    c = _counts
    if len(c) < n:  # threads may both grow it: either array serves
        c = np.arange(max(n, 2 * len(c)), dtype=np.int64)
        c.flags.writeable = False
        _counts = c
    return c[:n]


def _take_ragged(v: Ragged, idx, alloc=None):
    """Values and offsets of rows ``idx`` of a ragged column."""
    xp = _xp(v.values)
    if xp is not np:
        return _take_ragged_device(xp, v, idx)
    starts = v.offsets[idx]
    lengths = v.offsets[idx + 1]
    lengths -= starts
    off = _empty(np, (len(idx) + 1,), np.int64, alloc)
    off[0] = 0
    np.cumsum(lengths, out=off[1:])
    total = int(off[-1])
    if total == 0:
        return v.values[:0].copy(), off
    src = np.repeat(starts - off[:-1], lengths)  # source position of every output value: its row's
    src += _counting(total)  # start, shifted, plus its own position
    return np.take(v.values, src, out=_empty(np, (total,), v.values.dtype, alloc), mode=_GATHER_MODE), off


_KERNELS: dict = {}  # CuPy's compiled kernels of the device gather, made on first use

# row spans: for each taken row, where its values start in the window and how many there are
_SPANS = ("I row, raw int64 offsets", "int64 start, int64 length",
          "start = offsets[row]; length = offsets[row + 1] - start;")
# the gather: output value i belongs to the last taken row r with off[r] <= i (a binary search
# over the batch's offsets; empty rows are skipped since the next row starts where they end)
_GATHER = ("raw T values, raw int64 starts, raw int64 off, int64 nrows", "T out", """
    long long lo = 0, hi = nrows, at = (long long)i;
    while (hi - lo > 1) { long long mid = (lo + hi) >> 1; if (off[mid] <= at) lo = mid; else hi = mid; }
    out = values[starts[lo] + (at - off[lo])];""")


def _take_ragged_device(cupy, v: Ragged, idx):
    """The device gather of rows ``idx`` of a ragged column (CuPy arrays, the current stream):
    one kernel for the rows' spans, a scan for the offsets, one kernel for the values (each
    output value finds its row by binary search), so four device arrays and one wait for the
    device (the values' count) per column and batch."""
    kernels = _KERNELS.get("ragged")
    if kernels is None:  # two threads may both make them: the same kernels, either kept
        kernels = _KERNELS["ragged"] = (cupy.ElementwiseKernel(*_SPANS, "gpuload_ragged_spans"),
                                        cupy.ElementwiseKernel(*_GATHER, "gpuload_ragged_gather"))
    spans, gather = kernels
    starts, lengths = spans(idx, v.offsets)
    off = cupy.empty(len(idx) + 1, cupy.int64)
    off[:1] = 0
    cupy.cumsum(lengths, out=off[1:])
    total = int(off[-1])  # the batch's one wait for the device
    if total == 0:
        return v.values[:0].copy(), off
    return gather(v.values, starts, off, len(idx), cupy.empty(total, v.values.dtype)), off


def take(cols: dict, idx, alloc=None) -> dict:
    """Rows ``idx`` (an integer index array) of a column set, gathered into new arrays
    (from ``alloc(shape, dtype)`` when given, as in :func:`concat`)."""
    out = {}
    for k, v in cols.items():
        if isinstance(v, Ragged):
            out[k] = Ragged(*_take_ragged(v, idx, alloc))
        elif alloc is None or _xp(v) is not np:
            out[k] = _xp(v).take(v, idx, axis=0)
        else:
            out[k] = np.take(v, idx, axis=0, out=alloc((len(idx),) + v.shape[1:], v.dtype), mode=_GATHER_MODE)
    return out


def permute_rows(cols: dict, perm: np.ndarray, alloc=None) -> dict:
    """``cols``' rows in the order of the host permutation ``perm``, gathered where ``cols``
    lives (NumPy, into ``alloc(shape, dtype)`` when given; or CuPy on the current stream)."""
    first = next(iter(cols.values()))
    xp = _xp(first.values if isinstance(first, Ragged) else first)
    return take(cols, perm, alloc) if xp is np else take(cols, xp.asarray(perm))


def _join(arrays: list, alloc, key=None):
    """Concatenate along axis 0, into ``alloc(shape, dtype)`` when given (NumPy only; with
    ``key``, ``alloc(shape, dtype, key)``)."""
    xp = _xp(arrays[0])
    if alloc is None or xp is not np:
        return xp.concatenate(arrays)
    shape = (sum(len(a) for a in arrays),) + arrays[0].shape[1:]
    out = alloc(shape, arrays[0].dtype) if key is None else alloc(shape, arrays[0].dtype, key)
    return np.concatenate(arrays, out=out)


def _up64(n: int) -> int:
    """``n`` rounded up to a multiple of 64 (where :class:`_Slab` starts each array)."""
    return -(-n // 64) * 64


class _Slab:
    """``alloc(shape, dtype)`` carving arrays one after another out of one buffer of ``nbytes``
    bytes from ``alloc`` (each array 64-byte aligned): a joined batch's columns, each too small
    for a pool to keep (:class:`gpuload.memory.HostPool` keeps buffers of a MiB and more), in one
    buffer it keeps, instead of fresh memory for every column of every such batch."""

    __slots__ = ("_buf", "_at")

    def __init__(self, alloc, nbytes: int):
        self._buf, self._at = alloc((nbytes,), np.uint8), 0

    def __call__(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        out = self._buf[self._at:self._at + n].view(dtype).reshape(shape)
        self._at += _up64(n)
        return out


def _joined_nbytes(parts: Sequence[dict]) -> int:
    """Bytes of the arrays :func:`concat` makes of ``parts`` (host arrays), each rounded up to 64."""
    total = 0
    for k, v in parts[0].items():
        if isinstance(v, Ragged):
            total += _up64((sum(len(p[k].offsets) - 1 for p in parts) + 1) * v.offsets.itemsize)
            total += _up64(sum(int(p[k].offsets[-1] - p[k].offsets[0]) for p in parts) * v.values.itemsize)
        else:
            total += _up64(sum(p[k].nbytes for p in parts))
    return total


def concat(parts: Sequence[dict], alloc=None, keyed: bool = False) -> dict:
    """Rows of several column sets one after another, in new arrays (a single part is
    returned as it is: no copy).

    ``alloc(shape, dtype)``, if given, provides the output arrays (e.g. a
    :class:`gpuload.memory.HostPool`'s ``array``); ``keyed``: ``alloc(shape, dtype, key)``
    with a key per output array (its name, and ``"values"`` or ``"offsets"`` for a list), so
    a pool keeps each one's buffers apart (a shuffle window's columns).
    """
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k, v in parts[0].items():
        if isinstance(v, Ragged):  # each part's values from its first offset to its last (a slice's need not start at 0)
            ends = [(int(p[k].offsets[0]), int(p[k].offsets[-1])) for p in parts]
            shifts = np.cumsum([0] + [b - a for a, b in ends[:-1]])
            off = _join([parts[0][k].offsets[:1] - ends[0][0]] + [p[k].offsets[1:] + (int(s) - a) for p, s, (a, _)
                                                                  in zip(parts, shifts, ends)],
                        alloc, (k, "offsets") if keyed else None)
            out[k] = Ragged(_join([p[k].values[a:b] for p, (a, b) in zip(parts, ends)], alloc,
                                  (k, "values") if keyed else None), off)
        else:
            out[k] = _join([p[k] for p in parts], alloc, k if keyed else None)
    return out


def long_runs(perm) -> bool:
    """Whether the host permutation ``perm`` takes its rows in runs of consecutive rows (a
    block shuffle's), :data:`RUN_ROWS` or more on average: then copying the runs straight
    from a window's chunks (:class:`Parts`) beats joining them and gathering row by row."""
    if not isinstance(perm, np.ndarray) or len(perm) < 2:
        return False
    return int(np.count_nonzero(np.diff(perm) != 1)) * RUN_ROWS < len(perm)


class Parts:
    """A window's chunk pieces (column sets, host arrays), not joined: rows of their
    concatenation are copied out run by run, each run of consecutive rows one slice per
    array, so the window is never copied as a whole (see :func:`long_runs`)."""

    __slots__ = ("parts", "starts", "offsets")

    def __init__(self, parts: Sequence[dict]):
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [nrows(p) for p in self.parts])
        #: each list output's row offsets over the whole window (its rows' lengths, by window row)
        self.offsets = {}
        for k, v in self.parts[0].items() if self.parts else ():
            if isinstance(v, Ragged):
                ends = np.cumsum([0] + [int(p[k].offsets[-1] - p[k].offsets[0]) for p in self.parts])
                self.offsets[k] = np.concatenate([p[k].offsets[:-1] - p[k].offsets[0] + e
                                                  for p, e in zip(self.parts, ends[:-1])] + [ends[-1:]])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return sum(nbytes(p) for p in self.parts)

    def take(self, idx: np.ndarray, alloc=None) -> dict:
        """Rows ``idx`` (positions in the concatenation, host int64) in new arrays (from
        ``alloc(shape, dtype)`` when given, as in :func:`concat`)."""
        starts, slices = self.starts, []  # (piece, first row, end row) of each run, in order
        if len(idx):
            cut = np.flatnonzero(np.diff(idx) != 1) + 1
            lo, hi = idx[np.r_[0, cut]], idx[np.r_[cut - 1, len(idx) - 1]] + 1
            first = np.searchsorted(starts, lo, side="right") - 1
            last = np.searchsorted(starts, hi - 1, side="right") - 1
            for a, b, p, q in zip(lo.tolist(), hi.tolist(), first.tolist(), last.tolist()):
                while p < q:  # a run across the end of a piece
                    slices.append((p, a - int(starts[p]), int(starts[p + 1] - starts[p])))
                    a, p = int(starts[p + 1]), p + 1
                slices.append((p, a - int(starts[p]), b - int(starts[p])))
        slices = slices or [(0, 0, 0)]
        out = {}
        for k, v in self.parts[0].items():
            pieces = [(self.parts[p][k], a, b) for p, a, b in slices]
            if isinstance(v, Ragged):
                values = _join([r.values[r.offsets[a]:r.offsets[b]] for r, a, b in pieces], alloc)
                window = self.offsets[k]
                off = _empty(np, (len(idx) + 1,), np.int64, alloc)
                off[0] = 0
                np.cumsum(window[idx + 1] - window[idx], out=off[1:])
                out[k] = Ragged(values, off)
            else:
                out[k] = _join([c[a:b] for c, a, b in pieces], alloc)  # a copy, even of one
        return out


class _Piece:
    """Rows waiting to be batched: a column set, optionally read through a permutation
    (which may take only some of its rows), or a window's :class:`Parts` read through one."""

    __slots__ = ("cols", "perm", "pos", "n", "alloc")

    def __init__(self, cols, perm, alloc=None):
        self.cols, self.perm, self.pos, self.alloc = cols, perm, 0, alloc  # cols: a column set or Parts
        self.n = nrows(cols) if perm is None else len(perm)

    def plan(self, k: int) -> Callable[[], dict]:
        """The next ``k`` rows, as a function that makes them (safe to call on any thread:
        it only reads the piece's arrays)."""
        a, self.pos = self.pos, self.pos + k
        cols, alloc = self.cols, self.alloc
        if self.perm is None:
            return lambda: rows(cols, a, a + k)
        idx = self.perm[a:a + k]
        if isinstance(cols, Parts):
            return lambda: cols.take(idx, alloc)
        return lambda: take(cols, idx, alloc)

    def take(self, k: int) -> dict:
        return self.plan(k)()


class Batcher:
    """Cuts a stream of windows into batches of the planned sizes.

    Rows not used by one window's batches carry over into the next window's first
    batch, so batch boundaries ignore window and chunk boundaries. Without a
    permutation a batch that lies inside one chunk is a view of it (no copy).

    Parameters
    ----------
    sizes : the batch sizes this rank yields this epoch (from :func:`gpuload.plan.batch_sizes`).
    alloc : ``alloc(shape, dtype)`` for the arrays of gathered or joined batches (NumPy
        only; default: new arrays), e.g. a :class:`gpuload.memory.HostPool`'s ``array``.
    deferred : yield each batch as a function that gathers it (default False: the batch),
        so that several threads can gather batches at once; the order of the functions is
        the batches' order, and each only reads the windows it was cut from.
    """

    def __init__(self, sizes: Sequence[int], alloc=None, deferred: bool = False):
        self._sizes, self._next, self._alloc = sizes, 0, alloc  # an index: sizes may be long (plan.BatchSizes)
        self._deferred = deferred
        self._pieces: deque[_Piece] = deque()
        self._available = 0

    def add(self, cols: dict, perm=None) -> Iterator[dict]:
        """Add a window (rows ``perm`` in that order if given: a permutation of its rows, or
        part of one) and yield every batch now complete."""
        piece = _Piece(cols, perm, self._alloc)
        if piece.n:
            self._pieces.append(piece)
            self._available += piece.n
        while self._next < len(self._sizes) and self._available >= self._sizes[self._next]:
            self._next += 1
            yield self._cut(self._sizes[self._next - 1])
        # a shuffled window's rows still to come (fewer than a batch) are gathered now, so
        # the window itself is released before the next one is concatenated
        self._pieces = deque(_Piece(p.take(p.n - p.pos), None, self._alloc) if p.perm is not None else p
                             for p in self._pieces)

    def _cut(self, size: int):
        plans = []
        while size:
            p = self._pieces[0]
            k = min(size, p.n - p.pos)
            plans.append(p.plan(k))
            size -= k
            self._available -= k
            if p.pos == p.n:
                self._pieces.popleft()
        alloc = self._alloc

        def cut() -> dict:
            parts = [make() for make in plans]
            if alloc is None or len(parts) == 1:
                return concat(parts, alloc)
            return concat(parts, _Slab(alloc, _joined_nbytes(parts)))  # one buffer for the batch's arrays

        return cut if self._deferred else cut()

    @property
    def done(self) -> bool:
        """True once every planned batch has been cut."""
        return self._next == len(self._sizes)
