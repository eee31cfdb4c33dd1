"""Metrics of a real ParquetDataset, the diagnosis of injected slow stages, and `gpuload profile`.

These run the real pipeline on the real clock, so no assertion compares figures that a busy
machine could bring close: an injected delay is a lower bound on the stage it slows, and it
outweighs every other stage's CPU work many times over (cache writes, whose fsync waits on
the disk, are kept off the disk where a test compares stages).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

import gpuload
from gpuload import decode as decode_mod
from gpuload.cache.chunkfile import LAYOUT_DIR
from gpuload.tools.cli import main
from gpuload.tools.profile import disk_read_gbps, profile

from conftest import dataset_factory, write_parquet


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        n = 20_000
        write_parquet(tmp_path / "data" / f"p{i}.parquet",
                      {"x": rng.standard_normal(n), "y": rng.integers(0, 100, n)}, row_group_size=5_000)
    return tmp_path / "data"


def _run(ds, step_s: float = 0.0, epoch: int = 0):
    ds.set_epoch(epoch)
    ds.reset_stats()
    for _ in ds:
        if step_s:
            time.sleep(step_s)
    return ds.stats()


@pytest.fixture
def no_fsync(monkeypatch):
    """Cache writes without fsync: a shared disk's latency does not bear on what limits reads and decodes."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


_ds = dataset_factory(batch_size=2_000, chunk_bytes=80_000, shuffle_window=1)


def test_dataset_records_every_stage_it_runs(data, tmp_path):
    ds = _ds(data, tmp_path / "cache", prefetch=0)  # each epoch's stages its own: no next epoch's reads in them
    cold = _run(ds)
    assert cold.rows == ds.num_rows and cold.batches == len(ds)
    for stage in ("read", "decode", "convert", "cache_write", "batch"):
        assert cold.stages[stage].seconds > 0, stage
    assert cold.stages["decode"].rows == ds.num_rows  # every chunk decoded once
    assert "cache_read" not in cold.stages
    warm = _run(ds, epoch=1)
    assert warm.stages["cache_read"].rows == ds.num_rows and "decode" not in warm.stages
    assert warm.stages["cache_read"].nbytes == ds.num_rows * 16  # float64 + int64 per row
    assert 0 <= warm.starvation <= 1 and warm.passes == 1


def test_starvation_of_a_slow_consumer_is_near_zero(data, tmp_path):
    ds = _ds(data, tmp_path / "cache", batch_size=4_000)
    _run(ds)
    # 20 steps of 150 ms; a cached batch takes well under 1 ms. Few, long steps: each next() that finds
    # no batch ready (its loader thread not scheduled on busy cores) costs a wake-up, and the whole
    # epoch must wait under 5% (the diagnosis's rule) of 3 s, the first window's load included
    s = _run(ds, step_s=0.15, epoch=1)
    assert s.starvation < 0.05  # only the first window's load is waited for
    d = gpuload.diagnose(s, threads=ds.options.num_threads)
    assert d.limiting == "step" and "the step itself is the bottleneck" in d.message


