"""Categorical ids: every id against the ``xxhash`` package's XXH64, value by value; the
settings refused clearly; the cache key follows the encoder; the command's --categorical."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

import gpuload
import gpuload.categorical
from gpuload.categorical import Hash, hash_ids, ids_from_hashes, parse_key, xxh64

from conftest import ARROW_READS_NULL_FIXED_LISTS, open_dataset, write_parquet

SEEDS = [0, 1, 2**63 + 12345, 2**64 - 1]


def reference(values, enc: Hash) -> np.ndarray:
    """Ids computed value by value: 0 for None, else 1 + XXH64 % buckets (or the hash as int64)."""
    out = []
    for v in values:
        if v is None:
            out.append(0)
            continue
        h = xxhash.xxh64_intdigest(v.encode() if isinstance(v, str) else v, enc.seed)
        out.append(1 + h % enc.buckets if enc.buckets else h - (1 << 64) * (h >= 1 << 63))
    return np.array(out, np.int64)


def _random_bytes(rng, lengths):
    return [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in lengths]


@pytest.mark.parametrize("long", [4096, 10**9])  # values over `long` bytes: one call each, or vectorised too
@pytest.mark.parametrize("seed", SEEDS)
def test_xxh64_matches_the_reference_at_every_length_around_each_step(seed, long, monkeypatch):
    """Lengths 0..130 cover every tail (8-, 4- and 1-byte steps) with 0 to 4 stripes; a few long ones too."""
    monkeypatch.setattr(gpuload.categorical, "LONG", long)
    rng = np.random.default_rng(seed % 1000)
    values = _random_bytes(rng, list(range(131)) * 2 + [255, 256, 257, 1000, 4096, 4097, 20000])
    data = np.frombuffer(b"".join(values), np.uint8)
    lengths = np.array([len(v) for v in values], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    got = xxh64(data, starts, lengths, seed)
    assert got.tolist() == [xxhash.xxh64_intdigest(v, seed) for v in values]


@pytest.mark.parametrize("buckets", [None, 1, 7, 2**22])
@pytest.mark.parametrize("kind", ["string", "large_string", "binary", "large_binary", "dictionary", "view"])
def test_ids_of_every_string_type_with_nulls_and_slices(kind, buckets):
    rng = np.random.default_rng(3)
    words = [f"{x:x}" * int(k) for x, k in zip(rng.integers(0, 2**40, 3000), rng.integers(0, 9, 3000))]
    values = [None if i % 13 == 0 else w for i, w in enumerate(words)]
    if kind in ("binary", "large_binary"):
        values = [None if v is None else v.encode() for v in values]
    typ = {"string": pa.string(), "large_string": pa.large_string(), "binary": pa.binary(),
           "large_binary": pa.large_binary(), "dictionary": pa.string(), "view": pa.string()}[kind]
    arr = pa.array(values, typ)
    if kind == "dictionary":
        arr = arr.dictionary_encode()
    if kind == "view":
        if not hasattr(pa, "string_view"):
            pytest.skip("this pyarrow has no string_view")
        arr = arr.cast(pa.string_view())
    enc = Hash(buckets, seed=99)
    want = reference(values, enc)
    assert hash_ids(arr, enc).tolist() == want.tolist()
    assert hash_ids(arr.slice(1000, 777), enc).tolist() == want[1000:1777].tolist()  # an offset into the buffers
    assert hash_ids(arr.slice(5, 0), enc).tolist() == []


def test_fixed_size_binary_and_a_dictionary_with_null_values_and_null_indices():
    fixed = pa.array([b"abcd", None, b"\x00\x00\x00\x00", b"wxyz"], pa.binary(4))
    assert hash_ids(fixed.slice(1), Hash(100)).tolist() == reference([None, b"\x00" * 4, b"wxyz"], Hash(100)).tolist()
    dictionary = pa.DictionaryArray.from_arrays(pa.array([0, 1, None, 2, 0], pa.int8()), pa.array(["a", None, "c"]))
    assert hash_ids(dictionary, Hash(5)).tolist() == reference(["a", None, None, "c", "a"], Hash(5)).tolist()
    nothing = pa.array([None, None], pa.string())
    assert hash_ids(nothing, Hash()).tolist() == [0, 0]


def test_ids_from_hashes_maps_buckets_and_nulls_in_new_memory():
    h = np.array([0, 5, 2**64 - 1, 2**63], np.uint64)
    valid = np.array([True, True, False, True])
    assert ids_from_hashes(h, valid, 5).tolist() == [1, 1, 0, 1 + 2**63 % 5]
    full = ids_from_hashes(h, None, None)
    assert full.tolist() == [0, 5, -1, -(2**63)] and not np.shares_memory(full, h)


def test_hash_settings_are_checked_and_named():
    for bad in (dict(buckets=0), dict(buckets=-3), dict(buckets=2.5), dict(buckets=True), dict(buckets=2**63)):
        with pytest.raises(gpuload.ConfigError, match=r"Hash\(buckets="):
            Hash(**bad)
    for bad in (-1, 2**64, 1.0):
        with pytest.raises(gpuload.ConfigError, match=r"Hash\(seed="):
            Hash(seed=bad)
    for enc in (Hash(), Hash(10), Hash(2**22, seed=2**64 - 1)):
        assert parse_key(enc.key) == enc
        assert Hash.from_json(enc.as_json(), "x") == enc
    assert Hash.from_json(None, "x") == Hash() and Hash.from_json(12, "x") == Hash(12)
    with pytest.raises(gpuload.ConfigError, match="give a number of buckets"):
        Hash.from_json("many", "--categorical")


# -- through a dataset -----------------------------------------------------------------------
N = 6000


def _table(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**32, N)
    c1 = [None if i % 17 == 0 else f"{x:08x}" for i, x in enumerate(ids)]
    c2 = [None if i % 5 == 0 else ("DE", "FR", "US", "ü-ñ")[i % 4] for i in range(N)]
    items = [None if i % 11 == 0 else [None if (i + j) % 7 == 0 else f"item{(i * j) % 50}" for j in range(i % 5)]
             for i in range(N)]
    pairs = [None if i % 9 == 0 and ARROW_READS_NULL_FIXED_LISTS else [f"a{i % 3}", f"b{i % 4}"] for i in range(N)]
    table = pa.table({"row_id": np.arange(N), "C1": pa.array(c1), "C2": pa.array(c2).dictionary_encode(),
                      "items": pa.array(items, pa.list_(pa.string())), "pair": pa.array(pairs, pa.list_(pa.string(), 2)),
                      "x": rng.random(N)})
    return table, {"C1": c1, "C2": c2, "items": items, "pair": pairs}


CATEGORICAL = {"C1": Hash(2**20), "C2": Hash(10, seed=7), "items": Hash(64), "pair": Hash(1000)}


@pytest.fixture(scope="module")
def strings(tmp_path_factory):
    folder = tmp_path_factory.mktemp("strings")
    table, values = _table()
    for k in range(3):
        write_parquet(folder / f"part-{k}.parquet", table.slice(k * 2000, 2000), row_group_size=500)
    return folder, values


def _epoch(ds):
    batches = list(ds)
    order = np.concatenate([b["row_id"].numpy() for b in batches])
    return batches, order


def test_every_id_of_a_shuffled_epoch_equals_the_reference(strings, tmp_path):
    folder, values = strings
    columns = {"row_id": "row_id", "C1": "C1", "cats": ["C1", "C2"], "items": "items", "pair": "pair", "x": "x"}
    ds = open_dataset(folder, columns, tmp_path / "c", categorical=CATEGORICAL, batch_size=700)
    for epoch in (0, 1):  # built, then read from the cache
        ds.set_epoch(epoch)
        batches, order = _epoch(ds)
        assert sorted(order.tolist()) == list(range(N))
        c1 = reference(values["C1"], CATEGORICAL["C1"])[order]
        c2 = reference(values["C2"], CATEGORICAL["C2"])[order]
        assert np.array_equal(np.concatenate([b["C1"].numpy() for b in batches]), c1)
        assert np.array_equal(np.concatenate([b["cats"].numpy() for b in batches]), np.stack([c1, c2], 1))
        pair = np.concatenate([b["pair"].numpy() for b in batches])
        want_pair = [[0, 0] if values["pair"][i] is None else reference(values["pair"][i], CATEGORICAL["pair"])
                     for i in order]
        assert np.array_equal(pair, np.array(want_pair, np.int64))  # a null row: a row of the null id
        items = [b["items"].values[b["items"].offsets[i]:b["items"].offsets[i + 1]].tolist()
                 for b in batches for i in range(len(b["items"].offsets) - 1)]
        want = [[] if values["items"][i] is None else reference(values["items"][i], CATEGORICAL["items"]).tolist()
                for i in order]  # a null list is empty; a null element is id 0
        assert items == want
        assert all(b["C1"].dtype == b["items"].values.dtype == __import__("torch").int64 for b in batches)


def test_every_device_gives_the_reference_ids(strings, tmp_path, device_decode):
    """On a GPU: libcudf's XXH64 (decode='gpu') and pyarrow + copies give the reference ids too,
    cold and cached, with a decoder that reports no chunk left to the CPU."""
    device, decode = device_decode
    folder, values = strings
    columns = {"row_id": "row_id", "C1": "C1", "items": "items", "pair": "pair"}
    ds = open_dataset(folder, columns, tmp_path / "c", categorical={c: CATEGORICAL[c] for c in ("C1", "items", "pair")},
                      batch_size=1000, device=device, decode=decode)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = [{k: (v.values.cpu(), v.offsets.cpu()) if isinstance(v, gpuload.Ragged) else v.cpu()
                    for k, v in b.items()} for b in ds]
        order = np.concatenate([b["row_id"].numpy() for b in batches])
        assert sorted(order.tolist()) == list(range(N))
        want = reference(values["C1"], CATEGORICAL["C1"])[order]
        assert np.array_equal(np.concatenate([b["C1"].numpy() for b in batches]), want)
        flat = np.concatenate([b["items"][0].numpy() for b in batches])
        want_items = [e for i in order for e in reference(values["items"][i] or [], CATEGORICAL["items"]).tolist()]
        assert flat.tolist() == want_items
    assert getattr(ds.reader.decode, "fallbacks", 0) == 0


def test_one_hash_for_every_string_column_and_columns_none(strings, tmp_path):
    folder, values = strings
    ds = open_dataset(folder, None, tmp_path / "c", categorical=Hash(100), shuffle=False, batch_size=N)
    (batch,) = list(ds)
    assert set(batch) == {"row_id", "C1", "C2", "items", "pair", "x"}
    assert batch["C2"].numpy().tolist() == reference(values["C2"], Hash(100)).tolist()
    assert batch["x"].dtype == __import__("torch").float64  # numbers keep their values
    plain = open_dataset(folder, ["C1"], tmp_path / "c2", shuffle=False, batch_size=N)  # no categorical=: Hash()
    assert next(iter(plain))["C1"].numpy().tolist() == reference(values["C1"], Hash()).tolist()


def test_the_cache_key_follows_the_encoder(strings, tmp_path):
    folder, values = strings
    cache, keys = tmp_path / "c", []
    for enc in (Hash(100), Hash(101), Hash(100, seed=1), Hash(100)):
        ds = open_dataset(folder, ["C1"], cache, categorical={"C1": enc}, shuffle=False, batch_size=N)
        assert next(iter(ds))["C1"].numpy().tolist() == reference(values["C1"], enc).tolist()
        keys.append((ds.reader.spec_hash, ds.reader.counters.decoded))
    assert len({k for k, _ in keys}) == 3 and keys[3][0] == keys[0][0]  # each encoder its own column set
    assert keys[3][1] == 0  # the same encoder again: every chunk read from the cache


def test_bad_categorical_settings_are_refused_naming_what_to_do(strings, tmp_path):
    folder, _ = strings
    cases = [
        (dict(categorical={"x": Hash(10)}), r"categorical=\{'x': Hash\(buckets=10, seed=0\)\}: column 'x' is double; "
                                            r"a Hash takes strings"),
        (dict(categorical={"nope": Hash(10)}), r"categorical= names columns that are not loaded: \['nope'\]"),
        (dict(categorical={"C1": 10}), r"give a gpuload.Hash\(buckets=..., seed=...\), a gpuload.Vocab\(.*\) or a gpuload.Vocabulary"),
        (dict(categorical=[Hash()]), r"categorical= must be a gpuload.Hash, a gpuload.Vocab or a dict"),
        (dict(fill_nulls={"C1": 0}), r"fill_nulls=\{'C1': 0\}: column 'C1' becomes categorical ids, where a null "
                                     r"gets id 0"),
        (dict(dtypes={"C1": "int32"}), r"column 'C1' gets 64-bit hash ids \(negative ones too\) \(categorical=\{'C1': "
                                       r"Hash\(buckets=None, seed=0\)\}\), which int32 cannot hold exactly: give the column "
                                       r"buckets"),
        (dict(dtypes={"C1": "uint64"}), r"64-bit hash ids \(negative ones too\).* which uint64 cannot hold"),
        (dict(dtypes={"C1": "int16"}, categorical={"C1": Hash(40_000)}), r"ids up to 40,000 .* which int16 cannot hold "
                                                                         r"exactly: choose fewer buckets"),
        (dict(dtypes={"C1": "float16"}, categorical={"C1": Hash(4096)}), r"ids up to 4,096 .* which float16 cannot"),
        (dict(columns={"g": ["C1", "x"]}), r"which output 'g' \(float64, stacked with 'x'\) cannot hold exactly"),
    ]
    for kw, match in cases:
        with pytest.raises(gpuload.ConfigError, match=match):
            open_dataset(folder, kw.pop("columns", ["C1", "x"]), tmp_path / "c", **kw)
    for dtype, enc in (("float16", Hash(2048)), ("float32", Hash(2**24)), ("uint64", Hash(10))):  # these fit
        ds = open_dataset(folder, ["C1"], tmp_path / "c", dtypes={"C1": dtype}, categorical={"C1": enc}, shuffle=False,
                          batch_size=N)
        assert next(iter(ds))["C1"].numpy().astype(np.int64).tolist() == reference(_table()[1]["C1"], enc).tolist()
    ds = open_dataset(folder, ["C1"], tmp_path / "c", dtypes={"C1": "int16"}, categorical={"C1": Hash(30_000)},
                      shuffle=False, batch_size=N, fill_nulls=0)  # one fill for all: ids keep 0 for nulls
    batch = next(iter(ds))
    assert batch["C1"].dtype == __import__("torch").int16 and int(batch["C1"].max()) <= 30_000


def test_files_that_store_strings_as_string_large_string_or_binary_load_together(tmp_path):
    values = ["a", None, "bc", "é"]
    write_parquet(tmp_path / "d" / "0.parquet", pa.table({"k": pa.array(values, pa.string())}))
    write_parquet(tmp_path / "d" / "1.parquet", pa.table({"k": pa.array(values, pa.large_string())}))
    write_parquet(tmp_path / "d" / "2.parquet", pa.table({"k": pa.array([None if v is None else v.encode()
                                                                           for v in values], pa.binary())}))
    lists = [["x", None], None, [], ["é"]]
    for k, typ in enumerate([pa.list_(pa.string()), pa.large_list(pa.large_string()), pa.list_(pa.binary())]):
        path = tmp_path / "d" / f"{k}.parquet"
        write_parquet(path, pa.table({**pq.read_table(path).to_pydict(),
                                      "l": pa.array([None if v is None else [None if e is None else
                                                     (e.encode() if typ == pa.list_(pa.binary()) else e) for e in v]
                                                     for v in lists], typ)}))
    ds = open_dataset(tmp_path / "d", ["k", "l"], tmp_path / "c", categorical={"k": Hash(50), "l": Hash(9)},
                      shuffle=False, batch_size=12)
    batch = next(iter(ds))
    assert batch["k"].numpy().tolist() == reference(values, Hash(50)).tolist() * 3
    assert batch["l"].values.numpy().tolist() == reference(["x", None, "é"], Hash(9)).tolist() * 3


def test_the_command_takes_categorical(strings, tmp_path, capsys):
    from gpuload.tools.flags import categorical

    assert categorical("4096") == Hash(4096)
    assert categorical(json.dumps({"C1": 10, "C2": None, "items": {"buckets": 5, "seed": 3}})) == {
        "C1": Hash(10), "C2": Hash(), "items": Hash(5, 3)}
    for bad in ("many", "[1]", '{"C1": "x"}', "0"):
        with pytest.raises(gpuload.ConfigError, match="--categorical"):
            categorical(bad)
    from gpuload.tools.cli import main

    folder, _ = strings
    rc = main(["cache", "build", str(folder), "--cache-dir", str(tmp_path / "c"), "--columns", "C1,x",
               "--categorical", '{"x": 10}'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("gpuload: error: --categorical '{\"x\": {\"buckets\": 10}}'")
    assert main(["cache", "build", str(folder), "--cache-dir", str(tmp_path / "c"), "--columns", "C1,x",
                 "--categorical", '{"C1": 10}']) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "C1 (int64, ids of Hash(buckets=10))" in capsys.readouterr().out  # the column set says its encoder
