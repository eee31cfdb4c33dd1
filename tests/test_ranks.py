"""Ranks and node-affine sharding (``shard="node"``) of a dataset.

* the node layout from arguments or torchrun's environment, and its refusals;
* with ``shard="node"`` on 2 nodes x 2 ranks: every rank the same batches, no row twice
  in an epoch, what is left out bounded and different each epoch, values equal to
  pyarrow's, each node reading only its own chunks, so a node-local cache holds only its
  share and later epochs decode nothing (the default mode, for contrast, fills each
  node's cache with more than its share);
* resume in node mode, on the same layout (exact) and on others (exactly once);
* ranks not passed are resolved from ``torch.distributed`` when an iteration begins (a
  dataset made before ``init_process_group`` shards like one made after it), and an
  iteration under a launcher's ``WORLD_SIZE>1`` with no process group is refused;
  torchrun's node variables are checked when the dataset is made.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

import gpuload
from gpuload.ranks import resolve_local_world

from conftest import open_dataset, record_loads, row_ids, write_parquet

pytestmark = pytest.mark.usefixtures("no_leftover_threads")

FILES = (700, 650, 900, 333)  # 2,583 rows in row groups of 100
BATCH = 32


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    start = 0
    rng = np.random.default_rng(5)
    for i, n in enumerate(FILES):
        write_parquet(d / f"part{i}.parquet", pa.table({"row_id": np.arange(start, start + n, dtype=np.int64),
                                                        "x": rng.standard_normal(n)}), row_group_size=100)
        start += n
    return d


def _open(source, cache, rank, world=4, local=2, shard="node", **kw):
    kw = {"batch_size": BATCH, "chunk_bytes": 4 << 10, "shuffle_window": 2, **kw}
    return open_dataset(source, ["row_id", "x"], cache, rank=rank, world_size=world, shard=shard,
                        local_world_size=local if shard == "node" else None, **kw)


# ---------------------------------------------------------------------------------------
# the node layout
# ---------------------------------------------------------------------------------------

def test_local_world_size_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_local_world(None, 3, 4) == 2
    with pytest.raises(gpuload.ConfigError, match="GROUP_RANK"):
        resolve_local_world(None, 2, 4)  # rank 2 is not node 1's local rank 1
    assert resolve_local_world(2, 2, 4) == 2  # explicit: the caller says where the rank is
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(gpuload.ConfigError, match="run under torchrun .* or pass local_world_size="):
        resolve_local_world(None, 0, 4)
    with pytest.raises(gpuload.ConfigError, match="must divide world_size=4"):
        resolve_local_world(3, 0, 4)


def test_bad_shard_and_too_small_shares_are_refused(source, tmp_path):
    with pytest.raises(gpuload.ConfigError, match="shard='nodes' must be 'global' or 'node'"):
        _open(source, tmp_path, 0, shard="nodes")
    assert len(_open(source, tmp_path, 0, world=4, local=2, chunk_bytes=1 << 30).reader.chunks) == 4  # a file each
    with pytest.raises(gpuload.ConfigError, match="too few for 2 local ranks"):
        _open(source, tmp_path, 0, world=16, local=2, chunk_bytes=1 << 30)  # 8 nodes for 4 chunks


# ---------------------------------------------------------------------------------------
# one epoch, many epochs
# ---------------------------------------------------------------------------------------

def test_node_mode_epochs(source, tmp_path):
    caches = [tmp_path / f"node{n}" for n in (0, 1)]
    ranks = [_open(source, caches[r // 2], r) for r in range(4)]
    owned = ranks[0].node_chunks()
    assert sorted(owned[0] + owned[1]) == list(range(len(ranks[0].reader.chunks)))
    loads = [record_loads(ds) for ds in ranks]
    table = pa.concat_tables([pa.parquet.read_table(p) for p in sorted(source.glob("*.parquet"))])
    x_by_id = table["x"].to_numpy()[np.argsort(table["row_id"].to_numpy())]
    n, left_out = sum(FILES), set()
    for epoch in range(3):
        batches = []
        for ds in ranks:
            ds.set_epoch(epoch)
            batches.append(list(ds))
        assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(ranks[0])  # DDP never hangs
        assert all([len(x["row_id"]) for x in b] == [len(x["row_id"]) for x in batches[0]] for b in batches)
        ids = np.concatenate([row_ids(b) for b in batches])
        assert len(np.unique(ids)) == len(ids) == ranks[0].rows_per_epoch  # no row twice
        for b in batches:
            for x in b:
                assert np.array_equal(x["x"].numpy(), x_by_id[x["row_id"].numpy()])  # pyarrow's values
        missing = set(range(n)) - set(ids.tolist())
        biggest = max(c.rows for c in ranks[0].reader.chunks)
        assert len(missing) < 2 * (biggest + 2)  # per node: under a chunk's rows plus the local ranks
        left_out.add(frozenset(missing))
        for r, loaded in enumerate(loads):  # a node's ranks read only that node's chunks
            assert set(loaded) <= set(owned[r // 2]), (epoch, r)
            loaded.clear()
        if epoch == 0:
            decoded = [ds.reader.counters.decoded for ds in ranks]
        else:  # each node's cache already holds its share: nothing decoded
            assert [ds.reader.counters.decoded for ds in ranks] == decoded
    assert len(left_out) == 3  # other rows left out in each epoch
    for node in (0, 1):  # each node-local cache holds exactly its node's share
        assert len(list(caches[node].rglob("*.glc"))) == len(owned[node])


def test_default_mode_fills_every_node_cache_beyond_its_share(source, tmp_path):
    """The contrast: with shard='global', a node's ranks read chunks of the whole dataset."""
    caches = [tmp_path / f"node{n}" for n in (0, 1)]
    ranks = [_open(source, caches[r // 2], r, shard="global") for r in range(4)]
    chunks = len(ranks[0].reader.chunks)
    for epoch in range(3):
        for ds in ranks:
            ds.set_epoch(epoch)
            list(ds)
    for ds in ranks:
        ds.reader.cache.flush()  # the writes still queued (a loaded machine once counted [13, 9] here)
    cached = [len(list(c.rglob("*.glc"))) for c in caches]
    assert all(c > chunks / 2 + 2 for c in cached), cached


def test_node_mode_order_is_a_pure_function(source, tmp_path):
    a = _open(source, tmp_path / "a", 3, num_threads=1, prefetch=0)
    b = _open(source, tmp_path / "b", 3, num_threads=3, prefetch=4)
    for ds in (a, b):
        ds.set_epoch(2)
    assert np.array_equal(row_ids(list(a)), row_ids(list(b)))
    a.set_epoch(3)
    b.set_epoch(2)
    assert not np.array_equal(row_ids(list(a)), row_ids(list(b)))


# ---------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------

def _take(ds, epoch, k):
    ds.set_epoch(epoch)
    it = iter(ds)
    got = list(itertools.islice(it, k))
    state = ds.state_dict()
    it.close()
    return got, state


def test_node_mode_resume_on_the_same_layout_is_exact(source, tmp_path):
    ref = _open(source, tmp_path / "c", 1)
    ref.set_epoch(1)
    want = list(ref)
    got, state = _take(_open(source, tmp_path / "c", 1), 1, 7)
    assert state["runs"] == [[4, 7, 2]]
    ds = _open(source, tmp_path / "c", 1)
    ds.load_state_dict(state)
    ds.set_epoch(1)
    rest = list(ds)
    assert len(got) + len(rest) == len(want)
    assert all(np.array_equal(x["row_id"].numpy(), y["row_id"].numpy()) and np.array_equal(x["x"].numpy(),
               y["x"].numpy()) for x, y in zip(got + rest, want))


@pytest.mark.parametrize("world, local, shard", [(3, None, "global"), (2, 1, "node"), (6, 3, "node"), (4, 1, "node")])
def test_node_mode_resume_on_other_layouts_delivers_the_rest_once(source, tmp_path, world, local, shard):
    """From 2 nodes x 2 ranks to other ranks or nodes: the rest of the epoch exactly once, then their own order."""
    taken, state = [], None
    for r in range(4):
        got, state = _take(_open(source, tmp_path / "c", r), 0, 5)
        taken.append(row_ids(got))
    news = [_open(source, tmp_path / "c", r, world=world, local=local or 1, shard=shard) for r in range(world)]
    rest = []
    for ds in news:
        ds.load_state_dict(state)
        ds.set_epoch(0)
        rest.append(list(ds))
    assert len({len(b) for b in rest}) == 1
    ids = np.concatenate(taken + [row_ids(b) for b in rest])
    assert len(np.unique(ids)) == len(ids)
    assert len(ids) >= _open(source, tmp_path / "c", 0).rows_per_epoch - world  # the rest, all but < world rows
    for ds in news:  # the next epoch is the new layout's own
        ds.set_epoch(1)
        fresh = _open(source, tmp_path / "c", ds.rank, world=world, local=local or 1, shard=shard)
        fresh.set_epoch(1)
        assert np.array_equal(row_ids(list(ds)), row_ids(list(fresh)))


# ---------------------------------------------------------------------------------------
# ranks resolved when iteration begins
# ---------------------------------------------------------------------------------------

@pytest.fixture
def process_group(monkeypatch):
    """``start(rank, world)``: this process becomes rank ``rank`` of a fake process group of
    ``world`` (torch's ``fake`` backend: no peers, no collectives); destroyed after the test.
    The launcher's variables are cleared first (a test run under torchrun has them)."""
    dist = torch.distributed
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)

    def start(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _lazy(source, cache, shard="global", **kw):
    """A dataset opened without rank= and world_size=."""
    kw = {"batch_size": BATCH, "chunk_bytes": 4 << 10, "shuffle_window": 2, **kw}
    return gpuload.ParquetDataset(source, ["row_id", "x"], cache_dir=cache, device="cpu", shard=shard, **kw)


@pytest.mark.parametrize("shard", ["global", "node"])
def test_a_dataset_made_before_the_process_group_follows_it(source, tmp_path, process_group, shard):
    cache = tmp_path / "c"
    local = {"local_world_size": 2} if shard == "node" else {}
    ds = _lazy(source, cache, shard, **local)  # no process group yet: rank 0 of 1 for now
    if shard == "global":
        assert (ds.rank, ds.world_size) == (0, 1)
    process_group(3, 4)
    want = _open(source, cache, 3, world=4, local=2, shard=shard)
    assert (ds.rank, ds.world_size) == (3, 4)
    assert len(ds) == len(want) and ds.rows_per_epoch == want.rows_per_epoch
    assert ds.state_dict() == want.state_dict()
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        want.set_epoch(epoch)
        assert np.array_equal(row_ids(list(ds)), row_ids(list(want)))
    if shard == "node":
        assert ds.node_chunks() == want.node_chunks()
    # a later epoch follows the process group of its own start
    process_group(1, 2)
    want2 = _open(source, cache, 1, world=2, local=2, shard=shard)
    ds.set_epoch(2)
    want2.set_epoch(2)
    assert len(ds) == len(want2)
    assert np.array_equal(row_ids(list(ds)), row_ids(list(want2)))


def test_an_epoch_keeps_the_ranks_it_began_with(source, tmp_path, process_group):
    process_group(0, 2)
    ds = _lazy(source, tmp_path / "c")
    want = _open(source, tmp_path / "c", 0, world=2, shard="global")
    it = iter(ds)
    got = [next(it)]
    process_group(0, 3)  # the group changes mid-epoch: the next epoch's concern
    assert len(ds) == len(want) and ds.state_dict()["runs"] == [[2, 1]]
    got += list(it)
    assert np.array_equal(row_ids(got), row_ids(list(want)))
    assert ds.world_size == 3 and ds.state_dict()["runs"] == [[2, len(want)]]  # the epoch that ran


def test_explicit_ranks_are_fixed(source, tmp_path, process_group):
    process_group(1, 4)
    ds = _open(source, tmp_path / "c", 0, world=2, shard="global")
    assert (ds.rank, ds.world_size) == (0, 2)
    assert ds.state_dict()["runs"] == [[2, 0]]


def test_a_rank_without_a_world_size_or_a_process_group_is_refused(source, tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    ds = _lazy(source, tmp_path / "c", rank=1)
    with pytest.raises(gpuload.ConfigError, match=r"rank=1 without world_size=, and no process group .*pass "
                                                  r"world_size= too"):
        len(ds)
    assert len(_lazy(source, tmp_path / "c", rank=0)) == len(_lazy(source, tmp_path / "c"))  # rank 0 of 1


def test_a_world_size_without_a_rank_or_a_process_group_is_refused(source, tmp_path, monkeypatch):
    """Every process would be rank 0 of world_size and read rank 0's rows, the others' never."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    ds = _lazy(source, tmp_path / "c", world_size=2)
    for call in (lambda: next(iter(ds)), lambda: len(ds)):
        with pytest.raises(gpuload.ConfigError, match=r"world_size=2 without rank=, and no process group .*pass "
                                                      r"rank= too"):
            call()
    assert len(_lazy(source, tmp_path / "c", world_size=1)) == len(_lazy(source, tmp_path / "c"))  # rank 0 of 1


def test_world_size_from_a_launcher_without_a_process_group_is_refused(source, tmp_path, process_group,
                                                                        monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ds = _lazy(source, tmp_path / "c")  # made before init_process_group: fine
    for call in (lambda: next(iter(ds)), lambda: len(ds), lambda: ds.state_dict(), lambda: ds.rows_per_epoch):
        with pytest.raises(gpuload.ConfigError, match=r"WORLD_SIZE=2 .*init_process_group.* rank=.*world_size="):
            call()
    assert "rank=? (not known yet)" in repr(ds)
    process_group(1, 2)  # once the group exists, the same dataset works
    assert len(ds) == len(_open(source, tmp_path / "c", 1, world=2, shard="global"))
    assert len(list(ds)) == len(ds)
    explicit = _open(source, tmp_path / "c", 1, world=2, shard="global")  # or the ranks are passed
    assert len(list(explicit)) == len(explicit)


def test_a_state_loaded_before_the_process_group(source, tmp_path, process_group, monkeypatch):
    """A state restored before init_process_group goes on as the group's ranks will (here: 1 rank's
    state, elastic onto rank 1 of 2)."""
    one = _open(source, tmp_path / "c", 0, world=1, shard="global")
    it = iter(one)
    taken = [next(it) for _ in range(5)]
    state = one.state_dict()
    it.close()
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = _lazy(source, tmp_path / "c")
    ds.load_state_dict(state)
    assert ds.state_dict() == state  # as saved: the ranks are not known yet
    process_group(1, 2)
    want = _open(source, tmp_path / "c", 1, world=2, shard="global")
    want.load_state_dict(state)
    assert ds.state_dict() == want.state_dict() and ds.state_dict()["runs"] == [[1, 5], [2, 0]]
    assert np.array_equal(row_ids(list(ds)), row_ids(list(want)))
    assert len(taken) == 5


# ---------------------------------------------------------------------------------------
# torchrun's node variables
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, match", [
    ({"GROUP_RANK": "one"}, "GROUP_RANK='one'"),
    ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK='1.5'"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 .*LOCAL_WORLD_SIZE=2"),
    ({"GROUP_RANK": "-1"}, "GROUP_RANK=-1"),
    ({"GROUP_RANK": "2"}, "GROUP_RANK=2 .*2 nodes"),  # world_size=4 with 2 per node: nodes 0 and 1
    ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two'"),
    ({"GROUP_RANK": "1"}, "rank 0 is not"),  # rank 0 is on node 0
    ({"LOCAL_RANK": "1"}, "rank 0 is not"),  # and is its local rank 0
])
def test_bad_node_variables_are_refused_when_the_dataset_is_made(source, tmp_path, monkeypatch, env, match):
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(gpuload.ConfigError, match=match):
        _open(source, tmp_path / "c", 0, world=4, local=None)
    for name in env:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert len(_open(source, tmp_path / "c", 0, world=4, local=None)) > 0


def test_node_variables_are_checked_before_the_process_group_exists(source, tmp_path, process_group, monkeypatch):
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "LOCAL_RANK": "1", "RANK": "3"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(gpuload.ConfigError, match=r"RANK=3 is not GROUP_RANK \* LOCAL_WORLD_SIZE \+ LOCAL_RANK"):
        _lazy(source, tmp_path / "c", "node")
    monkeypatch.setenv("RANK", "1")
    ds = _lazy(source, tmp_path / "c", "node")  # consistent: rank 1 is node 0's local rank 1
    process_group(1, 4)
    assert ds.local_world_size == 2 and len(ds) == len(_open(source, tmp_path / "c", 1, world=4, local=2))
    process_group(2, 4)  # a process group that puts this process elsewhere than torchrun said
    with pytest.raises(gpuload.ConfigError, match="rank 2 is not"):
        next(iter(ds))


# ---------------------------------------------------------------------------------------
# Slurm: the variables as Slurm 22.05 sets them (captured from a real single-node cluster)
# ---------------------------------------------------------------------------------------

_JOB = {"SLURM_JOB_ID": "2", "SLURM_JOBID": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4", "SLURMD_NODENAME": "localhost"}


def _srun(rank: int, world: int = 4, per_node: str = "4", local: int | None = None) -> dict:
    """An srun task's variables (``srun -n 4``: step 0)."""
    return {**_JOB, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank if local is None else local),
            "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": str(world),
            "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_GTIDS": "0,1,2,3",
            "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SRUN_COMM_HOST": "127.0.0.1"}


_BATCH_STEP = {**_JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_GTIDS": "0"}  # sbatch -n 4, no srun
_INTERACTIVE = {**_BATCH_STEP, "SLURM_STEP_ID": "4294967290", "SLURM_STEPID": "4294967290",  # salloc's shell
                "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}


@pytest.fixture
def slurm_env(monkeypatch):
    """``use(variables)``: the environment holds exactly these Slurm variables and no launcher's."""
    import gpuload.ranks as ranks

    monkeypatch.setattr(ranks, "_warned_batch", False)

    def use(variables: dict) -> None:
        for name in [n for n in os.environ if n.startswith(("SLURM", "PMI"))] + list(ranks._TORCHRUN):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return use


def _epoch_ids(ds) -> list[np.ndarray]:
    return [b["row_id"].numpy() for b in ds]


def test_srun_tasks_shard_by_slurms_variables(source, tmp_path, slurm_env):
    seen, counts = [], set()
    for rank in range(4):
        slurm_env(_srun(rank))
        got = _epoch_ids(_lazy(source, tmp_path / "c", seed=3))
        slurm_env({})
        want = _epoch_ids(_lazy(source, tmp_path / "c", seed=3, rank=rank, world_size=4))
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        seen.append(np.concatenate(got))
        counts.add(len(got))
    assert len(counts) == 1 and np.array_equal(np.sort(np.concatenate(seen)), np.arange(sum(FILES)))


@pytest.mark.parametrize("variables", [_BATCH_STEP, _INTERACTIVE], ids=["batch-step", "salloc-shell"])
def test_a_process_srun_did_not_start_is_one_rank_and_says_so(source, tmp_path, slurm_env, variables, caplog):
    slurm_env(variables)
    with caplog.at_level("WARNING", logger="gpuload"):
        ids = np.concatenate(_epoch_ids(_lazy(source, tmp_path / "c")))
    assert np.array_equal(np.sort(ids), np.arange(sum(FILES)))  # rank 0 of 1: every row
    assert any("SLURM_NTASKS=4" in r.getMessage() and "srun" in r.getMessage() for r in caplog.records)


def test_torchrun_and_a_process_group_come_before_slurm(source, tmp_path, slurm_env, process_group, monkeypatch):
    slurm_env({**_srun(1), "WORLD_SIZE": "2"})  # torchrun inside an srun task: torchrun's ranks count
    with pytest.raises(gpuload.ConfigError, match="WORLD_SIZE=2"):
        list(_lazy(source, tmp_path / "c"))
    slurm_env(_srun(1))
    process_group(0, 2)  # Lightning's SLURMEnvironment made a group: it counts
    assert len(_lazy(source, tmp_path / "c")) == len(_lazy(source, tmp_path / "c", rank=0, world_size=2))


def test_node_sharding_under_srun_takes_the_tasks_per_node(source, tmp_path, slurm_env):
    slurm_env(_srun(3, per_node="2(x2)", local=1))  # srun -N 2 --ntasks-per-node 2, block layout
    ds = _lazy(source, tmp_path / "c", shard="node", seed=1)
    want = _open(source, tmp_path / "c", 3, world=4, local=2, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(_epoch_ids(ds), _epoch_ids(want)))
    slurm_env(_srun(1, per_node="2(x2)", local=0))  # --distribution=cyclic: rank 1 is the first on node 1
    with pytest.raises(gpuload.ConfigError, match="SLURM_LOCALID=0"):
        _lazy(source, tmp_path / "c", shard="node")
    slurm_env(_srun(1, world=3, per_node="2,1", local=1))  # nodes with different numbers of tasks
    with pytest.raises(gpuload.ConfigError, match="SLURM_STEP_TASKS_PER_NODE='2,1'"):
        _lazy(source, tmp_path / "c", shard="node")
    assert len(_lazy(source, tmp_path / "c")) > 0  # global sharding does not need the layout


def test_srun_tasks_per_node_are_not_taken_for_a_process_groups_ranks(source, tmp_path, slurm_env, process_group):
    slurm_env(_srun(1, world=2, per_node="1(x2)", local=0))  # one srun task per node, each spawning 8 ranks
    ds = _lazy(source, tmp_path / "c", shard="node")
    process_group(3, 16)
    with pytest.raises(gpuload.ConfigError, match="srun started 2 tasks"):
        len(ds)


def test_mpirun_inside_an_allocation_is_not_taken_for_srun(source, tmp_path, slurm_env):
    slurm_env({**_srun(0, world=2, per_node="1(x2)"), "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "5"})
    with pytest.raises(gpuload.ConfigError, match="OMPI_COMM_WORLD_SIZE=16"):
        list(_lazy(source, tmp_path / "c"))  # no process group: each rank would read every row