class _SlowReader:
    """pyarrow's Parquet reader (``ParquetFile.reader``) with each ``read_row_groups`` 80 ms slower."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_row_groups(self, *a, **k):
        time.sleep(0.08)
        return self._inner.read_row_groups(*a, **k)


def test_injected_slow_decode_is_named(data, tmp_path, monkeypatch, no_fsync):
    real = pq.ParquetFile.__init__

    def slow(self, *a, **k):  # pyarrow's decoding, made slow (called as ParquetFile or through its .reader)
        real(self, *a, **k)
        self.reader = _SlowReader(self.reader)

    monkeypatch.setattr(pq.ParquetFile, "__init__", slow)
    ds = _ds(data, tmp_path / "cache", num_threads=1)
    s = _run(ds, step_s=0.001)
    d = gpuload.diagnose(s, threads=1)
    assert s.starvation > 0.5  # 80 ms or more per chunk against a 1 ms step: about 0.95
    assert s.stages["decode"].seconds >= 0.08 * len(ds.reader.chunks)
    assert d.limiting == "decode" and "first epoch is decode-bound on the CPU" in d.message
    assert "gpuload cache build" in d.action and "device=cuda" in d.action


def test_injected_throttled_reader_is_named(data, tmp_path, monkeypatch, no_fsync):
    real = decode_mod._TimedFile._pread

    def throttled(self, start, end):
        # remote storage: every read waits, about 100x a chunk's decode (1-2 ms of CPU): the decodes, which
        # busy cores stretch, stay far behind (0.05 s, 30x, was not enough on a loaded machine)
        time.sleep(0.15)
        return real(self, start, end)

    monkeypatch.setattr(decode_mod._TimedFile, "_pread", throttled)
    ds = _ds(data, tmp_path / "cache", num_threads=1)
    s = _run(ds, step_s=0.001)
    d = gpuload.diagnose(s, threads=1)
    assert d.limiting == "read" and "reader is throttled" in d.message
    assert s.stages["read"].seconds >= 0.15 * s.stages["read"].calls > s.stages["decode"].seconds


def test_profile_reports_each_epoch_and_writes_one_trace(data, tmp_path):
    trace = tmp_path / "t.json"
    reports = profile(data, epochs=2, step_ms=1.0, trace=trace, batch_size=2_000, chunk_bytes=80_000,
                      device="cpu", cache_dir=tmp_path / "cache")
    assert [r.decoded_chunks > 0 for r in reports] == [True, False]
    chunks = len(gpuload.ParquetDataset(data, chunk_bytes=80_000, device="cpu", cache_dir=tmp_path / "cache").reader.chunks)
    assert reports[0].cached_chunks + reports[1].cached_chunks == chunks  # each read once: epoch 1's first, ahead
    assert "decodes and caches" in str(reports[0]) and "reads the cache" in str(reports[1])
    # the first epoch reads the second's first chunks ahead, from the cache it wrote: said so (a user's
    # trial read "1 chunks decoded, 1 read from the cache" of a one-chunk dataset as a contradiction)
    assert reports[0].cached_chunks > 0 and "the next epoch's first among them, read ahead" in str(reports[0])
    assert "read ahead" not in str(reports[1]).replace("read ahead by epoch 0", "")  # the last epoch loads nothing
    # for one that will not come; it says where its first chunks came from (a user's trial read "0 chunks decoded,
    # 0 read from the cache" of an epoch whose every chunk had been read ahead)
    taken = chunks - reports[1].cached_chunks
    assert reports[1].taken_ahead == taken > 0 and f", {taken} read ahead by epoch 0)" in str(reports[1])
    assert reports[0].taken_ahead == 0 and "read ahead by" not in str(reports[0])
    (one,) = profile(data, epochs=1, step_ms=1.0, batch_size=2_000, chunk_bytes=80_000, device="cpu",
                     cache_dir=tmp_path / "cache1")
    assert one.decoded_chunks > 0 and one.cached_chunks == 0 and "read ahead" not in str(one)  # a new user's trial
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"decode", "cache_read", "wait", "step"} <= names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # the two epochs share one time line: cache reads come after every decode
    assert min(e["ts"] for e in spans if e["name"] == "cache_read") > max(
        e["ts"] for e in spans if e["name"] == "decode")


def test_an_epoch_of_few_batches_is_flagged_and_cache_off_is_named(data, tmp_path):
    """A user's trial profiled 60,000 rows at the default 65,536-row batch: one batch an epoch, its
    starvation and advice printed as if measured; now flagged (the 40-batch epochs above are not)."""
    few = profile(data, epochs=1, step_ms=0.0, batch_size=40_000, device="cpu", cache_dir=tmp_path / "c")
    assert "only 2 batches in this epoch: the figures are mostly its start" in str(few[0])
    many = profile(data, epochs=2, step_ms=0.0, batch_size=2_000, device="cpu", cache_dir=tmp_path / "c2",
                   cache_io="off")
    assert all("only" not in str(r) and "decodes, cache_io='off'" in str(r) for r in many)
    assert [r.decoded_chunks > 0 and r.cached_chunks == 0 for r in many] == [True, True]


def test_profile_cli_prints_a_diagnosis(data, tmp_path, capsys):
    rc = main(["profile", str(data), "--device", "cpu", "--epochs", "2", "--step-ms", "1", "--batch-size", "2000",
               "--cache-dir", str(tmp_path / "cache"), "--trace", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("starvation") >= 2 and "limited by:" in out and "action:" in out
    assert "trace written to" in out and json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_headspace_runs_the_loader_alone_on_a_cache_of_its_own(data, tmp_path, capsys, monkeypatch):
    """The headspace epochs decode into a temporary cache (the user's is filled by the step-bound
    run alone), deliver the same rows, and the report says which side limits: with a 20 ms step
    on 10 batches an epoch, the step."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the headspace cache goes
    reports = profile(data, epochs=2, step_ms=20.0, headspace=True, batch_size=8_000, chunk_bytes=80_000,
                      device="cpu", cache_dir=tmp_path / "cache")
    assert [r.decoded_chunks > 0 for r in reports] == [True, False]  # the user's cache: cold, then warm
    for r in reports:
        assert r.headspace is not None and r.headspace.rows == r.stats.rows == 80_000
        assert r.stats.step_mean_s >= 0.02 and r.headspace.step_mean_s < r.stats.step_mean_s  # no step alone
    assert "empty cache" in reports[0].bound() and "full cache" in reports[1].bound()
    assert reports[1].bound() in str(reports[1])
    assert list((tmp_path / "tmp").iterdir()) == []  # its cache removed
    rc = main(["profile", str(data), "--device", "cpu", "--epochs", "1", "--step-ms", "1", "--batch-size", "8000",
               "--cache-dir", str(tmp_path / "cache2"), "--headspace"])
    assert rc == 0 and "headspace (the loader alone, no step, empty cache)" in capsys.readouterr().out


