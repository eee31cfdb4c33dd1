"""Synthetic click-log Parquet data for demos, tests, notebooks and benchmarks.

A recommender-style log: a binary label that depends on ``dense_0`` (so a model
can learn it), positive float features, Zipf-like categorical ids (heavy head,
long tail) and a variable-length ``history`` list of ids. :func:`write_criteo` writes
the raw Criteo click logs' layout instead: 13 integer counts and 26 hexadecimal string
categoricals, both with missing values.
"""

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["write_clicklog", "clicklog_columns", "write_criteo", "criteo_columns"]

#: Exclusive upper bound of every categorical and history id.
ID_BOUND = 100_000


def clicklog_columns(dense: int = 13, sparse: int = 8) -> dict:
    """Return the recommended ``columns=`` grouping for :func:`write_clicklog` data.

    Parameters
    ----------
    dense, sparse : int, default 13 and 8
        Numbers of ``dense_*`` and ``cat_*`` columns, as in :func:`write_clicklog`.

    Returns
    -------
    dict
        ``{"dense": [...], "sparse": [...], "label": "label", "history": "history"}``.
        A list value groups columns into one 2-D array; a str value is one column
        delivered under the key's name.
    """
    return {
        "dense": [f"dense_{i}" for i in range(dense)],
        "sparse": [f"cat_{i}" for i in range(sparse)],
        "label": "label",
        "history": "history",
    }


def _schema(dense: int, sparse: int) -> pa.Schema:
    fields = [pa.field("row_id", pa.int64()), pa.field("label", pa.int8())]
    fields += [pa.field(f"dense_{i}", pa.float32()) for i in range(dense)]
    fields += [pa.field(f"cat_{i}", pa.int64()) for i in range(sparse)]
    fields.append(pa.field("history", pa.list_(pa.int64())))
    return pa.schema(fields)


def _ids(rng: np.random.Generator, n: int, perm: np.ndarray) -> np.ndarray:
    """``n`` Zipf-like ids in ``[0, ID_BOUND)``: rank ``k`` has probability about
    ``1 / ((k + 1) ln ID_BOUND)`` (a log-uniform draw, far faster than
    ``Generator.zipf``); ``perm`` maps ranks to ids, so hot ids differ per column."""
    u = rng.random(n, dtype=np.float32)
    ranks = np.exp(u * np.float32(np.log(ID_BOUND))).astype(np.int32) - 1
    np.minimum(ranks, ID_BOUND - 1, out=ranks)  # float32 rounding may reach it
    return perm[ranks]


