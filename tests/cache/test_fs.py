"""The cache's file system boundary: gpuload deletes only its own files inside the root,
never follows a link out of it, never blocks on or serves an odd entry, and serves
exact data (with one warning) when the cache cannot be read, locked or written.

Permission tests need file modes to apply to the reader: as root (CI) they run it
without the capabilities that bypass them (``setpriv`` dropping ``CAP_DAC_OVERRIDE``,
``CAP_DAC_READ_SEARCH`` and ``CAP_FOWNER``), so it is refused exactly as another user
would be; as another user they run it as is.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gpuload
from gpuload.cache.store import ChunkCache
from gpuload.cache.chunkfile import LAYOUT_DIR
from gpuload.cache.fs import CacheRoot, ForeignEntry, Lock
from gpuload.tools.cli import main
from gpuload.synth import clicklog_columns, write_clicklog

from conftest import dataset_factory, python, spawn

COLUMNS = {**clicklog_columns(2, 2), "row_id": "row_id"}
CHUNK_BYTES = 1 << 14

# a test's cache writes end with it: one still queued would write into the next test, through its
# patched os functions (test_injected_os_errors_serve_exact_data once saw the test before's warning)
pytestmark = pytest.mark.usefixtures("no_leftover_threads")


def _data(path, rows=3000, files=3):
    return write_clicklog(path, rows=rows, files=files, row_group_rows=250, dense=2, sparse=2, list_max=3)


_ds = dataset_factory(COLUMNS, batch_size=400, chunk_bytes=CHUNK_BYTES)


def _exact(ds, n):
    """One epoch holds every row exactly once, with the values pyarrow reads (row_id-derived)."""
    ids, label, dense = [], [], []
    for b in ds:
        ids.append(b["row_id"].numpy())
        label.append(b["label"].numpy())
        dense.append(b["dense"].numpy())
    ids = np.concatenate(ids)
    assert np.array_equal(np.sort(ids), np.arange(n))
    return ids, np.concatenate(label), np.concatenate(dense)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdata")
    _data(d)
    return d


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The values of a clean cold epoch, per row_id."""
    ids, label, dense = _exact(_ds(data, tmp_path_factory.mktemp("ref"), shuffle=False), 3000)
    return label[np.argsort(ids)], dense[np.argsort(ids)]


def _check(ds, reference):
    ids, label, dense = _exact(ds, 3000)
    np.testing.assert_array_equal(label, reference[0][ids])
    np.testing.assert_array_equal(dense, reference[1][ids])


def _built(data, cache) -> ChunkCache:
    ds = _ds(data, cache)
    list(ds)
    ds.reader.cache.flush()
    return ds.reader.cache


def _tree(path) -> dict:
    """Every entry below ``path`` (not following links): relative path -> (kind, bytes)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(path))] = (stat.S_IFMT(st.st_mode),
                                             p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


# ---------------------------------------------------------------------------------------
# deletion never leaves gpuload's own files in the root
# ---------------------------------------------------------------------------------------

def _foreign(tmp_path) -> Path:
    """A folder of someone else's files, some with names gpuload writes."""
    f = tmp_path / "foreign"
    (f / "0123456789abcdef").mkdir(parents=True)
    (f / "precious.txt").write_text("keep me")
    name = "0123456789abcdef-0123456789abcdef-0-1.glc"
    for p in (f / name, f / (name + ".lock"), f / (name + ".tmp.1.0badf00d"), f / "0123456789abcdef" / name):
        p.write_text("not gpuload's")
    return f


@pytest.mark.parametrize("plant", ["folder_link", "layout_link", "file_links", "hard_links", "foreign_files",
                                   "root_link"])
