"""Ranks: this process's rank, the world size and the node layout, from arguments,
``torch.distributed`` or torchrun's environment.

Ranks passed as arguments are fixed. Those not passed come from ``torch.distributed``,
asked again each time a dataset needs them (when an iteration begins, ``len()``,
``state_dict()``...), so a dataset made before ``init_process_group`` (under torchrun,
or in a LightningModule's ``__init__``) shards like one made after it. Without a process
group a process is rank 0 of 1, except under a launcher that says otherwise
(``WORLD_SIZE>1``): reading every row on every rank would break "every row once", so
that is refused with a :class:`~gpuload.ConfigError`.

torchrun's node variables (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_RANK``, and
``RANK``), read for ``shard="node"``, must be integers that agree with each other and
with the rank: they are checked when the dataset is made, and against the rank when it
is known.

**Slurm.** Without a process group and without torchrun's variables, a task that
``srun`` started is rank ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` (the step's tasks,
not ``SLURM_NTASKS``, the allocation's), with ``SLURM_STEP_TASKS_PER_NODE`` ranks per
node and ``SLURM_LOCALID`` checked against the rank for ``shard="node"``. An srun task is
told by ``SLURM_STEP_ID`` (a job step's number) with ``SLURM_STEP_NUM_TASKS``: a batch
script's own process also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``, but no step
variables, and is rank 0 of 1 (it is one process, and reads every row; a warning says
so when the allocation has more tasks). The interactive step of ``salloc`` is a shell,
not a training task (its ``SLURM_STEP_ID`` is one of Slurm's special ids) and counts as
no step either.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from .errors import ConfigError, integer

__all__ = ["Ranks", "RankLayout", "SlurmTask", "resolve_ranks", "resolve_local_world", "slurm_task"]

log = logging.getLogger("gpuload")
_TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")
_LAUNCHED = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")  # the world size a launcher other than srun says
_SPECIAL_STEPS = 0xFFFFFFF0  # Slurm's step ids from here up are the batch, extern and interactive steps
_warned_batch = False


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` of ``world`` ranks; ``local``: ranks per node (``shard="node"``), else None."""

    rank: int
    world: int
    local: int | None = None


def _check_int(name: str, v) -> int:
    n = integer(v)
    if n is None:
        raise ConfigError(f"{name}={v!r} must be an integer")
    return n


