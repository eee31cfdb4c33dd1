"""Several drives: chunks striped over cache folders (here one on disk and one on tmpfs where
the machine has /dev/shm), found again by every reader, routed around a folder that fails or fills."""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import gpuload
from gpuload.cache import space
from gpuload.cache.drives import Drives
from gpuload.cache.fs import CacheRoot
from gpuload.cache.paths import split_dirs
from gpuload.tools.cli import main

from conftest import open_dataset, write_parquet

FILES, N = 12, 20_000


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("drives")
    for i in range(FILES):
        write_parquet(d / f"{i}.parquet", {"x": np.arange(i * N, (i + 1) * N)}, row_group_size=N)
    return d


@pytest.fixture
def folders(tmp_path):
    """Two cache folders: one on the test's disk, one on another filesystem (tmpfs) where there is one."""
    shm = Path("/dev/shm")
    other = shm / f"gpuload-test-{uuid.uuid4().hex[:8]}" if shm.is_dir() and os.access(shm, os.W_OK) else \
        tmp_path / "second"
    yield [tmp_path / "first", other]
    shutil.rmtree(other, ignore_errors=True)


def _chunks(folder) -> set[str]:
    return {p.name for p in Path(folder).rglob("*.glc")}


def _epoch(ds) -> list[np.ndarray]:
    out = [b["x"].cpu().numpy().copy() for b in ds]
    ds.reader.cache.flush()
    return out


def test_chunks_are_striped_once_over_the_folders_and_found_by_every_reader(source, folders, tmp_path, device):
    ds = open_dataset(source, ["x"], folders, batch_size=5000, seed=4, device=device)
    assert isinstance(ds.reader.cache, Drives)
    first = _epoch(ds)
    one = open_dataset(source, ["x"], tmp_path / "single", batch_size=5000, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, _epoch(one)))  # the same batches as one folder
    a, b = _chunks(folders[0]), _chunks(folders[1])
    keys = [ds.reader.key(i) for i in range(FILES)]
    assert a == {k.name for k in keys if ds.reader.cache.order(k)[0] == 0}  # each chunk once, where its order says
    assert b == {k.name for k in keys if ds.reader.cache.order(k)[0] == 1} and len(a | b) == FILES
    again = open_dataset(source, ["x"], folders[::-1], batch_size=5000, seed=4,  # another process, the other way
                         device=device)
    assert all(np.array_equal(x, y) for x, y in zip(first, _epoch(again)))
    assert again.reader.counters.decoded == 0 and (_chunks(folders[0]), _chunks(folders[1])) == (a, b)


def _unmount(folder) -> None:
    """``folder``'s drive goes away and a file is left where it was mounted: the folder moved
    aside, a file renamed into its place (again, if a cache writer made the folder anew in
    between: gpuload remakes a cache root that was deleted)."""
    stand_in = folder.with_name("stand-in")
    stand_in.write_text("not a folder")
    for n in range(100):
        folder.rename(folder.with_name(f"unmounted-{n}"))
        try:
            os.rename(stand_in, folder)
            return
        except IsADirectoryError:
            continue
    raise AssertionError(f"{folder} kept coming back")


def test_a_folder_that_fails_mid_epoch_is_routed_around_with_a_warning(source, folders, caplog):
    ds = open_dataset(source, ["x"], folders, batch_size=5000, shuffle=False, prefetch=0, num_threads=1)
    got = []
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        for i, batch in enumerate(ds):
            got.append(batch["x"].numpy().copy())
            if i == 8:  # two chunks in: the first folder's drive goes away, a file left where it was mounted
                _unmount(folders[0])
        ds.reader.cache.flush()
    assert np.array_equal(np.sort(np.concatenate(got)), np.arange(FILES * N))
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == 1 and str(folders[0]) in warned[0] and str(folders[1]) in warned[0]
    assert len(_chunks(folders[1])) >= FILES - 4  # the rest (all but a window) went to the folder that works
    assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N)) and len(_chunks(folders[1])) == FILES


