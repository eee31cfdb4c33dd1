"""The ``gpuload`` command: demo, profile and cache management.

User mistakes print one line ``gpuload: error: ...`` on stderr and exit with status 2;
a cache that fails verification exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from . import __version__
from .cache.store import ChunkCache, default_cache_dir
from .errors import ConfigError, GpuloadError, set_style

__all__ = ["main"]


def _columns(text: str | None):
    """``a,b,c`` -> list; a JSON object -> dict (groups); None -> None."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--columns is not valid JSON: {e}") from None
        return value
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ConfigError("--columns is empty: give names separated by commas, or a JSON object")
    return names


def _fill(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"--fill-nulls {text!r}: give a number or a JSON object like '{{\"col\": 0}}'") from None


def _dtypes(text: str | None):
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"--dtypes {text!r}: give a JSON object like '{{\"dense\": \"float16\"}}'")
    return value


def _storage(text: str | None) -> dict | None:
    """--storage-options: a JSON object passed to the fsspec filesystem of a URL source."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"--storage-options {text!r}: give a JSON object like '{{\"anon\": true}}'")
    return value


def _bar(desc: str, total: int, unit: str):
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, file=sys.stderr,
                disable=None, dynamic_ncols=True)


def cmd_demo(args) -> int:
    from .demo import report, run_demo

    if args.rows < 1000:
        raise ConfigError(f"--rows {args.rows}: the demo needs at least 1000 rows")
    owned = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gpuload-demo-")) if owned else Path(args.workdir)
    bars = []

    def progress(name, total):
        bar = _bar(name, total, "row")
        bars.append(bar)
        return bar.update

    try:
        results = run_demo(workdir, rows=args.rows, files=args.files, batch_size=args.batch_size,
                           step_ms=args.step_ms, model=args.model, device=args.device, progress=progress)
    finally:
        for b in bars:
            b.close()
        if owned and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    step = "a small MLP" if args.model == "mlp" else f"a simulated {args.step_ms:g} ms step"
    print(f"\nEach loader fed {step} with batches of {args.batch_size:,} rows:\n")
    print(report(results))
    cold, warm, naive = results
    print(f"\nFrom the cache gpuload delivered {warm.rows_per_s / naive.rows_per_s:.1f}x the rows/s of the naive "
          f"loop; the training step waited for data {warm.wait_fraction:.1%} of the time "
          f"(naive: {naive.wait_fraction:.1%}).")
    if not owned or args.keep:
        print(f"data and cache are in {workdir}")
    return 0


def cmd_profile(args) -> int:
    from .observe.profile import profile

    if args.epochs < 1:
        raise ConfigError(f"--epochs {args.epochs}: profile at least one epoch")
    _finite("--step-ms", args.step_ms)
    if args.step_ms is not None and args.step_ms > 60_000:
        raise ConfigError(f"--step-ms {args.step_ms}: a simulated step of over a minute is not a training step")
    kwargs = dict(batch_size=args.batch_size, device=args.device, num_threads=args.threads, prefetch=args.prefetch,
                  fill_nulls=_fill(args.fill_nulls), dtypes=_dtypes(args.dtypes),
                  storage_options=_storage(args.storage_options), chunk_bytes=_chunk_bytes(args))
    if args.cache_dir:
        kwargs["cache_dir"] = args.cache_dir
    _check_options(kwargs)  # before anything is printed
    step = "a small MLP" if args.model == "mlp" else f"a simulated {args.step_ms if args.step_ms is not None else 5:g} ms step"
    print(f"profiling {args.epochs} epochs of {', '.join(args.source)} under {step}, batches of {args.batch_size:,} rows",
          file=sys.stderr)
    reports = profile(args.source, _columns(args.columns), epochs=args.epochs,
                      step_ms=5.0 if args.step_ms is None else args.step_ms,
                      model=args.model, trace=args.trace, **kwargs)
    for r in reports:
        print(r)
        print()
    if args.trace:
        print(f"trace written to {args.trace}: open it in https://ui.perfetto.dev")
    if args.verbose:
        print(reports[-1].stats)
    return 0


def _chunk_bytes(args) -> int:
    """--chunk-mib in bytes, refused (as typed) below the smallest chunk a cache holds."""
    _finite("--chunk-mib", args.chunk_mib, strict=True)
    if args.chunk_mib * 2**20 < 4096:
        raise ConfigError(f"--chunk-mib {args.chunk_mib:g}: a chunk is at least 4096 bytes (--chunk-mib 0.00390625)")
    return int(args.chunk_mib * 2**20)


def _check_options(kwargs: dict) -> None:
    """Refuse bad loader settings (as flags) before a command prints or opens anything."""
    from .config import Options
    from .device import resolve_device

    resolve_device(Options.of(kwargs).device)


def _finite(flag: str, value: float | None, minimum: float = 0.0, strict: bool = False) -> None:
    """Refuse NaN, infinities and values below ``minimum`` for a numeric flag."""
    if value is not None and (not math.isfinite(value) or value < minimum or (strict and value == minimum)):
        raise ConfigError(f"{flag} {value}: give a finite number {'>' if strict else '>='} {minimum:g}")


def cmd_build(args) -> int:
    from .build import build_cache

    chunk_bytes = _chunk_bytes(args)
    _finite("--max-gib", args.max_gib)
    _check_options(dict(num_threads=args.threads, chunk_bytes=chunk_bytes, device=args.device,
                        cache_dir=args.cache_dir, layout=args.layout, **_block(args)))

    if args.nodes is not None and args.scheduler is None:
        raise ConfigError("--nodes says on which node (host) each chunk is built: give --scheduler too (a local "
                          "cluster of --workers runs on one host)")
    bar = _bar("building cache", 0, "row")

    def progress(n):
        bar.update(n)

    with contextlib.ExitStack() as stack:
        client = _client(args, stack)
        try:
            summary = build_cache(args.source, cache_dir=args.cache_dir, columns=_columns(args.columns),
                                  fill_nulls=_fill(args.fill_nulls), dtypes=_dtypes(args.dtypes),
                                  chunk_bytes=chunk_bytes,
                                  num_threads=args.threads,
                                  max_cache_bytes=None if args.max_gib is None else int(args.max_gib * 2**30),
                                  progress=progress, storage_options=_storage(args.storage_options),
                                  device=args.device, client=client, nodes=args.nodes, seed=args.seed,
                                  layout=args.layout, **_block(args))
        finally:
            bar.close()
    print(summary)
    return 0


def _client(args, stack: contextlib.ExitStack):
    """A Dask client for --scheduler ADDR or --workers N (a local cluster), else None."""
    if args.scheduler is None and args.workers is None:
        return None
    try:
        import distributed
    except ImportError:
        raise ConfigError("--scheduler and --workers need Dask: pip install 'gpuload[dask]'") from None
    if args.scheduler is not None:
        return stack.enter_context(distributed.Client(args.scheduler))
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: give at least 1")
    logging.getLogger("distributed").setLevel(logging.ERROR)  # its start and close chatter, around our bar
    if args.device.startswith("cuda"):  # one worker per GPU, decoding with cuDF
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            raise ConfigError("--workers with --device cuda needs dask-cuda: pip install 'gpuload[gpu]'") from None
        cluster = stack.enter_context(LocalCUDACluster(n_workers=args.workers, threads_per_worker=args.threads,
                                                       dashboard_address=None))
    else:
        cluster = stack.enter_context(distributed.LocalCluster(n_workers=args.workers, threads_per_worker=args.threads,
                                                               processes=True, dashboard_address=None,
                                                               silence_logs=logging.ERROR))
    return stack.enter_context(distributed.Client(cluster))


def _cache(args) -> ChunkCache:
    return ChunkCache(args.cache_dir or default_cache_dir(), create=False)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "never"


def _spec_text(desc) -> str:
    """One line per column set: its outputs and the columns they come from."""
    if not desc:
        return "(description missing)"
    import numpy as np

    parts = []
    for d in desc:
        cols = d["columns"][0] if len(d["columns"]) == 1 else "[" + ", ".join(d["columns"]) + "]"
        dtype = d["dtype"] if d["dtype"] == "bfloat16" else np.dtype(d["dtype"]).name
        parts.append(f"{d['name'] if d['name'] == cols else d['name'] + '=' + cols} ({dtype})")
    return ", ".join(parts)


def _left_alone(foreign: list[str]) -> None:
    if foreign:
        shown = "; ".join(foreign[:5]) + (f"; and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        print(f"  left alone {len(foreign)} entries gpuload did not write: {shown}")


def cmd_info(args) -> int:
    opts = _share_options(args) if args.source else None  # bad flags are refused before anything is printed
    cache = _cache(args)
    s = cache.summary()
    print(f"cache {s['root']}: {s['chunks']} chunks, {s['bytes'] / 2**20:,.1f} MiB; Parquet footers of "
          f"{s['footers']} source files (a cached dataset reopens without reading its files)")
    if s["specs"]:
        print("column sets (spec: outputs; last used; chunks):")
    for h, e in sorted(s["specs"].items(), key=lambda kv: -kv[1]["last_used"]):
        print(f"  {h}: {_spec_text(e['desc'])}; last used {_when(e['last_used'])}; {e['chunks']} chunks, "
              f"{e['bytes'] / 2**20:,.1f} MiB")
    if s["sources"]:
        print("source files:")
    for src, e in sorted(s["sources"].items()):
        print(f"  {src}: {e['chunks']} chunks, {e['bytes'] / 2**20:,.1f} MiB")
    if s["temporaries"]:
        print(f"  {s['temporaries']} unfinished temporary files from interrupted writers "
              "(never read; `gpuload cache clear` removes them)")
    if s["old_format"]:
        print(f"  {s['old_format']} chunk files of an older cache format (never read; `gpuload cache clear` "
              "removes them)")
    if s["foreign"]:
        print(f"  {len(s['foreign'])} entries gpuload did not write (never read, never deleted): "
              + "; ".join(s["foreign"][:5]))
    if args.source:
        _node_shares(args, opts)
    return 0


def _share_options(args):
    """The Options `cache info SOURCE --nodes N` opens the source with."""
    from .config import Options

    if args.nodes is None or args.nodes < 1:
        raise ConfigError("cache info SOURCE: give --nodes N (the training's number of nodes)")
    return Options(cache_dir=args.cache_dir, chunk_bytes=_chunk_bytes(args), device="cpu", layout=args.layout,
                   **_block(args))


def _block(args) -> dict:
    """--block-rows N as the settings ``shuffle="block", block_rows=N`` (none without it)."""
    return {} if args.block_rows is None else {"shuffle": "block", "block_rows": args.block_rows}


def _node_shares(args, opts) -> None:
    """Per node share of a source (shard='node' with --nodes nodes): chunks owned, and cached here."""
    from .config import Source
    from .plan import node_chunks
    from .reader import open_reader

    reader = open_reader(Source(args.source, _columns(args.columns), _fill(args.fill_nulls), _dtypes(args.dtypes),
                                storage_options=_storage(args.storage_options)), opts)
    try:
        owned = node_chunks([c.rows for c in reader.chunks], args.nodes, fingerprint=reader.fingerprint,
                            seed=args.seed)
        print(f"node shares of {', '.join(args.source)} ({len(reader.chunks)} chunks; shard='node', "
              f"{args.nodes} nodes, seed {args.seed}):")
        for n, chunks in enumerate(owned):
            sizes = [st.st_size for st in map(reader.cached_file, map(int, chunks)) if st is not None]
            rows = sum(reader.chunks[int(i)].rows for i in chunks)
            print(f"  node {n}: {len(chunks)} chunks, {rows:,} rows; {len(sizes)} cached here "
                  f"({sum(sizes) / 2**20:,.1f} MiB)")
    finally:
        reader.close()


def cmd_verify(args) -> int:
    cache = _cache(args)
    bar = _bar("verifying", len(list(cache.entries())), "file")
    checked = []
    try:
        bad = cache.verify_all(progress=lambda p: (checked.append(p), bar.update(1)))
    finally:
        bar.close()
    for path, problem, kind in bad:
        print(f"{kind.upper()} {problem}")
        if args.delete and kind == "corrupt":
            cache.delete(path)
    files_bad = len({p for p, _, _ in bad} & set(checked))
    print(f"{len(checked) - files_bad} of {len(checked)} cache files verified in {cache.root.path}"
          + (f"; {len(bad)} problems" + (" (corrupt files deleted: they are rebuilt on next use)"
                                         if args.delete else "") if bad else ""))
    _left_alone(cache.summary()["foreign"])
    return 1 if bad else 0


def _since(text: str) -> float:
    """``2026-11-01`` (local midnight), an ISO date-time, or an age like ``30d`` / ``12h``: epoch seconds."""
    text = text.strip()
    try:
        if text[-1:] in ("d", "h") and text[:-1].replace(".", "", 1).isdigit():
            hours = float(text[:-1]) * (24 if text[-1] == "d" else 1)
            return (datetime.datetime.now() - datetime.timedelta(hours=hours)).timestamp()
        return datetime.datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError):
        raise ConfigError(f"--unused-since {text!r}: give a date (2026-11-01) or an age (30d, 12h)") from None


def cmd_clear(args) -> int:
    cache = _cache(args)
    since = None if args.unused_since is None else _since(args.unused_since)
    if args.spec is not None and len(args.spec) < 4:
        raise ConfigError(f"--spec {args.spec!r}: give at least 4 characters of a column set's hash "
                          "(`gpuload cache info` lists them)")
    r = cache.clear(spec=args.spec, unused_since=since)
    which = "" if args.spec is None and since is None else f" ({len(r['specs'])} column sets)"
    print(f"cleared {cache.root.path}{which}: {r['files']} files, {r['freed'] / 2**20:,.1f} MiB freed")
    _left_alone(r["foreign"])
    if r["failed"]:
        print(f"  could not delete {len(r['failed'])} files: " + "; ".join(r["failed"][:5]))
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuload", description="Parquet to training batches, cached and converted.")
    p.add_argument("--version", action="version", version=f"gpuload {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what gpuload does")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="compare gpuload with a naive loop on generated data")
    d.add_argument("--rows", type=int, default=2_000_000, help="rows to generate (default 2,000,000)")
    d.add_argument("--files", type=int, default=8, help="Parquet files to write (default 8)")
    d.add_argument("--batch-size", type=int, default=16384, help="rows per batch (default 16384)")
    d.add_argument("--step-ms", type=float, default=5.0, help="simulated training step in ms (default 5)")
    d.add_argument("--model", choices=["sim", "mlp"], default="sim", help="simulated step or a small real MLP")
    d.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    d.add_argument("--workdir", help="folder for data and cache (default: a temporary folder, removed after)")
    d.add_argument("--keep", action="store_true", help="keep the temporary folder")
    d.set_defaults(fn=cmd_demo)

    f = sub.add_parser("profile", help="run the loader under a training step and diagnose starvation")
    f.add_argument("source", nargs="+", help="Parquet files, directories, globs or URLs (s3://, gs://, https://...)")
    f.add_argument("--storage-options", help="a JSON object for the URL's fsspec filesystem, e.g. '{\"anon\": true}'")
    f.add_argument("--columns", help="a,b,c or a JSON object {\"output\": [\"col\", ...]} (default: all)")
    f.add_argument("--fill-nulls", help="a number, or a JSON object {\"column\": value}")
    f.add_argument("--dtypes", help="a JSON object {\"output\": \"float16\"} (numpy or torch dtype names)")
    how = f.add_mutually_exclusive_group()
    how.add_argument("--step-ms", type=float, help="simulated training step in ms (default 5)")
    how.add_argument("--model", choices=["mlp"], help="a small real MLP over the dense outputs instead")
    f.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    f.add_argument("--epochs", type=int, default=2, help="epochs to run (default 2: cold, then cached)")
    f.add_argument("--batch-size", type=int, default=65536, help="rows per batch (default 65536)")
    f.add_argument("--threads", type=int, default=2, help="loader threads (default 2)")
    f.add_argument("--prefetch", type=int, default=2, help="chunks loaded ahead (default 2)")
    f.add_argument("--chunk-mib", type=float, default=64, help="chunk size bound in MiB (default 64; as the cache "
                   "was built with)")
    f.add_argument("--trace", help="write a Chrome trace-event JSON file (open in Perfetto)")
    f.add_argument("--cache-dir", help="cache folder (default $GPULOAD_CACHE_DIR or ~/.cache/gpuload)")
    f.set_defaults(fn=cmd_profile)

    c = sub.add_parser("cache", help="build, inspect, verify or clear the cache")
    csub = c.add_subparsers(dest="action", required=True)
    b = csub.add_parser("build", help="convert a Parquet source into the cache ahead of training")
    b.add_argument("source", nargs="+", help="Parquet files, directories, globs or URLs (s3://, gs://, https://...)")
    b.add_argument("--storage-options", help="a JSON object for the URL's fsspec filesystem, e.g. '{\"anon\": true}'")
    b.add_argument("--columns", help="a,b,c or a JSON object {\"output\": [\"col\", ...]} (default: all)")
    b.add_argument("--fill-nulls", help="a number, or a JSON object {\"column\": value}")
    b.add_argument("--dtypes", help="a JSON object {\"output\": \"float16\"} (numpy or torch dtype names)")
    b.add_argument("--chunk-mib", type=float, default=64, help="chunk size bound in MiB (default 64)")
    b.add_argument("--layout", choices=["rows", "columns"], default="rows",
                   help="the training's layout= (default rows)")
    b.add_argument("--block-rows", type=int, help="build for shuffle='block' with this block_rows (chunks "
                   "stored with their rows permuted); default: for the other shuffle modes")
    b.add_argument("--threads", type=int, default=2, help="decode threads (default 2)")
    b.add_argument("--max-gib", type=float, help="cache budget in GiB (default unbounded)")
    b.add_argument("--device", default="cpu", help="cpu, cuda or auto: where to decode (default cpu)")
    how = b.add_mutually_exclusive_group()
    how.add_argument("--scheduler", help="build on this Dask cluster (a scheduler address, tcp://host:8786)")
    how.add_argument("--workers", type=int, help="build on a local Dask cluster of this many worker processes "
                     "(one per GPU with --device cuda, through dask-cuda)")
    b.add_argument("--nodes", type=int, help="with --scheduler: build each chunk on the node (host, in sorted "
                   "order) that owns it under shard='node' with this many nodes")
    b.add_argument("--seed", type=int, default=0, help="the training's seed, for --nodes (default 0)")
    b.set_defaults(fn=cmd_build)
    for name, fn, text in (("info", cmd_info, "what the cache holds"),
                           ("verify", cmd_verify, "check every cache file; exit 1 if any is corrupt"),
                           ("clear", cmd_clear, "delete gpuload's files in the cache (all, or some column sets)")):
        a = csub.add_parser(name, help=text)
        a.set_defaults(fn=fn)
        if name == "info":
            a.add_argument("source", nargs="*", help="with --nodes: show each node's share of this source")
            a.add_argument("--nodes", type=int, help="number of nodes of a shard='node' training")
            a.add_argument("--seed", type=int, default=0, help="the training's seed (default 0)")
            a.add_argument("--columns", help="as the cache was built with (default: all)")
            a.add_argument("--fill-nulls", help="as the cache was built with")
            a.add_argument("--dtypes", help="as the cache was built with")
            a.add_argument("--chunk-mib", type=float, default=64, help="as the cache was built with (default 64)")
            a.add_argument("--layout", choices=["rows", "columns"], default="rows",
                           help="as the cache was built with (default rows)")
            a.add_argument("--block-rows", type=int, help="as the cache was built with (shuffle='block')")
            a.add_argument("--storage-options", help="a JSON object for the URL's fsspec filesystem")
        if name == "verify":
            a.add_argument("--delete", action="store_true", help="delete corrupt files (rebuilt on next use)")
        if name == "clear":
            a.add_argument("--spec", help="only this column set (a spec hash, or its prefix, from `cache info`)")
            a.add_argument("--unused-since", help="only column sets not used since a date (2026-11-01) or for "
                                                  "an age (30d, 12h)")
    for a in [b] + [csub.choices[n] for n in ("info", "verify", "clear")]:
        a.add_argument("--cache-dir", help="cache folder (default $GPULOAD_CACHE_DIR or ~/.cache/gpuload)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    set_style("cli")  # messages name flags (--fill-nulls ...), not Python arguments
    try:
        return args.fn(args)
    except GpuloadError as e:  # one line; messages name settings as flags (errors.setting)
        print(f"gpuload: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine's, not gpuload's: one line, not a traceback
        print(f"gpuload: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpuload: interrupted", file=sys.stderr)
        return 130
    finally:
        set_style("python")


if __name__ == "__main__":
    sys.exit(main())