def _env_int(name: str, low: int) -> int | None:
    """The environment variable ``name`` as an integer of at least ``low``; None when unset."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} in the environment is not an integer: unset it, or start the job "
                          "with a launcher (torchrun) that sets it") from None
    if value < low:
        raise ConfigError(f"{name}={value} in the environment must be at least {low}")
    return value


@dataclass(frozen=True)
class SlurmTask:
    """An srun task's place: ``rank`` of ``world`` tasks in its step, ``per_node`` tasks on
    each node (None when nodes have different numbers), ``local`` its rank on its node."""

    rank: int
    world: int
    per_node: int | None
    local: int


def _tasks_per_node(text: str) -> int | None:
    """``SLURM_STEP_TASKS_PER_NODE`` (``"4"``, ``"4(x2)"``, ``"4(x2),4"``) as one number, None if nodes differ."""
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", text)}
    return counts.pop() if len(counts) == 1 else None


def slurm_task() -> SlurmTask | None:
    """This process's place in its Slurm job step, when ``srun`` started it and torchrun's
    variables are absent (see the module doc); None otherwise."""
    global _warned_batch
    env = os.environ
    if any(name in env for name in _TORCHRUN):
        return None
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    if not step.isdigit() or int(step) >= _SPECIAL_STEPS or "SLURM_STEP_NUM_TASKS" not in env:
        tasks = env.get("SLURM_NTASKS", "").strip()
        if tasks.isdigit() and int(tasks) > 1 and "SLURM_JOB_ID" in env and not _warned_batch:
            _warned_batch = True
            log.warning("gpuload: SLURM_NTASKS=%s, but srun did not start this process (no SLURM_STEP_ID): it is "
                        "rank 0 of 1 and reads every row; start the training with `srun python ...` to shard it "
                        "over the job's tasks", tasks)
        return None
    world = _env_int("SLURM_STEP_NUM_TASKS", 1)
    mpi = env.get("OMPI_COMM_WORLD_SIZE", "").strip()
    if mpi and mpi != str(world):  # mpirun inside the allocation: its ranks are not srun's tasks
        return None
    rank = _env_int("SLURM_PROCID", 0)
    rank = 0 if rank is None else rank
    if rank >= world:
        raise ConfigError(f"SLURM_PROCID={rank} in the environment must be below SLURM_STEP_NUM_TASKS={world}")
    local = _env_int("SLURM_LOCALID", 0)
    return SlurmTask(rank, world, _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world))),
                     0 if local is None else local)


def _group() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default process group, None when there is none."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class RankLayout:
    """Where a dataset's ranks come from (see the module doc).

    Parameters
    ----------
    rank, world_size : fixed values, or None to take them from ``torch.distributed``.
    shard : ``"global"`` or ``"node"``.
    local_world_size : ranks per node with ``shard="node"`` (None: torchrun's ``LOCAL_WORLD_SIZE``).
    """

    def __init__(self, rank: int | None, world_size: int | None, shard: str, local_world_size: int | None):
        if shard not in ("global", "node"):
            raise ConfigError(f"shard={shard!r} must be 'global' or 'node'")
        self.rank = None if rank is None else _check_int("rank", rank)
        self.world = None if world_size is None else _check_int("world_size", world_size)
        if self.world is not None and self.world < 1:
            raise ConfigError(f"world_size={self.world} must be at least 1")
        if self.rank is not None and not 0 <= self.rank < (self.world or 1 << 62):
            raise ConfigError(f"rank={self.rank} and world_size={self.world}: need 0 <= rank < world_size")
        self.node = shard == "node"
        self.local: int | None = None
        self.node_env: tuple[int | None, int | None] = (None, None)  # torchrun's (GROUP_RANK, LOCAL_RANK)
        self.slurm: SlurmTask | None = None  # where the node layout came from Slurm
        if not self.node:
            return
        if local_world_size is not None:  # explicit: the caller says where each rank is
            self.local = _check_int("local_world_size", local_world_size)
            if self.local < 1:
                raise ConfigError(f"local_world_size={self.local} must be at least 1")
            return
        self.local = _env_int("LOCAL_WORLD_SIZE", 1)
        slurm = slurm_task() if self.local is None else None
        if slurm is not None:
            if slurm.per_node is None:
                raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={os.environ.get('SLURM_STEP_TASKS_PER_NODE')!r}: "
                                  "shard='node' needs the same number of tasks on every node (srun "
                                  "--ntasks-per-node=N), or pass local_world_size=")
            self.local, self.node_env, self.slurm = slurm.per_node, (None, slurm.local), slurm
            return
        if self.local is None:
            raise ConfigError("shard='node' needs the number of ranks per node: run under torchrun (which sets "
                              "LOCAL_WORLD_SIZE) or srun (SLURM_STEP_TASKS_PER_NODE), or pass local_world_size=")
        group, local_rank = _env_int("GROUP_RANK", 0), _env_int("LOCAL_RANK", 0)
        if local_rank is not None and local_rank >= self.local:
            raise ConfigError(f"LOCAL_RANK={local_rank} in the environment must be below "
                              f"LOCAL_WORLD_SIZE={self.local}")
        self.node_env = (group, local_rank)
        env_rank = _env_int("RANK", 0)
        if env_rank is not None and group is not None and local_rank is not None \
                and env_rank != group * self.local + local_rank:
            raise ConfigError(f"RANK={env_rank} is not GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK ({group} * "
                              f"{self.local} + {local_rank}) in the environment: shard='node' needs torchrun's "
                              "rank layout; pass rank=, world_size= and local_world_size= to say where each rank is")
        if self.known:
            self.resolve()  # the rank is known now: check it against the node variables

    @property
    def fixed(self) -> bool:
        """Whether both the rank and the world size were passed."""
        return self.rank is not None and self.world is not None

    @property
    def known(self) -> bool:
        """Whether the ranks can be told now (passed, or a process group exists)."""
        return self.fixed or _group() is not None or slurm_task() is not None

    def resolve(self, strict: bool = True) -> Ranks | None:
        """The ranks now: the arguments, else the process group's, else rank 0 of 1.

        Raises :class:`ConfigError` where the environment says ``WORLD_SIZE>1`` but no process
        group exists to tell this process's rank (with ``strict=False``: returns None).
        """
        rank, world = self.rank, self.world
        if rank is None or world is None:
            group = _group()
            slurm = slurm_task() if group is None else None
            if group is not None or slurm is not None:
                rank = (group[0] if group else slurm.rank) if rank is None else rank
                world = (group[1] if group else slurm.world) if world is None else world
            else:
                name = next((n for n in _LAUNCHED if os.environ.get(n) is not None), "WORLD_SIZE")
                launched = _env_int(name, 1)
                if launched is not None and launched > 1:
                    if not strict:
                        return None
                    raise ConfigError(
                        f"{name}={launched} in the environment (a launcher started this process: torchrun, "
                        "Lightning, accelerate, mpirun), but torch.distributed has no process group yet, so this rank "
                        "would read every row: call torch.distributed.init_process_group() before iterating "
                        "the dataset (it may be made before), or pass rank= and world_size=")
        if rank is None and world is not None and world > 1:  # world_size alone: every process would be rank 0
            raise ConfigError(f"world_size={world} without rank=, and no process group (nor srun) says which rank "
                              "this process is, so every process would read rank 0's rows: pass rank= too, or call "
                              "torch.distributed.init_process_group() before iterating")
        rank = 0 if rank is None else rank
        if world is None and rank > 0:  # rank given alone, no process group nor launcher to tell the world
            raise ConfigError(f"rank={rank} without world_size=, and no process group (nor srun) says how many "
                              "ranks there are: pass world_size= too, or call torch.distributed."
                              "init_process_group() before iterating")
        world = 1 if world is None else world
        if not 0 <= rank < world:
            raise ConfigError(f"rank={rank} and world_size={world}: need 0 <= rank < world_size")
        if self.local is None:
            return Ranks(rank, world)
        local = self.local
        if self.slurm is not None and world != self.slurm.world:  # e.g. one srun task per node spawning ranks
            raise ConfigError(f"shard='node': {world} ranks, but srun started {self.slurm.world} tasks "
                              f"(SLURM_STEP_NUM_TASKS), so its tasks per node are not the ranks per node; pass "
                              "local_world_size=")
        if world % local:
            raise ConfigError(f"local_world_size={local} must divide world_size={world} (the same number of "
                              "ranks on every node)")
        group_rank, local_rank = self.node_env
        fix = (f"shard='node' needs {'torchrun' if self.slurm is None else 'srun'}'s rank layout; pass rank= and "
               "local_world_size= to say which node a rank is on")
        if group_rank is not None and group_rank >= world // local:
            raise ConfigError(f"GROUP_RANK={group_rank} in the environment: world_size={world} with "
                              f"LOCAL_WORLD_SIZE={local} has {world // local} nodes (0 to {world // local - 1})")
        if group_rank is not None and local_rank is not None:
            if group_rank * local + local_rank != rank:
                raise ConfigError(f"rank {rank} is not GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK ({group_rank} "
                                  f"* {local} + {local_rank}): {fix}")
        elif group_rank is not None and rank // local != group_rank:
            raise ConfigError(f"rank {rank} is not on node GROUP_RANK={group_rank} (ranks {group_rank * local} to "
                              f"{group_rank * local + local - 1} with LOCAL_WORLD_SIZE={local}): {fix}")
        elif local_rank is not None and rank % local != local_rank:
            names = ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if self.slurm is None else ("SLURM_LOCALID", "tasks per node")
            raise ConfigError(f"rank {rank} is not {names[0]}={local_rank} of its node (rank % {names[1]} = "
                              f"{rank % local}): {fix}" + ("" if self.slurm is None else
                                                           " (srun's default block distribution gives that layout)"))
        return Ranks(rank, world, local)


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) now: the arguments, else ``torch.distributed`` when initialised, else 0 and 1."""
    r = RankLayout(rank, world_size, "global", None).resolve()
    return r.rank, r.world


def resolve_local_world(local_world_size: int | None, rank: int, world_size: int) -> int:
    """Ranks per node for node-affine sharding: the argument, else torchrun's ``LOCAL_WORLD_SIZE``.

    Global rank ``r`` must be local rank ``r % L`` of node ``r // L`` (torchrun's layout, with the
    same number of ranks on every node); where torchrun's ``GROUP_RANK`` and ``LOCAL_RANK`` are
    set, they are checked against it.
    """
    return RankLayout(rank, world_size, "node", local_world_size).resolve().local
