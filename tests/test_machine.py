"""What this process may use of the machine (gpuload/machine.py): memory and CPU cores within its
cgroups' limits (cgroup v1 and v2 trees written under a temporary folder) and its CPU affinity."""

from __future__ import annotations

import os

import pytest

from gpuload.machine import memory_bytes


def test_memory_is_at_most_the_machines():
    assert 0 < memory_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_the_memory_limit_is_the_lowest_of_the_process_cgroup_and_its_parents(tmp_path):
    """A Slurm job's or a systemd slice's limit sits on a nested cgroup (often on a parent of the
    process's own): cgroup v2 and v1 as /proc/self/cgroup places them, "max" meaning none."""
    from gpuload.machine import _cgroup_limits

    root = tmp_path / "sys"
    v2 = root / "system.slice" / "slurmstepd.scope" / "job_7" / "step_0"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2.parent / "memory.max").write_text(f"{64 << 30}\n")  # the job's limit, on the parent
    (root / "system.slice" / "memory.max").write_text(f"{512 << 30}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/slurmstepd.scope/job_7/step_0\n")
    assert min(_cgroup_limits(str(proc), str(root))) == 64 << 30
    v1 = root / "memory" / "slurm" / "uid_0" / "job_9"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{32 << 30}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc.write_text("12:cpu,cpuacct:/slurm/uid_0/job_9\n4:memory:/slurm/uid_0/job_9\n")
    assert min(_cgroup_limits(str(proc), str(root))) == 32 << 30
    assert _cgroup_limits(str(tmp_path / "missing"), str(root)) == []


def test_the_cpu_quota_is_the_lowest_of_the_process_cgroup_and_its_parents(tmp_path):
    """A container's CPU limit is a quota on its cgroup (or a parent's), in whole cores rounded up:
    cgroup v2's cpu.max ("max" meaning none) and v1's cfs quota over its period (-1 meaning none)."""
    from gpuload.machine import _cgroup_cpus

    root = tmp_path / "sys"
    pod = root / "kubepods.slice" / "pod_1" / "cri-abc"
    pod.mkdir(parents=True)
    (pod / "cpu.max").write_text("max 100000\n")
    (pod.parent / "cpu.max").write_text("250000 100000\n")  # the pod's limit of 2.5 CPUs, on the parent
    (root / "kubepods.slice" / "cpu.max").write_text("1600000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods.slice/pod_1/cri-abc\n")
    assert min(_cgroup_cpus(str(proc), str(root))) == 3
    v1 = root / "cpu" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert _cgroup_cpus(str(proc), str(root)) == [4]
    (root / "cpu").rename(root / "cpu,cpuacct")  # mounted without the "cpu" link
    assert _cgroup_cpus(str(proc), str(root)) == [4]
    v1 = root / "cpu,cpuacct" / "docker" / "abc"
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpus(str(proc), str(root)) == []
    assert _cgroup_cpus(str(tmp_path / "missing"), str(root)) == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux: a thread's CPU affinity")
def test_cores_are_the_affinity_within_the_cpu_quota(monkeypatch):
    import gpuload.machine as machine
    from gpuload.pipeline import cut_threads

    monkeypatch.setattr(machine, "_cgroup_cpus", lambda: [])  # this machine's own quota, if any, left out
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(mine)})  # this thread (taskset, a Slurm cpuset): one core
        assert machine.cores() == 1 and cut_threads(2) == 1
    finally:
        os.sched_setaffinity(0, mine)
    assert machine.cores() == len(mine)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # every core of a big node ...
    monkeypatch.setattr(machine, "_cgroup_cpus", lambda: [4, 8])  # ... in a container limited to 4
    assert machine.cores() == 4 and cut_threads(2) == 1
    monkeypatch.setattr(machine, "_cgroup_cpus", lambda: [])
    assert machine.cores() == 64 and cut_threads(2) == 2
