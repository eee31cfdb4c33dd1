"""Ranks from Slurm, on a real single-node Slurm cluster (tests/slurm/cluster.sh: munged, slurmctld
and slurmd started in a temporary folder and stopped after): srun tasks shard by srun's variables,
the README's sbatch example runs, and a batch script's own process reads every row as one rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import open_dataset, write_parquet

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
FILES = (500, 300, 700, 450)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "a private Slurm cluster runs its daemons as root"
    missing = [t for t in ("slurmctld", "slurmd", "srun", "sbatch", "munged") if not shutil.which(t)
               and not os.path.exists(f"/usr/sbin/{t}")]
    return f"Slurm is not installed (missing {', '.join(missing)}; Debian: apt-get install slurmctld slurmd " \
           "slurm-client munge)" if missing else None


@pytest.fixture(scope="module")
def slurm():
    """The environment of a private Slurm cluster's clients (``SLURM_CONF``), stopped after the module."""
    if _missing():
        pytest.skip(_missing())
    home = tempfile.mkdtemp(prefix="gl-slurm-")  # short: munge's socket path must fit a unix socket name
    started = subprocess.run(["bash", str(CLUSTER), "start", home], capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        yield {**env, "SLURM_CONF": f"{home}/slurm.conf", "GPULOAD_CACHE_RESERVE": "0", "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT)}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", home], capture_output=True, timeout=120)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm-data")
    start = 0
    for i, n in enumerate(FILES):
        write_parquet(d / f"{i}.parquet", {"row_id": np.arange(start, start + n)}, row_group_size=100)
        start += n
    return d


def _results(out: Path) -> dict[int, dict]:
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _run(cmd: list, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED"}


def _sbatch(args: list, env: dict, output: Path, timeout: float = 240) -> None:
    """Submits a batch job writing to ``output`` and waits for its end, asking slurmctld every 0.2 s
    (``sbatch --wait`` asks after 2, 4, 8, then every 10 s: a 3 s job took 10 s, 40 on a busy machine);
    fails unless it completed with exit code 0."""
    job = _run(["sbatch", "--parsable", "-o", str(output), *args], env).stdout.strip().split(";")[0]
    deadline, fields = time.monotonic() + timeout, {}
    while fields.get("JobState") not in _ENDED:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
            pytest.fail(f"batch job {job} still {fields.get('JobState')} after {timeout} s")
        time.sleep(0.2)
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                               timeout=30)
        assert shown.returncode == 0, (job, shown.stderr)
        fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
    log = output.read_text()[-3000:] if output.exists() else "(no output)"
    assert (fields["JobState"], fields.get("ExitCode")) == ("COMPLETED", "0:0"), (job, fields, log)


def _check_shards(got: dict, world: int, source, cache, **shard) -> None:
    assert sorted(got) == list(range(world)) and {g["world"] for g in got.values()} == {world}
    assert len({g["batches"] for g in got.values()}) == 1  # equal batch counts: DDP never hangs
    ids = np.concatenate([g["ids"] for g in got.values()])
    assert np.array_equal(np.sort(ids), np.arange(sum(FILES)))  # every row once
    for r, g in got.items():  # the order an explicit rank= / world_size= gives
        want = open_dataset(source, ["row_id"], cache, batch_size=64, seed=7, rank=r, world_size=world, **shard)
        assert g["ids"] == [i for b in want for i in b["row_id"].tolist()] and g["procid"] == str(r)


def test_srun_tasks_each_read_their_share(slurm, source, tmp_path):
    out = tmp_path / "out"
    _run(["srun", "-n", "3", sys.executable, "tests/slurm/train.py", str(source), str(tmp_path / "c"), str(out)],
         slurm)
    _check_shards(_results(out), 3, source, tmp_path / "c")


def test_the_readmes_sbatch_example_with_node_sharding(slurm, source, tmp_path):
    out = tmp_path / "out"
    _sbatch(["tests/slurm/train.sbatch", str(source), str(tmp_path / "c"), str(out), "node"], slurm,
            tmp_path / "job.out")
    got = _results(out)
    assert {g["local"] for g in got.values()} == {2}  # --ntasks-per-node=2, from SLURM_STEP_TASKS_PER_NODE
    _check_shards(got, 2, source, tmp_path / "c", shard="node", local_world_size=2)


def test_a_batch_scripts_own_process_is_one_rank_and_says_so(slurm, source, tmp_path):
    out = tmp_path / "out"
    job = tmp_path / "job.out"
    _sbatch(["-n", "2", "--wrap", f"{sys.executable} tests/slurm/train.py {source} {tmp_path / 'c'} {out}"], slurm,
            job)
    got = _results(out)
    assert list(got) == [0] and got[0]["world"] == 1 and sorted(got[0]["ids"]) == list(range(sum(FILES)))
    assert "SLURM_NTASKS=2, but srun did not start this process" in job.read_text()
