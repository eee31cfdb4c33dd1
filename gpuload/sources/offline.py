"""A remote source item listed, or, while its store cannot be reached, its last listing kept.

:func:`list_item` lists one item of a remote source (an object, a prefix or a glob) with
retries, has a Delta table's log choose its objects, and keeps the result in the cache
(:mod:`gpuload.cache.listings`). When the store cannot be reached (every try failed for a
reason worth another: :class:`~gpuload.sources.retry.Unreachable`), the kept listing stands in,
if one is kept and is at most ``RemoteSettings.kept_listing_s`` old; the item is recorded as an
:class:`Offline`, and :class:`gpuload.reader.ChunkReader` opens the dataset only if every chunk
is cached (the epochs then make no request), else raises the listing's error with what is missing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..cache.fs import CacheRoot
from ..cache.listings import Kept, load_listing, save_listing
from ..errors import SourceError
from .remote import ObjectInfo, Store
from .retry import Unreachable, retry
from .settings import RemoteSettings
from .tables import remote_table_files

log = logging.getLogger("gpuload")

__all__ = ["Offline", "list_item", "check_offline"]


@dataclass(frozen=True)
class Offline:
    """An item opened from its kept listing: its URL, the listing's error, the kept listing."""

    url: str
    error: str
    kept: Kept


def list_item(store: Store, text: str, settings: RemoteSettings, root: CacheRoot | None,
              offline: list[Offline]) -> tuple[list[ObjectInfo], str | None, dict | None]:
    """``(objects, Hive partition base or None, {path: table keys} or None)`` of one remote item
    ``text``, as :meth:`Store.expand` and :func:`~gpuload.sources.tables.remote_table_files` give
    them; kept in ``root`` (when not None) for a later open without the store, or taken from it
    (appending an :class:`Offline` to ``offline``) when the store cannot be reached."""
    url = store.url(store.strip(text))
    try:
        infos, base, below = retry(lambda: store.expand(text), f"{text}: listing", settings)
        tables = None if base is None else remote_table_files(
            store, base, [i.path for i in infos], below, whole=below is not None,
            read=lambda path, size: retry(lambda: store.read(path, 0, size), f"{store.url(path)}: reading", settings))
    except Unreachable as e:
        kept = load_listing(root, url) if settings.kept_listing_s > 0 else None
        if kept is None:
            raise
        if kept.table:
            raise Unreachable(f"{e}; the listing kept from its last open ({kept.age_text()} ago) is a Delta "
                              "table's, which opens only from its log") from None
        if time.time() - kept.at > settings.kept_listing_s:
            raise Unreachable(f"{e}; the listing kept from its last open is {kept.age_text()} old, more than "
                              f"remote kept_listing_s={settings.kept_listing_s:g} s allows") from None
        offline.append(Offline(url, str(e), kept))
        return [ObjectInfo(*o) for o in kept.objects], kept.base, None
    if root is not None:
        try:
            save_listing(root, url, base, tables is not None,
                         [i for i in infos if tables is None or i.path in tables])
        except OSError as e:  # the open goes on: only a later open without the store needs it
            log.warning("gpuload: %s: its listing could not be kept in the cache (%s); without the store, the "
                        "dataset will not open", url, e)
    return infos, base, tables


def check_offline(offline: list[Offline], missing: int, chunks: int) -> None:
    """For a dataset opened from kept listings (``offline``): a :class:`SourceError` when ``missing``
    of its ``chunks`` are not cached (reading them needs the store), else a warning per item."""
    if missing:
        first = offline[0]
        more = f" (and {len(offline) - 1} more item(s) of the source)" if len(offline) > 1 else ""
        raise SourceError(f"{first.error}{more}; the listing kept from its last open ({first.kept.age_text()} ago) "
                          f"names {len(first.kept.objects)} objects, but {missing} of the dataset's {chunks} chunks "
                          "are not cached, and reading them needs the store: open it again when the store is up (a "
                          "dataset opens without its store only once all its chunks are cached, as after a whole "
                          "epoch or gpuload cache build)")
    for o in offline:
        log.warning("gpuload: %s: the store cannot be reached (%s); opened from the listing kept at its last open, "
                    "%s ago (%d objects), every chunk cached: objects added, rewritten or removed since are not "
                    "seen", o.url, o.error, o.kept.age_text(), len(o.kept.objects))
