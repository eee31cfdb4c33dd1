"""Cache maintenance: what ``gpuload cache info``, ``verify`` and ``clear`` do (the record of each
column set's last use that ``clear`` goes by: :mod:`gpuload.cache.specs`).

Every function takes the :class:`gpuload.cache.fs.CacheRoot` of a cache directory and
works through it, so it never leaves the root nor follows a link. Entries that
gpuload did not write (a foreign file, a link, a FIFO, a folder where a chunk should
be) are reported and never deleted; ``clear`` deletes only regular files with the
names gpuload writes, and leaves a lock file alone while a builder holds it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator, NamedTuple

import xxhash

from .chunkfile import MALFORMED, LAYOUT_DIR, SPECS_DIR, SUFFIX, USES_DIR, Identity, read_header, read_regions, \
    version_token
from .fs import CHUNK, FOOTER, FOLDER, LAYOUT, LOCK, SPEC, TEMP, USES, VOCAB, CacheRoot, Lock, kind_of
from .paths import pack_folder, pack_version
from ..errors import ConfigError, CorruptCacheError
from .footers import check_footer_file
from .kept import KEPT_SUFFIX, check_kept_file
from .listings import LISTING_SUFFIX, check_listing_file, read_listing_file
from .specs import read_desc, spec_problem
from .vocabs import VOCAB_DIR, check_vocab_file, read_vocab_file
from ..layout import stored_outputs

__all__ = ["Problem", "walk", "chunk_files", "temporaries", "specs", "summary", "verify_all", "delete", "clear",
           "drop_free_lock"]

_LAYOUT, _SPECS, _VOCABS = LAYOUT_DIR, SPECS_DIR, VOCAB_DIR


def _name_identity(folder: str, name: str, header: dict) -> Identity:
    """The identity a chunk file named ``name`` in ``folder`` must have, given its own header."""
    spec, version, a, b = name[:-len(SUFFIX)].split("-")
    try:
        src, desc = header["source"], header["spec"]
        members = tuple(tuple(m) for m in header.get("members", ()))
        if members:  # a pack: named by its files (0-<files>), its first file's row groups in "row_groups"
            if pack_folder(members) != folder or pack_version(members) != version or (a, b) != ("0", str(len(members))):
                raise CorruptCacheError(f"its header packs {len(members)} files, others than its name's")
            a, b = header["row_groups"]
        elif (xxhash.xxh64_hexdigest(str(src["path"]).encode()) != folder
                or version_token(src["size"], src["mtime_ns"], src.get("tag", "")) != version):
            raise CorruptCacheError(f"its header names {src['path']}, another source file than its name")
        return Identity(src["path"], src["size"], src["mtime_ns"], int(a), int(b), None, spec, stored_outputs(desc),
                        src.get("tag", ""), members)
    except MALFORMED as e:
        raise CorruptCacheError(f"malformed header ({type(e).__name__}: {e})") from None


class Problem(NamedTuple):
    """A cache entry that failed a check: its path, what is wrong, and ``kind``
    (``"corrupt"``: rebuilt on next use, or ``"unreadable"``: no permission, a link...)."""

    path: Path
    problem: str
    kind: str


def _scan(root: CacheRoot, parts, problems: list | None) -> list:
    try:
        return root.scan(parts)
    except OSError as e:  # no permission, or a link where a folder should be
        if problems is not None:
            problems.append(Problem(root.where(parts), f"{root.where(parts)}: cannot read this folder ({e})",
                                    "unreadable"))
        return []


def walk(root: CacheRoot, layouts: bool = False, problems: list | None = None
         ) -> Iterator[tuple[tuple, str, os.stat_result]]:
    """(folder parts, name, lstat) of every entry in the source folders of the current
    layout (every layout if ``layouts``); also yields foreign entries at those levels.
    Folders that cannot be read are skipped, and added to ``problems`` if given."""
    for lname, lst in ([(_LAYOUT, None)] if not layouts else _scan(root, (), problems)):
        if layouts and not (LAYOUT.fullmatch(lname) and stat.S_ISDIR(lst.st_mode)):
            continue
        for fname, fst in _scan(root, (lname,), problems):
            if fname in (_SPECS, _VOCABS, USES_DIR) and lname == _LAYOUT:
                continue
            if not (FOLDER.fullmatch(fname) and stat.S_ISDIR(fst.st_mode)):
                yield (lname,), fname, fst  # the budget lock, or foreign: reported, never entered
                continue
            for name, st in _scan(root, (lname, fname), problems):
                yield (lname, fname), name, st


def chunk_files(root: CacheRoot, layouts: bool = False, problems: list | None = None
                ) -> Iterator[tuple[tuple, str, os.stat_result]]:
    """(folder parts, name, lstat) of every regular file with a chunk's name."""
    for parts, name, st in walk(root, layouts, problems):
        if len(parts) == 2 and CHUNK.fullmatch(name) and stat.S_ISREG(st.st_mode):
            yield parts, name, st


