"""Cache paths: where a cache lives, and what its files are called.

Layout of a cache directory::

    <cache_dir>/v3/<hash of source path>/<spec>-<file version>-<rg start>-<rg stop>.glc
    <cache_dir>/v3/<hash of the pack's paths>/<spec>-<version of its files>-0-<files>.glc   a pack
    <cache_dir>/v3/<hash of source path>/<chunk file name>.lock        build lock
    <cache_dir>/v3/specs/<spec>.json                                   the column set, last use = mtime

The name covers every input that changes the bytes: the source path, its size and
mtime (the file version), the columns, groups, dtypes and fill values (the spec), the
row groups, and the format version; the header inside repeats all of it and a read
compares the two. A changed source file changes only its own names; its stale chunks
are deleted when its new chunks are written (:class:`gpuload.cache.store.ChunkCache`).
A pack of small files (:func:`gpuload.packs.pack_small`) has a folder of its own, named by
its files' paths, so a newer version of the same pack replaces it there and other packs
of the same files (another listing of them) are left alone.

Nothing here touches a file except :func:`cache_folder`, which makes or checks the
cache directory itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import xxhash

from .chunkfile import LAYOUT_DIR, SUFFIX, Identity, version_token
from ..errors import CacheError, ConfigError, flag

__all__ = ["ChunkKey", "cache_dirs", "cache_folder", "default_cache_dir", "pack_folder", "pack_version", "source_folder",
           "split_dirs"]


def source_folder(path: str) -> str:
    """The folder (below the layout's) of the chunks of source file ``path``: the hash of the path."""
    return xxhash.xxh64_hexdigest(path.encode())


def default_cache_dir() -> Path | tuple[Path, ...]:
    """``$GPULOAD_CACHE_DIR`` (several folders, one per drive, separated by ``os.pathsep``:
    a tuple), else ``$XDG_CACHE_HOME/gpuload``, else ``~/.cache/gpuload``."""
    env = os.environ.get("GPULOAD_CACHE_DIR")
    if env:
        return cache_dirs(split_dirs(env, "$GPULOAD_CACHE_DIR"))
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpuload"


def split_dirs(text: str, where: str) -> str | list[str]:
    """A folder list in one string (``$GPULOAD_CACHE_DIR``, ``--cache-dir``: ``where``) split at
    ``os.pathsep``; one folder stays a string. Several must be absolute paths, so a folder
    whose name holds the separator is refused rather than cut in two (a ``ConfigError``). Empty
    entries are left out (``"$X:/nvme/gl"`` with ``$X`` empty is ``/nvme/gl``, not a folder named
    ``:/nvme/gl`` under the working directory); a text of no folder is refused."""
    parts = [p for p in text.split(os.pathsep) if p.strip()]
    if not parts:
        raise ConfigError(f"{where}={text!r} names no folder; give a cache folder (several: absolute paths separated "
                          f"by {os.pathsep!r})")
    if len(parts) == 1:
        return parts[0]
    relative = [p for p in parts if not os.path.isabs(os.path.expanduser(p))]
    if relative:
        raise ConfigError(f"{where}={text!r}: {relative[0]!r} is not an absolute path; give several cache folders "
                          f"as absolute paths separated by {os.pathsep!r}")
    return parts


def cache_dirs(given) -> Path | tuple[Path, ...]:
    """``cache_dir=`` as one folder (a ``Path``: a string or path, never split) or several (a
    tuple, in order, each folder once: a list or tuple of them)."""
    items = [given] if isinstance(given, (str, os.PathLike)) else list(given)
    out: list[Path] = []
    for item in items:
        path = Path(os.fspath(item)).expanduser()
        if os.fspath(item).strip() and os.path.realpath(path) not in map(os.path.realpath, out):
            out.append(path)
    if not out:
        raise ConfigError(f"{flag('cache_dir').rstrip('=')}={given!r} names no folder")
    return out[0] if len(out) == 1 else tuple(out)


def cache_folder(root, create: bool = True) -> Path:
    """``root`` (``~`` expanded) as a cache folder, made with its parents if missing and
    ``create`` (one another process makes meanwhile is fine). A :class:`CacheError` that says
    what to pass instead when it cannot be made, is not a folder, or is missing and not ``create``."""
    given = Path(root).expanduser()
    if not given.is_dir():
        what = None if create else "is not a folder" if given.exists() else "does not exist (nothing is cached there)"
        try:
            if what is None:  # a folder another process (another rank) made meanwhile is fine
                given.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # something that is not a folder
            what = "is not a folder"
        except OSError as e:
            raise CacheError(f"cache folder {given}: cannot create it ({e.strerror or e}); pass another "
                             f"{flag('cache_dir').rstrip('=')} or set $GPULOAD_CACHE_DIR") from None
        if what is not None:
            raise CacheError(f"cache folder {given} {what}; check {flag('cache_dir').rstrip('=')} "
                             "(or $GPULOAD_CACHE_DIR)")
    return given


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one cached chunk: where its file lives and what its header must say.

    Attributes
    ----------
    path : the source file's absolute path (a remote object's URL).
    size : the source file's size in bytes.
    mtime_ns : the source file's modification time in nanoseconds.
    spec : hash of the output spec (:func:`gpuload.cache.chunkfile.spec_hash`, 16 hex digits).
    rg_start, rg_stop : the chunk's row groups in the source file, ``[rg_start, rg_stop)``.
    rows : the chunk's rows.
    outputs : ``(name, kind, storage dtype, width)`` per output (default none).
    spec_desc : the spec description whose hash is ``spec`` (:func:`gpuload.layout.spec_description`);
        written into the header, left out of comparisons.
    tag : a remote object's version marker (ETag, version id...); for a local file, a hash of its
        footer (:func:`gpuload.sources.opening.identity_tag`).
    footer : the version token the source file's footer is cached under (kept when older
        versions' files are dropped); left out of comparisons.
    members : a pack's files (:func:`gpuload.packs.pack_small`), ``(path, size, mtime_ns, tag,
        rg_start, rg_stop)`` each, in order, the first of them also the fields above; () (default)
        for a chunk of one file.
    """

    path: str
    size: int
    mtime_ns: int
    spec: str
    rg_start: int
    rg_stop: int
    rows: int
    outputs: tuple = ()
    spec_desc: list = field(default_factory=list, compare=False, repr=False)
    tag: str = ""
    footer: str = field(default="", compare=False, repr=False)  #: the token its source's footer is kept under
    members: tuple = ()

    @cached_property
    def version(self) -> str:
        """The source file version's token (:func:`gpuload.cache.chunkfile.version_token`); a pack's:
        of every file's version and row groups."""
        if self.members:
            return pack_version(self.members)
        return version_token(self.size, self.mtime_ns, self.tag)

    @cached_property
    def folder(self) -> str:
        """The folder of the source file's chunks (:func:`source_folder`), or of a pack's versions."""
        return pack_folder(self.members) if self.members else source_folder(self.path)

    @property
    def parts(self) -> tuple[str, str]:
        """The folders below the cache root that hold the chunk's file."""
        return LAYOUT_DIR, self.folder

    @property
    def name(self) -> str:
        """The chunk file's name: ``<spec>-<version>-<rg start>-<rg stop>.glc`` (a pack's:
        ``<spec>-<version>-0-<files>.glc``)."""
        if self.members:
            return f"{self.spec}-{self.version}-0-{len(self.members)}{SUFFIX}"
        return f"{self.spec}-{self.version}-{self.rg_start}-{self.rg_stop}{SUFFIX}"

    def relpath(self) -> str:
        """The chunk file's path below the cache root, with ``/``."""
        return f"{LAYOUT_DIR}/{self.folder}/{self.name}"

    @property
    def identity(self) -> Identity:
        """What the chunk file's header must state to be served for this key."""
        return Identity(self.path, self.size, self.mtime_ns, self.rg_start, self.rg_stop, self.rows, self.spec,
                        self.outputs, self.tag, self.members)

    def header_fields(self) -> dict:
        """The identity fields a new chunk file's header records (``source``, ``row_groups``, ``spec``;
        a pack's ``members`` too: ``[path, size, mtime_ns, tag, rg_start, rg_stop]`` per file)."""
        source = {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}
        if self.tag:
            source["tag"] = self.tag
        members = {"members": [list(m) for m in self.members]} if self.members else {}
        return {"source": source, "row_groups": [self.rg_start, self.rg_stop], **members, "spec": self.spec_desc}


def pack_folder(members) -> str:
    """The folder of a pack's versions: a hash of its files' paths (``members``: as :class:`ChunkKey`'s)."""
    return xxhash.xxh64_hexdigest("\0".join(str(m[0]) for m in members).encode())


def pack_version(members) -> str:
    """A pack's version token: of each file's size, mtime and tag (:func:`version_token`) and row groups."""
    return xxhash.xxh64_hexdigest("\0".join(f"{version_token(m[1], m[2], m[3])}:{m[4]}:{m[5]}"
                                            for m in members).encode())
