"""Decode: what pyarrow reads from the files, as gpuload reads it (INT96 timestamps at
microsecond precision, range-checked), what a read error says, and a local file removed or
rewritten after the dataset was opened (refused, naming it)."""

from __future__ import annotations

import datetime as dt
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload.sources.ranges import column_ranges
from gpuload.synth import write_clicklog

from conftest import ARROW_READS_NULL_FIXED_LISTS, dataset_factory, run_with_timeout, write_parquet
from reference import CHUNK_BYTES, CLICK_COLUMNS, DENSE, SPARSE

SENTINELS = [dt.datetime(1, 1, 1), dt.datetime(1677, 9, 21), dt.datetime(1970, 1, 1), dt.datetime(2024, 2, 29, 12, 30, 1, 123456),
             dt.datetime(2262, 4, 12), dt.datetime(9999, 12, 31, 23, 59, 59, 999999)]


_ds = dataset_factory(batch_size=4, shuffle=False)


def _micros(values) -> list[int]:
    epoch = dt.datetime(1970, 1, 1)
    return [None if v is None else (v - epoch) // dt.timedelta(microseconds=1) for v in values]


def _all(ds, name) -> list:
    out = []
    for b in ds:
        v = b[name]
        out += (v.values if isinstance(v, gpuload.Ragged) else v).tolist()
    return out


def test_int96_timestamps_are_microseconds_without_wrapping_even_for_sentinel_dates(tmp_path):
    values = SENTINELS * 3
    t = pa.table({"ts": pa.array(values, pa.timestamp("us")),
                  "tl": pa.array([[v, v] for v in values], pa.list_(pa.timestamp("us")))})
    p = write_parquet(tmp_path / "spark.parquet", t, use_deprecated_int96_timestamps=True, row_group_size=5)
    assert pq.read_metadata(p).schema.column(0).physical_type == "INT96"
    ds = _ds(p, tmp_path / "cache", ["ts", "tl"])
    assert _all(ds, "ts") == _micros(values)  # pyarrow's default (nanoseconds) wraps the first and last
    assert _all(ds, "tl") == [m for m in _micros(values) for _ in (0, 1)]
    # the same values as a TIMESTAMP_MICROS column: switching Spark's outputTimestampType changes nothing
    q = write_parquet(tmp_path / "micros" / "a.parquet", t)
    assert pq.read_metadata(q).schema.column(0).physical_type == "INT64"
    write_parquet(tmp_path / "micros" / "b.parquet", t, use_deprecated_int96_timestamps=True)
    assert _all(_ds(tmp_path / "micros", tmp_path / "cache", ["ts"]), "ts") == _micros(values) * 2
    # a cache of the wrapped nanoseconds that an older gpuload wrote is never taken for these
    assert ds.reader.spec_desc[0]["sources"] == [["<i8", "int96"]]


def test_int96_beyond_int64_microseconds_is_refused_naming_the_column(tmp_path):
    t = pa.table({"id": pa.array([1, 2], pa.int64()),
                  "ts": pa.array([dt.datetime(2020, 1, 1, 0, 0, 0, 123456)] * 2, pa.timestamp("us"))})
    p = write_parquet(tmp_path / "x.parquet", t, use_deprecated_int96_timestamps=True, use_dictionary=False,
                      compression="none", write_statistics=False)
    raw = bytearray(p.read_bytes())
    julian = 2440588 + 18262  # 2020-01-01
    at = raw.index(struct.pack("<qI", 123456000, julian))
    raw[at + 8:at + 12] = struct.pack("<I", 2**31 + 5)  # a Julian day about 5.9 million years ahead
    p.write_bytes(bytes(raw))
    with pytest.raises(gpuload.SourceError, match=r"column 'ts' holds INT96 timestamps that int64 microseconds "
                                                  r"cannot represent \(1 values"):
        list(_ds(p, tmp_path / "cache", ["id", "ts"]))
    assert _all(_ds(p, tmp_path / "cache", ["id"]), "id") == [1, 2]  # the rest of the file is fine


def test_a_column_that_cannot_be_decoded_is_named_with_what_to_do(tmp_path):
    rng = np.random.default_rng(0)
    t = pa.table({"a": np.arange(20_000, dtype=np.int64), "b": rng.random(20_000), "c": rng.random(20_000)})
    p = write_parquet(tmp_path / "x.parquet", t, compression="snappy", use_dictionary=False)
    col = pq.read_metadata(p).row_group(0).column(1)
    raw = bytearray(p.read_bytes())
    raw[col.data_page_offset:col.data_page_offset + 8] = b"\xff" * 8  # b's page header damaged
    p.write_bytes(bytes(raw))
    with pytest.raises(gpuload.SourceError, match=r"column 'b' cannot be read \(.*\); the file may be corrupt there: "
                                                  r"rewrite it, or leave 'b' out of columns= to load the rest"):
        list(_ds(p, tmp_path / "cache", ["a", "b", "c"], batch_size=5000))
    got = _all(_ds(p, tmp_path / "cache", ["a", "c"], batch_size=5000), "a")  # and the rest loads
    assert got == list(range(20_000))
    # read alone, it is named too (a user's trial: "cannot be read", naming no column)
    with pytest.raises(gpuload.SourceError, match=r"x.parquet \(row groups 0-0\): column 'b' cannot be read \(.*\); "
                                                  r"the file may be truncated or corrupt there: rewrite it"):
        list(_ds(p, tmp_path / "cache", ["b"], batch_size=5000))


@pytest.mark.parametrize("encoding", ["DELTA_BYTE_ARRAY", "DELTA_LENGTH_BYTE_ARRAY"])
@pytest.mark.parametrize("categorical", [None, "vocab"])
def test_delta_encoded_strings_become_the_same_ids_as_plain_ones(tmp_path, encoding, categorical):
    """Parquet v2 writers (DuckDB's PARQUET_VERSION V2, Spark's writer version v2) delta-encode strings, which
    pyarrow cannot read as a dictionary: they were refused as corrupt. Hashed and counted alike, they give the
    ids the same values get from a dictionary-encoded file."""
    values = [f"k{i * 7919 % 1000}" if i % 13 else None for i in range(3000)]
    t = pa.table({"id": np.arange(3000), "s": values})
    for name in ("plain", "delta"):
        (tmp_path / name).mkdir()
    pq.write_table(t, tmp_path / "plain" / "a.parquet", row_group_size=700)  # dictionary-encoded strings
    pq.write_table(t, tmp_path / "delta" / "a.parquet", use_dictionary=False, column_encoding={"s": encoding},
                   row_group_size=700)
    md = pq.ParquetFile(tmp_path / "delta" / "a.parquet").metadata
    assert encoding in md.row_group(0).column(1).encodings
    enc = gpuload.Vocab() if categorical == "vocab" else None
    got = {}
    for name in ("plain", "delta"):
        ds = gpuload.ParquetDataset(tmp_path / name, ["id", "s"], categorical=enc, cache_dir=tmp_path / f"c-{name}",
                                    device="cpu", shuffle=False, batch_size=512)
        got[name] = np.concatenate([b["s"].numpy() for b in ds])
    assert np.array_equal(got["plain"], got["delta"])
    assert (got["delta"] == 0).sum() == sum(v is None for v in values)


def test_a_fixed_size_list_with_null_rows_is_read_or_refused_naming_the_pyarrow_to_install(tmp_path):
    emb = np.arange(4 * 6, dtype=np.float32)
    nulls = np.array([False, True, False, False, True, False])
    t = pa.table({"id": np.arange(6, dtype=np.int64),
                  "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb), 4, mask=pa.array(nulls))})
    p = write_parquet(tmp_path / "x.parquet", t)
    ds = gpuload.ParquetDataset(p, ["id", "emb"], cache_dir=tmp_path / "cache", device="cpu", batch_size=6,
                                shuffle=False, fill_nulls={"emb": -1.0})
    if ARROW_READS_NULL_FIXED_LISTS:
        (batch,) = list(ds)
        want = np.where(nulls[:, None], np.float32(-1.0), emb.reshape(6, 4))
        assert np.array_equal(batch["emb"].numpy(), want)
    else:  # pyarrow < 26 (apache/arrow#35692): the column named, and the way out
        with pytest.raises(gpuload.SourceError, match=r"x.parquet \(row groups 0-0\): column 'emb' cannot be read: "
                                                      r"pyarrow .* cannot read fixed-size lists that hold null rows.*"
                                                      r"pip install 'pyarrow>=26'"):
            list(ds)


# ---------------------------------------------------------------------------------------
# a file that changed after the dataset was opened
# ---------------------------------------------------------------------------------------

def test_source_removed_after_open_raises_gpuload_error(tmp_path):
    d = tmp_path / "d"
    files = write_clicklog(d, rows=3000, files=3, row_group_rows=500, dense=DENSE, sparse=SPARSE, list_max=5)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", device="cpu", batch_size=100,
                                chunk_bytes=CHUNK_BYTES, shuffle=False)
    Path(files[2]).unlink()

    def consume():
        with pytest.raises(gpuload.GpuloadError) as info:
            for _ in ds:
                pass
        return info

    info = run_with_timeout(consume)
    assert files[2].name in str(info.value)


def test_source_rewritten_after_open_raises(tmp_path):
    d = tmp_path / "d"
    files = write_clicklog(d, rows=3000, files=2, row_group_rows=500, dense=DENSE, sparse=SPARSE, list_max=5)
    ds = gpuload.ParquetDataset(d, CLICK_COLUMNS, cache_dir=tmp_path / "cache", device="cpu", batch_size=100,
                                chunk_bytes=CHUNK_BYTES, shuffle=False)
    other = write_clicklog(tmp_path / "o", rows=3000, files=2, row_group_rows=500, dense=DENSE, sparse=SPARSE,
                           list_max=5, seed=99)
    shutil.copyfile(other[1], files[1])
    with pytest.raises(gpuload.GpuloadError, match=files[1].name):
        run_with_timeout(lambda: list(ds))


@pytest.mark.parametrize("page_index", [False, True])
def test_the_gpu_decoders_image_of_a_local_file_holds_the_chunks_columns_and_footer_only(tmp_path, page_index):
    """What libcudf is given instead of the path (shared code, checked with pyarrow as the reader of
    the whole file): the chunk's column chunks, dictionary pages included, the magic and the footer
    (page indexes too), read into place; nothing of the other row groups or columns."""
    from gpuload.gpu.decoder import chunk_image as _image

    n = 8_000
    rng = np.random.default_rng(3)
    table = pa.table({"id": np.arange(n), "word": pa.array([f"w{i % 37}" for i in range(n)]),  # dictionary pages
                      "big": pa.array(np.frombuffer(rng.bytes(200 * n), "S200").tolist()),
                      "l": pa.array([[i] * (i % 3) for i in range(n)])})
    p = tmp_path / "a.parquet"
    pq.write_table(table, p, row_group_size=1000, write_page_index=page_index)
    ds = gpuload.ParquetDataset(p, ["id", "word", "l"], cache_dir=tmp_path / "c", device="cpu", chunk_bytes=30_000)
    r = ds.reader
    c = r.chunks[1]
    f = r.files[c.file]
    assert c.rg_stop - c.rg_start < f.metadata.num_row_groups
    image = _image(f, c, r.specs, None)
    try:
        data = image.getbuffer()
        assert len(data) == f.size and bytes(data[:4]) == b"PAR1"
        got = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data))).read_row_groups(
            list(range(c.rg_start, c.rg_stop)), columns=["id", "word", "l"])
        assert got.equals(table.slice(c.rg_start * 1000, c.rows).select(["id", "word", "l"]))
        raw = p.read_bytes()
        big = f.leaves("big")[0]
        gap = 1 << 16  # reads closer than this are merged
        for g in range(f.metadata.num_row_groups):  # a column not asked for (200 KB a row group): never read
            (a, b), = column_ranges(f.metadata, g, g + 1, [big])
            a, b = a + gap, b - gap
            assert b - a > 50_000 and not any(data[a:b]) and any(raw[a:b])
        read = [g for g in range(f.metadata.num_row_groups) if any(data[column_ranges(f.metadata, g, g + 1, [0])[0][0]:][:100])]
        assert read == list(range(c.rg_start, c.rg_stop))  # only the chunk's row groups
        del data
    finally:
        image.close()


