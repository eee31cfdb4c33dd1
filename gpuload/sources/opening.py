"""Opening: each listed file's footer, checked, under an identity checked after it was read.

A dataset's plan comes from its files' footers: the schema, the row groups, their row
counts and statistics. They are read once per version of a file and kept in the cache
(:mod:`gpuload.cache.footers`), so a reopening reads no Parquet. A footer is kept only
under the identity the file had while it was read: for a local file, its size, mtime and
ctime on the descriptor read, before and after, and on its name afterwards; for a remote
object, its size, version marker and last-modified time asked again after the read
(:func:`gpuload.sources.remote.same_version`). A file that changed since it was listed is
read under its new identity; one that keeps changing is refused. (Were the footer kept
under the listed identity, a file changed after the listing and later restored to that
identity, by ``cp -p``, ``rsync -a`` or an upload, would be decoded with the footer of
other bytes: columns swapped, and cached.)

Footers whose counts cannot be right are refused, naming the file (:func:`check_footer`).
INT96 timestamps (Spark's, Hive's, Impala's) are typed in microseconds, as they are read.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from ..cache.footers import load_footer, parse_footer, read_footer, save_footer
from ..errors import SourceError
from .listing import Listed, SourceFile, _leaf_count, _partitions, footer_tag
from .remote import same_version
from .retry import retry

__all__ = ["open_files", "check_footer"]

_MAX_PAGE_VALUES = 2**31 - 1  # a Parquet page header counts its values in an i32
_TRIES = 3  # reads of a footer while its file keeps changing


def _int96_columns(meta: pq.FileMetaData, schema: pa.Schema) -> frozenset:
    """Top-level columns of ``schema`` (the footer's Arrow schema) with a leaf stored as INT96."""
    leaves = [meta.schema.column(j).physical_type == "INT96" for j in range(len(meta.schema))]
    if not any(leaves):
        return frozenset()
    out, i = set(), 0
    for field in schema:
        n = _leaf_count(field.type)
        if any(leaves[i:i + n]):
            out.add(field.name)
        i += n
    return frozenset(out)


def _micros(t: pa.DataType) -> pa.DataType:
    """``t`` with its nanosecond timestamps (how pyarrow types INT96 by default) in microseconds."""
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_micros(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_micros(t.value_type)), t.list_size)
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_micros(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_micros(t.field(i).type)) for i in range(t.num_fields)])
    return t


