"""Remote sources against real loopback servers: an S3-protocol server (moto) and a plain
HTTP object server, both counting the requests they receive and able to inject latency
and faults (gpuload.testing)."""

from __future__ import annotations

import datetime
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload import SourceError
from gpuload.batch import Ragged

pytest.importorskip("moto")
pytest.importorskip("s3fs")
from gpuload.testing import Faults, HttpServer, S3Server  # noqa: E402

from conftest import open_dataset, python, spawn, wait_until, write_parquet  # noqa: E402
from typecases import DTYPES, FILL, NATIVE, write_every_type  # noqa: E402

N_FILES, ROWS, RG = 3, 3000, 500


def _table(i: int, rows: int = ROWS, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed * 100 + i)
    ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
    lens = rng.integers(0, 6, rows)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    values = rng.integers(-1000, 1000, int(offsets[-1]))
    t0 = datetime.datetime(2024, 1, 1)
    return pa.table({
        "id": ids,
        "i8": pa.array(rng.integers(-128, 128, rows), pa.int8()),
        "u16": pa.array(rng.integers(0, 65535, rows), pa.uint16()),
        "i32": pa.array(rng.integers(-2**31, 2**31 - 1, rows), pa.int32()),
        "f16": pa.array(rng.random(rows).astype(np.float16), pa.float16()),
        "f32": pa.array(rng.random(rows).astype(np.float32)),
        "f64": rng.random(rows),
        "flag": pa.array(rng.random(rows) < 0.5),
        "ts": pa.array([t0 + datetime.timedelta(seconds=int(s)) for s in rng.integers(0, 10**7, rows)],
                       pa.timestamp("us")),
        "day": pa.array(rng.integers(0, 20000, rows).astype(np.int32), pa.int32()).cast(pa.date32()),
        "cat": pa.array(rng.integers(0, 50, rows)).dictionary_encode(),
        "hist": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int64())),
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 4).astype(np.float32)), 4),
        "unused": rng.random(rows),  # never requested: its bytes must not be fetched
    })


COLUMNS = {"id": "id", "i8": "i8", "u16": "u16", "i32": "i32", "f16": "f16", "f32": "f32", "f64": "f64",
           "flag": "flag", "ts": "ts", "day": "day", "cat": "cat", "hist": "hist", "emb": "emb",
           "dense": ["f32", "f64"]}


def _expected(table: pa.Table, name: str):
    """What gpuload yields for output ``name``, computed by pyarrow alone."""
    src = COLUMNS[name]
    if isinstance(src, list):
        return np.stack([table.column(c).to_numpy() for c in src], axis=1).astype(np.float64)
    col = table.column(src).combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_timestamp(col.type) or pa.types.is_date32(col.type):
        return col.cast(pa.int32() if pa.types.is_date32(col.type) else pa.int64()).to_numpy().astype(np.int64)
    if pa.types.is_list(col.type):
        return Ragged(col.flatten().to_numpy(), col.offsets.to_numpy().astype(np.int64))
    if pa.types.is_fixed_size_list(col.type):
        return col.flatten().to_numpy().reshape(len(col), -1)
    return col.to_numpy(zero_copy_only=False)


def _rows_by_id(batches) -> dict:
    """{output: values in id order} from gpuload batches (ragged as a list of arrays)."""
    out: dict[str, list] = {}
    for b in batches:
        ids = b["id"].numpy()
        for k, v in b.items():
            if isinstance(v, Ragged):
                vals, offs = v.values.numpy(), v.offsets.numpy()
                out.setdefault(k, []).extend(zip(ids, (vals[offs[j]:offs[j + 1]] for j in range(len(ids)))))
            else:
                out.setdefault(k, []).extend(zip(ids, v.numpy()))
    return {k: [x for _, x in sorted(pairs, key=lambda p: p[0])] for k, pairs in out.items()}


def _check_equal(got: dict, tables: list[pa.Table]) -> None:
    table = pa.concat_tables(tables)
    order = np.argsort(table.column("id").to_numpy())
    assert len(got["id"]) == table.num_rows
    for name in COLUMNS:
        want = _expected(table, name)
        if isinstance(want, Ragged):
            offs = want.offsets
            rows = [want.values[offs[j]:offs[j + 1]] for j in order]
            assert all(np.array_equal(a, b) for a, b in zip(got[name], rows)), name
        else:
            assert np.array_equal(np.stack(got[name]) if want.ndim > 1 else np.array(got[name]), want[order]), name


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture
def bucket(s3, tmp_path):
    """A fresh bucket holding N_FILES Parquet objects under data/ (and a non-Parquet object)."""
    name = f"b{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    folder.mkdir()
    tables = [_table(i) for i in range(N_FILES)]
    for i, t in enumerate(tables):
        pq.write_table(t, folder / f"part-{i}.parquet", row_group_size=RG)
    (folder / "_SUCCESS").write_text("")
    s3.upload_folder(folder, name, "data/")
    s3.faults = Faults()
    return name, tables, folder


def _open(url, s3, cache, **kw):
    return open_dataset(url, COLUMNS, cache, batch_size=700, storage_options=s3.storage_options, chunk_bytes=120_000,
                        **kw)


