"""The demo's hand-written loop takes as many steps as gpuload: batches of batch_size rows across
file ends, every row once, in file order."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

import gpuload
from gpuload.synth import clicklog_columns, write_clicklog
from gpuload.tools.demo import naive_batches


def test_the_naive_loop_cuts_batches_across_file_ends_as_gpuload_does(tmp_path):
    """A helper's trial: the loop cut each file on its own, so every file ended with a short batch
    and the loop took more (simulated) steps than gpuload: 8 against 1 at 1,000 rows in batches of
    5,000, which the demo's 'vs naive' figure counted against it."""
    write_clicklog(tmp_path / "d", rows=2500, files=3)
    files = sorted((tmp_path / "d").glob("*.parquet"))
    sizes = [pq.ParquetFile(f).metadata.num_rows for f in files]
    assert len(set(sizes)) > 1 or sizes[0] % 512  # file ends fall inside batches
    cols = {**clicklog_columns(), "row_id": "row_id"}
    batches = list(naive_batches(files, 512, cols))
    assert [len(b["row_id"]) for b in batches] == [512] * 4 + [2500 - 4 * 512]
    ids = np.concatenate([b["row_id"].numpy() for b in batches])
    want = np.concatenate([pq.read_table(f, columns=["row_id"])["row_id"].to_numpy() for f in files])
    assert np.array_equal(ids, want)  # every row once, in file order
    history = np.concatenate([b["history"].values.numpy() for b in batches])
    assert np.array_equal(history, np.concatenate([np.concatenate(pq.read_table(f, columns=["history"])["history"]
                                                                  .to_pylist()) for f in files]))
    assert set(batches[0]) == set(cols)
    ds = gpuload.ParquetDataset(files, cols, batch_size=512, shuffle=False, cache_dir=tmp_path / "c",
                                device="cpu")
    assert len(batches) == len(ds)
