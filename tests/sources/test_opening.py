"""Opening: a footer (and a chunk) is kept only under the identity its file had while it
was read, so a file changed after its listing and later restored to the listed identity
(``cp -p``, ``rsync -a``, a re-upload) is never decoded with the footer of other bytes."""

from __future__ import annotations

import os
import shutil
import uuid

import numpy as np
import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import gpuload
import gpuload.decode
import gpuload.reader

from conftest import dataset_factory, write_parquet

N = 300


def _pair(folder):
    """Two files of one size whose columns hold each other's values: read with the other's
    footer, column ``a`` would give ``b``'s bytes."""
    a = write_parquet(folder / "a.parquet", pa.table({"a": np.arange(N, dtype=np.int64),
                                                      "b": np.arange(N, dtype=np.int64) + 10**6}),
                      compression="none", use_dictionary=False, write_statistics=False)
    b = write_parquet(folder / "swap" / "a.parquet", pa.table({"b": np.arange(N, dtype=np.int64) + 10**6,
                                                               "a": np.arange(N, dtype=np.int64)}),
                      compression="none", use_dictionary=False, write_statistics=False)
    assert a.stat().st_size == b.stat().st_size
    return a, b


def _values(ds, name="a"):
    return np.concatenate([b[name].numpy() for b in ds])


_ds = dataset_factory(["a"], shuffle=False, batch_size=100)


def test_a_file_changed_between_listing_and_footer_read_then_restored_is_read_right(tmp_path, monkeypatch):
    a, other = _pair(tmp_path)
    keep = tmp_path / "keep.parquet"
    shutil.copy2(a, keep)  # the listed version, with its mtime
    listed = gpuload.reader.list_files

    def list_then_change(*args, **kw):
        out = listed(*args, **kw)
        shutil.copyfile(other, a)  # rewritten after the listing, before its footer is read
        os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
        return out

    monkeypatch.setattr(gpuload.reader, "list_files", list_then_change)
    np.testing.assert_array_equal(_values(_ds(a, tmp_path / "cache")), np.arange(N))  # the version it read: right too
    monkeypatch.undo()
    shutil.copy2(keep, a)  # restored: the listed size and mtime again
    np.testing.assert_array_equal(_values(_ds(a, tmp_path / "cache")), np.arange(N))


def test_a_file_changed_while_a_chunk_is_read_is_not_cached(tmp_path, monkeypatch):
    a, other = _pair(tmp_path)
    keep = tmp_path / "keep.parquet"
    shutil.copy2(a, keep)
    read = gpuload.decode.read_columns

    def read_then_change(*args, **kw):
        table = read(*args, **kw)
        shutil.copyfile(other, a)  # written while the chunk was being read ...
        shutil.copystat(keep, a)  # ... and its mtime set back, as cp -p would
        return table

    ds = _ds(a, tmp_path / "cache")
    monkeypatch.setattr(gpuload.decode, "read_columns", read_then_change)
    with pytest.raises(gpuload.SourceError, match="changed or disappeared while a chunk was read"):
        list(ds)
    monkeypatch.undo()
    shutil.copy2(keep, a)
    again = _ds(a, tmp_path / "cache")
    np.testing.assert_array_equal(_values(again), np.arange(N))
    assert again.reader.counters.decoded == len(again.reader.chunks)  # nothing was cached from the bad read


class _SameETag(MemoryFileSystem):
    """An object store whose ETag does not follow the content (a constant), as some gateways give."""

    protocol = "etagmem"

    def info(self, path, **kw):
        return {**super().info(path, **kw), "ETag": '"constant"'}

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kw):
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kw)
        found = {k: {**v, "ETag": '"constant"'} for k, v in found.items()}
        return found if detail else sorted(found)


def test_a_rewritten_object_whose_etag_does_not_change_is_told_by_its_time(tmp_path):
    a, other = _pair(tmp_path)
    fs = _SameETag()
    key = f"/{uuid.uuid4().hex}/a.parquet"
    fs.pipe(key, a.read_bytes())
    ds = gpuload.ParquetDataset(key, ["a"], filesystem=fs, cache_dir=tmp_path / "c", device="cpu",
                                shuffle=False, batch_size=100)
    fs.pipe(key, other.read_bytes())  # same size, same ETag, a later creation time
    with pytest.raises(gpuload.SourceError, match="changed after the dataset was opened"):
        list(ds)
    assert not list((tmp_path / "c").rglob("*.glc"))


def test_an_object_rewritten_between_listing_and_footer_read_is_read_as_its_new_version(tmp_path, monkeypatch):
    a, other = _pair(tmp_path)
    fs = _SameETag()
    key = f"/{uuid.uuid4().hex}/a.parquet"
    fs.pipe(key, a.read_bytes())
    listed = gpuload.reader.list_files

    def list_then_change(*args, **kw):
        out = listed(*args, **kw)
        fs.pipe(key, other.read_bytes())
        return out

    monkeypatch.setattr(gpuload.reader, "list_files", list_then_change)
    ds = gpuload.ParquetDataset(key, ["a"], filesystem=fs, cache_dir=tmp_path / "c", device="cpu", shuffle=False,
                                batch_size=100)
    np.testing.assert_array_equal(_values(ds), np.arange(N))
    assert ds.reader.files[0].mtime_ns == int(fs.info(key)["created"].timestamp() * 1e9)  # the version read


def test_same_version_counts_every_field_and_tolerates_whole_second_times():
    from gpuload.sources.remote import same_version

    t = 1_700_000_000_123_000_000
    assert same_version((10, t, "e"), (10, t, "e"))
    assert same_version((10, t, "e"), (10, t // 10**9 * 10**9, "e"))  # HEAD's whole seconds vs a listing's ms
    assert not same_version((10, t, "e"), (10, t + 1_000_000, "e"))  # both precise: a millisecond counts
    assert not same_version((10, t, "e"), (10, t + 10**9, "e"))  # the ETag alone does not decide
    assert not same_version((10, t, "e"), (11, t, "e")) and not same_version((10, t, "e"), (10, t, "f"))
    assert same_version((10, 0, "e"), (10, t, "e"))  # no time given once: size and marker decide
