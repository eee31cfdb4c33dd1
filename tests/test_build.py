"""build_cache and `gpuload cache build`: what a build did, said exactly.

* a cache the build cannot write (not a folder, no permission, no space) fails the build
  with the real cause and the setting to change, never a summary blaming the budget;
* a budget that is full is not an error: the summary says so;
* two builds of one cache at once each count what they did: chunks decoded and written,
  chunks cached before they looked, chunks the other build wrote meanwhile;
* `cache build` with --layout/--shuffle/--block-rows builds exactly the files the matching dataset reads.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import threading
import time

import pytest

import gpuload
import gpuload.reader
from gpuload.cache.chunkfile import LAYOUT_DIR
from gpuload.cache.fs import CacheRoot
from gpuload.tools.cli import main
from gpuload.synth import write_clicklog

from conftest import at_once, wait_until

COLUMNS = ["label", "dense_0", "dense_1"]
CHUNK = 1 << 14


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("build") / "data"
    write_clicklog(d, rows=20_000, files=2, row_group_rows=1024)
    return d


def _cli(capsys, *args):
    capsys.readouterr()
    rc = main(["cache", "build", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, [line for line in err.splitlines() if line.startswith("gpuload: error:")]


def test_a_cache_that_is_not_a_folder_fails_the_build_naming_it(data, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / LAYOUT_DIR).write_text("not a folder")  # where gpuload keeps its chunk folders
    rc, out, errors = _cli(capsys, data, "--cache-dir", cache, "--columns", ",".join(COLUMNS), "--chunk-mib", 1 / 64)
    assert rc != 0 and out == "" and len(errors) == 1, (out, errors)
    assert "not a folder" in errors[0] and "--cache-dir" in errors[0] and str(cache) in errors[0]
    assert "max_cache_bytes" not in errors[0] and "--max-gib" not in errors[0]
    with pytest.raises(gpuload.CacheError, match="not a folder.*cache_dir="):
        gpuload.build_cache(data, cache, COLUMNS, chunk_bytes=CHUNK)


@pytest.mark.slow
def test_the_real_command_exits_non_zero_in_one_line(data, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / LAYOUT_DIR).write_text("not a folder")
    r = subprocess.run([sys.executable, "-m", "gpuload.tools.cli", "cache", "build", str(data), "--cache-dir", str(cache)],
                       capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("gpuload: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr
    assert "not a folder" in errors[0] and "--cache-dir" in errors[0] and "max" not in r.stdout + r.stderr


@pytest.mark.parametrize("code,words", [(errno.EACCES, "Permission denied"), (errno.ENOSPC, "No space left"),
                                        (errno.EROFS, "Read-only file system")])
@pytest.mark.parametrize("after", [0, 3])
def test_chunk_writes_that_fail_fail_the_build_with_their_cause(data, tmp_path, capsys, monkeypatch, code, words,
                                                                after):
    """Writes refused from the first chunk, or after 3: the build exits non-zero naming the
    OS's reason and --cache-dir, and says how many chunks it did cache."""
    real, written = CacheRoot.write, []

    def write(self, parts, name, fill, durable=True):
        if name.endswith(".glc"):
            if len(written) >= after:
                raise OSError(code, os.strerror(code))
            written.append(name)
        return real(self, parts, name, fill, durable)

    monkeypatch.setattr(CacheRoot, "write", write)
    rc, out, errors = _cli(capsys, data, "--cache-dir", tmp_path / "c", "--columns", ",".join(COLUMNS),
                           "--chunk-mib", 1 / 64)
    assert rc != 0 and len(errors) == 1 and out == "", (out, errors)
    assert words in errors[0] and "--cache-dir" in errors[0] and "max_cache_bytes" not in errors[0]
    n = int(re.search(r"of (\d+) chunks", errors[0])[1])
    assert f"{after} of {n} chunks" in errors[0] and n > 3


