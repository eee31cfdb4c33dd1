"""A fully cached remote source opens while its store is down, from the listing kept at its last
open; anything that would need the store is refused with the listing's error and what is missing.
Against a real S3-protocol server (moto) on loopback, stopped for real."""

from __future__ import annotations

import logging
import os
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload import SourceError
from gpuload.cache.fs import CacheRoot
from gpuload.cache.listings import load_listing, save_listing
from gpuload.sources import offline
from gpuload.sources.remote import ObjectInfo, Store, store_for
from gpuload.sources.retry import Unreachable

pytest.importorskip("moto")
pytest.importorskip("s3fs")
from gpuload.testing import S3Server  # noqa: E402

FAST = {"retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 5.0}
ROWS = 1000  # per file


def _upload(s3, folder, files: int, bucket: str) -> None:
    folder.mkdir(exist_ok=True)
    for i in range(files):
        x = np.arange(i * ROWS, (i + 1) * ROWS)
        pq.write_table(pa.table({"x": x, "y": (x * 3).astype(np.float32)}), folder / f"p{i}.parquet",
                       row_group_size=250)
    s3.upload_folder(folder, bucket, "data/")


def _open(so, cache, bucket: str, columns=("x",), **remote):
    return gpuload.ParquetDataset(f"s3://{bucket}/data/", list(columns), batch_size=128, cache_dir=cache, device="cpu",
                                  storage_options=so, remote=FAST | remote, chunk_bytes=4096)


def _kept(cache, bucket, so):
    """The listing kept in ``cache`` for the test's prefix at the store ``so`` configures."""
    return load_listing(CacheRoot(cache), f"s3://{bucket}/data", offline.place(store_for(f"s3://{bucket}/", None, so)))


def _xs(ds) -> np.ndarray:
    return np.sort(np.concatenate([b["x"].numpy() for b in ds]))


@pytest.fixture
def bucket() -> str:
    """A bucket name of the test's own (moto's buckets outlive its servers, in this process)."""
    return f"b{uuid.uuid4().hex[:12]}"


@pytest.fixture
def down(tmp_path, bucket):
    """A cache whose source (3 objects) was read whole through one epoch of column x, and the storage
    options of its store, which is then stopped (its port refuses connections)."""
    with S3Server() as s3:
        _upload(s3, tmp_path / "src", 3, bucket)
        ds = _open(s3.storage_options, tmp_path / "cache", bucket)
        assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
        ds.close()
        so = s3.storage_options
    return so, tmp_path / "cache"


def test_a_fully_cached_source_opens_and_trains_while_its_store_is_down(down, bucket, caplog):
    so, cache = down
    (listing,) = (cache / "v3" / "vocab").glob("*.listing")
    before = time.time()
    os.utime(listing, (before - 86400, before - 86400))  # last listed a day ago
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        ds = _open(so, cache, bucket)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"s3://{bucket}/data: the store cannot be reached" in said and "no connection to the store" in said
    assert "opened from the listing kept at the last open (" in said and " ago, 3 objects), every chunk cached" in said
    assert listing.stat().st_mtime >= before - 1  # marked used: `cache clear --unused-since` keeps it
    for epoch in (0, 1):  # every row once, in the order of a dataset opened with the store up
        ds.set_epoch(epoch)
        assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    assert ds.reader.counters.decoded == 0 and ds.stats().remote.requests == 0
    ds.close()


def test_a_partly_cached_source_is_refused_naming_what_needs_the_store(down, bucket, caplog):
    so, cache = down
    with caplog.at_level(logging.WARNING, logger="gpuload"), pytest.raises(
            SourceError, match=rf"s3://{bucket}/data/: listing: failed 3 times.*no connection to the store.*the "
                               r"listing kept at the last open \(\d+ s ago, 3 objects\) would open it, but 12 of the "
                               r"dataset's 12 chunks are not cached, and reading them needs the store"):
        _open(so, cache, bucket, columns=("x", "y"))  # another column set: its chunks were never cached
    assert "opened from the listing" not in caplog.text
    ds = _open(so, cache, bucket)  # the refusal cost the cached column set nothing
    assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    ds.close()


def test_a_listing_kept_too_long_or_not_wanted_gives_the_stores_error(down, bucket, monkeypatch):
    so, cache = down
    with pytest.raises(SourceError, match=r"listing: failed 3 times.*no connection to the store") as refused:
        _open(so, cache, bucket, kept_listing_s=0)
    assert "kept" not in str(refused.value)
    later = time.time() + 2 * 3600 + 300
    monkeypatch.setattr(offline.time, "time", lambda: later)  # a virtual clock: the listing 2 h 5 min old
    with pytest.raises(SourceError, match=rf"the listing of s3://{bucket}/data kept from its last open is 2 h 5 min old, more than remote "
                                          r"kept_listing_s=3600 s allows"):
        _open(so, cache, bucket, kept_listing_s=3600)
    monkeypatch.setenv("GPULOAD_REMOTE_KEPT_LISTING_S", "3600")
    with pytest.raises(SourceError, match=r"2 h 5 min old, more than remote kept_listing_s=3600 s allows"):
        _open(so, cache, bucket)  # the variable's limit
    ds = _open(so, cache, bucket, kept_listing_s=36000)  # the argument's, over the variable's
    assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    ds.close()


def test_each_open_with_the_store_up_keeps_its_new_listing(tmp_path, bucket):
    with S3Server() as s3:
        _upload(s3, tmp_path / "src", 2, bucket)
        _open(s3.storage_options, tmp_path / "cache", bucket).close()
        first = _kept(tmp_path / "cache", bucket, s3.storage_options)
        assert [o[0] for o in first.objects] == [f"{bucket}/data/p0.parquet", f"{bucket}/data/p1.parquet"]
        _upload(s3, tmp_path / "src", 3, bucket)  # an object added
        ds = _open(s3.storage_options, tmp_path / "cache", bucket)
        assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
        ds.close()
        so = s3.storage_options
    kept = _kept(tmp_path / "cache", bucket, so)
    assert len(kept.objects) == 3 and kept.at >= first.at and kept.base == f"{bucket}/data" and not kept.table
    ds = _open(so, tmp_path / "cache", bucket)  # the store down: the latest listing, all three objects
    assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    ds.close()


class _Down(Store):
    """A store whose every listing fails with a refused connection."""

    def expand(self, item):
        raise ConnectionRefusedError(111, "Connection refused")


def _down_store():
    import fsspec

    return _Down(fsspec.filesystem("memory"), "s3")


def test_a_kept_delta_tables_listing_is_not_used_without_its_log(tmp_path):
    root = CacheRoot(tmp_path / "cache")
    objects = [ObjectInfo("b/t/part-0.parquet", 10, 5, "e1")]
    where = offline.place(_down_store())
    save_listing(root, "s3://b/t", where, "b/t", True, objects)
    found: list = []
    with pytest.raises(Unreachable, match=r"s3://b/t: listing: failed 1 times.*is a Delta table's, which opens only "
                                          r"from its log"):
        offline.list_item(_down_store(), "s3://b/t", gpuload.RemoteSettings(**FAST | {"retries": 0}), root, found)
    save_listing(root, "s3://b/t", where, "b/t", False, objects)
    infos, base, tables = offline.list_item(_down_store(), "s3://b/t", gpuload.RemoteSettings(**FAST | {"retries": 0}),
                                            root, found)
    assert infos == objects and base == "b/t" and tables is None
    assert [o.url for o in found] == ["s3://b/t"] and "Connection refused" in found[0].error


def test_errors_that_are_not_the_stores_absence_are_raised_as_they_are(tmp_path):
    root = CacheRoot(tmp_path / "cache")
    save_listing(root, "s3://b/t", offline.place(_down_store()), None, False, [ObjectInfo("b/t", 10, 5, "e1")])

    class Gone(Store):
        def expand(self, item):
            raise FileNotFoundError(item)

    import fsspec

    with pytest.raises(SourceError, match="FileNotFoundError.*the object is gone"):  # a 404 is an answer
        offline.list_item(Gone(fsspec.filesystem("memory"), "s3"), "s3://b/t", gpuload.RemoteSettings(**FAST), root,
                          [])


def test_an_http_folder_opens_while_its_server_is_down(tmp_path, caplog):
    from gpuload.testing import HttpServer

    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"x": np.arange(i * ROWS, (i + 1) * ROWS)}), folder / f"p{i}.parquet",
                       row_group_size=250)
    with HttpServer(folder) as srv:
        url = srv.url("")
        kw = dict(batch_size=128, cache_dir=tmp_path / "cache", device="cpu", remote=FAST, chunk_bytes=4096)
        ds = gpuload.ParquetDataset(url, ["x"], **kw)
        assert np.array_equal(_xs(ds), np.arange(2 * ROWS))
        ds.close()
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        ds = gpuload.ParquetDataset(url, ["x"], **kw)
    assert "the store cannot be reached" in caplog.text and " ago, 2 objects), every chunk cached" in caplog.text
    assert np.array_equal(_xs(ds), np.arange(2 * ROWS)) and ds.stats().remote.requests == 0
    ds.close()


