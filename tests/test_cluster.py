"""Cache builds on a real Dask cluster (``distributed.LocalCluster``, worker processes).

* a parallel build is byte-identical to a serial one, builds each chunk once, and a
  dataset opened on it then reads no Parquet file;
* a worker killed with SIGKILL mid-build loses nothing: the build completes, every file
  in the cache is whole and verified;
* node-affine builds: each node's workers (their own ``$GPULOAD_CACHE_DIR``) build
  exactly the chunks ``ParquetDataset(shard="node")`` gives that node, also when a node's
  only worker is killed and its nanny starts it on another port;
* errors on a worker name the chunk and its file; bad ``nodes=`` are refused.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpuload
import gpuload.cluster
import gpuload.decode
from gpuload.cache.store import ChunkCache

from conftest import at_once, run_with_timeout, write_parquet

distributed = pytest.importorskip("distributed")  # the dask extra; in [dev], so CI runs these

pytestmark = pytest.mark.slow  # Dask clusters of worker processes

CHUNK = 64 << 10


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cluster_src")
    rng = np.random.default_rng(2)
    start = 0
    for i, n in enumerate((30_000, 20_000, 25_000)):
        write_parquet(d / f"part{i}.parquet", pa.table({
            "row_id": np.arange(start, start + n, dtype=np.int64), "x": rng.standard_normal(n),
            "h": pa.array([list(range(k)) for k in rng.integers(0, 4, n)], pa.list_(pa.int32()))}),
            row_group_size=2500)
        start += n
    return d


@pytest.fixture(scope="module")
def cluster():
    # 2 threads per worker, as the CLI starts them: a worker builds (and flushes) 2 chunks at once
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=None,
                                  silence_logs=40) as c, distributed.Client(c) as client:
        yield client


def _files(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in cache.rglob("*.glc")}


def _reads_no_parquet(source, cache, monkeypatch, **kw) -> None:
    opened = []
    real = pq.ParquetFile

    def counting(*a, **k):
        opened.append(a[0] if a else k.get("source"))
        return real(*a, **k)

    monkeypatch.setattr(pq, "ParquetFile", counting)
    monkeypatch.setattr(gpuload.decode.pq, "ParquetFile", counting)
    ds = gpuload.ParquetDataset(source, cache_dir=cache, device="cpu", chunk_bytes=CHUNK, batch_size=4096, **kw)
    ids = np.concatenate([b["row_id"].numpy() for b in ds])
    assert len(np.unique(ids)) == len(ids) == ds.rows_per_epoch
    assert opened == [] and ds.reader.counters.decoded == 0
    monkeypatch.undo()


def test_cluster_build_equals_serial_build(source, tmp_path, cluster, monkeypatch):
    serial = gpuload.build_cache(source, tmp_path / "serial", chunk_bytes=CHUNK)
    rows = []
    summary = gpuload.build_cache(source, tmp_path / "cluster", chunk_bytes=CHUNK, client=cluster,
                                  progress=rows.append)
    assert summary.chunks == serial.chunks > 8 and summary.built == summary.chunks  # each chunk built once
    assert sum(rows) == summary.rows == 75_000
    assert _files(tmp_path / "cluster") == _files(tmp_path / "serial")  # byte for byte
    again = gpuload.build_cache(source, tmp_path / "cluster", chunk_bytes=CHUNK, client=cluster)
    assert again.built == 0 and again.already_cached == again.chunks
    _reads_no_parquet(source, tmp_path / "cluster", monkeypatch)


def test_worker_killed_mid_build_loses_nothing(source, tmp_path, cluster):
    pids = cluster.run(os.getpid)
    victim = sorted(pids.values())[0]
    done, killed = [], threading.Event()

    def progress(n):
        done.append(n)
        if len(done) == 3 and not killed.is_set():
            os.kill(victim, signal.SIGKILL)  # mid-build: the other chunks are queued or being built
            killed.set()

    summary = gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK // 4, client=cluster, progress=progress)
    assert killed.is_set() and summary.not_cached == 0 and sum(done) == summary.rows
    assert summary.built == summary.chunks  # chunks finished before the kill are not built (or counted) again
    assert ChunkCache(tmp_path / "c", create=False).verify_all() == []  # every file whole and verified
    serial = gpuload.build_cache(source, tmp_path / "serial", chunk_bytes=CHUNK // 4)
    assert _files(tmp_path / "c") == _files(tmp_path / "serial")  # every chunk whole, none missing
    assert serial.chunks == summary.chunks
    cluster.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker


def _two_nodes(caches, per_node=1):
    """A cluster of two simulated nodes, workers w0, w1 (or w0a, w0b, w1a, w1b), each node's
    workers with its own $GPULOAD_CACHE_DIR (a node-local cache)."""
    names = [(f"w{n}", n) for n in (0, 1)] if per_node == 1 else [(f"w{n}{x}", n) for n in (0, 1) for x in "ab"]
    workers = {name: {"cls": distributed.Nanny, "options": {"nthreads": 1, "dashboard": False, "env": {
        "GPULOAD_CACHE_DIR": str(caches[n])}}} for name, n in names}
    scheduler = {"cls": distributed.Scheduler, "options": {"dashboard": False}}
    return distributed.SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40)


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")  # the module's cluster has the dashboard port
def test_node_affine_build_puts_each_chunk_on_its_node(source, tmp_path):
    caches = [tmp_path / "node0", tmp_path / "node1"]
    with _two_nodes(caches, per_node=2) as spec, distributed.Client(spec) as client:
        victim = client.run(os.getpid, workers=[a for a, w in client.scheduler_info()["workers"].items()
                                                if w["name"] == "w0a"])
        done = []

        def progress(n):  # a worker of node 0 is killed mid-build: the other one of node 0 builds its chunks
            done.append(n)
            if len(done) == 2:
                os.kill(next(iter(victim.values())), signal.SIGKILL)

        summary = gpuload.build_cache(source, None, chunk_bytes=CHUNK, client=client,
                                      nodes=[["w0a", "w0b"], ["w1a", "w1b"]], seed=7, progress=progress)
        again = gpuload.build_cache(source, None, chunk_bytes=CHUNK, client=client,
                                    nodes=[["w0b"], ["w1a", "w1b"]], seed=7)
    assert again.built == 0 and again.already_cached == again.chunks
    assert summary.built == summary.chunks and len(done) == summary.chunks
    _each_node_holds_its_share(source, caches)


def _each_node_holds_its_share(source, caches) -> None:
    ranks = [gpuload.ParquetDataset(source, cache_dir=caches[r], device="cpu", chunk_bytes=CHUNK, seed=7,
                                    rank=r, world_size=2, shard="node", local_world_size=1) for r in (0, 1)]
    owned = ranks[0].node_chunks()
    for n in (0, 1):
        files = list(caches[n].rglob("*.glc"))
        assert len(files) == len(owned[n]) > 0  # exactly its share
        assert {ranks[0].reader.key(i).name for i in owned[n]} == {f.name for f in files}
        ds = ranks[n]
        ds.set_epoch(1)
        list(ds)
        assert ds.reader.counters.decoded == 0  # the node's share is all there


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_a_node_whose_only_worker_restarts_on_another_port_builds_its_chunks(source, tmp_path):
    caches = [tmp_path / "node0", tmp_path / "node1"]
    with _two_nodes(caches) as spec, distributed.Client(spec) as client:
        def w0() -> dict:
            return {a: w for a, w in gpuload.cluster._workers(client).items() if w["name"] == "w0"}

        before = w0()
        victim = client.run(os.getpid, workers=list(before))
        done = []

        def progress(n):  # node 0's only worker is killed; its nanny starts it again, on another port
            done.append(n)
            if len(done) == 2:
                os.kill(next(iter(victim.values())), signal.SIGKILL)

        summary = gpuload.build_cache(source, None, chunk_bytes=CHUNK, client=client, nodes=[["w0"], ["w1"]],
                                      seed=7, progress=progress)
        after = w0()
    assert summary.built == summary.chunks and len(done) == summary.chunks
    assert len(after) == 1 and set(after).isdisjoint(before)  # the chunks went to the new address
    _each_node_holds_its_share(source, caches)


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_a_chunk_that_keeps_crashing_its_restarted_worker_fails_the_build(source, tmp_path):
    """Each time its worker comes back on another port, a chunk is given to it under a new key;
    Dask's count of the deaths it saw must carry over, or a crashing chunk is retried forever."""
    import re

    import dask
    from distributed.diagnostics.plugin import WorkerPlugin

    class CrashOnChunk0(WorkerPlugin):  # defined here: pickled by value to the worker processes
        def transition(self, key, start, finish, **kw):
            if finish == "executing" and re.fullmatch(r"gpuload-build-[0-9a-f]+-0(-\d+)?", str(key)):
                os._exit(1)  # like a chunk that runs its worker out of memory, every time

    with dask.config.set({"distributed.scheduler.allowed-failures": 1}), \
            _two_nodes([tmp_path / "n0", tmp_path / "n1"]) as spec, distributed.Client(spec) as client:
        client.register_plugin(CrashOnChunk0())
        with pytest.raises(gpuload.CacheError, match=r"chunk 0 \(.*part0\.parquet, row groups 0-\d+\): the workers "
                                                      r"building it kept dying \(2 workers died while it (and \d+ other chunks were|was) given to them"):
            run_with_timeout(lambda: gpuload.build_cache(source, None, chunk_bytes=CHUNK, client=client,
                                                         nodes=[["w0"], ["w1"]], seed=7), timeout=120)


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_a_node_left_without_workers_fails_the_build(source, tmp_path, monkeypatch):
    import gpuload.cluster

    monkeypatch.setattr(gpuload.cluster, "NODE_GRACE_S", 2.0)
    with _two_nodes([tmp_path / "n0", tmp_path / "n1"]) as spec, distributed.Client(spec) as client:
        done = []

        def progress(n):  # node 1's only worker goes away for good (its nanny too)
            done.append(n)
            if len(done) == 1:
                threading.Thread(target=lambda: client.sync(spec.workers["w1"].close)).start()

        with pytest.raises(gpuload.CacheError, match=r"node 1 \(tcp://.*\) has had no worker for 2 s: its chunks, chunk "):
            gpuload.build_cache(source, None, chunk_bytes=CHUNK // 4, client=client, nodes=[["w0"], ["w1"]],
                                progress=progress)


