"""Categorical columns: strings and bytes become int64 ids, the same on the CPU and the GPU.

Two encoders: :class:`Hash` (ids from the value alone) and :class:`Vocab` (ids from a
vocabulary counted once over the column: :class:`gpuload.vocabulary.Vocabulary`,
:mod:`gpuload.counting`), or a vocabulary given whole (``Vocabulary.of``).

:class:`Hash` turns each value of a string, large_string, binary, large_binary,
fixed_size_binary or dictionary<string> column (or of the values of a ``list<string>``)
into an id computed from the value's bytes alone, so every process, rank, node, restart
and device gives the same id without a shared vocabulary:

* ``h = XXH64(bytes, seed)``: the standard 64-bit xxHash of the value's UTF-8 (or raw)
  bytes, what the ``xxhash`` package's ``xxh64_intdigest(value, seed)`` and libcudf's
  ``xxhash_64`` compute;
* with ``buckets=B``: ``id = 1 + h % B``, in ``1..B``; without: ``h`` read as a signed
  int64 (two's complement);
* a null (a null value, or a null element of a list) gets id **0** either way, so an
  ``nn.Embedding(B + 1, dim, padding_idx=0)`` holds every id. (Without ``buckets`` a value
  whose hash is exactly 0 shares that id: a chance of 2**-64 per distinct value.)

The CPU computes XXH64 with NumPy over whole Arrow arrays (:func:`xxh64`: every value at
once, one pass per 32-byte stripe of the longest value); a dictionary-encoded column
hashes its dictionary once. The GPU path hashes with libcudf and maps the hashes to ids
with the same :func:`ids_from_hashes`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .errors import ConfigError

__all__ = ["Hash", "Vocab", "xxh64", "ids_from_hashes", "hash_ids", "hashable", "parse_key", "encoder_from_json"]

_M = (1 << 64) - 1
P1, P2, P3, P4, P5 = (np.uint64(11400714785074694791), np.uint64(14029467366897019727),
                      np.uint64(1609587929392839161), np.uint64(9650029242287828579),
                      np.uint64(2870177450012600261))


def _whole(v, what: str, low: int, high: int | None = None, none: bool = False):
    """``v`` as an int in ``low..high`` (None where ``none``), else a ConfigError naming ``what``."""
    if v is None and none:
        return None
    if isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) and low <= int(v) and (
            high is None or int(v) <= high):
        return int(v)
    raise ConfigError(f"{what}={v!r}): give a whole number from {low}" + (f" to {high}" if high else " up") +
                      (", or None" if none else ""))


@dataclass(frozen=True)
class Hash:
    """Hashed ids for a string or binary column: ``1 + XXH64(value, seed) % buckets``, null 0.

    Parameters
    ----------
    buckets : number of ids for values (ids ``1..buckets``; 0 is null), at least 1; None
        (default): the full 64-bit hash as int64.
    seed : XXH64 seed, ``0 <= seed < 2**64`` (default 0).
    """

    buckets: int | None = None
    seed: int = 0

    def __post_init__(self):  # NumPy integers are whole numbers too
        object.__setattr__(self, "buckets", _whole(self.buckets, "Hash(buckets", 1, 2**63 - 1, none=True))
        object.__setattr__(self, "seed", _whole(self.seed, "Hash(seed", 0, _M))

    def as_json(self) -> dict:
        """How the ``gpuload`` command's ``--categorical`` takes it: ``{"buckets": N}`` (and ``"seed"``)."""
        return {"buckets": self.buckets, **({"seed": self.seed} if self.seed else {})}

    @classmethod
    def from_json(cls, value, what: str) -> "Hash":
        """The Hash of ``--categorical``'s value for a column (:func:`encoder_from_json`'s Hash forms)."""
        enc = encoder_from_json(value, what)
        if not isinstance(enc, cls):
            raise ConfigError(f"{what}: a vocabulary where a Hash was asked for: give a number of buckets, null, or "
                              f"{{\"buckets\": N, \"seed\": S}}")
        return enc

    @property
    def key(self) -> str:
        """How the cache key and chunk headers name this encoder: ``"xxh64:<seed>:<buckets or 0>"``."""
        return f"xxh64:{self.seed}:{self.buckets or 0}"