def check_footer(path: str, meta: pq.FileMetaData, size: int) -> None:
    """Refuse footers whose row counts cannot be right: negative, not adding up, more rows
    than the file's pages could hold (a data page holds at most 2^31 - 1 values, and its
    header alone takes more than 8 bytes), or a row group whose column chunks hold another
    number of values than its rows (a flat column one per row, a repeated one at least one
    per row): which rows a reader then delivers depends on how it cuts the file."""
    total = 0
    repeated = [meta.schema.column(j).max_repetition_level > 0 for j in range(meta.num_columns)]
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        n = rg.num_rows
        if n < 0:
            raise SourceError(f"{path}: row group {g} declares {n} rows; the file is corrupt")
        for j, rep in enumerate(repeated):
            v = rg.column(j).num_values
            if v < n if rep else v != n:
                raise SourceError(f"{path}: row group {g} declares {n:,} rows, but its column "
                                  f"{meta.schema.column(j).path!r} holds {v:,} values; the file is corrupt: rewrite "
                                  "it or remove it from the source")
        total += n
    if total != meta.num_rows or total > (size // 8 + 1) * _MAX_PAGE_VALUES:
        raise SourceError(f"{path}: its footer declares {meta.num_rows:,} rows ({total:,} in its row groups) in "
                          f"{size:,} bytes, which cannot be right; the file is corrupt: rewrite it or remove it "
                          "from the source")




def _footer_key(x: Listed) -> str:
    return footer_tag(x.store, x.tag, x.ctime_ns)


def identity_tag(x: Listed, raw: bytes) -> str:
    """The tag in a file's identity: a remote object's version marker; for a local file, a hash of
    its footer (its row groups' sizes, offsets and statistics): the same for identical copies of a
    file on every node, and new for a file rewritten in place, whatever its size and mtime say."""
    return x.tag if x.store is not None else f"footer:{xxhash.xxh3_64_hexdigest(raw)}"


def _cached_footer(root, x: Listed, counts: dict) -> tuple[pq.FileMetaData, str] | None:
    """The footer of ``x`` from the cache and the file's identity tag, if the cache holds one for
    this version that parses."""
    raw = load_footer(root, x.path, x.size, x.mtime_ns, _footer_key(x))
    if raw is None:
        return None
    try:
        meta = parse_footer(raw, x.path)
        check_footer(x.path, meta, x.size)
    except SourceError:  # a cached footer that does not parse: read the file's own again
        return None
    counts["footers_cached"] += 1
    return meta, identity_tag(x, raw)


def _stat_id(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_local(x: Listed) -> tuple[bytes, Listed]:
    """The footer bytes of local file ``x`` and its identity while they were read."""
    for _ in range(_TRIES):
        try:
            fd = os.open(x.path, os.O_RDONLY)
            try:
                before = os.fstat(fd)
                raw = read_footer(lambda a, b: os.pread(fd, b - a, a), before.st_size, x.path)
                after = os.fstat(fd)
            finally:
                os.close(fd)
            now = os.stat(x.path)  # the name still leads to the file read
        except OSError as e:
            raise SourceError(f"{x.path}: not a readable Parquet file ({e}); remove it or narrow the source") from None
        if _stat_id(before) == _stat_id(after) == _stat_id(now):
            return raw, x._replace(size=now.st_size, mtime_ns=now.st_mtime_ns, ctime_ns=now.st_ctime_ns)
    raise SourceError(f"{x.path}: changed each of {_TRIES} times its footer was read; open the dataset once the "
                      "file is written")


def _read_remote(x: Listed, fetcher, stop: threading.Event | None = None) -> tuple[bytes, Listed]:
    """The footer bytes of remote object ``x`` and its identity, asked again after they were read
    (``stop``: set, the reads give up at once; default the fetcher's own)."""
    stop = fetcher.stop if stop is None else stop
    for _ in range(_TRIES):
        raw = read_footer(lambda a, b: fetcher.get(x.key, a, b, stop=stop), x.size, x.path)
        size, mtime, tag = retry(lambda: x.store.identity(x.key), f"{x.path}: asking its version",
                                 fetcher.settings, stop=stop)
        if same_version((x.size, x.mtime_ns, x.tag), (size, mtime, tag)):
            return raw, x
        x = x._replace(size=size, mtime_ns=mtime, tag=tag)  # rewritten since it was listed: read it again
    raise SourceError(f"{x.path}: changed each of {_TRIES} times its footer was read; open the dataset once the "
                      "object is written")


def _read_footer(root, x: Listed, fetcher_for, stop: threading.Event | None = None
                 ) -> tuple[tuple[pq.FileMetaData, str], Listed]:
    """The footer of ``x`` read from the file or object itself, then kept in the cache under the
    identity checked after the read; with the file's identity tag, and that identity."""
    raw, x = _read_remote(x, fetcher_for(x.store), stop) if x.store is not None else _read_local(x)
    meta = parse_footer(raw, x.path)
    check_footer(x.path, meta, x.size)
    # a remote object's copy is what an offline open reads (its store down): kept durable like its listing
    save_footer(root, x.path, x.size, x.mtime_ns, _footer_key(x), raw, durable=x.store is not None)
    return (meta, identity_tag(x, raw)), x


def _read_all(root, listed: list[Listed], todo: list[int], fetcher_for) -> dict[int, tuple]:
    """``{i: (footer, identity)}`` of ``listed[i]`` for each ``i`` in ``todo``: remote objects
    many at once (one request each, two for long footers); the first failure stops the rest."""
    out = {}
    remote = [i for i in todo if listed[i].store is not None]
    if len(remote) > 1:
        workers = min(len(remote), fetcher_for(listed[remote[0]].store).settings.max_requests)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpuload-footers")
        abandon = threading.Event()  # the open failed or was interrupted: the other reads give up at once
        try:
            futures = {i: pool.submit(_read_footer, root, listed[i], fetcher_for, abandon) for i in remote}
            done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if f.exception() is not None), None)
            if failed is not None:  # the first failure: what is queued is dropped, what runs gives up
                raise failed.exception()
            out = {i: fut.result() for i, fut in futures.items()}
        except BaseException:  # a failure, or Ctrl-C: no stalled read holds the open (or the process) back
            abandon.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    for i in todo:
        if i not in out:
            out[i] = _read_footer(root, listed[i], fetcher_for)
    return out


def open_files(listed: Sequence[Listed], root=None, fetcher_for=None, stats: dict | None = None) -> list[SourceFile]:
    """Read each file's footer (from the cache ``root`` when it holds this version's);
    a :class:`SourceError` names a bad file.

    ``fetcher_for(store)`` gives the :class:`gpuload.sources.fetch.Fetcher` that reads remote
    footers (retried). ``stats``, if given, counts ``{"footers_cached", "footers_read"}``.
    """
    listed = list(listed)
    parts = _partitions(listed)
    out = []
    counts = stats if stats is not None else {}
    counts.setdefault("footers_cached", 0)
    counts.setdefault("footers_read", 0)
    metas = [_cached_footer(root, x, counts) for x in listed]
    missing = [i for i, m in enumerate(metas) if m is None]
    for i, (meta, x) in _read_all(root, listed, missing, fetcher_for).items():
        metas[i], listed[i] = meta, x
    counts["footers_read"] += len(missing)
    for x, (meta, tag) in zip(listed, metas):
        try:
            schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{x.path}: not a readable Parquet file ({e}); remove it or narrow the source") from None
        int96 = _int96_columns(meta, schema)  # Spark's, Impala's and Hive's timestamps: read in microseconds
        for i in [i for i, f in enumerate(schema) if f.name in int96]:
            schema = schema.set(i, schema.field(i).with_type(_micros(schema.field(i).type)))
        fields, keys = parts.get(x.path, (pa.schema([]), ()))
        stored = tuple((k, v) for k, v in keys if k in schema.names)  # the file's column is the key's values
        for f in (f for f in fields if f.name in dict(keys) and f.name not in schema.names):
            schema = schema.append(f)
        keys = tuple((k, v) for k, v in keys if k not in dict(stored))
        out.append(SourceFile(x.path, x.size, x.mtime_ns, meta, schema, keys, tag=tag, store=x.store, key=x.key,
                              file_keys=stored, int96=int96, ctime_ns=x.ctime_ns, shown=x.shown))
    return out