def test_worker_errors_name_the_chunk_and_file(tmp_path, cluster):
    write_parquet(tmp_path / "src" / "good.parquet", {"v": np.arange(20_000, dtype=np.int64)}, row_group_size=5000)
    bad = write_parquet(tmp_path / "src" / "bad.parquet", {"v": np.arange(20_000, dtype=np.int64)},
                        row_group_size=5000, compression="none")
    meta = pq.read_metadata(bad)
    col = meta.row_group(2).column(0)
    data = bytearray(bad.read_bytes())
    start = col.data_page_offset + 40
    data[start:start + 2000] = os.urandom(2000)  # garbage in row group 2's data page; the footer stays valid
    bad.write_bytes(bytes(data))
    with pytest.raises(gpuload.GpuloadError, match=r"chunk \d+ \(.*bad\.parquet, row groups 2-2\)"):
        gpuload.build_cache(tmp_path / "src", tmp_path / "c", chunk_bytes=4096, client=cluster)


def test_bad_nodes_are_refused(source, tmp_path, cluster):
    with pytest.raises(gpuload.ConfigError, match="nodes=3: the cluster's workers run on 1 hosts"):
        gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK, client=cluster, nodes=3)
    with pytest.raises(gpuload.ConfigError, match=r"nodes\[1\]=\['nowhere'\]"):
        gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK, client=cluster,
                            nodes=[list(cluster.scheduler_info()["workers"]), ["nowhere"]])
    with pytest.raises(gpuload.ConfigError, match="pass client= too"):
        gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK, nodes=2)


