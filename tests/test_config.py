"""Settings: :class:`gpuload.config.Source` and :class:`gpuload.config.Options`, each default written once."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path

import numpy as np
import pytest

import gpuload
from gpuload.config import Options, Source
from gpuload.sources.settings import RemoteSettings


@pytest.mark.parametrize("api", [gpuload.ParquetDataset.__init__, gpuload.build_cache])
def test_flat_apis_take_every_default_from_the_settings(api):
    """A keyword of a flat API that is a setting defaults to the setting's default (build_cache's
    device excepted: it decodes on the CPU unless asked)."""
    defaults = {f.name: f.default for cls in (Source, Options) for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    params = inspect.signature(api).parameters
    shared = [p for p in params.values() if p.name in defaults and p.name != "source"]
    assert len(shared) >= 15
    for p in shared:
        if (api, p.name) == (gpuload.build_cache, "device"):
            assert p.default == "cpu"
            continue
        assert p.default == defaults[p.name], p.name


def test_every_setting_of_the_dataset_is_a_keyword_of_it():
    params = set(inspect.signature(gpuload.ParquetDataset.__init__).parameters)
    assert {f.name for cls in (Source, Options) for f in dataclasses.fields(cls)} <= params


def test_of_takes_its_own_settings_and_ignores_the_rest():
    given = {"batch_size": 10, "columns": ["a"], "progress": True, "source": "x.parquet"}
    o, s = Options.of(given), Source.of(given)
    assert o.batch_size == 10 and o.seed == Options.seed and s.columns == ["a"] and s.source == "x.parquet"


@pytest.mark.parametrize("shuffle, block_rows, shuffled, block", [
    (True, 7, True, None), (False, 7, False, None), ("block", 7, True, 7), (np.bool_(True), 0, True, None)])
def test_shuffle_modes(shuffle, block_rows, shuffled, block):
    o = Options(shuffle=shuffle, block_rows=block_rows)
    assert (o.shuffled, o.block) == (shuffled, block)
    assert dataclasses.replace(o, seed=3).block == block  # replace keeps the mode


@pytest.mark.parametrize("kw, match", [
    ({"shuffle": "rows"}, "shuffle='rows' must be True"),
    ({"shuffle": "block", "block_rows": 0}, "block_rows=0 must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"shard": "rack"}, "shard='rack' must be 'global' or 'node'"),
    ({"layout": "diagonal"}, "layout='diagonal'"),
    ({"decode": "tpu"}, "decode='tpu'"),
    ({"chunk_bytes": 100}, "chunk_bytes=100"),
    ({"nice": 20}, "nice=20 must be an integer from 0 to 19"),
    ({"nice": -1}, "nice=-1"),
    ({"nice": 1.5}, "nice=1.5"),
    ({"cache_io": "mmap"}, "cache_io='mmap' must be 'auto', 'direct', 'buffered' or 'off'"),
])
def test_bad_options_are_refused_naming_the_setting(kw, match):
    with pytest.raises(gpuload.ConfigError, match=match):
        Options(**kw)


def test_source_normalises_remote_settings_and_refuses_bad_ones():
    assert Source("x").remote == RemoteSettings()
    assert Source("x", remote={"retries": 2}).remote.retries == 2
    with pytest.raises(gpuload.ConfigError, match="unknown setting"):
        Source("x", remote={"retry": 2})
    with pytest.raises(gpuload.ConfigError, match="storage_options"):
        Source("s3://b/x", storage_options="anon")


def test_cache_dir_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(tmp_path / "env"))
    assert Options().cache_dir == tmp_path / "env"
    assert Options(cache_dir="~/c").cache_dir == Path("~/c").expanduser()


def test_settings_travel_pickled_as_they_are(tmp_path):
    """Dask workers receive the two objects pickled: unpickling resolves nothing again."""
    s, o = Source([str(tmp_path / "a.parquet")], columns={"x": ["a", "b"]}, remote={"retries": 1}), \
        Options(cache_dir=tmp_path / "c", shuffle="block", block_rows=8, device="cpu")
    assert pickle.loads(pickle.dumps(s)) == s and pickle.loads(pickle.dumps(o)) == o


def test_numpy_integers_are_integers_and_kept_as_python_ints():
    """Settings from NumPy or pandas (np.int64) are accepted and stored as Python ints (they
    reach JSON headers and cache keys); floats and booleans stay refused."""
    o = Options(batch_size=np.int64(64), seed=np.int32(5), prefetch=np.uint8(3), chunk_bytes=np.int64(1 << 20),
                max_cache_bytes=np.int64(0), shuffle="block", block_rows=np.int16(8))
    got = (o.batch_size, o.seed, o.prefetch, o.chunk_bytes, o.max_cache_bytes, o.block_rows)
    assert got == (64, 5, 3, 1 << 20, 0, 8) and {type(v) for v in got} == {int}
    for bad in (64.0, np.float64(64), True, np.bool_(True), "64"):
        with pytest.raises(gpuload.ConfigError, match="batch_size=.* must be an integer"):
            Options(batch_size=bad)


def test_seeds_beyond_the_orders_63_bits_and_drop_last_that_is_not_a_bool_are_refused():
    """The order's generators are keyed on 63 bits: seed=2**63 would silently give seed 0's order,
    and seed=-1 that of 2**63 - 1. drop_last="no" would drop rows (bool("no") is True)."""
    assert Options(seed=2**63 - 1).seed == 2**63 - 1 and Options(drop_last=np.bool_(True)).drop_last is True
    for bad in (-1, 2**63, 2**64):
        with pytest.raises(gpuload.ConfigError, match=rf"seed={bad} must be an integer from 0 to {2**63 - 1}"):
            Options(seed=bad)
    for bad in ("no", "false", 1, None):
        with pytest.raises(gpuload.ConfigError, match=r"drop_last=.* must be True or False"):
            Options(drop_last=bad)
        with pytest.raises(gpuload.ConfigError, match=r"pack_files=.* must be True or False"):
            Options(pack_files=bad)


@pytest.mark.parametrize("kw,said", [
    ({"block_rows": 64}, "block_rows=64 has no effect with shuffle=True"),
    ({"local_world_size": 3}, "local_world_size=3 has no effect with shard='global'"),
    ({"num_threads": 1000}, "num_threads=1000 is more than 4 per core"),
])
def test_settings_that_do_nothing_or_work_against_the_step_are_warned_about(kw, said, caplog, monkeypatch):
    """Accepted, but each with a log line (these were silent: a user's trial set them and saw no effect)."""
    import logging

    from gpuload import config

    monkeypatch.setattr(config, "cores", lambda: 8)
    caplog.set_level(logging.WARNING, logger="gpuload")
    config.warn_settings(Options(**kw))
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()], caplog.text
    caplog.clear()
    config.warn_settings(Options(num_threads=32, shard="node", local_world_size=3, shuffle="block", block_rows=64))
    assert caplog.records == []  # each in use, and 4 threads per core at most: nothing to say