def test_clear_deletes_nothing_outside_its_own_files(data, tmp_path, plant, reference):
    cache = tmp_path / "cache"
    _built(data, cache)
    foreign = _foreign(tmp_path)
    before = _tree(foreign)
    layout = cache / LAYOUT_DIR
    folders = sorted(p for p in layout.iterdir() if p.name != "specs")
    chunk = sorted(folders[0].glob("*.glc"))[0]
    if plant == "folder_link":  # a source folder replaced by a link to someone else's folder
        shutil.rmtree(folders[0])
        folders[0].symlink_to(foreign, target_is_directory=True)
    elif plant == "layout_link":  # the whole layout folder is a link
        shutil.move(str(layout), str(tmp_path / "moved"))
        layout.symlink_to(foreign, target_is_directory=True)
    elif plant == "file_links":  # links named like gpuload's files, to foreign files
        (folders[1] / "0123456789abcdef-0123456789abcdef-5-6.glc").symlink_to(foreign / "precious.txt")
        (folders[1] / "0123456789abcdef-0123456789abcdef-5-6.glc.lock").symlink_to(foreign / "precious.txt")
        chunk.unlink()
        chunk.symlink_to(foreign / "0123456789abcdef-0123456789abcdef-0-1.glc")
    elif plant == "hard_links":  # a foreign file hard-linked under a chunk's name, and a chunk linked outside
        os.link(foreign / "precious.txt", folders[1] / "0123456789abcdef-0123456789abcdef-7-8.glc")
        os.link(chunk, foreign / "kept-chunk.glc")
        before = _tree(foreign)
    elif plant == "foreign_files":  # someone else's files inside the cache
        (folders[0] / "notes.txt").write_text("mine")
        (layout / "README").write_text("mine")
        (folders[0] / "sub").mkdir()
        (folders[0] / "sub" / chunk.name).write_text("mine")
    elif plant == "root_link":  # the cache root itself is a link (allowed: e.g. to NVMe)
        real = tmp_path / "real"
        shutil.move(str(cache), str(real))
        cache.symlink_to(real, target_is_directory=True)
    inside = _tree(cache) if plant in ("foreign_files", "root_link") else None

    r = ChunkCache(cache, create=False).clear()
    assert _tree(foreign) == before, "a file outside the cache root was changed"
    left = _tree(cache)
    if plant == "foreign_files":
        for name in (f"{LAYOUT_DIR}/README", f"{LAYOUT_DIR}/{folders[0].name}/notes.txt", f"{LAYOUT_DIR}/{folders[0].name}/sub/{chunk.name}"):
            assert left[name] == inside[name]
        assert len(r["foreign"]) >= 2
    elif plant == "folder_link":
        assert os.path.islink(folders[0]) and any("symbolic link" in f for f in r["foreign"])
    elif plant == "file_links":
        links = [k for k, (kind, _) in left.items() if kind == stat.S_IFLNK]
        assert len(links) == 3  # reported, not followed, not deleted
    # every gpuload file of the real cache is gone (or was out of reach)
    real_root = Path(os.path.realpath(cache))
    gpuload_files = [p for p in real_root.rglob("*") if p.is_file() and not p.is_symlink()
                     and p.name.endswith((".glc", ".lock", ".json")) and "sub" not in p.parts]
    assert gpuload_files == []
    if plant == "root_link":
        assert r["files"] > 0 and r["freed"] > 0
    # the cache still works afterwards, and serves exact data
    ds = _ds(data, cache, seed=4)
    _check(ds, reference)
    assert _tree(foreign) == before


