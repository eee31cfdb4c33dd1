"""Real DDP runs under torchrun (gloo, CPU): checkpoint mid-epoch, SIGKILL, restart.

``tests/ddp_train.py`` trains a linear model under ``DistributedDataParallel`` and
checkpoints the model, the optimizer and rank 0's loader state together (gradients are
averaged in rank order, so that training is bitwise deterministic). The jobs are simulated
2 nodes x 2 ranks (``--nnodes=2`` on localhost, one cache folder per node, ``shard="node"``,
3 epochs): one runs uninterrupted (each node's cache holds only its share, and epochs 2 and 3
decode nothing); another is killed (every process, with SIGKILL) after its checkpoint in
epoch 1 and restarted from it, on the same 2 x 2 ranks and, on other machines (no cache), on
1 node of 3 ranks. Each restart checks: every row of the epoch used exactly once across the two
halves (the steps after the checkpoint that the kill lost are not counted: they were redone),
the same number of batches on every rank, no rank hung, every rank's loader state equal to
rank 0's, and, on the same ranks, the batches and the final model bitwise equal to the
uninterrupted run's. Last, ranks given different seeds are refused. (The default
``shard="global"`` is killed and restarted under Lightning and with a Mix: test_frameworks.py,
test_mix_ddp.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from conftest import free_port, spawn, write_parquet

pytestmark = pytest.mark.slow  # torchrun and its ranks

SCRIPT = Path(__file__).with_name("ddp_train.py")
ROWS = 4003
BATCH = 64
TIMEOUT = 180  # seconds a run may take before it counts as hung
NODE = ("--shard", "node", "--epochs", "3")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1 * rng.standard_normal(ROWS)).astype(np.float32)
    d = tmp_path_factory.mktemp("ddp_source")
    cols = {"row_id": np.arange(ROWS), **{f"x{i}": x[:, i] for i in range(4)}, "y": y}
    write_parquet(d / "a.parquet", {k: v[:2500] for k, v in cols.items()}, row_group_size=250)
    write_parquet(d / "b.parquet", {k: v[2500:] for k, v in cols.items()}, row_group_size=250)
    return d


class Job:
    """One torchrun launch per simulated node, started now."""

    def __init__(self, source: Path, out: Path, run: str, nproc: int, nnodes: int = 1, *extra: str,
                 cache: Path | None = None):
        self.out, self.run = out, run
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        self.procs = [spawn(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT),
             "--source", str(source), "--cache", str(cache or out / "cache"), "--out", str(out), "--name", run,
             "--batch-size", str(BATCH), *extra],
            env=env, stderr=subprocess.STDOUT, text=False)
            for node in range(nnodes)]
        self.world = nproc * nnodes

    def ended(self) -> tuple[list[int], str]:
        """Wait for every launch to end (fail if one hangs past TIMEOUT): their exit codes and output."""
        deadline = time.monotonic() + TIMEOUT
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"run {self.run}: a rank hung (still running after {TIMEOUT} s)")
        return [p.returncode for p in self.procs], "\n".join(p.stdout.read().decode(errors="replace")
                                                             for p in self.procs)

    def wait(self) -> None:
        """Wait for every launch to end; fail if one hangs (past TIMEOUT) or fails."""
        codes, logs = self.ended()
        assert codes == [0] * len(codes), f"run {self.run} failed:\n" + logs[-6000:]
        for r in range(self.world):
            assert (self.out / f"done.{self.run}.{r}").exists(), f"rank {r} of {self.run} did not finish"

    def kill(self) -> None:
        """SIGKILL every process of the job (the launchers and every rank), and wait until they are gone."""
        pids = [p.pid for p in self.procs]
        pids += [int(f.read_text()) for f in (self.out / "pids").glob(f"{self.run}.*")]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=30)
        for pid in pids:
            try:
                psutil.Process(pid).wait(timeout=30)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired, psutil.ZombieProcess, ChildProcessError):
                pass


def _run(source, out, run, nproc, nnodes=1, *extra, cache: Path | None = None) -> None:
    Job(source, out, run, nproc, nnodes, *extra, cache=cache).wait()


def _run_and_kill(source, out, run, nproc, nnodes, checkpoint_at, *extra) -> None:
    """Start a job that checkpoints after ``checkpoint_at`` steps; SIGKILL it a few steps later."""
    job = Job(source, out, run, nproc, nnodes, "--checkpoint-at", str(checkpoint_at), *extra)
    deadline = time.monotonic() + TIMEOUT
    log = out / f"rows.{run}.0.txt"
    while time.monotonic() < deadline:  # the checkpoint, then two more steps (lost work)
        if (out / "checkpointed").exists() and log.exists() and len(log.read_text().splitlines()) >= checkpoint_at + 2:
            break
        if any(p.poll() is not None for p in job.procs):
            job.kill()
            pytest.fail(f"run {run} ended before it was killed:\n" + job.procs[0].stdout.read().decode()[-6000:])
        time.sleep(0.05)
    else:
        job.kill()
        pytest.fail(f"run {run} did not checkpoint within {TIMEOUT} s")
    job.kill()
    assert not any((out / f"done.{run}.{r}").exists() for r in range(job.world)), "the job finished before the kill"


def _rows(out: Path, run: str, world: int, before_step: int | None = None) -> dict[int, list[np.ndarray]]:
    """Row ids each epoch used in ``run``, per step; only steps before ``before_step`` if given."""
    per_epoch: dict[int, list] = {}
    for r in range(world):
        for line in (out / f"rows.{run}.{r}.txt").read_text().splitlines():
            epoch, step, ids = line.split(" ")
            if before_step is None or int(step) < before_step:
                per_epoch.setdefault(int(epoch), []).append(np.array(ids.split(","), dtype=np.int64))
    return per_epoch


def _assert_each_row_once_per_epoch(*parts: dict[int, list[np.ndarray]], rows, epochs=(0, 1, 2)) -> None:
    """Each epoch's ids over ``parts``: no row twice, ``rows[e]`` rows of the source in all (shard="node"
    leaves out the few rows that would give one node more batches than the other)."""
    for e in epochs:
        ids = np.concatenate([a for part in parts for a in part.get(e, [])])
        assert len(np.unique(ids)) == len(ids) and set(ids) <= set(range(ROWS)), f"epoch {e}: a row twice"
        assert len(ids) == rows[e], f"epoch {e}: {len(ids)} rows, not {rows[e]}"


def _same_batch_counts(out: Path, run: str, world: int) -> dict:
    done = [json.loads((out / f"done.{run}.{r}").read_text()) for r in range(world)]
    assert all(d["counts"] == done[0]["counts"] and d["world"] == world for d in done), done
    return done[0]["counts"]


def _steps(out: Path, run: str, rank: int, before_step: int | None = None) -> list[tuple[int, str]]:
    """(epoch, row ids) of each step rank ``rank`` trained on in ``run`` (before ``before_step``)."""
    steps = []
    for line in (out / f"rows.{run}.{rank}.txt").read_text().splitlines():
        epoch, step, ids = line.split(" ")
        if before_step is None or int(step) < before_step:
            steps.append((int(epoch), ids))
    return steps


def _same_batches_as_uninterrupted(out: Path, world: int, before_step: int) -> None:
    """Every rank trained on the batches of the uninterrupted run, in its order, across both halves."""
    for r in range(world):
        assert _steps(out, "a", r, before_step) + _steps(out, "b", r) == _steps(out, "ref", r), f"rank {r}"


def _same_model(out: Path, a: str, b: str) -> None:
    ma, mb = torch.load(out / f"model.{a}.pt"), torch.load(out / f"model.{b}.pt")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma), "final models differ"


def _checkpoint(out: Path, world: int) -> dict:
    """The saved checkpoint; asserts every rank's loader state equals rank 0's (saved alone)."""
    states = [json.loads((out / f"loader_state.{r}.json").read_text()) for r in range(world)]
    assert all(s == states[0] for s in states)
    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    assert saved["loader"] == states[0]
    return saved


def test_ddp_ranks_with_different_seeds_are_refused(source, tmp_path):
    """seed=rank on 2 ranks would read some rows twice and others never: a rank refuses it, naming
    the seeds, and the job ends (gpuload.agree) instead of training on the wrong rows."""
    codes, logs = Job(source, tmp_path, "s", 2, 1, "--seed-per-rank", "--epochs", "1").ended()
    assert codes != [0]
    assert "ConfigError: ranks 0 and 1 of this job would read different rows: seed=" in logs, logs[-4000:]
    assert "give every rank the same seed=" in logs
    assert not list(tmp_path.glob("done.s.*"))


def _node_dataset(source: Path, cache: Path, world: int = 4, local: int = 2):
    """The jobs' dataset as rank 0 of ``world`` ranks, ``local`` per node, sees it."""
    import gpuload

    return gpuload.ParquetDataset(source, {"row_id": "row_id", "x": ["x0", "x1", "x2", "x3"], "y": "y"},
                                  batch_size=BATCH, cache_dir=cache, device="cpu", chunk_bytes=16 << 10,
                                  shuffle_window=2, shard="node", rank=0, world_size=world, local_world_size=local)


