"""gpuload under real training frameworks, 2 processes on the CPU (gloo): torchrun,
Lightning's DDP and ``accelerate launch``.

Each test runs ``tests/frameworks_train.py`` (the README's recipe for that framework) over
3 epochs and checks, from the ``row_id`` of every batch each rank trained on: every row
exactly once per epoch across the 2 ranks, the same number of batches on both ranks
(and as many as ``len(ds)`` said), a different order in each epoch, and that the job
ended (a hung rank fails the test after ``TIMEOUT`` seconds, every process killed).

* torchrun: the dataset is made before ``init_process_group`` (ranks resolve when
  iteration begins) and an iteration tried before it is refused;
* Lightning: the datasets are made in the LightningModule's ``__init__``; Lightning
  never calls ``set_epoch``, so each new iteration begins the next epoch; the validation
  set's sanity check (2 batches) and per-epoch runs; the uninterrupted job with
  ``StochasticWeightAveraging``, which deep-copies the module and its datasets;
* accelerate: ``accelerator.prepare(DataLoader(ds))`` would re-shard gpuload's batches
  (dispatched from rank 0, or every other batch kept): refused with a ``ConfigError`` on
  every rank, with accelerate's default settings and with ``dispatch_batches=False``;
  the recommended pattern (prepare the model and optimizer, iterate the dataset) works,
  and ``accelerator.save_state`` holds the dataset's position: restored, each rank gets
  the rest of the epoch it had.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gpuload

from conftest import free_port, run_launch, write_parquet
from frameworks_train import COLUMNS, OPTIONS

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("frameworks_train.py")
ROWS = 3001
BATCH = 50
EPOCHS = 3
TIMEOUT = 240  # seconds a job may take before it counts as hung (a run takes 10-40 s on 2 busy cores)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 2)).astype(np.float32)
    cols = {"row_id": np.arange(ROWS), "x0": x[:, 0], "x1": x[:, 1], "y": (x @ [1.0, -2.0]).astype(np.float32)}
    d = tmp_path_factory.mktemp("frameworks_source")
    write_parquet(d / "a.parquet", {k: v[:1700] for k, v in cols.items()}, row_group_size=100)
    write_parquet(d / "b.parquet", {k: v[1700:] for k, v in cols.items()}, row_group_size=100)
    return d


def _script_args(framework: str, source: Path, out: Path) -> list[str]:
    return [str(SCRIPT), framework, "--source", str(source), "--cache", str(out / "cache"), "--out", str(out),
            "--epochs", str(EPOCHS), "--batch-size", str(BATCH)]


def _launch(cmd: list[str], out: Path, world: int = 2, env: dict | None = None) -> list[dict]:
    t0 = time.monotonic()
    rc, log = run_launch(cmd, TIMEOUT, env)
    took = time.monotonic() - t0
    assert rc == 0, f"the job failed (exit {rc}):\n{log[-8000:]}"
    missing = [r for r in range(world) if not (out / f"done.{r}.json").exists()]
    assert not missing, f"ranks {missing} did not finish:\n{log[-8000:]}"
    (out / "took.txt").write_text(f"{took:.1f}")
    return [json.loads((out / f"done.{r}.json").read_text()) for r in range(world)]


def _batches(out: Path, world: int = 2) -> dict[str, list[list[np.ndarray]]]:
    """``{epoch: [[ids of each batch] for each rank]}`` as the ranks logged them."""
    got: dict[str, list[list[np.ndarray]]] = {}
    for r in range(world):
        for line in (out / f"rows.{r}.txt").read_text().splitlines():
            epoch, ids = line.split(" ")
            got.setdefault(epoch, [[] for _ in range(world)])[r].append(np.array(ids.split(","), dtype=np.int64))
    return got


def _each_row_once(per_rank: list[list[np.ndarray]], where) -> np.ndarray:
    """Asserts every row exactly once across the ranks and equal batch counts; returns the ids in order."""
    assert len({len(b) for b in per_rank}) == 1, (where, "batch counts differ between ranks",
                                                   [len(b) for b in per_rank])
    ids = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS)), (
        where, f"not every row once across ranks: {len(ids)} rows, {len(np.unique(ids))} distinct")
    return ids


def _check_training(out: Path, done: list[dict]) -> dict[str, list[list[np.ndarray]]]:
    batches = _batches(out)
    orders = []
    for e in range(EPOCHS):
        orders.append(_each_row_once(batches[str(e)], f"epoch {e}"))
        assert len(batches[str(e)][0]) == done[0]["len"], (e, "len(ds) is not the batches each rank got")
    for a in range(EPOCHS):
        for b in range(a + 1, EPOCHS):
            assert not np.array_equal(orders[a], orders[b]), f"epochs {a} and {b} have the same order"
    assert all(d["counts"] == done[0]["counts"] for d in done)
    return batches


def test_torchrun_dataset_made_before_init_process_group(source, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *_script_args("torchrun", source, tmp_path)]
    done = _launch(cmd, tmp_path)
    _check_training(tmp_path, done)
    for d in done:  # an iteration before the process group exists is refused, naming the fixes
        assert d["refused_before_init"] is not None, "iterating before init_process_group was not refused"
        assert "init_process_group" in d["refused_before_init"] and "rank=" in d["refused_before_init"]


@pytest.fixture(scope="module")
def lightning_job(source, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The Lightning job run uninterrupted: its output folder and each rank's ``done`` record."""
    out = tmp_path_factory.mktemp("lightning")
    return out, _launch([sys.executable, *_script_args("lightning", source, out)], out)