def test_s3_values_equal_pyarrow_for_every_type_and_cached_epochs_make_no_request(s3, bucket, tmp_path):
    name, tables, _ = bucket
    ds = _open(f"s3://{name}/data/", s3, tmp_path / "cache", seed=3)
    assert len(ds.reader.files) == N_FILES  # _SUCCESS is not a data file
    assert len(ds.reader.chunks) > N_FILES  # several chunks per object: ranged reads, not whole objects
    _check_equal(_rows_by_id(ds), tables)
    assert ds.stats().remote.requests > 0
    assert ds.reader.remote_reads.ahead_used > 0 and ds.reader.remote_reads._ahead == {} and ds.reader.remote_reads._ahead_bytes == 0  # fetched ahead
    s3.reset_counts()
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        _check_equal(_rows_by_id(ds), tables)
    assert s3.count() == 0, dict(s3.requests)


def test_every_type_from_s3_is_exact_on_every_device(s3, tmp_path, device_decode):
    """Remote objects on each device; with cuDF, libcudf reads each chunk's fetched ranges (and the
    footer) from a sparse staging file by itself, and must decode every chunk (no float16 here)."""
    device, decode = device_decode
    staged = set(Path(tempfile.gettempdir()).glob("gpuload-stage-*"))
    folder = tmp_path / "src"
    expected = write_every_type(folder, files=2, rows=4_000, row_group_size=1_000)
    name = f"b{uuid.uuid4().hex[:12]}"
    s3.upload_folder(folder, name, "data/")
    ds = gpuload.ParquetDataset(f"s3://{name}/data/", NATIVE, fill_nulls=FILL,
                                dtypes={k: v for k, v in DTYPES.items() if k in NATIVE}, batch_size=700,
                                cache_dir=tmp_path / "cache", storage_options=s3.storage_options,
                                chunk_bytes=1 << 17, device=device, decode=decode, seed=1)
    assert len(ds.reader.chunks) > 2
    for epoch in (0, 1):  # decoded from the objects, then read from the cache without a request
        if epoch == 1:
            ds.reader.cache.flush()
            s3.reset_counts()
        ds.set_epoch(epoch)
        ids = np.concatenate([expected.check(b, NATIVE) for b in ds])
        assert np.array_equal(np.sort(ids), np.arange(expected.n))
    assert s3.count() == 0, dict(s3.requests)
    if decode == "gpu":
        assert ds.reader.decode.fallbacks == 0 and ds.reader.counters.decoded == len(ds.reader.chunks)
    assert set(Path(tempfile.gettempdir()).glob("gpuload-stage-*")) <= staged  # staging files are deleted


def test_first_epoch_fetches_only_the_requested_columns(s3, bucket, tmp_path):
    name, tables, folder = bucket
    meta = pq.read_metadata(folder / "part-0.parquet")
    wanted = {"id", "f32"}
    col_bytes = sum(meta.row_group(g).column(j).total_compressed_size for g in range(meta.num_row_groups)
                    for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] in wanted)
    size = os.path.getsize(folder / "part-0.parquet")
    remote = {"coalesce_bytes": 0}  # no merging across the unwanted columns' bytes
    ds = gpuload.ParquetDataset(f"s3://{name}/data/part-0.parquet", sorted(wanted), batch_size=512,
                                cache_dir=tmp_path / "c", storage_options=s3.storage_options, remote=remote,
                                device="cpu")
    s3.reset_counts()
    n = sum(len(b["id"]) for b in ds)
    assert n == ROWS
    fetched = s3.range_bytes[f"/{name}/data/part-0.parquet"]
    assert col_bytes <= fetched <= col_bytes * 1.02 + 1024, (fetched, col_bytes, size)
    assert fetched < size / 3


def test_reopening_a_cached_dataset_reads_no_parquet_bytes(s3, bucket, tmp_path):
    name, tables, _ = bucket
    cache = tmp_path / "cache"
    gpuload.build_cache(f"s3://{name}/data/", cache, COLUMNS, chunk_bytes=120_000,
                        storage_options=s3.storage_options)
    s3.reset_counts()
    ds = _open(f"s3://{name}/data/", s3, cache)
    assert s3.count("GET", ".parquet") == 0 and s3.count("HEAD", ".parquet") == 0, dict(s3.requests)
    assert ds.reader.open_counts == {"footers_cached": N_FILES, "footers_read": 0}
    assert len(ds.reader.cached_at_open) == len(ds.reader.chunks)
    _check_equal(_rows_by_id(ds), tables)
    assert s3.count("GET", ".parquet") == 0
    assert ds.stats().remote.requests == 0


def test_a_changed_object_is_seen_in_the_listing_and_only_its_chunks_are_rebuilt(s3, bucket, tmp_path):
    name, tables, folder = bucket
    cache = tmp_path / "cache"
    ds = _open(f"s3://{name}/data/", s3, cache, shuffle=False)
    _check_equal(_rows_by_id(ds), tables)
    per_file = [sum(1 for c in ds.reader.chunks if c.file == i) for i in range(N_FILES)]
    new = _table(1, seed=7)  # same schema and rows, other values: a rewrite the size may not reveal
    pq.write_table(new, folder / "v2.parquet", row_group_size=RG)
    s3.client().upload_file(str(folder / "v2.parquet"), name, "data/part-1.parquet")
    ds2 = _open(f"s3://{name}/data/", s3, cache, shuffle=False, prefetch=0)  # loads counted: none for a next epoch
    assert ds2.reader.open_counts == {"footers_cached": N_FILES - 1, "footers_read": 1}
    got = _rows_by_id(ds2)
    assert ds2.reader.counters.decoded == per_file[1]
    assert ds2.reader.counters.from_cache == sum(per_file) - per_file[1]
    _check_equal(got, [tables[0], new, tables[2]])


