"""Flags: the command's settings, parsed into the settings of the Python API.

A loader flag left out is not passed on, so the setting keeps its default, written once
on :class:`gpuload.config.Options` (the help texts read it there). Values are checked
before a command prints or opens anything; messages name the flag (``--threads 0``).
"""

from __future__ import annotations

import argparse
import json
import math

from ..cache.paths import split_dirs
from ..categorical import Hash, Vocab, encoder_from_json
from ..config import MiB, Options, Source
from ..errors import FLAGS, ConfigError

__all__ = ["add_source_flags", "add_chunk_flags", "source_of", "loader_settings", "check_options", "finite",
           "columns", "bar"]


def columns(text: str | None):
    """``a,b,c`` or a JSON list of names -> list; a JSON object -> dict (groups); None -> None."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--columns is not valid JSON: {e}") from None
        if isinstance(value, list) and not all(isinstance(c, str) for c in value):
            raise ConfigError(f"--columns {text!r}: a JSON list must hold column names (strings)")
        return value
    names = [c.strip() for c in text.split(",")]
    if not any(names):
        raise ConfigError("--columns is empty: give names separated by commas, or a JSON object")
    if not all(names):  # 'a,,b' or a trailing comma: a name left out by mistake, not quietly dropped
        raise ConfigError(f"--columns {text!r} has an empty name: give names separated by single commas")
    return names


def _fill(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:  # a number as Python writes it, too: nan, inf, -inf (JSON has only NaN, Infinity); 1_000 an int
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--fill-nulls {text!r}: give a number or a JSON object like '{{\"col\": 0}}'") from None


def _json_object(flag: str, text: str | None, example: str) -> dict | None:
    """A flag's JSON object (None when the flag is not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: give a JSON object like '{example}'")
    return value


def add_source_flags(p: argparse.ArgumentParser, as_built: bool = False) -> None:
    """--storage-options, --columns, --fill-nulls and --dtypes (``as_built``: for a command that
    looks at a cache, which must name them as the cache was built with)."""
    was = "; as the cache was built with" if as_built else ""
    p.add_argument("--storage-options", help="a JSON object for the URL's fsspec filesystem, e.g. '{\"anon\": true}'")
    p.add_argument("--columns", help=f"a,b,c, a JSON list, or a JSON object {{\"output\": [\"col\", ...]}} "
                   f"(default: all{was})")
    p.add_argument("--fill-nulls", help=f"a number, or a JSON object {{\"column\": value}}{was}")
    p.add_argument("--dtypes", help=f"a JSON object {{\"output\": \"float16\"}} (numpy or torch dtype names){was}")
    p.add_argument("--categorical", help="ids for string and binary columns: a number of hash buckets, or vocab, "
                   f"for all of them, or a JSON object {{\"column\": buckets, null, \"vocab\", {{\"buckets\": N, "
                   f"\"seed\": S}} or {{\"min_count\": N, \"max_size\": M}}}} (default: the 64-bit hash){was}")
    p.add_argument("--filter", help="keep only the rows where these hold: a JSON list of [column, op, value] "
                   "conditions (all hold), or a list of such lists (any holds), e.g. "
                   f"'[[\"day\", \">=\", 20260101], [\"country\", \"in\", [\"DE\", \"FR\"]]]'{was}")


def add_cache_io_flag(p: argparse.ArgumentParser, off: bool = True) -> None:
    """--cache-io: whether cache files bypass the page cache (``off``: or are not written at all)."""
    p.add_argument("--cache-io", help=f"auto, direct{', buffered or off' if off else ' or buffered'}: write and read cache files "
                   f"around the page cache (direct), through it (buffered), direct with reads turning buffered after a "
                   f"pass they limited, where the cache fits in half the memory (auto{'' if off else ', the default'})"
                   + (f", or not at all: every epoch decodes Parquet (off; default {Options.cache_io})" if off else ""))


def add_chunk_flags(p: argparse.ArgumentParser, block_rows: bool = True, packs: bool = True) -> None:
    """--chunk-mib, (``packs``) --no-pack-files, --layout and (``block_rows``) --block-rows: what decides a
    cache's files."""
    p.add_argument("--chunk-mib", type=float, help=f"chunk size bound in MiB (default {Options.chunk_bytes // MiB}; "
                   "as the cache was built with)")
    if packs:
        p.add_argument("--no-pack-files", action="store_true", default=None, help="every chunk one file's: small "
                       "files are not packed several to a chunk (pack_files=False)")
    p.add_argument("--layout", choices=["auto", "rows", "columns"], help=f"the training's layout= (default {Options.layout})")
    p.add_argument("--shuffle", choices=list(SHUFFLES), help="the training's shuffle= (default rows: rows permuted in "
                   "windows); block stores each chunk with its rows permuted, so a cache built for it is its own")
    if block_rows:
        p.add_argument("--block-rows", type=int, help=f"the training's block_rows with shuffle='block' (default "
                       f"{Options.block_rows}; implies --shuffle block)")