def test_the_same_bucket_at_another_endpoint_does_not_open_from_the_listing(down, bucket):
    so, cache = down
    wrong = so | {"client_kwargs": so["client_kwargs"] | {"endpoint_url": "http://127.0.0.1:1"}}  # a typo'd port
    with pytest.raises(SourceError, match="no connection to the store") as refused:
        _open(wrong, cache, bucket)
    assert "kept" not in str(refused.value)
    rotated = so | {"key": "other-key", "secret": "other-secret"}  # credentials are not the store's place
    ds = _open(rotated, cache, bucket)
    assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    ds.close()


def test_a_store_down_is_tried_once_per_open_however_many_items_name_it(tmp_path, bucket, monkeypatch, caplog):
    with S3Server() as s3:
        _upload(s3, tmp_path / "src", 3, bucket)
        items = [f"s3://{bucket}/data/p{i}.parquet" for i in range(3)]
        kw = dict(batch_size=128, cache_dir=tmp_path / "cache", device="cpu", storage_options=s3.storage_options,
                  chunk_bytes=4096)
        ds = gpuload.ParquetDataset(items, ["x"], remote=FAST, **kw)
        assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
        ds.close()
    tries = []
    real = Store.expand
    monkeypatch.setattr(Store, "expand", lambda self, item: tries.append(item) or real(self, item))
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        ds = gpuload.ParquetDataset(items, ["x"], remote=FAST, **kw)
    assert tries == [items[0]] * 3  # the first item's 3 tries; the others' store is known down
    assert caplog.text.count("the store cannot be reached") == 1
    assert "(3 items of the source, the oldest " in caplog.text and " ago, 3 objects), every chunk cached" in caplog.text
    assert np.array_equal(_xs(ds), np.arange(3 * ROWS))
    ds.close()