def test_filesystem_objects_fsspec_and_pyarrow(s3, bucket, tmp_path):
    import pyarrow.fs as pafs
    import s3fs

    name, tables, _ = bucket
    fs = s3fs.S3FileSystem(**s3.storage_options)
    ds = gpuload.ParquetDataset(f"{name}/data", COLUMNS, filesystem=fs, batch_size=900, cache_dir=tmp_path / "a",
                                device="cpu")
    _check_equal(_rows_by_id(ds), tables)
    assert ds.reader.files[0].path.startswith("s3://") and ds.reader.files[0].tag  # the ETag
    pfs = pafs.S3FileSystem(access_key="testing", secret_key="testing", endpoint_override=s3.endpoint,
                            scheme="http", region="us-east-1")
    ds = gpuload.ParquetDataset(f"{name}/data/", COLUMNS, filesystem=pfs, batch_size=900, cache_dir=tmp_path / "b",
                                device="cpu")
    _check_equal(_rows_by_id(ds), tables)


def test_missing_objects_and_protocols_say_what_to_do(s3, bucket, tmp_path):
    name, _, _ = bucket
    with pytest.raises(SourceError, match="no such object"):
        _open(f"s3://{name}/nothing-here.parquet", s3, tmp_path / "c")
    with pytest.raises(SourceError, match="matched no Parquet"):
        _open(f"s3://{name}/data/*.csv", s3, tmp_path / "c")
    with pytest.raises(SourceError, match="not a protocol fsspec knows|needs a package"):
        gpuload.ParquetDataset("nosuchproto://x/y.parquet", cache_dir=tmp_path / "c", device="cpu")


def test_s3_requests_are_tried_by_gpuload_alone_unless_the_user_set_retries():
    """s3fs (5 tries) and botocore (5) retry too: over gpuload's 7 tries an endpoint that refused
    connections was reported after 62 s. gpuload turns theirs off, botocore's unless storage_options
    set them; s3fs's loop in any case (a user's trial: with botocore's retries set, as
    gpuload.testing.S3Server's options do, s3fs's 5 tries were left on and retries hidden)."""
    from gpuload.sources.remote import store_for

    opts = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}, "key": "k", "secret": "s"}
    fs = store_for("s3://b/x.parquet", storage_options=opts).fs
    assert fs.retries == 1 and fs.config_kwargs["retries"] == {"total_max_attempts": 1}
    assert "config_kwargs" not in opts  # the caller's dict is left as it was
    mine = {**opts, "config_kwargs": {"retries": {"max_attempts": 3}}}
    fs = store_for("s3://b/x.parquet", storage_options=mine).fs
    assert fs.config_kwargs["retries"] == {"max_attempts": 3} and fs.retries == 1


# -- plain HTTP, with latency and faults --------------------------------------------------------
@pytest.fixture
def http_files(tmp_path):
    pytest.importorskip("aiohttp")
    folder = tmp_path / "www"
    tables = [_table(i) for i in range(N_FILES)]
    for i, t in enumerate(tables):
        (folder / "d").mkdir(parents=True, exist_ok=True)
        pq.write_table(t, folder / "d" / f"part-{i}.parquet", row_group_size=RG)
    return folder, tables


