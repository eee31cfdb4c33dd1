"""What ``gpuload cache info``, ``verify``, ``clear`` and ``quota`` print of a cache folder: its
chunks, budget, datasets, column sets, vocabularies and source files, one line each."""

from __future__ import annotations

import datetime

from ..cache.evict import datasets
from ..cache.space import free_bytes
from ..cache.store import ChunkCache
from ..categorical import Vocab, parse_key
from ..memory import size_text

__all__ = ["budget", "chunks_text", "print_left_alone", "print_summary", "spec_text"]


_SHOWN = 10  # kept listings printed by `cache info`: unreadable ones, then the most recent


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "never"


def spec_text(desc) -> str:
    """One line per column set: its outputs and the columns they come from."""
    if not desc:
        return "(description missing)"
    import numpy as np

    parts = []
    for d in desc:
        cols = d["columns"][0] if len(d["columns"]) == 1 else "[" + ", ".join(d["columns"]) + "]"
        dtype = d["dtype"] if d["dtype"] == "bfloat16" else np.dtype(d["dtype"]).name
        encoders = sorted({_encoder_text(src[2]) for src in d.get("sources", []) if len(src) > 2})
        shape = {"ragged": f"lists of {dtype}", "fixed": f"lists of {d.get('width')} {dtype}"}.get(d.get("kind"), dtype)
        what = f"{shape}, ids of {' and '.join(encoders)}" if encoders else shape  # categorical columns
        fills = d.get("fills", [])  # what nulls became, per source column: caches differ by it
        if len(set(map(repr, fills))) > 1:
            what += ", nulls as " + ", ".join(f"{c}: {'refused' if f is None else repr(f)}"
                                              for c, f in zip(d["columns"], fills))
        elif fills and fills[0] is not None:
            what += f", nulls as {fills[0]!r}"
        named = d["name"] if d["name"] == cols or not d["columns"] else d["name"] + "=" + cols  # none: a transform's
        parts.append(f"{named} ({what})")
    made = sorted({d["transform"]["key"] for d in desc if isinstance(d.get("transform"), dict)})
    kept = sorted({str(d["filter"]).rsplit(" #", 1)[0] for d in desc if d.get("filter")})
    stored = "; rows permuted in each chunk (for shuffle='block')" if any(str(d.get("rows", "")).startswith("permuted") for d in desc) \
        else "; row blocks (layout='rows')" if any(d.get("block") for d in desc) else ""
    return ", ".join(parts) + "".join(f"; made by transform {k!r}" for k in made) + \
        "".join(f"; rows where {k}" for k in kept) + stored


def _vocab_text(vocab: Vocab) -> str:
    return f"Vocab(min_count={vocab.min_count}" + (f", max_size={vocab.max_size})" if vocab.max_size else ")")


def _encoder_text(key: str) -> str:
    """A categorical encoder's key as its Python spelling (``Hash(buckets=4194304)``, ``Vocab(min_count=5)``)."""
    try:
        enc = parse_key(key)
    except (ValueError, TypeError):
        return key
    if isinstance(enc, Vocab):
        return f"{_vocab_text(enc)} {key.split(':')[-1][:8]}"
    return f"Hash(buckets={enc.buckets}" + (f", seed={enc.seed})" if enc.seed else ")")


