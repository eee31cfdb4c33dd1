"""``gpuload cache``: build, inspect, verify and clear a cache folder."""

from __future__ import annotations

import argparse
import contextlib
import io
import datetime
import logging
import os

from ..cache.paths import cache_dirs, default_cache_dir, split_dirs
from ..cache.space import parse_size, write_quota
from ..cache.store import ChunkCache
from ..errors import CacheError, ConfigError, GpuloadError
from ..sources.listing import list_files
from ..sources.remote import is_url
from .cache_text import budget, print_left_alone, print_summary
from .flags import add_cache_io_flag, add_chunk_flags, add_source_flags, bar, check_options, finite, loader_settings, source_of

__all__ = ["add_cache_commands"]


def cmd_build(args) -> int:
    from ..build import build_cache, refuse_no_cache

    finite("--max-gib", args.max_gib)
    settings = loader_settings(args)
    check_options(dict(settings, device=args.device))
    refuse_no_cache(settings.get("cache_io"))  # before a cluster starts
    if args.nodes is not None and args.scheduler is None:
        raise ConfigError("--nodes says on which node (host) each chunk is built: give --scheduler too (a local "
                          "cluster of --workers runs on one host)")
    src = source_of(args)
    progress = bar("building cache", 0, "row")
    with contextlib.ExitStack() as stack:
        client = _client(args, stack)
        try:
            summary = build_cache(src.source, columns=src.columns, fill_nulls=src.fill_nulls, dtypes=src.dtypes,
                                  categorical=src.categorical, filters=src.filters,
                                  storage_options=src.storage_options,
                                  max_cache_bytes=None if args.max_gib is None else int(args.max_gib * 2**30),
                                  progress=progress.update, client=client, nodes=args.nodes, **settings)
        finally:
            progress.close()
    print(summary)
    return 0


def _client(args, stack: contextlib.ExitStack):
    """A Dask client for --scheduler ADDR or --workers N (a local cluster), else None."""
    if args.scheduler is None and args.workers is None:
        return None
    if args.scheduler is None and args.workers < 1:  # the mistake first, whether Dask is installed or not
        raise ConfigError(f"--workers {args.workers}: give at least 1")
    try:
        import distributed
    except ImportError:
        raise ConfigError("--scheduler and --workers need Dask: pip install 'gpuload[dask]'") from None
    if args.scheduler is not None:
        try:
            return stack.enter_context(distributed.Client(args.scheduler))
        except (ValueError, OSError) as e:  # a malformed address; none reached in Dask's connect timeout
            raise ConfigError(f"--scheduler {args.scheduler!r}: no Dask scheduler reached there ({type(e).__name__}: "
                              f"{' '.join(str(e).split())}); give a running scheduler's address, e.g. "
                              "tcp://host:8786") from None
    logging.getLogger("distributed").setLevel(logging.ERROR)  # its start and close chatter, around our bar
    if args.device.startswith("cuda"):  # one worker per GPU, decoding with cuDF
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            raise ConfigError("--workers with --device cuda needs dask-cuda: pip install 'gpuload[gpu]'") from None
        cluster = stack.enter_context(LocalCUDACluster(n_workers=args.workers, threads_per_worker=args.threads,
                                                       dashboard_address=None))
    else:
        # the worker processes' own logs: at shutdown a worker's heartbeat can race the scheduler's close and log
        # a traceback from that process (a CI run saw it); a chunk's failure comes back to this process as its error
        cluster = stack.enter_context(distributed.LocalCluster(n_workers=args.workers, threads_per_worker=args.threads,
                                                               processes=True, dashboard_address=None,
                                                               silence_logs=logging.CRITICAL))
    client = stack.enter_context(distributed.Client(cluster))
    # closed first (the stack unwinds in reverse): what Dask logs about the heartbeats of workers that
    # are shutting down after the build is noise, not a failure of the command
    stack.callback(lambda: [logging.getLogger(n).setLevel(logging.CRITICAL)
                            for n in ("distributed", "distributed.core", "distributed.worker", "distributed.nanny",
                                      "tornado", "asyncio")])
    return client


