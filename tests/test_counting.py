"""Counted vocabularies (gpuload.Vocab): every id against collections.Counter, counted once
and kept in the cache, shared by concurrent openers, refused past max_size, listed, checked
and cleared by the command."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

import gpuload
import gpuload.counting
from gpuload import Vocab

from conftest import open_dataset, write_parquet

N = 4000


def reference(values_per_row, vocab: Vocab) -> dict:
    """{value bytes: id} by the documented order: count (most first), then bytes; min_count applied."""
    counts = collections.Counter(v.encode() if isinstance(v, str) else v for v in values_per_row if v is not None)
    kept = sorted((v for v, n in counts.items() if n >= vocab.min_count), key=lambda v: (-counts[v], v))
    return {v: i for i, v in enumerate(kept, 1)}


def ids(values, table: dict) -> list:
    return [0 if v is None else table.get(v.encode() if isinstance(v, str) else v, 0) for v in values]


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Three files: Zipf-like words with nulls, stored as plain strings, dictionary strings and binary."""
    folder = tmp_path_factory.mktemp("words")
    rng = np.random.default_rng(4)
    ranks = np.minimum(rng.zipf(1.3, 3 * N), 500)
    words = [None if i % 23 == 0 else f"w{r}" + "é" * (r % 3) for i, r in enumerate(ranks)]
    lists = [None if i % 9 == 0 else [None if (i + j) % 7 == 0 else f"t{(i * j) % 40}" for j in range(i % 4)]
             for i in range(3 * N)]
    for k in range(3):
        part = words[k * N:(k + 1) * N]
        col = pa.array(part)
        if k == 1:
            col = col.dictionary_encode()
        if k == 2:
            col = pa.array([None if w is None else w.encode() for w in part], pa.binary())
        write_parquet(folder / f"part-{k}.parquet", pa.table({"row_id": np.arange(k * N, (k + 1) * N), "w": col,
                                                               "tags": pa.array(lists[k * N:(k + 1) * N],
                                                                                pa.list_(pa.string()))}),
                      row_group_size=700)
    return folder, words, lists


def _rows(ds):
    batches = list(ds)
    order = np.concatenate([b["row_id"].numpy() for b in batches])
    return batches, order


@pytest.mark.parametrize("vocab", [Vocab(), Vocab(min_count=3)])
def test_every_id_equals_the_counter_reference(words, tmp_path, vocab):
    folder, values, lists = words
    ds = open_dataset(folder, ["row_id", "w", "tags"], tmp_path / "c", categorical={"w": vocab, "tags": vocab},
                      batch_size=900)
    want_w = reference(values, vocab)
    want_t = reference([t for row in lists for t in row or []], vocab)
    for epoch in (0, 1):  # built, then read from the cache
        ds.set_epoch(epoch)
        batches, order = _rows(ds)
        assert sorted(order.tolist()) == list(range(3 * N))
        got = np.concatenate([b["w"].numpy() for b in batches])
        assert got.tolist() == ids([values[i] for i in order], want_w)
        flat = np.concatenate([b["tags"].values.numpy() for b in batches]).tolist()
        assert flat == [x for i in order for x in ids(lists[i] or [], want_t)]
    voc = ds.vocabulary("w")
    assert {v.encode(): i for v, i in voc.to_dict().items()} == want_w
    assert voc.counts.tolist() == sorted(voc.counts.tolist(), reverse=True) and len(voc) == len(want_w)
    top = next(iter(want_w))  # the most frequent value: id 1
    assert voc.ids([top.decode(), "never seen", None]).tolist() == [1, 0, 0]
    with pytest.raises(gpuload.ConfigError, match=r"column 'row_id' has no counted vocabulary .* gpuload.Vocab\(\)"):
        ds.vocabulary("row_id")


