"""Remote sources: object stores reached through fsspec or a pyarrow filesystem.

A :class:`Store` wraps one filesystem (``s3://``, ``gs://``, ``az://``, ``http(s)://``
or any other fsspec protocol, or a ``pyarrow.fs.FileSystem``) behind three calls:
list what a source item names (with each object's identity), read one byte range,
and name an object in messages. Retries, concurrency and timing live in
:mod:`gpuload.sources.fetch`; this module only talks to the store.

An object's identity is its size plus whatever version marker the store gives:
S3's version id or ETag, GCS's generation, Azure's ETag, HTTP's ETag and
Last-Modified. A store that gives none of them is served with a warning: a change
that keeps an object's size would not be noticed.

Each protocol's package is an optional extra (``pip install gpuload[s3]`` for s3fs,
``[gcs]`` for gcsfs, ``[azure]`` for adlfs, ``[http]`` for aiohttp); a missing one is
a :class:`~gpuload.SourceError` that names the extra.
"""

from __future__ import annotations

import datetime as _dt
import logging
import posixpath
import threading
from dataclasses import dataclass

from ..errors import SourceError, setting
from .retry import transient

__all__ = ["Store", "ObjectInfo", "Stopped", "is_url", "store_for", "hidden", "same_version"]

log = logging.getLogger("gpuload")

_GLOB_CHARS = set("*?[")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
           "adl": "azure", "http": "http", "https": "http"}
# the same key wins in a listing and in a single object's info (s3fs lists ETags; its info adds VersionId)
_VERSION_KEYS = ("ETag", "etag", "generation", "VersionId", "version_id", "md5Hash", "Content-MD5", "content_md5")
_MTIME_KEYS = ("LastModified", "last_modified", "Last-Modified", "updated", "mtime", "modified", "created")