def test_a_full_budget_is_not_an_error_and_is_said_as_a_flag(data, tmp_path, capsys):
    rc, out, errors = _cli(capsys, data, "--cache-dir", tmp_path / "c", "--columns", ",".join(COLUMNS),
                           "--chunk-mib", 1 / 64, "--max-gib", 0.0001)
    assert rc == 0 and not errors
    assert re.search(r"\d+ chunks did not fit --max-gib 0.0001 and will be read from Parquet", out), out
    summary = gpuload.build_cache(data, tmp_path / "p", COLUMNS, chunk_bytes=CHUNK, max_cache_bytes=100_000)
    assert summary.not_cached > 0 and "did not fit max_cache_bytes=100000" in str(summary)


def _slow_decoding(monkeypatch, seconds=0.02):
    real = gpuload.reader.ChunkReader._stored

    def slow(self, i):
        time.sleep(seconds)
        return real(self, i)

    monkeypatch.setattr(gpuload.reader.ChunkReader, "_stored", slow)


def test_two_builds_at_once_count_what_each_did(data, tmp_path, monkeypatch):
    """Two builds of one cache at once (threads; each chunk's lock is a file lock, as between
    processes): each chunk is built by one of them, and each summary says which it built,
    which it found and which the other one built meanwhile."""
    _slow_decoding(monkeypatch)
    def build():
        return gpuload.build_cache(data, tmp_path / "c", COLUMNS, chunk_bytes=CHUNK, num_threads=2)

    a, b = at_once(build, build)
    n = a.chunks
    assert n == b.chunks > 8
    assert a.built + b.built == n  # each chunk decoded and written once, by one of them
    for s in (a, b):
        assert s.built + s.already_cached + s.built_elsewhere + s.not_cached == n, str(s)
        assert s.already_cached == 0 and s.not_cached == 0
    assert a.built_elsewhere == b.built and b.built_elsewhere == a.built
    later = b if b.built_elsewhere else a
    assert f"{later.built_elsewhere} built meanwhile by another build" in str(later)
    again = gpuload.build_cache(data, tmp_path / "c", COLUMNS, chunk_bytes=CHUNK)
    assert (again.built, again.already_cached, again.built_elsewhere) == (0, n, 0)


def test_a_build_that_starts_while_another_runs(data, tmp_path, monkeypatch):
    """The second build opens when the first has cached some chunks: those are 'already
    cached', the ones the first writes while the second runs are the other build's."""
    _slow_decoding(monkeypatch, 0.05)
    first, started = [], threading.Event()
    progress = lambda rows: started.set()  # noqa: E731
    t = threading.Thread(target=lambda: first.append(gpuload.build_cache(data, tmp_path / "c", COLUMNS,
                                                                         chunk_bytes=CHUNK, progress=progress)))
    t.start()
    started.wait(60)
    wait_until(lambda: list((tmp_path / "c").rglob("*.glc")), timeout=30)  # on disk (written in the background)
    second = gpuload.build_cache(data, tmp_path / "c", COLUMNS, chunk_bytes=CHUNK)
    t.join()
    (a,) = first
    n = a.chunks
    assert second.already_cached >= 1 and a.built + second.built == n
    assert second.built + second.already_cached + second.built_elsewhere == n
    assert a.built_elsewhere == second.built and a.already_cached == 0


# ---------------------------------------------------------------------------------------
# what `cache build` builds is what a dataset reads
# ---------------------------------------------------------------------------------------

@pytest.fixture
def data_4096(tmp_path):
    write_clicklog(tmp_path / "data", rows=20_000, files=2, row_group_rows=4096)
    return tmp_path / "data"


@pytest.mark.parametrize("flags,kw", [([], {}), (["--layout", "columns"], {"layout": "columns"}),
                                      (["--block-rows", "64"], {"shuffle": "block", "block_rows": 64}),
                                      (["--shuffle", "block"], {"shuffle": "block"}),  # a user's trial: 256 by default
                                      (["--shuffle", "chunks"], {"shuffle": "chunks"}),
                                      (["--shuffle", "none"], {"shuffle": False})])