def _chunk_bytes(source, tmp_path) -> int:
    _epoch(open_dataset(source, ["x"], tmp_path / "probe", batch_size=5000))
    return max(p.stat().st_size for p in (tmp_path / "probe").rglob("*.glc"))


def test_a_full_folder_passes_its_chunks_to_the_next(source, folders, tmp_path, caplog, device):
    chunk = _chunk_bytes(source, tmp_path)
    probe = open_dataset(source, ["x"], folders, batch_size=5000)
    firsts = [probe.reader.cache.order(probe.reader.key(i))[0] for i in range(FILES)]
    full = int(firsts.count(1) >= firsts.count(0))  # the folder most chunks go to first: it fills
    keep = firsts.count(full) - 2  # it holds two chunks fewer than go to it
    space.write_quota(CacheRoot(folders[full]), int((keep + 0.5) * chunk))
    ds = open_dataset(source, ["x"], folders, batch_size=5000, device=device)  # on a GPU: host copies spill
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
    warned = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(warned) == 1 and str(os.path.realpath(folders[full])) in warned[0] and "budget" in warned[0]
    assert len(_chunks(folders[full])) == keep and len(_chunks(folders[1 - full])) == FILES - keep
    decoded = ds.reader.counters.decoded
    assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
    assert ds.reader.counters.decoded == decoded  # all cached: found where they went


def test_a_budget_is_split_over_the_folders(source, folders, tmp_path):
    chunk = _chunk_bytes(source, tmp_path)
    ds = open_dataset(source, ["x"], folders, batch_size=5000, max_cache_bytes=4 * chunk)
    _epoch(ds)
    assert ds.reader.cache.max_bytes == 4 * chunk
    assert all(space.used_bytes(CacheRoot(f)) <= 2 * chunk for f in folders) and 2 <= sum(
        len(_chunks(f)) for f in folders) <= 4


def test_folders_come_from_the_environment_and_the_command(source, folders, monkeypatch, capsys):
    monkeypatch.setenv("GPULOAD_CACHE_DIR", os.pathsep.join(map(str, folders)))
    ds = open_dataset(source, ["x"], batch_size=5000)
    assert ds.options.cache_dir == tuple(folders)
    _epoch(ds)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert all(f"cache {os.path.realpath(f)}:" in out for f in folders)
    assert main(["cache", "clear", "--cache-dir", os.pathsep.join(map(str, folders))]) == 0
    assert _chunks(folders[0]) and _chunks(folders[1])  # the dataset is open: its chunks are kept
    ds.close()
    assert main(["cache", "clear", "--cache-dir", os.pathsep.join(map(str, folders))]) == 0
    assert not _chunks(folders[0]) and not _chunks(folders[1])
    with pytest.raises(gpuload.ConfigError, match="names no folder"):
        open_dataset(source, ["x"], [], batch_size=5000)
    monkeypatch.setenv("GPULOAD_CACHE_DIR", f"{folders[0]}{os.pathsep}relative/b")  # a name cut in two: refused
    with pytest.raises(gpuload.ConfigError, match="'relative/b' is not an absolute path"):
        open_dataset(source, ["x"], batch_size=5000)
    for text in (f"{folders[0]}{os.pathsep}", f"{os.pathsep}{folders[0]}"):  # an empty entry ("$X:/nvme/gl")
        monkeypatch.setenv("GPULOAD_CACHE_DIR", text)
        assert open_dataset(source, ["x"], batch_size=5000).options.cache_dir == folders[0]
        assert split_dirs(text, "--cache-dir") == str(folders[0])
    for text in (os.pathsep, os.pathsep * 2):  # "$X:$Y", both empty: no folder named ':' under the working directory
        monkeypatch.setenv("GPULOAD_CACHE_DIR", text)
        with pytest.raises(gpuload.ConfigError, match=r"\$GPULOAD_CACHE_DIR=.* names no folder"):
            open_dataset(source, ["x"], batch_size=5000)
    colon = open_dataset(source, ["x"], str(folders[0]) + os.pathsep + "42", batch_size=5000)
    assert colon.options.cache_dir == Path(str(folders[0]) + os.pathsep + "42")  # in Python a string is one folder