def test_stale_versions_temporaries_and_corrupt_files_spare_foreign_entries(tmp_path, reference):
    """Every deletion path (a rebuilt corrupt file, a killed writer's temporary, the
    chunks of an older version of a source file) deletes only gpuload's regular files."""
    data = tmp_path / "data"
    files = _data(data)
    cache = tmp_path / "cache"
    _built(data, cache)
    foreign = _foreign(tmp_path)
    before = _tree(foreign)
    import xxhash

    folder = cache / LAYOUT_DIR / xxhash.xxh64_hexdigest(str(Path(files[0]).resolve()).encode())
    chunks = sorted(folder.glob("*.glc"))
    spec = chunks[0].name[:16]
    # a link named like a temporary, a stale version that is a link, a corrupt chunk that is a hard link
    (folder / (chunks[0].name + ".tmp.1.deadbeef")).symlink_to(foreign / "precious.txt")
    (folder / f"{spec}-{'f' * 16}-0-1.glc").symlink_to(foreign / "precious.txt")
    os.link(foreign / "precious.txt", folder / f"{spec}-{'e' * 16}-0-1.glc.lock")
    chunks[1].unlink()
    os.link(foreign / "0123456789abcdef-0123456789abcdef-0-1.glc", chunks[1])  # corrupt: not a chunk file
    # an older version of one source file: touch it so its chunks are rebuilt and old ones dropped
    st = os.stat(files[0])
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ds = _ds(data, cache, seed=2)
    _check(ds, reference)
    ds.reader.cache.flush()
    assert _tree(foreign) == before
    assert (folder / (chunks[0].name + ".tmp.1.deadbeef")).is_symlink()
    assert (folder / f"{spec}-{'f' * 16}-0-1.glc").is_symlink()


def test_unlink_refuses_non_matching_and_non_regular(tmp_path):
    root = CacheRoot(tmp_path)
    (tmp_path / LAYOUT_DIR / "x").mkdir(parents=True)
    name = "0123456789abcdef-0123456789abcdef-0-1.glc"
    (tmp_path / LAYOUT_DIR / "x" / "a.txt").write_text("x")
    (tmp_path / LAYOUT_DIR / "x" / name).mkdir()
    from gpuload.cache.fs import CHUNK
    assert root.unlink((LAYOUT_DIR, "x"), "a.txt", CHUNK) is None and (tmp_path / LAYOUT_DIR / "x" / "a.txt").exists()
    assert root.unlink((LAYOUT_DIR, "x"), name, CHUNK) is None and (tmp_path / LAYOUT_DIR / "x" / name).is_dir()
    (tmp_path / LAYOUT_DIR / "x" / name).rmdir()
    (tmp_path / LAYOUT_DIR / "x" / name).write_bytes(b"12345")
    assert root.unlink((LAYOUT_DIR, "x"), name, CHUNK).st_size == 5 and not (tmp_path / LAYOUT_DIR / "x" / name).exists()


# ---------------------------------------------------------------------------------------
# odd entries where a chunk or a lock should be: never block, never serve, never crash
# ---------------------------------------------------------------------------------------

ODD = ["dir", "fifo", "self_link", "dangling_link", "socket", "lock_dir", "lock_link", "lock_fifo", "folder_file"]


def _plant_odd(cache: Path, chunk: Path, kind: str, tmp_path: Path) -> None:
    lock = Path(str(chunk) + ".lock")
    chunk.unlink()  # for lock_* and folder_file: so that the chunk must be rebuilt under its lock
    if kind == "dir":
        chunk.mkdir()
    elif kind == "fifo":
        os.mkfifo(chunk)
    elif kind == "self_link":
        chunk.symlink_to(chunk.name)
    elif kind == "dangling_link":
        chunk.symlink_to(tmp_path / "nowhere")
    elif kind == "socket":
        os.mknod(chunk, 0o600 | stat.S_IFSOCK)
    elif kind in ("lock_dir", "lock_link", "lock_fifo"):
        lock.unlink(missing_ok=True)
        if kind == "lock_dir":
            lock.mkdir()
        elif kind == "lock_link":
            (tmp_path / "target.txt").write_text("must stay")
            lock.symlink_to(tmp_path / "target.txt")
        else:
            os.mkfifo(lock)
    elif kind == "folder_file":  # the chunk's whole source folder is a plain file
        shutil.rmtree(chunk.parent)
        chunk.parent.write_text("not a folder")