def test_lightning_ddp_dataset_made_in_module_init(lightning_job):
    out, done = lightning_job
    assert all(d["world"] == 2 and d["train_len"] == d["len"] for d in done)
    batches = _check_training(out, done)
    # validation: the sanity check's 2 batches per rank, then one whole run per epoch
    assert [len(b) for b in batches["val0"]] == [2, 2]
    for run in range(1, EPOCHS + 1):
        _each_row_once(batches[f"val{run}"], f"validation {run}")
    assert f"val{EPOCHS + 1}" not in batches


def _per_epoch(lightning_job) -> int:
    """Batches a rank takes in an epoch of 2 ranks."""
    return len(_batches(lightning_job[0])["0"][0])


def _preempt(source: Path, out: Path, at: int) -> None:
    """Runs the 2-process job saving a checkpoint every ``at`` steps and one at each epoch's end, every
    rank gone with ``os._exit`` as step ``at`` begins (in epoch 1): one checkpoint of each kind."""
    rc, log = run_launch([sys.executable, *_script_args("lightning", source, out), "--checkpoint-every", str(at),
                          "--die-at", str(at)], TIMEOUT)
    deadline = time.monotonic() + 60  # rank 1 leaves on its own, as rank 0 did
    while not all((out / f"died.{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all((out / f"died.{r}").read_text() == str(at) for r in range(2)), log[-6000:]
    assert [c.name for c in (out / "checkpoints").glob("*.ckpt")] == [f"epoch=1-step={at}.ckpt"], log[-6000:]


@pytest.fixture(scope="module")
def preempted_mid_epoch(source, tmp_path_factory, lightning_job) -> tuple[Path, int]:
    """The job preempted a third into epoch 1, its checkpoint at that step: its folder and the step.
    Each test resumes a copy of the folder (rows logs, checkpoints, cache). The job also saved a
    checkpoint at epoch 0's end, in ``checkpoints/epoch-ends``."""
    per_epoch = _per_epoch(lightning_job)
    at = per_epoch + per_epoch // 3
    out = tmp_path_factory.mktemp("preempted")
    _preempt(source, out, at)
    ends = [p.name for p in (out / "checkpoints" / "epoch-ends").glob("*.ckpt")]
    assert ends == [f"epoch=0-step={per_epoch}.ckpt"], ends
    return out, at


def _copy_of(preempted: tuple[Path, int], tmp_path: Path) -> Path:
    """A copy of the preempted job's folder in ``tmp_path``; returns the copy's checkpoint."""
    shutil.copytree(preempted[0], tmp_path, dirs_exist_ok=True)
    return tmp_path / "checkpoints" / f"epoch=1-step={preempted[1]}.ckpt"


def _copy_at_epoch_end(preempted: tuple[Path, int], tmp_path: Path) -> Path:
    """A copy of the preempted job's folder as if the job had died as epoch 1 began, just after its
    checkpoint at epoch 0's end (the rows it logged in epoch 1 dropped); returns that checkpoint."""
    _copy_of(preempted, tmp_path)
    for log in tmp_path.glob("rows.*.txt"):
        log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                               if line.split(" ", 1)[0] != "1"))
    (checkpoint,) = (tmp_path / "checkpoints" / "epoch-ends").glob("epoch=0-*.ckpt")
    return checkpoint


