"""What this process may use of the machine: memory and CPU cores, its cgroup's limits (a
container, a Slurm job, a systemd slice) and its CPU affinity included.

:func:`memory_bytes` sizes what a cache may leave in the page cache
(:func:`gpuload.memory.cache_io_modes`); :func:`cores` how many threads gather batches
(:func:`gpuload.pipeline.cut_threads`) and what :mod:`gpuload.observe` advises.
"""

from __future__ import annotations

import os

__all__ = ["memory_bytes", "cores"]


def _cgroup_dirs(controller: str, proc: str, root: str) -> list[tuple[str, bool]]:
    """``(folder, is_v2)`` of this process's cgroup and of every cgroup above it, for
    ``controller`` (cgroup v2's unified hierarchy, or v1's hierarchy of that controller), as
    ``/proc/self/cgroup`` places them: the process's own first."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy
            base, v2 = root, True
        elif controller in controllers.split(","):
            base, v2 = os.path.join(root, controller), False  # v1 mounts "cpu,cpuacct", mostly with a "cpu" link
            if not os.path.isdir(base):
                base = os.path.join(root, controllers)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [(os.path.join(base, *parts[:depth]), v2) for depth in range(len(parts), -1, -1)]
    return dirs


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_limits(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[int]:
    """The memory limits (bytes) of this process's cgroup and every cgroup above it: cgroup v2
    (``memory.max``) and v1 (``memory.limit_in_bytes``)."""
    limits = []
    for folder, v2 in _cgroup_dirs("memory", proc, root):
        text = _read(os.path.join(folder, "memory.max" if v2 else "memory.limit_in_bytes"))
        if text is not None and text.isdigit():  # "max" (v2) or a huge number (v1: unlimited) changes nothing below
            limits.append(int(text))
    return limits


def _cgroup_cpus(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[int]:
    """The CPU quotas, in whole cores rounded up, of this process's cgroup and every cgroup
    above it: cgroup v2 (``cpu.max``: quota and period in µs, or ``max``) and v1
    (``cpu.cfs_quota_us``, -1 for none, over ``cpu.cfs_period_us``). A container's CPU limit."""
    quotas = []
    for folder, v2 in _cgroup_dirs("cpu", proc, root):
        if v2:
            quota, period = ((_read(os.path.join(folder, "cpu.max")) or "max").split() + ["100000"])[:2]
        else:
            quota = _read(os.path.join(folder, "cpu.cfs_quota_us")) or "-1"
            period = _read(os.path.join(folder, "cpu.cfs_period_us")) or "100000"
        if quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
            quotas.append(-(-int(quota) // int(period)))
    return quotas


def memory_bytes() -> int:
    """Bytes of memory this process and its page cache may use: the machine's, or the lowest
    limit of its cgroup and the cgroups above it (a container, a Slurm job, a systemd slice)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([total, *_cgroup_limits()])


def cores() -> int:
    """CPU cores this process may use: those it may run on (its affinity: ``taskset``, a Slurm
    job's cpuset), at most the lowest CPU quota of its cgroup and the cgroups above it, rounded
    up (a container's CPU limit, which leaves the affinity at every core of the node)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min([n, *_cgroup_cpus()]))
