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
from gpuload.cache.chunkfile import encode, read_regions, write_regions
from gpuload.cache.directio import pread_all
from gpuload.memory import ALIGN, HostPool, cache_io_modes, reads_limited

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


def test_page_aligned_regions_are_written_from_their_own_memory_byte_for_byte(tmp_path, monkeypatch):
    """A chunk packed into the host pool's page-aligned arrays goes to the disk without the
    bounce buffer's copy (its whole blocks straight from the arrays; the tail padded), and the
    file is exactly a buffered write's."""
    pool = HostPool()
    cols = _chunk()
    aligned = {}
    for k, v in cols.items():
        if isinstance(v, Ragged):
            aligned[k] = Ragged(*(pool.array(a.shape, a.dtype) for a in (v.values, v.offsets)))
            aligned[k].values[...], aligned[k].offsets[...] = v.values, v.offsets
        else:
            aligned[k] = pool.array(v.shape, v.dtype)
            aligned[k][...] = v
    assert aligned["tail"].ctypes.data % directio.BLOCK == 0  # the pool's (its small arrays are not pooled)
    sources, writes, real = [], [], os.pwritev

    def pwritev(fd, buffers, offset):
        sources.extend(np.frombuffer(b, np.uint8).ctypes.data for b in buffers)
        writes.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(directio.os, "pwritev", pwritev)
    assert _write(tmp_path / "direct.glc", aligned, direct=True)
    monkeypatch.setattr(directio.os, "pwritev", real)
    assert not _write(tmp_path / "buffered.glc", cols, direct=False)
    assert (tmp_path / "direct.glc").read_bytes() == (tmp_path / "buffered.glc").read_bytes()
    big = aligned["tail"]  # larger than the bounce buffer: written from itself
    assert big.nbytes > directio.BOUNCE and big.ctypes.data in sources
    # the header and the regions follow one another in the file: one write of them all (each direct
    # write waits for the disk; it was one or two a region), the small ones copied, the rest in place
    assert writes == [8]
    _same(_read(tmp_path / "direct.glc", direct=True, alloc=pool.get), cols)


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
        real_pwrite, real_pwritev = os.pwrite, os.pwritev

        def refuse_direct(fd):
            if os.O_DIRECT & directio.fcntl.fcntl(fd, directio.fcntl.F_GETFL):
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")

        def pwrite(fd, data, offset):
            refuse_direct(fd)
            return real_pwrite(fd, data, offset)

        def pwritev(fd, buffers, offset):
            refuse_direct(fd)
            return real_pwritev(fd, buffers, offset)

        monkeypatch.setattr(directio.os, "pwrite", pwrite)
        monkeypatch.setattr(directio.os, "pwritev", pwritev)
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
    # a GPU reads files its own way: auto goes around the page cache only where it could not keep them
    assert cache_io_modes("auto", 4 * gib, memory=16 * gib, host=False) == (False, False, False)
    assert cache_io_modes("auto", 9 * gib, memory=16 * gib, host=False) == (True, True, False)
    assert cache_io_modes("direct", 1, memory=16 * gib, host=False) == (True, True, False)


@pytest.mark.parametrize("wall, waited, busy, limited", [
    (10.0, 1.0, 7.5, True),  # waited 10% while reads took 0.75 of the pass, summed over threads
    (10.0, 0.9, 20.0, False),  # the step hardly waited: the disk keeps up
    (10.0, 5.0, 7.4, False),  # waited, but for something else (gathers, a transform)
    (1.9, 1.9, 10.0, False),  # too short a pass to judge
    (0.0, 0.0, 0.0, False),
])
def test_direct_reads_limit_a_pass_where_the_step_waited_while_they_ran_all_along(wall, waited, busy, limited):
    assert reads_limited(wall, waited, busy) is limited


def _epoch(ds, epoch: int, stop: int | None = None) -> list:
    ds.set_epoch(epoch)
    out = []
    for b in ds:
        out.append(b["row_id"].clone())
        if len(out) == stop:
            break
    return out


def _figures(st) -> tuple:
    """What a pass is judged by, from stats: wall, waiting after each pass's first batch, cache reads."""
    read = st.stages.get("cache_read")
    return st.wall_s, st.wait_s - st.first_wait_s, read.seconds if read else 0.0


@pytest.fixture
def judged(monkeypatch):
    """The figures each judged pass gave reads_limited; it answers True for the pass numbers in ``.slow``."""
    import gpuload.reader

    class Passes(list):
        slow: set = set()

    passes = Passes()

    def measured(wall, waited, busy):
        passes.append((wall, waited, busy))
        return len(passes) in passes.slow

    monkeypatch.setattr(gpuload.reader, "reads_limited", measured)
    return passes


