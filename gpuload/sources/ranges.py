"""Ranges: which bytes of a Parquet file a chunk needs, and a file made of just those bytes.

:func:`column_ranges` reads the byte ranges of column chunks from a footer,
:func:`coalesce` merges and splits them into requests, and :class:`RangeFile` serves
pyarrow's Parquet reader from the fetched ranges (see :mod:`gpuload.sources.fetch`).
"""

from __future__ import annotations

import bisect
from typing import Callable

__all__ = ["column_ranges", "data_end", "image_ranges", "coalesce", "ReadOnlyFile", "RangeFile"]


def column_ranges(meta, rg_start: int, rg_stop: int, leaves) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of the column chunks of ``leaves`` in row groups
    ``[rg_start, rg_stop)``, from the footer ``meta`` (dictionary pages included)."""
    out = []
    for g in range(rg_start, rg_stop):
        rg = meta.row_group(g)
        for i in leaves:
            c = rg.column(i)
            start = c.data_page_offset
            if c.has_dictionary_page and 0 < c.dictionary_page_offset < start:
                start = c.dictionary_page_offset
            out.append((start, start + c.total_compressed_size))
    return out


def data_end(meta, size: int) -> int:
    """Offset of what follows a file's last column chunk (page indexes, bloom filters, footer):
    ``size`` is the file's length in bytes, ``meta`` its footer."""
    end = max((e for g in range(meta.num_row_groups) for _, e in column_ranges(meta, g, g + 1, range(meta.num_columns))),
              default=4)
    return min(end, size - meta.serialized_size - 8)


def image_ranges(meta, size: int, tail: int, groups, leaves) -> list[tuple[int, int]]:
    """What a reader of the whole file (libcudf) reads of it for ``leaves`` of row ``groups``:
    their column chunks, the leading magic bytes, and everything from ``tail`` (see
    :func:`data_end`) to the end of the file, which is ``size`` bytes long."""
    return [r for g in groups for r in column_ranges(meta, g, g + 1, leaves)] + [(0, 4), (tail, size)]


def coalesce(ranges, gap: int, longest: int) -> list[tuple[int, int]]:
    """Merge ranges closer than ``gap`` bytes, then split any longer than ``longest``."""
    merged: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if merged and a - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    for a, b in merged:
        parts = -(-(b - a) // longest)
        step = -(-(b - a) // parts)
        out += [(s, min(b, s + step)) for s in range(a, b, step)]
    return out


class ReadOnlyFile:
    """The seekable, read-only file protocol pyarrow needs, over ``read_at(start, end)`` of a
    ``size``-byte file (subclasses give it)."""

    def __init__(self, size: int):
        self._size, self._pos, self.closed = size, 0, False

    def read_at(self, start: int, end: int) -> bytes:
        raise NotImplementedError

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        data = self.read_at(self._pos, self._pos + n) if n > 0 else b""
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self._size + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class RangeFile(ReadOnlyFile):
    """A read-only file over fetched byte ranges (``parts``: ``{start: bytes}``) of one
    object, for pyarrow's Parquet reader (with ``pre_buffer=False``: one read per column chunk).

    A read outside the fetched ranges calls ``fallback(start, end)`` (counted in
    :attr:`unplanned`); a well-formed file never needs it.
    """

    def __init__(self, name: str, size: int, parts: dict[int, bytes], fallback: Callable[[int, int], bytes]):
        super().__init__(size)
        self.name, self.parts, self._fallback = name, parts, fallback
        self._starts = sorted(parts)
        self.unplanned = 0

    def read_at(self, a: int, b: int) -> bytes:
        i = bisect.bisect_right(self._starts, a) - 1
        if i >= 0:
            s = self._starts[i]
            data = self.parts[s]
            if b <= s + len(data):
                return data[a - s:b - s]
        self.unplanned += 1
        return self._fallback(a, b)
