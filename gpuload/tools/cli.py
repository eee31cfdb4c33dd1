"""The ``gpuload`` command: demo, profile and cache management (:mod:`gpuload.tools.cache_cmds`).

User mistakes print one line ``gpuload: error: ...`` on stderr and exit with status 2;
a cache that fails verification exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from .. import __version__
from ..config import Options
from ..errors import ConfigError, GpuloadError, set_style
from .cache_cmds import add_cache_commands
from .flags import add_cache_io_flag, add_chunk_flags, add_source_flags, check_options, finite, loader_settings, source_of
from .flags import bar as flag_bar

__all__ = ["main", "parser"]

MAX_DEMO_FILES = 1000  #: the demo's --files at most: it shows a loader, not a file system's limits


def cmd_demo(args) -> int:
    from .demo import report, run_demo

    if args.rows < 1000:
        raise ConfigError(f"--rows {args.rows}: the demo needs at least 1000 rows")
    most = min(args.rows, MAX_DEMO_FILES)
    if not 1 <= args.files <= most:
        raise ConfigError(f"--files {args.files}: give from 1 to {most:,} files"
                          + (f" (--rows is {args.rows:,})" if most == args.rows else ""))
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give at least 1 row")
    finite("--step-ms", args.step_ms)  # every mistake before the data is generated
    if args.workdir is not None and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        raise ConfigError(f"--workdir {args.workdir}: that is a file; give a folder (made if missing)")
    if args.workdir is not None:
        _writable_folder("--workdir", Path(args.workdir))
    owned = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gpuload-demo-")) if owned else Path(args.workdir)
    bars = []

    def progress(name, total):
        bar = flag_bar(name, total, "row")
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


def _writable_folder(flag: str, path: Path) -> None:
    """Make ``path`` (a folder the command writes into) if missing, and refuse it, naming ``flag``,
    where it cannot be made or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a folder you can write") from None


def _writable_file(flag: str, path: Path, sources=()) -> None:
    """Refuse, naming ``flag``, a file the command could not write at its end (its results would
    be lost): opened for appending now (nothing of it is changed), and removed again if it was new;
    and one whose writing would destroy or add data: a file of the local ``sources``, a new
    ``.parquet`` name in one of their folders (the next listing would read it), an existing Parquet file."""
    from ..sources.remote import is_url

    target = os.path.realpath(path)
    for source in map(str, sources):
        if is_url(source):
            continue
        root = os.path.realpath(source.removeprefix("file://"))
        if target == root:
            raise ConfigError(f"{flag} {path}: that is the source {source}; write it outside the source")
        if target.startswith(root.rstrip(os.sep) + os.sep) and path.name.endswith(".parquet"):
            raise ConfigError(f"{flag} {path}: " + (f"that is a file of the source {source}; write it outside the source"
                                                    if path.exists() else f"a new .parquet file in the source folder "
                                                    f"{source} would be read as data; give another name"))
    if os.path.isfile(path):  # (a FIFO or a device is never read here)
        with contextlib.suppress(OSError), open(path, "rb") as f:
            if f.read(4) == b"PAR1":
                raise ConfigError(f"{flag} {path}: that is a Parquet file; give another name")
    new = not path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror or e}); give a file you can write") from None
    if new:
        with contextlib.suppress(OSError):
            path.unlink()


def rank_path(path: str, rank: int) -> str:
    """``path`` for one rank: ``runs.v2/t.json.gz`` -> ``runs.v2/t.rank0.json.gz`` (the folder as it is)."""
    from pathlib import Path

    p = Path(path)
    stem, dot, ext = p.name.partition(".")
    return str(p.with_name(f"{stem}.rank{rank}{dot}{ext}"))


def _launched_rank() -> int | None:
    """This process's ``RANK`` under a launcher that set ``WORLD_SIZE`` > 1 (torchrun); None for one process."""
    from ..ranks import _env_int

    return None if (_env_int("WORLD_SIZE", 1) or 1) <= 1 else _env_int("RANK", 0) or 0


def _process_group():
    """Under a launcher that set ``WORLD_SIZE`` > 1 (torchrun): a gloo process group for the
    profile's gathers ("made", or "there" when one exists already); None for one process."""
    if _launched_rank() is None:
        return None
    import torch.distributed as dist

    if dist.is_initialized():
        return "there"
    dist.init_process_group("gloo")
    return "made"