def test_cache_build_prebuilds_each_layout_and_shuffle_mode(data_4096, tmp_path, flags, kw):
    """`cache build` with --layout/--shuffle/--block-rows builds exactly the files the matching dataset reads."""
    import gpuload

    data = data_4096  # (moved from test_cli.py, whose `data` has 4096-row row groups)
    cache = str(tmp_path / "c")
    columns = "label,dense_0,dense_1,cat_0,cat_1"
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--chunk-mib", "1", "--columns", columns,
                 *flags]) == 0
    ds = gpuload.ParquetDataset(data, columns.split(","), cache_dir=cache, chunk_bytes=1 << 20, device="cpu",
                                batch_size=4096, prefetch=0, **kw)  # its loads counted: none for a next epoch
    assert sum(len(b["label"]) for b in ds) == 20_000
    assert ds.reader.counters.decoded == 0 and ds.reader.counters.from_cache == len(ds.reader.chunks)
    assert main(["cache", "verify", "--cache-dir", cache]) == 0


def test_progress_false_reports_nothing(tmp_path, capsys):
    write_clicklog(tmp_path / "d", 3000, files=1, row_group_rows=1000)
    summary = gpuload.build_cache(tmp_path / "d", tmp_path / "c", COLUMNS, progress=False)
    assert summary.built > 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("kw,said", [
    (dict(progress=5), r"progress=5 must be True \(a progress bar\), False or None \(none\), or a function progress\(rows\)"),
    (dict(client="tcp://scheduler:8786"), r"client= is a str: pass a distributed.Client"),
])
def test_a_progress_or_client_of_another_kind_is_refused_before_anything_is_built(tmp_path, kw, said):
    """progress=5 was a TypeError after the first chunk was built; client=5 an AttributeError."""
    write_clicklog(tmp_path / "d", 3000, files=1, row_group_rows=1000)
    with pytest.raises(gpuload.ConfigError, match=said):
        gpuload.build_cache(tmp_path / "d", tmp_path / "c", COLUMNS, **kw)
    assert not list((tmp_path / "c").rglob("*.glc"))


def test_the_summary_gives_small_sizes_in_units_that_show_them():
    """A user's trial under a 1 MiB quota read "did not fit the cache folder's quota of 0.00 GiB" and
    "0.00 GiB in ..." for 0.8 MiB cached."""
    from gpuload.build import CacheSummary

    s = CacheSummary("/c", files=1, rows=10, chunks=3, built=1, already_cached=0, not_cached=2,
                     cached_bytes=int(0.8 * 2**20), seconds=0.1, outputs=("x",), over_budget=2,
                     max_cache_bytes=2**20, quota=True)
    text = str(s)
    assert "819.2 KiB in /c" in text and "the cache folder's quota of 1.0 MiB" in text and "0.00" not in text
    big = CacheSummary("/c", files=1, rows=10, chunks=1, built=1, already_cached=0, not_cached=0,
                       cached_bytes=3 * 2**30, seconds=0.1, outputs=("x",))
    assert "3.00 GiB in /c" in str(big)


def test_block_rows_with_another_shuffle_flag_is_refused(data_4096, tmp_path, capsys):
    rc = main(["cache", "build", str(data_4096), "--cache-dir", str(tmp_path / "c"), "--shuffle", "chunks",
               "--block-rows", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--block-rows 64 is for --shuffle block" in err[0]
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").rglob("*.glc"))


def test_cache_info_tells_a_block_shuffles_column_set_from_the_others(data_4096, tmp_path, capsys):
    """User trials: column sets built for shuffle='block', for the row shuffle (row blocks) and for
    'chunks' (columns) were printed exactly alike."""
    cache = str(tmp_path / "c")
    for flags in (["--shuffle", "chunks"], [], ["--shuffle", "block"]):  # chunks first: it reads row blocks cached
        assert main(["cache", "build", str(data_4096), "--cache-dir", cache, "--columns", "label,dense_0,dense_1",
                     *flags]) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    sets = [line for line in capsys.readouterr().out.splitlines() if "label" in line and "dense_0" in line]
    assert len(sets) == 3 and sum("rows permuted in each chunk (for shuffle='block')" in s for s in sets) == 1, sets
    assert sum("row blocks (layout='rows')" in s for s in sets) == 1, sets  # the default's; 'chunks' stores columns