def test_one_chunk_missing_is_enough_to_refuse(down, bucket):
    so, cache = down
    chunk = sorted(cache.rglob("*.glc"))[5]
    chunk.unlink()
    with pytest.raises(SourceError, match=r"1 of the dataset's 6 chunks is not cached, and reading them needs the "
                                          r"store"):
        _open(so, cache, bucket)


def test_a_damaged_kept_listing_is_named_not_used(down, bucket):
    so, cache = down
    (path,) = cache.rglob("*.listing")
    path.write_bytes(path.read_bytes()[:-1] + b" ")
    with pytest.raises(SourceError, match=rf"no connection to the store.*the listing kept for s3://{bucket}/data "
                                          r"cannot be used \(checksum mismatch\): `gpuload cache verify` names the file"):
        _open(so, cache, bucket)


def test_no_listing_is_kept_where_it_could_never_be_used(tmp_path, bucket):
    with S3Server() as s3:
        _upload(s3, tmp_path / "src", 1, bucket)
        _open(s3.storage_options, tmp_path / "a", bucket, kept_listing_s=0).close()
        ds = gpuload.ParquetDataset(f"s3://{bucket}/data/", ["x"], batch_size=128, cache_dir=tmp_path / "b",
                                    device="cpu", storage_options=s3.storage_options, remote=FAST, cache_io="off")
        ds.close()
        _open(s3.storage_options, tmp_path / "c", bucket).close()
    assert not list((tmp_path / "a").rglob("*.listing")) and not list((tmp_path / "b").rglob("*.listing"))
    assert len(list((tmp_path / "c").rglob("*.listing"))) == 1


def test_a_stores_place_leaves_out_credentials_and_tuning():
    import s3fs

    def place(**options):
        return offline.place(Store(s3fs.S3FileSystem(skip_instance_cache=True, **options), "s3"))

    base = place(key="k1", secret="s1", client_kwargs={"endpoint_url": "http://a:1", "region_name": "r"})
    assert "k1" not in base and "s1" not in base and "http://a:1" in base
    assert place(key="k2", secret="s2", token="t", client_kwargs={"endpoint_url": "http://a:1", "region_name": "r",
                                                                  "aws_session_token": "x"},
                 config_kwargs={"read_timeout": 3}) == base
    assert place(client_kwargs={"endpoint_url": "http://a:2", "region_name": "r"}) != base
    assert place(client_kwargs={"endpoint_url": "http://a:1", "region_name": "other"}) != base


def test_a_remote_objects_footer_copy_is_fsynced_where_a_local_files_is_not(tmp_path, bucket, monkeypatch):
    """An offline open (the store down) has no footer but the cache's copy: a remote object's copy is
    fsynced, as its listing is (a crash of the machine could otherwise leave it torn, and the open
    refused); a local file's copy, read again from the file when lost, is not (a8d29eb)."""
    from gpuload.cache import fs

    synced, real = [], os.fsync
    monkeypatch.setattr(fs.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    with S3Server() as s3:
        _upload(s3, tmp_path / "src", 2, bucket)
        _open(s3.storage_options, tmp_path / "remote", bucket).close()
    assert len([p for p in synced if p.endswith(".footer") or ".footer.tmp." in p]) >= 2, synced
    del synced[:]
    gpuload.ParquetDataset(tmp_path / "src", ["x"], batch_size=128, cache_dir=tmp_path / "local", device="cpu")
    assert list((tmp_path / "local").rglob("*.footer")) and not [p for p in synced if ".footer" in p]