def test_counted_once_then_read_from_the_cache_until_a_file_changes(words, tmp_path, monkeypatch):
    folder, values, _ = words
    src = tmp_path / "src"
    src.mkdir()
    for p in folder.glob("*.parquet"):
        (src / p.name).write_bytes(p.read_bytes())
    counted = []
    real = gpuload.counting.count_vocabulary
    monkeypatch.setattr(gpuload.counting, "count_vocabulary", lambda *a, **k: counted.append(a[1]) or real(*a, **k))
    first = open_dataset(src, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab()})
    again = open_dataset(src, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab()})
    assert counted == ["w"] and again.reader.spec_hash == first.reader.spec_hash
    open_dataset(src, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab(min_count=2)})
    assert counted == ["w", "w"]  # other settings: another vocabulary
    extra = pa.table({"row_id": np.arange(3 * N, 3 * N + 50), "w": pa.array(["brand new"] * 50),
                      "tags": pa.array([[]] * 50, pa.list_(pa.string()))})
    write_parquet(src / "part-3.parquet", extra)
    grown = open_dataset(src, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab()}, shuffle=False)
    assert counted == ["w", "w", "w"] and grown.reader.spec_hash != first.reader.spec_hash  # new ids, new chunks
    batches, order = _rows(grown)
    table = reference(values + ["brand new"] * 50, Vocab())
    assert np.concatenate([b["w"].numpy() for b in batches]).tolist() == ids((values + ["brand new"] * 50), table)


def test_concurrent_openers_count_once(words, tmp_path, monkeypatch):
    folder, _, _ = words
    counted = []
    real = gpuload.counting.count_vocabulary

    def slow(*a, **k):
        counted.append(a[1])
        time.sleep(0.5)  # the others arrive while this one counts
        return real(*a, **k)

    monkeypatch.setattr(gpuload.counting, "count_vocabulary", slow)
    got, errors = [], []

    def open_one():
        try:
            got.append(open_dataset(folder, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab()}))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == 3 and counted == ["w"]
    assert len({d.vocabulary("w").digest for d in got}) == 1


def test_a_vocabulary_past_max_size_is_refused_naming_the_min_count_that_fits(words, tmp_path, caplog):
    folder, values, _ = words
    counts = collections.Counter(v for v in values if v is not None)
    with pytest.raises(gpuload.ConfigError) as e:
        open_dataset(folder, ["w"], tmp_path / "c", categorical={"w": Vocab(max_size=20)})
    text = str(e.value)
    fits = int(text.split("min_count to ")[1].split(" ")[0])
    assert f"has {len(counts):,} values seen at least 1 times, more than max_size=20" in text
    ds = open_dataset(folder, ["w"], tmp_path / "c", categorical={"w": Vocab(min_count=fits, max_size=20)})
    assert len(ds.vocabulary("w")) == sum(n >= fits for n in counts.values()) <= 20
    with pytest.raises(gpuload.ConfigError, match=r"which int8 cannot hold exactly: raise min_count \(fewer values\)"):
        open_dataset(folder, ["w"], tmp_path / "c", categorical={"w": Vocab()}, dtypes={"w": "int8"})
    with caplog.at_level("WARNING", logger="gpuload"):  # a min_count past every count: every id 0, said
        ds = open_dataset(folder, ["w"], tmp_path / "c", categorical={"w": Vocab(min_count=10**9)})
    assert len(ds.vocabulary("w")) == 0 and set(np.concatenate([b["w"].numpy() for b in ds]).tolist()) == {0}
    assert any("no value of column 'w' is seen 1000000000 times or more: every row's id is 0" in r.getMessage()
               for r in caplog.records)
    even = tmp_path / "even"  # 50 values seen twice each: no min_count keeps 10 of them (one once said 3: none)
    write_parquet(even / "a.parquet", {"w": [f"v{i % 50}" for i in range(100)]})
    with pytest.raises(gpuload.ConfigError) as e:
        open_dataset(even, ["w"], tmp_path / "c", categorical={"w": Vocab(max_size=10)})
    assert "raise max_size to 50 (no min_count keeps at most 10: the 11 most frequent values are each seen 2 " \
        "times), or use gpuload.Hash" in str(e.value) and "min_count to" not in str(e.value)
    for bad in (dict(min_count=0), dict(max_size=0), dict(min_count=1.5)):
        with pytest.raises(gpuload.ConfigError, match=r"Vocab\((min_count|max_size)="):
            Vocab(**bad)


