"""Cache file format: one converted chunk per file, self-describing, checked on every read.

File format (version 3: :data:`FORMAT_VERSION`), little-endian::

    offset 0   8 bytes   magic b"GPULOAD\\0"
    offset 8   u32       format version (3)
    offset 12  u32       header length H in bytes
    offset 16  u64       xxh3-64 of the header bytes
    offset 24  H bytes   header: UTF-8 JSON (below)
    ...        zeros     up to the next multiple of 4096
    regions    each starts at a multiple of 4096; the file ends on one too

The header is the chunk's full identity plus its manifest::

    {"format": 3, "rows": n,
     "source": {"path", "size", "mtime_ns", "tag" (remote objects only)}, "row_groups": [start, stop],
     "spec": [one entry per output: name, columns, kind, dtype, width, sources, fills],
     "regions": [{"output", "part" ("data", "values" or "offsets"), "dtype", "shape",
                  "offset", "nbytes", "xxh3"}, ...]}

A read compares the header with the :class:`Identity` the plan expects (source path,
size and mtime, row groups, rows, the spec's hash, and every output's dtype and shape);
any difference makes the file corrupt (rebuilt, never served), whatever its checksums
say, so a valid chunk file copied or linked under another chunk's name is refused.
Every region is a C-contiguous array and the regions lie in one span, so a reader
takes one ``pread`` (into host memory, or with KvikIO into device memory) and makes
views by offset. No pickle anywhere.

:func:`write_chunk` and :func:`read_chunk` write and read one such file at a path,
outside any :class:`gpuload.cache.store.ChunkCache` (for tools and tests).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..batch import Ragged
from ..errors import CorruptCacheError
from . import directio
from .directio import pread_all, pwrite_all
from .fs import CacheRoot

__all__ = ["Identity", "FORMAT_VERSION", "LAYOUT_DIR", "SPECS_DIR", "SUFFIX", "ALIGN", "spec_hash", "version_token",
           "header_bound", "encode", "read_header", "check_identity", "open_chunk",
           "read_regions", "MALFORMED", "columns_from_buffer", "file_identity", "read_chunk", "write_chunk"]

MAGIC = b"GPULOAD\0"
FORMAT_VERSION = 3  # 3: cast float NaNs stored as one bit pattern (the same on the CPU and the GPU)
LAYOUT_DIR = f"v{FORMAT_VERSION}"  #: the cache's folder for this format
SPECS_DIR = "specs"  #: in LAYOUT_DIR: one JSON description per column set
USES_DIR = "uses"  #: live readers' records, below the layout folder (gpuload.cache.evict)
SUFFIX = ".glc"  #: chunk files' suffix
ALIGN = 4096
PREFIX = struct.Struct("<8sIIQ")
_MAX_HEADER = 64 << 20
MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError, RecursionError)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def spec_hash(spec: list) -> str:
    """The 16-hex-digit hash of a spec description (a JSON-able list, see :func:`gpuload.layout.spec_description`)."""
    return xxhash.xxh64_hexdigest(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode())


def version_token(size: int, mtime_ns: int, tag: str = "") -> str:
    """The token in a chunk file's name for one version of its source file: size and mtime,
    and ``tag``: a remote object's version marker (ETag, version id...), a local file's footer
    hash (:func:`gpuload.sources.opening.identity_tag`), or for a footer kept in the cache, a
    local file's ctime."""
    return xxhash.xxh64_hexdigest(f"{size}:{mtime_ns}{':' + tag if tag else ''}".encode())


@dataclass(frozen=True)
class Identity:
    """What a chunk file must say about itself to be served for one chunk of the plan.

    ``outputs`` lists ``(name, kind, storage dtype, width)`` per output; ``rows`` may be
    None (``cache verify`` knows the rows only from the header).
    """

    path: str
    size: int
    mtime_ns: int
    rg_start: int
    rg_stop: int
    rows: int | None
    spec: str
    outputs: tuple
    tag: str = ""  # a remote object's version marker; "" for local files
    members: tuple = ()  # a pack's files: (path, size, mtime_ns, tag, rg_start, rg_stop) each (ChunkKey's)


