"""Kept listings: read back as written; damaged, misnamed or foreign files ignored, never trusted;
counted, verified and cleared by the cache's tools."""

from __future__ import annotations

import json
import time

import pytest

from gpuload.cache import admin as cache_admin
from gpuload.cache.fs import CacheRoot
from gpuload.cache.listings import (LISTING_SUFFIX, Kept, check_listing_file, listing_key, load_listing,
                                    save_listing)
from gpuload.cache.smallfile import write_small_file
from gpuload.sources.remote import ObjectInfo

PLACE = '["s3", ["S3FileSystem", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}]]'
OBJECTS = [ObjectInfo("b/d/p0.parquet", 1234, 1_700_000_000_000_000_000, '"etag-0"'),
           ObjectInfo("b/d/k=1/p1.parquet", 99, 0, "")]


def _t(o: ObjectInfo) -> tuple:
    return o.path, o.size, o.mtime_ns, o.tag


def _path(cache, url: str, place: str = PLACE):
    return cache / "v3" / "vocab" / (listing_key(url, place) + LISTING_SUFFIX)


def test_a_listing_reads_back_as_it_was_kept(tmp_path):
    root = CacheRoot(tmp_path)
    before = time.time()
    save_listing(root, "s3://b/d", PLACE, "b/d", False, OBJECTS)
    kept = load_listing(root, "s3://b/d", PLACE)
    assert kept.objects == [_t(o) for o in OBJECTS] and kept.base == "b/d" and kept.table is False
    assert before <= kept.at <= time.time()
    assert load_listing(root, "s3://b/other", PLACE) is None and load_listing(None, "s3://b/d", PLACE) is None
    assert load_listing(root, "s3://b/d", PLACE.replace("9000", "9001")) is None  # another endpoint's
    assert listing_key("s3://b/d", PLACE) != listing_key("gs://b/d", PLACE)
    save_listing(root, "s3://b/d", PLACE, None, True, OBJECTS[:1])  # the next open's replaces it
    again = load_listing(root, "s3://b/d", PLACE)
    assert again == Kept(again.at, None, True, [_t(OBJECTS[0])])


@pytest.mark.parametrize("age, text", [(0, "0 s"), (59, "59 s"), (61, "1 min"), (3600 * 5 + 120, "5 h 2 min"),
                                       (86400 * 3 + 3600 * 4 + 60, "3 d 4 h")])
def test_age_in_words(age, text):
    assert Kept(1000.0, None, False, []).age_text(now=1000.0 + age) == text


def test_a_damaged_or_misnamed_listing_is_ignored_and_named_by_verify(tmp_path):
    root = CacheRoot(tmp_path)
    save_listing(root, "s3://b/d", PLACE, "b/d", False, OBJECTS)
    path = _path(tmp_path, "s3://b/d")
    assert check_listing_file(root, path.name) is None
    path.write_bytes(path.read_bytes()[:-1] + b" ")  # same length, other bytes
    with pytest.raises(ValueError, match="checksum"):
        load_listing(root, "s3://b/d", PLACE)
    assert "checksum" in check_listing_file(root, path.name)
    # a well-formed file for another URL copied under this one's name
    save_listing(root, "s3://b/other", PLACE, "b/other", False, OBJECTS)
    path.write_bytes(_path(tmp_path, "s3://b/other").read_bytes())
    with pytest.raises(ValueError, match="another listing"):
        load_listing(root, "s3://b/d", PLACE)
    assert check_listing_file(root, path.name) == "its header names another listing than its name"


@pytest.mark.parametrize("objects", [[["p", -1, 0, ""]], [["p", 1, 0]], [["p", True, 0, ""]], [[1, 1, 0, ""]], {}])
def test_objects_that_are_not_objects_are_refused(tmp_path, objects):
    from gpuload.cache import listings

    root = CacheRoot(tmp_path)
    key = listing_key("s3://b/d", PLACE)
    body = json.dumps({"key": key, "url": "s3://b/d", "place": PLACE, "at": 1.0, "base": None, "table": False,
                       "objects": objects})
    write_small_file(root, ("v3", "vocab"), key + LISTING_SUFFIX, listings.MAGIC, listings.VERSION, body.encode())
    with pytest.raises(ValueError, match="malformed"):
        load_listing(root, "s3://b/d", PLACE)
    assert "malformed" in check_listing_file(root, key + LISTING_SUFFIX)


def test_info_verify_and_clear_know_listings(tmp_path, cli):
    root = CacheRoot(tmp_path)
    save_listing(root, "s3://b/d", PLACE, "b/d", False, OBJECTS)
    for i in range(11):
        save_listing(root, f"s3://b/more{i}", PLACE, None, False, OBJECTS[:1])
    s = cache_admin.summary(root)
    assert len(s["listings"]) == 12 and not s["foreign"]
    assert {e["url"]: e["objects"] for e in s["listings"]} == {"s3://b/d": 2} | {f"s3://b/more{i}": 1 for i in range(11)}
    assert cache_admin.verify_all(root) == []
    path = _path(tmp_path, "s3://b/d")
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    (bad,) = cache_admin.verify_all(root)
    assert bad.path == path and "checksum" in bad.problem
    info = cli("cache", "info", "--cache-dir", str(tmp_path)).stdout
    assert "remote listings kept (each source's last, to open it while its store is down):" in info
    assert "s3://b/more10: 1 objects; listed " in info and "... and 2 more" in info
    assert f"{path.name}: unreadable (not used; `gpuload cache verify` says why)" in info  # shown first
    out = cache_admin.clear(root)
    assert not path.exists() and not out["foreign"] and not out["failed"]


def test_clear_unused_since_removes_the_listings_unused_since_and_a_spec_clear_none(tmp_path, cli):
    """A listing is used when an open with the store up writes it, or one with the store down opens
    from it (note_use): `cache clear --unused-since` removes those unused since, like column sets;
    `--spec` names a column set, which a listing is not: it removes none."""
    import os

    from gpuload.cache.listings import note_use

    root, now = CacheRoot(tmp_path), time.time()
    for url in ("s3://b/old", "s3://b/used", "s3://b/new"):
        save_listing(root, url, PLACE, None, False, OBJECTS)
    for url in ("s3://b/old", "s3://b/used"):  # listed 40 days ago
        os.utime(_path(tmp_path, url), (now - 40 * 86400, now - 40 * 86400))
    note_use(root, "s3://b/used", PLACE)  # opened from it with the store down just now
    assert _path(tmp_path, "s3://b/used").stat().st_mtime >= now - 1
    with pytest.raises(Exception, match="names no column set"):
        cache_admin.clear(root, spec="abcd")
    assert all(_path(tmp_path, u).exists() for u in ("s3://b/old", "s3://b/used", "s3://b/new"))
    out = cli("cache", "clear", "--unused-since", "30d", "--cache-dir", str(tmp_path)).stdout
    assert "1 files" in out
    assert not _path(tmp_path, "s3://b/old").exists()
    assert _path(tmp_path, "s3://b/used").exists() and _path(tmp_path, "s3://b/new").exists()
    note_use(CacheRoot(tmp_path / "absent"), "s3://b/x", PLACE)  # nothing to mark: no error