def test_a_block_shuffled_gather_is_timed_against_a_row_shuffled_one(data, tmp_path):
    from gpuload.tools.profile import block_gather_ratio

    ds = _ds(data, tmp_path / "cache", batch_size=2_000, shuffle_window=4)
    list(ds)
    ratio = block_gather_ratio(ds)
    assert ratio is not None and ratio > 0  # its value is bench_whatif's to judge
    assert block_gather_ratio(_ds(data, tmp_path / "c2", shuffle="block")) is None  # block already
    assert block_gather_ratio(_ds(data, tmp_path / "c3", shuffle=False)) is None


@pytest.mark.parametrize("args, text", [(["--epochs", "0"], "--epochs"), (["--step-ms", "-1"], "--step-ms"),
                                        (["--device", "tpu"], "--device tpu")])
def test_profile_cli_refuses_bad_settings(data, tmp_path, capsys, args, text):
    rc = main(["profile", str(data), "--cache-dir", str(tmp_path / "c")] + args)
    err = capsys.readouterr().err
    assert rc == 2 and "gpuload: error:" in err and text in err and "Traceback" not in err


def test_disk_read_speed_is_measured(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"\0" * (4 << 20))
    assert disk_read_gbps([p]) > 0
    assert disk_read_gbps([]) is None
    # a FIFO or a link at a cache file's name is skipped, never read through, never blocks
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(p)
    assert disk_read_gbps([tmp_path / "fifo", tmp_path / "link", tmp_path / "gone"]) is None
    # cache files are opened through the cache root: a linked folder in it is never followed
    from gpuload.cache.fs import CacheRoot

    (tmp_path / "cache" / LAYOUT_DIR).mkdir(parents=True)
    (tmp_path / "cache" / LAYOUT_DIR / "0123456789abcdef").symlink_to(tmp_path, target_is_directory=True)
    root = CacheRoot(tmp_path / "cache")
    assert disk_read_gbps([(root, (LAYOUT_DIR, "0123456789abcdef"), "f.bin")]) is None
    (tmp_path / "cache" / LAYOUT_DIR / "0123456789abcdef").unlink()
    (tmp_path / "cache" / LAYOUT_DIR / "0123456789abcdef").mkdir()
    os.link(p, tmp_path / "cache" / LAYOUT_DIR / "0123456789abcdef" / "f.bin")
    assert disk_read_gbps([(root, (LAYOUT_DIR, "0123456789abcdef"), "f.bin")]) > 0


