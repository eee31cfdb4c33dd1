"""Source: list Parquet files, fingerprint them and read their footers.

Everything here runs once, when a dataset is opened, and only reads Parquet footers:
no column data. It also does every check that can fail before work starts: missing
files, unreadable footers, columns missing or typed differently across files, and
nulls reported by the row-group statistics.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .errors import NullValuesError, SchemaError, SourceError
from .schema import FIXED, RAGGED, OutputSpec

__all__ = ["SourceFile", "list_files", "open_files", "check_consistent", "check_null_stats", "row_group_sizes",
           "fingerprint"]

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class SourceFile:
    """One Parquet file: identity (path, size, mtime) and its footer."""

    path: str
    size: int
    mtime_ns: int
    metadata: pq.FileMetaData
    schema: pa.Schema

    @property
    def version(self) -> str:
        """A short token that changes whenever the file's size or mtime does."""
        return xxhash.xxh64_hexdigest(f"{self.size}:{self.mtime_ns}".encode())

    def stat_matches(self) -> bool:
        """True if the file on disk still has the size and mtime recorded here."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_size == self.size and st.st_mtime_ns == self.mtime_ns


def _is_data_file(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(("_", "."))


def list_files(source) -> list[str]:
    """Absolute paths of the Parquet files named by ``source``, in a stable order.

    ``source`` is a file, a directory (searched recursively for ``*.parquet``, skipping
    names that start with ``_`` or ``.``), a glob (``**`` recurses), or a list of these.
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise SourceError("source is an empty list: pass a Parquet file, a directory or a glob")
    found: dict[str, None] = {}
    for item in items:
        text = os.fspath(item)
        if "://" in text and not text.startswith("file://"):
            raise SourceError(f"{text}: remote sources are not supported yet; copy the files to a local disk")
        text = text.removeprefix("file://")
        p = Path(text).expanduser()
        if p.is_dir():
            matches = sorted(q for q in p.rglob("*.parquet") if _is_data_file(q))
        elif _GLOB_CHARS & set(text):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if _is_data_file(Path(m)))
        elif p.is_file():
            matches = [p]
        else:
            raise SourceError(f"{text}: no such file or directory")
        if not matches:
            raise SourceError(f"{text}: matched no Parquet files")
        for m in matches:
            found[str(m.resolve())] = None
    return list(found)


def open_files(paths: Sequence[str]) -> list[SourceFile]:
    """Stat each file and read its footer; a :class:`SourceError` names a bad file."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: not a readable Parquet file ({e}); remove it or narrow the source") from None
        out.append(SourceFile(path, st.st_size, st.st_mtime_ns, meta, schema))
    return out


def _logical(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def check_consistent(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Every file has every selected column, with the same (dictionary-decoded) type."""
    first = files[0]
    for f in files[1:]:
        for s in specs:
            for c in s.columns:
                want = _logical(first.schema.field(c).type)
                if c not in f.schema.names:
                    raise SchemaError(f"column {c!r} is in {first.path} but not in {f.path}; "
                                      "select columns every file has, or fix the files")
                got = _logical(f.schema.field(c).type)
                if got != want:
                    raise SchemaError(f"column {c!r} is {want} in {first.path} but {got} in {f.path}; "
                                      "rewrite the files with one type for it")


def check_null_stats(files: Sequence[SourceFile], specs: Sequence[OutputSpec]) -> None:
    """Raise :class:`NullValuesError` for scalar columns whose statistics report nulls
    and that have no fill value. (List columns, and files without statistics, are
    checked while decoding.)"""
    for s in specs:
        if s.kind in (RAGGED, FIXED):
            continue
        for c, fill in zip(s.columns, s.fills):
            if fill is not None:
                continue
            nulls, where = 0, []
            for f in files:
                leaf = _leaves(f)[c]
                for g in range(f.metadata.num_row_groups):
                    st = f.metadata.row_group(g).column(leaf).statistics
                    if st is not None and st.has_null_count and st.null_count:
                        nulls += st.null_count
                        where.append(f.path)
            if nulls:
                files_named = ", ".join(dict.fromkeys(where))
                raise NullValuesError(
                    f"column {c!r} has {nulls} null values (in {files_named}); pass "
                    f"fill_nulls={{{c!r}: value}} (or a scalar for all columns) to replace them")


def _leaves(f: SourceFile) -> dict[str, int]:
    """Top-level column name -> index of its first Parquet leaf column."""
    out: dict[str, int] = {}
    for i in range(len(f.metadata.schema)):
        out.setdefault(f.metadata.schema.column(i).path.split(".")[0], i)
    return out


def row_group_sizes(f: SourceFile, specs: Sequence[OutputSpec]) -> list[tuple[int, int]]:
    """Per row group of ``f``: (rows, estimated bytes once converted to ``specs``)."""
    fixed_per_row = sum(np.dtype(s.dtype).itemsize * s.width for s in specs if s.kind != RAGGED)
    ragged = [(s, np.dtype(s.dtype).itemsize) for s in specs if s.kind == RAGGED]
    leaves = _leaves(f)
    out = []
    for g in range(f.metadata.num_row_groups):
        rg = f.metadata.row_group(g)
        n = rg.num_rows
        size = n * fixed_per_row
        for s, item in ragged:
            leaf = leaves.get(s.columns[0])
            values = rg.column(leaf).num_values if leaf is not None else n
            size += values * item + (n + 1) * 8
        out.append((n, size))
    return out


def fingerprint(files: Sequence[SourceFile]) -> int:
    """A 63-bit fingerprint of the files' identities (path, size, mtime, rows)."""
    h = xxhash.xxh64()
    for f in files:
        h.update(f"{f.path}\0{f.size}\0{f.mtime_ns}\0{f.metadata.num_rows}\n".encode())
    return h.intdigest() & (2**63 - 1)