def cmd_profile(args) -> int:
    from .profile import profile

    if args.epochs < 1:
        raise ConfigError(f"--epochs {args.epochs}: profile at least one epoch")
    if args.trace and (Path(args.trace).is_dir() or not Path(args.trace).parent.is_dir()):
        raise ConfigError(f"--trace {args.trace}: " + ("that is a folder; give a file name" if Path(args.trace).is_dir()
                                                       else f"its folder {Path(args.trace).parent} does not exist"))
    if args.trace:  # (under torchrun each rank writes its own file beside it: rank_path)
        rank = _launched_rank()  # the name this rank will write
        _writable_file("--trace", Path(args.trace if rank is None else rank_path(args.trace, rank)), args.source)
    finite("--step-ms", args.step_ms)
    if args.step_ms is not None and args.step_ms > 60_000:
        raise ConfigError(f"--step-ms {args.step_ms}: a simulated step of over a minute is not a training step")
    settings = loader_settings(args)
    opts = check_options(settings)  # before anything is printed
    src = source_of(args)
    step_ms = 5.0 if args.step_ms is None else args.step_ms
    step = "a small MLP" if args.model == "mlp" else f"a simulated {step_ms:g} ms step"
    ranks = _process_group()  # under torchrun: every rank profiles its share; rank 0 prints them all
    rank = 0
    if ranks is not None:
        import torch.distributed as dist

        rank = dist.get_rank()
        if args.trace:  # a trace per rank
            args.trace = rank_path(args.trace, rank)

    def heading(ds) -> None:  # once the source and the cache folder are open: a mistake prints only its error
        if rank == 0:
            print(f"profiling {args.epochs} epoch{'s' if args.epochs > 1 else ''} of {', '.join(args.source)} under "
                  f"{step}, batches of {opts.batch_size:,} rows"
                  + ("" if ranks is None else f" on each of {dist.get_world_size()} ranks"), file=sys.stderr)

    reports = profile(src.source, src.columns, epochs=args.epochs, step_ms=step_ms, model=args.model, trace=args.trace,
                      headspace=args.headspace, all_ranks=ranks is not None, opened=heading,
                      fill_nulls=src.fill_nulls, dtypes=src.dtypes, categorical=src.categorical, filters=src.filters,
                      storage_options=src.storage_options, **settings)
    if ranks is not None:
        dist.barrier()
        if ranks == "made":
            dist.destroy_process_group()
        if rank != 0:
            return 0
    for r in reports:
        print(r)
        print()
    if args.trace:
        print(f"trace written to {args.trace}: open it in https://ui.perfetto.dev")
    if args.verbose:
        print(reports[-1].stats)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too: they take its class) with each error in one line,
    as every other error of the command, and where to look: the help of the command the words
    typed name (argparse reports a subcommand's unknown flags from the top parser)."""

    _argv: list = []  # the words being parsed, for the top parser's errors

    def parse_args(self, args=None, namespace=None):
        argv = _Parser._argv = sys.argv[1:] if args is None else [str(a) for a in args]
        ns, extra = self.parse_known_args(argv, namespace)
        if extra:
            words = [w for w in (getattr(ns, "command", None), getattr(ns, "action", None)) if w]
            self.exit(2, f"gpuload: error: unrecognized arguments: {' '.join(extra)} "
                         f"(see {' '.join(['gpuload', *words])} --help)\n")
        return ns

    def error(self, message):
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        missing = sub is not None and message.endswith(f"required: {sub.dest}")  # maybe a misplaced flag
        wrong = None if sub is None else re.match(rf"argument {sub.dest}: invalid choice: '(.*?)'", message)
        if missing or wrong:
            argv, last = _Parser._argv, self.prog.split()[-1]  # this parser's words: after its command's
            argv = argv[argv.index(last) + 1:] if last in argv and self.prog != "gpuload" else argv
            if wrong and wrong[1] in argv:  # the words before the one taken for a command (a flag's value?)
                argv = argv[:argv.index(wrong[1])]
            flags = [w for w in argv if w.startswith("-") and w.split("=")[0] not in self._option_string_actions]
            if missing or flags:  # a flag before the command (its value taken for the command): name the flag
                message = (f"unrecognized arguments: {' '.join(flags)}; " if flags else "") + \
                    f"give a command first: {', '.join(sub.choices)}"
        self.exit(2, f"gpuload: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpuload", description="Parquet to training batches, cached and converted.")
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
    add_source_flags(f)
    how = f.add_mutually_exclusive_group()
    how.add_argument("--step-ms", type=float, help="simulated training step in ms (default 5)")
    how.add_argument("--model", choices=["mlp"], help="a small real MLP over the dense outputs instead")
    f.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default {Options.device})")
    f.add_argument("--epochs", type=int, default=2, help="epochs to run (default 2: cold, then cached)")
    f.add_argument("--batch-size", type=int, help=f"rows per batch (default {Options.batch_size})")
    f.add_argument("--threads", type=int, help=f"loader threads (default {Options.num_threads})")
    f.add_argument("--prefetch", type=int, help=f"chunks loaded ahead (default {Options.prefetch})")
    f.add_argument("--nice", type=int, help=f"nice steps below the training thread for the loader's threads, "
                                            f"0-19 (default {Options.nice})")
    add_chunk_flags(f)
    f.add_argument("--trace", help="write a Chrome trace-event JSON file (open in Perfetto)")
    f.add_argument("--headspace", action="store_true",
                   help="first run the loader alone (no step, an empty temporary cache): is the loader or the "
                        "step the limit?")
    f.add_argument("--cache-dir", help="cache folder (default $GPULOAD_CACHE_DIR or ~/.cache/gpuload)")
    add_cache_io_flag(f)
    f.set_defaults(fn=cmd_profile)

    add_cache_commands(sub)
    return p


class _Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``, Slurm, ``docker stop``) as an exception: the command's
    ``finally`` blocks run (the demo's temporary folder is removed, as on Ctrl-C). A
    ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except Exception`` of the library
    (a retried request, a Delta log read) takes it for an error of its own."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
    raise _Terminated()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    set_style("cli")  # messages name flags (--fill-nulls ...), not Python arguments
    previous = None
    if threading.current_thread() is threading.main_thread():  # only there can a handler be set
        previous = signal.getsignal(signal.SIGTERM)  # None: one set from C, left alone
        if previous is not None:
            signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        status = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `gpuload cache info | head`: the reader left; said by the status alone, as by `ls`
        with contextlib.suppress(OSError, ValueError):  # (no flush error at exit; pytest's capture has no fd)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except GpuloadError as e:  # one line; messages name settings as flags (errors.setting)
        print(f"gpuload: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine's, not gpuload's: one line, not a traceback
        print(f"gpuload: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpuload: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        previous = None  # still ignored: a later SIGTERM would kill the process before it exits with 143
        print("gpuload: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        set_style("python")


if __name__ == "__main__":
    sys.exit(main())
