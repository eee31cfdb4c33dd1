"""Source: list Parquet files and objects, their partition keys, and fingerprint them.

Everything here runs once, when a dataset is opened, and reads no Parquet bytes (the
footers are read by :mod:`gpuload.sources.opening`, from the cache where it holds them). A source is a local file, a directory, a glob, a URL (``s3://``,
``gs://``, ``az://``, ``http(s)://``, ``file://`` or any fsspec protocol; a prefix
or folder is listed recursively), or a list of these; with ``filesystem=`` (an fsspec
filesystem or a ``pyarrow.fs.FileSystem``) paths name objects in it. Anything else (a
table, bytes, an open file) is refused with a :class:`SourceError` that says what to
pass instead.

Directories laid out Hive-style (``day=1/part-0.parquet``) give each file's partition
keys as extra columns, typed as pyarrow's partition discovery types them (integers as
int32, anything else as strings, ``__HIVE_DEFAULT_PARTITION__`` as null); they are
cached like any other column, and the key's value is part of the file's path, so of
its cache key.

A file's identity is its path (a remote object's URL), size, and mtime or, for a
remote object, the store's last-modified time and version marker (ETag, version id,
generation): never a local time.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field as _field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from ..cache.chunkfile import version_token
from ..cache.fs import CacheRoot
from ..errors import SourceError
from .ranges import data_end
from .remote import Store, hidden, is_local_fs, is_url, store_for
from .settings import RemoteSettings
from .offline import list_item
from .tables import local_table_files
from ..dtypes import storage_dtype
from ..schema import RAGGED, OutputSpec

log = logging.getLogger("gpuload")

__all__ = ["SourceFile", "Listed", "list_files", "row_group_sizes", "fingerprint", "relative_names", "common_columns",
           "all_columns", "pandas_index_columns"]

_GLOB_CHARS = set("*?[")


def footer_tag(store, tag: str, ctime_ns: int) -> str:
    """The version a file's footer is cached under: a remote object's tag; a local file's ctime
    (any write changes it, and no tool sets it back), so that a file rewritten with its old size
    and mtime is read again."""
    return tag if store is not None else f"ctime:{ctime_ns}"


@dataclass(frozen=True)
class SourceFile:
    """One Parquet file: identity, footer, and Hive partition keys.

    ``path`` is the real local path, or a remote object's URL; ``size``, ``mtime_ns``
    and ``tag`` (a remote store's version marker, "" for local files) make its identity.
    ``schema`` is the file's Arrow schema followed by its partition keys' fields;
    ``partitions`` maps each partition key the file does not store to its value (None for
    a null partition); ``file_keys`` each key the file also stores as a column (as Polars'
    ``partition_by`` and DuckDB's ``WRITE_PARTITION_COLUMNS`` write them) to the folder's
    value, which every row of that column must hold (see :func:`gpuload.checks.check_partition_keys`).
    ``absent`` names the selected columns the file lacks and other files have (a column added
    later: a Delta table's schema evolution), read as nulls: each is in ``partitions`` with the
    value None and in ``schema`` with the type of the first file that has it
    (:func:`gpuload.drift.absent_as_nulls`), so that every stage reads it as a null Hive key.
    ``store`` (a :class:`gpuload.sources.remote.Store`) and ``key`` (the object's path in it)
    are set for remote objects only.
    """

    path: str
    size: int
    mtime_ns: int
    metadata: pq.FileMetaData
    schema: pa.Schema
    partitions: tuple = ()  # ((name, value), ...)
    file_keys: tuple = ()  # ((name, value), ...): partition keys also stored in the file
    int96: frozenset = frozenset()  # columns stored as INT96 timestamps (read as microseconds)
    absent: frozenset = frozenset()  # selected columns the file lacks: nulls (in partitions as None)
    ctime_ns: int = _field(default=0, compare=False)  # a local file's ctime when its footer was read
    shown: str = _field(default="", compare=False)  # a local file's path as listed (a link's own): its name
    tag: str = ""
    store: Store | None = _field(default=None, compare=False, repr=False)
    key: str = ""

    @property
    def remote(self) -> bool:
        return self.store is not None

    @property
    def version(self) -> str:
        """A short token that changes whenever the file's identity (size, mtime, tag) does."""
        return version_token(self.size, self.mtime_ns, self.tag)

    @property
    def footer_version(self) -> str:
        """The token its footer is kept in the cache under (:func:`footer_tag`)."""
        return version_token(self.size, self.mtime_ns, footer_tag(self.store, self.tag, self.ctime_ns))

    def stat_matches(self) -> bool:
        """True if a local file still has the size, mtime and ctime recorded when its footer was
        read (ctime changes with any write, and no tool can set it back; remote objects: their
        identity was checked at open, and is asked again after each chunk's fetch)."""
        if self.remote:
            return True
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns) and (
            not self.ctime_ns or st.st_ctime_ns == self.ctime_ns)

    @property
    def partition_names(self) -> set[str]:
        return {k for k, _ in self.partitions}

    def partition_scalar(self, name: str) -> pa.Scalar:
        """The value of partition key ``name`` as an Arrow scalar of its field's type."""
        return pa.scalar(dict(self.partitions)[name], type=self.schema.field(name).type)

    @cached_property
    def tail(self) -> int:
        """Offset of the page indexes and footer that follow the last column chunk (read once per file)."""
        return data_end(self.metadata, self.size)

    @cached_property
    def _leaf_ranges(self) -> dict[str, range]:
        """Top-level file column -> its Parquet leaf column indices (exact for any name, dots included)."""
        out, i, keys = {}, 0, self.partition_names
        for field in (f for f in self.schema if f.name not in keys):  # the file's own columns (as read)
            n = _leaf_count(field.type)
            out[field.name] = range(i, i + n)
            i += n
        if i != len(self.metadata.schema):  # a layout we do not model: fall back to the leaves' paths
            out = {}
            for j in range(len(self.metadata.schema)):
                name = self.metadata.schema.column(j).path.split(".")[0]
                r = out.get(name)
                out[name] = range(r.start if r else j, j + 1)
        return out

    def leaves(self, name: str) -> range:
        """Parquet leaf column indices of top-level file column ``name``."""
        return self._leaf_ranges[name]


def _leaf_count(t: pa.DataType) -> int:
    if isinstance(t, pa.ExtensionType):
        return _leaf_count(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaf_count(t.key_type) + _leaf_count(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_count(t.value_type)
    return 1


def _refuse(item) -> None:
    """Raise a :class:`SourceError` for a ``source`` item that is not a path or URL."""
    kind = type(item).__name__
    mod = type(item).__module__.split(".")[0]
    if item is None:
        raise SourceError("source is None: pass a Parquet file, a directory, a glob, a URL or a list of them")
    if isinstance(item, (bytes, bytearray, memoryview)):
        raise SourceError(f"source is {kind}: gpuload reads Parquet files by path; write the bytes to a file "
                          "and pass its path")
    if mod in ("pyarrow", "pandas", "polars") and not hasattr(item, "open_input_file"):
        raise SourceError(f"source is a {mod} {kind}: gpuload caches Parquet files; write it with "
                          "pyarrow.parquet.write_table (or DataFrame.to_parquet) and pass the file's path")
    if hasattr(item, "open_input_file") or (hasattr(item, "protocol") and hasattr(item, "ls")):
        raise SourceError(f"source is a filesystem object ({kind}): pass it as filesystem= and the paths in it "
                          "as source")
    if hasattr(item, "read") or hasattr(item, "readinto"):
        raise SourceError(f"source is an open file ({kind}): pass the file's path instead")
    raise SourceError(f"source is a {kind}: pass a Parquet file path, a directory, a glob, a URL or a list of them")


class Listed(NamedTuple):
    """One listed Parquet file: identity path (real local path or URL), Hive partition base
    (or None), the path as listed (for partition keys), size, mtime, version tag, and for
    remote objects the store and the object's path in it."""

    path: str
    base: str | None
    shown: str
    size: int
    mtime_ns: int
    tag: str = ""
    store: Store | None = None
    key: str = ""
    table: tuple | None = None  # a table format's file: (partition fields, ((name, value), ...)) from its log
    ctime_ns: int = 0  # a local file's ctime


def _items(source) -> list:
    if isinstance(source, (str, os.PathLike)):
        return [source]
    if isinstance(source, (list, tuple)):
        if not source:
            raise SourceError("source is an empty list: pass a Parquet file, a directory, a glob or a URL")
        return list(source)
    _refuse(source)


def list_files(source, filesystem=None, storage_options: dict | None = None, settings=None,
               kept: CacheRoot | None = None, offline: list | None = None) -> list[Listed]:
    """Each Parquet file or object named by ``source``, in a stable order (a local file
    reached through a link has its real path as identity, and the listed one for its
    Hive partition keys).

    :func:`gpuload.sources.opening.open_files` then reads their footers.

    ``source`` is a file, a directory (searched recursively for ``*.parquet``), a glob
    (``**`` recurses), a URL of an object, prefix or glob, or a list of these; below a
    directory or a glob's base, hidden paths are left out (:func:`~gpuload.sources.remote.hidden`:
    a part starting with ``_`` or ``.``), locally and remotely alike. Directories and globs are the base of Hive
    partition discovery for their files. ``filesystem`` (fsspec or pyarrow) makes every
    item a path in it; ``storage_options`` configure the fsspec filesystems made from
    URLs; ``settings`` (:class:`gpuload.RemoteSettings`) set the retries of listings.
    A remote item's listing is kept in cache root ``kept`` (default None: nowhere); while its
    store cannot be reached, the kept one stands in and is recorded in ``offline``
    (:mod:`gpuload.sources.offline`).
    """
    offline = [] if offline is None else offline
    settings = settings or RemoteSettings()
    if filesystem is not None and is_local_fs(filesystem):
        filesystem = None  # the local disk: read directly, identities from stat
    found: dict[str, Listed] = {}
    stores: dict[str, Store] = {}
    twice: list[str] = []  # files named more than once (a list that repeats one, a folder and a file in it)
    for item in _items(source):
        if not isinstance(item, (str, os.PathLike)):
            _refuse(item)
        text = os.fspath(item)
        if isinstance(text, bytes):
            _refuse(text)
        if filesystem is not None or is_url(text):
            proto = text.split("://", 1)[0] if "://" in text else ""
            store = stores.get(proto)
            if store is None:
                store = stores[proto] = store_for(text if "://" in text else None, filesystem, storage_options,
                                                  settings.timeout_s or None)
            infos, base, tables = list_item(store, text, settings, kept, offline)
            for i in infos:
                if tables is not None and i.path not in tables:
                    continue  # a file the table has removed
                url = store.url(i.path)
                if url in found:
                    twice.append(url)
                found.setdefault(url, Listed(url, None if tables is not None else base, i.path, i.size, i.mtime_ns,
                                             i.tag, store, i.path, None if tables is None else tables[i.path]))
            continue
        for path, base, shown, table in _list_local(text):
            if path in found:
                twice.append(path)
                continue
            st = os.stat(path)
            found[path] = Listed(path, base, shown, st.st_size, st.st_mtime_ns, table=table, ctime_ns=st.st_ctime_ns)
    if twice:
        log.warning("gpuload: %d file(s) named more than once in source= are read once each (%s); to read a source "
                    "more often than another, give each its dataset and weight them in a gpuload.Mix",
                    len(set(twice)), ", ".join(sorted(set(twice))[:3]) + (", ..." if len(set(twice)) > 3 else ""))
    return list(found.values())


def _list_local(text: str) -> list[tuple[str, str | None, str, tuple | None]]:
    text = text.removeprefix("file://")
    p = Path(os.path.abspath(Path(text).expanduser()))  # absolute, links kept: partitions live in the names
    base = None
    if p.is_dir():
        matches = sorted(q for q in p.rglob("*.parquet") if q.is_file() and not hidden(q.relative_to(p).as_posix()))
        base = p
    elif p.is_file():  # an existing name is a name, even with glob characters in it
        matches = [p]
    elif _GLOB_CHARS & set(text):
        base = Path(*p.parts[:next(i for i, part in enumerate(p.parts) if _GLOB_CHARS & set(part))])
        matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True)
                         if Path(m).is_file() and not hidden(Path(m).relative_to(base).as_posix()))
    else:
        raise SourceError(f"{text}: no such file or directory")
    tables = None if base is None else local_table_files(str(base), [str(m) for m in matches], whole=p.is_dir())
    if tables is not None:  # a Delta table: its live files, with the partition values of its log
        matches, base = [m for m in matches if str(m) in tables], None
    if not matches:
        raise SourceError(f"{text}: matched no Parquet files (a folder is searched for *.parquet below it, names "
                          f"starting with '.' or '_' left out): name the files, or a glob that matches them")
    # identity by the real file; partition keys from the name as listed
    return [(str(m.resolve()), None if base is None else str(base), str(m), tables and tables[str(m)])
            for m in matches]


def _hive_keys(path: str, base: str) -> set[str]:
    """Names of the ``key=value`` folders between ``base`` and the file ``path``."""
    return {seg.split("=", 1)[0] for seg in Path(path).relative_to(base).parts[:-1] if "=" in seg}


def _partitions(listed: Sequence[Listed]) -> dict[str, tuple[pa.Schema, tuple]]:
    """Per identity path with Hive partition folders: (partition fields, ((name, value), ...)),
    as pyarrow discovers them from the listed paths (names only: no file is opened)."""
    by_base: dict[str, list[tuple[str, str]]] = {}
    out = {x.path: x.table for x in listed if x.table is not None}  # a table's files: keys from its log
    for x in listed:
        if x.base is not None and _hive_keys(x.shown, x.base):
            by_base.setdefault(x.base, []).append((x.shown, x.path))
    if by_base:  # only then: pyarrow.dataset loads pandas too (0.1-0.2 s at the first open)
        import pyarrow.dataset as pds
        import pyarrow.fs as pafs
    for base, pairs in by_base.items():
        real = dict(pairs)
        opts = pds.FileSystemFactoryOptions(partition_base_dir=base)
        opts.partitioning_factory = pds.HivePartitioning.discover(infer_dictionary=False)
        try:  # a mock filesystem: discovery works on the names alone
            factory = pds.FileSystemDatasetFactory(pafs._MockFileSystem(), [s for s, _ in pairs],
                                                   pds.ParquetFileFormat(), opts)
            dataset = factory.finish(factory.inspect(fragments=0))
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{base}: cannot discover its partition folders ({e})") from None
        fields = pa.schema(list(dataset.partitioning.schema)) if dataset.partitioning else pa.schema([])
        for frag in dataset.get_fragments():
            found = pds.get_partition_keys(frag.partition_expression)  # a null key may be absent here
            present = _hive_keys(frag.path, base)
            out[real[frag.path]] = (fields, tuple((f.name, found.get(f.name)) for f in fields if f.name in present))
    return out


def pandas_index_columns(schema: pa.Schema) -> set[str]:
    """Columns that pandas wrote to store a DataFrame's index (``__index_level_0__`` or named)."""
    meta = schema.pandas_metadata or {}
    names = {c for c in meta.get("index_columns", []) if isinstance(c, str)}
    return names | {n for n in schema.names if n.startswith("__index_level_") and n.endswith("__")}


def common_columns(files: Sequence[SourceFile]) -> tuple[pa.Schema, list[str]]:
    """The first file's schema restricted to the columns every file has (pandas index
    columns left out), and the names left out because some file lacks them."""
    first = files[0].schema
    shared = set(first.names) - files[0].absent
    for f in files[1:]:
        shared &= set(f.schema.names) - f.absent
    everywhere = set().union(*(set(f.schema.names) for f in files))
    index = set().union(*(pandas_index_columns(f.schema) for f in files))
    keep = [f for f in first if f.name in shared and f.name not in index]
    return pa.schema(keep, metadata=first.metadata), sorted(everywhere - shared - index)


def all_columns(files: Sequence[SourceFile]) -> pa.Schema:
    """Every column some file has, each once, of the type of the first file that has it."""
    seen: dict[str, pa.Field] = {}
    for f in files:
        for field in f.schema:
            seen.setdefault(field.name, field)
    return pa.schema(list(seen.values()))


def row_group_sizes(f: SourceFile, specs: Sequence[OutputSpec],
                    outputs: Sequence[OutputSpec] | None = None) -> list[tuple[int, int]]:
    """Per row group of ``f``: (rows, estimated bytes once converted to ``specs``), or, given
    ``outputs`` (what a transform makes of ``specs``), to those: a ragged output made by the
    transform is taken to hold as many values as the largest ragged input (one a row without)."""
    def values(rg, c: str, n: int) -> int:
        return rg.column(f.leaves(c)[0]).num_values if c not in f.partition_names else n

    made = outputs is not None
    outputs = specs if outputs is None else outputs
    fixed_per_row = sum(storage_dtype(s.dtype).itemsize * s.width for s in outputs if s.kind != RAGGED)
    ragged = [(s, storage_dtype(s.dtype).itemsize) for s in outputs if s.kind == RAGGED]
    inputs = [s.columns[0] for s in specs if s.kind == RAGGED]
    out = []
    for g in range(f.metadata.num_row_groups):
        rg = f.metadata.row_group(g)
        n = rg.num_rows
        size = n * fixed_per_row
        guess = max((values(rg, c, n) for c in inputs), default=n) if made else 0
        for s, item in ragged:
            size += (guess if made else values(rg, s.columns[0], n)) * item + (n + 1) * 8
        out.append((n, size))
    return out


def fingerprint(files: Sequence[SourceFile]) -> int:
    """A 63-bit fingerprint of the files, the same wherever a folder of local files lies: each
    file's path as listed (a link's own, not its target's) relative to the folder that holds them
    all, its size, rows and partition keys, and its version: a local file's footer hash (not its
    mtime), a remote object's ETag or version and last-modified time. The same local files copied
    or moved to another folder, with their mtimes or new ones, or reached through links, keep it (so
    do the order and a saved state: :mod:`gpuload.resume`); a file renamed, added or removed changes
    it, and so does a rewrite, except a local one that leaves its size and footer byte for byte
    as they were (its row groups' sizes and statistics)."""
    h = xxhash.xxh64()
    names = relative_names([f.path if f.remote else (f.shown or f.path) for f in files])
    for f, name in zip(files, names):
        version = f"{f.tag}\0{f.mtime_ns}" if f.remote or not f.tag else f.tag
        keys = tuple(kv for kv in f.partitions if kv[0] not in f.absent)  # not the columns read as nulls
        h.update(f"{name}\0{f.size}\0{version}\0{f.metadata.num_rows}\0{keys!r}\n".encode())
    return h.intdigest() & (2**63 - 1)


def relative_names(paths: Sequence[str]) -> list[str]:
    """``paths`` (local paths or URLs) relative to the longest folder that holds them all
    (``["/d/a/x", "/d/b/y"]`` -> ``["a/x", "b/y"]``; one path: its name)."""
    parts = [p.split("/") for p in paths]
    common = 0
    if parts:
        folders = [q[:-1] for q in parts]
        while all(len(q) > common and q[common] == folders[0][common] for q in folders):
            common += 1
    return ["/".join(q[common:]) for q in parts]