@pytest.mark.parametrize("kind", ODD)
def test_odd_entries_are_never_served_and_never_block(data, tmp_path, kind, reference, caplog):
    cache = tmp_path / "cache"
    _built(data, cache)
    chunk = sorted((cache / LAYOUT_DIR).rglob("*.glc"))[1]
    _plant_odd(cache, chunk, kind, tmp_path)
    caplog.set_level(logging.WARNING, logger="gpuload")
    result = {}

    def run():
        try:
            ds = _ds(data, cache, seed=1)
            _check(ds, reference)
            ds.reader.cache.flush()
            result["ok"] = ds.reader.counters
        except BaseException as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"iteration blocked on a {kind}"
    assert "error" not in result, repr(result.get("error"))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    if kind == "lock_link":
        assert (tmp_path / "target.txt").read_text() == "must stay"
    # the CLI reports it (any exception here would fail the test), and never follows or deletes it
    for action in ("info", "verify", "clear"):
        assert main(["cache", action, "--cache-dir", str(cache)]) in (0, 1)
    assert os.path.lexists(chunk if not kind.startswith("lock_") and kind != "folder_file" else
                           (Path(str(chunk) + ".lock") if kind != "folder_file" else chunk.parent))


def test_lock_retries_when_its_file_is_removed(tmp_path):
    """A lock taken on a lock file that `cache clear` removed meanwhile does not count: the
    waiter locks the current file, so two builders never hold "the" lock at once."""
    root = CacheRoot(tmp_path)
    first = Lock(root, (LAYOUT_DIR, "ab"), "x.lock")
    assert first.acquire()
    waiting, holding, done = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def second():
        lock = Lock(root, (LAYOUT_DIR, "ab"), "x.lock")
        waiting.set()
        got["ok"] = lock.acquire()  # blocks on the old file, then must move to the new one
        got["ino"], got["links"] = os.fstat(lock._fd).st_ino, os.fstat(lock._fd).st_nlink
        holding.set()
        done.wait(30)
        lock.release()

    t = threading.Thread(target=second)
    t.start()
    waiting.wait(10)
    os.unlink(tmp_path / LAYOUT_DIR / "ab" / "x.lock")  # a `cache clear` meanwhile
    first.release()
    assert holding.wait(30)
    assert got["ok"] and got["links"] == 1  # not the removed file (inode numbers may be reused)
    assert os.stat(tmp_path / LAYOUT_DIR / "ab" / "x.lock").st_ino == got["ino"]
    assert not Lock(root, (LAYOUT_DIR, "ab"), "x.lock").acquire(blocking=False)  # the current file is held
    done.set()
    t.join(10)
    assert Lock(root, (LAYOUT_DIR, "ab"), "x.lock").acquire(blocking=False)


@pytest.mark.slow
def test_a_lock_held_by_a_stopped_process_never_blocks_a_reader(data, tmp_path, reference, caplog):
    """A builder that holds a chunk's lock and never finishes (stopped, hung): readers wait
    ``lock_patience`` seconds, then decode the chunk themselves, with one warning."""
    cache = tmp_path / "cache"
    _built(data, cache)
    chunks = sorted(cache.rglob("*.glc"))
    for p in chunks[:2]:
        p.unlink()
    holder = spawn(python("import fcntl, os, sys, time\n"
                          "fds = [os.open(p, os.O_RDONLY | os.O_CREAT) for p in sys.argv[1:]]\n"
                          "[fcntl.flock(fd, fcntl.LOCK_EX) for fd in fds]\nprint('held', flush=True)\n"
                          "time.sleep(600)", *[str(p) + ".lock" for p in chunks[:2]]), stderr=None)
    try:
        assert holder.stdout.readline().strip() == "held"
        caplog.set_level(logging.WARNING, logger="gpuload")
        ds = _ds(data, cache)
        ds.reader.cache.lock_patience = 0.2
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("n", _check(ds, reference)), daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "a reader waited for a stopped lock holder"
        assert "n" in result
        held = [r for r in caplog.records if "locked by another process" in r.getMessage()]
        assert len(held) == 1
        assert not chunks[0].exists()  # decoded, served, not written under someone else's lock
    finally:
        holder.kill()
        holder.wait()


