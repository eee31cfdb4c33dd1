"""Event logs: the events a :class:`gpuload.Metrics` keeps for its trace, in bounded memory.

An :class:`EventLog` keeps the events of one kind (tuples of one shape) in the order
they came, up to ``capacity`` of them: the first half for good, then a ring of the
latest, so a trace shows how a run started and how it is going now, with a gap between
(``dropped`` events) once it has run long enough. New events are appended to a short
Python list (about 0.1 us each) and packed, ``block`` at a time, into NumPy structured
arrays of ``dtype.itemsize`` bytes per event (a Python tuple of six numbers takes about
250). Every event is handed to ``fold`` exactly once, in order, before it is packed (or
earlier, from :meth:`EventLog.fold`), so sums built by ``fold`` stay exact whatever is
dropped.

Not thread-safe: the Metrics calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

import numpy as np

__all__ = ["EventLog", "BLOCK", "PENDING_EVENT_BYTES"]

#: Events packed into one array at a time (fewer for small capacities).
BLOCK = 1024
#: Upper estimate of the bytes of one event not packed yet (a tuple of up to six Python numbers).
PENDING_EVENT_BYTES = 280


class EventLog:
    """Events of one kind: the first ``capacity // 2``, then a ring of the latest.

    Parameters
    ----------
    dtype : NumPy structured dtype of a packed event (one field per tuple element).
    capacity : events kept at most, packed or not (0: none; every event is still folded).
    fold : called with a list of events not folded yet, in order; each event once.
    encode, decode : tuple -> tuple before packing and after unpacking (e.g. None <-> NaN);
        default: as is.
    """

    def __init__(self, dtype, capacity: int, fold: Callable[[list], None],
                 encode: Callable[[tuple], tuple] | None = None, decode: Callable[[tuple], tuple] | None = None):
        self.dtype = np.dtype(dtype)
        cap = max(0, int(capacity))
        self.block = max(1, min(BLOCK, cap // 8))
        self.head_blocks = (cap // 2) // self.block
        # the events not packed yet (at most block - 1 after a push) count against the capacity too
        self.tail_blocks = max(0, (cap - self.head_blocks * self.block - (self.block - 1)) // self.block)
        self.capacity = cap
        self._fold, self._encode, self._decode = fold, encode, decode
        self.clear()

    def clear(self) -> None:
        """Forget every event (without folding them)."""
        self._pending: list[tuple] = []
        self._folded = 0  # events of _pending already folded
        self._head: list[np.ndarray] = []
        self._tail: deque[np.ndarray] = deque()
        self.dropped = 0  #: events folded and no longer kept (between the head and the ring)

    def push(self, event: tuple) -> None:
        """Add ``event`` (a tuple matching ``dtype``)."""
        self._pending.append(event)
        if len(self._pending) >= self.block:
            self._pack()

    def fold(self) -> None:
        """Hand the events not folded yet to ``fold``."""
        if self._folded < len(self._pending):
            self._fold(self._pending[self._folded:])
            self._folded = len(self._pending)

    def _pack(self) -> None:
        self.fold()
        rows = self._pending if self._encode is None else [self._encode(e) for e in self._pending]
        packed = np.array(rows, dtype=self.dtype)
        self._pending, self._folded = [], 0
        if len(self._head) < self.head_blocks:
            self._head.append(packed)
            return
        self._tail.append(packed)
        while len(self._tail) > self.tail_blocks:
            self.dropped += len(self._tail.popleft())

    # -- reading ------------------------------------------------------------------------
    @property
    def head_len(self) -> int:
        """Events kept for good (the first ones, before the gap)."""
        return sum(map(len, self._head))

    def __len__(self) -> int:
        """Events kept."""
        return sum(map(len, self._head)) + sum(map(len, self._tail)) + len(self._pending)

    @property
    def nbytes(self) -> int:
        """Bytes the kept events take: packed arrays, and an upper estimate for the others."""
        return (sum(a.nbytes for a in self._head) + sum(a.nbytes for a in self._tail)
                + len(self._pending) * PENDING_EVENT_BYTES)

    def max_nbytes(self) -> int:
        """The most :attr:`nbytes` can reach: ``capacity`` packed events, or a block not packed yet."""
        return self.capacity * self.dtype.itemsize + (self.block - 1) * PENDING_EVENT_BYTES

    def _rows(self, arrays: Iterable[np.ndarray]) -> list[tuple]:
        out = [tuple(r) for a in arrays for r in a.tolist()]
        return out if self._decode is None else [self._decode(r) for r in out]

    def parts(self) -> tuple[list[tuple], list[tuple]]:
        """The kept events as two lists of tuples, in order: before the gap (the first ones
        kept for good) and after it (the latest). When nothing was dropped the second follows
        the first without a gap."""
        return self._rows(self._head), self._rows(self._tail) + list(self._pending)

    def events(self) -> list[tuple]:
        """Every kept event, in order (across the gap, if any)."""
        head, rest = self.parts()
        return head + rest

    def field_min(self, name: str, index: int) -> float | None:
        """Smallest value of field ``name`` (tuple position ``index``) among kept events."""
        values = [float(a[name].min()) for a in (*self._head, *self._tail) if len(a)]
        values += [e[index] for e in self._pending]
        return min(values, default=None)

    def field_array(self, name: str, index: int) -> np.ndarray:
        """Field ``name`` (tuple position ``index``) of every kept event, in order, as one array."""
        pending = np.array([e[index] for e in self._pending], dtype=self.dtype[name])
        return np.concatenate([a[name] for a in (*self._head, *self._tail)] + [pending])
