"""Packs of small files (gpuload/packs.py): every small file once, in order, within the bounds; where
packs end stays put when files are added, removed or moved (property-based and examples)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuload import packs, plan
from gpuload.plan import Chunk

SETTINGS = settings(max_examples=150, deadline=None)


def _names(n: int, prefix: str = "part") -> list[str]:
    return [f"{prefix}-{i:05}.parquet" for i in range(n)]


@SETTINGS
@given(st.lists(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 400)), max_size=3), max_size=120),
       st.integers(64, 20_000))
def test_packs_hold_every_small_file_once_in_order_within_their_bounds(files, chunk_bytes):
    plain = plan.make_chunks(files, chunk_bytes)
    packed = packs.pack_small(plain, _names(len(files)), chunk_bytes)
    assert [p for c in packed for p in c.pieces] == plain  # every chunk once, in file order
    target = packs.pack_target([c.nbytes for c in plain], chunk_bytes)
    per_file = [sum(c.file == f for c in plain) for f in range(len(files))]
    for c in packed:
        if not c.parts:
            continue
        assert 2 <= len(c.parts) <= packs.MAX_PACK
        assert all(per_file[p.file] == 1 and p.nbytes < target for p in c.parts)  # whole small files only
        first = plain.index(c.parts[0])  # consecutive chunks (files without rows have none)
        assert list(c.parts) == plain[first:first + len(c.parts)]
        assert c.nbytes == sum(p.nbytes for p in c.parts) <= min(chunk_bytes, 4 * target)
        assert c.rows == sum(p.rows for p in c.parts)
        assert (c.file, c.rg_start, c.rg_stop) == (c.parts[0].file, c.parts[0].rg_start, c.parts[0].rg_stop)


def test_pack_target_is_a_power_of_two_below_a_quarter_chunk_and_a_64th_of_the_data():
    assert packs.pack_target([10] * 10, 1 << 20) == 1  # 100 bytes: 64ths of a byte or two
    assert packs.pack_target([1] * 10, 1 << 20) == 0  # less than a byte per 64th: nothing packs
    assert packs.pack_target([1_700_000] * 400, 64 << 20) == 8 << 20  # 400 files of 1.7 MB: 10.6 MB -> 8 MiB
    assert packs.pack_target([1_700_000] * 4000, 64 << 20) == 16 << 20  # a quarter of chunk_bytes at most
    # files added: the target moves only where the data's size passes a power of two
    assert packs.pack_target([1_700_000] * 401, 64 << 20) == packs.pack_target([1_700_000] * 400, 64 << 20)


def test_few_or_large_files_are_not_packed():
    # fewer than 64 files of one size: each is at least the dataset's 64th
    assert all(not c.parts for c in packs.pack_small(plan.make_chunks([[(10, 100)]] * 63, 1 << 20), _names(63), 1 << 20))
    # 200 files, one with two chunks: it is left out of packs, the others pack around it
    files = [[(10, 100)]] * 200
    files[50] = [(10, 3000), (10, 3000)]
    chunks = packs.pack_small(plan.make_chunks(files, 4096), _names(200), 4096)
    assert sum(1 for c in chunks if c.parts) > 10
    assert [c for c in chunks if c.file == 50] == [Chunk(50, 0, 1, 10, 3000), Chunk(50, 1, 2, 10, 3000)]


def _packs(files, names, chunk_bytes=64 << 20) -> list[tuple[str, ...]]:
    chunks = packs.pack_small(plan.make_chunks(files, chunk_bytes), names, chunk_bytes)
    return [tuple(names[p.file] for p in c.pieces) for c in chunks]


def test_a_file_added_or_removed_changes_only_the_packs_beside_it():
    """A pack is a cache file: where packs end depends on each file's own name and size, so one file more
    (new data) or less leaves the others' packs, and their cache files, as they were."""
    rng = np.random.default_rng(7)
    names = _names(2000)
    files = [[(100, int(s))] for s in rng.integers(100_000, 300_000, 2000)]
    before = _packs(files, names)
    assert 20 < len(before) < 400
    for where in (0, 700, 1999, 2000):
        grown = _packs(files[:where] + [[(100, 200_000)]] + files[where:],
                       names[:where] + ["new-file.parquet"] + names[where:])
        assert len(set(before) - set(grown)) <= 2, where  # its own pack, and at most the next, cut otherwise
    shrunk = _packs(files[:900] + files[901:], names[:900] + names[901:])
    assert len(set(before) - set(shrunk)) <= 2


def _file(path: str, rows: int = 100, tag: str = "t", keys=()):
    """What packs.pack_name reads of a gpuload.sources.listing.SourceFile."""
    return SimpleNamespace(path=path, shown=path, remote=False, partitions=keys, absent=frozenset(), tag=tag,
                           metadata=SimpleNamespace(num_rows=rows))


def test_pack_names_leave_out_folders_and_tell_files_of_one_name_apart():
    here, there = _file("/data/run-1/part-7.parquet"), _file("/scratch/job/data/part-7.parquet")
    assert packs.pack_name(here) == packs.pack_name(there)  # the dataset moved: its packs end where they did
    assert packs.pack_name(_file("/d/x.parquet", keys=(("day", "1"),))) != packs.pack_name(
        _file("/d/x.parquet", keys=(("day", "2"),)))
    # one name in many folders (2024/01/01/data.parquet): told apart by their rows and versions
    rng = np.random.default_rng(3)
    files = [_file(f"/d/{i // 30}/{i % 30}/data.parquet", int(r), f"{i:08x}") for i, r in
             enumerate(rng.integers(400, 600, 2000))]
    names = [packs.pack_name(f) for f in files]
    assert len(set(names)) == 2000
    sizes = [[(100, 150_000)] for _ in files]
    before = _packs(sizes, names)
    assert 20 < len(before) < 400 and max(len(p) for p in before) < 256
    grown = _packs(sizes[:1000] + [[(100, 150_000)]] + sizes[1000:],
                   names[:1000] + [packs.pack_name(_file("/d/new/data.parquet", 7, "new"))] + names[1000:])
    assert len(set(before) - set(grown)) <= 2
