"""A table with every type gpuload supports, and the exact values its batches must hold.

``every_type(n, seed)`` returns the Arrow table to write and an :class:`Expected`: for
every output of :data:`COLUMNS` (with :data:`FILL` and :data:`DTYPES`), what each row
must hold, computed from the NumPy data the table was built from (as pyarrow writes
and reads it back), never by gpuload's own conversion. So a test can check any batch,
on any device, in any order, row by row: :meth:`Expected.check`.

The table has nulls to fill in scalars, lists and fixed-size lists, NaNs, the full
range of unsigned integers, negative dates, timestamps with and without a time zone,
durations and times, dictionary-encoded numbers, ragged lists with null lists and null
elements, a stacked group of three types, and casts (float16, float32 and bfloat16 of
float64 data with NaNs of both signs, widening integers).
:data:`NATIVE` leaves out the outputs that libcudf cannot decode to the CPU path's bytes
(float16, which it reads as strings), so a GPU decode of it falls back for no chunk.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gpuload.batch import Ragged

from conftest import ARROW_READS_NULL_FIXED_LISTS

DAY_MS = 86_400_000

COLUMNS = {
    "row_id": "row_id", "b": "b", "i8": "i8", "i16": "i16", "i32": "i32", "i64": "i64",
    "u8": "u8", "u16": "u16", "u32": "u32", "u64": "u64", "f16": "f16", "f32": "f32", "f64": "f64",
    "d32": "d32", "d64": "d64", "ts_s": "ts_s", "ts_ms_ny": "ts_ms_ny", "ts_us": "ts_us", "ts_ns": "ts_ns",
    "dur_us": "dur_us", "t32": "t32", "t64": "t64", "cat": "cat", "catf": "catf",
    "hist": "hist", "lf": "lf", "emb": "emb", "dense": ["f32", "i8", "u16"],
    "half": "g64", "brain": "h64", "single": "k64", "wide": "i16w",
}
FILL = {"b": True, "i32": -7, "f64": -1.0, "d32": 0, "ts_us": 0, "hist": 0, "emb": 7.5}
DTYPES = {"dense": "float32", "half": "float16", "brain": torch.bfloat16, "single": "float32", "wide": "int64",
          "lf": "float16"}
QUIET_NAN = {np.dtype(np.float16): 0x7E00, np.dtype(np.float32): 0x7FC00000}  # what a cast NaN becomes
NATIVE = {k: v for k, v in COLUMNS.items() if k not in ("f16", "lf")}
BFLOAT16_OUTPUTS = {"brain"}


class Expected:
    """Per output, what every row (by ``row_id``) must hold: ``arrays[name]`` is ``[n]`` or
    ``[n, k]`` in the output dtype (bfloat16: int16 bit patterns); ``ragged[name]`` is
    (lengths, starts, values)."""

    def __init__(self, arrays: dict, ragged: dict):
        self.arrays, self.ragged = arrays, ragged
        self.n = len(arrays["row_id"])

    def check(self, batch: dict, outputs) -> np.ndarray:
        """Assert that ``batch`` (torch tensors on any device) holds exactly the expected
        values of ``outputs`` for its rows, bit for bit; returns its row ids."""
        assert set(batch) == set(outputs), (sorted(batch), sorted(outputs))
        ids = batch["row_id"].cpu().numpy()
        for name in outputs:
            got = batch[name]
            if name in self.ragged:
                lengths, starts, values = self.ragged[name]
                assert isinstance(got, Ragged), name
                off, vals = got.offsets.cpu().numpy(), got.values.cpu().numpy()
                assert off.dtype == np.int64 and off[0] == 0, name
                assert np.array_equal(np.diff(off), lengths[ids]), name
                lens = lengths[ids]
                firsts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
                want = values[np.repeat(starts[ids] - firsts, lens) + np.arange(lens.sum())]
                assert vals.dtype == want.dtype and vals.tobytes() == want.tobytes(), name
                continue
            if name in BFLOAT16_OUTPUTS:
                assert got.dtype == torch.bfloat16, name
                got = got.view(torch.int16)
            arr = got.cpu().numpy()
            want = self.arrays[name][ids]
            assert arr.dtype == want.dtype and arr.shape == want.shape, (name, arr.dtype, want.dtype)
            assert arr.tobytes() == want.tobytes(), name  # bit for bit, NaNs included
        return ids


def _masked(rng, n: int, p: float) -> np.ndarray:
    return rng.random(n) < p


def _with_nans(v: np.ndarray, every: int) -> np.ndarray:
    """``v`` with NaNs and negative NaNs (sign bit set) sprinkled in."""
    v[::every] = np.nan
    v[1::every] = -np.nan
    return v


def _cast(v: np.ndarray, dtype) -> np.ndarray:
    """``v.astype(dtype)`` with every NaN as the positive quiet NaN of ``dtype`` (gpuload's rule)."""
    out = v.astype(dtype)
    out.view(f"u{out.itemsize}")[np.isnan(v)] = QUIET_NAN[out.dtype]
    return out


def _ragged(rng, n: int, values_of, null_rows=None, null_elems: float = 0.0, fill=0):
    """(pa array, (lengths, starts, values) expected) of a list column."""
    lengths = rng.integers(0, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = values_of(int(offsets[-1]))
    elem_null = _masked(rng, len(flat), null_elems)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, mask=elem_null if null_elems else None),
                                   mask=None if null_rows is None else pa.array(null_rows))
    want = np.where(elem_null, flat.dtype.type(fill), flat)
    exp_len = lengths if null_rows is None else np.where(null_rows, 0, lengths)
    return arr, (exp_len.astype(np.int64), offsets[:-1].astype(np.int64), want)


