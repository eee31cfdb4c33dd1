"""Chunk files carry their chunk's full identity: a valid file under another chunk's
name (copied, linked, hand-made) is never served, and ``cache verify`` finds it.

Also: a cache file truncated in place while a batch made from it is alive cannot
hurt that batch (reads copy into private memory; nothing is mapped).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xxhash

import gpuload
from gpuload.cache.chunkfile import FORMAT_VERSION, PREFIX, align, read_chunk, write_chunk
from gpuload.cache.store import ChunkCache
from gpuload.synth import clicklog_columns, write_clicklog

from conftest import dataset_factory

COLUMNS = {**clicklog_columns(2, 2), "row_id": "row_id"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("idata")
    write_clicklog(d, rows=4000, files=2, row_group_rows=200, dense=2, sparse=2, list_max=3)
    return d


_ds = dataset_factory(COLUMNS, chunk_bytes=1 << 14, batch_size=333)


def _built(data, cache):
    ds = _ds(data, cache, prefetch=0)  # no next epoch's chunks read while a test rewrites them
    list(ds)
    ds.reader.cache.flush()
    return ds


def _epoch_exact(ds, ref_label):
    ids, label = [], []
    for b in ds:
        ids.append(b["row_id"].numpy())
        label.append(b["label"].numpy())
    ids = np.concatenate(ids)
    assert len(ids) == 4000 and np.array_equal(np.sort(ids), np.arange(4000)), "a row was served twice or never"
    np.testing.assert_array_equal(np.concatenate(label), ref_label[ids])


@pytest.fixture(scope="module")
def ref_label(data, tmp_path_factory):
    batches = list(_ds(data, tmp_path_factory.mktemp("r"), shuffle=False))
    ids = np.concatenate([b["row_id"].numpy() for b in batches])
    label = np.concatenate([b["label"].numpy() for b in batches])
    out = np.empty_like(label)
    out[ids] = label
    return out


def _rewrite_header(path: Path, change) -> None:
    """Change the JSON header of a chunk file and give it a valid checksum (a hand-made file)."""
    raw = path.read_bytes()
    magic, version, hlen, _ = PREFIX.unpack_from(raw)
    header = json.loads(raw[PREFIX.size:PREFIX.size + hlen])
    change(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    start = align(PREFIX.size + hlen)
    assert align(PREFIX.size + len(blob)) <= start, "the test's header must fit the old one's space"
    head = PREFIX.pack(magic, version, len(blob), xxhash.xxh3_64_intdigest(blob)) + blob
    path.write_bytes(head + b"\0" * (start - len(head)) + raw[start:])


SWAPS = ["copy_other", "link_other", "hardlink_other", "larger", "smaller", "dtype", "drop_region", "shape",
         "rows", "spec", "other_source", "extra_bytes"]


@pytest.mark.parametrize("how", SWAPS)
@pytest.mark.parametrize("verify", [True, "always", False])
def test_a_file_that_is_not_the_chunk_is_never_served(data, tmp_path, how, verify, ref_label):
    cache = tmp_path / "cache"
    ds = _built(data, cache)
    keys = [ds.reader.key(i) for i in range(len(ds.reader.chunks))]
    paths = [ds.reader.cache.path(k) for k in keys]
    sizes = [p.stat().st_size for p in paths]
    victim = paths[0]
    other = next(p for p, k in zip(paths, keys) if k.path == keys[0].path and p != victim)
    if how == "copy_other":
        shutil.copy(other, victim)
    elif how == "link_other":
        victim.unlink()
        victim.symlink_to(other)
    elif how == "hardlink_other":
        victim.unlink()
        os.link(other, victim)
    elif how in ("larger", "smaller"):  # a file of another chunk with more (fewer) rows
        pick = max if how == "larger" else min
        big = pick((p for p in paths if p != victim), key=lambda p: p.stat().st_size)
        shutil.copy(big, victim)
    elif how == "dtype":
        _rewrite_header(victim, lambda h: [r.update(dtype="<i4") for r in h["regions"] if r["dtype"] == "<f4"])
    elif how == "drop_region":
        _rewrite_header(victim, lambda h: h["regions"].pop())
    elif how == "shape":
        _rewrite_header(victim, lambda h: [r.update(shape=[r["shape"][0] // 2, *r["shape"][1:]])
                                           for r in h["regions"] if r["part"] == "data"])
    elif how == "rows":
        _rewrite_header(victim, lambda h: h.update(rows=h["rows"] - 1))
    elif how == "spec":
        _rewrite_header(victim, lambda h: h["spec"][0].update(dtype="<f8"))
    elif how == "other_source":
        _rewrite_header(victim, lambda h: h["source"].update(mtime_ns=h["source"]["mtime_ns"] + 1))
    elif how == "extra_bytes":
        with open(victim, "ab") as f:
            f.write(b"\0" * 4096)
    bad = ChunkCache(cache, create=False).verify_all()
    if how != "link_other":  # a link is reported as unreadable (never followed)
        assert [b.path for b in bad] == [victim], bad
    else:
        assert [(b.path, b.kind) for b in bad] == [(victim, "unreadable")]
    ds2 = _ds(data, cache, verify_checksums=verify, seed=1, prefetch=0)  # its decodes counted: one epoch's
    _epoch_exact(ds2, ref_label)
    ds2.reader.cache.flush()
    assert ds2.reader.counters.decoded == 1
    if how != "link_other":  # rebuilt in place
        assert ChunkCache(cache, create=False).verify_all() == []
    assert [p.stat().st_size for p in paths[1:]] == sizes[1:]


def test_same_identity_in_another_cache_is_served(data, tmp_path, ref_label):
    """Copying a whole cache (same names, same headers) is fine: identity, not location."""
    _built(data, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ds = _ds(data, tmp_path / "b")
    _epoch_exact(ds, ref_label)
    assert ds.reader.counters.decoded == 0


TRUNCATE_WHILE_HELD = textwrap.dedent("""
    import os, sys, numpy as np, gpuload
    data, cache = sys.argv[1:3]
    ds = gpuload.ParquetDataset(data, ["row_id", "label"], cache_dir=cache, batch_size=100_000, shuffle=False,
                                device="cpu")
    list(ds); ds.reader.cache.flush()
    (batch,) = list(gpuload.ParquetDataset(data, ["row_id", "label"], cache_dir=cache, batch_size=100_000,
                                           shuffle=False, device="cpu"))
    want = batch["row_id"].clone()
    for p in sorted(__import__("pathlib").Path(cache).rglob("*.glc")):
        with open(p, "r+b") as f:  # another process truncates and rewrites the file in place
            f.truncate(0)
            f.write(b"x" * 10)
    assert int(batch["row_id"].sum()) == int(want.sum())  # no SIGBUS, same values
    assert (batch["row_id"].numpy() == np.arange(len(want))).all()
    print("ok")
