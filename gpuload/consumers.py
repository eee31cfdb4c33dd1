"""Consumers that would batch or shard gpuload's batches a second time, refused when they start;
and copies of a loader (pickling, deepcopy), refused with what to do instead.

gpuload batches, shuffles and shards by itself: every rank reads its own share of each
epoch and yields the same number of batches. Two common wrappers would do some of that
again, and deliver wrong rows without an error:

* ``torch.utils.data.DataLoader(ds)`` with its default ``batch_size=1`` stacks each batch
  into a ``[1, ...]`` batch of one;
* accelerate's ``Accelerator.prepare(DataLoader(ds, batch_size=None))`` shards the loader
  again: by default (``dispatch_batches``) only process 0's loader is read, and each of its
  batches is split among the processes, so the other ranks' shards are never read (half
  the rows on 2 processes) and list columns are cut by rows of their values; with
  ``dispatch_batches=False`` it wraps the dataset in ``IterableDatasetShard``, which keeps
  one of every ``num_processes`` batches of each rank's own shard.

They are recognised by the code of the frame that calls the dataset (read from the call
stack, without touching any frame's variables; accelerate is never imported here, only
looked up where the process already imported it) and refused with a
:class:`~gpuload.ConfigError` that says what to do instead.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType

from .errors import ConfigError

__all__ = ["check_iter_caller", "check_set_epoch_caller", "NotCopied"]

_DEPTH = 12  # frames looked at above the dataset's own: accelerate's loop is ~7 calls up from iter(ds)

_ACCELERATE = {
    "DataLoaderDispatcher": "it reads batches on process 0 only (dispatch_batches, accelerate's default for an "
                            "iterable dataset) and splits each among the processes, so the other ranks' shards are "
                            "never read and list columns are cut wrongly",
    "IterableDatasetShard": "it keeps one of every num_processes batches of each process's loader "
                            "(dispatch_batches=False), so each rank trains on part of its own shard",
}


def _accelerate_codes() -> dict[CodeType, str]:
    """Code objects of accelerate's re-sharding loops, where accelerate is imported."""
    mod = sys.modules.get("accelerate.data_loader")
    if mod is None:
        return {}
    codes = {}
    for cls, why in _ACCELERATE.items():
        for method in ("__iter__", "set_epoch"):
            code = getattr(getattr(getattr(mod, cls, None), method, None), "__code__", None)
            if code is not None:
                codes[code] = f"accelerate's {cls}: {why}"
    return codes


def _refuse_accelerate(frame: FrameType | None) -> None:
    codes = _accelerate_codes()
    for _ in range(_DEPTH if codes else 0):
        if frame is None:
            return
        why = codes.get(frame.f_code)
        if why is not None:
            raise ConfigError(
                f"accelerator.prepare(DataLoader(ds)) shards gpuload's batches a second time ({why}); gpuload "
                "already gives each rank its own shard. Do not pass gpuload's loader to accelerator.prepare: "
                "prepare the model and the optimizer only (model, opt = accelerator.prepare(model, opt)) and "
                "iterate the dataset, made with device=accelerator.device (README: Training frameworks)")
        frame = frame.f_back


def check_iter_caller(caller: FrameType) -> None:
    """Refuse an ``iter(ds)`` from a consumer that would batch or shard again (``caller``: its frame)."""
    # a DataLoader's fetcher calls iter() in its __init__; only that frame's `self` is read: reading
    # f_locals snapshots every local of the caller (the training loop's own frame, most often) and
    # keeps them alive after a `del`
    fetcher = caller.f_locals.get("self") if caller.f_code.co_name == "__init__" else None
    if type(fetcher).__name__ == "_IterableDatasetFetcher" and getattr(fetcher, "auto_collation", False):
        raise ConfigError("DataLoader(ds) would batch gpuload's batches again (a leading [1, ...] dimension): "
                          "pass DataLoader(ds, batch_size=None), or iterate the dataset directly")
    _refuse_accelerate(caller)


def check_set_epoch_caller(caller: FrameType) -> None:
    """Refuse ``set_epoch`` called by accelerate's re-sharding loaders (they call it before iterating)."""
    _refuse_accelerate(caller)


class NotCopied:
    """A loader that is shared, never copied: ``copy.deepcopy`` of what holds it (a LightningModule
    copied by SWA or EMA callbacks, ``torch.optim.swa_utils.AveragedModel``) shares this same loader;
    pickling (a spawned process, a DataLoader worker under spawn or forkserver) and ``copy.copy``,
    which would need its threads, pools and open cache files, raise a
    :class:`~gpuload.ConfigError` that says where to make it instead."""

    def __getstate__(self):
        what = type(self).__name__
        raise ConfigError(
            f"a {what} cannot be pickled or copied (it holds gpuload's threads, pools and open cache files; "
            f"copy.deepcopy of what holds it, as SWA or EMA callbacks make, shares this same {what}): make "
            f"it in the process that iterates it. Under Lightning's ddp_spawn (or any launcher that pickles the "
            f"LightningModule) make it in setup() or train_dataloader(), or use strategy='ddp'; with a DataLoader "
            f"keep num_workers=0 (gpuload reads on threads of its own); for a second loader of the same data make "
            f"another {what}")

    def __deepcopy__(self, memo):
        return self