def test_small_files_get_wider_windows_by_default_and_a_small_window_given_is_warned_about(tmp_path, caplog):
    """30 files of 200 rows: a chunk each (a chunk never spans two files). 4-chunk windows would
    shuffle 800 rows together where larger files give chunk_bytes' worth: by default the windows take
    as many small chunks as half the memory of 4 full-size ones allows (here all 30); a
    shuffle_window given stays, and where it is that small a line at open says so and names the
    default's. Chunks near chunk_bytes keep 4; without a row or block shuffle nothing is said."""
    import logging
    import re

    from conftest import open_dataset, write_parquet

    for i in range(30):
        write_parquet(tmp_path / "d" / f"part-{i:02d}.parquet", {"x": np.arange(i * 200, (i + 1) * 200)})
    caplog.set_level(logging.WARNING, logger="gpuload")

    def opened(**kw):
        caplog.clear()
        ds = open_dataset(tmp_path / "d", cache=tmp_path / "c", batch_size=64, **kw)
        assert sorted(int(v) for b in ds for v in b["x"]) == list(range(6000))
        windows, _ = ds.plan_epoch(0)
        assert {len({s.chunk for s in w}) for w in windows[:-1]} <= {ds.options.shuffle_window}
        return ds.options.shuffle_window, [r.getMessage() for r in caplog.records if "shuffle's windows" in r.getMessage()]

    assert opened() == (30, [])  # every chunk in one window: 6,000 rows shuffled together
    window, (line,) = opened(shuffle_window=4)
    assert window == 4 and "shuffle_window=4 hold about 800 rows here: the files are small (about 200 rows a chunk" in line
    assert re.search(r"; shuffle_window=30 \(the default's here\) shuffles about 6,000 rows together", line), line
    assert opened(shuffle_window=4, shuffle=False) == (4, []) and opened(shuffle_window=4, shuffle="chunks") == (4, [])
    assert opened(shuffle_window=4, shuffle="block", block_rows=16)[1]
    assert opened(chunk_bytes=4096, shuffle_window=4) == (4, [])  # chunks near chunk_bytes: not that small


def test_the_default_window_holds_half_the_memory_of_4_full_chunks_within_its_bounds():
    """window_chunks: a shuffle_window given is kept; without a row or block shuffle 4 (the order is
    the same); else as many chunks as take half the memory of 4 of chunk_bytes, at least 4 (chunks of
    half chunk_bytes or more), at most MAX_WINDOW (a first batch waits for them all) and every chunk."""
    from gpuload.config import DEFAULT_WINDOW, MAX_WINDOW, window_chunks

    mib = 1 << 20
    o = Options()
    assert (DEFAULT_WINDOW, MAX_WINDOW) == (4, 256)
    assert [window_chunks(o, 1000, o.chunk_bytes // k) for k in (1, 2, 4, 8, 32)] == [4, 4, 8, 16, 64]
    assert window_chunks(o, 1000, mib // 16) == 256 and window_chunks(o, 30, mib // 16) == 30
    assert window_chunks(Options(chunk_bytes=8 * mib), 1000, mib) == 16
    assert window_chunks(Options(shuffle_window=3), 1000, 100) == 3
    assert window_chunks(Options(shuffle=False), 1000, 100) == window_chunks(Options(shuffle="chunks"), 1000, 100) == 4
    assert window_chunks(Options(shuffle="block"), 1000, o.chunk_bytes // 8) == 16