@pytest.mark.parametrize("fits", [True, False])
def test_auto_reads_turn_buffered_after_a_pass_they_limited_where_the_cache_fits_in_memory(click, tmp_path, judged,
                                                                                           monkeypatch, caplog, fits):
    """A disk slower than the epochs need (taken as measured: reads_limited says so) turns auto's
    reads buffered from the next pass on, and the same batches come; a cache larger than half
    the memory stays direct (its pages would not last until the next epoch). The pass that
    decodes is not judged; a cached one is, on its own figures."""
    import gpuload.cache.store
    import gpuload.memory

    if not fits:
        monkeypatch.setattr(gpuload.memory, "memory_bytes", lambda: 1 << 12)
    judged.slow = {1}  # the first pass judged: the first cached one
    real, reads = gpuload.cache.store.read_regions, []

    def read(*args):
        reads.append(args[-1])  # direct
        return real(*args)

    monkeypatch.setattr(gpuload.cache.store, "read_regions", read)
    caplog.set_level(logging.INFO, logger="gpuload")
    ds = click.open(tmp_path / "c", seed=3, prefetch=0)  # prefetch=0: no chunk read ahead into the next pass
    assert ds.reader.cache_io == "direct" and ds.reader.adapts_reads is fits
    epochs = [_epoch(ds, 0)]
    assert judged == [] and reads == []  # decoded: not judged
    before = _figures(ds.stats())
    epochs.append(_epoch(ds, 1))
    after = _figures(ds.stats())
    # its own figures (not the decoding pass's too): within 5 ms, as a read of the next epoch's preload
    # that ends as the pass does may fall on either side of the stats' reading on a loaded machine
    assert judged == ([pytest.approx(tuple(a - b for a, b in zip(after, before)), abs=0.005)] if fits else [])
    epochs.append(_epoch(ds, 2))
    assert len(judged) == (1 if fits else 0)  # reads no longer direct: nothing to judge
    assert ds.reader.cache_io == ("direct writes, buffered reads" if fits else "direct")
    assert ds.stats().loader_settings["cache_io"] == ds.reader.cache_io
    assert ("through the page cache" in caplog.text) is fits
    # every chunk read in epochs 1 and 2, direct until the pass that limited, through the page cache after it
    assert reads == [True] * len(ds.reader.chunks) + [not fits] * len(ds.reader.chunks)
    ds.close()
    again = click.open(tmp_path / "b", seed=3, cache_io="buffered")
    for e, batches in enumerate(epochs):
        assert [b.tolist() for b in _epoch(again, e)] == [b.tolist() for b in batches]
    again.close()


def test_a_pass_left_early_is_judged_on_its_part_and_a_reset_or_a_forced_mode_leaves_the_reads(click, tmp_path,
                                                                                              judged):
    ds = click.open(tmp_path / "c", prefetch=0)
    _epoch(ds, 0)
    _epoch(ds, 1, stop=2)  # a loop that stops at a step (a Mix closes its sources' passes so too)
    assert len(judged) == 1 and ds.reader.cache_io == "direct"
    ds.set_epoch(2)
    it = iter(ds)
    next(it)
    ds.reset_stats()  # figures across a reset say nothing of the pass
    list(it)
    assert len(judged) == 1
    judged.slow = {2}
    _epoch(ds, 3)
    assert len(judged) == 2 and ds.reader.cache_io == "direct writes, buffered reads"
    ds.close()
    for mode in ("direct", "buffered"):
        forced = click.open(tmp_path / mode, cache_io=mode)
        _epoch(forced, 0)
        _epoch(forced, 1)
        assert forced.reader.cache_io == mode and not forced.reader.adapts_reads and len(judged) == 2
        forced.close()


def test_a_mix_judges_its_sources_passes(click, tmp_path, judged):
    import gpuload

    a, b = (click.open(tmp_path / n, prefetch=0, batch_size=64) for n in "ab")
    mix = gpuload.Mix({"a": a, "b": b}, {"a": 1, "b": 1})
    for e in range(2):
        mix.set_epoch(e)
        for _ in mix:
            pass
    assert len(judged) >= 1  # the sources' cached passes, closed by the mix at the epoch's end
    a.close()
    b.close()


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


@pytest.mark.parametrize("iov_max", [1, 2, 1024])
def test_many_regions_gaps_and_short_writes_give_a_buffered_writes_bytes(tmp_path, monkeypatch, iov_max):
    """Direct writes coalesced into pwritev: regions that fill the bounce buffer several times over,
    a gap between pieces (a new write there), flushes at every buffer count and writes the kernel
    cuts short (resumed where they stopped) all leave exactly a buffered write's bytes."""
    rng = np.random.default_rng(iov_max)
    pool = HostPool()
    pieces, off = [], 0
    for k in range(60):  # small and large, aligned (pool) and not, some ending on a block boundary
        n = int(rng.choice([1, 100, 4095, 4096, 5000, 300_000, directio.BOUNCE // 3]))
        a = pool.array((n,), np.uint8) if k % 3 else np.empty(n + 1, np.uint8)[1:]
        a[...] = rng.integers(0, 256, n, dtype=np.uint8)
        pieces.append((off, a))
        off += -(-n // directio.BLOCK) * directio.BLOCK + (directio.BLOCK * 3 if k == 30 else 0)  # one gap
    real = os.pwritev

    def short(fd, buffers, offset):  # a prefix of what was asked: at most 3 buffers and 1 MiB at once
        taken, room = [], 1 << 20
        for b in buffers[:3]:
            taken.append(memoryview(b)[:room])
            room -= len(taken[-1])
            if not room:
                break
        return real(fd, taken, offset)

    monkeypatch.setattr(directio, "_IOV_MAX", iov_max)
    monkeypatch.setattr(directio.os, "pwritev", short)
    fd = os.open(tmp_path / "d", os.O_WRONLY | os.O_CREAT)
    try:
        assert directio.write(fd, pieces, off)
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT)
    try:
        for o, a in pieces:
            os.pwrite(fd, a.tobytes(), o)
        os.ftruncate(fd, off)
    finally:
        os.close(fd)
    assert (tmp_path / "d").read_bytes() == (tmp_path / "b").read_bytes()