@dataclass(frozen=True)
class Vocab:
    """Ids from a vocabulary counted over the column: the values seen at least ``min_count``
    times, ordered by count (most frequent first), then by their bytes; id ``i + 1`` for the
    ``i``-th, **0** for a null or a value not in the vocabulary (out of vocabulary).

    Counted once per source (only that column's bytes are read; remote: only its ranges),
    kept in the cache beside the chunks and read from there by every later open, rank and
    process (:meth:`gpuload.ParquetDataset.vocabulary` returns it). A vocabulary larger than
    ``max_size`` is refused, naming the ``min_count`` that would fit.

    Parameters
    ----------
    min_count : values seen fewer times are out of vocabulary (default 1).
    max_size : the most values the vocabulary may hold (default None: no limit).
    """

    min_count: int = 1
    max_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "min_count", _whole(self.min_count, "Vocab(min_count", 1))
        object.__setattr__(self, "max_size", _whole(self.max_size, "Vocab(max_size", 1, 2**31 - 2, none=True))

    def as_json(self) -> dict:
        """How ``--categorical`` takes it: ``{"min_count": N, "max_size": M}``."""
        return {"min_count": self.min_count, "max_size": self.max_size}

    @property
    def key(self) -> str:
        """The encoder's name without the counted vocabulary's digest: ``"vocab:<min_count>:<max_size or 0>"``."""
        return f"vocab:{self.min_count}:{self.max_size or 0}"


def parse_key(key: str) -> Hash | Vocab:
    """The :class:`Hash` or :class:`Vocab` a ``key`` names (a vocabulary's digest, if any, ignored)."""
    kind, a, b, *_ = key.split(":")
    if kind == "xxh64":
        return Hash(int(b) or None, int(a))
    if kind == "vocab":
        return Vocab(int(a), int(b) or None)
    raise ValueError(f"unknown categorical encoder {key!r}")


def encoder_from_json(value, what: str) -> Hash | Vocab:
    """``--categorical``'s value for a column: a number of hash buckets, null (the 64-bit hash),
    ``{"buckets": N, "seed": S}``, ``"vocab"`` or ``{"min_count": N, "max_size": M}``."""
    if value == "vocab":
        return Vocab()
    if isinstance(value, dict) and value and set(value) <= {"min_count", "max_size"}:
        return Vocab(value.get("min_count", 1), value.get("max_size"))
    if isinstance(value, dict) and value and set(value) <= {"buckets", "seed"}:
        return Hash(value.get("buckets"), value.get("seed", 0))
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return Hash(value)
    raise ConfigError(f"{what}: give a number of buckets (hashed ids), null (the 64-bit hash), "
                      f"{{\"buckets\": N, \"seed\": S}}, \"vocab\" or {{\"min_count\": N, \"max_size\": M}}")


def hashable(t: pa.DataType) -> bool:
    """Whether :class:`Hash` takes values of Arrow type ``t``."""
    if pa.types.is_dictionary(t):
        return hashable(t.value_type)
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
            or getattr(pa.types, "is_string_view", lambda _: False)(t)
            or getattr(pa.types, "is_binary_view", lambda _: False)(t))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    return _rotl(acc + lane * P2, 31) * P1


def _words(buf: np.ndarray, size: int) -> np.ndarray:
    """Unaligned little-endian words of ``size`` bytes at every byte offset of ``buf``
    (``buf`` padded: the last ``size - 1`` bytes start no word)."""
    return np.ndarray((len(buf) - size + 1,), dtype=f"<u{size}", buffer=buf, offset=0, strides=(1,))


LONG = 4096  # bytes: longer values are hashed one by one (the xxhash package's XXH64, the same function)


