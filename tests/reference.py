"""The sources the dataset, pipeline and reader tests share, and pyarrow's values for them.

* ``click_data`` (3 click-log files, 20,000 rows, 1000-row row groups: 21 chunks) and
  ``mixed_data`` (files of different row-group sizes, 0-row files among them), for a module's
  ``click`` and ``mixed`` fixtures: each a :class:`Data`, its folder, columns and
  :class:`Reference`; ``Data.open(cache, **kw)`` opens it (``conftest.open_dataset``);
* :class:`Reference`: expected outputs, computed with pyarrow alone; ``check(batch)`` asserts a
  batch holds exactly those values and returns its row_ids;
* ``same_batches(a, b)``: two epochs' batches are equal, dtype and values.

CPU only, small data: tens of thousands of rows in 64 KiB chunks (tens of chunks).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from gpuload.batch import Ragged
from gpuload.synth import clicklog_columns, write_clicklog

from conftest import open_dataset

DENSE, SPARSE = 4, 3
# single-column outputs of one dtype share a row-major block in the default layout (row_id and
# cat_0; dense_0 and dense_1; g1 and g2), beside stacked groups and lists
CLICK_COLUMNS = {**clicklog_columns(DENSE, SPARSE), "row_id": "row_id", "cat_0": "cat_0", "dense_0": "dense_0",
                 "dense_1": "dense_1"}
MIXED_COLUMNS = {"row_id": "row_id", "x": "x", "g": ["g1", "g2"], "h": "h", "g1": "g1", "g2": "g2"}
CHUNK_BYTES = 64 << 10


def _np(t):
    return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class Reference:
    """Expected outputs, computed with pyarrow alone, looked up by ``row_id``."""

    def __init__(self, table: pa.Table, columns: dict):
        self.table = table
        self.n = table.num_rows
        row_id = table["row_id"].to_numpy()
        self.pos = np.full(int(row_id.max()) + 1 if self.n else 1, -1, dtype=np.int64)
        self.pos[row_id] = np.arange(self.n)
        self.outputs = {}
        for name, src in columns.items():
            if isinstance(src, list):
                self.outputs[name] = ("dense", np.stack([table[c].to_numpy() for c in src], axis=1))
                continue
            col = table[src].combine_chunks()
            if pa.types.is_list(col.type):
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
                off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
                self.outputs[name] = ("ragged", (lengths, off, pc.list_flatten(col).to_numpy()))
            else:
                self.outputs[name] = ("dense", col.to_numpy())

    def check(self, batch: dict) -> np.ndarray:
        """Assert every output of ``batch`` equals pyarrow's values; returns the row_ids."""
        assert set(batch) == set(self.outputs)
        ids = _np(batch["row_id"])
        assert ids.dtype == np.int64 and ids.ndim == 1
        idx = self.pos[ids]
        assert (idx >= 0).all(), "unknown row_id"
        for name, (kind, want) in self.outputs.items():
            got = batch[name]
            if kind == "dense":
                assert isinstance(got, torch.Tensor) and got.device.type == "cpu", name
                assert got.is_contiguous(), name  # in both layouts
                g = _np(got)
                assert g.dtype == want.dtype, (name, g.dtype, want.dtype)
                assert g.shape == (len(ids),) + want.shape[1:], name
                np.testing.assert_array_equal(g, want[idx], err_msg=name)
            else:
                lengths, off, values = want
                assert isinstance(got, Ragged), name
                assert isinstance(got.offsets, torch.Tensor) and isinstance(got.values, torch.Tensor)
                o, v = _np(got.offsets), _np(got.values)
                assert o.dtype == np.int64, name
                assert o.shape == (len(ids) + 1,) and o[0] == 0, name
                assert v.dtype == values.dtype and v.ndim == 1 and len(v) == o[-1], name
                np.testing.assert_array_equal(np.diff(o), lengths[idx], err_msg=name)
                expect = (np.concatenate([values[off[i]:off[i + 1]] for i in idx]) if len(idx)
                          else values[:0])
                np.testing.assert_array_equal(v, expect, err_msg=name)
        return ids


class Data:
    def __init__(self, source, columns, ref):
        self.source, self.columns, self.ref = source, columns, ref

    def open(self, cache, **kw):
        kw.setdefault("batch_size", 997)
        kw.setdefault("chunk_bytes", CHUNK_BYTES)
        if kw.get("shuffle") == "block":
            kw.setdefault("block_rows", 64)  # chunks hold ~1000 rows here: many blocks per window
        return open_dataset(self.source, self.columns, cache, **kw)


def read_all(paths) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(map(str, paths))])


def click_data(tmp_path_factory) -> Data:
    """3 click-log files, 20,000 rows, 1000-row row groups: 21 chunks."""
    d = tmp_path_factory.mktemp("click")
    files = write_clicklog(d, rows=20_000, files=3, row_group_rows=1000, dense=DENSE, sparse=SPARSE,
                           list_max=5, seed=3)
    return Data(d, CLICK_COLUMNS, Reference(read_all(files), CLICK_COLUMNS))


MIXED_SCHEMA = pa.schema([("row_id", pa.int64()), ("x", pa.float64()), ("g1", pa.int32()), ("g2", pa.int32()),
                          ("h", pa.list_(pa.int32()))])


def _mixed_table(start, n, seed):
    rng = np.random.default_rng(seed)
    ids = np.arange(start, start + n, dtype=np.int64)
    lengths = rng.integers(0, 9, n)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table({
        "row_id": ids,
        "x": rng.standard_normal(n),
        "g1": rng.integers(-1000, 1000, n).astype(np.int32),
        "g2": (ids * 7 % 1001).astype(np.int32),
        "h": pa.ListArray.from_arrays(pa.array(off), pa.array(rng.integers(0, 10**6, int(off[-1])).astype(np.int32))),
    }, schema=MIXED_SCHEMA)


def mixed_data(tmp_path_factory) -> Data:
    """Files of different row-group sizes, with 0-row files first and in the middle."""
    d = tmp_path_factory.mktemp("mixed")
    layout = [("00-empty.parquet", 0, 1000), ("01-a.parquet", 3000, 500), ("02-empty.parquet", 0, 64),
              ("03-b.parquet", 4111, 1300), ("04-c.parquet", 2777, 10_000), ("05-d.parquet", 1, 1)]
    start = 0
    for i, (name, n, rg) in enumerate(layout):
        pq.write_table(_mixed_table(start, n, i), d / name, row_group_size=rg)
        start += n
    table = read_all(sorted(d.glob("*.parquet")))
    assert table.num_rows == start
    return Data(d, MIXED_COLUMNS, Reference(table, MIXED_COLUMNS))


def same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert list(x) == list(y)
        for k in x:
            if isinstance(x[k], Ragged):
                assert torch.equal(x[k].offsets, y[k].offsets), (i, k)
                assert torch.equal(x[k].values, y[k].values), (i, k)
            else:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (i, k)