def temporaries(root: CacheRoot) -> Iterator[Path]:
    """Temporary files left by writers that were killed."""
    specs = [((_LAYOUT, d), name, st) for d in (_SPECS, USES_DIR) for name, st in _scan(root, (_LAYOUT, d), None)]
    for parts, name, st in [*walk(root), *specs]:
        if TEMP.fullmatch(name) and stat.S_ISREG(st.st_mode):
            yield root.where(parts, name)


def specs(root: CacheRoot, problems: list | None = None) -> dict[str, dict]:
    """Per spec hash of the current format: ``desc`` (or None), ``last_used`` (epoch seconds: when a
    dataset last opened it, from its ``specs/`` record, else its newest chunk file), chunks, bytes."""
    out: dict[str, dict] = {}
    for name, st in _scan(root, (_LAYOUT, _SPECS), problems):
        if SPEC.fullmatch(name) and stat.S_ISREG(st.st_mode):
            desc = None
            with contextlib.suppress(OSError):
                desc = read_desc(root, name)
            out[name[:-5]] = {"desc": desc, "last_used": st.st_mtime, "chunks": 0, "bytes": 0}
    marked = set(out)
    for parts, name, st in chunk_files(root, problems=problems):
        e = out.setdefault(name[:16], {"desc": None, "last_used": 0.0, "chunks": 0, "bytes": 0})
        e["chunks"] += 1
        e["bytes"] += st.st_size
        if name[:16] not in marked:  # no record of its use: its newest chunk stands in
            e["last_used"] = max(e["last_used"], st.st_mtime)
    return out


def _vocab_folder(root: CacheRoot, problems: list, foreign: list) -> Iterator[tuple[str, os.stat_result]]:
    """(name, lstat) of gpuload's files in the vocabulary folder (vocabularies, their temporaries
    and locks); every other entry there is added to ``foreign``."""
    for name, st in _scan(root, (_LAYOUT, _VOCABS), problems):
        if (VOCAB.fullmatch(name) or TEMP.fullmatch(name) or LOCK.fullmatch(name)) and stat.S_ISREG(st.st_mode):
            yield name, st
        else:
            foreign.append(f"{root.where((_LAYOUT, _VOCABS), name)} ({kind_of(st.st_mode)})")


