"""watch: measure any loader from the training thread's side.

``gpuload.watch(loader)`` returns a :class:`Watched` that iterates exactly like
``loader`` (a torch ``DataLoader``, a generator, a :class:`gpuload.ParquetDataset`,
anything iterable) and times every ``next()`` call the training loop makes on it, so
:meth:`Watched.stats` reports how much of the loop's time went into waiting for data
(``starvation``, see :mod:`gpuload.observe.metrics` for the exact definition)::

    loader = gpuload.watch(DataLoader(ds, batch_size=1024, num_workers=4))
    for batch in loader:
        step(batch)
    print(loader.stats())             # starvation, rows/s, waits, steps, CPU/GPU use
    print(gpuload.diagnose(loader.stats()))
    loader.write_trace("trace.json")  # open in https://ui.perfetto.dev

Rows and bytes are counted for batches that are tensors, NumPy (or CuPy) arrays,
:class:`gpuload.Ragged`, Arrow record batches or tables, and dicts, tuples or lists of
those (rows: the first element's length; bytes: the sum). Anything else counts as a
batch of 0 rows and 0 bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Iterable, Iterator

import psutil
import torch

from ..batch import Ragged
from ..errors import ConfigError
from .metrics import Metrics
from .stats import Stats
from .sampling import UtilSampler

__all__ = ["watch", "Watched", "describe_loader"]


def _measure(batch, depth: int = 0) -> tuple[int, int]:
    """``(rows, nbytes)`` of a batch; (0, 0) for what it cannot size."""
    kind = type(batch)
    if kind is dict or kind is tuple or kind is list:  # the common case, kept fast: about 0.2 us a tensor
        rows = nbytes = 0
        for item in batch.values() if kind is dict else batch:
            if type(item) is torch.Tensor:
                shape = item.shape
                rows, nbytes = rows or (shape[0] if shape else 1), nbytes + item.nbytes
            elif type(item) is Ragged and type(item.values) is type(item.offsets) is torch.Tensor:
                rows = rows or max(item.offsets.shape[0] - 1, 0)
                nbytes += item.values.nbytes + item.offsets.nbytes
            elif depth < 4:
                r, b = _measure(item, depth + 1)
                rows, nbytes = rows or r, nbytes + b
        return rows, nbytes
    if isinstance(batch, Ragged):
        (n, a), (_, b) = _measure(batch.offsets, depth + 1), _measure(batch.values, depth + 1)
        return max(n - 1, 0), a + b
    shape = getattr(batch, "shape", None)
    if shape is not None and hasattr(batch, "nbytes"):  # torch, numpy, cupy
        try:
            return (int(shape[0]) if len(shape) else 1), int(batch.nbytes)
        except (TypeError, RuntimeError):  # e.g. sparse or nested tensors
            return 0, 0
    if hasattr(batch, "num_rows") and hasattr(batch, "nbytes"):  # pyarrow RecordBatch / Table
        return int(batch.num_rows), int(batch.nbytes)
    if depth >= 4 or isinstance(batch, (str, bytes)):
        return 0, 0
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (tuple, list)):
        items = batch
    else:
        return 0, 0
    rows = nbytes = 0
    for item in items:
        r, b = _measure(item, depth + 1)
        rows, nbytes = rows or r, nbytes + b
    return rows, nbytes


def describe_loader(loader) -> tuple[str, dict]:
    """``(kind, settings)`` of a loader, as :attr:`gpuload.Stats.loader` and ``loader_settings`` say them
    (a loader that describes itself, as :class:`gpuload.ParquetDataset` does, through its
    ``loader_description()``)."""
    dataset = getattr(loader, "dataset", None) if isinstance(loader, torch.utils.data.DataLoader) else None
    for ds in (loader, dataset):
        own = getattr(type(ds), "loader_description", None)
        if callable(own):
            return own(ds)
    if isinstance(loader, torch.utils.data.DataLoader):
        return "DataLoader", {"num_workers": loader.num_workers, "pin_memory": bool(loader.pin_memory),
                              "persistent_workers": bool(loader.persistent_workers),
                              "prefetch_factor": loader.prefetch_factor}
    return "iterable", {"type": type(loader).__name__}


class _WorkerCpu:
    """CPU seconds a DataLoader's worker processes used over a pass (``it``: its iterator, whose
    ``_workers`` they are), read with psutil at most every ``period`` seconds as batches come: the
    training process's own CPU says nothing of them, and I/O-bound workers (waiting on a disk or a
    store) are helped by more of them where busy ones are not."""

    def __init__(self, it, clock, period: float = 0.1):
        try:
            self.procs = [psutil.Process(w.pid) for w in getattr(it, "_workers", ()) if w.pid]
        except (psutil.Error, AttributeError, TypeError):
            self.procs = []
        self.count, self.clock, self.period = len(self.procs), clock, period
        self.first = self.last = None
        self.sample(force=True)

    def sample(self, force: bool = False) -> None:
        if not self.procs:
            return
        t = self.clock()
        if not force and self.last is not None and t - self.last[0] < self.period:
            return
        try:
            cpu = sum(sum(p.cpu_times()[:2]) for p in self.procs)
        except psutil.Error:  # a worker ended (the pass's end, without persistent_workers): the last sample stands
            self.procs = []
            return
        self.first = self.first or (t, cpu)
        self.last = (t, cpu)

    def measured(self) -> tuple[float, float]:
        """(CPU seconds of the workers, their wall seconds: the sampled span times their number)."""
        if self.first is None or self.last is self.first:
            return 0.0, 0.0
        return self.last[1] - self.first[1], (self.last[0] - self.first[0]) * self.count


class Watched:
    """An iterable in place of ``iterable`` that records every ``next()`` into a :class:`~gpuload.Metrics`.

    Each ``iter()`` starts a new pass over ``iterable`` (and a utilisation sampler for
    its duration). The first ``next()`` of a pass includes creating the inner iterator
    (e.g. a ``DataLoader`` starting its workers). Leaving the loop early ends the pass
    at that moment. Attributes it does not have itself (``set_epoch``, ``dataset``, ...)
    come from ``iterable``.

    Parameters
    ----------
    iterable : the loader to watch.
    metrics : where to record (default: a new :class:`~gpuload.Metrics`, as ``.metrics``).
        Give each watched loader its own: one training thread per Metrics. Times come from
        its ``clock`` (``time.perf_counter`` unless the Metrics was given another).
    sample_util : sample CPU and GPU utilisation while a pass runs (default True).
    util_period : seconds between utilisation samples (default 0.1).
    """

    def __init__(self, iterable: Iterable, *, metrics: Metrics | None = None, sample_util: bool = True,
                 util_period: float = 0.1):
        if sample_util and not util_period > 0:
            raise ValueError(f"util_period={util_period!r} must be a positive number of seconds")
        if not (hasattr(iterable, "__iter__") or hasattr(iterable, "__getitem__")):  # else it fails at the for loop
            raise ConfigError(f"watch() takes the loader the training loop iterates (a DataLoader, a "
                              f"gpuload.ParquetDataset, a generator...), not a {type(iterable).__name__}")
        self.inner = iterable
        self.metrics = metrics if metrics is not None else Metrics()
        self.sample_util = bool(sample_util)
        self.util_period = util_period
        self._sampler: UtilSampler | None = None  # one per Watched: resuming it costs microseconds
        self._passes_open = 0
        self._workers = [0.0, 0.0]  # a DataLoader's worker processes: their CPU s and wall s, over the passes

    def __iter__(self) -> Iterator:
        return self._pass()

    def _pass(self) -> Iterator:
        m = self.metrics
        clock = m.clock
        if self.sample_util:
            if self._sampler is None:
                self._sampler = UtilSampler(m, period=self.util_period)
            self._passes_open += 1
            self._sampler.start()
        it = None
        ended, waiting = False, True
        t0 = clock()
        workers = None
        try:
            it = iter(self.inner)
            workers = _WorkerCpu(it, clock) if self.sample_util else None
            while True:
                waiting = True
                try:
                    item = next(it)
                except StopIteration:
                    m.consumer_end(t0, clock())
                    ended = True
                    return
                t1 = clock()
                waiting = False
                rows, nbytes = _measure(item)
                m.consumer_wait(t0, t1, rows=rows, nbytes=nbytes)
                if workers is not None:
                    workers.sample()
                yield item
                t0 = clock()
        finally:
            if workers is not None:
                workers.sample(force=True)
                for i, v in enumerate(workers.measured()):
                    self._workers[i] += v
            if not ended:  # an error inside next(), or the loop was left
                t = clock()
                m.consumer_end(t0 if waiting else t, t)
            close = getattr(it, "close", None)
            if close is not None and not ended and it is not self.inner:  # a generator given as such stays resumable
                close()
            if self.sample_util:
                self._passes_open -= 1
                if not self._passes_open:
                    self._sampler.stop()

    def __len__(self) -> int:
        """``len()`` of the watched iterable (TypeError if it has none)."""
        return len(self.inner)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (e.g. while unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def stats(self) -> Stats:
        """:meth:`Metrics.stats` of what was recorded so far (``starvation`` and the rest), with
        what kind of loader was watched (``loader``, ``loader_settings``) for :func:`gpuload.diagnose`."""
        kind, settings = describe_loader(self.inner)
        cpu, wall = self._workers  # at least a second of workers' time sampled: a share that means something
        return dataclasses.replace(self.metrics.stats(), loader=kind, loader_settings=settings,
                                   worker_cpu_percent=100 * cpu / wall if wall >= 1.0 else None)

    def write_trace(self, path):
        """Write a Chrome trace-event JSON file (see :meth:`Metrics.write_trace`); returns its path."""
        return self.metrics.write_trace(path)

    def reset(self) -> None:
        """Forget what was recorded so far."""
        self.metrics.reset()
        self._workers = [0.0, 0.0]

    def __repr__(self) -> str:
        return f"Watched({self.inner!r})"


def watch(iterable: Iterable, *, metrics: Metrics | None = None, sample_util: bool = True,
          util_period: float = 0.1) -> Watched:
    """Wrap ``iterable`` so that every ``next()`` the training loop makes on it is timed.

    Parameters
    ----------
    iterable : a loader: torch ``DataLoader``, generator, :class:`gpuload.ParquetDataset`, ...
        A one-shot iterator (a generator) gives one pass; a re-iterable loader one
        per ``for`` loop.
    metrics : record into this :class:`~gpuload.Metrics` (default: a new one), timed by its ``clock``.
    sample_util : sample CPU (psutil) and GPU (NVML, where available) use during each
        pass (default True).
    util_period : seconds between utilisation samples (default 0.1).

    Returns
    -------
    Watched
        Iterate it in place of ``iterable``; ``.stats()`` gives the :class:`~gpuload.Stats`,
        ``.write_trace(path)`` a trace for Perfetto.
    """
    return Watched(iterable, metrics=metrics, sample_util=sample_util, util_period=util_period)
