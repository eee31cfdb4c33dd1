"""Table formats: a Delta Lake or Iceberg folder is read as its table, never file by file.

A table format keeps the Parquet files of many versions of a table in one folder: the
files that an overwrite, a ``DELETE``, an ``UPDATE`` or a compaction replaced stay there
until they are vacuumed, and only the table's log says which files hold the table now.
Read file by file, such a folder serves deleted and replaced rows. So before a listed
folder (or glob) is read, gpuload looks for a table there, or above the partition folders
listed:

* **Delta Lake** (a ``_delta_log/`` folder): only the files live in the table's latest
  version are read, each with the partition values the log gives it, typed by the
  table's schema (not guessed from folder names). The log is read with the ``deltalake``
  package (``pip install gpuload[delta]``); without it the folder is refused with what to
  pass instead. A remote table's log (from its last checkpoint on) is copied to a
  temporary folder to be read. Refused, naming the table: rows masked by deletion
  vectors (the files still hold them), column mapping (files' columns have other
  names), and live files outside the table's folder (shallow clones).
* **Apache Iceberg** (a ``metadata/`` folder holding ``*.metadata.json``): refused, with
  the pyiceberg call that lists a snapshot's live files to pass instead.

To read another Delta version, pass its files: ``DeltaTable(path, version=n).file_uris()``
(without partition columns, which then exist only in the log).
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable
from urllib.parse import unquote

import pyarrow as pa

from ..errors import SourceError

__all__ = ["Table", "find_table", "delta_files", "delta_log_names", "local_table_files", "remote_table_files"]

_DELTA_LOG = "_delta_log"
_VERSIONED = re.compile(r"^(\d{20})\.")  # a commit or checkpoint file of the log, by its version


@dataclass(frozen=True)
class Table:
    """A table found at ``root`` (a local path or a store's path): ``kind`` is ``"delta"`` or ``"iceberg"``."""

    kind: str
    root: str


def _ancestors(base: str) -> Iterable[str]:
    """``base``, then the folders above it while the one below is a partition folder (``key=value``),
    and the table folder above an Iceberg ``data/`` folder."""
    cur = base.rstrip("/") or "/"
    yield cur
    while True:
        name = posixpath.basename(cur)
        parent = posixpath.dirname(cur)
        if not parent or parent == cur or not ("=" in name or name == "data"):
            return
        cur = parent
        yield cur


def find_table(base: str, is_dir: Callable[[str], bool], names: Callable[[str], list[str]],
               below: Iterable[str] | None = None) -> Table | None:
    """The table whose folder is ``base`` or holds it (through partition folders), or None.

    ``is_dir(path)`` and ``names(folder)`` (the names in a folder) look at the filesystem;
    ``below`` (paths relative to ``base`` already listed, hidden ones included) answers for
    ``base`` itself without asking the filesystem again.
    """
    for i, folder in enumerate(_ancestors(base)):
        if i == 0 and below is not None:
            rels = list(below)
            if any(r.startswith(_DELTA_LOG + "/") for r in rels):
                return Table("delta", folder)
            if any(r.startswith("metadata/") and r.endswith(".metadata.json") for r in rels):
                return Table("iceberg", folder)
            continue
        if is_dir(posixpath.join(folder, _DELTA_LOG)):
            return Table("delta", folder)
        meta = posixpath.join(folder, "metadata")
        if is_dir(meta) and any(n.endswith(".metadata.json") for n in names(meta)):
            return Table("iceberg", folder)
    return None


def refuse_iceberg(table: Table, shown: str) -> SourceError:
    return SourceError(
        f"{shown} is an Apache Iceberg table: its folder keeps the data files of every snapshot (deleted and "
        "replaced rows included), so gpuload does not read it file by file. Pass the live files of the snapshot you "
        "want: with pyiceberg, [task.file.file_path for task in catalog.load_table(name).scan().plan_files()] (a "
        "scan with delete files needs its deletes applied first)")


def delta_log_names(names: Iterable[str]) -> list[str]:
    """Of the names in a Delta log folder (relative to it), those a reader needs: everything
    from the last checkpoint on (``_last_checkpoint`` says which; without it, the whole log),
    checksum files left out."""
    names = [n for n in names if not n.endswith(".crc")]
    checkpoints = [int(m.group(1)) for n in names if ".checkpoint." in n and (m := _VERSIONED.match(n))]
    if "_last_checkpoint" not in names or not checkpoints:
        return names
    first = max(checkpoints)
    return [n for n in names if not (m := _VERSIONED.match(posixpath.basename(n))) or int(m.group(1)) >= first
            or n.startswith("_sidecars/")]


def copy_log(names: list[str], read: Callable[[str], bytes]) -> tempfile.TemporaryDirectory:
    """A temporary folder (a context manager giving its path) holding ``_delta_log/<name>`` for
    each name, read with ``read(name)``."""
    tmp = tempfile.TemporaryDirectory(prefix="gpuload-delta-")
    try:
        for n in names:
            dest = os.path.join(tmp.name, _DELTA_LOG, *n.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as fh:
                fh.write(read(n))
    except BaseException:
        tmp.cleanup()
        raise
    return tmp


def delta_files(table_dir: str, shown: str) -> tuple[dict[str, tuple], pa.Schema]:
    """The live files of the Delta table whose log is in local folder ``table_dir``:
    ``({path relative to the table folder: ((key, value), ...)}, partition fields)``.
    ``shown`` names the table in errors."""
    try:
        from deltalake import DeltaTable
    except ImportError:
        raise SourceError(
            f"{shown} is a Delta Lake table: its folder keeps files the table has removed, so gpuload reads it only "
            "through its log, with the deltalake package: pip install gpuload[delta]. Or pass its live files: "
            "deltalake.DeltaTable(path).file_uris() (partition columns are then not loaded)") from None
    try:
        dt = DeltaTable(table_dir)
        config = dt.metadata().configuration or {}
        partitions = list(dt.metadata().partition_columns)
        schema = pa.schema(dt.schema().to_arrow())
        adds = pa.table(dt.get_add_actions(flatten=True))
        features = dt.protocol().reader_features or []
    except Exception as e:  # the log is read by delta-rs, whose errors share no base class
        raise SourceError(f"{shown}: its Delta log cannot be read ({type(e).__name__}: {e}); check the table with "
                          "deltalake.DeltaTable(path)") from None
    mode = config.get("delta.columnMapping.mode", "none")
    if mode != "none":
        raise SourceError(f"{shown}: a Delta table with column mapping (mode {mode!r}): its files name columns "
                          "otherwise than the table; gpuload cannot read it yet. Rewrite it without column mapping")
    if "deletionVectors" in features and _has_deletion_vectors(dt):
        raise SourceError(f"{shown}: rows of this Delta table are deleted by deletion vectors that its files still "
                          "hold; gpuload would serve them. Purge them first (Spark: REORG TABLE ... APPLY (PURGE)), "
                          "or write the table anew")
    fields = pa.schema([schema.field(k) for k in partitions])
    live: dict[str, tuple] = {}
    values = {k: adds.column(f"partition.{k}").to_pylist() for k in partitions}
    for i, path in enumerate(adds.column("path").to_pylist()):
        rel = unquote(path)
        if "://" in path or rel.startswith("/"):
            raise SourceError(f"{shown}: live file {path} lies outside the table's folder (a shallow clone?); "
                              "pass deltalake.DeltaTable(path).file_uris() instead")
        live[rel] = tuple((k, values[k][i]) for k in partitions)
    return live, fields


def _has_deletion_vectors(dt) -> bool:
    try:
        return dt.deletion_vectors().read_all().num_rows > 0
    except Exception:  # a vector that cannot be read: it may mask rows, so it counts
        return True


def _select(root: str, base: str, live: dict[str, tuple], fields: pa.Schema, listed: Iterable[str],
            whole: bool, shown: str) -> dict[str, tuple]:
    """``{listed path: (fields, keys)}`` of the listed paths that are live files of the table at
    ``root``; with ``whole`` (a folder listed, not a glob), every live file below ``base`` must be there."""
    out = {p: (fields, live[rel]) for p in listed if (rel := posixpath.relpath(p, root)) in live}
    if whole:
        below = posixpath.relpath(base, root)
        want = {r for r in live if below == "." or r.startswith(below + "/")}
        missing = sorted(want - {posixpath.relpath(p, root) for p in out})
        if missing:
            raise SourceError(f"{shown}: the Delta table's live file {missing[0]} is missing ({len(missing)} of "
                              f"{len(want)}): the table is damaged (files vacuumed or deleted by hand); repair it "
                              "(deltalake's DeltaTable.repair, Spark's FSCK REPAIR TABLE) or pass the files")
    return out


def local_table_files(base: str, listed: list[str], whole: bool) -> dict[str, tuple] | None:
    """For local paths ``listed`` under folder (or glob base) ``base``: None when no table holds
    them, else ``{path: (partition fields, keys)}`` for those live in the Delta table (an
    Iceberg table is refused)."""
    table = find_table(base, os.path.isdir, os.listdir)
    if table is None:
        return None
    if table.kind == "iceberg":
        raise refuse_iceberg(table, table.root)
    live, fields = delta_files(table.root, table.root)
    return _select(table.root, base, live, fields, listed, whole, table.root)


def remote_table_files(store, base: str, listed: list[str], below: list | None, whole: bool,
                       read: Callable[[str, int], bytes]) -> dict[str, tuple] | None:
    """:func:`local_table_files` for the objects ``listed`` (store paths) below ``base`` of
    ``store`` (a :class:`gpuload.sources.remote.Store`); ``below`` is what the listing of
    ``base`` found (objects, see :meth:`Store.expand`), ``read(path, size)`` an object's bytes."""
    table = find_table(base, store.is_dir, lambda folder: [posixpath.basename(i.path) for i in store.find(folder)],
                       None if below is None else [posixpath.relpath(i.path, base) for i in below])
    if table is None:
        return None
    shown = store.url(table.root)
    if table.kind == "iceberg":
        raise refuse_iceberg(table, shown)
    log = posixpath.join(table.root, _DELTA_LOG)
    in_log = [i for i in below if i.path.startswith(log + "/")] if table.root == base and below else store.find(log)
    objects = {posixpath.relpath(i.path, log): (i.path, i.size) for i in in_log}
    with copy_log(delta_log_names(objects), lambda n: read(*objects[n])) as folder:
        live, fields = delta_files(folder, shown)
    return _select(table.root, base, live, fields, listed, whole, shown)
