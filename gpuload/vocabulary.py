"""Vocabularies: a column's values in id order, counted (:class:`gpuload.Vocab`,
:mod:`gpuload.counting`) or given (:meth:`Vocabulary.of`, or one dataset's vocabulary handed
to another), and the lookups that turn values into their ids.

A vocabulary's ``digest`` names its contents and is part of the encoder key the chunks made
with it carry (``"vocab:<min_count>:<max_size>:<digest>"``), so chunks made with another
vocabulary are never served. Each process registers the vocabularies its datasets use, by
digest; conversions find them there (:func:`encode_ids`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from .categorical import Hash, Vocab, _through_dictionary, hash_ids, parse_key
from .errors import ConfigError

__all__ = ["Vocabulary", "register", "registered", "vocab_ids", "encode_ids"]


class Vocabulary:
    """The vocabulary of one column: ``values`` (large_binary, the value of id ``i + 1`` at
    ``i``), their ``counts`` (int64; 0 for a vocabulary given whole) and the :class:`Vocab` it
    was counted with; ``digest`` names its contents (part of the cache key of the chunks made
    with it).

    A vocabulary is also an encoder: ``categorical={"country": vocabulary}`` gives a column
    exactly these ids, so that several datasets (the sources of a :class:`gpuload.Mix`, a
    retraining on newer data, a serving system) agree on what each id means. Take it from
    :meth:`gpuload.ParquetDataset.vocabulary` (counted over that dataset's files), or make one
    with :meth:`of` from values kept elsewhere.
    """

    @classmethod
    def of(cls, values, column: str = "") -> "Vocabulary":
        """A vocabulary of ``values`` in id order (str or bytes: id ``i + 1`` for ``values[i]``;
        str as its UTF-8 bytes), e.g. ``Vocabulary.of(json.load(f))``. Refused with a
        :class:`~gpuload.ConfigError` when empty or when a value is not str or bytes or comes twice."""
        if isinstance(values, (str, bytes)):  # list("DE") is ["D", "E"]: one value given bare
            raise ConfigError(f"Vocabulary.of({values!r}): give a list of values, e.g. Vocabulary.of([{values!r}])")
        vals = list(values.to_pylist() if isinstance(values, (pa.Array, pa.ChunkedArray)) else values)
        raw = []
        for i, v in enumerate(vals):
            if not isinstance(v, (str, bytes)):
                raise ConfigError(f"Vocabulary.of: values[{i}] is {v!r}: give str or bytes values")
            raw.append(v.encode() if isinstance(v, str) else v)
        if not raw:
            raise ConfigError("Vocabulary.of: no values: give at least one (id 1 is the first)")
        seen: dict[bytes, int] = {}
        for i, v in enumerate(raw):
            if seen.setdefault(v, i) != i:
                raise ConfigError(f"Vocabulary.of: {vals[i]!r} is values[{seen[v]}] and values[{i}]: each value "
                                  "may have one id")
        return cls(column, pa.array(raw, pa.large_binary()), np.zeros(len(raw), np.int64), Vocab(), given=True)

    def __init__(self, column: str, values: pa.Array, counts: np.ndarray, vocab: Vocab, given: bool = False):
        self.column, self.values, self.counts, self.vocab = column, values, np.asarray(counts, np.int64), vocab
        self._index = None  # made on first lookup: see index()
        self.given = given  #: made by :meth:`of` from values given whole, not counted
        h = xxhash.xxh3_64()
        for buf in values.buffers()[1:]:
            h.update(b"" if buf is None else memoryview(buf))
        h.update(self.counts.tobytes())
        h.update(vocab.key.encode())
        self.digest = h.hexdigest()

    def __len__(self) -> int:
        return len(self.values)

    def index(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(sorted XXH64 of the values, the value index of each), made once, for lookups by
        hash (:func:`vocab_ids`); None where two values share a hash."""
        if self._index is None:
            h = hash_ids(self.values, Hash()).view(np.uint64)
            order = np.argsort(h, kind="stable")
            hashes = h[order]
            self._index = (hashes, order) if len(h) and not (hashes[1:] == hashes[:-1]).any() else False
        return self._index or None

    @property
    def key(self) -> str:
        """The encoder key chunks made with it carry: ``"vocab:<min_count>:<max_size>:<digest>"``."""
        return f"{self.vocab.key}:{self.digest}"

    def to_dict(self) -> dict:
        """``{value: id}`` (str where the bytes are UTF-8, else bytes), for a serving system."""
        out = {}
        for i, v in enumerate(self.values.to_pylist(), 1):
            try:
                out[v.decode()] = i
            except UnicodeDecodeError:
                out[v] = i
        return out

    def ids(self, values) -> np.ndarray:
        """int64 ids of ``values`` (an Arrow array, or a list of str or bytes): 0 when absent or null."""
        if isinstance(values, (str, bytes)):  # one value given bare would be looked up character by character
            raise ConfigError(f"Vocabulary.ids({values!r}): give a list of values, e.g. ids([{values!r}])")
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(
            [v.encode() if isinstance(v, str) else v for v in values], pa.large_binary())
        return vocab_ids(arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr, self)

    def __repr__(self) -> str:
        how = "given" if self.given else f"counted by {self.vocab}"
        return f"Vocabulary({self.column + ', ' if self.column else ''}{len(self):,} values, {how})"


_REGISTERED: dict[str, Vocabulary] = {}  # by digest: the vocabularies this process counted or read


def register(vocabulary: Vocabulary) -> Vocabulary:
    """Make ``vocabulary`` the one conversions of its key use (returns the one registered first)."""
    return _REGISTERED.setdefault(vocabulary.digest, vocabulary)


def registered(key: str) -> Vocabulary | None:
    """The vocabulary an encoder key ``"vocab:<min_count>:<max_size>:<digest>"`` names, if this process has it."""
    parts = key.split(":")
    return _REGISTERED.get(parts[3]) if parts[0] == "vocab" and len(parts) == 4 else None


def vocab_ids(arr: pa.Array, vocabulary: Vocabulary) -> np.ndarray:
    """int64 ids of a flat Arrow array of a :func:`hashable` type in ``vocabulary``: 0 when null or absent."""
    if pa.types.is_dictionary(arr.type):  # each distinct value looked up once
        return _through_dictionary(arr, lambda values: vocab_ids(values, vocabulary))
    values = arr.cast(pa.large_binary())
    index = vocabulary.index()
    if index is None:  # two vocabulary values share a 64-bit hash (never seen in practice): Arrow's set lookup
        found = pc.index_in(values, value_set=vocabulary.values)
        return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
    hashes, order = index
    h = hash_ids(values, Hash()).view(np.uint64)  # each value's XXH64 (a null's is 0, and is not looked up)
    pos = np.minimum(np.searchsorted(hashes, h), len(hashes) - 1)
    cand = order[pos]
    hit = hashes[pos] == h
    if arr.null_count:
        hit &= np.asarray(arr.is_valid())
    # the same hash is not enough: the bytes must be equal too
    same = pc.equal(values, vocabulary.values.take(pa.array(cand))).fill_null(False).to_numpy(zero_copy_only=False)
    return np.where(hit & same, cand + 1, 0).astype(np.int64)


def encode_ids(arr: pa.Array, key: str) -> np.ndarray:
    """int64 ids of a flat Arrow array by encoder ``key`` (a :class:`Hash`'s, or a counted vocabulary's)."""
    if key.startswith("vocab:"):
        vocabulary = registered(key)
        if vocabulary is None:  # every reader registers its vocabularies when it opens: a bug if reached
            raise RuntimeError(f"gpuload: the vocabulary {key} was not loaded in this process; reopen the dataset")
        return vocab_ids(arr, vocabulary)
    return hash_ids(arr, parse_key(key))