def summary(root: CacheRoot) -> dict:
    """Counts and bytes of the chunk files, per source file and per spec, plus leftovers: ``foreign``
    (entries gpuload did not write) and ``unreadable`` (its folders that cannot be read, not counted).
    Raises ``OSError`` when the cache folder itself cannot be read."""
    root.scan(())  # the folder itself unreadable: an error, not a cache of nothing with room to spare
    sources: dict[str, dict] = {}
    total, foreign, old, problems, footers = 0, [], 0, [], 0
    for parts, name, st in walk(root, layouts=True, problems=problems):
        if len(parts) == 2 and CHUNK.fullmatch(name) and stat.S_ISREG(st.st_mode):
            if parts[0] != _LAYOUT:
                old += 1
                continue
            total += st.st_size
            src = "(unreadable header)"
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError, CorruptCacheError):
                fd = root.open_read(parts, name)
                try:
                    header = read_header(fd, name)[0]
                    src = header["source"]["path"]
                    if header.get("members"):  # a pack of small files: named by its first
                        src = f"{src} and the {len(header['members']) - 1} files packed after it"
                finally:
                    os.close(fd)
            e = sources.setdefault(str(src), {"chunks": 0, "bytes": 0})
            e["chunks"] += 1
            e["bytes"] += st.st_size
        elif len(parts) == 2 and FOOTER.fullmatch(name) and stat.S_ISREG(st.st_mode):
            footers += parts[0] == _LAYOUT
        elif not ((TEMP.fullmatch(name) or LOCK.fullmatch(name)) and stat.S_ISREG(st.st_mode)):
            foreign.append(f"{root.where(parts, name)} ({kind_of(st.st_mode)})")
    for name, st in _scan(root, (_LAYOUT, _SPECS), problems):
        if not ((SPEC.fullmatch(name) or TEMP.fullmatch(name)) and stat.S_ISREG(st.st_mode)):
            foreign.append(f"{root.where((_LAYOUT, _SPECS), name)} ({kind_of(st.st_mode)})")
    vocabularies = []
    kept, listings = 0, []
    for name, st in _vocab_folder(root, problems, foreign):
        if VOCAB.fullmatch(name) and name.endswith(KEPT_SUFFIX):  # a row filter's counts of one file
            kept += 1
        elif VOCAB.fullmatch(name) and name.endswith(LISTING_SUFFIX):  # a remote source's last listing
            entry = {"name": name, "bytes": st.st_size}
            with contextlib.suppress(OSError, ValueError):
                header = read_listing_file(root, name)
                entry.update(url=header["url"], objects=len(header["objects"]), at=header["at"])
            listings.append(entry)
        elif VOCAB.fullmatch(name):
            entry = {"name": name, "bytes": st.st_size, "built": st.st_mtime}
            with contextlib.suppress(OSError, ValueError):
                header, vocabulary = read_vocab_file(root, name)
                entry.update(column=vocabulary.column, values=len(vocabulary), vocab=vocabulary.vocab,
                             sources=header.get("sources"))
            vocabularies.append(entry)
    return {"root": str(root.path), "chunks": sum(e["chunks"] for e in sources.values()), "bytes": total,
            "sources": sources, "specs": specs(root), "temporaries": len(list(temporaries(root))),
            "old_format": old, "footers": footers, "vocabularies": vocabularies, "kept_counts": kept,
            "listings": listings,
            "foreign": foreign, "unreadable": sorted({p.problem for p in problems})}


def verify_all(root: CacheRoot, progress=None) -> list[Problem]:
    """Check every chunk file: its name, header identity, sizes and checksums.

    Returns a :class:`Problem` for each bad one, including entries at a chunk's name
    that are not regular files and files or folders that cannot be read.
    """
    bad: list[Problem] = []
    for name, st in _scan(root, (_LAYOUT, _SPECS), bad):
        if SPEC.fullmatch(name) and stat.S_ISREG(st.st_mode):
            _check_file(bad, root.where((_LAYOUT, _SPECS), name), lambda: spec_problem(root, name))
    for name, st in _scan(root, (_LAYOUT, _VOCABS), bad):
        if VOCAB.fullmatch(name):
            path = root.where((_LAYOUT, _VOCABS), name)
            check = check_kept_file if name.endswith(KEPT_SUFFIX) else \
                check_listing_file if name.endswith(LISTING_SUFFIX) else check_vocab_file
            _check_file(bad, path, lambda: check(root, name))
            if progress is not None:
                progress(path)
    for parts, name, st in sorted(walk(root, problems=bad), key=lambda e: e[:2]):
        path = root.where(parts, name)
        if len(parts) == 2 and FOOTER.fullmatch(name):
            _check_file(bad, path, lambda: check_footer_file(root, parts, name))
            continue
        if not (len(parts) == 2 and CHUNK.fullmatch(name)):
            continue
        try:
            fd = root.open_read(parts, name)
            try:
                header = read_header(fd, path)[0]
                try:
                    want = _name_identity(parts[1], name, header)
                except CorruptCacheError as e:
                    raise CorruptCacheError(f"{path}: {e}") from None
                read_regions(fd, path, want, verify=True)
            finally:
                os.close(fd)
        except FileNotFoundError:
            continue  # removed meanwhile
        except (CorruptCacheError, OSError) as e:
            text = str(e) if str(path) in str(e) else f"{path}: {e}"
            bad.append(Problem(path, text, "corrupt" if isinstance(e, CorruptCacheError) else "unreadable"))
        if progress is not None:
            progress(path)
    return bad