FAST_RETRY = {"retries": 12, "backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 1.0}


def test_http_with_latency_and_faults_still_yields_exactly_pyarrows_rows(http_files, tmp_path):
    folder, tables = http_files
    faults = Faults(latency_s=0.02, rate=0.25, kinds=("503", "reset", "stall"), stall_s=3.0, seed=1)
    with HttpServer(folder, faults) as srv:
        urls = [srv.url(f"d/part-{i}.parquet") for i in range(N_FILES)]
        ds = gpuload.ParquetDataset(urls, COLUMNS, batch_size=800, cache_dir=tmp_path / "c", chunk_bytes=120_000,
                                    remote=FAST_RETRY, device="cpu")
        _check_equal(_rows_by_id(ds), tables)
        st = ds.stats().remote
        assert st.retried > 0 and st.failed == 0, st
        assert ds.reader.files[0].tag  # the server's ETag is the identity
        srv.faults = Faults(rate=1.0, kinds=("503",))  # every data request fails from now on
        srv.reset_counts()
        ds.set_epoch(1)
        _check_equal(_rows_by_id(ds), tables)  # cached: no request at all
        assert srv.count() == 0


def test_an_http_server_down_for_a_second_mid_epoch_costs_no_row(http_files, tmp_path):
    """fsspec's HTTP store raises FileNotFoundError(url) for a refused connection too: it is retried
    like one (a user's trial: a 3 s outage ended the epoch, "the object is gone")."""
    import threading
    import time

    folder, tables = http_files
    with HttpServer(folder) as srv:
        urls = [srv.url(f"d/part-{i}.parquet") for i in range(N_FILES)]
        ds = gpuload.ParquetDataset(urls, COLUMNS, batch_size=800, cache_dir=tmp_path / "c", chunk_bytes=120_000,
                                    remote={"retries": 20, "backoff_s": 0.05, "max_backoff_s": 0.3, "timeout_s": 2.0,
                                            "readahead_bytes": 1, "max_requests": 1}, device="cpu")
        it, got = iter(ds), []
        got.append(next(it))
        srv.stop()  # down: connections are refused
        again = threading.Timer(1.0, srv.start, kwargs={"port": srv.port})
        again.start()
        t0 = time.monotonic()
        got.extend(it)
        again.join()
        assert ds.stats().remote.retried > 0 and time.monotonic() - t0 > 0.5  # it waited for the server
        _check_equal(_rows_by_id(got), tables)


def test_an_address_nothing_answers_is_named_with_what_to_check(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SourceError, match=rf"127.0.0.1:{port}/d/x.parquet: listing: failed 3 times, last with "
                                          r"\w*Connect\w*Error: .*no connection to the store: check its address"):
        gpuload.ParquetDataset(f"http://127.0.0.1:{port}/d/x.parquet", cache_dir=tmp_path / "c", device="cpu",
                               remote=FAST_RETRY | {"retries": 2})


def test_a_store_that_fails_every_request_ends_in_a_clear_error_and_caches_nothing(http_files, tmp_path):
    folder, tables = http_files
    cache = tmp_path / "c"
    with HttpServer(folder) as srv:
        urls = [srv.url(f"d/part-{i}.parquet") for i in range(N_FILES)]
        ds = gpuload.ParquetDataset(urls, COLUMNS, batch_size=800, cache_dir=cache, remote=FAST_RETRY | {"retries": 2},
                                    device="cpu")
        srv.faults = Faults(rate=1.0, kinds=("503", "reset"))
        with pytest.raises(SourceError) as e:
            for _ in ds:
                pass
        text = str(e.value)
        assert "part-" in text and "bytes " in text and "failed 3 times" in text, text
        assert not list(cache.rglob("*.glc"))
        with pytest.raises(SourceError, match="failed 3 times"):  # at open too: footers are fetched
            gpuload.ParquetDataset(urls, COLUMNS, cache_dir=tmp_path / "other", remote=FAST_RETRY | {"retries": 2},
                                   device="cpu")


def test_a_stalled_server_times_out_instead_of_hanging(http_files, tmp_path):
    folder, _ = http_files
    with HttpServer(folder, Faults(rate=1.0, kinds=("stall",), stall_s=30)) as srv:
        with pytest.raises(SourceError, match="failed 2 times.*Timeout"):
            gpuload.ParquetDataset([srv.url("d/part-0.parquet")], ["id"], cache_dir=tmp_path / "c",
                                   remote={"retries": 1, "backoff_s": 0.01, "timeout_s": 0.5}, device="cpu")


def test_http_folder_listing(http_files, tmp_path):
    folder, tables = http_files
    with HttpServer(folder) as srv:
        ds = gpuload.ParquetDataset(srv.url("d/"), COLUMNS, batch_size=1000, cache_dir=tmp_path / "c", device="cpu")
        assert len(ds.reader.files) == N_FILES
        _check_equal(_rows_by_id(ds), tables)


# -- local sources: the footer cache ---------------------------------------------------------------
def test_local_files_are_not_opened_again_unless_written_even_with_their_old_size_and_mtime(tmp_path):
    """Reopening reads no Parquet byte of files left alone; a file rewritten in place is read again
    even when it is given back its size and mtime (an archive's or a reproducible build's fixed
    timestamps): its ctime changed, and its identity is its footer's hash (a user's trial was served
    the old values, with `cache verify` content)."""
    def table(i: int, seed: int) -> pa.Table:  # uncompressed, fixed width: the same size for other values
        rng = np.random.default_rng(seed)
        return pa.table({"id": np.arange(i * 1000, (i + 1) * 1000), "x": rng.standard_normal(1000)})

    paths = [tmp_path / "d" / f"p{i}.parquet" for i in range(2)]
    paths[0].parent.mkdir()
    for i, p in enumerate(paths):
        pq.write_table(table(i, 0), p, compression="none")
        os.utime(p, ns=(315532800 * 10**9, 315532800 * 10**9))  # 1980-01-01, as zip leaves it
    cache = tmp_path / "cache"
    kw = dict(cache_dir=cache, batch_size=1000, device="cpu", shuffle=False)
    first = {b["id"][0].item(): b["x"].numpy().copy() for b in gpuload.ParquetDataset(tmp_path / "d", ["id", "x"], **kw)}
    ds = gpuload.ParquetDataset(tmp_path / "d", ["id", "x"], **kw)
    assert ds.reader.open_counts == {"footers_cached": 2, "footers_read": 0}  # left alone: no Parquet byte
    size = paths[1].stat().st_size
    pq.write_table(table(1, 1), paths[1], compression="none")  # other values, the same size and mtime
    os.utime(paths[1], ns=(315532800 * 10**9, 315532800 * 10**9))
    assert paths[1].stat().st_size == size
    ds = gpuload.ParquetDataset(tmp_path / "d", ["id", "x"], **kw)
    assert ds.reader.open_counts == {"footers_cached": 1, "footers_read": 1}
    got = {b["id"][0].item(): b["x"].numpy().copy() for b in ds}
    assert np.array_equal(got[0], first[0])
    assert np.array_equal(got[1000], table(1, 1).column("x").to_numpy())  # the new values
    assert not np.array_equal(got[1000], first[1000])
    for p in paths:  # every byte scrambled, size and mtime kept: refused, never the cached rows
        p.write_bytes(b"\0" * p.stat().st_size)
        os.utime(p, ns=(315532800 * 10**9, 315532800 * 10**9))
    with pytest.raises(SourceError, match="p0.parquet"):
        gpuload.ParquetDataset(tmp_path / "d", ["id", "x"], **kw)


def test_any_fsspec_protocol_memory(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    tables = [_table(i) for i in range(2)]
    for i, t in enumerate(tables):
        with fs.open(f"/gl-{tmp_path.name}/part-{i}.parquet", "wb") as fh:
            pq.write_table(t, fh, row_group_size=RG)
    ds = gpuload.ParquetDataset(f"memory://gl-{tmp_path.name}/", COLUMNS, batch_size=1000, cache_dir=tmp_path / "c",
                                device="cpu")
    assert [f.path for f in ds.reader.files] == [f"memory:///gl-{tmp_path.name}/part-{i}.parquet" for i in range(2)]
    _check_equal(_rows_by_id(ds), tables)


def test_gpu_image_holds_the_chunks_columns_and_footer_only(s3, bucket, tmp_path):
    """The GPU decoder's image of a remote object (shared code, checked here with pyarrow): the
    fetched ranges in place, which a Parquet reader of the whole file reads the chunk's columns from."""
    from gpuload.gpu.decoder import chunk_image as _image

    name, tables, folder = bucket
    ds = gpuload.ParquetDataset(f"s3://{name}/data/part-2.parquet", ["id", "hist", "f32"], cache_dir=tmp_path / "c",
                                storage_options=s3.storage_options, chunk_bytes=40_000, remote={"coalesce_bytes": 0},
                                device="cpu")
    r = ds.reader
    c = r.chunks[1]
    f = r.files[c.file]
    s3.reset_counts()
    image = _image(f, c, r.specs, r.remote_reads.fetch)
    try:
        data = image.getbuffer()
        assert len(data) == f.size
        assert bytes(data[:4]) == b"PAR1"  # libcudf checks the leading magic too (pyarrow only the trailing one)
        got = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data))).read_row_groups(list(range(c.rg_start, c.rg_stop)),
                                                                                  columns=["id", "hist", "f32"])
        want = tables[2].slice(c.rg_start * RG, c.rows).select(["id", "hist", "f32"])
        assert got.equals(want)
        assert sum(s3.range_bytes.values()) < f.size / 2
        del data
    finally:
        image.close()


