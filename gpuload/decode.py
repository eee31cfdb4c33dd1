"""Decode: read one chunk's row groups from Parquet and convert them.

A decoder turns a :class:`~gpuload.plan.Chunk` of a :class:`~gpuload.source.SourceFile`
into a column set (see :mod:`gpuload.convert`). The CPU decoder uses pyarrow; the GPU
decoder (cuDF) returns the same column set in device memory, behind the same call.
"""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .convert import needed_columns, table_to_columns
from .errors import SourceError
from .plan import Chunk
from .schema import OutputSpec
from .source import SourceFile

__all__ = ["ArrowDecoder"]


class ArrowDecoder:
    """CPU decoder: pyarrow reads the row groups, :func:`table_to_columns` converts.

    Each call reads only the chunk's row groups and selected columns, on the calling
    thread (pyarrow's own thread pool is not used: gpuload runs several chunks at once).
    """

    name = "cpu"

    def __call__(self, f: SourceFile, chunk: Chunk, specs: Sequence[OutputSpec]) -> dict:
        where = f"{f.path} (row groups {chunk.rg_start}-{chunk.rg_stop - 1})"
        if not f.stat_matches():
            raise SourceError(f"{f.path} changed or disappeared after the dataset was opened; "
                              "open the dataset again to pick up the new file")
        try:
            pf = pq.ParquetFile(f.path, metadata=f.metadata)
            table = pf.read_row_groups(range(chunk.rg_start, chunk.rg_stop),
                                       columns=needed_columns(specs), use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{where}: cannot be read ({e}); the file may be truncated or corrupt") from None
        if table.num_rows != chunk.rows:
            raise SourceError(f"{where}: read {table.num_rows} rows where the footer promises {chunk.rows}")
        return table_to_columns(table, specs, where)
