"""Layout: how a chunk's outputs are stored, and how a batch is turned back into outputs.

Two layouts, chosen with ``layout=`` (default ``"auto"``: ``"rows"`` where rows are gathered,
``"columns"`` where none is, unless more of the dataset is cached as row blocks:
:attr:`gpuload.config.Options.stored_layout`):

* ``"columns"``: one array per output, as the batch hands them out.
* ``"rows"``: single-column scalar outputs that share a storage dtype (after
  ``dtypes=``) are stored together as one row-major ``[rows, k]`` *block*, so a shuffled
  gather copies each row's bytes from one place (``k * itemsize`` contiguous bytes)
  instead of ``k`` places, and the batch stage handles a few arrays per batch instead of
  one per column. Stacked groups, fixed-size lists and list columns are stored as they
  are in both layouts (they are already one array, or two, per output).

Every stage between the decoder and the hand-off (cache files, windows, gathers,
slices) works on the *stored* column set. :meth:`Layout.unpack` makes the outputs
just before the hand-off: a block's batch rows are transposed once into one
batch-sized buffer (a single copy of ``rows * k`` values), and each of its outputs is a
contiguous 1-D view of a row of that buffer, so consumers get the same contiguous
tensors in both layouts. Everything here works unchanged on NumPy and CuPy arrays.

A chunk's scalar outputs reach :meth:`Layout.pack` as :class:`Pieces` (one array per row
group, as the converter made them) and are copied once, into their block (:func:`stack`,
a cache-sized tile of rows at a time) or into an array of their own (:func:`joined`).

A block is named ``"#" + dtype string`` (e.g. ``"#<f4"``); output names cannot start
with ``#`` in that layout (:func:`spec_description` refuses them). The blocks and
their members are recorded in the spec description (each member's entry carries
``"block"``), so they are part of the cache key and of every chunk file's header.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Iterator, Sequence

import numpy as np

from .batch import Ragged, _empty, _join, _xp, concat
from .errors import ConfigError, setting
from .dtypes import storage_dtype
from .schema import SCALAR, OutputSpec

__all__ = ["LAYOUTS", "Layout", "Pieces", "joined", "merge_pieces", "stack", "block_members", "stored_outputs", "is_block",
           "spec_description"]

LAYOUTS = ("rows", "columns")


def block_members(desc: list) -> dict[str, list[str]]:
    """``{block name: [member outputs, in spec order]}`` of a spec description."""
    blocks: dict[str, list[str]] = {}
    for d in desc:
        if "block" in d:
            blocks.setdefault(d["block"], []).append(d["name"])
    return blocks


def stored_outputs(desc: list) -> tuple:
    """``(name, kind, storage dtype str, width)`` per *stored* array of a spec description:
    each output, except that a block replaces its members (at its first member's place)."""
    out, blocks = [], block_members(desc)
    for d in desc:
        b = d.get("block")
        if b is None:
            out.append((d["name"], d["kind"], storage_dtype(d["dtype"]).str, int(d["width"])))
        elif blocks[b][0] == d["name"]:
            out.append((b, "group", storage_dtype(d["dtype"]).str, len(blocks[b])))
    return tuple(out)


class Layout:
    """Packs decoded outputs into stored arrays and unpacks batches (see the module doc).

    Parameters
    ----------
    desc : the spec description (:func:`spec_description`), whose
        ``"block"`` entries say which outputs share a block.
    """

    def __init__(self, desc: list):
        self.outputs = [d["name"] for d in desc]
        self.blocks = block_members(desc)
        self._where = {m: (b, j) for b, ms in self.blocks.items() for j, m in enumerate(ms)}

    def pack(self, cols: dict, alloc=None) -> dict:
        """Stored column set of a chunk's decoded outputs ``cols`` (new block arrays, from
        ``alloc(shape, dtype)`` when given, NumPy only; :class:`Pieces` copied
        once, into a block or joined into an array of their own; other outputs unchanged),
        in the order of :func:`stored_outputs`."""
        out = {}
        for name in self.outputs:
            where = self._where.get(name)
            if where is None:
                out[name] = joined(cols[name], alloc)
            elif where[1] == 0:
                out[where[0]] = stack([cols[m] for m in self.blocks[where[0]]], alloc)
        return out

    def unpack(self, cols: dict, alloc=None) -> dict:
        """Output column set of a stored one (a batch, or any rows of a chunk): each block's
        members become contiguous views of one transposed copy of it (into
        ``alloc(shape, dtype)`` when given, NumPy only)."""
        if not self.blocks:
            return cols
        rows = {}
        for b in self.blocks:
            v = cols[b]
            if alloc is None or _xp(v).__name__ != "numpy":
                rows[b] = _xp(v).ascontiguousarray(v.T)
            else:
                rows[b] = alloc(v.shape[::-1], v.dtype)
                rows[b][...] = v.T
        out = {}
        for name in self.outputs:
            where = self._where.get(name)
            out[name] = cols[name] if where is None else rows[where[0]][where[1]]
        return out


class Pieces:
    """A 1-D host column given as consecutive NumPy arrays, not joined: a chunk's row groups
    converted one by one (:func:`gpuload.convert.table_to_columns` with ``pieces=True``).

    The layout copies each piece once into where the chunk is stored (a block's column, or an
    array of its own: :meth:`Layout.pack`), where joining them first would copy
    every scalar column of a first epoch once more, into newly allocated pages.
    """

    __slots__ = ("parts", "starts", "dtype")

    def __init__(self, parts: Sequence[np.ndarray]):
        if not parts:
            raise ValueError("Pieces needs at least one part (an empty one for no rows)")
        self.parts = [np.ascontiguousarray(p) for p in parts]
        self.dtype = self.parts[0].dtype
        self.starts = [0]  # row where each part starts, then the total
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def spans(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(row offset from start, rows)`` of the parts' rows in ``start:stop``, in order."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.parts) and self.starts[i] < stop:
            a, b = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if b > a:
                yield a - start, self.parts[i][a - self.starts[i]:b - self.starts[i]]
            i += 1

    def join(self, alloc=None) -> np.ndarray:
        """One array of every part (the part itself when there is one, else into ``alloc(shape, dtype)``)."""
        return self.parts[0] if len(self.parts) == 1 else _join(self.parts, alloc)


def joined(v, alloc=None):
    """``v`` as one array: :class:`Pieces` joined (into ``alloc(shape, dtype)``), anything else as it is."""
    return v.join(alloc) if isinstance(v, Pieces) else v


def merge_pieces(parts: Sequence[dict], alloc=None) -> dict:
    """One column set of a pack's, one per file (:func:`gpuload.packs.pack_small`), their rows one after
    another: :class:`Pieces` put one after another (the layout still copies each once), other arrays joined
    (host ones into ``alloc(shape, dtype)`` when given). A part on the host beside parts on a GPU (a file
    the GPU decoder left to the CPU) is sent to the GPU. A single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        got = [p[k] for p in parts]
        if all(isinstance(v, Pieces) for v in got):
            out[k] = Pieces([a for v in got for a in v.parts])
            continue
        got = [joined(v) for v in got]
        xp = next((m for m in (_xp(v.values if isinstance(v, Ragged) else v) for v in got) if m is not np), np)
        if xp is not np:
            got = [Ragged(xp.asarray(v.values), xp.asarray(v.offsets)) if isinstance(v, Ragged) else xp.asarray(v)
                   for v in got]
        out[k] = concat([{k: v} for v in got], alloc)[k]
    return out


_TILE = 1 << 14  # rows per tile when interleaving columns on the CPU: the tile stays in cache


def stack(columns: list, alloc=None):
    """``[rows, k]`` C-contiguous array whose column ``j`` is ``columns[j]`` (arrays of one
    dtype, NumPy or CuPy, or :class:`Pieces`; from ``alloc(shape, dtype)`` when given, NumPy only)."""
    first = columns[0]
    xp = np if isinstance(first, Pieces) else _xp(first)
    n = len(first)
    out = _empty(xp, (n, len(columns)), first.dtype, alloc)
    tile = _TILE if xp is np else max(n, 1)  # on a GPU: one strided copy kernel per column
    for a in range(0, n, tile):  # on the CPU: strided stores a tile at a time, not k passes over the block
        b = min(n, a + tile)
        t = out[a:b]
        for j, c in enumerate(columns):
            if isinstance(c, Pieces):
                for off, part in c.spans(a, b):
                    t[off:off + len(part), j] = part
            else:
                t[:, j] = c[a:b]
    return out


def is_block(name: str) -> bool:
    """Whether a stored array's name is a block's (not an output's)."""
    return name.startswith("#")


#: the mark of chunk files whose rows were permuted once for block shuffling; "permuted-2": by a permutation
#: keyed by the file's size and version, not its path (files that held the older one are another column set)
PERMUTED = "permuted-2"


def spec_description(specs: Sequence[OutputSpec], layout: str = "columns", permuted: bool = False) -> list[dict]:
    """A JSON-able description of ``specs`` stored in ``layout`` (see the module doc):
    what the cache key hashes and chunk headers carry.

    With ``layout="rows"``, every single-column scalar output whose storage dtype it shares
    with another one gets ``"block": "#<dtype>"``; ``permuted`` (block shuffling) marks
    every entry ``"rows": PERMUTED``: chunk files whose rows were permuted once when
    they were built. Neither is written otherwise, so caches of plain column files keep
    their key.
    """
    desc = [{"name": s.name, "columns": list(s.columns), "kind": s.kind, "dtype": s.dtype, "width": s.width,
             "sources": [[v.dtype, v.temporal] + ([v.encode] if v.encode else []) for v in s.sources],
             "fills": list(s.fills)} for s in specs]
    if layout == "rows":
        bad = [s.name for s in specs if s.name.startswith("#")]
        if bad:
            raise ConfigError(f"output {bad[0]!r}: names starting with '#' are reserved by layout='rows'; "
                              "rename the output")
        share = Counter(storage_dtype(s.dtype).str for s in specs if s.kind == SCALAR)
        for d, s in zip(desc, specs):
            dt = storage_dtype(s.dtype).str
            if s.kind == SCALAR and share[dt] > 1:
                d["block"] = "#" + dt
    elif layout != "columns":
        raise ConfigError(f"{setting('layout', layout)} must be 'rows' or 'columns'")
    if permuted:
        for d in desc:
            d["rows"] = PERMUTED
    return desc