@pytest.fixture(scope="module")
def two_nodes(source, tmp_path_factory) -> Path:
    """A job on 2 nodes x 2 ranks (torchrun --nnodes=2 on localhost, one cache folder per node,
    ``shard="node"``, 3 epochs) run uninterrupted ("ref"; what each node cached is counted here,
    before another job shares the folders), then the same job killed after a checkpoint 5 steps
    into epoch 1 ("a")."""
    out = tmp_path_factory.mktemp("ddp2x2")
    _run(source, out, "ref", 2, 2, *NODE)
    (out / "cached.ref.json").write_text(json.dumps(_cached(out)))
    assert _same_batch_counts(out, "ref", 4) == {"0": 16, "1": 16, "2": 16}
    _run_and_kill(source, out, "a", 2, 2, 16 + 5, *NODE)
    return out


def _cached(out: Path) -> list[int]:
    """Chunk files in each simulated node's cache folder."""
    return [len(list((out / "cache" / f"node{n}").rglob("*.glc"))) for n in (0, 1)]


def test_ddp_two_nodes_cache_only_their_share(source, two_nodes, tmp_path):
    """Each node's cache holds exactly the chunks the node owns; epochs 2 and 3 decode nothing; every
    epoch the rows of the node layout, none twice."""
    out = two_nodes
    ds = _node_dataset(source, tmp_path / "probe")
    assert json.loads((out / "cached.ref.json").read_text()) == [len(o) for o in ds.node_chunks()]
    decoded = [json.loads((out / f"done.ref.{r}").read_text())["decoded"] for r in range(4)]
    assert all(d["0"] > 0 and d["1"] == 0 and d["2"] == 0 for d in decoded), decoded
    _assert_each_row_once_per_epoch(_rows(out, "ref", 4), rows=[ds.rows_per_epoch] * 3)


