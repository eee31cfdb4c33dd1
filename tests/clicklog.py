"""The click-log dataset the cache and fault tests share, and pyarrow's values for it.

* ``clicklog(path)``: 3 files of synthetic click-log Parquet (``DENSE`` float columns,
  ``SPARSE`` int columns, a ``history`` list, a ``label`` and a ``row_id``);
* :class:`Reference`: those files as pyarrow reads them; ``check(batch)`` asserts a batch
  holds exactly pyarrow's values for its row_ids, and ``check_epoch(ds, ref)`` that an
  epoch holds every row exactly once;
* ``sample_cols()`` and ``key_for(cols)``: columns of every storage kind and a chunk key
  that describes them, for writing cache files outside a dataset;
* ``wait_for(path, proc)``: wait for a child process to create a file (it must not die first).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpuload.batch import Ragged
from gpuload.cache.chunkfile import spec_hash
from gpuload.cache.paths import ChunkKey
from gpuload.synth import clicklog_columns, write_clicklog

DENSE, SPARSE = 4, 3
COLUMNS = {**clicklog_columns(DENSE, SPARSE), "row_id": "row_id"}
CHILD_TIMEOUT = 120  # s a child process may take to reach the point a test waits for


def clicklog(path, rows=6_000, files=3, row_group_rows=500, seed=0):
    return write_clicklog(path, rows=rows, files=files, row_group_rows=row_group_rows, dense=DENSE,
                          sparse=SPARSE, list_max=5, seed=seed)


def as_numpy(t):
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


class Reference:
    """The click-log columns as pyarrow reads them, indexed by row_id."""

    def __init__(self, files):
        t = pa.concat_tables([pq.read_table(f) for f in sorted(map(str, files))])
        self.n = t.num_rows
        row_id = t["row_id"].to_numpy()
        self.pos = np.full(row_id.max() + 1 if self.n else 1, -1, dtype=np.int64)
        self.pos[row_id] = np.arange(self.n)
        self.dense = np.stack([t[c].to_numpy() for c in COLUMNS["dense"]], axis=1)
        self.sparse = np.stack([t[c].to_numpy() for c in COLUMNS["sparse"]], axis=1)
        self.label = t["label"].to_numpy()
        h = t["history"].combine_chunks()
        self.h_len = pc.list_value_length(h).to_numpy(zero_copy_only=False).astype(np.int64)
        self.h_off = np.concatenate([[0], np.cumsum(self.h_len)]).astype(np.int64)
        self.h_val = pc.list_flatten(h).to_numpy()

    def check_arrays(self, z) -> None:
        """Assert saved columns (row_id, dense, sparse, label, h_len, h_val) hold pyarrow's values."""
        idx = self.pos[z["row_id"]]
        np.testing.assert_array_equal(z["dense"], self.dense[idx])
        np.testing.assert_array_equal(z["sparse"], self.sparse[idx])
        np.testing.assert_array_equal(z["label"], self.label[idx])
        np.testing.assert_array_equal(z["h_len"], self.h_len[idx])
        np.testing.assert_array_equal(z["h_val"], np.concatenate(
            [self.h_val[self.h_off[i]:self.h_off[i + 1]] for i in idx] or [self.h_val[:0]]))

    def check(self, batch) -> np.ndarray:
        """Assert ``batch`` holds exactly pyarrow's values for its row_ids; returns them."""
        ids = as_numpy(batch["row_id"])
        assert ids.dtype == np.int64
        assert ids.min() >= 0 and ids.max() < len(self.pos)
        idx = self.pos[ids]
        assert (idx >= 0).all()
        dense, sparse, label = as_numpy(batch["dense"]), as_numpy(batch["sparse"]), as_numpy(batch["label"])
        assert dense.dtype == np.float32 and dense.shape == (len(ids), DENSE)
        assert sparse.dtype == np.int64 and sparse.shape == (len(ids), SPARSE)
        assert label.dtype == np.int8 and label.shape == (len(ids),)
        np.testing.assert_array_equal(dense, self.dense[idx])
        np.testing.assert_array_equal(sparse, self.sparse[idx])
        np.testing.assert_array_equal(label, self.label[idx])
        h = batch["history"]
        assert isinstance(h, Ragged)
        off, val = as_numpy(h.offsets), as_numpy(h.values)
        assert off.dtype == np.int64 and len(off) == len(ids) + 1 and off[0] == 0
        np.testing.assert_array_equal(np.diff(off), self.h_len[idx])
        want = (np.concatenate([self.h_val[self.h_off[i]:self.h_off[i + 1]] for i in idx])
                if len(idx) else self.h_val[:0])
        assert len(val) == off[-1]
        np.testing.assert_array_equal(val, want)
        return ids


def check_epoch(ds, ref) -> list:
    """Iterate one epoch; every row exactly once with pyarrow's values. Returns the batches."""
    batches = list(ds)
    assert len(batches) == len(ds)
    ids = np.concatenate([ref.check(b) for b in batches])
    assert len(ids) == ref.n
    assert np.array_equal(np.sort(ids), np.arange(ref.n))
    return batches


def wait_for(path, proc, timeout=CHILD_TIMEOUT):
    t0 = time.monotonic()
    while not os.path.exists(path):
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"child exited early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"child did not create {path}")
        time.sleep(0.01)


def sample_cols(rows=1000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 7, rows)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    wide = rng.standard_normal((rows, 6)).astype(np.float64)
    return {
        "a": rng.integers(-2**40, 2**40, rows).astype(np.int64),
        "b": rng.standard_normal((rows, 3)).astype(np.float32),
        "strided": wide[:, ::2],  # not contiguous
        "flag": rng.random(rows) < 0.3,
        "small": rng.integers(-100, 100, rows).astype(np.int8),
        "h": Ragged(rng.integers(0, 1000, int(off[-1])).astype(np.int32), off),
    }


def key_for(cols) -> ChunkKey:
    """A chunk key whose outputs describe ``cols`` (for writing files outside a dataset)."""
    outputs = []
    for k, v in cols.items():
        if isinstance(v, Ragged):
            outputs.append((k, "ragged", v.values.dtype.str, 1))
        elif v.ndim == 2:
            outputs.append((k, "group", v.dtype.str, v.shape[1]))
        else:
            outputs.append((k, "scalar", v.dtype.str, 1))
    rows = next((len(v.offsets) - 1 if isinstance(v, Ragged) else len(v) for v in cols.values()), 0)
    desc = [{"name": n, "kind": k, "dtype": d, "width": w} for n, k, d, w in outputs]
    return ChunkKey("/x.parquet", 1, 2, spec_hash(desc), 0, 1, rows, tuple(outputs), desc)
