"""Ranks that agree: every rank of a job must read the same files with the same order settings.

A rank with another seed, file listing, batch size or restored position reads some rows twice
and others never, silently, and ranks whose batch counts differ hang DDP at the first step one
of them no longer takes (architecture.md, Invariants 2). So when an iteration begins under a
``torch.distributed`` process group, each rank posts what shapes its order (the dataset's resume
signature, its rank, world size and the epoch's restored position: :class:`Agreement`) to the group's
key-value store, and compares it with its neighbours' (group ranks ``r - 1`` and ``r + 1``) where
they have posted theirs for the same dataset and epoch. A rank that finds a difference raises
:class:`~gpuload.ConfigError` naming it, the ranks and what to do (a :class:`gpuload.Mix` compares its own
settings the same way, and each of its sources its own); the launcher (torchrun,
Lightning, accelerate) then stops the others. Nothing waits for another rank: of two neighbours
that differ, the later to begin its epoch finds the other's post, and ranks that do not all agree
have such a pair of neighbours. Two store round trips per rank and epoch, whatever the world size.

A dataset is known across ranks by what the user gave (its source and outputs) and how many such
datasets the process made before it: the same code makes them in the same order on every rank.
``GPULOAD_CHECK_RANKS=0`` turns the comparison off (ranks that make such datasets in another
order on purpose). Without a process group (ranks passed as arguments, or a launcher's
environment alone) there is no store, and nothing is compared.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading

import torch
import xxhash

from .errors import ConfigError

__all__ = ["Agreement", "ENV"]

log = logging.getLogger("gpuload")

ENV = "GPULOAD_CHECK_RANKS"  #: "0": ranks are not compared

#: what each field of the comparison is, and what to do where ranks differ (in the order they are named;
#: a setting not listed here is named as itself: ``shuffle=``, a Mix's ``weights=``, ...)
_FIELDS = {
    "source": ("the source files", "open the same files on every rank: list them once and pass that list, or "
               "open them after the last file lands"),
    "rows": ("the number of rows", "open the same files on every rank"),
    "files": ("the number of files", "open the same files on every rank"),
    "chunks": ("the chunk layout", "give every rank the same chunk_bytes="),
    "outputs": ("the outputs", "give every rank the same columns="),
    "seed": ("seed=", "give every rank the same seed= (a seed per rank reads some rows twice and others never)"),
    "filter": ("filters=", "give every rank the same filters="),
    "world": ("the world size", "give every rank the same world_size= (or none, to take the process group's)"),
    "local": ("the ranks per node", "give every rank the same local_world_size= (or none)"),
    "runs": ("the epoch's restored position", "load the same state on every rank (rank 0's, saved with the "
             "model), or on none"),
    "sources": ("a Mix's sources (their names or files)", "give every rank's Mix the same sources"),
}


def _field(key: str) -> tuple[str, str]:
    """(what field ``key`` is, what to do where ranks differ in it): a setting not listed is named as one."""
    return _FIELDS.get(key, (f"{key}=", f"give every rank the same {key}="))


_made: collections.Counter = collections.Counter()  # datasets made so far in this process, by what was given
_made_lock = threading.Lock()


def _store():
    """(the default process group's store, its rank, its size), or None without a process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)  # torch's own, since 1.x
    if get is None:
        return None
    try:
        return get(), dist.get_rank(), dist.get_world_size()
    except (RuntimeError, ValueError):  # a group torch cannot give the store of (a custom backend)
        return None


class Agreement:
    """The comparison of one dataset's order settings with the other ranks' (see the module doc).

    ``given``: what the user gave that tells this dataset from others (its source and outputs, as text).
    """

    def __init__(self, given: str):
        with _made_lock:
            n = _made[given]
            _made[given] += 1
        self._name = f"gpuload/agree/{xxhash.xxh3_64_hexdigest(given.encode())}/{n}"
        self._posted: str | None = None  # this rank's last key, deleted when the next is posted
        self._told = False  # the warning of a world size beyond the process group's

    def check(self, epoch: int, fields: dict) -> None:
        """Post ``fields`` (JSON values: what shapes this rank's order in ``epoch``) and compare them
        with the neighbouring ranks' posts for the same epoch; :class:`ConfigError` where one differs.
        A store that fails (its server gone) skips the comparison."""
        if os.environ.get(ENV, "1").strip() == "0":
            return
        got = _store()
        if got is None:
            return
        store, rank, world = got
        key = f"{self._name}/{int(epoch)}/"
        posted, theirs = json.dumps(fields, sort_keys=True), {}
        try:
            store.set(key + str(rank), posted)
            if self._posted is not None and self._posted != key + str(rank):
                store.delete_key(self._posted)
            self._posted = key + str(rank)
            for q in sorted({(rank - 1) % world, (rank + 1) % world} - {rank}):
                if store.check([key + str(q)]):
                    theirs[q] = json.loads(store.get(key + str(q)))
        except (RuntimeError, OSError, ValueError) as e:  # the store's server gone, a timeout: nothing compared
            log.debug("gpuload: could not compare this rank's order settings with the others' (%s)", e)
            return
        mine = json.loads(posted)  # as the others see it (tuples become lists)
        # one rank's rows read by two processes is a mistake only where every process is a rank of its own
        # (fewer ranks than processes: data-parallel groups under model parallelism share them on purpose)
        shared = mine.get("rank") is not None and mine.get("world") == world
        for q, other in theirs.items():
            keys = [*_FIELDS, *sorted((set(mine) | set(other)) - set(_FIELDS) - {"rank"})]
            diffs = [k for k in keys if mine.get(k) != other.get(k)]
            if diffs:
                raise ConfigError(_message(diffs, mine, other, rank, q))
            if shared and mine["rank"] == other.get("rank"):
                raise ConfigError(
                    f"ranks {min(rank, q)} and {max(rank, q)} of this job both read the rows of rank "
                    f"{mine['rank']} of {world} (rank= given the same on both): give no rank= or world_size= "
                    "(the process group's are taken), or each process its own rank=")
        if mine.get("world", 0) > world and not self._told:
            self._told = True
            unread = f"rank {world}" if mine["world"] == world + 1 else f"ranks {world} to {mine['world'] - 1}"
            log.warning("gpuload: world_size=%s, but the process group has %d ranks: the rows of %s are read by "
                        "no process of this job", mine["world"], world, unread)


def _message(diffs: list, mine: dict, other: dict, rank: int, q: int) -> str:
    """The error of ranks ``rank`` (``mine``) and ``q`` (``other``) that differ in ``diffs``."""
    shown = [d for d in diffs if d not in ("rows", "chunks")] or diffs  # they follow from the files
    count = f" ({mine['files']} files on rank {rank}, {other['files']} on rank {q})" if "files" in shown else ""
    shown = [d for d in shown if d != "files" or "source" not in shown]  # said with the files
    parts = []
    for d in shown:
        what, _ = _field(d)
        if d in ("source", "chunks", "outputs", "sources"):
            parts.append(f"{what} differ" + (f"{count}: another listing (a file added or removed between the ranks' "
                                             "opens), or other copies of them" if d == "source" else ""))
        elif d == "runs":  # a run per ranks the epoch went on with: [world, batches taken, ...]
            parts.append(f"{what} differs ({mine.get(d)} on rank {rank}, {other.get(d)} on rank {q})")
        elif what.endswith("="):
            parts.append(f"{what}{mine.get(d)!r} on rank {rank}, {what}{other.get(d)!r} on rank {q}")
        else:
            parts.append(f"{what}: {mine.get(d)!r} on rank {rank}, {other.get(d)!r} on rank {q}")
    return (f"ranks {min(rank, q)} and {max(rank, q)} of this job would read different rows: "
            + "; ".join(parts) + ". To fix: " + "; ".join(dict.fromkeys(_field(d)[1] for d in shown))
            + f". Datasets of the same source and columns made in another order on another rank look like "
            f"this too: make them in the same order, or set {ENV}=0")