def test_an_object_rewritten_after_open_is_refused_not_decoded_as_the_listed_version(s3, bucket, tmp_path):
    name, tables, folder = bucket
    cache = tmp_path / "cache"
    ds = _open(f"s3://{name}/data/", s3, cache, shuffle=False)
    pq.write_table(_table(0, seed=9), folder / "v2.parquet", row_group_size=RG)
    s3.client().upload_file(str(folder / "v2.parquet"), name, "data/part-0.parquet")
    with pytest.raises(SourceError, match=r"part-0.parquet changed after the dataset was opened.*open the dataset"):
        for _ in ds:
            pass
    ds.reader.cache.flush()
    assert not any(ds.reader.is_cached(i) for i, c in enumerate(ds.reader.chunks) if c.file == 0)
    ds = _open(f"s3://{name}/data/", s3, cache, shuffle=False)  # reopened: the new version
    _check_equal(_rows_by_id(ds), [_table(0, seed=9), tables[1], tables[2]])


def test_a_shared_filesystem_sees_rewrites_made_after_its_listing(s3, bucket, tmp_path):
    import s3fs

    name, tables, folder = bucket
    fs = s3fs.S3FileSystem(**s3.storage_options)
    cols = ["id", "f64"]
    gpuload.ParquetDataset(f"{name}/data", cols, filesystem=fs, cache_dir=tmp_path / "c",
                           device="cpu")  # fills fsspec's cache
    new = _table(1, rows=ROWS + 10, seed=5)
    pq.write_table(new, folder / "v2.parquet", row_group_size=RG)
    s3.client().upload_file(str(folder / "v2.parquet"), name, "data/part-1.parquet")
    ds = gpuload.ParquetDataset(f"{name}/data/part-1.parquet", cols, filesystem=fs, cache_dir=tmp_path / "c",
                                device="cpu")
    assert ds.num_rows == ROWS + 10
    got = np.sort(np.concatenate([b["f64"].numpy() for b in ds]))
    assert np.array_equal(got, np.sort(new.column("f64").to_numpy()))


def test_s3_throttling_and_resets_are_retried(s3, bucket, tmp_path):
    name, tables, _ = bucket
    s3.faults = Faults(rate=0.3, kinds=("503", "reset"), seed=3)
    ds = _open(f"s3://{name}/data/", s3, tmp_path / "c", remote=FAST_RETRY)
    _check_equal(_rows_by_id(ds), tables)
    assert ds.stats().remote.failed == 0
    s3.faults = Faults(rate=1.0, kinds=("503",))
    with pytest.raises(SourceError, match=r"part-\d.parquet \(bytes \d+-\d+\): failed 3 times"):
        _open(f"s3://{name}/data/", s3, tmp_path / "c2", remote=FAST_RETRY | {"retries": 2})
    s3.faults = Faults()


def test_a_server_that_ignores_ranges_is_named(http_files, tmp_path):
    folder, _ = http_files
    with HttpServer(folder, ranges=False) as srv:
        with pytest.raises(SourceError, match="ignores Range requests"):
            gpuload.ParquetDataset([srv.url("d/part-0.parquet")], ["id"], cache_dir=tmp_path / "c",
                                   remote=FAST_RETRY, device="cpu")
        assert srv.count("GET") == 1  # not retried: it cannot get better


