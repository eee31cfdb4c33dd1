"""Cache paths: the default cache folder, making or refusing a cache folder, chunk file names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gpuload
from gpuload.cache.chunkfile import LAYOUT_DIR, Identity
from gpuload.cache.paths import ChunkKey, cache_folder, default_cache_dir
from gpuload.cache.store import ChunkCache


def test_default_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPULOAD_CACHE_DIR", "~/here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == Path("~/here").expanduser()
    monkeypatch.setenv("GPULOAD_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "xdg" / "gpuload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "gpuload"


def test_cache_folder_made_by_another_rank_meanwhile_is_used(tmp_path, monkeypatch):
    """Ranks starting together on a new cache folder: one that finds it missing, and then
    made by another rank before it makes it, uses it (it once said "is not a folder")."""
    root = tmp_path / "fresh"
    real = Path.is_dir

    def made_meanwhile(self):
        if self == root and not real(self):
            answer = False  # missing when looked at ...
            self.mkdir()  # ... and made by another rank right after
            return answer
        return real(self)

    monkeypatch.setattr(Path, "is_dir", made_meanwhile)
    assert ChunkCache(root).root.path == Path(os.path.realpath(root))
    monkeypatch.setattr(Path, "is_dir", real)
    (tmp_path / "file").write_text("")
    with pytest.raises(gpuload.CacheError, match="is not a folder"):
        ChunkCache(tmp_path / "file")
    with pytest.raises(gpuload.CacheError, match="does not exist"):
        ChunkCache(tmp_path / "missing", create=False)


def test_cache_folder_makes_a_missing_one_and_its_parents(tmp_path):
    assert cache_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    assert cache_folder(tmp_path / "a" / "b", create=False) == tmp_path / "a" / "b"


def test_chunk_key_names_and_identity():
    key = ChunkKey("/data/x.parquet", 10, 20, "0123456789abcdef", 3, 5, 7, (("a", "scalar", "<i8", 1),), ["d"])
    assert key.name == f"0123456789abcdef-{key.version}-3-5.glc" and len(key.version) == 16
    assert key.parts == (LAYOUT_DIR, key.folder) and key.relpath() == f"{LAYOUT_DIR}/{key.folder}/{key.name}"
    assert key.identity == Identity("/data/x.parquet", 10, 20, 3, 5, 7, "0123456789abcdef",
                                    (("a", "scalar", "<i8", 1),), "")
    assert key.header_fields() == {"source": {"path": "/data/x.parquet", "size": 10, "mtime_ns": 20},
                                   "row_groups": [3, 5], "spec": ["d"]}
    tagged = ChunkKey("/data/x.parquet", 10, 20, "0123456789abcdef", 3, 5, 7, tag="etag-1")
    assert tagged.version != key.version and tagged.folder == key.folder  # another version, the same folder
    assert tagged.header_fields()["source"]["tag"] == "etag-1"
    assert ChunkKey("/data/x.parquet", 10, 20, "0123456789abcdef", 3, 5, 7, spec_desc=["other"]) == \
        ChunkKey("/data/x.parquet", 10, 20, "0123456789abcdef", 3, 5, 7)  # the description is not compared
