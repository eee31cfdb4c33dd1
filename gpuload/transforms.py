"""Batch transforms: a user's function applied to every batch on the loader's producer thread.

``ParquetDataset(..., batch_transform=fn)`` calls ``fn(batch, generator)`` for each batch after
the shuffle and before the hand-off: on the producer thread (the training thread never runs
it) and, on a GPU, on the loader's batch stream, so its kernels are queued before the batch's
ready event and the training step waits for them only when it uses the batch. It is for work
that must differ each epoch (augmentation, masking, negative sampling); work that is the same
every epoch belongs in the cache instead.

``generator`` is a ``torch.Generator`` on the batch's device, seeded from the dataset's
fingerprint and ``seed``, the epoch, the run of the epoch (a resume on another number of ranks
starts a new run), the rank and the batch's position in the rank's run: an uninterrupted
epoch and one resumed from a state give every batch the same generator, so a transform that
draws its randomness from it gives the same batches (bit for bit, on the same device and
library versions).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["BatchTransform", "check_batch_transform", "batch_seed"]


def check_batch_transform(fn) -> Callable | None:
    """``fn`` if it is None or callable, else :class:`ConfigError` naming the setting."""
    if fn is not None and not callable(fn):
        raise ConfigError(f"batch_transform={fn!r} must be a function fn(batch, generator) -> batch (or None)")
    return fn


def batch_seed(fingerprint: int, seed: int, epoch: int, run: int, rank: int, index: int) -> int:
    """The seed (0 <= seed < 2**63) of the generator of batch ``index`` of ``rank`` in run ``run``
    of ``epoch``."""
    key = [int(k) & (2**63 - 1) for k in (fingerprint, seed, epoch, 2, run, rank, index)]  # 2: not a permutation's key
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]) & (2**63 - 1)


class BatchTransform:
    """``fn`` applied to one iteration's batches in turn (on the producer thread).

    ``key``: ``(fingerprint, seed, epoch, run, rank)`` of the iteration; ``first``: the
    position in the rank's run of the first batch it yields (the batches a resumed run took
    already); ``device``: the batches' torch device, where the generator lives.
    """

    def __init__(self, fn: Callable, key: tuple[int, int, int, int, int], first: int, device: torch.device):
        self.fn, self.key, self.index, self.device = fn, key, first, device

    @classmethod
    def starting(cls, fn: Callable, pos, fingerprint: int, seed: int, device: torch.device) -> BatchTransform:
        """The transform of an iteration beginning at position ``pos`` (a
        :class:`gpuload.epochs.Position` whose ranks are known)."""
        return cls(fn, (fingerprint, seed, pos.epoch, len(pos.runs) - 1, pos.ranks.rank), pos.runs[-1].taken, device)

    def __call__(self, batch: dict) -> dict:
        g = torch.Generator(device=self.device)
        g.manual_seed(batch_seed(*self.key, self.index))
        where = f"batch {self.index} of epoch {self.key[2]} (rank {self.key[4]}, run {self.key[3]})"
        try:
            out = self.fn(batch, g)
        except Exception as e:
            e.add_note(f"gpuload: raised by batch_transform on {where}")
            raise
        if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
            raise ConfigError(f"batch_transform returned {type(out).__name__} for {where}: it must return a dict "
                              "of output name -> tensor (the batch it was given, changed or not)")
        self.index += 1
        return dict(out)