""")


@pytest.mark.slow
def test_truncating_a_cache_file_in_place_cannot_hurt_a_held_batch(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 100_000
    pq.write_table(pa.table({"row_id": np.arange(n), "label": np.ones(n, np.int8)}), tmp_path / "x.parquet")
    r = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_HELD, str(tmp_path / "x.parquet"), str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)  # -7 would be SIGBUS
    assert r.stdout.strip() == "ok"


def test_header_checksum_and_json_shape_are_checked(tmp_path):
    """A header that is valid JSON with a valid checksum but the wrong shape is corrupt, not a crash."""
    import dataclasses

    from clicklog import key_for, sample_cols

    cols = sample_cols(100)
    key = key_for(cols)
    path = tmp_path / "c.glc"
    write_chunk(path, cols, key)
    read_chunk(path, want=key.identity)
    for change in (lambda h: h.update(regions="nope"), lambda h: h.update(source=[1, 2]),
                   lambda h: h["regions"][0].update(offset="0"), lambda h: h["regions"][0].update(shape=[-1]),
                   lambda h: h["regions"][0].update(dtype="not a dtype"), lambda h: h.update(row_groups=None),
                   lambda h: h["regions"][0].update(offset=1 << 40), lambda h: h["regions"][0].pop("xxh3"),
                   lambda h: h["regions"][0].update(xxh3=7), lambda h: h["regions"][-1].update(shape=[2**64]),
                   lambda h: h["regions"][0].update(nbytes=2**70)):
        write_chunk(path, cols, key)
        _rewrite_header(path, change)
        with pytest.raises(gpuload.CorruptCacheError, match=str(path)):
            read_chunk(path, want=key.identity)
    bad = dataclasses.replace(key.identity, rows=101)
    write_chunk(path, cols, key)
    with pytest.raises(gpuload.CorruptCacheError, match="100 rows"):
        read_chunk(path, want=bad)


def test_a_header_read_without_an_identity_still_places_its_regions_in_the_file(tmp_path):
    """``read_chunk(path)`` (tools, no identity expected) holds the regions to whole, aligned,
    ordered spans after the header: one at offset 0 (inside the header), a negative size or two
    overlapping are a CorruptCacheError naming the file, not a NumPy error or, unverified, views
    of the wrong bytes."""
    from clicklog import key_for, sample_cols

    cols = sample_cols(100)
    key = key_for(cols)
    path = tmp_path / "c.glc"
    write_chunk(path, cols, key)
    read_chunk(path)
    for change in (lambda h: h["regions"][0].update(offset=0), lambda h: h["regions"][0].update(nbytes=-8),
                   lambda h: h["regions"][-1].update(offset=h["regions"][0]["offset"]),
                   lambda h: h["regions"][0].update(offset=h["regions"][0]["offset"] + 8)):
        write_chunk(path, cols, key)
        _rewrite_header(path, change)
        for verify in (True, False):
            with pytest.raises(gpuload.CorruptCacheError, match=str(path)):
                read_chunk(path, verify=verify)


def test_absurdly_nested_header_is_corrupt_not_a_crash(tmp_path):
    path = tmp_path / "c.glc"
    blob = b"[" * 200_000 + b"]" * 200_000
    head = PREFIX.pack(b"GPULOAD\0", FORMAT_VERSION, len(blob), xxhash.xxh3_64_intdigest(blob)) + blob
    path.write_bytes(head + b"\0" * (align(len(head)) - len(head)))
    with pytest.raises(gpuload.CorruptCacheError, match="not JSON"):
        read_chunk(path)


def test_a_chunk_files_header_stays_within_its_bound(data, tmp_path):
    """header_bound sizes the cache files a dataset reckons it needs (its room warning counts chunks by
    them): every header encode wrote for the click log's chunks is within it."""
    from gpuload.cache.chunkfile import header_bound

    ds = _built(data, tmp_path / "c")
    r = ds.reader
    for i in range(len(r.chunks)):
        path = r.cache.path(r.key(i))
        with open(path, "rb") as f:
            _, _, hlen, _ = PREFIX.unpack(f.read(PREFIX.size))
        assert PREFIX.size + hlen <= header_bound(r.spec_desc, r.arrays_per_chunk, r.files[r.chunks[i].file].path)


