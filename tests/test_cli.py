"""The gpuload command: one-line errors, non-zero exits, cache management, the demo."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from gpuload.cache.chunkfile import read_chunk
from gpuload.cache.chunkfile import LAYOUT_DIR
from gpuload.tools.cli import _writable_file, main
from gpuload.synth import write_clicklog

from conftest import run_with_timeout


@pytest.fixture
def data(tmp_path):
    write_clicklog(tmp_path / "data", rows=20_000, files=2, row_group_rows=4096)
    return tmp_path / "data"


def run(*args):
    """The real command, in a process of its own (tests that use it are marked slow)."""
    return subprocess.run([sys.executable, "-m", "gpuload.tools.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["cache", "build", "/no/such/place"], "no such file"),
    (["cache", "build", "DATA", "--columns", "dense_0,nope"], "'nope'"),
    (["cache", "build", "DATA", "--columns", "{bad json"], "--columns"),
    (["demo", "--rows", "10"], "--rows"),
    (["demo", "--device", "cuda:0", "--rows", "2000"], "--device cuda:0"),
    (["cache", "build", "DATA", "--storage-options", "[1]"], "--storage-options"),
    (["cache", "build", "DATA", "--nodes", "2"], "give --scheduler too"),
    (["cache", "build", "DATA", "--nodes", "2", "--workers", "2"], "give --scheduler too"),
    (["cache", "build", "DATA", "--workers", "0"], "--workers 0"),
    (["profile", "DATA", "--layout", "diagonal"], "argument --layout: invalid choice: 'diagonal'"),  # argparse's
    (["cache", "frobnicate"], "invalid choice: 'frobnicate'"),
    (["cache", "info", "DATA", "--nodes", "0"], "--nodes 0: the training's number of nodes is at least 1"),
    (["cache", "info", "/no/such/place"], "/no/such/place: no such file or directory"),  # not "give --nodes"
    (["cache", "info", "/no/such/*.parquet"], "/no/such/*.parquet: matched no Parquet files"),  # the listing's
    (["cache", "info", "file:///no/such/place"], "/no/such/place: no such file or directory"),
    (["cache", "info", "DATA", "--bogus"], "unrecognized arguments: --bogus (see gpuload cache info --help)"),
    (["cache", "quota", "-5G"], "unrecognized arguments: -5G (see gpuload cache quota --help)"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus (see gpuload demo --help)"),
    (["--bogus"], "unrecognized arguments: --bogus; give a command first: demo, profile, cache (see gpuload --help)"),
    (["--threads", "2", "profile", "DATA"],
     "unrecognized arguments: --threads; give a command first: demo, profile, cache (see gpuload --help)"),
    (["cache", "--max-gib", "3", "build", "DATA"], "unrecognized arguments: --max-gib; give a command first: build, "
     "quota, info, verify, clear (see gpuload cache --help)"),
    (["-v"], "gpuload: error: give a command first: demo, profile, cache (see gpuload --help)"),
    (["-v", "cache"], "error: give a command first: build, quota, info, verify, clear (see gpuload cache --help)"),
])
def test_user_mistakes_are_one_line_errors(args, needle, data, tmp_path, cli):
    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = [str(data) if a == "DATA" else a for a in args]
    r = cli(*args, *(["--cache-dir", str(tmp_path / "c")] if args[0] == "cache" else []))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpuload: error:")]
    assert len(lines) == 1 and needle in lines[0]


def test_output_cut_short_by_its_reader_is_no_error(data, tmp_path, capsys, monkeypatch):
    """`gpuload cache info | head -1`: the pipe closes, and the command once blamed the cache folder
    (`cannot use the cache folder ... (Broken pipe)`, status 2). Now it stops quietly, status 141 as
    a command SIGPIPE ends."""
    import io
    import sys

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    assert main(["cache", "build", str(data), "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["cache", "info", "--cache-dir", str(tmp_path / "c")]) == 141
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


def test_build_info_verify_clear(data, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--chunk-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "chunks (20,000 rows) from 2 files" in out and "built" in out
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "part-00000.parquet" in out and "Parquet footers of 2 source files" in out
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    victim = sorted((tmp_path / "cache").rglob("*.glc"))[0]
    region = read_chunk(victim, verify=False)[0]["regions"][0]
    raw = bytearray(victim.read_bytes())
    raw[region["offset"] + region["nbytes"] // 2] ^= 0xFF  # inside a data region
    victim.write_bytes(bytes(raw))
    assert main(["cache", "verify", "--cache-dir", cache]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "the next read rebuilds it from its source; --delete removes them now" in out
    from gpuload.cache.store import ChunkCache

    def denied(self, path):  # a cache another user built: as root, chmod would not stop this test
        raise PermissionError(13, "Permission denied", str(path))

    with pytest.MonkeyPatch.context() as mp:  # a helper's trial: --delete there was told "it must be readable"
        mp.setattr(ChunkCache, "delete", denied)
        assert main(["cache", "verify", "--cache-dir", cache, "--delete"]) == 2
        err = capsys.readouterr().err
        assert "Permission denied" in err and "it must be writable" in err and err.count("\n") == 1
    assert victim.exists()
    assert main(["cache", "verify", "--cache-dir", cache, "--delete"]) == 1
    assert not victim.exists()
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    assert not list((tmp_path / "cache").rglob("*.glc"))


def test_a_damaged_column_set_description_is_found_and_written_again(data, tmp_path, capsys):
    """``specs/<hash>.json`` names and describes a column set for ``cache info`` and ``clear
    --spec``: cut short, or holding another set's description, ``verify`` reports it (and
    ``--delete`` removes it), and the next dataset that opens that column set writes it again."""
    import gpuload

    cache = tmp_path / "cache"
    assert main(["cache", "build", str(data), "--cache-dir", str(cache), "--chunk-mib", "1"]) == 0
    (spec,) = (cache / LAYOUT_DIR / "specs").glob("*.json")
    good = spec.read_text()
    for damage in ("{garbage", good.replace('"kind"', '"kinds"', 1), "[]", "{}"):
        spec.write_text(damage)
        capsys.readouterr()
        assert main(["cache", "verify", "--cache-dir", str(cache)]) == 1
        out = capsys.readouterr().out
        assert "CORRUPT" in out and spec.name in out, out
        gpuload.ParquetDataset(data, cache_dir=cache, device="cpu", chunk_bytes=1 << 20)  # opening repairs it
        assert spec.read_text() == good
        assert main(["cache", "verify", "--cache-dir", str(cache)]) == 0
    spec.write_text("{garbage")
    assert main(["cache", "verify", "--cache-dir", str(cache), "--delete"]) == 1
    assert not spec.exists() and main(["cache", "verify", "--cache-dir", str(cache)]) == 0


def test_demo_runs_small(tmp_path, cli):
    r = cli("demo", "--rows", "30000", "--files", "2", "--batch-size", "4096", "--step-ms", "1",
            "--workdir", str(tmp_path / "w"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    for name in ("epoch 1", "epoch 2", "naive"):
        assert name in r.stdout
    assert "rows/s" in r.stdout and "waiting for data" in r.stdout


@pytest.mark.slow
def test_a_terminated_demo_removes_its_temporary_folder(tmp_path):
    """SIGTERM (``timeout``, ``kill``, Slurm, ``docker stop``) ends the demo as Ctrl-C does: its
    temporary folder removed, one line said, the status 128 + SIGTERM; the signals after the first
    are ignored (three of them 10 ms apart left the folder behind)."""
    import os
    import signal

    from conftest import spawn, wait_until

    proc = spawn([sys.executable, "-m", "gpuload", "demo", "--rows", "3000000", "--device", "cpu"],
                 env={**os.environ, "TMPDIR": str(tmp_path)})
    wait_until(lambda: any(tmp_path.glob("gpuload-demo-*/data/*.parquet")), timeout=120,
               what="the demo writing its data")
    for _ in range(3):  # a second and third SIGTERM (a launcher insisting) do not cut the cleanup short
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "gpuload: terminated", err
    assert not list(tmp_path.glob("gpuload-demo-*")), "the demo's temporary folder was left behind"


@pytest.mark.parametrize("action", ["info", "verify", "clear"])
def test_the_default_cache_folder_not_made_yet_is_nothing_cached(tmp_path, action, monkeypatch, capsys):
    """A new user's first `gpuload cache info` (no --cache-dir, no $GPULOAD_CACHE_DIR): exit 0 and say
    nothing is cached yet (was an error); the folder is not made. A named folder that is missing is
    still an error (the test below)."""
    monkeypatch.delenv("GPULOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["cache", action]) == 0
    out = capsys.readouterr().out
    assert "nothing is cached yet" in out and str(tmp_path / "xdg" / "gpuload") in out
    assert not (tmp_path / "xdg").exists()


@pytest.mark.parametrize("action", ["info", "verify", "clear"])
def test_missing_cache_folder_is_an_error_and_is_not_created(tmp_path, action, cli):
    typo = tmp_path / "cahce"
    r = cli("cache", action, "--cache-dir", str(typo))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "does not exist" in r.stderr and str(typo) in r.stderr
    assert not typo.exists()


def test_cli_errors_name_flags_not_python_arguments(tmp_path, cli):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"f3": pa.array([1.0, None, 2.0])}), tmp_path / "n.parquet")
    r = cli("cache", "build", str(tmp_path / "n.parquet"), "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 2
    assert """--fill-nulls '{"f3": 0}'""" in r.stderr and "fill_nulls=" not in r.stderr
    r = cli("cache", "build", str(tmp_path / "n.parquet"), "--cache-dir", str(tmp_path / "c"),
            "--fill-nulls", '{"f3": 0}')
    assert r.returncode == 0, r.stderr
    # the same mistake in Python names the argument
    import gpuload

    with pytest.raises(gpuload.NullValuesError, match=r"fill_nulls=\{'f3': 0\}"):
        gpuload.ParquetDataset(tmp_path / "n.parquet", cache_dir=tmp_path / "c", device="cpu")


def test_info_shows_column_sets_and_clear_removes_one_or_the_unused(data, tmp_path, capsys):
    import os
    import time

    cache = str(tmp_path / "cache")
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--columns", "label,dense_0"]) == 0
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--columns",
                 '{"dense": ["dense_0", "dense_1"], "label": "label"}', "--dtypes", '{"dense": "bfloat16"}']) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    specs = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ") and "last used" in line
             and "chunk folders (a source file's" not in line]  # column sets, not the datasets above them
    assert len(specs) == 2
    assert "label (int8), dense_0 (float32)" in out and "dense=[dense_0, dense_1] (bfloat16)" in out
    # the older column set was last used long ago
    spec_files = {p.stem: p for p in (tmp_path / "cache" / LAYOUT_DIR / "specs").glob("*.json")}
    old = next(h for h in specs if "dense_0 (float32)" in next(line for line in out.splitlines() if h in line))
    long_ago = time.time() - 90 * 86400
    os.utime(spec_files[old], (long_ago, long_ago))
    assert main(["cache", "clear", "--cache-dir", cache, "--unused-since", "30d"]) == 0
    assert "1 column sets" in capsys.readouterr().out
    left = {p.name[:16] for p in (tmp_path / "cache").rglob("*.glc")}
    assert left == {h for h in specs if h != old}
    assert main(["cache", "clear", "--cache-dir", cache, "--spec", "ffff"]) == 2  # unknown: an error
    # column sets that differ only in what nulls become, with a list column: told apart in one look
    for fill in ("0", "7"):
        assert main(["cache", "build", str(data), "--cache-dir", cache, "--columns", "dense_0,history",
                     "--fill-nulls", f'{{"dense_0": {fill}}}']) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "dense_0 (float32, nulls as 0.0), history (lists of int64)" in out
    assert "dense_0 (float32, nulls as 7.0), history (lists of int64)" in out
    for h in [line.split(":")[0].strip() for line in out.splitlines() if "nulls as" in line]:
        assert main(["cache", "clear", "--cache-dir", cache, "--spec", h]) == 0
    assert main(["cache", "clear", "--cache-dir", cache, "--spec", next(iter(left))[:8]]) == 0
    assert not list((tmp_path / "cache").rglob("*.glc"))


def test_readme_cache_build_example_matches_the_training_example():
    """The README's `cache build` columns are the columns its training example loads."""
    import json
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    build = re.search(r"gpuload cache build \S+ --columns '([^']+)'", readme)
    assert build, "README has no cache build example with --columns"
    built = json.loads(build[1])
    code = re.search(r"```python\n(.*?)```", readme, re.S)[1]  # the training example
    namespace: dict = {}
    exec(code[code.index("columns = "):code.index("ds = ")], namespace)
    assert built == namespace["columns"]
    fills = re.search(r"gpuload cache build .*--fill-nulls '([^']+)'", readme)
    assert fills and json.loads(fills[1]) == {"dense_3": 0.0} and 'fill_nulls={"dense_3": 0.0}' in code


