"""The GPU decoder's choice of chunks for the CPU, made before any read (:func:`check_gpu_columns`):
runs on any machine (it imports nothing of the GPU stack)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import gpuload
from gpuload.gpu.cudf_decode import Unsupported
from gpuload.gpu.decoder import check_gpu_columns

from conftest import write_parquet


def test_a_column_narrower_in_the_file_than_it_is_read_goes_to_the_cpu_before_cudf_decodes_it(tmp_path):
    """Files whose types drift (int32 here, int64 there) and a fill value only the output's type holds:
    libcudf would read the file's type, which cudf_decode refuses only after decoding the chunk (a
    review saw each such chunk decoded twice); the columns stored as they are read pass."""
    write_parquet(tmp_path / "a.parquet", {"x": np.arange(3, dtype=np.int32), "n": pa.array([1, None, 3], pa.int8()),
                                          "l": pa.array([[1], None, [2, 3]], pa.list_(pa.int16())),
                                          "y": np.arange(3, dtype=np.float32)})
    write_parquet(tmp_path / "b.parquet", {"x": np.arange(3, dtype=np.int64), "n": pa.array([4, 5, None], pa.int8()),
                                          "l": pa.array([[4], [5], None], pa.list_(pa.int16())),
                                          "y": np.arange(3, dtype=np.float32)})
    ds = gpuload.ParquetDataset(tmp_path, ["x", "y"], batch_size=3, cache_dir=tmp_path / "c", device="cpu")
    a, b = ds.reader.files
    with pytest.raises(Unsupported, match="column 'x' is narrower in this file than the <i8 it is read in"):
        check_gpu_columns(a, ds.reader.specs)
    check_gpu_columns(b, ds.reader.specs)  # int64 as read
    for columns in (["n"], ["l"]):
        ds = gpuload.ParquetDataset(tmp_path, columns, batch_size=3, cache_dir=tmp_path / "c", device="cpu",
                                    fill_nulls={columns[0]: 70000}, dtypes={columns[0]: "int32"})
        for f in ds.reader.files:
            with pytest.raises(Unsupported, match=f"column '{columns[0]}' is narrower in this file than the <i4"):
                check_gpu_columns(f, ds.reader.specs)
    ds = gpuload.ParquetDataset(tmp_path, ["y"], batch_size=3, cache_dir=tmp_path / "c", device="cpu",
                                dtypes={"y": "float16"})  # a cast after the read, as cuDF's path does it too
    for f in ds.reader.files:
        check_gpu_columns(f, ds.reader.specs)