def _check_file(bad: list, path: Path, check) -> None:
    """Run ``check()`` (what is wrong with a footer or vocabulary file, or None) and add its Problem to ``bad``."""
    try:
        problem = check()
    except FileNotFoundError:
        return  # removed meanwhile
    except OSError as e:
        bad.append(Problem(path, f"{path}: {e}", "unreadable"))
        return
    if problem is not None:
        bad.append(Problem(path, f"{path}: {problem}", "corrupt"))


def delete(root: CacheRoot, path: Path) -> int:
    """Delete one chunk, footer, vocabulary or column-set description file given by its path
    (only a regular file with such a name, in its folder inside this cache); returns the bytes freed."""
    path = Path(path)
    try:
        rel = path.parent.relative_to(root.path).parts
    except ValueError:
        return 0
    if rel == (_LAYOUT, _VOCABS):
        pattern = VOCAB
    elif rel == (_LAYOUT, _SPECS):
        pattern = SPEC
    elif len(rel) == 2 and LAYOUT.fullmatch(rel[0]) and FOLDER.fullmatch(rel[1]):
        pattern = FOOTER if FOOTER.fullmatch(path.name) else CHUNK
    else:
        return 0  # not a folder of this cache that holds them (".." included)
    gone = root.unlink(rel, path.name, pattern)
    return 0 if gone is None else gone.st_size


def clear(root: CacheRoot, spec: str | None = None, unused_since: float | None = None, open_specs=()) -> dict:
    """Delete gpuload's files: every chunk, footer, vocabulary, listing, temporary and free lock file of every
    format (or only those of spec hash ``spec``, or of the specs and the remote listings
    (:mod:`gpuload.cache.listings`) not used since ``unused_since`` epoch seconds),
    but the column sets in ``open_specs`` (a live reader reads them: while one is kept, the footers and
    vocabularies, which serve every column set, are kept too). Returns
    ``{"freed": bytes, "files": n, "specs": removed spec hashes, "open": specs kept as open,
    "foreign": [entries left alone], "failed": [files that could not be deleted, with why]}``.

    Only regular files with names gpuload writes are deleted, only inside the root,
    never through a link; lock files that a builder holds are left in place.
    """
    chosen, kept = None, []
    known = specs(root) if spec is not None or unused_since is not None or open_specs else {}
    if spec is not None or unused_since is not None or set(open_specs) & set(known):
        named = [h for h in known if h.startswith(spec)] if spec is not None else []
        if spec is not None and not named:  # a user's trial was told to give more of a hash that matched none
            raise ConfigError(f"spec {spec!r} names no column set in {root.path} ({len(known)} there); give the "
                              "start of a hash `gpuload cache info` lists under 'column sets' (not a dataset's, "
                              "listed above them)")
        if len(named) > 1:
            raise ConfigError(f"spec {spec!r} names {len(named)} column sets, not exactly one; give more of its "
                              "hash (`gpuload cache info` lists them)")
        chosen = {h for h in (known if spec is None else named)
                  if unused_since is None or known[h]["last_used"] < unused_since}
        kept = sorted(chosen & set(open_specs))  # in use now: a running dataset reads them
        chosen -= set(kept)
    only_open = spec is None and unused_since is None  # a full clear, but for open column sets
    freed, files, foreign, folders, problems, failed = 0, 0, [], set(), [], []
    for parts, name, st in list(walk(root, layouts=True, problems=problems)):
        if not stat.S_ISREG(st.st_mode) or not (CHUNK.fullmatch(name) or TEMP.fullmatch(name)
                                                 or LOCK.fullmatch(name) or FOOTER.fullmatch(name)):
            foreign.append(f"{root.where(parts, name)} ({kind_of(st.st_mode)})")
            continue
        folders.update([parts, parts[:1]])
        if chosen is not None and (name[:16] not in chosen or FOOTER.fullmatch(name)) \
                and not (only_open and parts[0] != _LAYOUT):  # older formats' files: no reader reads them
            continue  # footers serve every column set: only a full clear removes them
        try:
            if LOCK.fullmatch(name):
                gone = drop_free_lock(root, parts, name)
            else:
                pattern = next(p for p in (CHUNK, FOOTER, TEMP) if p.fullmatch(name))
                gone = root.unlink(parts, name, pattern)
                freed += gone.st_size if gone is not None and CHUNK.fullmatch(name) else 0
        except OSError as e:  # e.g. a read-only cache: say which, go on with the rest
            failed.append(f"{root.where(parts, name)} ({e.strerror or e})")
            continue
        files += gone is not None
    for parts in sorted(folders, key=len, reverse=True):  # only if empty (another process may be writing)
        if len(parts) == 2 or parts[0] != _LAYOUT:  # source folders, and older formats' layout folders
            root.rmdir(parts[:-1], parts[-1])
    for name, st in _vocab_folder(root, problems, foreign):  # they serve every column set: a full clear only,
        unused = (spec is None and unused_since is not None and VOCAB.fullmatch(name) is not None  # but a
                  and name.endswith(LISTING_SUFFIX) and st.st_mtime < unused_since)  # listing unused since
        if chosen is None or unused:
            try:
                gone = (drop_free_lock(root, (_LAYOUT, _VOCABS), name) if LOCK.fullmatch(name) else
                        root.unlink((_LAYOUT, _VOCABS), name, VOCAB if VOCAB.fullmatch(name) else TEMP))
            except OSError as e:
                failed.append(f"{root.where((_LAYOUT, _VOCABS), name)} ({e.strerror or e})")
                continue
            files += gone is not None
    if chosen is None:
        root.rmdir((_LAYOUT,), _VOCABS)
        files += _clear_records(root, foreign, failed)
    removed = []
    for name, st in _scan(root, (_LAYOUT, _SPECS), problems):
        if not ((SPEC.fullmatch(name) or TEMP.fullmatch(name)) and stat.S_ISREG(st.st_mode)):
            foreign.append(f"{root.where((_LAYOUT, _SPECS), name)} ({kind_of(st.st_mode)})")
        elif chosen is None or name[:16] in chosen:
            try:
                if root.unlink((_LAYOUT, _SPECS), name, SPEC if SPEC.fullmatch(name) else TEMP) is not None:
                    removed += [name[:16]] if SPEC.fullmatch(name) else []
            except OSError as e:
                failed.append(f"{root.where((_LAYOUT, _SPECS), name)} ({e.strerror or e})")
    return {"freed": freed, "files": files, "specs": sorted(removed), "open": kept,
            "foreign": foreign, "failed": failed + sorted({p.problem for p in problems})}