def every_type(n: int, seed: int = 0, first_id: int = 0) -> tuple[pa.Table, Expected]:
    """A table of ``n`` rows (``row_id`` from ``first_id``) and the values gpuload must give."""
    rng = np.random.default_rng(seed)
    cols, exp, rag = {}, {}, {}

    def plain(name, values, mask=None, fill=None, arrow_type=None, expect=None):
        cols[name] = pa.array(values, type=arrow_type, mask=mask)
        e = values if expect is None else expect
        exp[name] = e if mask is None else np.where(mask, e.dtype.type(fill), e)

    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    plain("row_id", ids)
    plain("b", rng.random(n) < 0.5, _masked(rng, n, 0.1), True)
    for bits in (8, 16, 32, 64):
        for kind in ("i", "u"):
            dt = np.dtype(f"{kind}{bits // 8}")
            info = np.iinfo(dt)
            v = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
            name = f"{kind}{bits}"
            if name == "i32":
                plain(name, v, _masked(rng, n, 0.1), -7)
            else:
                plain(name, v)
    f16 = rng.standard_normal(n).astype(np.float16)
    f16[::97] = np.nan
    plain("f16", f16)
    f32 = rng.standard_normal(n).astype(np.float32)
    f32[::89] = np.nan
    plain("f32", f32)
    f64 = rng.standard_normal(n) * 1e6
    f64[::83] = -np.inf
    plain("f64", f64, _masked(rng, n, 0.1), -1.0)
    days = rng.integers(-30_000, 30_000, n).astype(np.int32)
    plain("d32", days, _masked(rng, n, 0.05), 0, pa.date32(), days.astype(np.int64))
    d64 = rng.integers(-30_000, 30_000, n)
    plain("d64", d64 * DAY_MS, None, None, pa.date64(), d64)  # Parquet stores whole days
    secs = rng.integers(-2**33, 2**33, n)
    plain("ts_s", secs, None, None, pa.timestamp("s"), secs * 1000)  # Parquet keeps milliseconds
    ms = rng.integers(-2**42, 2**42, n)
    plain("ts_ms_ny", ms, None, None, pa.timestamp("ms", tz="America/New_York"))  # UTC, zone dropped
    us = rng.integers(-2**52, 2**52, n)
    plain("ts_us", us, _masked(rng, n, 0.1), 0, pa.timestamp("us", tz="UTC"))
    ns = rng.integers(-2**62, 2**62, n)
    plain("ts_ns", ns, None, None, pa.timestamp("ns"))
    dur = rng.integers(-2**50, 2**50, n)
    plain("dur_us", dur, None, None, pa.duration("us"))
    t32 = rng.integers(0, DAY_MS, n).astype(np.int32)
    plain("t32", t32, None, None, pa.time32("ms"), t32.astype(np.int64))
    t64 = rng.integers(0, DAY_MS * 1000, n)
    plain("t64", t64, None, None, pa.time64("us"))
    cat = rng.integers(0, 40, n) * 1_000_003
    cols["cat"] = pa.array(cat).dictionary_encode()
    exp["cat"] = cat
    catf = (rng.integers(0, 30, n) / 8).astype(np.float32)
    cols["catf"] = pa.array(catf).dictionary_encode()
    exp["catf"] = catf
    cols["hist"], rag["hist"] = _ragged(rng, n, lambda m: rng.integers(-10**12, 10**12, m),
                                        null_rows=_masked(rng, n, 0.1), null_elems=0.05, fill=0)
    lf, (lens, starts, vals) = _ragged(rng, n, lambda m: _with_nans(rng.standard_normal(m) * 100, 53))
    cols["lf"], rag["lf"] = lf, (lens, starts, _cast(vals, np.float16))
    emb = rng.standard_normal((n, 4)).astype(np.float32)
    # pyarrow before 26 cannot read fixed-size lists with null rows (tests/test_decode.py checks what it says)
    null_emb = _masked(rng, n, 0.1 if ARROW_READS_NULL_FIXED_LISTS else 0.0)
    cols["emb"] = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), 4, mask=pa.array(null_emb))
    exp["emb"] = np.where(null_emb[:, None], np.float32(7.5), emb)
    exp["dense"] = np.stack([exp["f32"], exp["i8"].astype(np.float32), exp["u16"].astype(np.float32)], axis=1)
    g64 = _with_nans(rng.standard_normal(n) * 1e3, 71)
    plain("g64", g64)
    exp["half"] = _cast(g64, np.float16)
    h64 = _with_nans(rng.standard_normal(n) * 1e3, 67)
    plain("h64", h64)
    brain = torch.from_numpy(h64).to(torch.bfloat16).view(torch.int16).numpy()
    brain[np.isnan(h64)] = 0x7FC0  # one NaN pattern for bfloat16 too
    exp["brain"] = brain
    k64 = _with_nans(rng.standard_normal(n) * 1e30, 61)
    plain("k64", k64)
    exp["single"] = _cast(k64, np.float32)
    i16w = rng.integers(-2**15, 2**15, n).astype(np.int16)
    plain("i16w", i16w)
    exp["wide"] = i16w.astype(np.int64)
    for k in ("g64", "h64", "k64", "i16w"):
        del exp[k]
    return pa.table(cols), Expected(exp, rag)