def _cache(args) -> ChunkCache:
    return ChunkCache(args.cache_dir, create=False)  # one folder: _each_folder gives it


def _each_folder(fn):
    """``fn(args)`` once per cache folder of ``--cache-dir`` (several, one per drive, separated by
    ``os.pathsep``); the worst exit status. An ``OSError`` in a folder (read-only, gone, no
    permission) becomes a :class:`CacheError` naming the folder and ``--cache-dir``."""
    def one(args, folder) -> int:
        try:
            return fn(argparse.Namespace(**{**vars(args), "cache_dir": str(folder)}))
        except BrokenPipeError:  # the output's reader left (`| head`): not the folder's fault
            raise
        except OSError as e:
            what = e.strerror or type(e).__name__
            raise CacheError(f"`gpuload cache {args.action}` cannot use the cache folder {folder} ({what}"
                             + (f": {e.filename}" if e.filename else "") + "); check --cache-dir (it must be "
                             + ("writable)" if args.action in ("quota", "clear") or getattr(args, "delete", False)
                                else "readable)")) from None

    def run(args) -> int:
        folders = cache_dirs(split_dirs(args.cache_dir, "--cache-dir") if args.cache_dir else default_cache_dir())
        if _none_yet(args, folders):  # a first `gpuload cache info`: not a mistyped folder, just nothing cached yet
            print(f"nothing is cached yet: the default cache folder {folders} does not exist (gpuload makes it on "
                  "first use; --cache-dir or $GPULOAD_CACHE_DIR choose another)")
            return 0
        if not isinstance(folders, tuple):
            return one(args, folders)
        worst = 0
        for f in folders:  # a folder that fails (a dead drive) is said, and the others still done
            print(f"== {f}")
            try:
                worst = max(worst, one(args, f))
            except GpuloadError as e:
                print(f"gpuload: {e}")
                worst = max(worst, 1)
        return worst
    return run


def _none_yet(args, folders) -> bool:
    """Whether `cache info`, `verify` or `clear` (no SOURCE) looks at the default cache folder, chosen by
    neither --cache-dir nor $GPULOAD_CACHE_DIR, and it does not exist yet: nothing to show or do there. A
    folder the user named and that is missing is an error instead (a typo: it is named, not made)."""
    return (args.action in ("info", "verify", "clear") and not args.cache_dir and not getattr(args, "source", None)
            and not os.environ.get("GPULOAD_CACHE_DIR") and not isinstance(folders, tuple) and not folders.exists())


#: `cache info`'s flags that say how to open a SOURCE: meaningless without one
_SOURCE_FLAGS = ("storage_options", "columns", "fill_nulls", "dtypes", "categorical", "filter", "chunk_mib", "layout",
                 "shuffle", "block_rows", "nodes", "seed")


def cmd_info(args) -> int:
    given = [f"--{n.replace('_', '-')}" for n in _SOURCE_FLAGS if getattr(args, n, None) is not None]
    if given and not args.source:  # a user's trial: `cache info --filter 'junk'` printed the cache and exit 0
        raise ConfigError(f"{', '.join(given)} {'say' if len(given) > 1 else 'says'} how to open a SOURCE: give one "
                          "(`gpuload cache info SOURCE --nodes N` shows each node's share of it), or leave "
                          f"{'them' if len(given) > 1 else 'it'} out")
    opts = _share_options(args) if args.source else None  # bad flags are refused before anything is printed,
    cache = _cache(args)  # and a cache folder that is not there (opening the source would make it)
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):  # the cache as it was, before the source's opening used it
        print_summary(cache)
    # opened before anything is printed: bad columns or files are refused with the error alone
    shares = _node_shares(args, opts) if args.source else []
    print(summary.getvalue(), end="")
    for line in shares:
        print(line)
    return 0


