"""Integration tests of the chunk cache: file format, corruption, invalidation, cache
keys, atomic writes, concurrent builders, stale locks and the size budget.

Everything runs on the CPU with small data (tens of thousands of rows, 64 KiB chunks,
so a dataset has tens of chunks). Multi-process tests start children with
``subprocess`` (``python -c``), never ``fork``.
"""

from __future__ import annotations

import json
import re
import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload.batch import Ragged
from gpuload.cache.chunkfile import read_chunk, write_chunk

from conftest import dataset_factory, python, spawn, spawn_warm
from clicklog import CHILD_TIMEOUT, COLUMNS, Reference, check_epoch, clicklog, key_for, sample_cols, wait_for

CHUNK_BYTES = 64 << 10
PREFIX = struct.Struct("<8sIIQ")  # magic, format version, header length, header checksum
ALIGN = 4096


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

_dataset = dataset_factory(COLUMNS, batch_size=997, chunk_bytes=CHUNK_BYTES)


def _header(path):
    raw = Path(path).read_bytes()
    magic, version, hlen, _ = PREFIX.unpack_from(raw)
    return json.loads(raw[PREFIX.size:PREFIX.size + hlen]), raw


def _corrupt(path, how: str) -> None:
    header, raw = _header(path)
    data = [r for r in header["regions"] if r["nbytes"] > 0]
    b = bytearray(raw)
    if how == "flip":
        r = data[len(data) // 2]
        b[r["offset"] + r["nbytes"] // 2] ^= 0x5A
    elif how == "truncate":
        last = max(data, key=lambda r: r["offset"])
        b = b[:last["offset"] + last["nbytes"] // 2]
    elif how == "magic":
        b[0:8] = b"NOTGPULD"
    else:
        raise AssertionError(how)
    Path(path).write_bytes(bytes(b))


def _entries(cache) -> list[Path]:
    return sorted(Path(cache).rglob("*.glc"))


def _cache_bytes(cache) -> int:
    return sum(p.stat().st_size for p in _entries(cache))


def _spawn(script, *args, fresh: bool = False):
    """``python -c script *args``, forked with torch imported (conftest's ``spawn_warm``), or ``fresh``:
    a new interpreter, started and ended as a user's (a GPU context made and torn down in it)."""
    return spawn(python(script, *args)) if fresh else spawn_warm(script, *args)


@pytest.fixture(scope="module")
def click(tmp_path_factory):
    """3 files, 6000 rows, 500-row row groups: 12 chunks of one row group each."""
    d = tmp_path_factory.mktemp("click")
    files = clicklog(d)
    return d, files, Reference(files)


# ---------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------

def _assert_same_cols(got, want):
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, Ragged):
            assert isinstance(g, Ragged), k
            for gp, wp in ((g.values, w.values), (g.offsets, w.offsets)):
                assert gp.dtype == wp.dtype and gp.shape == wp.shape
                np.testing.assert_array_equal(gp, wp)
        else:
            assert not isinstance(g, Ragged), k
            assert g.dtype == w.dtype and g.shape == w.shape, k
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("rows", [1000, 1, 0, 4097])
def test_write_read_round_trip(tmp_path, rows):
    cols = sample_cols(rows)
    path = tmp_path / "sub" / "chunk.glc"
    size = write_chunk(path, cols, key_for(cols))
    assert size == path.stat().st_size
    header, got = read_chunk(path)
    assert header["rows"] == rows
    _assert_same_cols(got, cols)
    # the arrays are a private mapping: changing them in place never changes the file
    before = path.read_bytes()
    for v in got.values():
        for a in (v if isinstance(v, Ragged) else (v,)):
            a[...] = 0
    assert path.read_bytes() == before
    _assert_same_cols(read_chunk(path)[1], cols)
    # nothing but the final file is left in the folder
    assert sorted(p.name for p in path.parent.iterdir()) == ["chunk.glc"]


@pytest.mark.parametrize("ncols", [1, 6, 80])  # 80 outputs: the header is larger than 4 KiB
def test_regions_aligned_and_header_is_json(tmp_path, ncols):
    rng = np.random.default_rng(1)
    cols = {f"c{i}": rng.integers(0, 9, 1000 + 37 * i).astype([np.int8, np.int32, np.float64][i % 3])
            for i in range(ncols)}
    cols["rag"] = Ragged(np.arange(123, dtype=np.int64), np.array([0, 100, 100, 123], np.int64))
    path = tmp_path / "c.glc"
    write_chunk(path, cols, key_for(cols))
    raw = path.read_bytes()
    assert len(raw) % ALIGN == 0
    magic, version, hlen, _ = PREFIX.unpack_from(raw)
    assert magic == b"GPULOAD\0"
    header = json.loads(raw[PREFIX.size:PREFIX.size + hlen].decode("utf-8"))  # JSON, not pickle
    assert b"\x80\x04\x95" not in raw[:PREFIX.size + hlen] and b"numpy" not in raw[:PREFIX.size + hlen]
    regions = header["regions"]
    assert {(r["output"], r["part"]) for r in regions} == (
        {(f"c{i}", "data") for i in range(ncols)} | {("rag", "values"), ("rag", "offsets")})
    end_of_header = PREFIX.size + hlen
    spans = []
    for r in regions:
        assert {"dtype", "shape", "offset", "nbytes", "xxh3"} <= set(r)
        assert r["offset"] % ALIGN == 0
        assert r["offset"] >= end_of_header
        assert r["offset"] + r["nbytes"] <= len(raw)
        assert np.dtype(r["dtype"]).itemsize * int(np.prod(r["shape"])) == r["nbytes"]
        spans.append((r["offset"], r["offset"] + r["nbytes"]))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "regions overlap"
    _, got = read_chunk(path)
    _assert_same_cols(got, cols)


# ---------------------------------------------------------------------------------------
# corruption
# ---------------------------------------------------------------------------------------

@pytest.fixture
def chunk_file(tmp_path):
    cols = sample_cols(3000)
    path = tmp_path / "chunk.glc"
    write_chunk(path, cols, key_for(cols))
    return path


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("region", ["a", "b", "flag", "h/values", "h/offsets"])
def test_flipped_byte_in_data_raises(chunk_file, region, where):
    header, raw = _header(chunk_file)
    name, _, part = region.partition("/")
    r = next(r for r in header["regions"] if r["output"] == name and r["part"] == (part or "data"))
    pos = r["offset"] + {"first": 0, "middle": r["nbytes"] // 2, "last": r["nbytes"] - 1}[where]
    b = bytearray(raw)
    b[pos] ^= 0x01
    chunk_file.write_bytes(bytes(b))
    said = f"output '{name}'" if not part else f"the {part} of list output '{name}'"
    with pytest.raises(gpuload.CorruptCacheError, match=re.escape(f"{chunk_file}: the bytes of {said} do not match")):
        read_chunk(chunk_file)


def test_a_corrupt_block_of_stacked_columns_is_named_by_its_type(tmp_path):
    """A row layout's block ("#<f4" in the file) is named in words (was "checksum mismatch in #<f4/data")."""
    cols = {"#<f4": np.ones((100, 3), np.float32), "y": np.arange(100)}
    path = tmp_path / "chunk.glc"
    write_chunk(path, cols, key_for(cols))
    header, raw = _header(path)
    r = next(r for r in header["regions"] if r["output"] == "#<f4")
    b = bytearray(raw)
    b[r["offset"]] ^= 0x01
    path.write_bytes(bytes(b))
    with pytest.raises(gpuload.CorruptCacheError, match="the bytes of the stacked float32 columns do not match"):
        read_chunk(path)


def test_flipped_byte_in_header_raises(chunk_file):
    header, raw = _header(chunk_file)
    b = bytearray(raw)
    b[PREFIX.size + 20] ^= 0x01
    chunk_file.write_bytes(bytes(b))
    with pytest.raises(gpuload.CorruptCacheError, match=str(chunk_file)):
        read_chunk(chunk_file)


@pytest.mark.parametrize("keep", ["empty", "prefix", "header", "data"])
def test_truncated_file_raises(chunk_file, keep):
    header, raw = _header(chunk_file)
    last = max(header["regions"], key=lambda r: r["offset"])
    n = {"empty": 0, "prefix": 10, "header": PREFIX.size + 30, "data": last["offset"] + last["nbytes"] - 1}[keep]
    chunk_file.write_bytes(raw[:n])
    with pytest.raises(gpuload.CorruptCacheError, match=str(chunk_file)):
        read_chunk(chunk_file)


@pytest.mark.parametrize("field", ["magic", "version"])
def test_bad_magic_or_version_raises(chunk_file, field):
    raw = bytearray(chunk_file.read_bytes())
    if field == "magic":
        raw[0:8] = b"PAR1\0\0\0\0"
    else:
        raw[8:12] = struct.pack("<I", 999)
    chunk_file.write_bytes(bytes(raw))
    with pytest.raises(gpuload.CorruptCacheError, match=str(chunk_file)):
        read_chunk(chunk_file)


@pytest.mark.parametrize("how", ["flip", "truncate", "magic"])
def test_dataset_rebuilds_corrupt_chunk(click, tmp_path, how):
    data, files, ref = click
    cache = tmp_path / "cache"
    ds = _dataset(data, cache, shuffle=True, prefetch=0)  # no read ahead of the corruption
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    n = len(ds.reader.chunks)
    assert len(_entries(cache)) == n
    victim = ds.reader.cache.path(ds.reader.key(n // 2))
    _corrupt(victim, how)
    with pytest.raises(gpuload.CorruptCacheError):
        read_chunk(victim)

    before = ds.reader.counters.decoded
    ds.set_epoch(1)
    check_epoch(ds, ref)  # exact values: the corrupt chunk was not served
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded - before == 1  # only the corrupt chunk was rebuilt
    _, cols = read_chunk(victim, verify=True)  # rebuilt and valid again
    assert len(cols["row_id"]) == ds.reader.chunks[n // 2].rows

    # a brand-new dataset reads everything from the cache
    ds2 = _dataset(data, cache, shuffle=False)
    check_epoch(ds2, ref)
    assert ds2.reader.counters.decoded == 0


@pytest.mark.parametrize("verify", [True, False])
def test_every_chunk_file_is_on_disk_before_it_has_its_name(click, tmp_path, monkeypatch, verify):
    """Whatever a later reader checks (verify_checksums=False checks no data), a power cut must leave
    each chunk whole or absent: every chunk file is fsynced while it still has its temporary name,
    on the two writer threads alike, and its folder after the rename."""
    data, files, ref = click
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    ds = _dataset(data, tmp_path / "cache", shuffle=True, verify_checksums=verify)
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    temps = [p for p in synced if ".glc.tmp." in p]
    assert len(temps) == len(ds.reader.chunks) == len(_entries(tmp_path / "cache")), synced


def _flip_keeping_stat(path) -> None:
    """Flip a data byte in place, keeping the file's size and mtime (like bit rot)."""
    st = os.stat(path)
    header, _ = _header(path)
    r = next(r for r in header["regions"] if r["nbytes"] > 0)
    with open(path, "r+b") as f:
        f.seek(r["offset"] + r["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_silent_corruption_after_verified_read(click, tmp_path):
    """A chunk corrupted without any change of size or mtime after it was verified:
    ``verify_checksums="always"`` catches it on the same dataset, and the default
    catches it on a newly opened dataset."""
    data, files, ref = click
    cache = tmp_path / "cache"
    ds = _dataset(data, cache, verify_checksums="always", prefetch=0)  # no read ahead of the corruption
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    ds.set_epoch(1)
    check_epoch(ds, ref)  # every file read (and verified) once
    victim = ds.reader.cache.path(ds.reader.key(3))
    _flip_keeping_stat(victim)
    before = ds.reader.counters.decoded
    ds.set_epoch(2)
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded - before == 1
    read_chunk(victim, verify=True)  # rebuilt

    # default verification: a new dataset object checks each file on its first read
    warm = _dataset(data, cache)
    check_epoch(warm, ref)
    _flip_keeping_stat(victim)
    fresh = _dataset(data, cache, seed=3)
    check_epoch(fresh, ref)
    fresh.reader.cache.flush()
    assert fresh.reader.counters.decoded == 1
    read_chunk(victim, verify=True)


def test_a_chunk_changed_in_place_with_its_mtime_restored_is_checked_again(click, tmp_path):
    """A helper's trial: bytes flipped in every chunk between two epochs of one dataset, each file's mtime put
    back, were served unchecked (verify-once knew a file by device, inode, size and mtime). Its ctime, which no
    program can set back, is part of what it knows now: the same dataset checks the file again and rebuilds it."""
    data, files, ref = click
    cache = tmp_path / "cache"
    ds = _dataset(data, cache, prefetch=0)  # no chunk read ahead of the change
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    ds.set_epoch(1)
    check_epoch(ds, ref)  # every file read from the cache, and checked, once
    victim = ds.reader.cache.path(ds.reader.key(3))
    _flip_keeping_stat(victim)
    before = ds.reader.counters.decoded
    ds.set_epoch(2)
    check_epoch(ds, ref)  # exact values: the changed file was not served
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded - before == 1
    read_chunk(victim, verify=True)  # rebuilt


def test_corrupt_chunk_with_source_gone_raises(tmp_path):
    data = tmp_path / "data"
    files = clicklog(data)
    ref = Reference(files)
    cache = tmp_path / "cache"
    ds = _dataset(data, cache, shuffle=False, num_threads=1, prefetch=0)  # no read ahead of the corruption
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    victim_chunk = next(i for i, c in enumerate(ds.reader.chunks) if c.file == 1)
    victim = ds.reader.cache.path(ds.reader.key(victim_chunk))
    _corrupt(victim, "flip")
    src = Path(files[1])
    src.unlink()
    got = []
    with pytest.raises(gpuload.GpuloadError) as info:
        for b in ds:
            got.append(b)
    assert src.name in str(info.value) or str(victim) in str(info.value)
    for b in got:  # what was delivered before the error is right
        ref.check(b)
    # the delivered rows stop before the corrupt chunk's rows
    delivered = sum(len(b["row_id"]) for b in got)
    assert delivered <= sum(c.rows for c in ds.reader.chunks[:victim_chunk])


# ---------------------------------------------------------------------------------------
# invalidation
# ---------------------------------------------------------------------------------------

def test_rewritten_source_file_invalidates_only_its_chunks(tmp_path):
    data = tmp_path / "data"
    files = clicklog(data, seed=0)
    cache = tmp_path / "cache"
    ds = _dataset(data, cache)
    check_epoch(ds, Reference(files))
    ds.reader.cache.flush()
    target = Path(files[1])
    target_chunks = [i for i, c in enumerate(ds.reader.chunks)
                     if ds.reader.files[c.file].path == str(target.resolve())]
    old_target = {ds.reader.cache.path(ds.reader.key(i)) for i in target_chunks}
    (target_folder,) = {p.parent for p in old_target}
    assert set(target_folder.glob("*.glc")) == old_target
    others = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _entries(cache) if p.parent != target_folder}
    assert old_target and others

    # same rows, different values and a different row-group layout
    other = clicklog(tmp_path / "other", seed=1, row_group_rows=300)
    old_mtime = target.stat().st_mtime_ns
    target.write_bytes(Path(other[1]).read_bytes())
    later = old_mtime + 5_000_000_000
    os.utime(target, ns=(later, later))
    new_ref = Reference(files)

    ds2 = _dataset(data, cache, prefetch=0)  # its loads counted: none for a next epoch
    check_epoch(ds2, new_ref)
    ds2.reader.cache.flush()
    n_target = sum(1 for c in ds2.reader.chunks if ds2.reader.files[c.file].path == str(target.resolve()))
    assert n_target > 0
    assert ds2.reader.counters.decoded == n_target
    assert ds2.reader.counters.from_cache == len(ds2.reader.chunks) - n_target
    # the old version's chunk files are gone; exactly the new ones are there
    assert not any(p.exists() for p in old_target)
    want = {ds2.reader.cache.path(ds2.reader.key(i)) for i, c in enumerate(ds2.reader.chunks)
            if ds2.reader.files[c.file].path == str(target.resolve())}
    assert set(target_folder.glob("*.glc")) == want
    # the other files' chunks were served, not rewritten
    for p, (ino, mtime) in others.items():
        assert p.exists() and (p.stat().st_ino, p.stat().st_mtime_ns) == (ino, mtime)
    # and the values really changed (the test is not vacuous)
    old_ref = Reference([*files[:1], *clicklog(tmp_path / "orig", seed=0)[1:2], *files[2:]])
    assert not np.array_equal(old_ref.dense, new_ref.dense)


def test_a_dataset_opened_before_its_file_changed_drops_none_of_the_new_versions_files(tmp_path):
    """A process whose view of a file is out of date fails to build that file's chunks (the file
    changed since it opened): the chunks and footer an up-to-date process cached meanwhile stay."""
    data = tmp_path / "data"
    files = clicklog(data, seed=0)
    cache = tmp_path / "cache"
    stale = _dataset(data, cache, prefetch=0)  # opened on the first version
    target = Path(files[1])
    later = target.stat().st_mtime_ns + 5_000_000_000
    target.write_bytes(Path(clicklog(tmp_path / "other", seed=1)[1]).read_bytes())
    os.utime(target, ns=(later, later))
    fresh = _dataset(data, cache)
    check_epoch(fresh, Reference(files))
    fresh.reader.cache.flush()
    folder = {fresh.reader.cache.path(fresh.reader.key(i)).parent for i, c in enumerate(fresh.reader.chunks)
              if fresh.reader.files[c.file].path == str(target.resolve())}.pop()
    kept = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))
    assert any(n.endswith(".glc") for n in kept) and any(n.endswith(".footer") for n in kept)
    fresh.close()
    with pytest.raises(gpuload.SourceError, match="changed"):
        for _ in stale:
            pass
    stale.close()
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) == kept


# ---------------------------------------------------------------------------------------
# cache key
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Columns a, b (float32, different values), c with nulls, l: list with a null list."""
    d = tmp_path_factory.mktemp("keyed")
    n = 4000
    rng = np.random.default_rng(7)
    c = rng.integers(0, 100, n).astype(np.int32)
    c_mask = rng.random(n) < 0.1
    lists = [None if i % 17 == 0 else list(range(i % 5)) for i in range(n)]
    t = pa.table({
        "row_id": pa.array(np.arange(n, dtype=np.int64)),
        "a": pa.array(rng.standard_normal(n).astype(np.float32)),
        "b": pa.array(rng.standard_normal(n).astype(np.float32)),
        "c": pa.array(c, mask=c_mask),
        "l": pa.array(lists, pa.list_(pa.int16())),
    })
    pq.write_table(t, d / "t.parquet", row_group_size=500)
    return d / "t.parquet", t


def _values(ds):
    out = {}
    for b in ds:
        for k, v in b.items():
            if isinstance(v, Ragged):
                out.setdefault(k + ".len", []).append(np.diff(v.offsets.numpy()))
                out.setdefault(k + ".val", []).append(v.values.numpy())
            else:
                out.setdefault(k, []).append(v.numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def _expected(t, columns, fill_nulls, dtypes):
    out = {}
    for name, src in columns.items():
        srcs = [src] if isinstance(src, str) else src
        arrs = []
        for s in srcs:
            fill = fill_nulls.get(s) if isinstance(fill_nulls, dict) else fill_nulls
            col = t[s].combine_chunks()
            if pa.types.is_list(col.type):
                if fill is not None:
                    col = pc.if_else(pc.is_null(col), pa.scalar([], col.type), col)
                out[name + ".len"] = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
                out[name + ".val"] = pc.list_flatten(col).to_numpy()
                break
            if fill is not None:
                col = pc.fill_null(col, fill)
            arrs.append(col.to_numpy())
        else:
            v = arrs[0] if isinstance(src, str) else np.stack(arrs, axis=1)
            if dtypes and name in dtypes:
                v = v.astype(dtypes[name])
            out[name] = v
    return out


KEY_VARIANTS = {
    "column": (dict(columns={"x": "a", "row_id": "row_id"}), dict(columns={"x": "b", "row_id": "row_id"})),
    "group_order": (dict(columns={"x": ["a", "b"], "row_id": "row_id"}),
                    dict(columns={"x": ["b", "a"], "row_id": "row_id"})),
    "dtype": (dict(columns={"x": "a", "row_id": "row_id"}, dtypes={"x": "float64"}),
              dict(columns={"x": "a", "row_id": "row_id"}, dtypes={"x": "float16"})),
    "fill": (dict(columns={"x": "c", "row_id": "row_id"}, fill_nulls={"c": 0}),
             dict(columns={"x": "c", "row_id": "row_id"}, fill_nulls={"c": -1})),
    "list_fill": (dict(columns={"x": "l", "row_id": "row_id"}, fill_nulls={"l": 0}),
                  dict(columns={"x": "l", "row_id": "row_id"}, fill_nulls={"l": 3})),
}


@pytest.mark.parametrize("variant", list(KEY_VARIANTS))
def test_cache_key_separates_specs(keyed, tmp_path, variant):
    path, table = keyed
    cache = tmp_path / "cache"
    sets = []
    for spec in KEY_VARIANTS[variant]:
        kw = dict(spec)
        columns = kw.pop("columns")
        ds = gpuload.ParquetDataset(path, columns, cache_dir=cache, batch_size=333, shuffle=False,
                                    chunk_bytes=8192, device="cpu", **kw)
        got = _values(ds)
        ds.reader.cache.flush()
        assert ds.reader.counters.decoded == len(ds.reader.chunks) > 1  # nothing served from the other spec
        want = _expected(table, columns, kw.get("fill_nulls"), kw.get("dtypes"))
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        sets.append({ds.reader.cache.path(ds.reader.key(i)) for i in range(len(ds.reader.chunks))})
        # served from the cache the second time, still with its own values
        again = gpuload.ParquetDataset(path, columns, cache_dir=cache, batch_size=333, shuffle=False,
                                       chunk_bytes=8192, device="cpu", **kw)
        got2 = _values(again)
        assert again.reader.counters.decoded == 0
        for k in want:
            np.testing.assert_array_equal(got2[k], want[k], err_msg=k)
    assert not sets[0] & sets[1]
    assert set(_entries(cache)) == sets[0] | sets[1]
    # the first spec still reads its own values after the second was cached
    kw = dict(KEY_VARIANTS[variant][0])
    columns = kw.pop("columns")
    ds = gpuload.ParquetDataset(path, columns, cache_dir=cache, batch_size=333, shuffle=False,
                                chunk_bytes=8192, device="cpu", **kw)
    got = _values(ds)
    assert ds.reader.counters.decoded == 0
    want = _expected(table, columns, kw.get("fill_nulls"), kw.get("dtypes"))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ---------------------------------------------------------------------------------------
# atomicity: builders killed mid-write
# ---------------------------------------------------------------------------------------

KILLED_WRITER = r"""
import os, sys, time
import numpy as np
import gpuload, gpuload.cache.store as gcache, gpuload.cache.fs as cfs
from gpuload.batch import Ragged
data, cache, ready, mode, columns = sys.argv[1:6]
import json
real_encode = gcache.encode

def tampered(cols):
    out = {}
    for k, v in cols.items():
        if isinstance(v, Ragged):
            out[k] = Ragged(v.values + 1, v.offsets)
        else:
            out[k] = (v + 1).astype(v.dtype)
    return out

real_write = cfs.CacheRoot.write

def write_then_die(self, parts, name, fill, durable=True):
    if not name.endswith(".glc"):
        return real_write(self, parts, name, fill, durable)
    # what a writer killed before its rename leaves behind: a temporary file with valid
    # checksums but wrong values (complete) or half of one
    with self.folder(parts, create=True) as d:
        fd = os.open(f"{name}.tmp.{os.getpid()}.0badf00d", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
        fill(fd)
        if mode == "partial_temp":
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
        os.close(fd)
    open(ready, "w").close()
    os._exit(1)

real_replace = os.replace

def sleeping_replace(src, dst, **k):
    if not str(dst).endswith(".glc"):
        return real_replace(src, dst, **k)
    open(ready, "w").close()
    time.sleep(600)

if mode in ("complete_temp", "partial_temp"):
    gcache.encode = lambda cols, ident: real_encode(tampered(cols), ident)
    cfs.CacheRoot.write = write_then_die
else:
    os.replace = sleeping_replace
ds = gpuload.ParquetDataset(data, json.loads(columns), cache_dir=cache, batch_size=997, chunk_bytes=65536,
                            device="cpu", shuffle=False, num_threads=1)
for _ in ds:
    pass
ds.reader.cache.flush()
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["complete_temp", "partial_temp", "sigkill_in_rename"])
def test_killed_writer_leaves_nothing_readable(click, tmp_path, mode):
    data, files, ref = click
    cache = tmp_path / "cache"
    ready = tmp_path / "ready"
    proc = _spawn(KILLED_WRITER, data, cache, ready, mode, json.dumps(COLUMNS))
    try:
        wait_for(ready, proc)
        if mode == "sigkill_in_rename":
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=CHILD_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.communicate()
    assert proc.returncode != 0
    leftovers = [p for p in Path(cache).rglob("*") if p.is_file() and ".tmp" in p.name]
    assert leftovers, "the child should have left a temporary file"
    assert not _entries(cache), "no complete chunk file may exist: the child died before its rename"

    ds = _dataset(data, cache, shuffle=True)
    assert len(list(ds.reader.cache.temporaries())) == len(leftovers)
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded == len(ds.reader.chunks)
    assert not any(p.exists() for p in leftovers), "leftover temporaries must be cleaned up"
    assert list(ds.reader.cache.temporaries()) == []
    assert ds.reader.cache.verify_all() == []
    ds2 = _dataset(data, cache, shuffle=False)
    check_epoch(ds2, ref)
    assert ds2.reader.counters.decoded == 0


# ---------------------------------------------------------------------------------------
# concurrency: several processes build one cache
# ---------------------------------------------------------------------------------------

CONCURRENT_READER = r"""
import json, os, sys, time
import numpy as np
import gpuload
data, cache, out, go, columns, seed, device = sys.argv[1:8]
seed = int(seed)
ds = gpuload.ParquetDataset(data, json.loads(columns), cache_dir=cache, batch_size=997, chunk_bytes=65536,
                            device=device, shuffle=seed >= 2, seed=seed, num_threads=2,
                            prefetch=0)  # its loads counted: none for a next epoch
open(out + ".ready", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
parts = {}
for b in ds:
    for k, v in b.items():
        if k == "history":
            parts.setdefault("h_len", []).append(np.diff(v.offsets.cpu().numpy()))
            parts.setdefault("h_val", []).append(v.values.cpu().numpy())
            parts.setdefault("h_off0", []).append(v.offsets.cpu().numpy()[:1])
        else:
            parts.setdefault(k, []).append(v.cpu().numpy())
ds.reader.cache.flush()
np.savez(out + ".npz", **{k: np.concatenate(v) for k, v in parts.items()})
with open(out + ".json", "w") as f:
    json.dump({"decoded": ds.reader.counters.decoded, "from_cache": ds.reader.counters.from_cache,
               "batches": len(parts["row_id"]), "len": len(ds), "chunks": len(ds.reader.chunks)}, f)
"""


@pytest.mark.slow
def test_concurrent_processes_build_each_chunk_once(tmp_path, device):
    """4 processes (on a GPU: 4 processes on one GPU) fill one cache folder at once."""
    data = tmp_path / "data"
    files = clicklog(data, rows=30_000, files=4, row_group_rows=400)
    ref = Reference(files)
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    outs = [tmp_path / f"child{i}" for i in range(4)]
    procs = [_spawn(CONCURRENT_READER, data, cache, out, go, json.dumps(COLUMNS), i, device, fresh=device == "cuda")
             for i, out in enumerate(outs)]
    try:
        for out, p in zip(outs, procs):
            wait_for(str(out) + ".ready", p)
        go.touch()
        for p in procs:
            _, err = p.communicate(timeout=CHILD_TIMEOUT)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    stats = [json.loads(Path(str(o) + ".json").read_text()) for o in outs]
    n_chunks = stats[0]["chunks"]
    assert n_chunks >= 30
    for s in stats:
        assert s["decoded"] + s["from_cache"] == n_chunks
        assert s["batches"] == s["len"]
    assert sum(s["decoded"] for s in stats) == n_chunks, stats  # each chunk built exactly once
    for o in outs:
        z = np.load(str(o) + ".npz")
        assert (z["h_off0"] == 0).all()
        assert np.array_equal(np.sort(z["row_id"]), np.arange(ref.n))
        ref.check_arrays(z)
    assert len(_entries(cache)) == n_chunks
    assert not [p for p in Path(cache).rglob("*") if ".tmp" in p.name]
    ds = _dataset(data, cache)
    assert ds.reader.cache.verify_all() == []


# ---------------------------------------------------------------------------------------
# stale locks
# ---------------------------------------------------------------------------------------

LOCK_HOLDER = r"""
import os, sys, time, json
import gpuload
data, cache, ready, columns = sys.argv[1:5]
ds = gpuload.ParquetDataset(data, json.loads(columns), cache_dir=cache, batch_size=997, chunk_bytes=65536,
                            device="cpu", shuffle=False, num_threads=1)

def hang(*a, **k):  # decoding chunk 0 while holding its build lock, forever
    open(ready, "w").close()
    time.sleep(600)

ds.reader.decode = hang
ds.reader.load(0)
"""


@pytest.mark.slow
def test_lock_of_killed_process_does_not_block(click, tmp_path):
    data, files, ref = click
    cache = tmp_path / "cache"
    ready = tmp_path / "ready"
    proc = _spawn(LOCK_HOLDER, data, cache, ready, json.dumps(COLUMNS))
    try:
        wait_for(ready, proc)
        ds = _dataset(data, cache, shuffle=False, num_threads=1, prefetch=0)
        result = {}

        def build():
            try:
                result["cols"] = ds.reader.load(0)
            except BaseException as e:  # pragma: no cover - reported below
                result["error"] = e

        t = threading.Thread(target=build, daemon=True)
        t.start()
        t.join(1.5)
        # while the holder lives, the chunk's builder waits for it (build-once)
        assert t.is_alive(), "a second builder did not wait for the chunk's lock"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        t.join(10)
        assert not t.is_alive(), "the lock of a killed process still blocks the builder"
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.communicate()
    assert "error" not in result, result.get("error")
    cols = result["cols"]
    ref.check({k: v for k, v in cols.items()})
    check_epoch(ds, ref)


# ---------------------------------------------------------------------------------------
# budget
# ---------------------------------------------------------------------------------------

def test_budget_caches_some_chunks_and_streams_the_rest(click, tmp_path):
    data, files, ref = click
    full = tmp_path / "full"
    dsf = _dataset(data, full)
    check_epoch(dsf, ref)
    dsf.reader.cache.flush()
    total = _cache_bytes(full)
    n = len(dsf.reader.chunks)
    assert n >= 10

    budget = int(total * 0.4)
    cache = tmp_path / "cache"
    ds = _dataset(data, cache, max_cache_bytes=budget, shuffle=True, prefetch=0)  # decodes counted per epoch
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    used = _cache_bytes(cache)
    cached = set(_entries(cache))
    assert used <= budget
    assert 0 < len(cached) < n
    assert used > budget - 2 * total / n  # filled until (nearly) full, not far below
    assert ds.reader.counters.decoded == n

    before = ds.reader.counters.decoded
    ds.set_epoch(1)
    check_epoch(ds, ref)
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded - before == n - len(cached)  # only the uncached chunks decoded
    assert set(_entries(cache)) == cached  # nothing evicted, nothing added
    assert _cache_bytes(cache) <= budget

    # a new dataset object under the same budget: still within it, still exact
    ds2 = _dataset(data, cache, max_cache_bytes=budget, seed=5, prefetch=0)
    check_epoch(ds2, ref)
    ds2.reader.cache.flush()
    assert _cache_bytes(cache) <= budget
    assert ds2.reader.counters.from_cache == len(cached)
    assert ds2.reader.counters.decoded == n - len(cached)


def test_budget_is_never_exceeded_at_the_boundary(tmp_path):
    """A budget just large enough by a loose estimate must still not be exceeded.

    One list column whose values and offsets each end 1 byte past a 4 KiB boundary, so
    each of its two regions carries almost 4 KiB of padding.
    """
    n = 512
    lengths = np.full(n, 8)
    lengths[0] = 9  # 4097 int8 values; offsets: 513 * 8 = 4104 bytes
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    vals = pa.array((np.arange(off[-1]) % 100).astype(np.int8))
    pq.write_table(pa.table({"h": pa.ListArray.from_arrays(pa.array(off), vals)}), tmp_path / "one.parquet")

    probe = gpuload.ParquetDataset(tmp_path / "one.parquet", ["h"], cache_dir=tmp_path / "probe",
                                   device="cpu", shuffle=False)
    list(probe)
    probe.reader.cache.flush()
    (entry,) = _entries(tmp_path / "probe")
    size = entry.stat().st_size
    for budget in range(size - 3 * ALIGN, size + 1, 512):
        cache = tmp_path / f"c{budget}"
        ds = gpuload.ParquetDataset(tmp_path / "one.parquet", ["h"], cache_dir=cache, device="cpu",
                                    shuffle=False, max_cache_bytes=budget)
        (b,) = list(ds)
        np.testing.assert_array_equal(b["h"].values.numpy(), vals.to_numpy())
        used = _cache_bytes(cache)
        assert used <= budget, f"cache holds {used} bytes with max_cache_bytes={budget}"
    # with room to spare, the chunk is cached (the loop above is not vacuous)
    ds = gpuload.ParquetDataset(tmp_path / "one.parquet", ["h"], cache_dir=tmp_path / "roomy", device="cpu",
                                shuffle=False, max_cache_bytes=2 * size)
    list(ds)
    assert _cache_bytes(tmp_path / "roomy") == size



def test_a_failed_host_copy_gives_its_write_slot_back(tmp_path):
    """A ``to_host`` that raises (a device copy out of memory) fails that load and keeps no
    pending-write slot: flush() still returns, and the chunk is written by a later load."""
    from gpuload.cache.store import ChunkCache

    failures = [MemoryError("out of host memory")] * 2  # as many as there are slots

    def to_host(cols):
        if failures:
            raise failures.pop()
        return cols

    cache, cols = ChunkCache(tmp_path, to_host=to_host), sample_cols(10)
    key = key_for(cols)
    for _ in range(2):
        with pytest.raises(MemoryError):
            cache.load(key, lambda: cols)
    flushed = threading.Event()
    threading.Thread(target=lambda: (cache.flush(), flushed.set()), daemon=True).start()
    assert flushed.wait(10), "flush() waits for writes that will never come"
    assert cache.load(key, lambda: cols)[1] is False
    cache.flush()
    assert cache.exists(key) and cache.load(key, lambda: cols)[1] is True


def test_a_shared_chunk_is_written_from_its_own_arrays_and_says_when(tmp_path):
    """``load(shared=True)`` (views of the chunk will be handed out): the writer writes the chunk's
    own arrays, no copy, and the chunk comes back as a Writing whose ``written`` is set once the
    writer is done; ``shared=False`` (gathered batches): a plain column set, nothing to wait for."""
    from gpuload.cache.store import ChunkCache, Writing

    gate = threading.Event()
    cache, cols = ChunkCache(tmp_path), sample_cols(1000)
    write = cache._write
    seen = []

    def held_write(key, got, spill=True):
        seen.append(got)
        gate.wait(10)
        return write(key, got, spill)

    cache._write = held_write
    got, cached = cache.load(key_for(cols), lambda: cols, shared=True)
    assert not cached and isinstance(got, Writing) and dict(got) == cols
    assert not got.written.wait(0.2)  # the write is held: not done yet
    gate.set()
    assert got.written.wait(10) and cache.exists(key_for(cols))
    assert all(seen[0][k] is cols[k] for k in cols)  # the very arrays, not a copy
    other = sample_cols(1000, seed=1)
    plain, _ = cache.load(key_for(other), lambda: other, shared=False)
    assert type(plain) is dict
    cache.flush()