def write_every_type(folder, files: int = 3, rows: int = 8_000, row_group_size: int = 1_500, seed: int = 0):
    """``files`` Parquet files of :func:`every_type` in ``folder``; returns the merged :class:`Expected`."""
    from conftest import write_parquet

    parts = []
    for i in range(files):
        table, e = every_type(rows, seed + i, first_id=i * rows)
        write_parquet(folder / f"part-{i}.parquet", table, row_group_size=row_group_size)
        parts.append(e)
    arrays = {k: np.concatenate([p.arrays[k] for p in parts]) for k in parts[0].arrays}
    ragged = {}
    for k in parts[0].ragged:
        lens = np.concatenate([p.ragged[k][0] for p in parts])
        values, starts, base = [], [], 0
        for p in parts:
            starts.append(p.ragged[k][1] + base)
            values.append(p.ragged[k][2])
            base += len(p.ragged[k][2])
        ragged[k] = (lens, np.concatenate(starts), np.concatenate(values))
    return Expected(arrays, ragged)


# -- a smaller table of the common kinds (the GPU tests' original case) ------------------------

def rich_table(n: int, seed: int = 0) -> pa.Table:
    """Every supported kind: scalars, nulls to fill, bool, uint, dictionary, temporals, lists."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    hist = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, offsets[-1])),
                                    mask=pa.array(rng.random(n) < 0.05))
    emb = pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(n * 4).astype(np.float32)), 4)
    f = rng.standard_normal(n)
    return pa.table({
        "row_id": pa.array(np.arange(n, dtype=np.int64)),
        "f64": pa.array(f, mask=rng.random(n) < 0.1),
        "f32": pa.array(rng.standard_normal(n).astype(np.float32)),
        "flag": pa.array(rng.random(n) < 0.5),
        "u16": pa.array(rng.integers(0, 60000, n).astype(np.uint16)),
        "i8": pa.array(rng.integers(-100, 100, n).astype(np.int8)),
        "cat": pa.array(rng.integers(0, 50, n)).dictionary_encode(),
        "day": pa.array(rng.integers(0, 20000, n).astype(np.int32), type=pa.date32()),
        "ts": pa.array(rng.integers(0, 2**40, n), type=pa.timestamp("us", tz="UTC")),
        "hist": hist,
        "emb": emb,
    })


RICH_COLUMNS = {"row_id": "row_id", "f64": "f64", "f32": "f32", "flag": "flag", "u16": "u16", "i8": "i8", "cat": "cat",
            "day": "day", "ts": "ts", "hist": "hist", "emb": "emb", "dense": ["f32", "i8"]}
RICH_FILL = {"f64": -1.0, "hist": 0}