def test_locks_of_a_stopped_holder_cost_one_wait_not_one_per_chunk_and_epoch(data, tmp_path, reference, monkeypatch):
    """A helper's trial: a SIGSTOPped process held 3 chunks' locks, and another reader waited 60 s for each,
    in every epoch (181 s an epoch). Now: the full patience once, a short one for the holder's other locks,
    none for a lock already waited out; every row exact. (Locks held through other open files of this
    process conflict as another process's would; the waits are read off, not timed.)"""
    import fcntl

    import gpuload.cache.store as store

    cache = tmp_path / "cache"
    _built(data, cache)
    chunks = sorted(cache.rglob("*.glc"))[:3]
    for p in chunks:
        p.unlink()
    held = [os.open(str(p) + ".lock", os.O_RDONLY | os.O_CREAT) for p in chunks]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)
    waits = []
    acquire = Lock.acquire

    def recorded(self, blocking=True, timeout=None, meanwhile=None):
        if self.name.endswith(".glc.lock"):
            waits.append((self.name, timeout))
        return acquire(self, blocking, 0.0 if timeout is None else min(timeout, 0.05), meanwhile)  # no real wait

    monkeypatch.setattr(Lock, "acquire", recorded)
    try:
        ds = _ds(data, cache, shuffle=False, prefetch=0)  # no next epoch's chunks loaded within this one
        names = {p.name + ".lock" for p in chunks}
        for epoch in range(2):
            waits.clear()
            ds.set_epoch(epoch)
            _check(ds, reference)
            on_held = [t for n, t in waits if n in names]
            assert len(on_held) == 3
            if epoch == 0:  # the loader threads' first waits overlap: at most one full wait each
                full = on_held.count(ds.reader.cache.lock_patience)
                assert 1 <= full <= ds.options.num_threads and on_held.count(store.STALLED_PATIENCE) == 3 - full
            else:
                assert on_held == [0.0] * 3  # known held: decoded at once
        assert not any(p.exists() for p in chunks)  # decoded, served, not written under another's lock
    finally:
        for fd in held:
            os.close(fd)
    ds.set_epoch(2)  # the holder gone: its chunks are cached again
    _check(ds, reference)
    ds.reader.cache.flush()
    assert all(p.exists() for p in chunks)


def test_a_waiting_reader_takes_the_chunk_its_lock_holder_builds(data, tmp_path, reference):
    """Waiting for a live builder: when its file appears, the reader serves it (build once)."""
    cache = tmp_path / "cache"
    _built(data, cache)
    chunk = sorted(cache.rglob("*.glc"))[0]
    saved = chunk.read_bytes()
    chunk.unlink()
    lock = Lock(CacheRoot(cache), chunk.parent.relative_to(cache).parts, chunk.name + ".lock")
    assert lock.acquire()
    ds = _ds(data, cache, shuffle=False)
    index = next(i for i in range(len(ds.reader.chunks)) if ds.reader.cache.path(ds.reader.key(i)) == chunk)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("cols", ds.reader.load(index)), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for the holder
    tmp = chunk.with_name(chunk.name + ".tmp.1.00000000")
    tmp.write_bytes(saved)
    os.replace(tmp, chunk)  # the holder finishes its build
    t.join(30)
    lock.release()
    assert not t.is_alive() and ds.reader.counters.decoded == 0 and ds.reader.counters.from_cache == 1


def test_delete_and_unlink_never_leave_the_cache(tmp_path):
    """`..`, absolute paths and names with slashes are never followed, whatever the caller passes."""
    root = tmp_path / "cache"
    victim = tmp_path / "0123456789abcdef-0123456789abcdef-0-1.glc"
    victim.write_bytes(b"x" * 8)
    (root / LAYOUT_DIR / "0123456789abcdef").mkdir(parents=True)
    cache = ChunkCache(root, create=False)
    for p in (root / LAYOUT_DIR / ".." / ".." / victim.name, root / LAYOUT_DIR / "0123456789abcdef" / ".." / ".." / ".." /
              victim.name, str(victim), victim):
        assert cache.delete(p) == 0
    from gpuload.cache.fs import CHUNK

    for parts, name in (((LAYOUT_DIR, ".."), victim.name), (("..",), victim.name), ((LAYOUT_DIR,), "../../" + victim.name)):
        with pytest.raises(ForeignEntry):
            cache.root.unlink(parts, name, CHUNK) if "/" not in name else cache.root.open_read(parts, name)
    assert victim.read_bytes() == b"x" * 8