def test_ddp_two_nodes_kill_and_restart(source, two_nodes, tmp_path):
    out = two_nodes
    saved = _checkpoint(out, 4)
    assert saved["epoch"] == 1 and saved["loader"]["runs"] == [[4, 5, 2]]
    _run(source, out, "b", 2, 2, "--resume", *NODE)
    assert _same_batch_counts(out, "b", 4) == {"1": 16 - 5, "2": 16}
    per_epoch = _node_dataset(source, tmp_path / "probe").rows_per_epoch
    _assert_each_row_once_per_epoch(_rows(out, "a", 4, before_step=saved["step"]), _rows(out, "b", 4),
                                    rows=[per_epoch] * 3)
    _same_batches_as_uninterrupted(out, 4, saved["step"])
    _same_model(out, "ref", "b")  # bitwise: the restart saw the same batches in the same order


def test_ddp_restart_of_two_nodes_on_three_ranks_of_one(source, two_nodes, tmp_path):
    """The 2 x 2 job's checkpoint restarted by a job of 1 node x 3 ranks on other machines (a cache
    folder of its own, empty): the rest of epoch 1, each row once, as many batches on every rank;
    then a whole epoch of the new layout."""
    out = two_nodes
    saved = _checkpoint(out, 4)
    _run(source, out, "c", 3, 1, "--resume", *NODE, cache=tmp_path / "cache")
    counts = _same_batch_counts(out, "c", 3)
    old, new = (_node_dataset(source, tmp_path / "probe", w, local).rows_per_epoch for w, local in ((4, 2), (3, 3)))
    # the rest of epoch 1: 4000 - 4 x 5 x 64 = 2720 rows, at most 907 per rank on 3 ranks: 15 batches of 64
    assert counts["1"] == 15, counts
    _assert_each_row_once_per_epoch(_rows(out, "a", 4, before_step=saved["step"]), _rows(out, "c", 3),
                                    epochs=[1], rows={1: old})
    _assert_each_row_once_per_epoch(_rows(out, "c", 3), epochs=[2], rows={2: new})

