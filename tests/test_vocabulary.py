"""Vocabularies (gpuload/vocabulary.py): given whole (Vocabulary.of, or one dataset's handed to
another) a column takes exactly their ids; the cache follows the vocabulary; bad ones are refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import gpuload
import gpuload.vocabulary
from gpuload import Vocabulary

from conftest import open_dataset, write_parquet


@pytest.fixture
def source(tmp_path):
    names = ["de", "fr", None, "jp", "xx", "fr", "de", "de"] * 100
    tags = [["a", "b"], [], None, ["b", "zz"]] * 200
    write_parquet(tmp_path / "d" / "p.parquet", pa.table({"row_id": np.arange(800), "country": names, "tags": tags}),
                  row_group_size=128)
    return tmp_path / "d", names, tags


def _rows(ds, *cols):
    got = {c: [] for c in ("row_id", *cols)}
    for b in ds:
        got["row_id"].append(b["row_id"].numpy())
        for c in cols:
            v = b[c]
            if isinstance(v, gpuload.Ragged):
                off, vals = v.offsets.numpy(), v.values.numpy()
                got[c].extend(vals[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1))
            else:
                got[c].append(v.numpy())
    order = np.argsort(np.concatenate(got["row_id"]))
    return {c: (np.concatenate(v)[order] if c == "row_id" or not isinstance(v[0], list) else [v[i] for i in order])
            for c, v in got.items()}


def test_a_given_vocabulary_gives_exactly_its_ids_to_scalars_and_lists(source, tmp_path):
    path, names, tags = source
    voc = Vocabulary.of(["jp", "de", b"fr"])  # str and bytes alike
    tag_voc = Vocabulary.of(["b", "a"])
    ds = open_dataset(path, ["row_id", "country", "tags"], tmp_path / "c", batch_size=100,
                      categorical={"country": voc, "tags": tag_voc})
    got = _rows(ds, "country", "tags")
    ids = {"jp": 1, "de": 2, "fr": 3}
    assert got["country"].tolist() == [ids.get(n, 0) for n in names]  # null and "xx": 0
    assert got["tags"] == [[{"b": 1, "a": 2}.get(t, 0) for t in (row or [])] for row in tags]
    assert ds.vocabulary("country") is voc and voc.to_dict() == {"jp": 1, "de": 2, "fr": 3}
    assert voc.ids(["de", "nope"]).tolist() == [2, 0]
    assert repr(voc) == "Vocabulary(3 values, given)"  # not "Vocab(min_count=1...)": it was not counted


def test_the_cache_follows_the_vocabulary_and_a_fresh_process_registers_it_again(source, tmp_path):
    path, names, _ = source
    cache = tmp_path / "c"
    first = _rows(open_dataset(path, ["row_id", "country"], cache, categorical={"country": Vocabulary.of(["de"])}),
                  "country")
    other = Vocabulary.of(["fr", "de"])
    gpuload.vocabulary._REGISTERED.clear()  # as in a new process (a Dask worker) that unpickled the settings
    ds = open_dataset(path, ["row_id", "country"], cache, categorical={"country": other})
    second = _rows(ds, "country")
    assert first["country"].tolist() == [1 if n == "de" else 0 for n in names]
    assert second["country"].tolist() == [{"fr": 1, "de": 2}.get(n, 0) for n in names]  # not the cached chunks
    ds.reader.cache.flush()
    assert ds.reader.counters.decoded == 1 and len(list(cache.rglob("*.glc"))) == 2  # a chunk file per vocabulary


@pytest.mark.parametrize("values, said", [([], "no values"), (["a", "b", "a"], r"'a' is values\[0\] and values\[2\]"),
                                          (["a", 3], r"values\[1\] is 3"), (["a", None], r"values\[1\] is None"),
                                          ("DE", r"Vocabulary.of\('DE'\): give a list of values, e.g. "
                                                 r"Vocabulary.of\(\['DE'\]\)"), (b"DE", r"of\(\[b'DE'\]\)")])
def test_bad_vocabularies_are_refused(values, said):
    with pytest.raises(gpuload.ConfigError, match=said):
        Vocabulary.of(values)


def test_ids_of_a_bare_value_is_refused():
    """Not looked up character by character (every id 0, one per character)."""
    voc = Vocabulary.of(["DE", "FR"])
    with pytest.raises(gpuload.ConfigError, match=r"Vocabulary.ids\('FR'\): give a list of values, e.g. ids\(\['FR'\]\)"):
        voc.ids("FR")
    assert voc.ids(["FR"]).tolist() == [2]


def test_a_vocabulary_on_a_numeric_column_is_refused_naming_it(source, tmp_path):
    path, _, _ = source
    with pytest.raises(gpuload.ConfigError, match="column 'row_id' is int64"):
        open_dataset(path, ["row_id"], tmp_path / "c", categorical={"row_id": Vocabulary.of(["a"])})
