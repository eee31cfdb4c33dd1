"""Every rank's figures: gathered under a real torchrun job (gloo) with one rank slowed and its
cache cold, the straggler named with its cause; the table and the rules on hand-made figures."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

import gpuload
from gpuload.observe.ranks import RankFigures, RankStats
from gpuload.observe.stats import Stats
from gpuload.sources.settings import RemoteStats

from conftest import free_port, open_dataset, run_launch, write_parquet


def _stats(starvation: float, wall: float = 10.0, **kw) -> Stats:
    return Stats(wall_s=wall, batches=100, rows=100_000, bytes=1, wait_s=starvation * wall, starvation=starvation,
                 passes=1, wait_mean_s=starvation * wall / 100, wait_max_s=0.5, step_mean_s=0.05, step_max_s=0.1,
                 stages={}, first_wait_s=0.01, **kw)


def _rank(r: int, starvation: float, decoded: int = 0, cached: int = 10, **kw) -> RankFigures:
    return RankFigures(r, _stats(starvation, **kw), decoded, cached, f"node{r // 2}", 8)


def test_the_straggler_is_named_with_what_its_figures_show():
    view = RankStats([_rank(0, 0.02), _rank(1, 0.03), _rank(2, 0.41, decoded=12, cached=0), _rank(3, 0.02)])
    assert view.slowest.rank == 2 and view.median_starvation == pytest.approx(0.025)
    d = gpuload.diagnose(view)
    assert d.rank == 2 and "rank 2 (node1) is the straggler" in d.message
    assert "cache is cold: it decoded 12 chunks" in d.message and d.action.startswith("on rank 2:")
    table = str(view)
    assert "2 *" in table and "41.0%" in table and "+38.5%" in table
    remote = RankStats([_rank(0, 0.01), _rank(1, 0.30, remote=RemoteStats(900, 10**9, 3, 0, 0.1, 0.2, 0.3)),
                        _rank(2, 0.01)])
    assert "reads a remote source (900 requests" in gpuload.diagnose(remote).message
    busy = RankStats([_rank(0, 0.01, system_cpu_percent=40.0), _rank(1, 0.2, system_cpu_percent=99.0)])
    assert "CPUs are busy (99% of all of node0's cores; the rank may use 8)" in gpuload.diagnose(busy).message


def test_a_rank_that_timed_nothing_is_not_the_straggler():
    view = RankStats([_rank(0, 0.10), RankFigures(1, _stats(0.0, wall=0.0), 0, 0, "n", 8), _rank(2, 0.40)])
    assert view.slowest.rank == 2 and gpuload.diagnose(view).rank == 2


def test_ranks_that_wait_alike_have_no_straggler():
    d = gpuload.diagnose(RankStats([_rank(0, 0.30), _rank(1, 0.32), _rank(2, 0.31)]))
    assert d.rank is None and d.message.startswith("no straggler: the ranks wait alike")


def test_without_a_process_group_all_ranks_is_this_one(tmp_path):
    write_parquet(tmp_path / "d" / "a.parquet", {"row_id": np.arange(500)}, row_group_size=100)
    ds = open_dataset(tmp_path / "d", ["row_id"], tmp_path / "c", batch_size=100)
    list(ds)
    view = ds.stats(all_ranks=True)
    assert [r.rank for r in view.ranks] == [0] and view.ranks[0].decoded == ds.reader.counters.decoded > 0
    assert view.ranks[0].stats.rows == 500 and str(view).startswith("gpuload stats of 1 rank ")
    decoded = view.ranks[0].decoded
    ds.reader.cache.flush()
    ds.reset_stats()  # the chunks' counts start afresh with the rest: a cached epoch decodes none
    ds.set_epoch(1)
    list(ds)
    again = ds.stats(all_ranks=True).ranks[0]
    assert again.decoded == 0 and again.cached == decoded and again.stats.rows == 500


SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch.distributed as dist
    import gpuload
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data, out, warm, cold = sys.argv[1:5]
    ds = gpuload.ParquetDataset(data, ["row_id"], batch_size=100, device="cpu", chunk_bytes=4096,
                                cache_dir=cold if rank == 2 else warm, shuffle_window=1)
    if rank == 2:  # a rank whose node's cache is cold, and whose decoding is slow: 0.3 s a chunk of
        # 5 batches, far slower than a step with its barrier even on busy cores (0.05 s was not)
        decode = ds.reader.decode
        ds.reader.decode = lambda *a: (time.sleep(0.3), decode(*a))[1]
    for batch in ds:
        time.sleep(0.002)  # the step
        dist.barrier()     # every rank steps together, as DDP's all-reduce makes them
    view = ds.stats(all_ranks=True)
    if rank == 0:
        open(out, "w").write(json.dumps({"table": str(view), "diagnosis": str(gpuload.diagnose(view)),
                                         "rank": gpuload.diagnose(view).rank}))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_a_torchrun_job_names_its_slow_rank_and_why(tmp_path):
    import json

    write_parquet(tmp_path / "d" / "a.parquet", {"row_id": np.arange(6000)}, row_group_size=100)
    gpuload.build_cache(tmp_path / "d", tmp_path / "warm", ["row_id"], chunk_bytes=4096, progress=False)
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=3",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", script, tmp_path / "d",
           tmp_path / "out.json", tmp_path / "warm", tmp_path / "cold"]
    rc, log = run_launch(cmd, 180)
    assert rc == 0, log[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["rank"] == 2, got
    assert "rank 2 " in got["diagnosis"] and "is the straggler" in got["diagnosis"]
    assert "cache is cold" in got["diagnosis"] and "2 *" in got["table"]
