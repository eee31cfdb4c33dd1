"""Footers kept in the cache: trusted only when they check out; listed, verified and cleared."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from gpuload.cache import admin as cache_admin
from gpuload.cache.fs import CacheRoot
from gpuload.cache.footers import footer_name, load_footer

from conftest import open_dataset


def _dataset(tmp_path, cache):
    if not (tmp_path / "a.parquet").exists():
        pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "a.parquet", row_group_size=30)
    return open_dataset(tmp_path / "a.parquet", cache=cache, batch_size=10)


def _footer_files(cache):
    return sorted(cache.rglob("*.footer"))


def test_a_damaged_footer_file_is_ignored_and_rewritten(tmp_path):
    cache = tmp_path / "cache"
    ds = _dataset(tmp_path, cache)
    assert ds.reader.open_counts == {"footers_cached": 0, "footers_read": 1}
    (path,) = _footer_files(cache)
    good = path.read_bytes()
    for bad in (good[:-3], good[:30] + bytes([good[30] ^ 1]) + good[31:], b"", b"GPULFTR\0" + b"\xff" * 40):
        path.write_bytes(bad)
        ds = _dataset(tmp_path, cache)
        assert ds.reader.open_counts == {"footers_cached": 0, "footers_read": 1}
        assert path.read_bytes() == good
        assert sorted(int(v) for b in ds for v in b["x"]) == list(range(100))


def test_a_footer_under_another_files_name_is_not_served(tmp_path):
    cache = tmp_path / "cache"
    f = _dataset(tmp_path, cache).reader.files[0]
    root = CacheRoot(cache)
    kept = f"ctime:{f.ctime_ns}"  # a local file's footer is kept under its ctime too
    assert load_footer(root, f.path, f.size, f.mtime_ns, kept) is not None
    assert load_footer(root, f.path, f.size + 1, f.mtime_ns, kept) is None  # another version of the file
    assert load_footer(root, f.path, f.size, f.mtime_ns, f"ctime:{f.ctime_ns + 1}") is None  # written since
    assert load_footer(root, f.path, f.size, f.mtime_ns, tag="etag") is None
    (path,) = _footer_files(cache)
    path.rename(path.with_name(footer_name(f.size, f.mtime_ns + 1, kept)))  # copied under another version's name
    assert load_footer(root, f.path, f.size, f.mtime_ns + 1, kept) is None


def test_cache_info_verify_and_clear_know_footers(tmp_path):
    cache = tmp_path / "cache"
    ds = _dataset(tmp_path, cache)
    sum(1 for _ in ds)
    ds.reader.cache.flush()
    root = CacheRoot(cache)
    s = cache_admin.summary(root)
    assert s["footers"] == 1 and not s["foreign"]
    assert cache_admin.verify_all(root) == []
    (path,) = _footer_files(cache)
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    (bad,) = cache_admin.verify_all(root)
    assert bad.path == path and bad.kind == "corrupt" and "checksum" in bad.problem
    spec = next(iter(cache_admin.specs(root)))
    cache_admin.clear(root, spec=spec)  # a column set's clear keeps the footers: every set uses them
    assert _footer_files(cache) == [path]
    out = cache_admin.clear(root)
    assert _footer_files(cache) == [] and not out["foreign"] and not out["failed"]


def test_footers_are_not_fsynced_and_chunk_files_are(tmp_path, monkeypatch):
    """A footer's copy is only a shortcut (checked whole on read, read from the source again when a
    crash lost or tore it: the test above), so it is written without fsync, which cost a cold open of
    1,500 small files a second here; the chunk files an epoch writes, and their folders, still are."""
    import os

    from gpuload.cache import fs

    synced = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    real = os.fsync
    monkeypatch.setattr(fs.os, "fsync", fsync)
    cache = tmp_path / "cache"
    ds = _dataset(tmp_path, cache)
    assert _footer_files(cache) and not [p for p in synced if ".footer" in p]
    assert sorted(int(v) for b in ds for v in b["x"]) == list(range(100))
    ds.reader.cache.flush()
    chunks = sorted(str(p.parent) for p in cache.rglob("*.glc"))
    assert chunks and all(any(".glc.tmp." in p and p.startswith(c) for p in synced) for c in chunks)
    assert set(chunks) <= set(synced)  # and each chunk's folder, after the rename
