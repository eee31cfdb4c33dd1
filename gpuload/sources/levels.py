"""Definition-level histograms from Parquet footers: nulls counted without reading a column.

A list column's statistics cannot say whether it holds nulls: their null count also counts
empty lists. Parquet's ``SizeStatistics`` (format 2.10) can: each column chunk's
*definition-level histogram* counts, per definition level, the values written at it, and for
a list ``optional group (LIST) { repeated group list { optional element } }`` level 0 is a
null list, 1 an empty one, 2 a null element and 3 a value. pyarrow writes these histograms
in every file (since Arrow 19) but does not expose them in Python, so this module reads them
from the footer's Thrift bytes (the compact protocol; every other field is skipped).

:func:`null_counts` answers for the columns of one file (one walk of its footer), or says
for each that it cannot (no histograms, as with files from writers that leave them out, a
schema whose levels it does not map, a footer it cannot parse);
:func:`gpuload.checks.check_nulls` then reads that column as before. The walk is pure
Python: it is used for list columns, whose reading it saves; a flat column without
statistics is read as before.
"""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa

__all__ = ["null_counts", "definition_histograms"]

# compact-protocol field types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_FILE_ROW_GROUPS, _ROW_GROUP_COLUMNS, _CHUNK_META, _META_SIZE_STATS, _SIZE_DEF_HIST = 4, 1, 3, 16, 3


class _Reader:
    """Just enough of Thrift's compact protocol to walk a footer and skip what is not wanted."""

    def __init__(self, data: bytes):
        self.data, self.pos = bytes(data), 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out, self.pos = _varint(self.data, self.pos)
        return out

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def fields(self):
        """(field id, type) of a struct's fields, until its stop byte."""
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            yield last, kind

    def list_header(self) -> tuple[int, int]:
        head = self.byte()
        size = head >> 4
        return (self.varint() if size == 15 else size), head & 0x0F

    def skip(self, kind: int) -> None:
        self.pos = _skip(self.data, self.pos, kind)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(the unsigned varint at ``pos``, the position after it)."""
    shift = out = 0
    while True:
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, pos
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _skip(data: bytes, pos: int, kind: int) -> int:
    """The position after the value of ``kind`` at ``pos``, containers and structs included, in
    one loop over a stack of the open ones (most of a footer is skipped: a call and a generator per
    value made the walk take 17 ms per 16-row-group, 42-column file)."""
    stack: list = []  # None: a struct (fields until its stop byte); [kind, map's value kind or None, left]
    while True:
        if kind == _STRUCT:
            stack.append(None)
        elif kind in (_I16, _I32, _I64):
            while data[pos] & 0x80:
                pos += 1
            pos += 1
        elif kind == _BINARY:
            n, pos = _varint(data, pos)
            pos += n
        elif kind in (_LIST, _SET):
            head = data[pos]
            pos += 1
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size, pos = _varint(data, pos)
            if elem in (_TRUE, _FALSE, _BYTE):  # a byte each (bools too, inside a container)
                pos += size
            elif elem == _DOUBLE:
                pos += 8 * size
            elif size:
                stack.append([elem, None, size])
        elif kind == _MAP:
            size, pos = _varint(data, pos)
            if size:
                types = data[pos]
                pos += 1
                stack.append([types >> 4, types & 0x0F, 2 * size])
        elif kind == _DOUBLE:
            pos += 8
        elif kind == _BYTE:
            pos += 1
        elif kind not in (_TRUE, _FALSE):  # a struct field's bool is in its type: no byte
            raise ValueError(f"unknown Thrift type {kind}")
        while True:  # the next value to skip: of the innermost struct or container still open
            if not stack:
                if pos > len(data):
                    raise ValueError("footer ends early")
                return pos
            top = stack[-1]
            if top is None:
                head = data[pos]
                pos += 1
                if head == 0:
                    stack.pop()
                    continue
                kind = head & 0x0F
                if not head >> 4:  # the field id in full (a zigzag varint) after the type
                    while data[pos] & 0x80:
                        pos += 1
                    pos += 1
                break
            key, value, left = top
            if not left:
                stack.pop()
                continue
            top[2] = left - 1
            kind = key if value is None or left % 2 == 0 else value  # a map's entries: key, then value
            if kind in (_TRUE, _FALSE):  # a byte each inside a container
                pos += 1
                continue
            break


def _histogram(r: _Reader) -> list[int] | None:
    """A ColumnChunk's definition-level histogram (or None), the reader left after the chunk."""
    found = None
    for fid, kind in r.fields():
        if fid != _CHUNK_META or kind != _STRUCT:
            r.skip(kind)
            continue
        for mid, mkind in r.fields():  # ColumnMetaData
            if mid != _META_SIZE_STATS or mkind != _STRUCT:
                r.skip(mkind)
                continue
            for sid, skind in r.fields():  # SizeStatistics
                if sid == _SIZE_DEF_HIST and skind == _LIST:
                    size, elem = r.list_header()
                    if elem != _I64:
                        raise ValueError("a definition-level histogram of non-i64")
                    found = [r.zigzag() for _ in range(size)]
                else:
                    r.skip(skind)
    return found


