"""What makes a mix's sources fit together (:class:`gpuload.Mix`): the same outputs with the
same dtypes and shapes, one device, and string columns encoded alike, so that an id means the
same value whichever source a row comes from. Each check raises a :class:`~gpuload.ConfigError`
naming the sources, the output and what to give.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .categorical import parse_key
from .errors import ConfigError
from .vocabulary import registered

__all__ = ["check_sources"]


def check_sources(names: Sequence[str], sources: Sequence, provenance: str | None) -> None:
    """Refuse ``sources`` (:class:`gpuload.ParquetDataset`, by ``names``) that differ from the first
    in their outputs, dtypes, shapes, device or categorical encoders, and a ``provenance`` output
    name that is not a string or is an output already."""
    def shape(d):
        return {s.name: (s.kind, s.dtype, s.width) for s in d.reader.outputs}

    first, want = names[0], shape(sources[0])
    for n, d in zip(names[1:], sources[1:]):
        got = shape(d)
        if set(got) != set(want):
            raise ConfigError(f"source {n!r} has outputs {sorted(got)} where {first!r} has {sorted(want)}: "
                              "every source of a mix needs the same outputs (columns= maps names)")
        for o, spec in got.items():
            if spec != want[o]:
                raise ConfigError(f"output {o!r} is {_spec_text(spec)} in source {n!r} but {_spec_text(want[o])} "
                                  f"in {first!r}: give both the same dtype and shape (dtypes=, columns=)")
        _check_encoders(first, sources[0], n, d)
        if d.device != sources[0].device:
            raise ConfigError(f"source {n!r} is on {d.device} and {first!r} on {sources[0].device}: "
                              "give every source the same device=")
    if provenance is not None and (not isinstance(provenance, str) or provenance in want):
        raise ConfigError(f"provenance={provenance!r} must be a name that is not an output already "
                          f"({sorted(want)})")


def _spec_text(spec) -> str:
    kind, dtype, width = spec
    try:
        dtype = np.dtype(dtype).name
    except TypeError:  # bfloat16, named as gpuload names it
        pass
    return f"{kind} {dtype}" + (f" [.., {width}]" if kind in ("group", "fixed") else "")


def _check_encoders(first: str, a, name: str, b) -> None:
    """Refuse sources whose categorical ids would mean other values: an output encoded by another
    Hash, by a vocabulary of other values, or not at all in one of them. Outputs are compared by
    name; where a transform makes a source's outputs, the encoders of the columns it is given."""
    def encoders(d):
        return {s.name: [vt.encode for vt in s.sources] for s in d.reader.specs}

    want, got = encoders(a), encoders(b)
    if a.reader.source.transform is None and b.reader.source.transform is None:
        pairs = [(repr(o), k, w) for o in got if o in want for k, w in zip(got[o], want[o])]
    else:  # a transform's inputs need not share names: the encoders used, each once, must agree
        used = [sorted({k for ks in e.values() for k in ks if k}) for e in (got, want)]
        pairs = [("(the columns its transform is given)", k, w) for k, w in zip(*used)] + (
            [("(the columns its transform is given)", "|".join(used[0]), "|".join(used[1]))]
            if len(used[0]) != len(used[1]) else [])
    for o, k, w in pairs:
        if k == w or _same_vocabulary(k, w):
            continue
        if k.startswith("vocab:") and w.startswith("vocab:") and parse_key(k) == parse_key(w):
            why = "a vocabulary counted over each source's own files, so an id names other values in each"
        else:
            why = f"{_encoder_text(w)} in {first!r} and {_encoder_text(k)} in {name!r}"
        raise ConfigError(f"output {o} of a mix's sources is encoded by {why}: give every source the same "
                          f"encoder for it in categorical=: one gpuload.Hash(buckets=..., seed=...), or one "
                          f"gpuload.Vocabulary (a dataset's over every source's files: .vocabulary(column); or "
                          f"gpuload.Vocabulary.of(values))")


def _same_vocabulary(k: str, w: str) -> bool:
    """Two vocabulary keys whose values are the same, in the same order (their counts may differ)."""
    a, b = registered(k), registered(w)
    return a is not None and b is not None and a.values.equals(b.values)


def _encoder_text(key: str) -> str:
    return "no encoder" if not key else "|".join(repr(parse_key(k)) for k in key.split("|"))