def test_the_gpu_decoders_image_of_a_truncated_file_names_it(tmp_path):
    from gpuload.gpu.decoder import chunk_image as _image

    p = write_parquet(tmp_path / "a.parquet", {"x": np.arange(10_000)}, row_group_size=1000)
    ds = gpuload.ParquetDataset(p, ["x"], cache_dir=tmp_path / "c", device="cpu", chunk_bytes=10_000)
    r = ds.reader
    c = r.chunks[-1]
    with open(p, "r+b") as fh:  # only the data of the last row groups is gone: the tail is asked before it
        fh.truncate(r.files[0].metadata.row_group(c.rg_start).column(0).data_page_offset + 10)
    with pytest.raises(OSError, match="a.parquet"):
        _image(r.files[0], c, r.specs, None)


def test_a_packs_files_converted_at_once_equal_each_converted_alone(tmp_path):
    """ArrowDecoder.pack (a pack's tables joined, converted once) against each file converted alone and
    their rows put one after another: hashed strings with each file's own dictionary, a Vocab, lists,
    timestamps, a Hive key; and files whose schemas differ (int32 here, int64 there) converted one by one."""
    from gpuload.batch import Ragged
    from gpuload.layout import Pieces, joined, merge_pieces

    rng = np.random.default_rng(4)
    start = 0
    for i in range(70):
        n = int(rng.integers(5, 30))
        write_parquet(tmp_path / "data" / f"day={i % 3}" / f"p{i:03}.parquet", {
            "row_id": np.arange(start, start + n),
            "city": pa.array([f"c{int(k)}" for k in rng.integers(0, 9 + i, n)]),  # strings, dictionary-read
            "tag": pa.array([f"t{int(k)}" for k in rng.integers(0, 4, n)]),
            "hist": pa.array([list(range(int(k))) for k in rng.integers(0, 4, n)], pa.list_(pa.int64())),
            "when": pa.array(rng.integers(0, 10**9, n), pa.timestamp("ms")),
            "v": pa.array(rng.integers(0, 100, n), pa.int32() if 30 <= i < 40 else pa.int64())})
        start += n
    n = 20_000  # a large file: the small ones are each less than the dataset's 64th
    write_parquet(tmp_path / "data" / "day=0" / "big.parquet", {
        "row_id": np.arange(start, start + n), "city": pa.array(["c1"] * n), "tag": pa.array(["t1"] * n),
        "hist": pa.array([[1]] * n, pa.list_(pa.int64())), "when": pa.array(np.zeros(n, np.int64), pa.timestamp("ms")),
        "v": np.zeros(n, np.int64)})
    ds = gpuload.ParquetDataset(tmp_path / "data", ["row_id", "city", "tag", "hist", "when", "v", "day"],
                                device="cpu", cache_dir=tmp_path / "c", batch_size=64,
                                categorical={"city": gpuload.Hash(1000), "tag": gpuload.Vocab()})
    r = ds.reader
    packs = [c for c in r.chunks if c.parts]
    assert len(packs) >= 3 and sum(len(c.parts) for c in packs) > 50
    for c in packs:
        at_once = r.decode.pack(r.files, c.parts, r.specs)
        alone = merge_pieces([r.decode(r.files[p.file], p, r.specs) for p in c.parts])
        assert at_once.keys() == alone.keys()
        for k, v in at_once.items():
            w = alone[k]
            if isinstance(v, Ragged):
                assert np.array_equal(v.offsets, w.offsets) and np.array_equal(v.values, w.values), k
            else:
                a, b = joined(v), joined(w)
                assert isinstance(v, Pieces) == isinstance(w, Pieces) and a.dtype == b.dtype and np.array_equal(a, b), k
    ds.close()
