"""Running a dataset's epochs: one iteration's producer thread, its hand-off to the training
thread, and the next epoch's first chunks loaded while an epoch ends.

:class:`Epochs` is what :class:`gpuload.ParquetDataset` iterates: it takes the position the
cursor gives (:class:`gpuload.epochs.Position`), runs this rank's rest of that epoch on a
background producer (:func:`gpuload.pipeline.epoch_batches`: loads ahead, windows, gathers)
and yields each batch as the device hands it over, counting it when it is handed out
(architecture.md, Threads).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from . import preload
from .cursor import Cursor
from .epochs import EpochPlan, Position
from .observe.metrics import Metrics
from .pipeline import cut_threads, epoch_batches
from .producer import Background, handed_out
from .reader import ChunkReader
from .transforms import BatchTransform

__all__ = ["Epochs"]


class Epochs:
    """The iterations of one dataset: ``reader``'s chunks in the order ``plan`` gives, at the
    positions ``cursor`` keeps, measured into ``metrics``.

    ``ahead`` holds the next epoch's first chunks, loaded while an epoch's last batches are
    consumed (:mod:`gpuload.preload`); :meth:`close` drops them.
    """

    def __init__(self, reader: ChunkReader, plan: EpochPlan, cursor: Cursor, metrics: Metrics):
        self.reader, self.plan, self.cursor, self.metrics = reader, plan, cursor, metrics
        self.options = reader.opts
        self.ahead = preload.Ahead()  # the next epoch's first chunks, loaded while this one ends
        self.preload_next = True  # whether an epoch's end loads them (ParquetDataset.preload_next)

    def iterate(self, views: dict, batch_transform: Callable | None, torch_device) -> Iterator[dict]:
        """One iteration: the rest of the cursor's epoch on this rank, batch by batch.
        ``views``: outputs handed out reinterpreted (bfloat16), ``batch_transform``: the user's
        per-batch function (:mod:`gpuload.transforms`), ``torch_device``: where batches are."""
        r, o = self.reader, self.options
        handoff = r.device.handoff(views, r.layout, r.batch_pool)
        pos = self.cursor.begin()
        if batch_transform is not None:
            handoff.transform = BatchTransform.starting(batch_transform, pos, r.fingerprint, o.seed, torch_device)
        r.resume()
        pre = self.ahead.take(r.device.consumer_stream())
        producer = Background(lambda stop: self._batches(pos, handoff, stop, pre), depth=o.prefetch + 2, nice=o.nice)
        before = self._measured() if r.adapts_reads else None
        failed = False
        try:  # each batch counted when handed out: a state taken then resumes after it; run to its end, the
            # next epoch's first loads finish inside this epoch's last next() (settling again below: a no-op)
            yield from handed_out(producer, self.metrics, handoff.receive, lambda item: pos.take(),
                                  lambda: self.ahead.settle(pre, True))
        except BaseException as e:  # an error or Ctrl-C inside next(): a traceback kept (Jupyter keeps the last
            failed = not isinstance(e, GeneratorExit)  # one) holds the reader, not its pools' memory; a loop left
            raise  # (break, close: GeneratorExit) keeps them for the next epoch
        finally:
            pos.running = False
            if not producer.finished:  # left early: no load goes on, none waits on a stalled store
                producer.stop.set()
                r.interrupt()
            producer.close()
            self.ahead.settle(pre, producer.finished)
            if failed:
                r.release_memory()
            if before is not None:  # were this pass's direct cache reads the limit? (also a pass left
                after = self._measured()  # early: a Mix closes its sources' passes, a loop stops at a step)
                if after[0] == before[0] and after[-1] == before[-1]:  # no reset meanwhile, nothing decoded
                    r.pass_ended(*(a - b for a, b in zip(after[1:-1], before[1:-1])))

    def _measured(self) -> tuple:
        """What a pass's reads are judged by (:meth:`gpuload.reader.ChunkReader.pass_ended`): the
        metrics' resets, wall, waiting after the first batch and cache reads so far, and the chunks
        decoded (a pass that decodes any is not a cached one)."""
        return (*self.metrics.totals("cache_read"), self.reader.counters.decoded)

    def _batches(self, pos: Position, handoff: Callable, stop, pre) -> Iterator:
        """The producer's side: this rank's rest of ``pos``'s epoch as batches, through ``handoff``."""
        o, r = self.options, self.reader
        rest = self.plan.rest(pos, pos.ranks.rank)
        device = r.device

        def loaded() -> None:  # this epoch's last loads are under way: the next epoch's first chunks load meanwhile
            if not stop.is_set() and self.preload_next:
                self.ahead.start(self.cursor.plan_epoch, pos.epoch, o.prefetch, o.num_threads, device, r.load,
                                 shuffled=self.plan.shuffled)

        def draw(i: int, n: int):  # window i's rows as positions in it, the same order on every device
            return self.plan.permutation(pos.epoch, rest.takes[i], n)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuload-perm") as drawer:
            drawn: dict = {}  # window -> its permutation being drawn, one window ahead of the window thread

            def permutation(i: int, n: int):
                """Window i's permutation where the gathers run; window i + 1's is drawn meanwhile on the
                drawer thread (NumPy shuffles without the GIL): on the H200 drawing them was half the
                window thread's time in cached epochs, and the producer waited for windows."""
                ahead = drawn.pop(i, None)  # drawn for the rows epoch_batches plans for a window: n
                if i + 1 < len(rest.loads):
                    drawn[i + 1] = drawer.submit(draw, i + 1, sum(s.hi - s.lo for s in rest.loads[i + 1]))
                return device.upload_index(draw(i, n) if ahead is None else ahead.result())

            remote = r.has_remote
            try:
                yield from epoch_batches(rest.loads, rest.sizes, r.load, permutation if self.plan.shuffled else None,
                                         handoff, threads=o.num_threads,
                                         prefetch=o.prefetch, stop=stop, alloc=device.host_alloc(r.pool),
                                         batch_alloc=device.host_alloc(r.batch_pool), stages=device,
                                         metrics=self.metrics, warm=r.warm if remote else None,
                                         forget=r.forget_ahead if remote else None,
                                         cut_threads=cut_threads(o.num_threads), preloaded=pre,
                                         loaded=loaded if o.prefetch and r.caching else None)  # off: the next
                # epoch's first window would be decoded (and waited for at this one's end) for a job that may have none
            finally:
                for f in drawn.values():  # left early: no draw for a window that will not come
                    f.cancel()

    def close(self) -> None:
        """Drop the next epoch's chunks loaded ahead."""
        self.ahead.drop()
