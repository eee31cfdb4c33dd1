"""Direct I/O (gpuload.cache.directio): cache files written and read around the page cache
hold exactly a buffered write's bytes, read back exactly, fall back to buffered I/O where the
file system refuses, and leave the page cache alone; cache_io= decides it per dataset."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from conftest import row_ids
from gpuload.batch import Ragged
from gpuload.cache import directio
from gpuload.cache.directio import resident_share
from gpuload.cache.chunkfile import encode, pread_all, read_regions, write_regions
from gpuload.memory import ALIGN, HostPool, cache_io_modes, memory_bytes, reads_limited

def _chunk(n: int = 3001) -> dict:
    """Regions of odd sizes, one larger than the bounce buffer (written through it in pieces)."""
    rng = np.random.default_rng(n)
    big = rng.integers(0, 2**62, directio.BOUNCE // 8 + 1001)
    lengths = rng.integers(0, 7, n)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {"#<i8": rng.integers(-9, 9, (n, 5)), "label": rng.integers(0, 2, n).astype(np.int8),
            "big": big[:n], "history": Ragged(big[:int(off[-1])].copy(), off), "tail": big}


def _write(path, cols, direct: bool) -> bool:
    head, regions, arrays, total = encode(cols, {"source": {"path": "x"}, "row_groups": [0, 1], "spec": "s"})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return write_regions(fd, head, regions, arrays, total, direct)
    finally:
        os.close(fd)


def _read(path, direct: bool, alloc=None) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_regions(fd, path, None, True, alloc=alloc, direct=direct)[1]
    finally:
        os.close(fd)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], Ragged):
            assert np.array_equal(a[k].values, b[k].values) and np.array_equal(a[k].offsets, b[k].offsets), k
        else:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_a_direct_write_is_byte_for_byte_a_buffered_one(tmp_path):
    cols = _chunk()
    assert _write(tmp_path / "direct.glc", cols, direct=True)  # this machine's file systems take O_DIRECT
    assert not _write(tmp_path / "buffered.glc", cols, direct=False)
    assert (tmp_path / "direct.glc").read_bytes() == (tmp_path / "buffered.glc").read_bytes()
    _same(_read(tmp_path / "direct.glc", direct=False), cols)


def test_a_direct_read_is_exact_and_leaves_the_page_cache_alone(tmp_path):
    cols = _chunk(5003)
    path = tmp_path / "c.glc"
    assert _write(path, cols, direct=True)
    assert resident_share(path) < 0.05  # written around the page cache
    pool = HostPool(max_buffers=4, max_bytes=256 << 20)
    _same(_read(path, direct=True, alloc=pool.get), cols)
    assert resident_share(path) < 0.05  # read around it too (the header's page aside)
    _same(_read(path, direct=False), cols)  # a buffered read fills it: the check can fail
    assert resident_share(path) > 0.9


def test_unaligned_buffers_and_offsets_are_read_buffered(tmp_path):
    path = tmp_path / "f"
    data = np.random.default_rng(1).integers(0, 255, 3 * ALIGN + 77, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = np.empty(len(data) + 2 * ALIGN, np.uint8)  # room for an aligned start, and one byte past it
        start = -raw.ctypes.data % ALIGN
        aligned, unaligned = raw[start:start + len(data)], raw[start + 1:start + 1 + len(data)]
        assert directio.read_into(fd, unaligned, 0) is None and directio.read_into(fd, aligned, 1) is None
        assert directio.read_into(fd, aligned, 0) == len(data) and np.array_equal(aligned, data)  # the tail too
        assert pread_all(fd, unaligned, 0, direct=True) == len(data) and np.array_equal(unaligned, data)
        assert pread_all(fd, aligned[:-1], 1, direct=True) == len(data) - 1 and np.array_equal(aligned[:-1],
                                                                                               data[1:])
    finally:
        os.close(fd)


def _refuse(monkeypatch, where: str) -> list:
    """Make the file system refuse O_DIRECT at ``where`` ("open": setting the flag, "write":
    the first direct write), as some FUSE and network file systems do; the calls refused."""
    refused = []
    if where == "open":
        real = directio.fcntl.fcntl

        def fcntl(fd, cmd, arg=0):
            if cmd == directio.fcntl.F_SETFL and arg & os.O_DIRECT:
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, cmd, arg)

        monkeypatch.setattr(directio.fcntl, "fcntl", fcntl)
    else:
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):
            if os.O_DIRECT & directio.fcntl.fcntl(fd, directio.fcntl.F_GETFL):
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(directio.os, "pwrite", pwrite)
    return refused


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_file_system_that_refuses_gets_buffered_files(tmp_path, monkeypatch, where):
    cols = _chunk()
    _write(tmp_path / "buffered.glc", cols, direct=False)
    refused = _refuse(monkeypatch, where)
    assert not _write(tmp_path / "fallback.glc", cols, direct=True)
    assert refused
    assert (tmp_path / "fallback.glc").read_bytes() == (tmp_path / "buffered.glc").read_bytes()


@pytest.mark.parametrize("shuffle", [True, False])
def test_cache_io_direct_serves_the_same_batches_and_keeps_out_of_the_page_cache(click, tmp_path, shuffle):
    runs = {}
    for mode in ("buffered", "direct"):
        # prefetch=0: no next epoch's chunks read in the first (chunks this small are read buffered)
        ds = click.open(tmp_path / mode, cache_io=mode, shuffle=shuffle, seed=4, prefetch=0)
        assert ds.reader.cache.direct_writes == ds.reader.cache.direct_reads == (mode == "direct")
        first = [{k: (v.values.clone(), v.offsets.clone()) if hasattr(v, "offsets") else v.clone()
                  for k, v in b.items()} for b in ds]
        ds.reader.cache.flush()
        files = list((tmp_path / mode).rglob("*.glc"))
        assert len(files) == len(ds.reader.chunks)
        runs[mode] = (first, [resident_share(f) for f in files])
        ds.set_epoch(1)
        assert sorted(row_ids(ds).tolist()) == list(range(ds.num_rows))  # read back from the cache
        assert ds.reader.counters.decoded == len(ds.reader.chunks)  # decoded once, in the first epoch
        ds.close()
    (direct, direct_resident), (buffered, buffered_resident) = runs["direct"], runs["buffered"]
    assert len(direct) == len(buffered)
    for a, b in zip(direct, buffered):
        for k in a:
            pairs = zip(a[k], b[k]) if isinstance(a[k], tuple) else [(a[k], b[k])]
            assert all(x.equal(y) for x, y in pairs), k
    assert max(direct_resident) < 0.2 and min(buffered_resident) > 0.8


def test_auto_writes_direct_and_lets_reads_turn_buffered_only_where_the_cache_fits_half_the_memory():
    gib = 1 << 30
    assert cache_io_modes("auto", 4 * gib, memory=16 * gib) == (True, True, True)
    assert cache_io_modes("auto", 9 * gib, memory=16 * gib) == (True, True, False)
    assert cache_io_modes("direct", 1, memory=16 * gib) == (True, True, False)
    assert cache_io_modes("buffered", 100 * gib, memory=16 * gib) == (False, False, False)
    assert 0 < memory_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("wall, waited, busy, threads, limited", [
    (10.0, 1.0, 15.0, 2, True),  # waited 10%, reads 75% of 2 threads
    (10.0, 0.9, 20.0, 2, False),  # the step hardly waited: the disk keeps up
    (10.0, 5.0, 14.9, 2, False),  # waited, but for something else (decoding, gathers)
    (10.0, 5.0, 30.0, 4, True), (10.0, 5.0, 29.9, 4, False),
    (0.0, 0.0, 0.0, 2, False),  # nothing timed
])
def test_direct_reads_limit_a_pass_where_the_step_waited_while_they_kept_the_threads_busy(wall, waited, busy,
                                                                                           threads, limited):
    assert reads_limited(wall, waited, busy, threads) is limited


def _epoch(ds, epoch: int) -> list:
    ds.set_epoch(epoch)
    return [b["row_id"].clone() for b in ds]


@pytest.mark.parametrize("fits", [True, False])
def test_auto_reads_turn_buffered_after_a_pass_they_limited_where_the_cache_fits_in_memory(click, tmp_path,
                                                                                           monkeypatch, caplog, fits):
    """A disk slower than the epochs need (taken as measured: reads_limited says so) turns auto's
    reads buffered from the next pass on, and the same batches come; a cache larger than half
    the memory stays direct (its pages would not last until the next epoch)."""
    import gpuload.cache.store
    import gpuload.memory
    import gpuload.reader

    if not fits:
        monkeypatch.setattr(gpuload.memory, "memory_bytes", lambda: 1 << 12)
    passes = []

    def measured(wall, waited, busy, threads):
        passes.append((wall, waited, busy, threads))
        return len(passes) == 2  # the first cached pass

    monkeypatch.setattr(gpuload.reader, "reads_limited", measured)
    real, reads = gpuload.cache.store.read_regions, []

    def read(*args):
        reads.append(args[-1])  # direct
        return real(*args)

    monkeypatch.setattr(gpuload.cache.store, "read_regions", read)
    caplog.set_level(logging.INFO, logger="gpuload")
    ds = click.open(tmp_path / "c", seed=3, prefetch=0)  # prefetch=0: no chunk read ahead into the next pass
    assert ds.reader.cache_io == "direct" and ds.reader.adapts_reads is fits
    epochs = [_epoch(ds, e) for e in range(2)]
    st = ds.stats()
    assert len(passes) == (2 if fits else 0)  # each whole pass measured, while the reads are direct
    if fits:
        assert sum(p[0] for p in passes) == pytest.approx(st.wall_s) and sum(p[1] for p in passes) == pytest.approx(st.wait_s)
        assert sum(p[2] for p in passes) == pytest.approx(st.stages["cache_read"].seconds)
        assert all(p[3] == ds.options.num_threads for p in passes)
    epochs.append(_epoch(ds, 2))
    assert len(passes) == (2 if fits else 0)
    st = ds.stats()
    assert ds.reader.cache_io == ("direct writes, buffered reads" if fits else "direct")
    assert st.loader_settings["cache_io"] == ds.reader.cache_io
    assert ("through the page cache" in caplog.text) is fits
    # every chunk read in epochs 1 and 2, direct until the pass that limited, through the page cache after it
    assert reads == [True] * len(ds.reader.chunks) + [not fits] * len(ds.reader.chunks)
    ds.close()
    again = click.open(tmp_path / "b", seed=3, cache_io="buffered")
    for e, batches in enumerate(epochs):
        assert [b.tolist() for b in _epoch(again, e)] == [b.tolist() for b in batches]
    again.close()


def test_a_pass_left_early_or_a_forced_mode_never_turns_the_reads(click, tmp_path, monkeypatch):
    import gpuload.reader

    monkeypatch.setattr(gpuload.reader, "reads_limited", lambda *a: True)
    ds = click.open(tmp_path / "c", prefetch=0)
    _epoch(ds, 0)
    assert ds.reader.cache_io == "direct writes, buffered reads"  # the figures said so
    ds = click.open(tmp_path / "d", prefetch=0)
    for _ in ds:
        break  # not a whole pass: nothing measured
    assert ds.reader.cache_io == "direct"
    for mode in ("direct", "buffered"):
        forced = click.open(tmp_path / mode, cache_io=mode)
        _epoch(forced, 0)
        assert forced.reader.cache_io == mode and not forced.reader.adapts_reads
        forced.close()
    ds.close()


def test_a_refusing_folder_turns_direct_writes_off(click, tmp_path, monkeypatch):
    refused = _refuse(monkeypatch, "open")
    ds = click.open(tmp_path / "c", cache_io="direct", shuffle=False)
    assert sorted(row_ids(ds).tolist()) == list(range(ds.num_rows))
    ds.reader.cache.flush()
    assert not ds.reader.cache.direct_writes and len(refused) >= 1  # tried once, then buffered
    before = len(refused)
    ds.set_epoch(1)
    assert sorted(row_ids(ds).tolist()) == list(range(ds.num_rows))
    assert len(refused) == before  # reads no longer try either
    assert ds.reader.counters.decoded == len(ds.reader.chunks)


def test_the_memory_limit_is_the_lowest_of_the_process_cgroup_and_its_parents(tmp_path):
    """A Slurm job's or a systemd slice's limit sits on a nested cgroup (often on a parent of the
    process's own): cgroup v2 and v1 as /proc/self/cgroup places them, "max" meaning none."""
    from gpuload.memory import _cgroup_limits

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
