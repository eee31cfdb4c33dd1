"""Cache: converted chunks on local disk, one file per chunk.

File format (version 1), little-endian::

    offset 0   8 bytes   magic b"GPULOAD\\0"
    offset 8   u32       format version (1)
    offset 12  u32       header length H in bytes
    offset 16  u64       xxh3-64 of the header bytes
    offset 24  H bytes   header: UTF-8 JSON (the chunk's manifest, below)
    ...        zeros     up to the next multiple of 4096
    regions    each starts at a multiple of 4096; the file ends on one too

The header holds ``rows``, the ``source`` (path, size, mtime_ns, row groups) and a list
of ``regions``: ``{"output", "part" ("data", "values" or "offsets"), "dtype", "shape",
"offset", "nbytes", "xxh3"}``. Every region is a C-contiguous array, so a reader (mmap,
pread or KvikIO into device memory) takes one read of the file and makes views by
offset. No pickle anywhere.

Layout of a cache directory::

    <cache_dir>/v1/<hash of source path>/<spec>-<file version>-<rg start>-<rg stop>.glc

The name covers every input that changes the bytes: the source path, its size and
mtime (the file version), the columns, groups, dtypes and fill values (the spec), the
row groups, and the format version. A changed source file changes only its own names;
its stale chunks are deleted when its new chunks are written.

Writes go to a temporary name in the same folder, are fsynced and renamed into place:
a reader sees a complete file or none. Each chunk has a lock file (``fcntl`` locks,
released by the OS when a process dies) so concurrent builders build it once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import xxhash
from filelock import FileLock

from .batch import Ragged, nbytes, nrows
from .errors import CacheError, CorruptCacheError

__all__ = ["ChunkKey", "ChunkCache", "write_chunk", "read_chunk", "read_header", "default_cache_dir"]

log = logging.getLogger("gpuload")

MAGIC = b"GPULOAD\0"
FORMAT_VERSION = 1
ALIGN = 4096
_PREFIX = struct.Struct("<8sIIQ")
SUFFIX = ".glc"
_PENDING_WRITES = 2
_LAYOUT = f"v{FORMAT_VERSION}"


def default_cache_dir() -> Path:
    """``$GPULOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpuload``, else ``~/.cache/gpuload``."""
    env = os.environ.get("GPULOAD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpuload"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one cached chunk; :meth:`relpath` is its file name in the cache."""

    path: str  # absolute source path
    version: str  # source file version (size + mtime)
    spec: str  # hash of the output spec
    rg_start: int
    rg_stop: int

    @property
    def folder(self) -> str:
        return xxhash.xxh64_hexdigest(self.path.encode())

    def relpath(self) -> str:
        return f"{_LAYOUT}/{self.folder}/{self.spec}-{self.version}-{self.rg_start}-{self.rg_stop}{SUFFIX}"


def _regions(cols: dict) -> list[tuple[str, str, np.ndarray]]:
    out = []
    for name, v in cols.items():
        if isinstance(v, Ragged):
            out += [(name, "values", np.asarray(v.values)), (name, "offsets", np.asarray(v.offsets))]
        else:
            out.append((name, "data", np.asarray(v)))
    return out


def _layout(cols: dict, source: dict) -> tuple[bytes, list[dict], list[np.ndarray], int]:
    """Header bytes, region entries, arrays and total file size of a chunk file."""
    regions, arrays = [], []
    for name, part, arr in _regions(cols):
        arr = np.ascontiguousarray(arr)
        regions.append({"output": name, "part": part, "dtype": arr.dtype.str, "shape": list(arr.shape),
                        "offset": 0, "nbytes": arr.nbytes, "xxh3": xxhash.xxh3_64_hexdigest(arr)})
        arrays.append(arr)
    rows = next((len(v.offsets) - 1 if isinstance(v, Ragged) else len(v) for v in cols.values()), 0)
    header = {"format": FORMAT_VERSION, "rows": rows, "source": source, "regions": regions}
    # region offsets depend on the header's length, which depends on the offsets'
    # digits: repeat until they agree (offsets only grow, so this ends quickly)
    blob = b""
    while True:
        offset = _align(_PREFIX.size + len(blob))
        for r in regions:
            r["offset"], offset = offset, _align(offset + r["nbytes"])
        again = json.dumps(header, separators=(",", ":")).encode()
        if again == blob:
            return blob, regions, arrays, max(offset, _align(_PREFIX.size + len(blob)))
        blob = again