def test_a_spec_equal_only_to_pythons_eq_is_still_refused(tmp_path):
    """A chunk file of fill 0.0 read first, a file of fill -0.0 (other spec, other bits in every
    filled null) copied under its name is refused: the check's memo of specs it hashed compares
    floats as JSON writes them, not as ``==`` does. (From review: -0.0 == 0.0.)"""
    from gpuload.cache.chunkfile import spec_hash
    from gpuload.cache.paths import ChunkKey

    def desc(fill):
        return [{"name": "x", "columns": ["x"], "kind": "scalar", "dtype": "<f4", "width": 1,
                 "sources": [["<f4", None]], "fills": [fill]}]

    keys = [ChunkKey("/d/x.parquet", 10, 20, spec_hash(d), 0, 1, 3, (("x", "scalar", "<f4", 1),), d)
            for d in (desc(0.0), desc(-0.0), desc(0.5))]
    assert len({k.spec for k in keys}) == 3
    for k in keys:
        write_chunk(tmp_path / k.name, {"x": np.zeros(3, np.float32)}, k)
    read_chunk(tmp_path / keys[0].name, want=keys[0].identity)  # its spec hashed once, then kept
    read_chunk(tmp_path / keys[0].name, want=keys[0].identity)  # (and served from the memo)
    for other in keys[1:]:
        with pytest.raises(gpuload.CorruptCacheError, match="its column spec differs"):
            read_chunk(tmp_path / other.name, want=keys[0].identity)
    read_chunk(tmp_path / keys[1].name, want=keys[1].identity)  # each file still serves its own name