def _share_options(args):
    """The Options `cache info SOURCE --nodes N` opens the source with. A local SOURCE is listed
    first (no request made), so one that is not there, or holds no Parquet, is the news: a user's
    trial was told to give --nodes for a mistyped path."""
    local = [item for item in args.source if not is_url(os.fspath(item))]
    if local:
        list_files(local)
    if args.nodes is None:
        raise ConfigError("cache info SOURCE shows each node's share of SOURCE under shard='node': give --nodes N "
                          "(the training's number of nodes), or leave SOURCE out to see the cache folder alone")
    if args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: the training's number of nodes is at least 1")
    return check_options(dict(loader_settings(args), device="cpu", pack_files=False))  # shard="node" never packs


def _node_shares(args, opts) -> list[str]:
    """The lines of a source's per node shares (shard='node' with --nodes nodes): chunks owned, and
    cached here."""
    from ..nodeplan import node_chunks
    from ..reader import open_reader

    reader = open_reader(source_of(args), opts, record=False)  # info changes no use or last-use date
    try:
        owned = node_chunks([c.rows for c in reader.chunks], args.nodes, fingerprint=reader.fingerprint,
                            seed=opts.seed)
        lines = [f"node shares of {', '.join(args.source)} ({len(reader.chunks)} chunks; shard='node', "
                 f"{args.nodes} nodes, seed {opts.seed}):"]
        for n, chunks in enumerate(owned):
            sizes = [st.st_size for st in map(reader.cached_file, map(int, chunks)) if st is not None]
            rows = sum(reader.chunks[int(i)].rows for i in chunks)
            lines.append(f"  node {n}: {len(chunks)} chunks, {rows:,} rows; {len(sizes)} cached here "
                         f"({sum(sizes) / 2**20:,.1f} MiB)")
        return lines
    finally:
        reader.close()


def cmd_verify(args) -> int:
    cache = _cache(args)
    shown = bar("verifying", len(list(cache.entries())), "file")
    checked = []
    try:
        bad = cache.verify_all(progress=lambda p: (checked.append(p), shown.update(1)))
    finally:
        shown.close()
    for path, problem, kind in bad:
        print(f"{kind.upper()} {problem}")
        if args.delete and kind == "corrupt":
            cache.delete(path)
    files_bad = len({p for p, _, _ in bad} & set(checked))
    corrupt = any(kind == "corrupt" for _, _, kind in bad)
    advice = ("" if not corrupt else " (corrupt files deleted: they are rebuilt on next use)" if args.delete else
              " (a corrupt file is never served: the next read rebuilds it from its source; --delete removes them "
              "now)") + ("" if all(kind == "corrupt" for _, _, kind in bad) else
                         " (what cannot be read: check its owner and permissions; a reader decodes such chunks "
                         "from Parquet)")
    print(f"{len(checked) - files_bad} of {len(checked)} cache files verified in {cache.root.path}"
          + (f"; {len(bad)} problems{advice}" if bad else ""))
    print_left_alone(cache.summary()["foreign"])
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


def cmd_quota(args) -> int:
    text = args.size.strip().lower()
    sets = text not in ("show", "none")
    if sets:
        try:
            nbytes = parse_size(args.size)
        except ValueError as e:
            raise ConfigError(f"gpuload cache quota {args.size!r}: {e}; e.g. 500G, or none to remove it") from None
    # a quota set ahead of the jobs that will fill the folder (a fresh node's NVMe): the folder is made
    cache = ChunkCache(args.cache_dir, create=sets)
    if sets:
        write_quota(cache.root, nbytes)
    elif text == "none":
        write_quota(cache.root, None)
    print(budget(ChunkCache(cache.root.path, create=False), cache.summary()["bytes"])[1])  # the quota read again
    return 0


def cmd_clear(args) -> int:
    cache = _cache(args)
    since = None if args.unused_since is None else _since(args.unused_since)
    if args.spec is not None and len(args.spec) < 4:
        raise ConfigError(f"--spec {args.spec!r}: give at least 4 characters of a column set's hash "
                          "(`gpuload cache info` lists them)")
    r = cache.clear(spec=args.spec, unused_since=since, include_open=args.include_open)
    which = "" if args.spec is None and since is None and not r.get("open") else f" ({len(r['specs'])} column sets)"
    print(f"cleared {cache.root.path}{which}: {r['files']} files, {r['freed'] / 2**20:,.1f} MiB freed")
    if r.get("open"):
        print(f"  kept {len(r['open'])} column sets a running dataset has open (in use now): "
              + ", ".join(h[:8] for h in r["open"]) + "; --include-open clears them too")
    print_left_alone(r["foreign"])
    if r["failed"]:
        print(f"  could not delete {len(r['failed'])} files: " + "; ".join(r["failed"][:5]))
        return 1
    return 0