#: ``--shuffle`` choices and the ``shuffle=`` each means
SHUFFLES = {"rows": True, "block": "block", "chunks": "chunks", "none": False}


def categorical(text: str | None):
    """``--categorical``: a number of buckets (a :class:`gpuload.Hash` for every string column) or
    ``vocab`` (a :class:`gpuload.Vocab` for each), or a JSON object ``{column: buckets, null, "vocab",
    {"buckets": N, "seed": S} or {"min_count": N, "max_size": M}}``; None -> None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    try:
        if isinstance(value, dict):
            return {c: encoder_from_json(v, f"column {c!r}") for c, v in value.items()}
        if value == "vocab":
            return Vocab()
        if isinstance(value, int) and not isinstance(value, bool):
            return Hash(value)
    except ConfigError as e:
        raise ConfigError(f"--categorical {text!r}: {e}") from None
    raise ConfigError(f"--categorical {text!r}: give a number of hash buckets, vocab, or a JSON object like "
                      "'{\"C1\": 4194304, \"C2\": null, \"C3\": \"vocab\"}'")


def row_filter(text: str | None):
    """``--filter``: the DNF conditions as JSON lists (None: no filter)."""
    if text is None:
        return None
    try:
        got = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--filter is not valid JSON ({e}): give '[[\"day\", \">=\", 20260101]]'") from None
    if not isinstance(got, list) or not got:
        raise ConfigError(f"--filter {text!r}: give a JSON list of [column, op, value] conditions, e.g. "
                          "'[[\"day\", \">=\", 20260101], [\"country\", \"in\", [\"DE\"]]]'")
    return got


def source_of(args) -> Source:
    """The :class:`Source` of a command's positional sources and source flags."""
    return Source(args.source, columns(args.columns), _fill(args.fill_nulls),
                  _json_object("--dtypes", args.dtypes, '{"dense": "float16"}'),
                  categorical=categorical(args.categorical), filters=row_filter(getattr(args, "filter", None)),
                  storage_options=_json_object("--storage-options", args.storage_options, '{"anon": true}'))


#: the loader settings a command's flags may give as they are (each flag: errors.FLAGS)
_SETTINGS = ("batch_size", "num_threads", "nice", "prefetch", "device", "cache_dir", "cache_io", "layout", "seed")


def _dest(setting: str) -> str:
    """argparse's name of ``setting``'s flag (``num_threads`` -> ``--threads`` -> ``threads``)."""
    return FLAGS[setting][2:].replace("-", "_")


def loader_settings(args) -> dict:
    """The loader settings of the flags given (``--chunk-mib`` in bytes, ``--shuffle`` as
    :data:`SHUFFLES` says, ``--block-rows N`` as ``shuffle="block", block_rows=N``); flags left out
    are not there."""
    out = {s: getattr(args, _dest(s)) for s in _SETTINGS if getattr(args, _dest(s), None) is not None}
    if "cache_dir" in out:  # several folders, one per drive: a:b
        out["cache_dir"] = split_dirs(out["cache_dir"], "--cache-dir")
    if getattr(args, "chunk_mib", None) is not None:
        finite("--chunk-mib", args.chunk_mib, strict=True)
        if args.chunk_mib * MiB < 4096:
            raise ConfigError(f"--chunk-mib {args.chunk_mib:g}: a chunk is at least 4096 bytes (--chunk-mib 0.00390625)")
        out["chunk_bytes"] = int(args.chunk_mib * MiB)
    if getattr(args, "no_pack_files", False):
        out["pack_files"] = False
    shuffle = getattr(args, "shuffle", None)
    if shuffle is not None:
        out["shuffle"] = SHUFFLES[shuffle]
    if getattr(args, "block_rows", None) is not None:
        if shuffle not in (None, "block"):
            raise ConfigError(f"--block-rows {args.block_rows} is for --shuffle block, not --shuffle {shuffle}: "
                              "leave one of them out")
        out.update(shuffle="block", block_rows=args.block_rows)
    return out


def check_options(settings: dict) -> Options:
    """The :class:`Options` of ``settings``, its device resolved: bad flags are refused before a
    command prints or opens anything."""
    from ..device import check_device

    opts = Options.of(settings)
    check_device(opts.device)
    return opts


def finite(flag: str, value: float | None, minimum: float = 0.0, strict: bool = False) -> None:
    """Refuse NaN, infinities and values below ``minimum`` for a numeric flag."""
    if value is not None and (not math.isfinite(value) or value < minimum or (strict and value == minimum)):
        raise ConfigError(f"{flag} {value}: give a finite number {'>' if strict else '>='} {minimum:g}")


def bar(desc: str, total: int, unit: str):
    """A progress bar on stderr (none where stderr is not a terminal)."""
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, file=sys.stderr,
                disable=None, dynamic_ncols=True)
