"""Ranks compared through torch.distributed's store (gpuload.agree): ranks that would read
different rows are refused, ranks that agree and unrelated datasets are not.

The store is a real one of torch's (an in-process ``HashStore``, or a ``TCPStore`` on loopback);
the ranks are played by calls with each rank's number. tests/test_ddp.py refuses a real torchrun
job whose ranks give different seeds."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from gpuload import ConfigError
from gpuload import agree
from gpuload.agree import ENV, Agreement

from conftest import free_port

FIELDS = {"source": "0x00000000000000aa", "rows": 1000, "chunks": "0x01", "outputs": {"x": ["x"]}, "seed": 0,
          "shuffle": True, "batch_size": 64, "drop_last": False, "shuffle_window": 4, "world": 2, "local": None,
          "runs": [[2, 0]]}


@pytest.fixture
def store(monkeypatch):
    """A real in-process store; ``at(rank, world)`` makes the calls that follow be that rank's."""
    s = dist.HashStore()
    where = {}

    def at(rank: int, world: int):
        where["now"] = (s, rank, world)

    monkeypatch.setattr(agree, "_store", lambda: where.get("now"))
    monkeypatch.delenv(ENV, raising=False)
    at.store = s
    return at


def _ranks(store, world: int, fields_of, given: str = "data/ x", epoch: int = 0):
    """Each rank in turn (one Agreement per rank, as one per process) begins ``epoch``."""
    for r in range(world):
        store(r, world)
        a = _fresh(given)
        a.check(epoch, fields_of(r))


def _fresh(given: str) -> Agreement:
    """An Agreement as a process's first dataset of ``given`` makes it (its own process's count)."""
    agree._made.pop(given, None)
    return Agreement(given)


def test_ranks_that_agree_go_on(store):
    _ranks(store, 4, lambda r: {**FIELDS, "rank": r, "world": 4})


def test_two_processes_given_the_same_rank_are_refused(store):
    with pytest.raises(ConfigError, match=r"ranks 0 and 1 of this job both read the rows of rank 0 of 2 \(rank= given"):
        _ranks(store, 2, lambda r: {**FIELDS, "rank": 0, "world": 2})


def test_data_parallel_groups_under_model_parallelism_share_ranks(store, caplog):
    """4 processes, 2-way tensor parallel: data-parallel rank = process // 2 of 2, given as arguments."""
    _ranks(store, 4, lambda r: {**FIELDS, "rank": r // 2, "world": 2})
    assert "read by no process" not in caplog.text


def test_a_world_beyond_the_process_group_is_warned_about(store, caplog):
    _ranks(store, 2, lambda r: {**FIELDS, "rank": r, "world": 3})
    assert "world_size=3, but the process group has 2 ranks: the rows of rank 2 are read by no process" \
        in caplog.text


def test_a_seed_per_rank_is_refused_naming_both(store):
    with pytest.raises(ConfigError) as e:
        _ranks(store, 2, lambda r: {**FIELDS, "seed": r})
    msg = str(e.value)
    assert "ranks 0 and 1 of this job would read different rows: seed=1 on rank 1, seed=0 on rank 0. To fix: " in msg
    assert "seed=1 on rank 1, seed=0 on rank 0" in msg
    assert "give every rank the same seed=" in msg


def test_another_listing_is_named_as_the_files_not_their_rows(store):
    with pytest.raises(ConfigError, match=r"the source files differ \(11 files on rank 1, 10 on rank 0\): another listing .*\. To fix: open the same files on every rank") as e:
        _ranks(store, 2, lambda r: {**FIELDS, "source": f"0x{r:016x}", "rows": 1000 + r, "chunks": f"0x{r}",
                                    "files": 10 + r})
    assert "number of rows" not in str(e.value) and "number of files" not in str(e.value)


def test_a_state_loaded_on_one_rank_only_is_refused(store):
    with pytest.raises(ConfigError, match=r"restored position differs \(\[\[2, 0\]\] on rank 1, \[\[2, 7\]\] on "
                                          r"rank 0\)\. To fix: load the same state on every rank"):
        _ranks(store, 2, lambda r: {**FIELDS, "runs": [[2, 7]] if r == 0 else [[2, 0]]})


def test_one_rank_of_four_that_differs_is_found_by_a_neighbour(store):
    for odd in range(4):
        with pytest.raises(ConfigError, match=r"the world size: (3 on rank \d, 2|2 on rank \d, 3) on rank"):
            _ranks(store, 4, lambda r: {**FIELDS, "world": 3 if r == odd else 2}, epoch=odd)


def test_other_datasets_and_other_epochs_are_not_compared(store):
    store(0, 2)
    _fresh("data/ x").check(0, FIELDS)
    store(1, 2)
    _fresh("val/ x").check(0, {**FIELDS, "seed": 5})  # another dataset
    _fresh("data/ x").check(1, {**FIELDS, "seed": 5})  # the same one, at another epoch


def test_a_process_tells_its_datasets_of_the_same_source_apart(store):
    a, b = Agreement("same x"), Agreement("same x")
    assert a._name != b._name
    store(0, 2)
    a.check(0, FIELDS)
    b.check(0, {**FIELDS, "shuffle": False})  # a second dataset of the same files, unshuffled: not a's peer


def test_each_rank_keeps_one_post(store):
    a = _fresh("data/ x")
    store(0, 2)
    for epoch in range(3):
        a.check(epoch, FIELDS)
    assert not store.store.check([a._name + "/0/0"]) and not store.store.check([a._name + "/1/0"])
    assert store.store.check([a._name + "/2/0"])


def test_the_comparison_can_be_turned_off(store, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    _ranks(store, 2, lambda r: {**FIELDS, "seed": r})


def test_without_a_process_group_nothing_is_compared():
    assert not (dist.is_available() and dist.is_initialized())
    assert agree._store() is None
    Agreement("x").check(0, FIELDS)


def test_a_store_whose_server_is_gone_skips_the_comparison(monkeypatch):
    port = free_port()
    timeout = datetime.timedelta(seconds=2)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    a = _fresh("data/ x")
    monkeypatch.setattr(agree, "_store", lambda: (client, 1, 2))
    monkeypatch.delenv(ENV, raising=False)
    a.check(0, FIELDS)  # works
    del server  # the master's store gone: the next epoch's post fails, and nothing is compared
    a.check(1, {**FIELDS, "seed": 3})


def test_a_mixs_own_settings_are_named_as_given(store):
    mix = {"sources": [["a", "0x1"], ["b", "0x2"]], "weights": [0.5, 0.5], "mode": "proportion", "seed": 0,
           "world": 2, "runs": [[2, 10, 0, 10]]}
    _ranks(store, 2, lambda r: mix, given="mix", epoch=5)  # no rank of its own: nothing read twice
    with pytest.raises(ConfigError, match=r": weights=\[0.5, 0.5\] on rank 1, weights=\[0.7, 0.3\] on rank 0\. "
                                          r"To fix: give every rank the same weights="):
        _ranks(store, 2, lambda r: {**mix, "weights": [0.7, 0.3] if r == 0 else [0.5, 0.5]}, given="mix")
    with pytest.raises(ConfigError, match=r"a Mix's sources \(their names or files\) differ"):
        _ranks(store, 2, lambda r: {**mix, "sources": [["a", f"0x{r}"]]}, given="mix", epoch=1)