def test_nulls_in_a_remote_list_column_are_found_at_open_from_the_footer_alone(s3, tmp_path):
    """pyarrow's footers hold definition-level histograms: a null list is refused when the dataset
    opens, with no GET beyond the footer's. Polars' hold none: the first epoch finds it, without
    fetching the column twice."""
    pl = pytest.importorskip("polars")

    name = f"b{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    folder.mkdir()
    t = pa.table({"id": np.arange(1000), "hist": pa.array([[1, 2]] * 500 + [None] + [[3]] * 499,
                                                         pa.list_(pa.int64()))})
    pq.write_table(t, folder / "n.parquet", row_group_size=250)
    pl.from_arrow(t).write_parquet(folder / "p.parquet", row_group_size=250)
    s3.upload_folder(folder, name, "")
    kw = dict(batch_size=100, shuffle=False, cache_dir=tmp_path / "c", storage_options=s3.storage_options,
              device="cpu")
    with pytest.raises(gpuload.NullValuesError, match=r"'hist' has 1 null.*n.parquet"):
        gpuload.ParquetDataset(f"s3://{name}/n.parquet", ["id", "hist"], **kw)
    assert s3.count("GET", "n.parquet") == 1  # the footer only
    ds = gpuload.ParquetDataset(f"s3://{name}/p.parquet", ["id", "hist"], **kw)
    assert s3.count("GET", "p.parquet") == 1  # the footer only: the check could not tell, and fetched nothing
    with pytest.raises(gpuload.NullValuesError, match=r"'hist' has 1 null.*p.parquet \(row groups 0-3\)"):
        for _ in ds:
            pass
    ds = gpuload.ParquetDataset(f"s3://{name}/n.parquet", ["id", "hist"], fill_nulls={"hist": 0}, **kw)
    assert sum(len(b["id"]) for b in ds) == 1000


def test_hive_partitions_of_a_remote_prefix_and_a_mixed_list(s3, tmp_path):
    name = f"b{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    for day in (1, 2):
        (folder / f"day={day}").mkdir(parents=True)
        pq.write_table(pa.table({"id": np.arange(day * 100, day * 100 + 50)}), folder / f"day={day}" / "p.parquet")
    s3.upload_folder(folder, name, "t/")
    local = tmp_path / "local.parquet"
    pq.write_table(pa.table({"id": np.arange(1000, 1010)}), local)
    ds = gpuload.ParquetDataset(f"s3://{name}/t/", ["id", "day"], batch_size=20, cache_dir=tmp_path / "c",
                                storage_options=s3.storage_options, device="cpu")
    got = sorted((int(i), int(d)) for b in ds for i, d in zip(b["id"], b["day"]))
    assert got == [(i, 1) for i in range(100, 150)] + [(i, 2) for i in range(200, 250)]
    s3.reset_counts()
    ds = gpuload.ParquetDataset([f"s3://{name}/t/day=1/p.parquet", str(local)], ["id"], batch_size=20,
                                cache_dir=tmp_path / "c", storage_options=s3.storage_options, device="cpu")
    assert sorted(int(i) for b in ds for i in b["id"]) == list(range(100, 150)) + list(range(1000, 1010))


def test_a_dropped_dataset_leaves_no_request_threads(http_files, tmp_path):
    import gc
    import threading

    folder, tables = http_files
    with HttpServer(folder) as srv:
        ds = gpuload.ParquetDataset([srv.url("d/part-0.parquet")], COLUMNS, cache_dir=tmp_path / "c", device="cpu")
        rows = sum(len(b["id"]) for b in ds)  # not inside an assert: pytest would keep the iterator alive
        del ds
        assert rows == ROWS
        gc.collect()
        wait_until(lambda: not any(t.name.startswith("gpuload-fetch") for t in threading.enumerate()), timeout=30,
                   interval=0.02, what="gpuload-fetch threads still running")  # a bound for busy cores, not a measure
        assert not [t.name for t in threading.enumerate() if t.name.startswith("gpuload-fetch")]


def test_a_server_that_ignores_ranges_costs_no_whole_objects_before_the_error(tmp_path):
    """40 objects of 2 MB on a server that answers every ranged GET with the whole object (at 1 MB/s
    each, so that what it sends is what the client reads, not what socket buffers absorb): the
    footer reads stop at each answer's headers, and after the first the queued ones never start.
    What a server sends before the client hangs up grows with the client's reaction time: at 4 MB/s,
    a loaded machine's took more than a quarter of an object (0.15 s); at 1 MB/s that is 0.57 s."""
    folder = tmp_path / "big"
    rng = np.random.default_rng(0)
    for i in range(40):
        write_parquet(folder / f"part-{i:02d}.parquet", {"x": rng.integers(0, 2**62, 250_000)}, compression="none")
    size = (folder / "part-00.parquet").stat().st_size
    assert size > 2_000_000
    with HttpServer(folder, ranges=False, bandwidth=1e6) as srv:
        urls = [srv.url(f"part-{i:02d}.parquet") for i in range(40)]
        with pytest.raises(SourceError, match=r"part-\d\d.parquet: asked for bytes \d+-\d+, .*ignores Range requests"):
            gpuload.ParquetDataset(urls, ["x"], cache_dir=tmp_path / "c", remote=FAST_RETRY, device="cpu")
        sent = dict(srv.sent_bytes)
    assert max(sent.values()) < size / 4, sent  # no object sent whole (before: 33 of them, 75 MB)
    assert sum(sent.values()) < 40 * size / 8, sent