def _regions(cols: dict) -> list[tuple[str, str, np.ndarray]]:
    out = []
    for name, v in cols.items():
        if isinstance(v, Ragged):
            out += [(name, "values", np.asarray(v.values)), (name, "offsets", np.asarray(v.offsets))]
        else:
            out.append((name, "data", np.asarray(v)))
    return out


def header_bound(spec: list, arrays: int, source: str) -> int:
    """Bytes a chunk file's prefix and header take at most (what :func:`encode` writes) for a column set
    described by ``spec``, stored in ``arrays`` arrays, of source file ``source``: the description, a
    region entry per array, the source's path and the other fields, each well within its share."""
    return PREFIX.size + len(json.dumps(spec)) + 512 * arrays + len(source.encode()) + 4096


def encode(cols: dict, ident: dict) -> tuple[bytes, list[dict], list[np.ndarray], int]:
    """(prefix + header bytes, region entries, arrays, total file size) of a chunk file.

    ``ident`` holds the identity fields of the header (``source``, ``row_groups``, ``spec``).
    """
    regions, arrays = [], []
    for name, part, arr in _regions(cols):
        arr = np.ascontiguousarray(arr)
        regions.append({"output": name, "part": part, "dtype": arr.dtype.str, "shape": list(arr.shape),
                        "offset": 0, "nbytes": arr.nbytes, "xxh3": xxhash.xxh3_64_hexdigest(arr)})
        arrays.append(arr)
    rows = next((len(v.offsets) - 1 if isinstance(v, Ragged) else len(v) for v in cols.values()), 0)
    # no time, host or process in it: a chunk's file is the same bytes wherever and whenever it is built
    header = {"format": FORMAT_VERSION, "rows": rows, **ident, "regions": regions}
    # region offsets depend on the header's length, which depends on the offsets'
    # digits: repeat until they agree (offsets only grow, so this ends quickly)
    blob = b""
    while True:
        offset = align(PREFIX.size + len(blob))
        for r in regions:
            r["offset"], offset = offset, align(offset + r["nbytes"])
        again = json.dumps(header, separators=(",", ":")).encode()
        if again == blob:
            total = max(offset, align(PREFIX.size + len(blob)))
            head = PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob), xxhash.xxh3_64_intdigest(blob)) + blob
            return head, regions, arrays, total
        blob = again


def write_regions(fd: int, head: bytes, regions: list[dict], arrays: list, total: int, direct: bool = False) -> bool:
    """Write an encoded chunk (from :func:`encode`) to ``fd``; ``direct``: around the page
    cache (:func:`gpuload.cache.directio.write`). True if it was written directly (the file's
    bytes are the same either way)."""
    if direct and directio.write(fd, [(0, head)] + [(r["offset"], a) for r, a in zip(regions, arrays) if a.nbytes],
                                 total):
        return True
    pwrite_all(fd, head, 0)
    for r, arr in zip(regions, arrays):
        if arr.nbytes:
            pwrite_all(fd, arr, r["offset"])
    os.ftruncate(fd, total)
    return False


