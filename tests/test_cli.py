"""The gpuload command: one-line errors, non-zero exits, cache management, the demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuload.cache import read_header
from gpuload.cli import main
from gpuload.synth import write_clicklog


@pytest.fixture
def data(tmp_path):
    write_clicklog(tmp_path / "data", rows=20_000, files=2, row_group_rows=4096)
    return tmp_path / "data"


def run(*args):
    return subprocess.run([sys.executable, "-m", "gpuload.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["cache", "build", "/no/such/place"], "no such file"),
    (["cache", "build", "DATA", "--columns", "dense_0,nope"], "'nope'"),
    (["cache", "build", "DATA", "--columns", "{bad json"], "--columns"),
    (["demo", "--rows", "10"], "--rows"),
    (["demo", "--device", "cuda:0", "--rows", "2000"], "device="),
])
def test_user_mistakes_are_one_line_errors(args, needle, data, tmp_path):
    args = [str(data) if a == "DATA" else a for a in args]
    r = run(*args, *(["--cache-dir", str(tmp_path / "c")] if args[0] == "cache" else []))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpuload: error:")]
    assert len(lines) == 1 and needle in lines[0]


def test_build_info_verify_clear(data, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert main(["cache", "build", str(data), "--cache-dir", cache, "--chunk-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "20,000 rows from 2 files" in out and "built" in out
    assert main(["cache", "info", "--cache-dir", cache]) == 0
    assert "part-00000.parquet" in capsys.readouterr().out
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    victim = sorted((tmp_path / "cache").rglob("*.glc"))[0]
    with open(victim, "rb") as f:
        region = read_header(f, victim)[0]["regions"][0]
    raw = bytearray(victim.read_bytes())
    raw[region["offset"] + region["nbytes"] // 2] ^= 0xFF  # inside a data region
    victim.write_bytes(bytes(raw))
    assert main(["cache", "verify", "--cache-dir", cache]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["cache", "verify", "--cache-dir", cache, "--delete"]) == 1
    assert not victim.exists()
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    assert not list((tmp_path / "cache").rglob("*.glc"))


def test_demo_runs_small(tmp_path):
    r = run("demo", "--rows", "30000", "--files", "2", "--batch-size", "4096", "--step-ms", "1",
            "--workdir", str(tmp_path / "w"))
    assert r.returncode == 0, r.stderr
    for name in ("epoch 1", "epoch 2", "naive"):
        assert name in r.stdout
    assert "rows/s" in r.stdout and "waiting for data" in r.stdout