def _clear_records(root: CacheRoot, foreign: list, failed: list) -> int:
    """A full clear's part in ``uses/`` (:mod:`gpuload.cache.evict`): the records no live reader
    holds; the files deleted."""
    parts, n = (_LAYOUT, USES_DIR), 0
    for name, st in _scan(root, parts, None):
        if not ((USES.fullmatch(name) or LOCK.fullmatch(name) or TEMP.fullmatch(name)) and stat.S_ISREG(st.st_mode)):
            foreign.append(f"{root.where(parts, name)} ({kind_of(st.st_mode)})")
        elif USES.fullmatch(name):
            lock = Lock(root, parts, name + ".lock")
            try:
                if lock.acquire(blocking=False):  # no reader holds it: its lock file goes below
                    n += root.unlink(parts, name, USES) is not None
            except OSError as e:
                failed.append(f"{root.where(parts, name)} ({e.strerror or e})")
            finally:
                lock.release()
        elif TEMP.fullmatch(name):
            n += root.unlink(parts, name, TEMP) is not None
    for name, _ in _scan(root, parts, None):  # the lock files no one holds: the records', and the folder's own
        if LOCK.fullmatch(name) and drop_free_lock(root, parts, name) is not None:
            n += 1
    root.rmdir((_LAYOUT,), USES_DIR)
    return n


def drop_free_lock(root: CacheRoot, parts, name: str) -> os.stat_result | None:
    """Delete lock file ``name`` unless a builder holds it; its lstat if deleted."""
    lock = Lock(root, parts, name)
    try:
        if not lock.acquire(blocking=False):
            return None
    except OSError:
        return None
    try:
        return root.unlink(parts, name, LOCK)
    finally:
        lock.release()