def print_left_alone(foreign: list[str]) -> None:
    if foreign:
        shown = "; ".join(foreign[:5]) + (f"; and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        print(f"  left alone {len(foreign)} entries gpuload did not write: {shown}")


def chunks_text(n: int) -> str:
    """``"1 chunk"``, ``"3 chunks"``."""
    return f"{n} chunk{'s' * (n != 1)}"


def print_summary(cache) -> None:
    """Print what ``cache info`` says of the cache itself."""
    s = cache.summary()
    print(f"cache {s['root']}: {chunks_text(s['chunks'])}, {s['bytes'] / 2**20:,.1f} MiB; Parquet footers of "
          f"{s['footers']} source files (a cached dataset reopens without reading its files)")
    print(budget(cache, s["bytes"])[1])
    _datasets_text(cache, s["bytes"])
    if s["specs"]:
        print("column sets (spec: outputs; last used; chunks):")
    for h, e in sorted(s["specs"].items(), key=lambda kv: -kv[1]["last_used"]):
        print(f"  {h}: {spec_text(e['desc'])}; last used {_when(e['last_used'])}; {chunks_text(e['chunks'])}, "
              f"{e['bytes'] / 2**20:,.1f} MiB")
    if s["vocabularies"]:
        print("vocabularies (column: values; counted with; over source files; built):")
    for v in sorted(s["vocabularies"], key=lambda v: (str(v.get("column")), -v["built"])):
        if "column" not in v:
            print(f"  {v['name']}: unreadable (counted again when needed; `gpuload cache verify` says why)")
            continue
        print(f"  {v['column']}: {v['values']:,} values; {_vocab_text(v['vocab'])}; over "
              f"{v['sources']} files; built {_when(v['built'])}")
    if s.get("kept_counts"):
        print(f"row filters' kept-row counts: {s['kept_counts']} source files counted")
    if s.get("listings"):
        print("remote listings kept (each source's last, to open it while its store is down):")
    for e in sorted(s.get("listings", []), key=lambda e: -e.get("at", float("inf")))[:_SHOWN]:  # unreadable first
        print(f"  {e['url']}: {e['objects']:,} objects; listed {_when(e['at'])}" if "url" in e else
              f"  {e['name']}: unreadable (not used; `gpuload cache verify` says why)")
    if len(s.get("listings", [])) > _SHOWN:
        print(f"  ... and {len(s['listings']) - _SHOWN} more")
    if s["sources"]:
        print("source files:")
    for src, e in sorted(s["sources"].items()):
        print(f"  {src}: {chunks_text(e['chunks'])}, {e['bytes'] / 2**20:,.1f} MiB")
    if s["temporaries"]:
        print(f"  {s['temporaries']} unfinished temporary files from interrupted writers "
              "(never read; `gpuload cache clear` removes them)")
    if s["old_format"]:
        print(f"  {s['old_format']} chunk files of an older cache format (never read; `gpuload cache clear` "
              "removes them)")
    if s["foreign"]:
        print(f"  {len(s['foreign'])} entries gpuload did not write (never read, never deleted): "
              + "; ".join(s["foreign"][:5]))
    if s.get("unreadable"):
        print(f"  {len(s['unreadable'])} of its folders cannot be read, and are not counted above (check their "
              "owner and permissions): " + "; ".join(s["unreadable"][:5]))


def budget(cache: ChunkCache, used: int) -> tuple[int, str]:
    """(the bytes chunks may take in the cache folder, one line saying so and how much is used)."""
    if cache.max_bytes == 0:
        kept = f"{size_text(used)} kept from before; " if used else ""
        return 0, ("budget: the folder's quota is 0 (`gpuload cache quota`): nothing new is cached here, datasets "
                   f"read Parquet for what is not ({kept}`gpuload cache quota none` removes the quota)")
    if cache.max_bytes is not None:
        return cache.max_bytes, (f"budget: the folder's quota of {size_text(cache.max_bytes)} (`gpuload cache quota`), "
                                 f"{used / cache.max_bytes:.0%} used")
    above = max(0, free_bytes(cache.root.path) - cache.reserve)
    return used + above, (f"budget: no quota; chunks are written while the disk keeps {size_text(cache.reserve)} free "
                          f"for other jobs ($GPULOAD_CACHE_RESERVE, default 10% of the disk): room for "
                          f"{size_text(above)} more")


def _datasets_text(cache: ChunkCache, used: int) -> None:
    """Each dataset that used the cache: its chunks against the budget, last use, and whether a
    reader has it open (its chunks are then never evicted)."""
    rows = datasets(cache.root)
    if not rows:
        return
    print("datasets (most recently used first; evicted least recently used first when room is needed, never while "
          "open):")
    room = budget(cache, used)[0]
    for d in rows:
        share = f", {d['bytes'] / room:.0%} of the budget" if room else ""
        print(f"  {d['record']}: {d['files']} chunk folders (a source file's, or a pack's of small files), column set {', '.join(h[:8] for h in d['specs'])}; "
              f"{chunks_text(d['chunks'])}, {size_text(d['bytes'])}{share}; last used {_when(d['last_used'])}"
              + ("; open now" if d["live"] else ""))