@pytest.mark.parametrize("args,needle", [
    (["cache", "clear", "--unused-since", "99999999999d"], "--unused-since"),
    (["cache", "clear", "--spec", ""], "--spec"),
    (["cache", "clear", "--spec", "ab"], "--spec"),
    (["cache", "build", "DATA", "--chunk-mib", "nan"], "--chunk-mib"),
    (["cache", "build", "DATA", "--max-gib", "inf"], "--max-gib"),
    (["cache", "build", "DATA", "--dtypes", '{"label": "float128"}'], "float128"),
    (["cache", "build", "DATA", "--filter", '["label", ">", 0]'], "--filter '[\"label\", \">\", 0]' is one condition"),
    (["profile", "DATA", "--step-ms", "nan"], "--step-ms"),
    (["profile", "DATA", "--step-ms", "1e308"], "--step-ms"),
    (["profile", "DATA", "--model", "mlp", "--columns", "history"], "--model mlp"),
])
def test_bad_numbers_and_prefixes_are_one_line_errors(args, needle, data, tmp_path, capsys):
    cache = tmp_path / "c"
    cache.mkdir()
    args = [str(data) if a == "DATA" else a for a in args] + (["--device", "cpu"] if args[0] == "profile" else [])
    rc = main([*args, "--cache-dir", str(cache)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_a_dataset_reading_through_a_clear_describes_its_column_set_again(data, tmp_path, capsys):
    """`cache clear` while a dataset reads: it makes the chunks again, and `cache info` names their
    column set again (a user's trial saw "(description missing)" until the next open)."""
    import gpuload

    cache = str(tmp_path / "cache")
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--columns", "label,dense_0"]) == 0
    ds = gpuload.ParquetDataset(str(data), ["label", "dense_0"], cache_dir=cache, device="cpu", batch_size=4096)
    rows = sum(len(b["label"]) for b in ds)
    assert main(["cache", "clear", "--include-open", "--cache-dir", cache]) == 0
    assert sum(len(b["label"]) for b in ds) == rows  # made again
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "label (int8), dense_0 (float32)" in out and "description missing" not in out, out


def test_clear_with_a_prefix_of_several_column_sets_is_refused(data, tmp_path, capsys):
    cache = tmp_path / "cache"
    for cols in ("label", "dense_0", "dense_1", "label,dense_0", "label,dense_1"):
        assert main(["cache", "build", str(data), "--cache-dir", str(cache), "--columns", cols]) == 0
    specs = sorted(p.stem for p in (cache / LAYOUT_DIR / "specs").glob("*.json"))
    prefixes = {h[:4] for h in specs}
    shared = next((p for p in prefixes if sum(h.startswith(p) for h in specs) > 1), None)
    if shared is None:  # no two hashes share 4 digits here: the API refuses an ambiguous prefix alike
        shared = specs[0][:4]
        import gpuload
        from gpuload.cache.store import ChunkCache

        with pytest.raises(gpuload.ConfigError, match="not exactly one"):
            ChunkCache(cache, create=False).clear(spec="")
        return
    capsys.readouterr()
    assert main(["cache", "clear", "--cache-dir", str(cache), "--spec", shared]) == 2
    assert "not exactly one" in capsys.readouterr().err
    assert len(list(cache.rglob("*.glc"))) == 2 * len(specs)


def test_cache_info_and_clear_say_what_a_flag_needs(data, tmp_path, capsys):
    """A user's trial: `cache info --filter 'junk'` printed the cache and exited 0; `cache info SOURCE`
    said only "give --nodes N"; `cache clear --spec abcd` matching nothing said to give more of the hash."""
    cache = str(tmp_path / "cache")
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--columns", "label"]) == 0
    capsys.readouterr()
    for flags, named in ((["--filter", "not json at all"], "--filter says"),
                         (["--columns", "label", "--nodes", "2"], "--columns, --nodes say"),
                         (["--seed", "5"], "--seed says")):
        assert main(["cache", "info", "--cache-dir", cache, *flags]) == 2
        err = capsys.readouterr().err
        assert named in err and "give one" in err and err.count("\n") == 1, err
    assert main(["cache", "info", str(data), "--cache-dir", cache]) == 2
    assert "leave SOURCE out to see the cache folder alone" in capsys.readouterr().err
    assert main(["cache", "clear", "--cache-dir", cache, "--spec", "zzzz"]) == 2
    err = capsys.readouterr().err
    assert "spec 'zzzz' names no column set" in err and "more of its hash" not in err
    assert "under 'column sets' (not a dataset's" in err  # cache info lists datasets' hashes first
    assert len(list((tmp_path / "cache").rglob("*.glc"))) > 0  # nothing cleared


@pytest.mark.slow
def test_cache_build_and_profile_of_an_s3_source(data, tmp_path):
    """`cache build s3://...` and `profile s3://...` against a loopback S3 server, in subprocesses."""
    pytest.importorskip("moto")
    import json
    import os

    from gpuload.testing import S3Server

    with S3Server() as s3:
        s3.upload_folder(data, "clibkt", "clicks/")
        opts = json.dumps(s3.storage_options)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        cache = str(tmp_path / "c")
        r = subprocess.run([sys.executable, "-m", "gpuload.tools.cli", "cache", "build", "s3://clibkt/clicks/",
                            "--storage-options", opts, "--cache-dir", cache, "--chunk-mib", "1"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        assert "built" in r.stdout and "0 already cached" in r.stdout
        s3.reset_counts()
        r = subprocess.run([sys.executable, "-m", "gpuload.tools.cli", "profile", "s3://clibkt/clicks/", "--storage-options",
                            opts, "--cache-dir", cache, "--chunk-mib", "1", "--epochs", "1", "--step-ms", "1",
                            "--batch-size", "4096", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0, r.stderr
        assert "remote source: no requests" in r.stdout  # built ahead: the profiled epoch reads the cache
        assert s3.count("GET", ".parquet") == 0


@pytest.mark.slow  # the real command, and a Dask cluster of worker processes
def test_build_on_local_cluster_and_node_shares(data, tmp_path):
    pytest.importorskip("distributed", reason="--workers builds on a Dask cluster")
    cache = str(tmp_path / "c")
    r = run("cache", "build", str(data), "--cache-dir", cache, "--chunk-mib", "0.25", "--workers", "2")
    assert r.returncode == 0, r.stderr
    built = int(re.search(r"(\d+) chunks \(20,000 rows\) from 2 files: (\d+) built", r.stdout).group(2))
    assert built > 2 and "Traceback" not in r.stderr
    r = run("cache", "info", str(data), "--cache-dir", cache, "--chunk-mib", "0.25", "--nodes", "2")
    assert r.returncode == 0, r.stderr
    shares = re.findall(r"node (\d): (\d+) chunks, ([\d,]+) rows; (\d+) cached here", r.stdout)
    assert [s[0] for s in shares] == ["0", "1"]
    assert sum(int(s[1]) for s in shares) == built and all(s[1] == s[3] for s in shares)
    assert sum(int(s[2].replace(",", "")) for s in shares) == 20_000
    r = run("cache", "info", str(data), "--cache-dir", cache)
    assert r.returncode == 2 and "give --nodes N" in r.stderr


def test_clear_keeps_a_column_set_a_running_dataset_has_open(data, tmp_path, capsys):
    """New users' trials: `clear --unused-since`, then a plain `clear` and `clear --spec`, deleted the chunks of
    a dataset open in another process (which then decoded and wrote them all again), where the README said
    never: a column set in use is kept, saying so, unless --include-open; the others go."""
    import gpuload

    cache = tmp_path / "c"
    other = gpuload.ParquetDataset(data, ["label"], cache_dir=cache, device="cpu", chunk_bytes=1 << 20)
    list(other)
    other.close()  # another column set, no longer open
    ds = gpuload.ParquetDataset(data, cache_dir=cache, device="cpu", chunk_bytes=1 << 20)
    list(ds)
    ds.reader.cache.flush()
    mine = sorted(p for p in cache.rglob("*.glc") if p.name.startswith(ds.reader.spec_hash))
    assert mine and len(mine) < len(list(cache.rglob("*.glc")))
    capsys.readouterr()
    for how in (["--unused-since", "2099-01-01"], ["--spec", ds.reader.spec_hash[:8]], []):
        if not how:  # an older format's chunk (no reader reads it): a full clear removes it, open sets or not
            old = cache / "v2" / mine[0].parent.name / mine[0].name
            old.parent.mkdir(parents=True)
            shutil.copy(mine[0], old)
        assert main(["cache", "clear", *how, "--cache-dir", str(cache)]) == 0
        out = capsys.readouterr().out
        assert "kept 1 column sets a running dataset has open" in out and "--include-open" in out, (how, out)
        assert sorted(cache.rglob("*.glc")) == mine  # the other column set is gone, this one kept
    assert main(["cache", "clear", "--include-open", "--cache-dir", str(cache)]) == 0
    assert not list(cache.rglob("*.glc"))
    list(ds)  # the dataset decodes them again
    ds.reader.cache.flush()
    assert sorted(cache.rglob("*.glc")) == mine
    ds.close()  # closed: no longer in use, and cleared
    capsys.readouterr()
    assert main(["cache", "clear", "--unused-since", "2099-01-01", "--cache-dir", str(cache)]) == 0
    assert "kept" not in capsys.readouterr().out and not list(cache.rglob("*.glc"))


def test_warnings_of_the_command_name_its_flags(data, tmp_path, caplog):
    """A new user's trial: `cache build --max-gib 0` warned of max_cache_bytes=0 and cache_io='off'."""
    import logging

    with caplog.at_level(logging.WARNING, logger="gpuload"):
        assert main(["cache", "build", str(data), "--cache-dir", str(tmp_path / "c"), "--max-gib", "0"]) == 0
    (warned,) = [r.getMessage() for r in caplog.records if "leaves no room" in r.getMessage()]
    assert warned.startswith("gpuload: --max-gib 0 leaves no room") and "the build caches none of them" in warned
    assert "max_cache_bytes" not in warned and "cache_io" not in warned and "--cache-io" not in warned
    caplog.clear()  # a budget too small: a build is not told of --cache-io off, which it refuses
    with caplog.at_level(logging.WARNING, logger="gpuload"):
        assert main(["cache", "build", str(data), "--cache-dir", str(tmp_path / "d"), "--max-gib", "0.001"]) == 0
    (warned,) = [r.getMessage() for r in caplog.records if "has space for about" in r.getMessage()]
    assert "--max-gib" in warned and "fewer columns" in warned and "cache-io" not in warned and "cache_io" not in warned


def test_info_of_a_source_leaves_the_cache_as_it_was(data, tmp_path, capsys):
    """A new user's trial: `cache info SOURCE --nodes 2` recorded a use of the column set and a reader,
    so the next `cache info` listed a dataset and a column set "last used" now that no training used."""
    from gpuload.cache.paths import LAYOUT_DIR

    cache = tmp_path / "c"
    assert main(["cache", "build", str(data), "--cache-dir", str(cache), "--chunk-mib", "1"]) == 0
    records = {p: p.stat().st_mtime_ns for p in (cache / LAYOUT_DIR).rglob("*") if "specs" in p.parts
               or "uses" in p.parts}

    def unchanged(out: str) -> str:  # the budget line's free disk moves with other jobs' writes on this disk
        return "\n".join(line for line in out.splitlines() if not line.startswith("budget:"))

    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    before = unchanged(capsys.readouterr().out)
    time.sleep(0.01)
    assert main(["cache", "info", str(data), "--cache-dir", str(cache), "--chunk-mib", "1", "--nodes", "2"]) == 0
    assert "node 1:" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (cache / LAYOUT_DIR).rglob("*") if "specs" in p.parts
            or "uses" in p.parts} == records
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    assert unchanged(capsys.readouterr().out) == before


def test_every_column_with_nulls_is_named_in_one_line_with_the_flag_that_fixes_them(tmp_path, cli):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": pa.array([1.0, None]), "ok": pa.array([1, 2]), "b": pa.array([None, 2]),
                             "c": pa.array([[1], None], pa.list_(pa.int64()))}), tmp_path / "n.parquet")
    r = cli("cache", "build", str(tmp_path / "n.parquet"), "--cache-dir", str(tmp_path / "c"))
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpuload: error:")]
    assert r.returncode == 2 and len(lines) == 1 and "3 columns" in lines[0]
    fix = """--fill-nulls '{"a": 0, "b": 0, "c": 0}'"""
    assert fix in lines[0] and "fill_nulls=" not in lines[0]
    r = cli("cache", "build", str(tmp_path / "n.parquet"), "--cache-dir", str(tmp_path / "c"), "--fill-nulls",
            json.dumps({"a": 0, "b": 0, "c": 0}))
    assert r.returncode == 0, r.stderr


PYTHON_NAMES = ("num_threads", "batch_size", "chunk_bytes", "max_cache_bytes", "dtypes=", "fill_nulls=", "columns=",
                "cache_dir", "block_rows", "prefetch=", "device=", "layout=", "storage_options")


@pytest.mark.parametrize("args,flag", [
    (["cache", "build", "DATA", "--threads", "0"], "--threads 0"),
    (["cache", "build", "DATA", "--chunk-mib", "0.001"], "--chunk-mib 0.001"),
    (["cache", "build", "DATA", "--block-rows", "-4"], "--block-rows -4"),
    (["cache", "build", "DATA", "--columns", "label,dense_0", "--dtypes", '{"dense_0": "int8"}'], "--dtypes"),
    (["cache", "build", "DATA", "--columns", "label", "--fill-nulls", '{"label": 1.5}'], "--fill-nulls"),
    (["cache", "build", "DATA", "--device", "tpu"], "--device tpu"),
    (["cache", "build", "DATA", "--cache-dir", "FILE/cache"], "--cache-dir"),
    (["profile", "DATA", "--threads", "0"], "--threads 0"),
    (["profile", "DATA", "--nice", "20"], "--nice 20"),
    (["profile", "DATA", "--cache-io", "mmap"], "--cache-io mmap"),
    (["cache", "build", "DATA", "--cache-io", "always"], "--cache-io always"),
    (["cache", "build", "DATA", "--cache-io", "off"], "--cache-io off caches nothing"),
    (["cache", "build", "DATA", "--cache-io", "off", "--scheduler", "notanaddress"], "--cache-io off"),  # first
    (["profile", "DATA", "--batch-size", "0"], "--batch-size 0"),
    (["profile", "DATA", "--prefetch", "-1"], "--prefetch -1"),
    (["profile", "DATA", "--chunk-mib", "0.001"], "--chunk-mib 0.001"),
    (["profile", "DATA", "--device", "cuda:0"], "--device cuda:0"),
    (["cache", "info", "DATA", "--nodes", "2", "--block-rows", "0"], "--block-rows 0"),
    (["cache", "build", "DATA", "--columns", "label", "--fill-nulls", '{"dense_0": 0}'], "--fill-nulls"),
    (["cache", "build", "DATA", "--dtypes", '{"label": "float17"}'], "--dtypes label='float17' is not a dtype"),
    (["cache", "build", "DATA", "--dtypes", '{"nope": "float32"}'], "--dtypes names outputs that do not exist"),
    (["cache", "build", "DATA", "--columns", "label", "--fill-nulls", '{"label": "x"}'], "--fill-nulls"),
    (["demo", "--device", "cuda:0", "--rows", "2000"], "--device cuda:0"),
    (["demo", "--files", "0", "--rows", "2000"], "--files 0"),  # these four were tracebacks
    (["demo", "--step-ms", "-1", "--rows", "2000"], "--step-ms -1"),
    (["demo", "--workdir", "FILE", "--rows", "2000"], "--workdir"),
    (["demo", "--workdir", "FILE/w", "--rows", "2000"], "--workdir"),  # was the OS's error, naming no flag
    (["demo", "--files", "100000"], "--files 100000"),  # was accepted: 100,000 files written in /tmp
    (["profile", "DATA", "--trace", "/proc/version"], "--trace"),  # failed only after the whole run
    (["cache", "build", "DATA", "--scheduler", "notanaddress"], "--scheduler 'notanaddress'"),
    (["profile", "DATA", "--trace", "FILE/t.json"], "--trace"),  # was the OS's error, naming no flag
    (["cache", "build", "DATA", "--columns", "[1, 2]"], "--columns"),
    (["cache", "build", "DATA", "--columns", '{"a": []}'], "--columns a must be a column name"),  # was columns['a']
    (["cache", "build", "DATA", "--columns", "label,,dense_0"], "has an empty name"),  # was read as label,dense_0
    (["cache", "build", "DATA", "--cache-dir", ""], "--cache-dir=''"),
    (["cache", "info", "DATA", "--nodes", "2", "--dtypes", '{"label": "int33"}'], "--dtypes"),  # these three
    (["cache", "info", "DATA", "--nodes", "2", "--columns", "nope"], "nope"),  # printed the cache's summary
    (["cache", "info", "FILE/none", "--nodes", "2"], "none"),  # before the error
    (["cache", "info", "DATA", "--nodes", "2", "--cache-dir", "FILEtypo"], "--cache-dir"),  # not made by the open
])
def test_errors_name_the_flags_typed_never_python_arguments(args, flag, data, tmp_path, capsys):
    """Through the real command: a non-zero exit, one line, the flag as the user typed it,
    and nothing printed before the error (profile used to announce 'batches of 0 rows')."""
    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if flag == "--scheduler 'notanaddress'" and importlib.util.find_spec("distributed") is None:
        flag = "--scheduler and --workers need Dask: pip install 'gpuload[dask]'"  # a GPU node without dask
    (tmp_path / "FILE").write_text("not a folder")
    args = [str(data) if a == "DATA" else str(tmp_path / a) if a.startswith("FILE") else a for a in args]
    if args[0] in ("cache", "profile") and "--cache-dir" not in args:
        args += ["--cache-dir", str(tmp_path / "c")]
        (tmp_path / "c").mkdir()  # `cache info` needs one
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc != 0 and out == "", out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuload: error:") and flag in lines[0], err
    assert not (tmp_path / "FILEtypo").exists()  # a mistyped cache folder is named, not made
    assert not any(name in lines[0] for name in PYTHON_NAMES), lines[0]


def test_a_trace_that_would_overwrite_data_is_refused_and_nothing_is_touched(data, tmp_path, capsys, monkeypatch):
    """``--trace`` naming a file of the source (a typo of a user's trial truncated the Parquet file
    being profiled, then failed saying the source had changed), also as ``file://`` and as the name
    a torchrun rank writes, a new ``.parquet`` name in the source's folder, or a Parquet file elsewhere:
    refused in one line, every file as it was. A FIFO is not read (the check would wait on it)."""
    part = sorted(data.glob("*.parquet"))[0]
    elsewhere = tmp_path / "other.parquet"
    shutil.copy(part, elsewhere)
    shutil.copy(part, tmp_path / "t.rank1.parquet")  # the file rank 1 of 2 writes for --trace t.parquet
    before = {p: p.read_bytes() for p in (part, elsewhere, tmp_path / "t.rank1.parquet")}
    cases = ((str(part), [str(data)], "that is a file of the source"),
             (str(part), [f"file://{part}"], "that is the source"),
             (str(data / "new.parquet"), [str(data)], "would be read as data"),
             (str(data), [str(data)], "that is a folder"), (str(elsewhere), [str(data)], "that is a Parquet file"),
             (str(tmp_path / "t.parquet"), [str(data)], "t.rank1.parquet: that is a Parquet file"))
    for trace, sources, said in cases:
        if "rank1" in said:
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("RANK", "1")
        capsys.readouterr()
        rc = main(["profile", *sources, "--trace", trace, "--epochs", "1", "--cache-dir", str(tmp_path / "c")])
        out, err = capsys.readouterr()
        assert rc != 0 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "--trace" in err and said in err, err
    assert {p: p.read_bytes() for p in before} == before
    assert not (data / "new.parquet").exists() and not (tmp_path / "c").exists()
    monkeypatch.delenv("WORLD_SIZE")
    os.mkfifo(tmp_path / "fifo")  # a reader on it (gzip < fifo): the check opens it for appending, never reads it
    reader = threading.Thread(target=lambda: open(tmp_path / "fifo", "rb").read(), daemon=True)
    reader.start()
    run_with_timeout(lambda: _writable_file("--trace", tmp_path / "fifo", [str(data)]), timeout=20)
    reader.join(20)
    _writable_file("--trace", data / "t.json", [str(data)])  # a trace beside the data: not a file it lists


def test_a_column_left_out_for_not_being_in_every_file_is_said_in_the_errors_one_line(tmp_path, capsys):
    """Without --columns, a column some files lack is left out; a --fill-nulls naming it then fails,
    and its one line says why the column is not loaded (was a warning naming columns= and
    fill_nulls= before it: two lines, in Python's words)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"x": np.arange(10), "extra": np.ones(10)}), tmp_path / "d" / "1.parquet")
    pq.write_table(pa.table({"x": np.arange(10)}), tmp_path / "d" / "2.parquet")
    capsys.readouterr()
    rc = main(["profile", str(tmp_path / "d"), "--fill-nulls", '{"extra": 0}', "--device", "cpu",
               "--cache-dir", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert "--fill-nulls names columns that are not loaded: ['extra']" in lines[0]
    assert "extra left out: not in every file; name them in --columns" in lines[0]
    assert not any(name in lines[0] for name in PYTHON_NAMES), lines[0]
    # an error about something else says nothing of it
    assert main(["profile", str(tmp_path / "d"), "--dtypes", '{"x": "bogus"}', "--device", "cpu",
                 "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "left out" not in err, err


def test_every_command_prints_its_help(capsys):
    """`gpuload ... --help` of every command and subcommand (argparse formats help texts with %)."""
    import argparse

    from gpuload.tools.cli import parser

    def commands(p, path):
        yield path
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, path + [name])

    paths = list(commands(parser(), []))
    assert ["cache", "quota"] in paths and ["profile"] in paths
    for path in paths:
        with pytest.raises(SystemExit) as e:
            parser().parse_args([*path, "--help"])
        assert e.value.code == 0, path
        assert capsys.readouterr().out.startswith("usage: gpuload"), path


def test_profile_says_nothing_before_its_source_opens(tmp_path, capsys):
    """The heading comes once the source and the cache folder are open: a bad source prints only its error."""
    (tmp_path / "c").mkdir()
    assert main(["profile", str(tmp_path / "nope"), "--device", "cpu", "--cache-dir", str(tmp_path / "c")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("gpuload: error:"), err


def test_columns_take_a_json_list_too():
    from gpuload.tools.flags import columns

    assert columns('["label", "dense_0"]') == columns("label, dense_0") == ["label", "dense_0"]
    assert columns('{"x": ["a", "b"]}') == {"x": ["a", "b"]}


def test_folders_it_cannot_read_are_said_as_such_not_as_foreign_entries(data, tmp_path, capsys, monkeypatch):
    """A helper's trial (run as another user): a chunk folder it could not read was listed among "entries gpuload
    did not write", with --delete advised; an unreadable cache folder showed an empty cache with room to spare.
    (As root no permission stops a read: CacheRoot.scan is made to fail as it would.)"""
    from gpuload.cache.fs import CacheRoot

    cache = tmp_path / "cache"
    assert main(["cache", "build", str(data), "--cache-dir", str(cache), "--chunk-mib", "1"]) == 0
    folder = sorted(cache.rglob("*.glc"))[0].parent
    blocked = {folder.relative_to(cache).parts}
    scan = CacheRoot.scan

    def denied(self, parts):
        if tuple(parts) in blocked:
            raise PermissionError(13, "Permission denied", str(self.where(parts)))
        return scan(self, parts)

    monkeypatch.setattr(CacheRoot, "scan", denied)
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "1 of its folders cannot be read, and are not counted above" in out and "did not write" not in out, out
    assert main(["cache", "verify", "--cache-dir", str(cache)]) == 1
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and "check its owner and permissions" in out and "--delete" not in out, out
    assert "did not write" not in out
    blocked.add(())  # the cache folder itself
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "cannot use the cache folder" in err and "Permission denied" in err and err.count("\n") == 1, err