def is_url(text: str) -> bool:
    """Whether ``text`` names a remote object (``proto://...`` other than ``file://``)."""
    return "://" in text and not text.startswith("file://")


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its path in the store, size in bytes, last-modified time in ns
    (0 when the store gives none) and version marker (``""`` when the store gives none)."""

    path: str
    size: int
    mtime_ns: int
    tag: str


def _to_ns(value) -> int:
    """Last-modified as integer ns since the epoch, from what stores return (datetime, seconds, HTTP date)."""
    if value is None:
        return 0
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return int(value.timestamp() * 1e9)
    if isinstance(value, (int, float)):
        return int(value * 1e9) if value < 1e12 else int(value)
    text = str(value)
    try:
        from email.utils import parsedate_to_datetime

        return _to_ns(parsedate_to_datetime(text))
    except (TypeError, ValueError):
        pass
    try:
        return _to_ns(_dt.datetime.fromisoformat(text.replace("Z", "+00:00")))
    except ValueError:
        return 0


def _identity(info: dict) -> tuple[int, str]:
    mtime = next((_to_ns(info[k]) for k in _MTIME_KEYS if info.get(k) is not None), 0)
    tag = next((str(info[k]).strip('"') for k in _VERSION_KEYS if info.get(k)), "")
    return mtime, tag


def hidden(rel: str) -> bool:
    """Whether a path below a listed folder or glob base is left out of the dataset: one of
    its parts starts with ``.`` or ``_`` (Spark's ``_temporary/`` and ``.spark-staging-*``,
    ``_SUCCESS``, ``_delta_log/``, NFS's ``.snapshot/``, editors' ``.~lock`` files), the rule
    of Spark and ``pyarrow.dataset``; like Spark, a partition folder ``_key=value`` is kept.
    Every listing, local or remote, uses it."""
    return any(p.startswith(".") or (p.startswith("_") and "=" not in p) for p in rel.split("/") if p)


def same_version(listed: tuple[int, int, str], now: tuple[int, int, str]) -> bool:
    """Whether an object's ``(size, last-modified ns, version marker)`` asked again is the version
    listed: the same size and marker, and where the store gave a last-modified time both
    times, the same time (to the second where one of them is in whole seconds: S3 lists
    milliseconds, its HEAD answers seconds). Every field counts, so a store whose ETag does
    not follow the content (or that gives none) still tells a rewritten object by its time."""
    (size, mtime, tag), (size2, mtime2, tag2) = listed, now
    if size != size2 or tag != tag2:
        return False
    if not (mtime and mtime2):
        return True
    if mtime % 10**9 == 0 or mtime2 % 10**9 == 0:
        return mtime // 10**9 == mtime2 // 10**9
    return mtime == mtime2


class Store:
    """One filesystem of a remote source.

    Parameters
    ----------
    fs : an fsspec ``AbstractFileSystem`` or a ``pyarrow.fs.FileSystem``.
    protocol : the URL scheme objects are named with in messages and cache keys
        (default: the filesystem's own).
    timeout : seconds one single-object call (``info``) may take on an async fsspec
        filesystem before it counts as stalled (default None: unbounded).
    """

    def __init__(self, fs, protocol: str | None = None, timeout: float | None = None):
        self.fs = fs
        self.arrow = _is_arrow_fs(fs)
        if protocol is None:
            protocol = fs.type_name if self.arrow else (fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0])
        self.protocol = protocol
        self._files: dict[str, object] = {}  # pyarrow: path -> open input file (read_at is thread-safe)
        self._lock = threading.Lock()
        self._warned = False
        self.timeout = timeout  # seconds for one info() call (RemoteSettings.timeout_s)
        self._async = not self.arrow and getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None

    # -- naming ---------------------------------------------------------------------------
    def url(self, path: str) -> str:
        """The object's name in messages and cache keys (``s3://bucket/key``, ``https://host/x``)."""
        return path if "://" in path else f"{self.protocol}://{path}"

    def strip(self, text: str) -> str:
        """The store's own path for a URL or path."""
        if self.arrow:
            return text.split("://", 1)[1] if "://" in text else text
        return self.fs._strip_protocol(text)

    def _call(self, name: str, *args, **kwargs):
        """fsspec method ``name``; a single-object call (``info``) is bounded by ``timeout`` seconds
        on async filesystems, so a stalled one fails and is retried instead of hanging (a
        recursive listing makes many requests, and is not bounded as a whole)."""
        timeout = self.timeout if name == "info" else None
        if self._async and timeout:
            from fsspec.asyn import sync

            return sync(self.fs.loop, getattr(self.fs, "_" + name), *args, timeout=timeout, **kwargs)
        return getattr(self.fs, name)(*args, **kwargs)

    # -- listing --------------------------------------------------------------------------
    def expand(self, item: str) -> tuple[list[ObjectInfo], str | None, list[ObjectInfo] | None]:
        """The Parquet objects ``item`` names, in name order; the Hive partition base (the
        folder or glob base; None for a single object); and for a folder, every object listed
        below it, hidden ones included (to find a table's log)."""
        path = self.strip(item)
        if not self.arrow:  # fsspec's listings cache would hide objects rewritten since it was filled
            self.fs.invalidate_cache(path)
        below = None
        if _GLOB_CHARS & set(path) and not self._exists(path):
            base = path[:min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
            found = [i for i in self._glob(path) if not hidden(posixpath.relpath(i.path, base))]
        else:
            kind, info = self._kind(path)
            if kind == "file":
                return [info], None, None
            if kind != "directory":
                raise SourceError(f"{self.url(path)}: no such object or folder")
            base = path.rstrip("/")
            listed = self._find(base)
            below = listed
            found = [i for i in listed if i.path.endswith(".parquet") and not hidden(posixpath.relpath(i.path, base))]
        if not found:
            raise SourceError(f"{self.url(path)}: matched no Parquet objects")
        return sorted(found, key=lambda i: i.path), base, below

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a folder (a prefix with objects below it) in the store."""
        return self._kind(path)[0] == "directory"

    def find(self, folder: str) -> list[ObjectInfo]:
        """Every object below ``folder``, hidden ones included."""
        return self._find(folder.rstrip("/"))

    def _info(self, path: str, raw: dict) -> ObjectInfo:
        if raw.get("size") is None or raw.get("size") == 0 and self.protocol.startswith("http"):
            raw = self._call("info", path)  # an HTTP index page gives names only: ask each object (HEAD)
            if raw.get("size") is None:
                raise SourceError(f"{self.url(path)}: the store does not give its size; gpuload needs it to read "
                                  "the Parquet footer")
        mtime, tag = _identity(raw)
        if not mtime and not tag and not self._warned:
            self._warned = True
            log.warning("gpuload: %s gives no ETag, version or last-modified time for %s: a change that keeps an "
                        "object's size will not be noticed; clear the cache after rewriting objects",
                        self.protocol, self.url(path))
        return ObjectInfo(path, int(raw["size"]), mtime, tag)

    def _key(self, name: str) -> str:
        """A listed entry's path in the store (HTTP names are whole URLs: kept as they are)."""
        return name if self.protocol.startswith("http") else self.strip(name)

    def _infos(self, listed: dict) -> list[ObjectInfo]:
        return [self._info(self._key(name), raw) for name, raw in listed.items() if raw.get("type", "file") == "file"]

    def _exists(self, path: str) -> bool:
        return self._kind(path)[0] != "missing"

    def _kind(self, path: str) -> tuple[str, ObjectInfo | None]:
        if self.arrow:
            import pyarrow.fs as pafs

            fi = self.fs.get_file_info(path)
            if fi.type == pafs.FileType.File:
                return "file", ObjectInfo(path, fi.size, fi.mtime_ns or 0, "")
            return ("directory" if fi.type == pafs.FileType.Directory else "missing"), None
        try:
            raw = self._call("info", path)
        except FileNotFoundError as e:
            if transient(e):  # a failed connection (fsspec's HTTP store calls it "not found"): tried again
                raise
            return "missing", None
        if raw.get("type") == "directory" or (self.protocol.startswith("http") and (
                path.endswith("/") or raw.get("mimetype") == "text/html")):  # an index page
            return "directory", None
        return "file", self._info(self._key(raw.get("name", path)), raw)

    def _find(self, base: str) -> list[ObjectInfo]:
        if self.arrow:
            import pyarrow.fs as pafs

            sel = pafs.FileSelector(base, recursive=True)
            return [ObjectInfo(fi.path, fi.size, fi.mtime_ns or 0, "") for fi in self.fs.get_file_info(sel)
                    if fi.type == pafs.FileType.File]
        return self._infos(self._call("find", base, detail=True, withdirs=False))

    def _glob(self, pattern: str) -> list[ObjectInfo]:
        if self.arrow:
            raise SourceError(f"{pattern}: globs need an fsspec filesystem; pass the folder, or a list of objects")
        return self._infos(self._call("glob", pattern, detail=True))

    def identity(self, path: str) -> tuple[int, int, str]:
        """(size, mtime ns, tag) of object ``path`` as the store says now (not from a cache)."""
        if self.arrow:
            fi = self.fs.get_file_info(path)
            return fi.size, fi.mtime_ns or 0, ""
        self.fs.invalidate_cache(path)
        raw = self._call("info", path)
        mtime, tag = _identity(raw)
        return int(raw["size"]), mtime, tag

    # -- reading --------------------------------------------------------------------------
    def read(self, path: str, start: int, end: int, timeout: float | None = None,
             stop: threading.Event | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``path``: one request (no retry here).

        ``timeout``: seconds the request may take (async fsspec stores). ``stop``: once set, a
        request in flight on an async store is abandoned within 0.1 s (raising
        :class:`Stopped`). An HTTP server that ignores ``Range`` is refused as soon as its
        answer's headers arrive, before its body is read (a :class:`~gpuload.SourceError`).
        """
        if self.arrow:
            with self._lock:
                f = self._files.get(path)
                if f is None:
                    f = self._files[path] = self.fs.open_input_file(path)
            return f.read_at(end - start, start)
        if self._async:
            if self.protocol.startswith("http"):
                return self._await(_http_range(self, path, start, end), path, timeout, stop)
            return self._await(self.fs._cat_file(path, start=start, end=end), path, timeout, stop)
        return self.fs.cat_file(path, start=start, end=end)

    def _await(self, coro, path: str, timeout: float | None, stop: threading.Event | None):
        """Run ``coro`` on the filesystem's event loop; give up after ``timeout`` seconds, or
        when ``stop`` is set (the request is cancelled on the loop, its connection closed)."""
        import asyncio
        import concurrent.futures

        async def bounded():
            return await (asyncio.wait_for(coro, timeout) if timeout else coro)

        fut = asyncio.run_coroutine_threadsafe(bounded(), self.fs.loop)
        while True:
            try:
                return fut.result(timeout=None if stop is None else 0.1)
            except (TimeoutError, concurrent.futures.TimeoutError):
                if fut.done():  # the request's own timeout
                    raise
                if stop.is_set():
                    fut.cancel()
                    raise Stopped(f"{self.url(path)}: the request was abandoned: the dataset was closed "
                                  "or its epoch ended") from None

    def close(self) -> None:
        """Close the open pyarrow input files (fsspec keeps its own sessions)."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


class Stopped(Exception):
    """A request abandoned because its dataset was closed or its epoch ended (not retried)."""


async def _http_range(store: Store, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an HTTP object by one ranged GET (fsspec's HTTP filesystem's
    session and settings), reading at most one byte more than asked: a server that ignores
    ``Range`` is refused from its status and headers, before its body."""
    fs = store.fs
    kw = dict(fs.kwargs)
    headers = {**kw.pop("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
        fs._raise_not_found_for_status(r, path)
        whole = r.status == 200 and start == 0 and r.content_length == end
        if r.status != 206 and not whole:
            raise SourceError(f"{store.url(path)}: asked for bytes {start}-{end - 1}, the server answered "
                              f"{r.status} with {r.content_length if r.content_length is not None else 'unknown'} "
                              "bytes: it ignores Range requests, which gpuload needs; serve the objects from a server "
                              "that honours them")
        want, data = end - start, bytearray()
        while len(data) <= want:
            part = await r.content.read(want + 1 - len(data))
            if not part:
                break
            data += part
    return bytes(data)


def _is_arrow_fs(fs) -> bool:
    try:
        import pyarrow.fs as pafs
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return False
    return isinstance(fs, pafs.FileSystem)


def is_local_fs(fs) -> bool:
    """Whether a filesystem object is the local disk (then gpuload reads paths directly)."""
    if _is_arrow_fs(fs):
        return fs.type_name == "local"
    proto = getattr(fs, "protocol", None)
    protos = (proto,) if isinstance(proto, str) else tuple(proto or ())
    return bool(set(protos) & {"file", "local"})


def _single_tries(proto: str, storage_options: dict | None) -> dict:
    """``storage_options`` with botocore's own retries off unless given (s3fs's loop, which no
    option sets, is turned off on the instance: see :func:`store_for`): gpuload retries
    each request itself (:class:`gpuload.RemoteSettings`), and the layers multiplied (an endpoint
    that refused connections took 62 s to be reported, 7 x 5 x 5 tries)."""
    opts = dict(storage_options or {})
    if proto in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})  # botocore's
        opts["config_kwargs"] = config
    return opts


def store_for(url: str | None, filesystem=None, storage_options: dict | None = None,
              timeout: float | None = None) -> Store:
    """The :class:`Store` for ``url`` (or for ``filesystem``), creating the fsspec
    filesystem from the URL's protocol and ``storage_options`` when none is given;
    ``timeout`` bounds each single-object call (seconds, None: unbounded)."""
    if filesystem is not None:
        if not (_is_arrow_fs(filesystem) or (hasattr(filesystem, "cat_file") and hasattr(filesystem, "info"))):
            raise SourceError(f"filesystem={type(filesystem).__name__}: pass an fsspec filesystem or a "
                              "pyarrow.fs.FileSystem")
        proto = url.split("://", 1)[0] if url and "://" in url else None
        return Store(filesystem, proto, timeout)
    proto = url.split("://", 1)[0].lower()
    import fsspec  # a dependency of gpuload; the protocols' packages are extras
    try:
        cls = fsspec.get_filesystem_class(proto)
        opts = _single_tries(proto, storage_options)
        fs = cls(**opts)
        if proto in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
            # s3fs's own loop (tries in all), on the instance made here, whatever botocore's retries in the
            # options (gpuload.testing.S3Server's set them, and s3fs's 5 tries stacked up under gpuload's)
            fs.retries = 1
    except ImportError as e:
        extra = _EXTRAS.get(proto)
        hint = f"pip install gpuload[{extra}]" if extra else f"install the fsspec package for {proto}://"
        raise SourceError(f"{url}: reading {proto}:// needs a package that is not installed ({e}); {hint}") from None
    except ValueError as e:
        raise SourceError(f"{url}: {proto}:// is not a protocol fsspec knows ({e})") from None
    except TypeError as e:
        raise SourceError(f"{setting('storage_options', storage_options)}: {proto}:// does not take them ({e})") from None
    return Store(fs, proto, timeout)