def chunk_file_size(cols: dict, source: dict) -> int:
    """Bytes the cache file of ``cols`` takes on disk."""
    return _layout(cols, source)[3]


def write_chunk(path: Path, cols: dict, source: dict) -> int:
    """Write ``cols`` atomically as a cache file at ``path``; returns the file size.

    The data goes to a temporary file beside ``path``, is fsynced, then renamed.
    """
    blob, regions, arrays, total = _layout(cols, source)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob), xxhash.xxh3_64_intdigest(blob)))
            f.write(blob)
            for r, arr in zip(regions, arrays):
                f.seek(r["offset"])
                f.write(memoryview(arr).cast("B") if arr.nbytes else b"")
            f.truncate(total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return total


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(f, path) -> tuple[dict, int]:
    """Read and check the prefix and header of an open cache file.

    Returns (header dict, offset of the first region). Raises :class:`CorruptCacheError`.
    """
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        raise CorruptCacheError(f"{path}: truncated cache file (no header)")
    magic, version, hlen, hsum = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCacheError(f"{path}: not a gpuload cache file (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptCacheError(f"{path}: cache format {version}, this gpuload reads {FORMAT_VERSION}")
    blob = f.read(hlen)
    if len(blob) != hlen or xxhash.xxh3_64_intdigest(blob) != hsum:
        raise CorruptCacheError(f"{path}: header checksum mismatch")
    header = json.loads(blob)
    return header, _align(_PREFIX.size + hlen)


def read_chunk(path: Path, verify: bool = True, verified: set | None = None) -> tuple[dict, dict]:
    """Map a cache file into memory and return (header, column set of views into it).

    The mapping is private (copy-on-write): a batch changed in place never changes the
    file. Its pages are populated here, on the calling (loader) thread, so the
    training thread never page-faults into the file. With ``verify`` every region's
    checksum is compared, except for files in ``verified`` (identities of files
    already checked; a verified file's identity is added to it). Raises
    ``FileNotFoundError`` when absent and :class:`CorruptCacheError` when the file
    fails a check.
    """
    with open(path, "rb", buffering=0) as f:
        header, start = read_header(f, path)
        end = region_span(header, start)
        st = os.fstat(f.fileno())
        size = st.st_size
        ident = file_identity(st)
        if verified is not None and ident in verified:
            verify = False
        if size < end:  # checked before mapping: reading past the end would be SIGBUS
            raise CorruptCacheError(f"{path}: truncated cache file ({size} of {end} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    _populate(mm)
    cols = columns_from_buffer(np.frombuffer(mm, np.uint8), header, path, verify)
    if verify and verified is not None:
        verified.add(ident)
    return header, cols


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def _populate(mm: mmap.mmap) -> None:
    """Fault every page of ``mm`` in now (one madvise, else one read per page)."""
    try:
        mm.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError, AttributeError):
        np.frombuffer(mm, np.uint8)[::mmap.PAGESIZE].max(initial=0)


def region_span(header: dict, start: int) -> int:
    """End offset of the last region of a chunk file whose regions begin at ``start``."""
    return max((r["offset"] + r["nbytes"] for r in header["regions"]), default=start)


def file_identity(st: os.stat_result) -> tuple:
    """What identifies one version of a file (for verify-once)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def columns_from_buffer(buf, header: dict, path, verify: bool, base: int = 0) -> dict:
    """Views of each region of a chunk whose file, from byte ``base`` on, is in ``buf``.

    ``buf`` is a uint8 NumPy or CuPy array; ``verify`` (NumPy only) compares checksums.
    """
    cols: dict = {}
    for r in header["regions"]:
        raw = buf[r["offset"] - base: r["offset"] - base + r["nbytes"]]
        if verify and xxhash.xxh3_64_hexdigest(raw) != r["xxh3"]:
            raise CorruptCacheError(f"{path}: checksum mismatch in {r['output']}/{r['part']}")
        arr = raw.view(np.dtype(r["dtype"])).reshape(r["shape"])
        if r["part"] == "data":
            cols[r["output"]] = arr
        else:
            cols.setdefault(r["output"], {})[r["part"]] = arr
    return {k: Ragged(v["values"], v["offsets"]) if isinstance(v, dict) else v for k, v in cols.items()}


class ChunkCache:
    """A cache directory: get-or-build chunks, with locking, a size budget and checks.

    Parameters
    ----------
    root : the cache directory (created if missing).
    max_bytes : budget for chunk files in bytes; None means unbounded. When a new
        chunk would exceed it, the chunk is not written (it is streamed from Parquet
        every epoch instead) and nothing already cached is evicted.
    verify : ``True`` (default): compare a file's checksums the first time this
        process reads it (again whenever the file changes); ``"always"``: on every
        read; ``False``: never (the header is still checked).
    read : ``read(path, verify, verified) -> column set`` (default: :func:`read_chunk`
        into host memory; the GPU path passes a KvikIO reader into device memory).
    to_host : ``to_host(column set) -> host column set`` the writer may keep (default:
        a copy when ``shared``, else the columns themselves).
    trust_writes : count files this process wrote as checked (default False). The GPU
        path sets it, so that its cached epochs read straight into device memory
        without a host pass over data that just came from its own memory.
    metrics : a :class:`gpuload.Metrics` that records ``cache_read`` and ``cache_write``
        spans (default None).
    """

    def __init__(self, root, max_bytes: int | None = None, verify: bool | str = True,
                 read: Callable | None = None, to_host: Callable | None = None, trust_writes: bool = False,
                 metrics=None):
        self.metrics = metrics
        self._read_fn = read or (lambda p, v, s: read_chunk(p, v, s)[1])
        self._to_host = to_host
        self._trust_writes = trust_writes
        self._verified: set[tuple] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuload-write")
        self._slots = threading.Semaphore(_PENDING_WRITES)  # chunks waiting to be written, at most
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.verify = verify
        try:
            (self.root / _LAYOUT).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cache_dir {self.root}: cannot create it ({e}); pass another cache_dir "
                             "or set GPULOAD_CACHE_DIR") from None
        self.full = False  # set once the budget refused a chunk

    def path(self, key: ChunkKey) -> Path:
        return self.root / key.relpath()

    def _lock(self, key: ChunkKey) -> FileLock:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        # not thread-local: a background writer releases the lock its loader took
        return FileLock(str(p) + ".lock", thread_local=False)

    def load(self, key: ChunkKey, build: Callable[[], tuple[dict, dict]], shared: bool = True
             ) -> tuple[dict, bool]:
        """The chunk's column set, and whether it came from the cache.

        Reads the cached file if present and valid. Otherwise, holding the chunk's
        lock, calls ``build()`` -> (column set, source info) and writes the result if
        the budget allows. A corrupt file is rebuilt, never served.

        Without a budget the write (and its fsync) happens on a background writer
        thread that keeps the chunk's lock until the file is in place, so decoding
        goes on meanwhile; other readers of the chunk wait for the lock and then read
        the file. :meth:`flush` waits for pending writes. ``shared=True`` (default)
        says the caller may hand views of the columns to code that changes them in
        place, so the writer works on its own copy.
        """
        p = self.path(key)
        try:
            return self._read(p), True
        except FileNotFoundError:
            log.debug("gpuload: %s is not cached yet", p)
        except CorruptCacheError as e:
            log.warning("gpuload: %s; rebuilding it from its source", e)
        lock = self._lock(key)
        lock.acquire()
        try:
            with contextlib.suppress(FileNotFoundError):
                try:
                    return self._read(p), True  # another process built it meanwhile
                except CorruptCacheError:
                    p.unlink(missing_ok=True)
            for stale in p.parent.glob(p.name + ".tmp.*"):  # left by a killed writer
                stale.unlink(missing_ok=True)
            cols, source = build()
            self._drop_stale(key)
            if self.max_bytes is None:
                self._slots.acquire()
                # the writer gets its own copy: the caller may hand views of ``cols`` to
                # a training loop that changes them in place before the write happens
                snapshot = self._host(cols, copy=shared)
                try:
                    self._writer.submit(self._write_and_release, p, snapshot, source, lock)
                except BaseException:  # e.g. at interpreter shutdown: give the slot back
                    self._slots.release()
                    raise
                lock = None  # the writer releases it
            else:
                with FileLock(str(self.root / _LAYOUT / ".budget.lock")):
                    host = self._host(cols, copy=False)  # written before anyone else sees ``cols``
                    if not self.full:
                        used = sum(e.stat().st_size for e in self.entries())
                        self.full = used + chunk_file_size(host, source) > self.max_bytes
                    if not self.full:
                        self._write(p, host, source)
            return cols, False
        finally:
            if lock is not None:
                lock.release()

    def _host(self, cols: dict, copy: bool) -> dict:
        """Host arrays of ``cols`` for the writer: ``to_host``'s, else a copy if ``copy``, else ``cols``."""
        if self._to_host is not None:
            return self._to_host(cols)
        if not copy:
            return cols
        return {k: Ragged(v.values.copy(), v.offsets.copy()) if isinstance(v, Ragged) else v.copy()
                for k, v in cols.items()}

    def _read(self, p: Path) -> dict:
        verify, seen = (bool(self.verify), None) if self.verify == "always" or not self.verify else (True, self._verified)
        if self.metrics is None:
            return self._read_fn(p, verify, seen)
        with self.metrics.span("cache_read") as span:  # a missing or corrupt file records nothing
            cols = self._read_fn(p, verify, seen)
            span.nbytes, span.rows = nbytes(cols), nrows(cols)
        return cols

    def _write(self, path: Path, cols: dict, source: dict) -> None:
        try:
            if self.metrics is None:
                write_chunk(path, cols, source)
            else:
                with self.metrics.span("cache_write", rows=nrows(cols)) as span:
                    span.nbytes = write_chunk(path, cols, source)
            if self._trust_writes:
                self._verified.add(file_identity(path.stat()))
        except OSError as e:  # e.g. disk full, or a `cache clear` meanwhile: the data is still served
            log.warning("gpuload: could not write cache file %s (%s); it will be read from Parquet again", path, e)

    def _write_and_release(self, path: Path, cols: dict, source: dict, lock: FileLock) -> None:
        try:
            self._write(path, cols, source)
        finally:
            lock.release()
            self._slots.release()

    def flush(self) -> None:
        """Wait until every background write has finished."""
        for _ in range(_PENDING_WRITES):
            self._slots.acquire()
        for _ in range(_PENDING_WRITES):
            self._slots.release()

    def _drop_stale(self, key: ChunkKey) -> None:
        """Delete chunks of older versions of ``key``'s source file (same spec)."""
        folder = self.root / _LAYOUT / key.folder
        for p in folder.glob(f"{key.spec}-*{SUFFIX}"):
            if p.name.split("-")[1] != key.version:
                p.unlink(missing_ok=True)

    def entries(self) -> Iterator[Path]:
        """Every complete chunk file in the cache."""
        yield from (self.root / _LAYOUT).glob(f"*/*{SUFFIX}")

    def temporaries(self) -> Iterator[Path]:
        """Temporary files left by writers that were killed."""
        yield from (self.root / _LAYOUT).glob(f"*/*{SUFFIX}.tmp.*")

    def summary(self) -> dict:
        """Counts and bytes of the chunk files, per source file, plus leftover temporaries."""
        sources: dict[str, dict] = {}
        total = 0
        for p in self.entries():
            size = p.stat().st_size
            total += size
            try:
                with open(p, "rb") as f:
                    src = read_header(f, p)[0]["source"]["path"]
            except (OSError, ValueError, KeyError, CorruptCacheError):
                src = "(unreadable header)"
            e = sources.setdefault(src, {"chunks": 0, "bytes": 0})
            e["chunks"] += 1
            e["bytes"] += size
        return {"root": str(self.root), "chunks": sum(e["chunks"] for e in sources.values()), "bytes": total,
                "sources": sources, "temporaries": len(list(self.temporaries()))}

    def verify_all(self, progress=None) -> list[tuple[Path, str]]:
        """Read every chunk file with checksums; returns (path, problem) for each bad one."""
        bad = []
        for p in sorted(self.entries()):
            try:
                read_chunk(p, verify=True)
            except (CorruptCacheError, ValueError, KeyError) as e:
                bad.append((p, str(e)))
            if progress is not None:
                progress(p)
        return bad

    def clear(self) -> int:
        """Delete every chunk, temporary and lock file; returns bytes freed."""
        freed = 0
        layout = self.root / _LAYOUT
        for p in list(layout.glob("*/*")) + list(layout.glob(".*.lock")):
            with contextlib.suppress(FileNotFoundError):
                freed += p.stat().st_size if p.name.endswith(SUFFIX) else 0
                p.unlink()
        for d in layout.glob("*"):
            if d.is_dir():
                with contextlib.suppress(OSError):  # not empty: another process is writing
                    d.rmdir()
        return freed