def test_a_corrupt_vocabulary_is_counted_again_and_the_command_lists_checks_and_clears_it(words, tmp_path, capsys):
    from gpuload.tools.cli import main

    folder, values, _ = words
    cache = tmp_path / "c"
    ds = open_dataset(folder, ["w"], cache, categorical={"w": Vocab(min_count=2)})
    digest = ds.vocabulary("w").digest
    (path,) = list(cache.rglob("*.vocab"))
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"  w: {len(ds.vocabulary('w')):,} values; Vocab(min_count=2); over 3 files" in out
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert main(["cache", "verify", "--cache-dir", str(cache)]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    assert main(["cache", "verify", "--delete", "--cache-dir", str(cache)]) == 1 and not path.exists()  # deleted
    assert main(["cache", "verify", "--cache-dir", str(cache)]) == 0
    again = open_dataset(folder, ["w"], cache, categorical={"w": Vocab(min_count=2)})  # counted again, rewritten
    assert again.vocabulary("w").digest == digest and main(["cache", "verify", "--cache-dir", str(cache)]) == 0
    ds.close(), again.close()  # open datasets' column sets (and the vocabularies beside them) would be kept
    assert main(["cache", "clear", "--cache-dir", str(cache)]) == 0
    assert not list(cache.rglob("*.vocab*"))


def test_the_command_builds_with_a_vocabulary(words, tmp_path, capsys):
    from gpuload.tools.cli import main
    from gpuload.tools.flags import categorical

    assert categorical("vocab") == Vocab()
    for bad in ('{"w": {}}', '{"w": {"min_count": 2, "seed": 1}}', '{"w": "count"}'):
        with pytest.raises(gpuload.ConfigError, match=r"--categorical .*\"vocab\" or \{\"min_count\": N"):
            categorical(bad)
    assert categorical('{"w": "vocab", "tags": {"min_count": 2, "max_size": 9}, "x": 5}') == {
        "w": Vocab(), "tags": Vocab(2, 9), "x": gpuload.Hash(5)}
    folder, _, _ = words
    assert main(["cache", "build", str(folder), "--cache-dir", str(tmp_path / "c"), "--columns", "w",
                 "--categorical", '{"w": {"min_count": 2}}']) == 0
    ds = open_dataset(folder, ["w"], tmp_path / "c", categorical={"w": Vocab(min_count=2)})
    assert ds.reader.cached_at_open == set(range(len(ds.reader.chunks)))  # the command's chunks, the same ids


def test_a_hive_string_key_gets_a_vocabulary_too(tmp_path):
    for region, rows in (("eu", 30), ("us", 10), ("apac", 20)):
        write_parquet(tmp_path / "h" / f"region={region}" / "p.parquet", {"x": np.arange(rows)})
    ds = open_dataset(tmp_path / "h", ["x", "region"], tmp_path / "c", categorical={"region": Vocab()},
                      shuffle=False, batch_size=60)
    assert ds.vocabulary("region").to_dict() == {"eu": 1, "apac": 2, "us": 3}
    assert sorted(collections.Counter(next(iter(ds))["region"].tolist()).items()) == [(1, 30), (2, 20), (3, 10)]


def test_every_device_gives_the_counter_ids(words, tmp_path, device_decode):
    """On a GPU the chunks with vocabulary ids are converted on the CPU (the decoder says so): the same ids."""
    device, decode = device_decode
    folder, values, _ = words
    ds = open_dataset(folder, ["row_id", "w"], tmp_path / "c", categorical={"w": Vocab(min_count=2)},
                      device=device, decode=decode, batch_size=1000)
    batches = [{k: v.cpu() for k, v in b.items()} for b in ds]
    order = np.concatenate([b["row_id"].numpy() for b in batches])
    want = ids([values[i] for i in order], reference(values, Vocab(min_count=2)))
    assert np.concatenate([b["w"].numpy() for b in batches]).tolist() == want


def test_lookups_check_the_bytes_not_only_the_hash_and_fall_back_where_hashes_are_shared():
    from gpuload.categorical import Hash, hash_ids
    from gpuload.vocabulary import Vocabulary

    voc = Vocabulary("c", pa.array([b"a", b"b"], pa.large_binary()), np.array([2, 1]), Vocab())
    assert voc.ids(["a", "b", "c", None]).tolist() == [1, 2, 0, 0]
    c_hash = hash_ids(pa.array([b"c"], pa.large_binary()), Hash()).view(np.uint64)
    voc._index = (c_hash, np.array([0]))  # as if "c" shared "a"'s hash: equal hashes, other bytes
    assert voc.ids(["c"]).tolist() == [0]
    voc._index = False  # two values sharing a hash: Arrow's set lookup instead
    assert voc.ids(["a", "b", "c", None]).tolist() == [1, 2, 0, 0]