def read_header(fd: int, path) -> tuple[dict, int]:
    """Read and check the prefix and header of an open cache file.

    Returns (header dict, offset of the first region). Raises :class:`CorruptCacheError`.
    """
    prefix = os.pread(fd, PREFIX.size, 0)
    if len(prefix) != PREFIX.size:
        raise CorruptCacheError(f"{path}: truncated cache file (no header)")
    magic, version, hlen, hsum = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCacheError(f"{path}: not a gpuload cache file (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptCacheError(f"{path}: cache format {version}, this gpuload reads {FORMAT_VERSION}")
    if hlen > _MAX_HEADER:
        raise CorruptCacheError(f"{path}: header length {hlen} is not plausible")
    blob = os.pread(fd, hlen, PREFIX.size)
    if len(blob) != hlen or xxhash.xxh3_64_intdigest(blob) != hsum:
        raise CorruptCacheError(f"{path}: the bytes of its header do not match their checksum")
    try:
        header = json.loads(blob, parse_float=_Float)
    except (ValueError, RecursionError):
        raise CorruptCacheError(f"{path}: header is not JSON (or absurdly nested)") from None
    if not isinstance(header, dict):
        raise CorruptCacheError(f"{path}: header is not a JSON object")
    return header, align(PREFIX.size + hlen)


@functools.lru_cache(maxsize=256)
def _expected_regions(outputs: tuple, rows: int) -> dict:
    """``{(output, part): (dtype str, shape or None for any 1-D length, itemsize)}`` for ``outputs``
    (the same few for every chunk of a dataset: kept)."""
    want = {}
    for name, kind, dtype, width in outputs:
        size = np.dtype(dtype).itemsize
        if kind == "ragged":
            want[(name, "values")] = (dtype, None, size)
            want[(name, "offsets")] = (np.dtype(np.int64).str, [rows + 1], 8)
        elif kind in ("group", "fixed"):
            want[(name, "data")] = (dtype, [rows, width], size)
        else:
            want[(name, "data")] = (dtype, [rows], size)
    return want


_CHECKSUM = re.compile(r"[0-9a-f]{16}")
_SPECS_SEEN: dict[str, list] = {}  #: spec hash -> a header's spec that had it (a new one is hashed once)


class _Float(float):
    """A header's float: equal only to one of the same JSON text (``==`` has -0.0 equal 0.0, which
    fill values tell apart), so that a spec equal to one that hashed right hashes right too."""

    __slots__ = ()
    __hash__ = float.__hash__

    def __eq__(self, other) -> bool:
        return type(other) is _Float and float.__repr__(self) == float.__repr__(other)

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)


@functools.lru_cache(maxsize=256)
def _dtype_text(name: str) -> str:
    return np.dtype(name).str


def _same_spec(spec, want: str) -> bool:
    """Whether a header's ``spec`` hashes to ``want``: equal to one that did (ints, strings and
    :class:`_Float` s compare as their JSON text; a bool equal to an int stores the same bytes), or
    hashed now (its JSON text hashed: 40 us a chunk file, a tenth of a small chunk's read, each time)."""
    seen = _SPECS_SEEN.get(want)
    if seen is not None and type(spec) is list and spec == seen:
        return True
    if spec_hash(spec) != want:
        return False
    if len(_SPECS_SEEN) < 1024:
        _SPECS_SEEN[want] = spec
    return True