@pytest.mark.parametrize("where", ["mid-epoch", "at an epoch's end"])
def test_lightning_ddp_resumes_from_its_checkpoint(source, tmp_path, lightning_job, preempted_mid_epoch, where):
    """A job preempted in epoch 1 (every rank gone with ``os._exit`` as step ``at`` begins, the
    last checkpoint at that step, or the one at epoch 0's end, as if it had died as epoch 1 began)
    and started again with ``ckpt_path``: each rank trains on exactly the batches of the
    uninterrupted job, in the same order, no batch lost or repeated. Lightning keeps the dataset's
    state in its checkpoint because the hook returns the dataset itself; from a checkpoint at an
    epoch's end it does not restore it, and ``set_epoch(current_epoch)`` in ``on_train_epoch_start``
    (the README's recipe) starts the right epoch."""
    ref = _batches(lightning_job[0])
    per_epoch = _per_epoch(lightning_job)
    copy = _copy_of if where == "mid-epoch" else _copy_at_epoch_end
    checkpoint = copy(preempted_mid_epoch, tmp_path)
    base = [sys.executable, *_script_args("lightning", source, tmp_path), "--checkpoint-every",
            str(preempted_mid_epoch[1])]
    done = _launch([*base, "--resume", str(checkpoint)], tmp_path)  # the rows logged go on in the same files
    got = _batches(tmp_path)
    for e in range(EPOCHS):
        for r in range(2):
            assert len(got[str(e)][r]) == len(ref[str(e)][r]), (e, r, "batches lost or repeated")
            assert all(np.array_equal(a, b) for a, b in zip(got[str(e)][r], ref[str(e)][r])), (
                e, r, "the resumed job trained on other batches than the uninterrupted one")
    assert all(d["counts"][str(EPOCHS - 1)] == per_epoch for d in done)
    if where != "mid-epoch":  # it went on from epoch 0's end: the whole of epoch 1 again
        assert all(d["counts"]["1"] == per_epoch for d in done), [d["counts"] for d in done]


@pytest.mark.parametrize("world", [3, 1])
def test_lightning_ddp_resumes_on_other_process_counts_with_every_row_once(source, tmp_path, lightning_job,
                                                                           preempted_mid_epoch, world):
    """A 2-process job preempted in epoch 1 and started again from its checkpoint on 3 processes, or
    on 1 (elastic): the README's recipe restores the dataset in ``on_load_checkpoint``, before
    Lightning counts the epoch's batches against ``len(ds)``, so the new ranks train on the whole
    rest of epoch 1 (each row once over the old and new ranks; equal batch counts) and epoch 2 is a
    whole epoch of the new ranks. A user's trial lost 8% of the epoch's rows on 3 processes when len
    was taken before the restore; a review found the resumed count, kept by Lightning, cutting every
    later epoch on 1."""
    k = _per_epoch(lightning_job) // 3  # epoch 1's batches each of the 2 ranks took before the job died
    checkpoint = _copy_of(preempted_mid_epoch, tmp_path)
    base = [sys.executable, *_script_args("lightning", source, tmp_path)]
    done = _launch([*base, "--devices", str(world), "--resume", str(checkpoint)], tmp_path, world=world)
    got = _batches(tmp_path, world=max(world, 2))
    _each_row_once(got["0"][:2], "epoch 0, on 2 ranks")
    after = [b[k:] if r < 2 else b for r, b in enumerate(got["1"][:world])]  # ranks 0, 1 log on in their files
    ids = np.concatenate([np.concatenate(b) for b in got["1"]])
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS)), (
        f"epoch 1 over 2 then 3 ranks: {len(ids)} rows, {len(np.unique(ids))} distinct of {ROWS}")
    assert len({len(b) for b in after}) == 1, ("the new ranks took different batch counts", [len(b) for b in after])
    _each_row_once(got["2"][:world], f"epoch 2, on {world} ranks")
    assert all(d["world"] == world for d in done)


def test_accelerate_launch(source, tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
           "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
           *_script_args("accelerate", source, tmp_path)]
    # the ranks train on the CPU (Accelerator(cpu=True)); with a GPU visible, `--multi_gpu` would
    # still give each rank cuda:<local rank> for its barriers, which a one-GPU node does not have
    done = _launch(cmd, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    for d in done:  # accelerator.prepare(dataloader) would re-shard what gpuload already shards
        for mode in ("dispatch", "shard"):
            got = d["prepared"][mode]
            assert got["refused"], f"prepare(DataLoader(ds)) ({mode}) was not refused: {got}"
            assert "accelerator.prepare" in got["message"], got
    batches = _check_training(tmp_path, done)
    state = torch.load(tmp_path / "checkpoint" / "custom_checkpoint_0.pkl", weights_only=False)
    assert (state["epoch"], state["runs"]) == (1, [[2, 5]])  # saved after 5 batches of epoch 1
    for rank in (0, 1):
        ds = gpuload.ParquetDataset(source, COLUMNS, batch_size=BATCH, cache_dir=tmp_path / "cache", device="cpu",
                                    rank=rank, world_size=2, **OPTIONS)
        ds.load_state_dict(state)
        rest = [b["row_id"].numpy() for b in ds]
        want = batches["1"][rank][5:]
        assert len(rest) == len(want) and all(np.array_equal(a, b) for a, b in zip(rest, want)), rank
