"""A real torchrun job mixing a local folder and an S3 prefix (a loopback S3 server) with
``gpuload.Mix`` (``tests/mix_train.py``): uninterrupted, killed with SIGKILL after a
checkpoint and restarted on the same 2 ranks (the same batches as the uninterrupted run,
bit for bit), and restarted on 3 ranks (every rank the same steps, no row twice per pass, the
source that ends the epoch read whole but for at most batches_per_step - 1 batches per rank).
In every run the S3 source, which ends each epoch, is read whole once per epoch."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import free_port, kill_tree, run_launch, spawn, write_parquet

pytestmark = pytest.mark.slow  # torchrun and its ranks

SCRIPT = Path(__file__).with_name("mix_train.py")
LOCAL, S3_ROWS, S3_BASE = 3000, 1200, 100_000
TIMEOUT = 180


def _table(ids: np.ndarray) -> pa.Table:
    rng = np.random.default_rng(int(ids[0]))
    x = rng.standard_normal((len(ids), 4)).astype(np.float32)
    return pa.table({"row_id": ids, **{f"x{i}": x[:, i] for i in range(4)}, "y": x.sum(1)})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from gpuload.testing import S3Server

    root = tmp_path_factory.mktemp("mix_ddp")
    write_parquet(root / "local" / "a.parquet", _table(np.arange(0, 1800)), row_group_size=200)
    write_parquet(root / "local" / "b.parquet", _table(np.arange(1800, LOCAL)), row_group_size=200)
    write_parquet(root / "s3src" / "c.parquet", _table(np.arange(S3_BASE, S3_BASE + S3_ROWS)), row_group_size=200)
    with S3Server() as s3:
        s3.upload_folder(root / "s3src", "mixbucket", "clicks/")
        yield root, s3


def _cmd(setup, run: str, nproc: int, *extra) -> list:
    root, s3 = setup
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", SCRIPT, "--folder", root / "local",
            "--s3", "s3://mixbucket/clicks/", "--endpoint", s3.endpoint, "--cache", root / f"cache.{run}",
            "--out", root / "out", "--name", run, *extra]


def _run(setup, run: str, nproc: int, *extra) -> dict:
    rc, log = run_launch(_cmd(setup, run, nproc, *extra), TIMEOUT)
    assert rc == 0, log[-6000:]
    out = setup[0] / "out"
    done = [json.loads((out / f"done.{run}.{r}").read_text()) for r in range(nproc)]
    assert all(d["counts"] == done[0]["counts"] for d in done), done  # every rank the same steps
    return done[0]


def _steps(setup, run: str, rank: int, before: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
    out = []
    for line in (setup[0] / "out" / f"rows.{run}.{rank}.txt").read_text().splitlines():
        epoch, step, rows = line.split(" ")
        if before is None or int(step) < before:
            out.append((int(epoch), [tuple(map(int, r.split(":"))) for r in rows.split(",")]))
    return out


def _per_source(steps_by_rank: list, epoch: int) -> dict[int, np.ndarray]:
    got: dict[int, list] = {0: [], 1: []}
    for steps in steps_by_rank:
        for e, rows in steps:
            if e == epoch:
                for s, i in rows:
                    got[s].append(i)
    return {s: np.array(v, np.int64) for s, v in got.items()}


def _check_epoch(parts: dict[int, np.ndarray], s3_whole: bool = True) -> None:
    local, s3 = parts[0], parts[1]
    assert ((local >= 0) & (local < LOCAL)).all() and (s3 >= S3_BASE).all()  # provenance names the right source
    assert len(np.unique(local)) == len(local) and len(np.unique(s3)) == len(s3)  # no row twice in a pass
    if s3_whole:
        assert np.array_equal(np.sort(s3), np.arange(S3_BASE, S3_BASE + S3_ROWS))


def test_a_mix_of_local_and_s3_killed_and_restarted_on_the_same_and_on_more_ranks(setup):
    ref = _run(setup, "ref", 2)
    per_epoch = ref["counts"]["0"]
    assert ref["counts"] == {"0": per_epoch, "1": per_epoch} and per_epoch > 10
    ref_steps = [_steps(setup, "ref", r) for r in range(2)]
    for e in range(2):
        _check_epoch(_per_source(ref_steps, e))

    ckpt_at = per_epoch + 7  # in epoch 1
    proc = spawn(_cmd(setup, "a", 2, "--checkpoint-at", ckpt_at),
                 env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    out = setup[0] / "out"
    deadline = time.monotonic() + TIMEOUT
    while not ((out / "checkpointed").exists() and (out / "rows.a.0.txt").exists()
               and len((out / "rows.a.0.txt").read_text().splitlines()) >= ckpt_at + 2):
        assert proc.poll() is None, proc.communicate()[0][-6000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    kill_tree(proc)  # SIGKILL: the launcher and both ranks
    for pid in (out / "pids").glob("a.*"):
        try:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not (out / "done.a.0").exists()

    same = _run(setup, "b", 2, "--resume")
    assert same["counts"] == {"1": per_epoch - 7}
    for r in range(2):  # bit-exact: the restart trains on the batches the uninterrupted run did
        assert _steps(setup, "a", r, ckpt_at) + _steps(setup, "b", r) == ref_steps[r]

    more = _run(setup, "c", 3, "--resume")
    assert list(more["counts"]) == ["1"] and more["counts"]["1"] > 0
    # epoch 1 across the killed run and the restart: no row twice in either source's pass, and the
    # source that ran out first is read whole to within batches_per_step - 1 = 2 batches per new rank.
    # Which one that is depends on the epoch's arrangement, drawn from the sources' identities
    # (their temporary paths and upload times): mostly S3 (1 of 3 batches, 1,200 rows), sometimes
    # the local source (2 of 3, 3,000 rows) when the draw takes it faster
    before = [_steps(setup, "a", r, ckpt_at) for r in range(2)]
    after = [_steps(setup, "c", r) for r in range(3)]
    parts = _per_source(before + after, 1)
    _check_epoch(parts, s3_whole=False)
    unread = {"s3": S3_ROWS - len(parts[1]), "local": LOCAL - len(parts[0])}
    assert min(unread.values()) <= 2 * 32 * 3, unread  # the first to run out: at most 2 batches a rank unread