LAYOUT_ODD = ["layout_file", "layout_link", "layout_fifo", "specs_link", "specs_file", "spec_json_link",
              "spec_json_garbage", pytest.param("layout_000", marks=pytest.mark.slow)]  # an unprivileged process


@pytest.mark.parametrize("kind", LAYOUT_ODD)
def test_odd_layout_and_specs_entries(data, tmp_path, kind, reference):
    """The format's folder or the specs folder replaced by something else, or a spec record
    that is not one: data is exact, `build_cache` and the CLI report instead of crashing (a
    build that cannot write its chunk files fails with a CacheError naming why)."""
    cache = tmp_path / "cache"
    _built(data, cache)
    layout, specs = cache / LAYOUT_DIR, cache / LAYOUT_DIR / "specs"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.json").write_text("{}")
    spec_file = next(specs.glob("*.json"))
    if kind.startswith("layout_"):
        shutil.rmtree(layout)
        if kind == "layout_file":
            layout.write_text("x")
        elif kind == "layout_link":
            layout.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        elif kind == "layout_fifo":
            os.mkfifo(layout)
        else:
            layout.mkdir()
            layout.chmod(0)
    elif kind == "specs_link":
        shutil.rmtree(specs)
        specs.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    elif kind == "specs_file":
        shutil.rmtree(specs)
        specs.write_text("x")
    elif kind == "spec_json_link":
        spec_file.unlink()
        spec_file.symlink_to(tmp_path / "elsewhere" / "keep.json")
    else:
        for text in ('{"a": 1}', "[1]", '"hello"', '[{"name": "x"}]', "[" * 100_000 + "]" * 100_000):
            spec_file.write_text(text)
            assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    if kind == "layout_000":  # file modes must apply: a separate, unprivileged process
        script = ("import sys, gpuload\nfrom gpuload.synth import clicklog_columns\n"
                  "cols = {**clicklog_columns(2, 2), 'row_id': 'row_id'}\n"
                  "try:\n    print(gpuload.build_cache(sys.argv[1], sys.argv[2], cols, chunk_bytes=1 << 14))\n"
                  "except gpuload.CacheError as e:\n    sys.exit(f'error: {e}')")
        runs = [[sys.executable, "-c", script, str(data), str(cache)]]
        runs += [[sys.executable, "-m", "gpuload.tools.cli", "cache", a, "--cache-dir", str(cache)]
                 for a in ("info", "verify", "clear")]
        for n, cmd in enumerate(runs):
            r = _unprivileged(*cmd)
            assert "Traceback" not in r.stderr, (cmd, r.stderr)
            if n == 0:  # the build cannot write its chunks: it fails, saying why
                assert r.returncode == 1 and "Permission denied" in r.stderr, (r.stdout, r.stderr)
            else:
                assert r.returncode in (0, 1), (cmd, r.stdout, r.stderr)
    elif kind.startswith("layout_"):  # no chunk file can be written: the build fails, saying why
        with pytest.raises(gpuload.CacheError, match="cannot write cache files .*not a folder gpuload made"):
            gpuload.build_cache(data, cache, COLUMNS, chunk_bytes=CHUNK_BYTES)
        for action in ("info", "verify", "clear"):
            assert main(["cache", action, "--cache-dir", str(cache)]) in (0, 1)
    else:  # in this process: any exception would fail the test
        gpuload.build_cache(data, cache, COLUMNS, chunk_bytes=CHUNK_BYTES)
        for action in ("info", "verify", "clear"):
            assert main(["cache", action, "--cache-dir", str(cache)]) in (0, 1)
    if kind == "layout_000":
        layout.chmod(0o755)
    _check(_ds(data, cache, seed=3), reference)
    assert (tmp_path / "elsewhere" / "keep.json").read_text() == "{}"
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["keep.json"]