def test_a_folder_that_cannot_be_made_is_left_out_at_open(source, folders, tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        ds = open_dataset(source, ["x"], [tmp_path / "file" / "cache", folders[1]], batch_size=5000)
    assert any("left out" in r.getMessage() and "file" in r.getMessage() for r in caplog.records)
    assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
    assert len(_chunks(folders[1])) == FILES
    built = gpuload.build_cache(source, [tmp_path / "file" / "cache", folders[1]], ["x"], progress=False)
    assert built.cache_dir == str(folders[1])  # the summary names the folder used, not the one left out


def test_a_corrupt_copy_in_another_folder_is_deleted_once(source, folders, caplog):
    ds = open_dataset(source, ["x"], folders, batch_size=5000)
    _epoch(ds)
    cache = ds.reader.cache
    key = ds.reader.key(0)
    first, other = cache.order(key)[0], cache.order(key)[1]
    good = cache.caches[first].path(key)
    bad = cache.caches[other].path(key)
    bad.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a stale, damaged duplicate where the chunk is looked for second
    bad.write_bytes(bytes(data))
    good.unlink()
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
        assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
    assert not bad.exists() and good.exists()  # rebuilt where it belongs, the damaged copy gone
    assert len([r for r in caplog.records if "checksum" in r.getMessage() or "rebuilding" in r.getMessage()]) == 1


@pytest.mark.slow  # mounts a tmpfs
def test_a_drive_remounted_read_only_mid_epoch_is_routed_around(source, tmp_path, tiny_fs, caplog):
    import subprocess

    disk, keys = tmp_path / "nvme0", [open_dataset(source, ["x"], tmp_path / "probe").reader.key(i) for i in range(FILES)]
    for n in range(50):  # a drive name whose chunks come early and again later in file order
        name = f"nvme1-{n}"
        mine = [i for i, k in enumerate(keys) if Drives([tmp_path / name, disk]).order(k)[0] == 0]
        if mine and mine[0] <= 5 and any(i >= mine[0] + 4 for i in mine):
            break
    drive = tiny_fs(name, size="64m")
    ds = open_dataset(source, ["x"], [drive, disk], batch_size=5000, shuffle=False, prefetch=0, num_threads=1)
    got = []
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        for i, batch in enumerate(ds):
            got.append(batch["x"].numpy().copy())
            if i == 4 * mine[0] + 3:  # the drive's first chunk is written: it goes read-only under the epoch
                # loads ahead of this batch may be writing a chunk ("mount point is busy"): the paused consumer
                # lets them finish, then the remount goes through
                for _ in range(250):
                    ds.reader.cache.flush()
                    if subprocess.run(["mount", "-o", "remount,ro", str(drive)], capture_output=True).returncode == 0:
                        break
                    time.sleep(0.02)
                else:
                    pytest.fail(f"{drive} stayed busy: it could not be remounted read-only")
        ds.reader.cache.flush()
    assert np.array_equal(np.sort(np.concatenate(got)), np.arange(FILES * N))
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == 1 and str(drive) in warned[0] and "Read-only" in warned[0]
    on_drive, decoded = _chunks(drive), ds.reader.counters.decoded
    assert keys[mine[0]].name in on_drive and len(on_drive | _chunks(disk)) == FILES  # what it took stays readable
    assert np.array_equal(np.sort(np.concatenate(_epoch(ds))), np.arange(FILES * N))
    assert ds.reader.counters.decoded == decoded  # every chunk cached, on one drive or the other


def test_a_dropped_dataset_lets_its_chunks_go_at_once(source, folders):
    from gpuload.cache import evict

    ds = open_dataset(source, ["x"], folders, batch_size=5000)
    _epoch(ds)
    assert all(d["live"] for f in folders for d in evict.datasets(CacheRoot(f)))
    del ds  # no reference cycle keeps its records held until a garbage collection
    assert not any(d["live"] for f in folders for d in evict.datasets(CacheRoot(f)))