def _block(rng, schema, perms, start, n, dense, list_max) -> pa.Table:
    """Generate one row group: rows ``start .. start + n - 1``."""
    cols = [np.arange(start, start + n, dtype=np.int64)]
    feats = rng.lognormal(0.0, 1.0, size=(dense, n)).astype(np.float32)
    # label = [log(dense_0) + noise > t]; t is the 75th percentile of that sum,
    # so about 25% of labels are 1 and they rise with dense_0.
    signal = np.log(feats[0]) if dense else np.zeros(n, np.float32)
    threshold = 0.6745 * np.sqrt(2.0 if dense else 1.0)
    cols.append((signal + rng.standard_normal(n) > threshold).astype(np.int8))
    cols += list(feats)
    cols += [_ids(rng, n, perm) for perm in perms[:-1]]
    lengths = rng.integers(0, list_max + 1, n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(_ids(rng, int(offsets[-1]), perms[-1]), pa.int64())
    arrays = [pa.array(c) for c in cols]
    arrays.append(pa.ListArray.from_arrays(pa.array(offsets), values))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_clicklog(path, rows: int = 1_000_000, *, files: int = 4,
                   row_group_rows: int = 65_536, dense: int = 13, sparse: int = 8,
                   list_max: int = 20, seed: int = 0,
                   compression: str = "snappy") -> list[pathlib.Path]:
    """Write a synthetic click log as ``files`` Parquet files in directory ``path``.

    Rows are split as evenly as possible across ``part-00000.parquet``,
    ``part-00001.parquet``, ... (earlier files get the extra rows). Memory is
    bounded by one row group: data are generated one row group at a time.

    Columns: ``row_id`` int64 (0 .. rows-1, unique, in file order); ``label`` int8
    (0/1, about 25% ones, increasing with ``dense_0``); ``dense_0`` ..
    ``dense_{dense-1}`` float32 (lognormal, positive, median 1.0); ``cat_0`` ..
    ``cat_{sparse-1}`` int64 (Zipf-like ids in [0, 100_000)); ``history``
    list<int64> (0 .. ``list_max`` ids in [0, 100_000) per row, uniform length).

    Parameters
    ----------
    path : str or os.PathLike
        Output directory; created (with parents) if missing. Existing
        ``part-*.parquet`` files of the same names are overwritten.
    rows : int, default 1_000_000
        Total number of rows across all files.
    files : int, default 4
        Number of files; ``1 <= files <= rows``.
    row_group_rows : int, default 65_536
        Rows per Parquet row group (the last one of a file may be shorter).
    dense, sparse : int, default 13 and 8
        Number of float and categorical feature columns.
    list_max : int, default 20
        Maximum ``history`` length, in elements.
    seed : int, default 0
        Seed of the ``numpy.random.PCG64`` generator: equal arguments give
        identical column data.
    compression : str, default "snappy"
        Parquet codec, as accepted by ``pyarrow.parquet.ParquetWriter``.

    Returns
    -------
    list of pathlib.Path
        The written files, in row order.
    """
    if files < 1 or rows < files:
        raise ValueError(f"need 1 <= files <= rows, got files={files}, rows={rows}")
    if row_group_rows < 1 or min(dense, sparse, list_max) < 0:
        raise ValueError("row_group_rows must be >= 1; dense, sparse, list_max >= 0")
    if row_group_rows * list_max >= 2**31:
        raise ValueError("row_group_rows * list_max must be < 2**31 (int32 offsets)")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    schema = _schema(dense, sparse)
    # One rank -> id permutation per cat_* column, and one for history
    perms = [rng.permutation(ID_BOUND) for _ in range(sparse + 1)]
    dict_cols = [f"cat_{i}" for i in range(sparse)]  # the only ones it pays for
    written, start = [], 0
    for i in range(files):
        n = rows // files + (i < rows % files)
        dest = out / f"part-{i:05d}.parquet"
        with pq.ParquetWriter(dest, schema, compression=compression,
                              use_dictionary=dict_cols) as writer:
            for off in range(0, n, row_group_rows):
                m = min(row_group_rows, n - off)
                table = _block(rng, schema, perms, start + off, m, dense, list_max)
                writer.write_table(table, row_group_size=m)
        written.append(dest)
        start += n
    return written


def criteo_columns() -> dict:
    """``columns=`` for :func:`write_criteo` data: ``{"label", "ints": [I1..I13], "cats": [C1..C26]}``
    (with ``categorical=`` the 26 string columns stack into one ``[rows, 26]`` id tensor)."""
    return {"label": "label", "ints": [f"I{i}" for i in range(1, 14)], "cats": [f"C{i}" for i in range(1, 27)]}


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def _hex_strings(ids: np.ndarray, valid: np.ndarray) -> pa.Array:
    """8-character lowercase hexadecimal strings of uint32 ``ids`` (null where not ``valid``)."""
    n = len(ids)
    nibbles = (ids[:, None].astype(np.uint32) >> np.arange(28, -1, -4, dtype=np.uint32)) & 0xF
    data = _HEX[nibbles].reshape(-1)
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    mask = pa.array(valid).buffers()[1] if not valid.all() else None
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data), mask,
                                       int(n - valid.sum()))


def write_criteo(path, rows: int = 1_000_000, *, files: int = 4, row_group_rows: int = 65_536, seed: int = 0,
                 compression: str = "snappy") -> list[pathlib.Path]:
    """Write Criteo-format click logs as ``files`` Parquet files ``part-NNNNN.parquet`` in ``path``.

    Columns: ``row_id`` int64 (0 .. rows-1); ``label`` int8 (about 30% ones, rising with
    ``I1``); ``I1`` .. ``I13`` int32 counts (lognormal, rounded; about 20% null);
    ``C1`` .. ``C26`` strings of 8 hexadecimal digits (Zipf-like over 100,000 values per
    column, as :func:`write_clicklog`'s ids; about 10% null), dictionary-encoded in the file
    as Spark writes them. Memory: one row group at a time; equal arguments give equal data.
    """
    if files < 1 or rows < files or row_group_rows < 1:
        raise ValueError(f"need 1 <= files <= rows and row_group_rows >= 1, got files={files}, rows={rows}")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    perms = [rng.permutation(ID_BOUND) for _ in range(26)]
    codes = rng.integers(0, 2**32, ID_BOUND, dtype=np.uint32)  # the hex value of each id
    fields = [pa.field("row_id", pa.int64()), pa.field("label", pa.int8())]
    fields += [pa.field(f"I{i}", pa.int32()) for i in range(1, 14)] + [pa.field(f"C{i}", pa.string())
                                                                       for i in range(1, 27)]
    schema = pa.schema(fields)
    written, start = [], 0
    for i in range(files):
        n = rows // files + (i < rows % files)
        dest = out / f"part-{i:05d}.parquet"
        with pq.ParquetWriter(dest, schema, compression=compression,
                              use_dictionary=[f"C{k}" for k in range(1, 27)]) as writer:
            for off in range(0, n, row_group_rows):
                m = min(row_group_rows, n - off)
                counts = np.round(rng.lognormal(1.0, 1.5, size=(13, m))).astype(np.int32)
                label = (np.log1p(counts[0]) + rng.standard_normal(m) > 2.2).astype(np.int8)
                arrays = [pa.array(np.arange(start + off, start + off + m, dtype=np.int64)), pa.array(label)]
                arrays += [pa.array(c, mask=rng.random(m) < 0.2) for c in counts]
                arrays += [_hex_strings(codes[_ids(rng, m, perm)], rng.random(m) >= 0.1) for perm in perms]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=m)
        written.append(dest)
        start += n
    return written