def test_lock_refuses_a_link_or_folder(tmp_path):
    root = CacheRoot(tmp_path)
    (tmp_path / LAYOUT_DIR / "ab").mkdir(parents=True)
    (tmp_path / "t").write_text("x")
    (tmp_path / LAYOUT_DIR / "ab" / "l.lock").symlink_to(tmp_path / "t")
    (tmp_path / LAYOUT_DIR / "ab" / "d.lock").mkdir()
    for name in ("l.lock", "d.lock"):
        with pytest.raises(ForeignEntry):
            Lock(root, (LAYOUT_DIR, "ab"), name).acquire()
    assert (tmp_path / "t").read_text() == "x"
    (tmp_path / LAYOUT_DIR / "cd").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ForeignEntry):
        Lock(root, (LAYOUT_DIR, "cd"), "x.lock").acquire()
    assert not (tmp_path / "x.lock").exists()


# ---------------------------------------------------------------------------------------
# caches that cannot be written: read-only, another user's, no space, no inodes
# ---------------------------------------------------------------------------------------

AS_USER = r"""
import json, sys, logging
import numpy as np
import gpuload
from gpuload.synth import clicklog_columns
logging.basicConfig(level=logging.WARNING, format="WARN %(message)s")
data, cache, out = sys.argv[1:4]
columns = {**clicklog_columns(2, 2), "row_id": "row_id"}
ds = gpuload.ParquetDataset(data, columns, cache_dir=cache, chunk_bytes=1 << 14, device="cpu", batch_size=400,
                            prefetch=0)  # its loads counted: none for a next epoch
ids, label = [], []
for b in ds:
    ids.append(b["row_id"].numpy()); label.append(b["label"].numpy())
np.savez(out, ids=np.concatenate(ids), label=np.concatenate(label))
print(json.dumps({"decoded": ds.reader.counters.decoded, "cached": ds.reader.counters.from_cache}))
"""


_UNPRIVILEGED = (["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
                 if os.geteuid() == 0 else [])


def _unprivileged(*cmd, cwd=None):
    """Run ``cmd`` so that file modes apply to it (see the module doc)."""
    return subprocess.run([*_UNPRIVILEGED, *cmd], capture_output=True, text=True, timeout=300, cwd=cwd)


def _as_nobody(*args, cwd):
    return _unprivileged(sys.executable, "-c", AS_USER, *map(str, args), cwd=cwd)


modes_apply = pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                                reason="file modes do not apply to root without setpriv")


@pytest.fixture
def shared(tmp_path):
    """A world-readable place, as on a cluster where one job builds and others read."""
    base = Path("/tmp") / f"gpuload-shared-{os.getpid()}-{tmp_path.name}"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    yield base
    for p in base.rglob("*"):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(base)


@pytest.mark.slow
@modes_apply
@pytest.mark.parametrize("missing", [0, 1])
def test_read_only_cache_of_another_user_is_served(data, shared, missing, reference):
    d = shared / "data"
    shutil.copytree(data, d)
    cache = shared / "cache"
    _built(d, cache)
    chunks = sorted(cache.rglob("*.glc"))
    for p in chunks[:missing]:
        p.unlink()
    for p in [d, cache, *d.rglob("*"), *cache.rglob("*")]:
        p.chmod((p.stat().st_mode | 0o555) & ~0o222)  # chmod -R a-w, readable by all
    out = shared / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    before = _tree(cache)
    r = _as_nobody(d, cache, out / "out.npz", cwd=out)
    assert r.returncode == 0, r.stderr
    counts = json.loads(r.stdout)
    assert counts["decoded"] == missing and counts["cached"] == len(chunks) - missing
    z = np.load(out / "out.npz")
    assert np.array_equal(np.sort(z["ids"]), np.arange(3000))
    np.testing.assert_array_equal(z["label"], reference[0][z["ids"]])
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARN")]
    assert len(warnings) == (1 if missing else 0), r.stderr
    assert "Traceback" not in r.stderr
    assert _tree(cache) == before  # nothing written, nothing locked into existence