def definition_histograms(thrift: bytes, leaves, groups) -> dict[tuple[int, int], list[int] | None]:
    """``{(row group, leaf): definition-level histogram, or None}`` of the leaf columns ``leaves``
    in row groups ``groups``, from a footer's Thrift bytes (``FileMetaData``), in one walk that
    ends after the last row group wanted. Raises ValueError on bytes it cannot walk."""
    want_leaves, want_groups = set(leaves), set(groups)
    out: dict = {}
    last = max(want_groups, default=-1)
    r = _Reader(thrift)
    try:
        for fid, kind in r.fields():  # FileMetaData
            if fid != _FILE_ROW_GROUPS or kind != _LIST:
                r.skip(kind)
                continue
            count, _ = r.list_header()
            for g in range(min(count, last + 1)):
                for gid, gkind in r.fields():  # RowGroup
                    if gid != _ROW_GROUP_COLUMNS or gkind != _LIST:
                        r.skip(gkind)
                        continue
                    n, _ = r.list_header()
                    for c in range(n):
                        if g in want_groups and c in want_leaves:
                            out[g, c] = _histogram(r)
                        else:
                            r.skip(_STRUCT)
            return out  # nothing after the last row group wanted is needed
    except IndexError:
        raise ValueError("footer ends early") from None
    return out


def _levels(field: pa.Field, lists: bool) -> tuple[int, list[int]] | None:
    """(the leaf's max definition level, the levels that are nulls to count) of a top-level
    column ``field``: a flat one, or a list (variable or fixed size) of flat values; None for
    any other shape."""
    if not lists:
        return (1, [0]) if field.nullable else (0, [])
    t = field.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return None
    inner = t.value_field
    if pa.types.is_nested(inner.type):
        return None
    outer, elem = int(field.nullable), int(inner.nullable)
    # levels: [null list] (if the list is optional), empty list, [null element], value
    nulls = ([0] if outer else []) + ([outer + 1] if elem else [])
    return outer + 1 + elem, nulls


def null_counts(metadata, schema: pa.Schema, wanted: Sequence[tuple[str, int, Sequence[int], bool]]
                ) -> list[int | None]:
    """Nulls (null lists plus null elements for lists) of each ``(column, leaf, row groups,
    lists)`` of ``wanted`` (a top-level column, its Parquet leaf) in a file whose footer is
    ``metadata`` (``pq.FileMetaData``) and Arrow schema ``schema``, from its definition-level
    histograms (the footer walked once); None for each it cannot tell (then read the column)."""
    shapes = []
    for column, leaf, groups, lists in wanted:
        shape = _levels(schema.field(column), lists)
        parquet_leaf = metadata.schema.column(leaf)
        if shape is not None and (parquet_leaf.max_definition_level != shape[0]
                                  or parquet_leaf.max_repetition_level != int(lists)):
            shape = None  # another encoding of the same type (a legacy two-level list): not mapped
        shapes.append(shape)
    need = [(w, sh) for w, sh in zip(wanted, shapes) if sh is not None and sh[1]]
    found: dict = {}
    if need:
        try:
            thrift = bytes(metadata.__reduce__()[1][0])  # the footer as pyarrow holds it: its Thrift bytes
            found = definition_histograms(thrift, {w[1] for w, _ in need}, {g for w, _ in need for g in w[2]})
        except (ValueError, TypeError, IndexError, AttributeError):
            return [0 if sh is not None and not sh[1] else None for sh in shapes]
    out: list[int | None] = []
    for (column, leaf, groups, lists), shape in zip(wanted, shapes):
        if shape is None:
            out.append(None)
            continue
        max_def, nulls = shape
        total = 0
        for g in groups if nulls else ():
            h = found.get((g, leaf))
            if h is None or len(h) != max_def + 1 or sum(h) != metadata.row_group(g).column(leaf).num_values:
                total = None  # missing, or not what this schema promises: do not trust it
                break
            total += sum(h[level] for level in nulls)
        out.append(total)
    return out