def _stalling(s3, bucket, cache):
    """The bucket's footers cached (an opening makes no GET), then every GET of an object stalls 120 s:
    a first epoch whose store hangs. Requests time out after the default 60 s."""
    name, _, _ = bucket
    _open(f"s3://{name}/data/", s3, cache)
    s3.faults = Faults(rate=1.0, kinds=("stall",), stall_s=120)
    return f"s3://{name}/data/"


def test_close_during_a_stalled_remote_epoch_stops_it_at_once(s3, bucket, tmp_path):
    import threading
    import time

    src = _stalling(s3, bucket, tmp_path / "c")
    try:
        ds = gpuload.ParquetDataset(src, COLUMNS, batch_size=256, cache_dir=tmp_path / "c", shuffle=False,
                                    storage_options=s3.storage_options, device="cpu")
        it = iter(ds)
        threading.Timer(1.0, ds.close).start()
        t0 = time.monotonic()
        with pytest.raises(SourceError, match="abandoned: the dataset was closed") as e:
            next(it)
        assert "store may be down" not in str(e.value) and "failed" not in str(e.value)  # not the store's doing
        assert time.monotonic() - t0 < 20  # before: 60 s per request, then its retries
        # an exception in the training step while later chunks' requests stall: the epoch ends at once
        s3.faults = Faults(rate=1.0, kinds=("stall",), stall_s=120, only="part-1")
        t1 = time.monotonic()
        with pytest.raises(ZeroDivisionError):
            for batch in ds:  # part-0's rows come first, part-1's are being fetched
                assert batch["id"].max() < ROWS
                1 / 0
        assert time.monotonic() - t1 < 20
        # and a new epoch works once the store answers again
        s3.faults = Faults()
        assert sum(len(b["id"]) for b in ds) == N_FILES * ROWS
    finally:
        s3.faults = Faults()


_CTRL_C = """
import json, sys, gpuload
ds = gpuload.ParquetDataset(sys.argv[1], ["id", "f32"], batch_size=256, cache_dir=sys.argv[2],
                            storage_options=json.loads(sys.argv[3]), device="cpu")
print("iterating", flush=True)
for batch in ds:
    pass
"""


@pytest.mark.slow
def test_ctrl_c_during_a_stalled_remote_epoch_exits_at_once(s3, bucket, tmp_path):
    import json
    import signal
    import subprocess
    import time

    src = _stalling(s3, bucket, tmp_path / "c")
    try:
        proc = spawn(python(_CTRL_C, src, tmp_path / "c", json.dumps(s3.storage_options)))
        assert proc.stdout.readline().strip() == "iterating"
        time.sleep(2)  # its first chunks' requests are stalled now
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the process still ran 30 s after Ctrl-C")
        assert time.monotonic() - t0 < 20
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
    finally:
        s3.faults = Faults()


def test_a_vocabulary_is_counted_from_the_columns_ranges_and_then_read_from_the_cache(s3, tmp_path):
    """Counting fetches only the counted column's bytes; a second opening makes no request."""
    import collections

    name = f"v{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    folder.mkdir()
    rng = np.random.default_rng(5)
    words = [f"w{int(r)}" for r in rng.zipf(1.5, 2 * 2000) % 300]
    for k in range(2):
        pq.write_table(pa.table({"w": words[k * 2000:(k + 1) * 2000], "pad": rng.random(2000)}),
                       folder / f"part-{k}.parquet", row_group_size=500)
    s3.upload_folder(folder, name, "data/")
    url = f"s3://{name}/data/"
    kw = dict(storage_options=s3.storage_options, shuffle=False, batch_size=4000)
    open_dataset(url, ["pad"], tmp_path / "c", **kw)  # footers kept: the next opening's requests are the count's
    s3.reset_counts()
    ds = open_dataset(url, ["w"], tmp_path / "c", categorical={"w": gpuload.Vocab()}, **kw)
    counts = collections.Counter(words)
    order = sorted(counts, key=lambda v: (-counts[v], v.encode()))
    assert ds.vocabulary("w").to_dict() == {v: i for i, v in enumerate(order, 1)}
    w_bytes = sum(pq.read_metadata(folder / f"part-{k}.parquet").row_group(g).column(0).total_compressed_size
                  for k in range(2) for g in range(4))
    pad_bytes = sum(pq.read_metadata(folder / f"part-{k}.parquet").row_group(g).column(1).total_compressed_size
                    for k in range(2) for g in range(4))
    asked = sum(s3.range_bytes.values())
    assert 0 < asked < w_bytes + pad_bytes / 4, (asked, w_bytes, pad_bytes)  # the column's ranges, not the rest
    s3.reset_counts()
    again = open_dataset(url, ["w"], tmp_path / "c", categorical={"w": gpuload.Vocab()}, **kw)
    assert s3.count("GET", ".parquet") == 0, dict(s3.requests)  # listing only: no object read
    assert again.vocabulary("w").digest == ds.vocabulary("w").digest