def check_identity(header: dict, want: Identity, path, size: int, start: int) -> int:
    """Raise :class:`CorruptCacheError` unless ``header`` (of a file of ``size`` bytes whose
    regions start at ``start``) describes exactly the chunk ``want`` and its regions fit the file;
    returns where its regions end."""
    def bad(what: str):
        return CorruptCacheError(f"{path}: {what}; this is not the chunk gpuload expects under this name")

    try:
        src = header["source"]
        got = (src["path"], src["size"], src["mtime_ns"], src.get("tag", ""), *header["row_groups"])
        if got != (want.path, want.size, want.mtime_ns, want.tag, want.rg_start, want.rg_stop):
            raise bad(f"it holds {src['path']} (size {src['size']}, mtime {src['mtime_ns']}) row groups "
                      f"{header['row_groups']}")
        members = header.get("members", [])
        if members != [list(m) for m in want.members]:
            raise bad(f"it packs {len(members)} files, not the {len(want.members)} named" if len(members) != len(
                want.members) else "it packs other files or other versions of them")
        rows = header["rows"]
        if type(rows) is not int or rows < 0 or (want.rows is not None and rows != want.rows):
            raise bad(f"it holds {rows} rows, not {want.rows}")
        if not _same_spec(header["spec"], want.spec):
            raise bad("its column spec differs")
        expected = _expected_regions(tuple(want.outputs), rows)
        end = region_span(header, start)  # whole, aligned, ordered spans after the header (else a ValueError)
        seen = set()
        for r in header["regions"]:
            key = (r["output"], r["part"])
            if key not in expected or key in seen:
                raise bad(f"unexpected region {r['output']}/{r['part']}")
            seen.add(key)
            dtype, shape, itemsize = expected[key]
            s = r["shape"]
            if _dtype_text(r["dtype"]) != dtype or not isinstance(s, list) or not all(
                    type(x) is int and x >= 0 for x in s):
                raise bad(f"region {r['output']}/{r['part']} is {r['dtype']} {s}, expected {dtype}")
            if (shape is not None and s != shape) or (shape is None and len(s) != 1):
                raise bad(f"region {r['output']}/{r['part']} has shape {s}, expected {shape or '[n]'}")
            if not (isinstance(r["xxh3"], str) and _CHECKSUM.fullmatch(r["xxh3"])):
                raise bad(f"region {r['output']}/{r['part']} has no valid checksum")
            if r["nbytes"] != math.prod(s) * itemsize:
                raise bad(f"region {r['output']}/{r['part']} has {r['nbytes']} bytes, not its shape's")
        if seen != set(expected):
            missing = sorted("/".join(k) for k in set(expected) - seen)
            raise bad(f"regions {missing} are missing")
        total = align(end)
    except CorruptCacheError:
        raise
    except MALFORMED as e:
        raise bad(f"malformed header ({type(e).__name__}: {e})") from None
    if size != total:
        raise CorruptCacheError(f"{path}: {size} bytes where its header describes {total}"
                                + (" (truncated)" if size < total else ""))
    return end


def region_span(header: dict, start: int) -> int:
    """End offset of the last region of a chunk file whose regions begin at ``start``; a
    ``ValueError`` unless every region is a whole number of bytes at an aligned offset, at or
    after ``start``, not overlapping another (all a header nobody expected can be held to;
    :func:`check_identity` holds an expected one to its regions' types and shapes too)."""
    end = start
    for r in sorted(header["regions"], key=lambda r: r["offset"]):
        off, n = r["offset"], r["nbytes"]
        if type(off) is not int or type(n) is not int or n < 0 or off % ALIGN or off < end:
            raise ValueError(f"region {r.get('output')}/{r.get('part')} has a bad offset or size")
        end = off + n
    return end


