"""Packs of small files (gpuload/packs.py): every small file once, in order, within the bounds; where
packs end stays put when files are added, removed, moved or listed otherwise (property-based and examples)."""

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
@given(st.lists(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 400)), max_size=3), min_size=64, max_size=150),
       st.integers(64, 20_000))
def test_packs_hold_every_small_file_once_in_order_within_their_bounds(files, chunk_bytes):
    plain = plan.make_chunks(files, chunk_bytes)
    packed = packs.pack_small(plain, _names(len(files)), chunk_bytes)
    assert [p for c in packed for p in c.pieces] == plain  # every chunk once, in file order
    target = packs.pack_target(chunk_bytes)
    per_file = [sum(c.file == f for c in plain) for f in range(len(files))]
    for c in packed:
        if not c.parts:
            continue
        assert 2 <= len(c.parts) <= packs.MAX_PACK
        assert all(per_file[p.file] == 1 and p.nbytes < target for p in c.parts)  # whole small files only
        first = plain.index(c.parts[0])  # consecutive chunks (files without rows have none)
        assert list(c.parts) == plain[first:first + len(c.parts)]
        assert c.nbytes == sum(p.nbytes for p in c.parts) <= 4 * target
        assert c.rows == sum(p.rows for p in c.parts)
        assert (c.file, c.rg_start, c.rg_stop) == (c.parts[0].file, c.parts[0].rg_start, c.parts[0].rg_stop)


def test_pack_target_is_a_setting_alone_and_few_files_are_not_packed():
    assert packs.pack_target(64 << 20) == 8 << 20 and packs.pack_target(4096) == 512
    # fewer than MIN_FILES files: each its own chunk, however small
    assert all(not c.parts for c in packs.pack_small(plan.make_chunks([[(10, 100)]] * 63, 1 << 20), _names(63),
                                                     1 << 20))
    # 200 files, one with two chunks: it is left out of packs, the others pack around it
    files = [[(10, 100)]] * 200
    files[50] = [(10, 3000), (10, 3000)]
    chunks = packs.pack_small(plan.make_chunks(files, 4096), _names(200), 4096)
    assert sum(1 for c in chunks if c.parts) > 10
    assert [c for c in chunks if c.file == 50] == [Chunk(50, 0, 1, 10, 3000), Chunk(50, 1, 2, 10, 3000)]


def _packs(files, names, chunk_bytes=64 << 20) -> list[tuple[str, ...]]:
    chunks = packs.pack_small(plan.make_chunks(files, chunk_bytes), names, chunk_bytes)
    return [tuple(names[p.file] for p in c.pieces) for c in chunks]


def test_a_file_added_or_removed_or_a_subset_changes_only_the_packs_beside_it():
    """A pack is a cache file: where packs end depends on each file's own name and size, so one file more
    (new data) or less, or some of the files alone (a few days), leave the others' packs as they were."""
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
    part = _packs(files[500:1500], names[500:1500])
    assert len(part) > 20 and len(set(part) - set(before)) <= 2  # all but the packs at its two ends


def test_tiny_files_end_packs_by_their_names_not_by_the_cap():
    """Files far below the target still end a pack after them with chance 4 in MAX_PACK: a pack of 64
    ends by the cap rarely, so the cap's cuts (placed by position, not by name) seldom move packs."""
    names = _names(3000)
    files = [[(30, 900)]] * 3000
    before = _packs(files, names)
    assert 100 < len(before) < 400 and sum(len(p) == packs.MAX_PACK for p in before) < 10
    grown = _packs([[(30, 900)]] + files, ["first.parquet"] + names)
    assert len(set(before) - set(grown)) <= 2


def _file(path: str, rows: int = 100, keys=()):
    """What packs.pack_name reads of a gpuload.sources.listing.SourceFile."""
    return SimpleNamespace(path=path, shown=path, remote=False, partitions=keys, absent=frozenset(),
                           metadata=SimpleNamespace(num_rows=rows))


def test_pack_names_leave_out_folders_and_keys_and_tell_files_of_one_name_apart():
    here, there = _file("/data/run-1/part-7.parquet"), _file("/scratch/job/data/part-7.parquet")
    assert packs.pack_name(here) == packs.pack_name(there)  # the dataset moved: its packs end where they did
    # listed through its partition folders, a file has no Hive keys: they do not count
    assert packs.pack_name(_file("/d/day=1/x.parquet", keys=(("day", "1"),))) == packs.pack_name(
        _file("/d/day=1/x.parquet"))
    # one name in many folders (2024/01/01/data.parquet): told apart by their rows
    rng = np.random.default_rng(3)
    files = [_file(f"/d/{i // 30}/{i % 30}/data.parquet", int(r)) for i, r in enumerate(rng.integers(400, 600, 2000))]
    names = [packs.pack_name(f) for f in files]
    sizes = [[(100, 150_000)] for _ in files]
    before = _packs(sizes, names)
    assert 20 < len(before) < 400 and sum(len(p) == packs.MAX_PACK for p in before) < 10
    grown = _packs(sizes[:1000] + [[(100, 150_000)]] + sizes[1000:],
                   names[:1000] + [packs.pack_name(_file("/d/new/data.parquet", 7))] + names[1000:])
    assert len(set(before) - set(grown)) <= 2