@pytest.mark.slow
@modes_apply
def test_mode_000_chunk_and_folder_are_decoded_with_a_warning(data, shared, reference):
    d = shared / "data"
    shutil.copytree(data, d)
    cache = shared / "cache"
    _built(d, cache)
    for p in [shared, *shared.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    folders = sorted(p for p in (cache / LAYOUT_DIR).iterdir() if p.name != "specs")
    sorted(folders[0].glob("*.glc"))[0].chmod(0)
    folders[1].chmod(0)
    r = _as_nobody(d, cache, shared / "out.npz", cwd=shared)
    assert r.returncode == 0, r.stderr
    z = np.load(shared / "out.npz")
    assert np.array_equal(np.sort(z["ids"]), np.arange(3000))
    np.testing.assert_array_equal(z["label"], reference[0][z["ids"]])
    assert "Traceback" not in r.stderr and 1 <= r.stderr.count("WARN") <= 3, r.stderr
    v = _unprivileged(sys.executable, "-m", "gpuload.tools.cli", "cache", "verify", "--cache-dir", str(cache))
    assert "Traceback" not in v.stderr and v.returncode == 1 and "UNREADABLE" in v.stdout, v.stdout + v.stderr


@pytest.mark.slow  # mount and umount a tmpfs
@pytest.mark.parametrize("opts", [dict(size="160k", nr_inodes=1000), dict(size="64m", nr_inodes=12),
                                  dict(size="64m", nr_inodes=5)])
def test_full_disk_or_inodes_serve_exact_data(data, tiny_fs, opts, reference, caplog):
    cache = tiny_fs("fs", **opts)
    caplog.set_level(logging.WARNING, logger="gpuload")
    for seed in (0, 1):
        ds = _ds(data, cache, seed=seed)
        _check(ds, reference)
        ds.reader.cache.flush()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings and len(warnings) <= 4, warnings
    assert all("No space" in w or "space" in w.lower() for w in warnings), warnings
    assert ChunkCache(cache).verify_all() == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.EIO, errno.EROFS])
@pytest.mark.parametrize("where", ["write", "lock", "mkdir"])
def test_injected_os_errors_serve_exact_data(data, tmp_path, monkeypatch, err, where, reference, caplog):
    import gpuload.cache.fs as cfs

    real_open, real_mkdir = os.open, os.mkdir

    def failing_open(path, flags, *a, **k):
        name = str(path)
        if where == "write" and ".tmp." in name or where == "lock" and name.endswith(".lock"):
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *a, **k)

    def failing_mkdir(path, *a, **k):
        raise OSError(err, os.strerror(err))

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(cfs.os, "open", failing_open)
    if where == "mkdir":
        monkeypatch.setattr(cfs.os, "mkdir", failing_mkdir)
    caplog.set_level(logging.WARNING, logger="gpuload")
    for seed in (0, 1):
        _check(_ds(data, cache, seed=seed), reference)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert not list(cache.rglob("*.glc"))
    monkeypatch.setattr(cfs.os, "open", real_open)
    monkeypatch.setattr(cfs.os, "mkdir", real_mkdir)
    ds = _ds(data, cache)
    _check(ds, reference)  # and once the fault is gone, the cache fills again
    ds.reader.cache.flush()
    assert len(list(cache.rglob("*.glc"))) == len(ds.reader.chunks)


def test_a_probe_whose_temporary_another_writer_removed_still_passes(tmp_path, monkeypatch):
    """Two builds at once: a writer holding a chunk's lock clears the chunk's leftover
    temporaries, the other build's probe file among them; the probe succeeded all the same."""
    root, real = CacheRoot(tmp_path / "c"), os.unlink

    def cleared_first(name, *, dir_fd=None):
        real(name, dir_fd=dir_fd)  # the other writer's cleanup, just before
        return real(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", cleared_first)
    root.probe_write((LAYOUT_DIR, "ab12"), "x-y-0-1.glc")
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "c" / LAYOUT_DIR / "ab12").iterdir()] == []
