"""Preload: the next epoch's first chunks, loaded while this epoch's last batches are cut.

An epoch's first batch waits for its whole first window to be read (and, shuffled,
permuted): the longest wait of a cached epoch, most of what a training step waited over
a whole epoch on the H100 (``docs/benchmarks.md``, GPU). So once an epoch's last loads are
under way, :class:`gpuload.ParquetDataset` starts loading the chunks the *next* epoch takes
first: shuffled, once the last window is assembled, its first window and ``prefetch`` chunks
after it; in file order (a batch needs only its own chunk), once the last ``prefetch + 2``
chunks are being cut, as many chunks (:func:`first_chunks`): epoch + 1, the one an iteration
without ``set_epoch`` follows and the one a loop calling ``set_epoch(epoch + 1)`` asks for.
The next iteration takes each of them it needs instead of loading it again. A chunk's
columns are the same in every epoch (orders are applied after loading), so a wrong guess
(another epoch set, a state restored, other ranks) costs reads, never the order: the
chunks not taken are dropped when that iteration ends, and a preloaded load that failed
(an iteration left early interrupts loads) is simply loaded again.

An iteration that runs to its end returns once these loads are done (they began while its
last batches were cut, so by then they usually are): nothing of the dataset reads after an
epoch, and :meth:`gpuload.ParquetDataset.stats` holds still between epochs. Those loads are
counted with the epoch that made them (``stats()``, ``reader.counters``): for one epoch's
own reads alone, ``prefetch=0``. An iteration left early starts none (or drops them). The
preloaded chunks are held until the next iteration takes them, or
:meth:`gpuload.ParquetDataset.close`. The memory bounds count them (``device_bytes_bound``,
``host_bytes_bound``): shuffled, in place of the window being assembled, which the epoch no longer
needs; in file order, as ``prefetch + 2`` chunks of their own, since the epoch's last chunks are
still held. The reader runs ``num_threads`` loads at once, the preload's and the epoch's together
(:meth:`gpuload.reader.ChunkReader.load`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Callable, Sequence

from .plan import Segment

__all__ = ["Ahead", "Preload", "first_chunks", "next_epoch"]

log = logging.getLogger("gpuload")


class Preload:
    """Loads of ``chunks`` started now, on ``threads`` threads of their own (which end with
    the loads), each taken at most once by the iteration that needs it.

    Parameters
    ----------
    load : chunk index -> what the pipeline's loads return (inside the device's read side).
    chunks : the chunk indices, in the order they are needed (repeats loaded once).
    threads : loader threads (the dataset's ``num_threads``).
    key : what the taking iteration must match for the loads to be used (the GPU path: the
        consumer's stream, which the device memory of the loads is guarded for).
    """

    def __init__(self, load: Callable[[int], object], chunks: Sequence[int], threads: int, key=None):
        self.key = key
        self._lock = threading.Lock()
        pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="gpuload-load")
        try:
            self._futures: dict[int, Future] = {c: pool.submit(load, c) for c in dict.fromkeys(chunks)}
        finally:
            pool.shutdown(wait=False)  # its threads end when the loads are done

    def __len__(self) -> int:
        return len(self._futures)

    def holds(self, chunk: int) -> bool:
        """Whether the load of ``chunk`` is here, not taken yet."""
        with self._lock:
            return chunk in self._futures

    def take(self, chunk: int) -> Future | None:
        """The load of ``chunk`` if it was preloaded and not taken yet (then it is taken), else None."""
        with self._lock:
            return self._futures.pop(chunk, None)

    def wait(self) -> None:
        """Block until every load not taken yet has finished (failed ones included)."""
        with self._lock:
            futures = list(self._futures.values())
        for f in futures:
            try:
                f.exception()  # a failed load's exception is returned, not raised
            except CancelledError:
                pass

    def drop(self) -> None:
        """Forget the loads not taken: those not started are cancelled, the others' results dropped."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for f in futures:
            f.cancel()


class Ahead:
    """A dataset's slot for the next epoch's preload: started when an epoch's last loads are under
    way (:meth:`start`), taken when the next iteration begins (:meth:`take`), settled when an
    iteration ends (:meth:`settle`), dropped by :meth:`drop`."""

    def __init__(self):
        self.pending: Preload | None = None
        self._lock = threading.Lock()
        self._drops = 0  # drops so far: a preload begun before one is not kept after it

    def start(self, *args, **kwargs) -> None:
        """Preload as :func:`next_epoch` (same arguments) says, in place of any pending preload.
        Never raises: the preload is a guess, the next iteration loads what it lacks. A
        :meth:`drop` meanwhile (``close()`` on another thread) drops this one too."""
        with self._lock:
            drops = self._drops
        try:
            new = next_epoch(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - an epoch not plannable now, no thread to start, ...
            log.debug("gpuload: next epoch not preloaded: %s", e)
            new = None
        with self._lock:
            if self._drops != drops:
                old = new
            else:
                old, self.pending = self.pending, new
        if old is not None:
            old.drop()

    def take(self, key) -> Preload | None:
        """The pending preload for an iteration whose consumer stream is ``key`` (None: none,
        or one made for another stream, dropped: its device memory is guarded for that one)."""
        with self._lock:
            pre, self.pending = self.pending, None
        if pre is not None and pre.key != key:
            pre.drop()
            return None
        return pre

    def settle(self, used: Preload | None, finished: bool) -> None:
        """At an iteration's end: drop what it did not take of ``used``; then wait for the next
        epoch's loads if it ran to its ``finished`` end, else drop them."""
        if used is not None:
            used.drop()
        pending = self.pending
        if pending is not None and finished:
            pending.wait()
        elif pending is not None:
            self.drop()

    def drop(self) -> None:
        """Forget the pending preload."""
        with self._lock:
            pre, self.pending = self.pending, None
            self._drops += 1
        if pre is not None:
            pre.drop()


def first_chunks(windows: Sequence[Sequence[Segment]], prefetch: int, shuffled: bool = True) -> list[int]:
    """The chunks an epoch of ``windows`` (a rank's segments by shuffle window) loads first:
    shuffled, those of its first window (a batch draws on all of it) and of the ``prefetch``
    segments after it; in file order, what the pipeline holds when it starts (the segment
    being cut, the one taken after it, and ``prefetch`` more)."""
    if not windows:
        return []
    segments = [s for w in windows for s in w]
    return [s.chunk for s in segments[:(len(windows[0]) if shuffled else 2) + prefetch]]


def next_epoch(plan_epoch: Callable, epoch: int, prefetch: int, threads: int, device, load: Callable,
               shuffled: bool = True) -> Preload:
    """The preload of epoch ``epoch + 1``'s first chunks (:func:`first_chunks` of
    ``plan_epoch(epoch + 1)``, a rank's windows, rows ``shuffled`` or not), each loaded by ``load`` inside ``device``'s
    read side and handed over as the pipeline's loads are, keyed by the consumer's stream
    (an epoch that cannot be planned now raises: :meth:`Ahead.start` then preloads nothing,
    and the next iteration plans, and reports, for real)."""
    windows, _ = plan_epoch(epoch + 1)

    def one(chunk: int):
        with device.reading():
            return device.handover(load(chunk))

    return Preload(one, first_chunks(windows, prefetch, shuffled), threads, key=device.consumer_stream())