@pytest.mark.slow
def test_profile_under_torchrun_prints_every_ranks_figures(data, tmp_path):
    import sys

    from conftest import free_port, run_launch

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "gpuload", "profile", str(data),
           "--device", "cpu", "--epochs", "2", "--step-ms", "1", "--batch-size", "2000",
           "--cache-dir", str(tmp_path / "cache"), "--trace", str(tmp_path / "t.json")]
    rc, out = run_launch(cmd, 180)
    assert rc == 0, out[-4000:]
    assert out.count("gpuload stats of 2 ranks") == 2  # a table per epoch, printed once (by rank 0)
    assert out.count("profiling 2 epochs") == 1 and "on each of 2 ranks" in out  # the header too
    assert out.count("limited by:") >= 4  # each epoch: rank 0's diagnosis and the ranks' one
    assert (tmp_path / "t.rank0.json").exists() and (tmp_path / "t.rank1.json").exists()


def test_the_headspace_verdict_compares_the_rates():
    import dataclasses

    from gpuload.tools.profile import EpochReport

    def st(rows_per_s, stages=(), starvation=0.01):
        return gpuload.observe.stats.Stats(
            wall_s=1.0, batches=1, rows=int(rows_per_s), bytes=1, wait_s=starvation, starvation=starvation, passes=1,
            wait_mean_s=0.1, wait_max_s=0.1, step_mean_s=0.0, step_max_s=0.0,
            stages={n: gpuload.StageStats(n, 0.1, 1, 1, 1, 1, 0.0, 0.0, 0.1) for n in stages})

    d = gpuload.diagnose(st(1e6, ["cache_read"]))
    report = EpochReport(1, st(1e6), d, 0, 4, headspace=st(4e6, ["cache_read"]))
    assert "the step is the limit: the loader alone is 4.0x faster" in report.bound() and "full cache" in report.bound()
    near = dataclasses.replace(report, headspace=st(1.1e6, ["decode"]))
    assert "the loader is the limit: under the step it delivers 91%" in near.bound() and "empty cache" in near.bound()
    faster = dataclasses.replace(report, headspace=st(0.9e6))
    assert "as fast as alone" in faster.bound() and "colder" not in faster.bound()
    # a user's trial: alone 287,074 rows/s, under the step 591,028, and "it goes as fast as alone"
    cold = dataclasses.replace(report, headspace=st(0.5e6, ["decode"]))
    assert "as fast as alone or faster (alone it measured 50% of that, in a run that came first" in cold.bound()
    # a user's trial: starvation 75% and "limited by: batch", then "the step is the limit" (alone 1.6x faster):
    # a step that waits for the loader does not limit it; its own CPU work slows the loader
    shared = dataclasses.replace(report, stats=st(2.66e6, starvation=0.75), headspace=st(4.2e6, ["cache_read"]))
    assert "the loader is the limit, slowed by the step: alone it is 1.6x faster, yet the step waited 75%" in \
        shared.bound() and "step is the limit" not in shared.bound()


def test_each_rank_writes_a_trace_of_its_own_name():
    from gpuload.tools.cli import rank_path

    assert rank_path("t.json", 0) == "t.rank0.json"
    assert rank_path("runs.v2/trace", 3) == "runs.v2/trace.rank3"
    assert rank_path("./t.json.gz", 1) == "t.rank1.json.gz"


def test_headspace_against_a_full_cache_is_measured_on_a_full_cache(data, tmp_path):
    full = _ds(data, tmp_path / "cache")
    list(full)
    full.reader.cache.flush()  # the user's cache is full before profiling
    reports = profile(data, epochs=1, step_ms=5.0, headspace=True, batch_size=2_000, chunk_bytes=80_000,
                      shuffle_window=1, device="cpu", cache_dir=tmp_path / "cache")
    assert reports[0].decoded_chunks == 0 and "decode" not in reports[0].headspace.stages
    text = reports[0].bound()
    assert "full cache" in text and not any(f"{n}%" in text for n in range(101, 1000))