def file_identity(st: os.stat_result) -> tuple:
    """What identifies one version of a file (for verify-once): its ctime too, which any write, rename or
    ``touch`` moves and no program can set back (a file changed in place with its mtime restored)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _region_text(r: dict) -> str:
    """A region of a chunk file in words: ``output 'x'``, ``the values of list output 'h'``, ``the
    stacked float32 columns`` (a row layout's block, named ``"#" + dtype``)."""
    name, part = r["output"], r["part"]
    if name.startswith("#"):
        return f"the stacked {np.dtype(name[1:]).name} columns"
    return f"output {name!r}" if part == "data" else f"the {part} of list output {name!r}"


def columns_from_buffer(buf, header: dict, path, verify: bool, base: int = 0) -> dict:
    """Views of each region of a chunk whose file, from byte ``base`` on, is in ``buf``.

    ``buf`` is a uint8 NumPy or CuPy array; ``verify`` (NumPy only) compares checksums
    and that ragged offsets never decrease; whatever ``verify`` says, ragged offsets
    must start at 0 and end at the number of values.
    """
    cols: dict = {}
    for r in header["regions"]:
        raw = buf[r["offset"] - base: r["offset"] - base + r["nbytes"]]
        if verify and xxhash.xxh3_64_hexdigest(raw) != r["xxh3"]:
            raise CorruptCacheError(f"{path}: the bytes of {_region_text(r)} do not match their checksum")
        arr = raw.view(np.dtype(r["dtype"])).reshape(r["shape"])
        if r["part"] == "data":
            cols[r["output"]] = arr
        else:
            cols.setdefault(r["output"], {})[r["part"]] = arr
    out = {}
    for k, v in cols.items():
        if isinstance(v, dict):
            off, values = v["offsets"], v["values"]
            ordered = not verify or len(off) < 2 or not (np.diff(off) < 0).any()  # with the checksums, once a file
            if int(off[0]) != 0 or int(off[-1]) != len(values) or not ordered:
                raise CorruptCacheError(f"{path}: offsets of {k} do not describe its {len(values)} values")
            v = Ragged(values, off)
        out[k] = v
    return out


def open_chunk(fd: int, path, want: Identity | None, verify: bool, verified: set | None
               ) -> tuple[dict, int, int, bool, tuple]:
    """Check an open cache file's header: (header, offset of the regions, bytes of the regions,
    whether checksums still need comparing, the file's identity for ``verified``).

    ``want`` (None: not checked) is the identity the header must state; ``verify`` is
    dropped for files in ``verified``. Raises :class:`CorruptCacheError`.
    """
    st = os.fstat(fd)
    header, start = read_header(fd, path)
    if want is not None:
        end = check_identity(header, want, path, st.st_size, start)
    else:
        try:
            end = region_span(header, start)
        except MALFORMED as e:
            raise CorruptCacheError(f"{path}: malformed header ({e})") from None
        if st.st_size < end:
            raise CorruptCacheError(f"{path}: truncated cache file ({st.st_size} of {end} bytes)")
    ident = file_identity(st)
    if verified is not None and ident in verified:
        verify = False
    return header, start, end - start, verify, ident


def read_regions(fd: int, path, want: Identity | None, verify: bool, verified: set | None = None,
                 alloc=None, direct: bool = False) -> tuple[dict, dict]:
    """Read an open cache file into host memory: (header, column set of views into one buffer).

    The bytes are copied (``preadv``) into a buffer of ``alloc(nbytes)`` (default: a new
    array), never mapped, so nothing another process does to the file later (even
    truncating it) can reach a batch. ``want`` (None: not checked) is the identity the
    header must state. With ``verify`` every region's checksum is compared, except for
    files in ``verified`` (identities of files already checked; a verified file's
    identity is added to it). ``direct``: read around the page cache where the file system
    and ``buf`` allow (see :mod:`gpuload.cache.directio`). Raises :class:`CorruptCacheError`.
    """
    header, start, span, verify, ident = open_chunk(fd, path, want, verify, verified)
    buf = alloc(span) if alloc is not None else np.empty(span, np.uint8)
    got = pread_all(fd, buf, start, direct)
    if got != span:
        raise CorruptCacheError(f"{path}: truncated cache file ({start + got} of {start + span} bytes)")
    try:
        cols = columns_from_buffer(buf, header, path, verify, base=start)
    except MALFORMED as e:  # only without ``want``: a header nobody checked
        raise CorruptCacheError(f"{path}: malformed header ({type(e).__name__}: {e})") from None
    if verify and verified is not None:
        verified.add(ident)
    return header, cols


def write_chunk(path, cols: dict, key) -> int:
    """Write ``cols`` as the cache file of ``key`` (a :class:`gpuload.cache.paths.ChunkKey`) at
    ``path``, atomically, making its folder if missing; returns its size in bytes."""
    path = Path(path)
    head, regions, arrays, total = encode(cols, key.header_fields())
    path.parent.mkdir(parents=True, exist_ok=True)
    CacheRoot(path.parent).write((), path.name, lambda fd: write_regions(fd, head, regions, arrays, total))
    return total


def read_chunk(path, verify: bool = True, verified: set | None = None, want: Identity | None = None
               ) -> tuple[dict, dict]:
    """Read the cache file at ``path`` into host memory: (header, column set), as
    :func:`read_regions` (``want``: the identity it must state, None: not checked)."""
    path = Path(path)
    fd = CacheRoot(path.parent).open_read((), path.name)
    try:
        return read_regions(fd, path, want, verify, verified)
    finally:
        os.close(fd)