def add_cache_commands(sub) -> None:
    """``gpuload cache build | info | verify | clear | quota`` on the command's subparsers ``sub``."""
    from ..config import BUILD_DEVICE, Options

    c = sub.add_parser("cache", help="build, inspect, verify, clear the cache, or set its quota")
    csub = c.add_subparsers(dest="action", required=True)
    b = csub.add_parser("build", help="convert a Parquet source into the cache ahead of training")
    b.add_argument("source", nargs="+", help="Parquet files, directories, globs or URLs (s3://, gs://, https://...)")
    add_source_flags(b)
    add_chunk_flags(b)
    b.add_argument("--threads", type=int, help=f"decode threads (default {Options.num_threads})")
    b.add_argument("--max-gib", type=float, help="this dataset's cache budget in GiB, within the folder's quota "
                   "or reserve (default none)")
    b.add_argument("--device", default=BUILD_DEVICE, help=f"cpu, cuda or auto: where to decode (default {BUILD_DEVICE})")
    add_cache_io_flag(b, off=False)
    how = b.add_mutually_exclusive_group()
    how.add_argument("--scheduler", help="build on this Dask cluster (a scheduler address, tcp://host:8786)")
    how.add_argument("--workers", type=int, help="build on a local Dask cluster of this many worker processes "
                     "(one per GPU with --device cuda, through dask-cuda)")
    b.add_argument("--nodes", type=int, help="with --scheduler: build each chunk on the node (host, in sorted "
                   "order) that owns it under shard='node' with this many nodes")
    b.add_argument("--seed", type=int, help=f"the training's seed, for --nodes (default {Options.seed})")
    b.set_defaults(fn=cmd_build)
    q = csub.add_parser("quota", help="set the cache folder's quota for every process using it (default: none; "
                                      "the disk then keeps 10%% free)")
    q.add_argument("size", nargs="?", default="show", help="a size (500G, 1.5T), none to remove it, or show")
    q.set_defaults(fn=_each_folder(cmd_quota))
    for name, fn, text in (("info", cmd_info, "what the cache holds"),
                           ("verify", cmd_verify, "check every cache file; exit 1 if any is corrupt"),
                           ("clear", cmd_clear, "delete gpuload's files in the cache (all, or some column sets)")):
        a = csub.add_parser(name, help=text)
        a.set_defaults(fn=_each_folder(fn))
        if name == "info":
            a.add_argument("source", nargs="*", help="with --nodes: show each node's share of this source")
            a.add_argument("--nodes", type=int, help="number of nodes of a shard='node' training")
            a.add_argument("--seed", type=int, help=f"the training's seed (default {Options.seed})")
            add_source_flags(a, as_built=True)
            add_chunk_flags(a, packs=False)  # shard='node' never packs
        if name == "verify":
            a.add_argument("--delete", action="store_true", help="delete corrupt files (rebuilt on next use)")
        if name == "clear":
            a.add_argument("--spec", help="only this column set (a spec hash, or its prefix, from `cache info`)")
            a.add_argument("--unused-since", help="only column sets (and remote sources' kept listings) not used "
                                                  "since a date (2026-11-01) or for an age (30d, 12h)")
            a.add_argument("--include-open", action="store_true",
                           help="clear column sets a running dataset has open too (kept by default; that dataset "
                                "then decodes their chunks again)")
    for a in [b] + [csub.choices[n] for n in ("info", "verify", "clear", "quota")]:
        a.add_argument("--cache-dir", help="cache folder, or folders (one per drive) separated by "
                       f"{os.pathsep!r} (default $GPULOAD_CACHE_DIR or ~/.cache/gpuload)")
