"""A remote source item listed, or, while its store cannot be reached, its last listing kept.

:func:`list_item` lists one item of a remote source (an object, a prefix or a glob) with
retries, has a Delta table's log choose its objects, and keeps the result in the cache
(:mod:`gpuload.cache.listings`), under the item's URL and its store's place (the filesystem and
its options, credentials left out: the same names at another endpoint are another listing). When
the store cannot be reached (every try failed for a reason worth another:
:class:`~gpuload.sources.retry.Unreachable`), the kept listing stands in, if one is kept and is at
most ``RemoteSettings.kept_listing_s`` old, and the other items of that store are not tried again
in this open; each such item is recorded as an
:class:`Offline`, and :class:`gpuload.reader.ChunkReader` opens the dataset only if every chunk
is cached (the epochs then make no request), else raises the listing's error with what is missing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

from ..cache.fs import CacheRoot
from ..cache.listings import Kept, load_listing, note_use, save_listing
from ..errors import SourceError
from .remote import ObjectInfo, Store, _is_arrow_fs as is_arrow_fs
from .retry import Unreachable, retry
from .settings import RemoteSettings
from .tables import remote_table_files

log = logging.getLogger("gpuload")

__all__ = ["Offline", "list_item", "check_offline", "warn_offline"]


@dataclass(frozen=True)
class Offline:
    """An item opened from its kept listing: its URL, the listing's error, the kept listing, and
    the store that could not be reached."""

    url: str
    error: str
    kept: Kept
    store: Store = field(compare=False, repr=False)


# option names left out of a store's place: credentials (rotated from job to job) and tuning
_NOT_PLACE = re.compile(r"key|secret|token|password|passwd|credential|auth|sas|session|signature|role|"
                        r"timeout|retr|config_kwargs|frequency|background|cache|block_size|loop|asynchronous", re.I)


def _public(value):
    """Options (dicts, lists, scalars) without the entries whose names :data:`_NOT_PLACE` matches."""
    if isinstance(value, dict):
        return {str(k): _public(v) for k, v in value.items() if not _NOT_PLACE.search(str(k))}
    if isinstance(value, (list, tuple)):
        return [_public(v) for v in value]
    return value


def _named(obj):
    """A filesystem (or another object among the options) as JSON-able: its class and the public
    options it was made with (fsspec's ``storage_options``, pyarrow's pickled arguments)."""
    if hasattr(obj, "storage_options"):
        return [type(obj).__name__, _public(obj.storage_options or {})]
    if is_arrow_fs(obj):
        args = obj.__reduce__()[1]
        return [type(obj).__name__, _public(args[0] if len(args) == 1 and isinstance(args[0], dict) else list(args))]
    return type(obj).__name__


def place(store: Store) -> str:
    """What tells ``store`` from another that holds objects of the same names: its protocol, its
    filesystem's class and the options that filesystem was made with (an endpoint, a region, a root
    folder), credentials and tuning left out (they may change from job to job)."""
    return json.dumps([store.protocol, _named(store.fs)], sort_keys=True, default=_named)


_unkept: set[str] = set()  # cache roots a listing could not be kept in (warned once per process)


def list_item(store: Store, text: str, settings: RemoteSettings, root: CacheRoot | None,
              offline: list[Offline]) -> tuple[list[ObjectInfo], str | None, dict | None]:
    """``(objects, Hive partition base or None, {path: table keys} or None)`` of one remote item
    ``text``, as :meth:`Store.expand` and :func:`~gpuload.sources.tables.remote_table_files` give
    them; kept in ``root`` (when not None) for a later open without the store, or taken from it
    (appending an :class:`Offline` to ``offline``) when the store cannot be reached. An item whose
    store an earlier item found down is not listed again: its kept listing is used at once."""
    url, where = store.url(store.strip(text)), place(store)
    root = root if settings.kept_listing_s > 0 else None  # 0: never opened without the store, nothing kept
    down = next((o.error for o in offline if o.store is store), None)  # an earlier item's failure
    if down is None:
        try:
            infos, base, below = retry(lambda: store.expand(text), f"{text}: listing", settings)
            tables = None if base is None else remote_table_files(
                store, base, [i.path for i in infos], below, whole=below is not None,
                read=lambda path, size: retry(lambda: store.read(path, 0, size), f"{store.url(path)}: reading",
                                              settings))
        except Unreachable as e:
            down, why = str(e), ""
        else:
            _keep(root, url, where, base, tables, infos)
            return infos, base, tables
    else:
        why = f"; {url} was not listed: its store is the same"
    kept = _kept(root, url, where, settings, down, why)
    offline.append(Offline(url, down, kept, store))
    return [ObjectInfo(*o) for o in kept.objects], kept.base, None


def _keep(root: CacheRoot | None, url: str, where: str, base, tables, infos) -> None:
    if root is None:
        return
    try:
        save_listing(root, url, where, base, tables is not None,
                     [i for i in infos if tables is None or i.path in tables])
    except OSError as e:  # the open goes on: only a later open without the store needs it
        if str(root.path) not in _unkept:
            _unkept.add(str(root.path))
            log.warning("gpuload: the cache in %s cannot keep remote sources' listings (%s): while a store is "
                        "down, its sources open from a listing kept earlier, if any, or not at all", root.path,
                        e.strerror or e)


def _kept(root: CacheRoot | None, url: str, where: str, settings: RemoteSettings, down: str, why: str) -> Kept:
    """The kept listing ``url`` opens from while its store is down (``down``: the error; ``why``: ""
    where it is this item's own, else why this item was not listed), or :class:`Unreachable` saying
    why there is none to use."""
    try:
        kept = load_listing(root, url, where)
    except ValueError as e:
        raise Unreachable(f"{down}{why}; the listing kept for {url} cannot be used ({e}): "
                          "`gpuload cache verify` names the file") from None
    if kept is None:
        raise Unreachable(down + (f"{why}, and no listing of it is kept" if why else "")) from None
    if kept.table:
        raise Unreachable(f"{down}{why}; the listing of {url} kept from its last open ({kept.age_text()} ago) is "
                          "a Delta table's, which opens only from its log") from None
    if time.time() - kept.at > settings.kept_listing_s:
        raise Unreachable(f"{down}{why}; the listing of {url} kept from its last open is {kept.age_text()} old, "
                          f"more than remote kept_listing_s={settings.kept_listing_s:g} s allows") from None
    note_use(root, url, where)  # used: `cache clear --unused-since` keeps it
    return kept


def _listings(offline: list[Offline]) -> str:
    """The kept listings in words: how many items, the oldest age, the objects."""
    many = len(offline) > 1
    oldest = min(offline, key=lambda o: o.kept.at)
    return (f"listing{'s' if many else ''} kept at the last open ({f'{len(offline)} items of the source, ' * many}"
            f"{'the oldest ' * many}{oldest.kept.age_text()} ago, {sum(len(o.kept.objects) for o in offline)} objects)")


def check_offline(offline: list[Offline], missing: int, chunks: int) -> None:
    """For a dataset opened from kept listings (``offline``): a :class:`SourceError` when ``missing``
    of its ``chunks`` are not cached, since reading them needs the store."""
    if missing:
        raise SourceError(f"{offline[0].error}; the {_listings(offline)} would open it, but {missing} of the "
                          f"dataset's {chunks} chunks {'is' if missing == 1 else 'are'} not cached, and reading them "
                          "needs the store: open it again when the store is up (a dataset opens without its store "
                          "only once all its chunks are cached, as after a whole epoch or gpuload cache build)")


def warn_offline(offline: list[Offline]) -> None:
    """The warning of a dataset opened from kept listings (``offline``), every chunk cached."""
    log.warning("gpuload: %s: the store cannot be reached (%s); opened from the %s, every chunk cached: objects "
                "added, rewritten or removed since are not seen", offline[0].url, offline[0].error, _listings(offline))
