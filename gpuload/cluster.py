"""Cluster builds: chunk builds spread over a Dask cluster (dask-cuda on GPU nodes).

:func:`gpuload.build_cache` with ``client=`` lists the source once on the calling
process, then submits one task per chunk. A worker opens the dataset once per build (its
footers come from the cache the listing filled, or from the source), checks that it sees
the same files, decodes the chunk and writes it to its cache folder, and returns once
the file is on disk. So:

* with a cache folder shared by every worker, any worker builds any chunk, and the
  cache's per-chunk locks make each chunk built once even beside other builders;
* with node-local cache folders (each worker's ``cache_dir``, or its own
  ``$GPULOAD_CACHE_DIR`` when ``cache_dir=None``) and ``nodes=``, each chunk is built
  only by workers of the node that owns it under node-affine sharding
  (``ParquetDataset(shard="node")`` with the same seed and number of nodes);
* a worker that dies mid-build leaves at most a temporary file (cache files are written
  under a temporary name and renamed); Dask gives its tasks to other workers (of the same
  node, with ``nodes=``: by host or name, so workers restarted on other ports count), and
  a chunk whose workers keep dying fails the build with an error that names the chunk
  and its file.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Sequence

import xxhash

from .errors import CacheError, ConfigError, GpuloadError, SourceError

__all__ = ["build_on_cluster", "node_workers"]

_readers: dict = {}  # on a worker: the reader of the build in progress
_lock = threading.Lock()


def _sameness(reader, own_dir: bool) -> int:
    """What a worker's reader must share with the caller's: the fingerprint (the files, wherever they
    lie) and, where the chunks go to the caller's shared cache, the files' paths too (chunk files are
    named by them: built under another path, they would be none of the caller's)."""
    if own_dir:
        return reader.fingerprint
    return xxhash.xxh64_intdigest("\0".join([str(reader.fingerprint)] + [f.path for f in reader.files]).encode())


def _open_reader(token: str, src, opts, own_dir: bool, fingerprint: int):
    """On a worker: the reader of build ``token``, opened once (``own_dir``: in this worker's
    ``$GPULOAD_CACHE_DIR``, not ``opts.cache_dir``)."""
    from .reader import open_reader

    with _lock:
        reader = _readers.get(token)
        if reader is None:
            if own_dir:  # resolved here, on the worker
                opts = dataclasses.replace(opts, cache_dir=None)
            reader = open_reader(src, opts, scan_nulls=False)  # the caller's listing checked these very files
            if _sameness(reader, own_dir) != fingerprint:
                reader.close()
                raise SourceError(f"{src.source}: a worker sees other files than build_cache listed (changed "
                                  "since, or another path on this worker); make the source the same everywhere")
            reader.cache.outcomes = {}  # what became of each chunk file here, for the build's summary
            _readers[token] = reader  # closed by _forget when the build ends
    return reader


def build_chunk(token: str, src, opts, own_dir: bool, fingerprint: int, i: int) -> tuple[int, object, int | None, float | None]:
    """On a worker: make sure chunk ``i`` is cached; ``(i, outcome, cache file size, its
    modification time)`` (None, None where it is not cached). ``outcome``: what became of the
    file here (:attr:`gpuload.cache.store.ChunkCache.outcomes`), an ``OSError`` as
    ``(errno, text, path)``."""
    reader = _open_reader(token, src, opts, own_dir, fingerprint)
    where = _where(reader, i)
    try:
        with reader.device.reading():
            reader.build(i)
        reader.cache.flush()  # on disk before the task reports it done
    except GpuloadError as e:
        e.args = (f"{where}: {e}",) + e.args[1:]
        raise
    except Exception as e:
        raise CacheError(f"{where}: {type(e).__name__}: {e}") from e
    key = reader.key(i)
    outcome = reader.cache.outcomes.pop(key.relpath(), "cached")
    if isinstance(outcome, OSError):
        outcome = (outcome.errno, outcome.strerror or str(outcome), str(reader.cache.path(key)))
    st = reader.cached_file(i)
    if st is None:
        return i, outcome, None, None
    return i, outcome, st.st_size, st.st_mtime


def _workers(client) -> dict:
    try:
        return client.scheduler_info(n_workers=-1)["workers"]  # some releases list only 5 by default
    except TypeError:
        return client.scheduler_info()["workers"]


def _matches(names: list[str], address: str, info: dict) -> bool:
    return address in names or info.get("host") in names or str(info.get("name")) in names


def node_workers(client, nodes) -> list[list[str]]:
    """Who may build each node's chunks: ``nodes`` as a list (node rank -> worker names,
    host names or addresses; the workers' addresses now), or a count of hosts, numbered in
    sorted host order (the hosts: a worker restarted on another port is found again; names
    are looked up again by the build's watch).
    """
    workers = _workers(client)
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        hosts = sorted({w["host"] for w in workers.values()})
        if len(hosts) != nodes:
            raise ConfigError(f"nodes={nodes}: the cluster's workers run on {len(hosts)} hosts ({', '.join(hosts)}); "
                              "pass nodes=[[worker names or hosts of node 0], [... of node 1], ...] to say which is "
                              "which")
        return [[h] for h in hosts]
    if not isinstance(nodes, Sequence) or isinstance(nodes, str) or not nodes:
        raise ConfigError(f"nodes={nodes!r} must be a number of hosts or a list of worker names or hosts per node")
    groups, owner = [], {}
    for n, names in enumerate(_names(nodes)):
        found = _found(workers, names)
        if not found:
            raise ConfigError(f"nodes[{n}]={names!r}: no worker of the cluster has that name, host or address")
        for a in found:
            if owner.setdefault(a, n) != n:
                raise ConfigError(f"worker {a} is in nodes[{owner[a]}] and nodes[{n}]: a worker belongs to one node")
        groups.append(found)
    return groups


def _names(nodes) -> list[list[str]]:
    return [[names] if isinstance(names, str) else [str(x) for x in names] for names in nodes]


def _found(workers: dict, names: list[str]) -> list[str]:
    """The addresses of the workers in ``workers`` (the scheduler's) that ``names`` name."""
    return sorted(a for a, w in workers.items() if _matches(names, a, w))


def build_on_cluster(client, src, opts, reader, progress: Callable[[int], None] | None = None, nodes=None,
                     own_dirs: bool = False) -> list[tuple[int, object, int | None, float | None]]:
    """Build every chunk of ``reader`` (the caller's listing) on ``client``'s workers.

    Each worker opens ``src`` (a :class:`gpuload.config.Source`) under ``opts`` (its
    :class:`gpuload.config.Options`, pickled), with its own ``$GPULOAD_CACHE_DIR`` where
    ``own_dirs``; ``opts.seed`` places chunks on ``nodes``. Returns one
    ``(chunk, outcome, cache file size, its mtime)`` per chunk (None, None where it is
    not cached; outcome as :func:`build_chunk` says it). A chunk found cached by a task
    that ran again because its worker was lost is ``"ours"``: the lost worker wrote it
    (its task had run there). See the module doc.
    """
    from concurrent.futures import CancelledError

    import dask
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    from . import nodeplan

    token = uuid.uuid4().hex
    owner, groups = None, None
    if nodes is not None:
        groups = node_workers(client, nodes)
        owned = nodeplan.node_chunks([c.rows for c in reader.chunks], len(groups), fingerprint=reader.fingerprint,
                                     seed=opts.seed)
        owner = {int(c): n for n, cs in enumerate(owned) for c in cs}
    futures, keys, lock = {}, {}, threading.Lock()

    def submit(i: int, workers: list[str] | None):
        tried = keys.setdefault(i, [])
        tried.append(key := f"gpuload-build-{token}-{i}" + (f"-{len(tried)}" if tried else ""))
        kw = {} if workers is None else {"workers": workers, "allow_other_workers": False}
        fut = client.submit(build_chunk, token, src, opts, own_dirs, _sameness(reader, own_dirs), i, key=key, pure=False,
                            **kw)
        futures[fut] = i
        return fut

    for i in range(len(reader.chunks)):
        submit(i, None if owner is None else groups[owner[i]])
    done = as_completed(list(futures))
    results, failed, stop = [], [], threading.Event()
    allowed = int(dask.config.get("distributed.scheduler.allowed-failures", 3))

    def retarget(stuck: set, workers: list[str]) -> CacheError | None:  # on the watch thread
        """Give the chunks of keys ``stuck`` to ``workers`` under new keys, unless the build is
        over, or they were on workers that died more than Dask allows (new keys would restart
        its count): then the error to fail the build with."""
        with lock:
            if stop.is_set():
                return None
            old = {futures[f]: f for f in futures if f.key in stuck}
            deaths = _deaths(client, {i: keys[i] for i in old})
            worst = max(sorted(old), key=lambda i: deaths[i], default=None)
            if worst is not None and deaths[worst] > allowed:
                others = sum(d > allowed for d in deaths.values()) - 1  # queued on the same workers (Dask counts them too)
                return _kept_dying(reader, worst, f"{deaths[worst]} workers died while it"
                                   + (f" and {others} other chunks were" if others else " was") + " given to them: "
                                   + ("one of them" if others else "it") + " may crash its worker, out of memory?")
            for i, f in old.items():
                del futures[f]
                done.add(submit(i, workers))
        client.cancel(list(old.values()))
        return None

    if groups is not None:  # a node without workers would leave its tasks waiting forever
        names = None if isinstance(nodes, int) else _names(nodes)  # hosts: Dask finds restarted workers itself
        watch = threading.Thread(target=_watch_nodes, args=(client, groups, names, owner, futures, lock, reader, failed,
                                                            stop, retarget), name="gpuload-build-watch", daemon=True)
        watch.start()
    try:
        for fut in done:
            with lock:
                i = futures.get(fut)
            if i is None:  # given to its node's restarted workers under another key
                continue
            try:  # its worker may die before the result is gathered: it stays watched until then
                results.append(fut.result())
            except KilledWorker as e:
                raise _kept_dying(reader, i, str(e)) from None
            except CancelledError:
                if failed:
                    raise failed[0] from None
                with lock:
                    if fut not in futures:  # its result was lost with its worker, and it was given to the new one
                        continue
                raise
            with lock:
                del futures[fut]
            fut.release()  # done with it: a worker that dies later does not hold it (or rebuild it)
            if progress is not None:
                progress(reader.chunks[i].rows)
    finally:
        with lock:  # a retarget on the watch thread finishes first, and none starts
            stop.set()
            client.cancel(list(futures))
        client.run(_forget, token)
    found = {r[0] for r in results if r[1] in ("cached", "other")}
    rerun = _ran_on_lost_workers(client, {k for i in found for k in keys[i]}) if found else set()
    return sorted((i, "ours" if rerun.intersection(keys[i]) else outcome, size, mtime)
                  for i, outcome, size, mtime in results)


def _removals(client) -> list[tuple[set, set]]:
    """``(keys given to it, keys it had computed)`` of each worker the cluster lost (the
    scheduler's ``remove-worker`` events; none from an old scheduler without events)."""
    try:
        events = client.get_events("all")
    except Exception:
        return []
    return [({str(k) for k in msg.get("processing-tasks", ())}, {str(k) for k in msg.get("lost-computed-tasks", ())})
            for _, msg in events if isinstance(msg, dict) and msg.get("action") == "remove-worker"]


def _ran_on_lost_workers(client, keys: set) -> set:
    """Which of ``keys`` were running, or done, on a worker the cluster lost: their first run
    may have written the file their rerun found (none known: counted as another build's)."""
    lost = set()
    for given, computed in _removals(client):
        lost |= given | computed
    return keys & lost


def _deaths(client, keys: dict[int, list[str]]) -> dict[int, int]:
    """For each chunk (``keys``: its task keys so far), how many workers the cluster lost while
    one of its tasks was given to them: Dask's count of a task's suspicious deaths, across keys."""
    removals = _removals(client)
    return {i: sum(1 for given, _ in removals if not given.isdisjoint(ks)) for i, ks in keys.items()}


def _kept_dying(reader, i: int, detail: str) -> CacheError:
    return CacheError(f"{_where(reader, i)}: the workers building it kept dying ({detail}); what was built is kept, "
                      "and a new build_cache finishes the rest")


def _where(reader, i: int) -> str:
    c = reader.chunks[i]
    more = f", and the {len(c.parts) - 1} small files packed with it" if c.parts else ""
    return f"chunk {i} ({reader.files[c.file].path}, row groups {c.rg_start}-{c.rg_stop - 1}{more})"


NODE_GRACE_S = 60.0  #: seconds a node's chunks may wait with no worker allowed to build them


def _no_worker(dask_scheduler, keys) -> list:
    """On the scheduler: which of ``keys`` wait for a worker that no longer exists."""
    return [k for k in keys if (ts := dask_scheduler.tasks.get(k)) is not None and ts.state == "no-worker"]


def _watch_nodes(client, groups, names, owner, futures, lock, reader, failed: list, stop: threading.Event,
                 retarget, every: float = 1.0) -> None:
    """Watch the chunks waiting for a worker of their node (``groups[n]``, the addresses they
    were given). Where ``names`` (``nodes=`` as worker names or hosts) match workers at other
    addresses, the node's workers were restarted (a nanny, a job scheduler): its waiting
    chunks are given to them (``retarget``; it returns an error where their workers died
    too often). Where none match for ``NODE_GRACE_S`` seconds, fail the build (cancel its
    tasks, the reason in ``failed``): Dask would keep the tasks waiting forever."""
    import time

    since: dict[int, float] = {}
    while not stop.wait(every):
        with lock:
            left = {f.key: i for f, i in futures.items()}
        try:
            stuck = client.run_on_scheduler(_no_worker, keys=list(left))
            workers = _workers(client) if stuck and names is not None else {}
        except Exception:  # the client is closing
            return
        nodes = {owner[left[k]] for k in stuck if k in left}
        for n in list(since):
            if n not in nodes:
                del since[n]
        for n in sorted(nodes):
            mine = {k for k in stuck if k in left and owner[left[k]] == n}
            error = None
            if names is not None and (now := _found(workers, names[n])) and now != groups[n]:
                groups[n] = now
                try:
                    error = retarget(mine, now)
                except Exception:  # the client is closing
                    return
            elif time.monotonic() - since.setdefault(n, time.monotonic()) > NODE_GRACE_S:
                error = CacheError(
                    f"node {n} ({', '.join(groups[n])}) has had no worker for {NODE_GRACE_S:.0f} s: its chunks, "
                    f"{_where(reader, min(left[k] for k in mine))} first, cannot be built; start its workers again "
                    "and rerun build_cache (what was built is kept)")
            if error is not None:
                failed.append(error)
                with lock:
                    client.cancel(list(futures))
                return


def _forget(token: str) -> None:
    """On every worker: close the reader of a finished build."""
    with _lock:
        got = _readers.pop(token, None)
    if got is not None:
        got.close()