def test_progress_bar_counts_every_row(source, tmp_path, cluster, capsys):
    summary = gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK, client=cluster, progress=True)
    err = capsys.readouterr().err
    assert "building cache" in err and "75.0k/75.0k" in err and summary.built == summary.chunks


def test_two_cluster_builds_at_once_count_what_each_did(source, tmp_path, cluster):
    """Two cluster builds of one cache at the same time (they used to both report every
    chunk as built): each chunk is built by one of them, and each says how many the other built."""
    def build():
        return gpuload.build_cache(source, tmp_path / "c", chunk_bytes=CHUNK // 4, client=cluster)

    a, b = at_once(build, build)
    n = a.chunks
    assert a.built + b.built == n and a.built_elsewhere == b.built and b.built_elsewhere == a.built
    for s in (a, b):
        assert s.already_cached == 0 and s.not_cached == 0
        assert s.built + s.built_elsewhere == n, str(s)
    assert ChunkCache(tmp_path / "c", create=False).verify_all() == []


def test_categorical_columns_build_on_the_cluster_as_serially(tmp_path, cluster):
    """Hashed and counted ids built by the workers: byte for byte the serial build's files, the
    vocabulary counted once (by the caller) and read by every worker from the shared cache."""
    rng = np.random.default_rng(8)
    for i in range(3):
        words = [None if k % 11 == 0 else f"w{int(r)}" for k, r in enumerate(rng.zipf(1.4, 8000) % 200)]
        write_parquet(tmp_path / "src" / f"part{i}.parquet", pa.table({
            "row_id": np.arange(i * 8000, (i + 1) * 8000), "w": words,
            "tags": pa.array([[f"t{(k * j) % 30}" for j in range(k % 3)] for k in range(8000)],
                             pa.list_(pa.string()))}), row_group_size=1000)
    kw = dict(columns=["row_id", "w", "tags"], chunk_bytes=CHUNK,
              categorical={"w": gpuload.Vocab(min_count=2), "tags": gpuload.Hash(1000)})
    serial = gpuload.build_cache(tmp_path / "src", tmp_path / "serial", **kw)
    built = gpuload.build_cache(tmp_path / "src", tmp_path / "cluster", client=cluster, **kw)
    assert built.built == built.chunks == serial.chunks > 3
    assert _files(tmp_path / "cluster") == _files(tmp_path / "serial")
    assert len(list((tmp_path / "cluster").rglob("*.vocab"))) == 1


def test_a_transform_travels_to_the_workers_and_builds_what_a_serial_build_does(source, tmp_path, cluster):
    """The function is pickled to the worker processes (a lambda: by value, as Dask pickles it)."""
    import torch

    t = gpuload.Transform(lambda o: {"row_id": o["row_id"], "x2": (o["x"] * 2).to(torch.float32),
                                     "n": o["h"].offsets[1:] - o["h"].offsets[:-1]}, key="x2-v1")
    serial = gpuload.build_cache(source, tmp_path / "serial", chunk_bytes=CHUNK, transform=t)
    summary = gpuload.build_cache(source, tmp_path / "cluster", chunk_bytes=CHUNK, client=cluster, transform=t)
    assert summary.built == summary.chunks == serial.chunks and summary.outputs == ("row_id", "x2", "n")
    assert _files(tmp_path / "cluster") == _files(tmp_path / "serial")
    ds = gpuload.ParquetDataset(source, cache_dir=tmp_path / "cluster", device="cpu", chunk_bytes=CHUNK,
                                batch_size=4096, transform=t, shuffle=False)
    got = {k: torch.cat([b[k] for b in ds]) for k in ("row_id", "x2", "n")}
    assert ds.reader.counters.decoded == 0
    table = pq.read_table(source)
    assert np.array_equal(got["row_id"].numpy(), table["row_id"].to_numpy())
    assert np.array_equal(got["x2"].numpy(), (table["x"].to_numpy() * 2).astype(np.float32))
    assert np.array_equal(got["n"].numpy(), pa.compute.list_value_length(table["h"]).to_numpy())


def test_a_filtered_cluster_build_is_the_serial_one(source, tmp_path, cluster):
    f = [("row_id", ">=", 40_000), ("x", ">", 0.0)]
    serial = gpuload.build_cache(source, tmp_path / "serial", chunk_bytes=CHUNK, filters=f)
    summary = gpuload.build_cache(source, tmp_path / "cluster", chunk_bytes=CHUNK, client=cluster, filters=f)
    assert summary.built == summary.chunks == serial.chunks and summary.rows == serial.rows
    assert _files(tmp_path / "cluster") == _files(tmp_path / "serial")
    ds = gpuload.ParquetDataset(source, cache_dir=tmp_path / "cluster", device="cpu", chunk_bytes=CHUNK,
                                batch_size=4096, filters=f)
    ids = np.sort(np.concatenate([b["row_id"].numpy() for b in ds]))
    assert ds.reader.counters.decoded == 0
    assert np.array_equal(ids, np.sort(pq.read_table(source, filters=f)["row_id"].to_numpy()))


def test_workers_must_see_the_callers_paths_only_where_they_build_into_its_cache(source, tmp_path):
    """A worker whose files lie elsewhere has the caller's fingerprint (the order is the same), but
    chunks built into a shared cache under its paths would be none of the caller's: refused there,
    allowed where each worker builds into its own cache."""
    import shutil

    from gpuload.config import Options, Source
    from gpuload.reader import open_reader

    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    here, there = (open_reader(Source.of({"source": d, "columns": ["x"]}),
                               Options.of({"cache_dir": tmp_path / "c", "device": "cpu"})) for d in (source, moved))
    try:
        assert here.fingerprint == there.fingerprint
        assert gpuload.cluster._sameness(here, True) == gpuload.cluster._sameness(there, True)
        assert gpuload.cluster._sameness(here, False) != gpuload.cluster._sameness(there, False)
    finally:
        here.close()
        there.close()


def test_a_build_for_node_shards_makes_the_chunks_a_node_shard_asks_for(small_files, tmp_path, capsys):
    """shard='node' never packs small files (its nodes own whole chunks): a build with nodes= makes
    a chunk per file, as such a training asks for, and `cache info SOURCE --nodes` counts those."""
    from gpuload.tools.cli import main

    root, paths, _ = small_files
    cache = tmp_path / "c"
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None,
                                  silence_logs=40) as c, distributed.Client(c) as client:
        summary = gpuload.build_cache(root, cache, ["row_id", "x"], client=client, nodes=1)
    ds = gpuload.ParquetDataset(root, ["row_id", "x"], cache_dir=cache, device="cpu", shard="node", rank=0,
                                world_size=1, local_world_size=1)
    assert summary.chunks == len(ds.reader.chunks) == len(paths)
    assert ds.reader.cached_at_open == set(range(len(paths)))
    ds.close()
    capsys.readouterr()
    assert main(["cache", "info", str(root), "--nodes", "1", "--columns", "row_id,x", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"({len(paths)} chunks; shard='node'" in out and f"{len(paths)} cached here" in out
