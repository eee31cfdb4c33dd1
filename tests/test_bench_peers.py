"""benchmarks/bench_peers.py keeps working without installing any peer: the loaders of the project's own
venv run end to end on a small click log, and the runners' shared pieces cut and verify batches exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH / "peers"))
    monkeypatch.syspath_prepend(str(BENCH))


def chunk(start: int, n: int) -> dict:
    lens = np.arange(start, start + n) % 4
    off = np.concatenate([[0], np.cumsum(lens)])
    return {"row_id": torch.arange(start, start + n),
            "history": (torch.arange(off[-1]) + 1000 * start, torch.from_numpy(off))}


def test_rebatch_cuts_exact_batches_across_chunks():
    from common import rebatch

    sizes = [5, 3, 17, 1, 8, 2]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    chunks = [chunk(int(s), n) for s, n in zip(starts, sizes)]
    got = list(rebatch(iter(chunks), 8))
    assert [len(b["row_id"]) for b in got] == [8, 8, 8, 8, 4]
    assert torch.equal(torch.cat([b["row_id"] for b in got]), torch.arange(sum(sizes)))
    want = [v.tolist() for c in chunks for v in np.split(c["history"][0].numpy(), c["history"][1].numpy()[1:-1])]
    have = [v.tolist() for b in got for v in np.split(b["history"][0].numpy(), b["history"][1].numpy()[1:-1])]
    assert have == want
    assert all(int(b["history"][1][0]) == 0 and int(b["history"][1][-1]) == len(b["history"][0]) for b in got)


def test_run_epoch_fails_a_loader_that_repeats_or_drops_rows():
    from common import Peer, run_epoch

    class Twice(Peer):
        name = "twice"

        def epoch(self, e):
            yield {"row_id": torch.tensor([0, 1, 1])}
            yield {"row_id": torch.tensor([2])}

    class Good(Peer):
        name = "good"

        def epoch(self, e):
            yield {"row_id": torch.tensor([3, 1])}
            yield {"row_id": torch.tensor([0, 2])}

    assert run_epoch(Good(None), 0, 4, 0.0, None, prepare=True)["verified"] is True
    assert run_epoch(Twice(None), 0, 4, 0.0, None, prepare=False)["verified"].startswith("FAILED")
    assert run_epoch(Good(None), 0, 5, 0.0, None, prepare=False)["verified"].startswith("FAILED")


def _result(rates, verified=(True, True), rss=1 << 30):
    return {"loader": "x", "shuffle": "none", "notes": [], "versions": {}, "peak_rss_bytes": rss,
            "epochs": [{"epoch": i + 1, "rows": 8, "rows_per_s": r, "seconds": 8 / r, "wait_fraction": 0.1 * (i + 1),
                        "first_batch_s": 0.5, "verified": v} for i, (r, v) in enumerate(zip(rates, verified))]}


def test_repeated_runs_combine_into_medians_and_ranges_and_fail_if_one_run_did():
    from bench_peers import combine, table

    runs = [_result([1e6, 3e6]), {"error": "exit 1: boom"}, _result([2e6, 2e6], rss=3 << 30),
            _result([4e6, 2.5e6], verified=(True, "FAILED: 7 rows delivered"))]
    got = combine(runs)
    (e1, e2) = got["epochs"]
    assert (e1["rows_per_s"], e1["rows_per_s_range"]) == (2e6, [1e6, 4e6])
    assert (e2["rows_per_s"], e2["rows_per_s_range"]) == (2.5e6, [2e6, 3e6])
    assert e1["verified"] is True and e2["verified"] == "FAILED: 7 rows delivered"  # one bad run fails the epoch
    assert got["peak_rss_bytes"] == 1 << 30 and got["runs"] == 3 and got["failed"] == ["exit 1: boom"]
    assert combine([runs[1], {"error": "exit 2"}]) == runs[1]  # every run failed: the first error
    one = _result([1e6, 2e6])
    assert combine([one]) is one
    row = table({("x", "1"): got}, "1", 8).splitlines()[-1]
    assert "| 2.00 M (1.00 M-4.00 M) |" in row and "| 2.50 M (2.00 M-3.00 M) |" in row
    assert "FAILED: 7 rows delivered" in row and "1 of 4 runs failed: exit 1: boom" in row


@pytest.mark.slow
def test_local_loaders_deliver_every_row_once(tmp_path, capsys):
    import bench_peers

    out, md = tmp_path / "r.json", tmp_path / "b.md"
    md.write_text("# Benchmarks\n\n## Peers\n\nSTALE\n\n## Other\n\nkept\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- peers:start -->\nSTALE\n<!-- peers:end -->\nrest\n")
    # ideal-window is ideal-window-stacked's code on other columns (both shuffles checked in-process below)
    loaders = ["gpuload", "naive", "ideal", "ideal-block", "ideal-window-stacked", "torch-dataloader"]
    rc = bench_peers.main(["--rows", "50000", "--files", "2", "--threads", "1", "--step-ms", "0",
                           "--loaders", ",".join(loaders), "--workdir", str(tmp_path / "w"),
                           "--json", str(out), "--out", str(md), "--readme", str(readme)])
    got = json.loads(out.read_text())["results"]
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert [r["key"] for r in got] == loaders
    for r in got:
        assert "error" not in r, r
        assert [e["verified"] for e in r["epochs"]] == [True, True], r
        assert [e["rows"] for e in r["epochs"]] == [50_000, 50_000]
        assert r["peak_rss_bytes"] > 0 and r["shuffle"]
    text = md.read_text()
    assert "STALE" not in text and "## Other\n\nkept" in text and "gpuload (default)" in text
    text = readme.read_text()
    assert text.startswith("intro\n<!-- peers:start -->\nConsumer") and text.endswith("<!-- peers:end -->\nrest\n")
    assert "STALE" not in text and "caution" in text


@pytest.mark.parametrize("n", [1, 255, 257, 1000, 5000])
@pytest.mark.parametrize("kind", ["rows", "blocks"])
def test_the_shuffled_ideals_give_every_row_once_in_the_promised_order(tmp_path, n, kind):
    """bench_cpu's hand-written ideals: every row once (list values with their rows), cut into full
    batches but the last; rows leave neither their window of whole chunks nor, for blocks, their
    run of consecutive rows of one chunk; another seed, another order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from bench_cpu import ideal_blocks, ideal_shuffled, write_npy

    lens = np.arange(n) % 3
    hist = pa.array([list(range(10 * i, 10 * i + k)) for i, k in enumerate(lens)], pa.list_(pa.int64()))
    pq.write_table(pa.table({"label": np.arange(n), "history": hist}), tmp_path / "a.parquet")
    cols, chunk, block, window, bs = {"label": "label", "history": "history"}, 64, 16, 150, 32

    def epoch(seed):
        if kind == "rows":
            write_npy([tmp_path / "a.parquet"], cols, tmp_path / "npy")
            return list(ideal_shuffled(tmp_path / "npy", cols, bs, window, seed, chunk_rows=chunk))
        write_npy([tmp_path / "a.parquet"], cols, tmp_path / "npy", permute_chunks=chunk)
        return list(ideal_blocks(tmp_path / "npy", cols, bs, window, block, seed, chunk_rows=chunk))

    batches = epoch(1)
    assert [len(b["label"]) for b in batches[:-1]] == [bs] * (len(batches) - 1) and 0 < len(batches[-1]["label"]) <= bs
    ids = np.concatenate([b["label"].numpy() for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(n))
    for b in batches:  # each row's list came with it
        values, offsets = (t.numpy() for t in b["history"])
        for i, row in enumerate(b["label"].numpy()):
            assert values[offsets[i]:offsets[i + 1]].tolist() == list(range(10 * row, 10 * row + lens[row]))
    per = max(1, round(window / chunk)) * chunk  # a window's rows at most: whole chunks
    chunk_of = ids // chunk
    start = 0
    while start < n:  # a window: the rows of a set of whole chunks, together
        owned = set()
        stop = start
        while stop < n and (len(owned | {chunk_of[stop]}) <= per // chunk):
            owned.add(chunk_of[stop])
            stop += 1
        have = sorted(ids[start:stop].tolist())
        assert have == sorted(r for c in owned for r in range(c * chunk, min(c * chunk + chunk, n)))
        start = stop
    if kind == "blocks":  # stored rows come in runs of a block (a chunk's rows permuted once, at caching)
        stored = np.load(tmp_path / "npy" / "label.npy")
        where = np.argsort(stored)[ids]  # each delivered row's place in the stored file
        runs = np.split(where, np.flatnonzero(np.diff(where) != 1) + 1)
        assert all(r[0] % block == 0 and ((r[-1] + 1) % block == 0 or r[-1] + 1 == n) for r in runs)
        if n > chunk:
            assert not np.array_equal(stored, np.arange(n))  # permuted within its chunks
    if n > 2 * block:
        assert not np.array_equal(ids, np.concatenate([b["label"].numpy() for b in epoch(2)]))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_the_cpu_of_the_benchmarks_reaped_processes_is_its_own_not_others():
    """What says whether a run was quiet: a child that burns CPU and is reaped counts as the
    benchmark's own, so the others' share stays what the rest of the machine used."""
    import subprocess
    import sys

    from bench_cpu import OtherCPU

    other = OtherCPU().start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"],
                   check=True)
    other.stop()
    assert other.ours >= 0.5 and other.others is not None and other.steal >= 0
    assert other.busy >= other.ours - 0.1  # the machine's busy time holds the child's
    assert "other processes used" in other.text() and f"benchmark's own used {other.ours:.0f} s" in other.text()


@pytest.mark.slow
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch has one intra-op thread here by default")
def test_a_loader_that_sets_torch_threads_on_its_thread_leaves_the_consumers_alone(tmp_path):
    """torchdata.nodes' thread workers call torch.set_num_threads(1). Where the training thread had not
    run torch yet, that made the 'default threads' consumer's copies single-threaded, and its rows
    measured a 1-thread consumer. The runner's training thread fixes its threads first, as a script
    that builds its model first does."""
    import subprocess
    import sys

    script = tmp_path / "peer.py"
    script.write_text(
        "import sys, threading, torch\n"
        f"sys.path[:0] = [{str(BENCH / 'peers')!r}]\n"
        "from common import Peer, main\n"
        "class P(Peer):\n"
        "    name = 'sets threads'\n"
        "    def epoch(self, e):\n"
        "        t = threading.Thread(target=torch.set_num_threads, args=(1,)); t.start(); t.join()\n"
        "        yield {'row_id': torch.arange(self.args.rows)}\n"
        "main(P, 'a loader')\n")
    out = subprocess.run([sys.executable, str(script), "--data", str(tmp_path), "--work", str(tmp_path), "--rows",
                          "10", "--threads", "default", "--epochs", "1", "--step-ms", "0"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    # the default a fresh process gets here (not this worker's: an earlier test's process may differ)
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True, timeout=120).stdout
    if int(default) < 2:
        pytest.skip(f"a fresh process here gets one torch thread (affinity {sorted(os.sched_getaffinity(0))}, "
                    f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}): nothing to test")
    assert json.loads(out.splitlines()[-1])["torch_threads"] == int(default)