def test_a_filter_on_s3_fetches_no_byte_of_the_row_groups_its_statistics_exclude(s3, bucket, tmp_path):
    """ids rise through the objects: keeping ids >= 7,500 keeps the last 3 of part-2's 6 row
    groups; the other objects' and row groups' column bytes are never asked for."""
    name, tables, folder = bucket
    f = [("id", ">=", 7500), ("i8", ">", 0)]
    s3.reset_counts()  # from the open on: its footer reads and the filter's counting included
    ds = gpuload.ParquetDataset(f"s3://{name}/data/", ["id", "f64"], filters=f, cache_dir=tmp_path / "c",
                                storage_options=s3.storage_options, remote={"coalesce_bytes": 0}, device="cpu",
                                batch_size=256)
    got = np.sort(np.concatenate([b["id"].numpy() for b in ds]))
    want = np.sort(pq.read_table(folder, filters=f)["id"].to_numpy())
    assert np.array_equal(got, want) and ds.num_rows == len(want) > 0
    meta = pq.ParquetFile(folder / "part-2.parquet").metadata
    idx = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    size = {c: sum(meta.row_group(g).column(idx[c]).total_compressed_size for g in (3, 4, 5)) for c in ("id", "f64", "i8")}
    allowed = size["id"] + size["i8"] + sum(size.values())  # counted at open (the filter's columns), then read
    for k in (0, 1):  # the other objects: their footers only
        footer = pq.ParquetFile(folder / f"part-{k}.parquet").metadata.serialized_size + 8
        assert s3.range_bytes[f"/{name}/data/part-{k}.parquet"] <= max(footer, 64 << 10)
    tail = meta.serialized_size + 8
    assert s3.range_bytes[f"/{name}/data/part-2.parquet"] <= allowed * 1.02 + max(tail, 64 << 10) + 1024


def test_a_column_older_objects_lack_is_nulls_there(s3, tmp_path):
    """Schema evolution in a bucket: the objects written before a column was added read it as nulls (the fill
    value), and every value of the newer ones is pyarrow's, over S3 as from the disk."""
    name = f"b{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    folder.mkdir()
    pq.write_table(pa.table({"id": np.arange(0, 50)}), folder / "old.parquet", row_group_size=20)
    pq.write_table(pa.table({"id": np.arange(50, 90), "w": np.arange(40) * 0.25,
                             "l": pa.array([[i] * (i % 3) for i in range(40)])}), folder / "new.parquet",
                   row_group_size=20)
    s3.upload_folder(folder, name, "data/")
    ds = gpuload.ParquetDataset(f"s3://{name}/data/", ["id", "w", "l"], fill_nulls={"w": -1.0, "l": 0},
                                storage_options=s3.storage_options, cache_dir=tmp_path / "c", device="cpu",
                                batch_size=16)
    got = {}
    for b in ds:
        values, offsets = b["l"].values.tolist(), b["l"].offsets.tolist()
        for k, (i, w) in enumerate(zip(b["id"].tolist(), b["w"].tolist())):
            got[i] = (w, values[offsets[k]:offsets[k + 1]])
    assert got == {**{i: (-1.0, []) for i in range(50)}, **{50 + i: (i * 0.25, [i] * (i % 3)) for i in range(40)}}


def test_a_failed_open_does_not_wait_for_stalled_footer_reads(s3, bucket, tmp_path):
    """One object's footer is not Parquet while another's GETs stall: the open fails at once,
    naming the bad object, instead of waiting out the stalled read's timeouts and retries (the same
    path as Ctrl-C during an open, which then exits at once)."""
    import time

    name, _, folder = bucket
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "part-9.parquet").write_bytes(b"not parquet at all, just bytes" * 10)
    s3.upload_folder(bad, name, "data/")
    s3.faults = Faults(rate=1.0, kinds=("stall",), stall_s=120, only="part-1")
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="part-9.parquet"):
        gpuload.ParquetDataset(f"s3://{name}/data/", COLUMNS, cache_dir=tmp_path / "c", device="cpu",
                               storage_options=s3.storage_options)
    assert time.monotonic() - t0 < 15  # before: 60 s per try of part-1's footer, 7 tries
    s3.faults = Faults()


def test_many_small_objects_are_packed_fetched_ahead_and_exact(s3, tmp_path):
    """70 objects of 40 rows beside one of 3,000: the small ones are packed several to a chunk
    (gpuload.packs.pack_small), each object's columns fetched ahead of its pack's decoding; every row
    once, as pyarrow reads it; a cached epoch makes no request."""
    name = f"b{uuid.uuid4().hex[:12]}"
    folder = tmp_path / "src"
    folder.mkdir()
    tables = [_table(100, rows=3000)] + [_table(i, rows=40) for i in range(70)]
    for i, t in enumerate(tables):
        pq.write_table(t, folder / f"part-{i:03}.parquet", row_group_size=RG)
    s3.upload_folder(folder, name, "data/")
    s3.faults = Faults()
    ds = open_dataset(f"s3://{name}/data/", COLUMNS, tmp_path / "cache", batch_size=700,
                      storage_options=s3.storage_options, seed=4)
    packs = [c for c in ds.reader.chunks if c.parts]
    assert sum(len(c.parts) for c in packs) >= 30 and len(ds.reader.chunks) < 50
    _check_equal(_rows_by_id(ds), tables)
    reads = ds.reader.remote_reads
    assert reads.ahead_used >= 30 and reads._ahead == {} and reads._ahead_bytes == 0
    s3.reset_counts()
    ds.set_epoch(1)
    _check_equal(_rows_by_id(ds), tables)
    assert s3.count() == 0, dict(s3.requests)
    ds.close()