def xxh64(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seed: int = 0) -> np.ndarray:
    """XXH64 of each value ``data[starts[i]:starts[i] + lengths[i]]`` (uint8 ``data``): uint64.

    Every value at once: one NumPy pass per 32-byte stripe of the longest value (over the
    values that long), then at most seven for the tails, and the final mix. Values longer
    than ``LONG`` bytes (blobs, rare in categorical columns) are hashed one call each.
    """
    n = len(starts)
    lengths = np.asarray(lengths, np.int64)
    long_values = np.flatnonzero(lengths > LONG)
    if long_values.size:  # a few long values: one call each (the same XXH64) rather than a pass per stripe
        import xxhash

        h = xxh64(data, np.where(lengths > LONG, 0, starts), np.where(lengths > LONG, 0, lengths), seed)
        raw = memoryview(np.ascontiguousarray(data))
        for i in long_values:
            h[i] = xxhash.xxh64_intdigest(raw[starts[i]:starts[i] + lengths[i]], seed)
        return h
    buf = np.zeros(len(data) + 8, np.uint8)  # padded: an 8-byte word can be read at any offset of data
    buf[:len(data)] = data
    w64, w32 = _words(buf, 8), _words(buf, 4)
    pos = np.asarray(starts, np.int64).copy()
    h = np.empty(n, np.uint64)
    stripes = lengths // 32
    long = np.flatnonzero(stripes)
    h[stripes == 0] = np.uint64((seed + int(P5)) & _M)
    if long.size:
        order = np.argsort(-stripes[long], kind="stable")  # longest first: the active ones are a prefix
        long, count = long[order], stripes[long][order]
        v = [np.full(long.size, (seed + a) & _M, np.uint64)
             for a in (int(P1) + int(P2), int(P2), 0, -int(P1))]
        p = pos[long]
        active = np.searchsorted(-count, -np.arange(1, int(count[0]) + 1), side="right")  # values with > k stripes
        for m in active:
            at = p[:m]
            for j in range(4):
                v[j][:m] = _round(v[j][:m], w64[at + 8 * j])
            p[:m] += 32
        acc = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
        for lane in v:
            acc = (acc ^ _round(np.zeros_like(lane), lane)) * P1 + P4
        h[long], pos[long] = acc, p
    h += lengths.astype(np.uint64)
    rest = lengths % 32
    for j in range(3):  # 8-byte words
        sel = np.flatnonzero(rest >= 8 * (j + 1))
        if not sel.size:
            break
        k = _round(np.zeros(sel.size, np.uint64), w64[pos[sel]])
        h[sel] = _rotl(h[sel] ^ k, 27) * P1 + P4
        pos[sel] += 8
    sel = np.flatnonzero(rest % 8 >= 4)  # a 4-byte word
    if sel.size:
        h[sel] = _rotl(h[sel] ^ (w32[pos[sel]].astype(np.uint64) * P1), 23) * P2 + P3
        pos[sel] += 4
    for j in range(3):  # single bytes
        sel = np.flatnonzero(rest % 4 > j)
        if not sel.size:
            break
        h[sel] = _rotl(h[sel] ^ (buf[pos[sel]].astype(np.uint64) * P5), 11) * P1
        pos[sel] += 1
    h ^= h >> np.uint64(33)
    h *= P2
    h ^= h >> np.uint64(29)
    h *= P3
    h ^= h >> np.uint64(32)
    return h


def ids_from_hashes(h, valid, buckets: int | None):
    """int64 ids from uint64 hashes ``h`` (NumPy or CuPy): ``1 + h % buckets``, or ``h`` as
    int64 without ``buckets``; 0 where ``valid`` (a boolean array, or None: all valid) is False.
    Always new memory."""
    ids = (h % h.dtype.type(buckets)).astype(np.int64) + 1 if buckets else h.view(np.int64).copy()
    if valid is not None:
        ids[~valid] = 0
    return ids


def _valid(arr: pa.Array) -> np.ndarray | None:
    return None if arr.null_count == 0 else np.asarray(arr.is_valid())


def _through_dictionary(arr: pa.Array, ids_of) -> np.ndarray:
    """Ids of a dictionary array: ``ids_of`` its dictionary (each distinct value once), taken by
    its indices; a null index is id 0."""
    ids = ids_of(arr.dictionary)
    out = ids[arr.indices.fill_null(0).to_numpy(zero_copy_only=False)] if len(ids) else np.zeros(len(arr), np.int64)
    valid = _valid(arr)
    if valid is not None:
        out[~valid] = 0
    return out


def hash_ids(arr: pa.Array, enc: Hash) -> np.ndarray:
    """int64 ids of a flat Arrow array of a :func:`hashable` type (see the module's rules)."""
    t = arr.type
    if pa.types.is_dictionary(t):  # each distinct value hashed once
        return _through_dictionary(arr, lambda values: hash_ids(values, enc))
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)):
        arr = arr.cast(pa.large_binary())  # string_view / binary_view
        t = arr.type
    n = len(arr)
    if pa.types.is_fixed_size_binary(t):
        _, data_buf = arr.buffers()
        width = t.byte_width
        starts = (np.arange(n, dtype=np.int64) + arr.offset) * width
        lengths = np.full(n, width, np.int64)
    else:
        _, off_buf, data_buf = arr.buffers()
        wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        off = np.frombuffer(off_buf, np.int64 if wide else np.int32,  # count: a buffer may be padded past it
                            count=arr.offset + n + 1)[arr.offset:].astype(np.int64)
        starts, lengths = off[:-1], np.diff(off)
    lo, hi = (int(starts[0]), int(starts[-1] + lengths[-1])) if n else (0, 0)
    data = np.frombuffer(data_buf, np.uint8)[lo:hi] if data_buf is not None else np.zeros(0, np.uint8)
    starts = starts - lo  # only the bytes of this slice are copied
    return ids_from_hashes(xxh64(data, starts, lengths, enc.seed), _valid(arr), enc.buckets)
