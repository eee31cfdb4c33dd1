"""Ranks: this process's rank, the world size and the node layout, from arguments,
``torch.distributed`` or torchrun's environment."""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

__all__ = ["resolve_ranks", "resolve_local_world"]


def _check_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{name}={v!r} must be an integer")
    return v


def resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the arguments, else ``torch.distributed`` when initialised, else 0 and 1."""
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = _check_int("rank", 0 if rank is None else rank)
    world_size = _check_int("world_size", 1 if world_size is None else world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} and world_size={world_size}: need 0 <= rank < world_size")
    return rank, world_size


def resolve_local_world(local_world_size: int | None, rank: int, world_size: int) -> int:
    """Ranks per node for node-affine sharding: the argument, else torchrun's ``LOCAL_WORLD_SIZE``.

    Global rank ``r`` must be local rank ``r % L`` of node ``r // L`` (torchrun's layout, with the
    same number of ranks on every node); where torchrun's ``GROUP_RANK`` and ``LOCAL_RANK`` are
    set, they are checked against it.
    """
    from_env = local_world_size is None
    if from_env:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ConfigError("shard='node' needs the number of ranks per node: run under torchrun (which sets "
                              "LOCAL_WORLD_SIZE), or pass local_world_size=")
        try:
            local_world_size = int(env)
        except ValueError:
            raise ConfigError(f"LOCAL_WORLD_SIZE={env!r} in the environment is not an integer") from None
    local = _check_int("local_world_size", local_world_size)
    if local < 1 or world_size % local:
        raise ConfigError(f"local_world_size={local} must divide world_size={world_size} (the same number of "
                          "ranks on every node)")
    group, local_rank = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_RANK")
    if from_env and group is not None and local_rank is not None and int(group) * local + int(local_rank) != rank:
        raise ConfigError(f"rank {rank} is not GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK ({group} * {local} + "
                          f"{local_rank}): shard='node' needs torchrun's rank layout; pass rank= and "
                          "local_world_size= to say which node a rank is on")
    return local
