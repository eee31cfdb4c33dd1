"""Column-set descriptions: ``v3/specs/<hash>.json``, what each column set a cache holds is (its
outputs, their columns and dtypes: ``gpuload cache info`` shows them) and, by the file's mtime,
when a dataset last opened it (``gpuload cache clear --unused-since`` goes by it).

Written (atomically) by the first dataset that opens a column set, touched by every later one,
written again where damaged; ``gpuload cache verify`` reports a damaged one (:func:`spec_problem`).
"""

from __future__ import annotations

import json
import os
import stat
import time

from .chunkfile import LAYOUT_DIR, MALFORMED, SPECS_DIR, spec_hash
from .directio import pwrite_all
from .fs import TEMP, CacheRoot
from ..layout import stored_outputs

__all__ = ["read_desc", "spec_problem", "record_spec"]

_LAYOUT, _SPECS = LAYOUT_DIR, SPECS_DIR


def _valid_desc(desc) -> list | None:
    """``desc`` if it is a spec description (list of outputs with name, columns, kind, dtype, width), else None."""
    if not isinstance(desc, list):
        return None
    try:
        stored_outputs(desc)
        if all(isinstance(d["columns"], list) and all(isinstance(c, str) for c in d["columns"]) for d in desc):
            return desc
    except MALFORMED:
        pass
    return None


_MAX_SPEC = 64 << 20  # bytes of a description read at most (as a chunk header's): 5,000 columns take 1.3 MiB


def read_desc(root: CacheRoot, name: str) -> list | None:
    """The column-set description in ``specs/<name>``, or None where it is not one (or is larger
    than any gpuload writes). Raises the ``OSError`` of opening or reading it."""
    fd = root.open_read((_LAYOUT, _SPECS), name)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_SPEC + 1)
    try:
        return _valid_desc(json.loads(raw)) if len(raw) <= _MAX_SPEC else None
    except (ValueError, RecursionError):
        return None


def spec_problem(root: CacheRoot, name: str) -> str | None:
    """What is wrong with the column-set description ``specs/<name>``, or None: it must be a
    description whose hash is its name's (``cache info`` names and describes caches by it)."""
    desc = read_desc(root, name)
    if desc is None:
        return "not a column-set description (the next dataset that opens this column set writes it again)"
    if spec_hash(desc) != name[:-5]:
        return f"describes column set {spec_hash(desc)}, not {name[:-5]}"
    return None


def record_spec(root: CacheRoot, key_spec: str, desc: list) -> None:
    """Record that column set ``desc`` (hash ``key_spec``) is in use now: write its
    ``specs/<key_spec>.json`` if missing or not its description (after deleting temporaries
    of it left over a minute ago by a killed writer), else set that file's mtime to now
    (never that of a file another name shares). Raises the ``OSError`` met (a read-only cache)."""
    name = f"{key_spec}.json"
    st = root.lstat((_LAYOUT, _SPECS), name)
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and spec_problem(root, name) is not None:
        st = None  # damaged (cut short, overwritten): written again, atomically, over it
    if st is None:
        for tmp, tst in root.scan((_LAYOUT, _SPECS)):  # left by a writer killed a while ago
            if tmp.startswith(name + ".tmp.") and time.time() - tst.st_mtime > 60:
                root.unlink((_LAYOUT, _SPECS), tmp, TEMP)
        text = json.dumps(desc, indent=1).encode()
        root.write((_LAYOUT, _SPECS), name, lambda fd: pwrite_all(fd, text, 0))
    elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # never a file another name shares
        with root.folder((_LAYOUT, _SPECS)) as d:
            os.utime(name, dir_fd=d, follow_symlinks=False)
