"""Training scripts for tests/test_frameworks.py: gpuload under real training frameworks (CPU, gloo).

One script, three ways to run it, each as the README's recipe for that framework:

* ``torchrun``: run under ``python -m torch.distributed.run --nproc_per_node=2``; the dataset
  is made *before* ``init_process_group`` (and tried once before it too), then trained
  with ``DistributedDataParallel``, calling ``set_epoch`` each epoch;
* ``lightning``: a ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (``--devices``) started by
  this script (Lightning re-runs it for the other ranks); the datasets are made in the
  LightningModule's ``__init__``, before any process group, and returned by the
  ``*_dataloader`` hooks themselves (so Lightning keeps the training set's state in its
  checkpoints), the training set told Lightning's epoch in ``on_train_epoch_start`` and its state
  also kept by ``on_save_checkpoint`` and restored by ``on_load_checkpoint`` (before Lightning
  takes ``len``, which an elastic resume changes); a validation set (not shuffled) runs
  the sanity check and each epoch's validation. With ``--checkpoint-every K`` a
  ``ModelCheckpoint`` saves every K steps into ``<out>/checkpoints`` and another one at each epoch's end
  (Lightning's default) into ``<out>/checkpoints/epoch-ends``; with ``--die-at S``
  each rank leaves with ``os._exit`` as step S begins (a preempted job: ``<out>/died.<rank>``
  says it did); with ``--resume CKPT`` the job goes on from that checkpoint;
* ``accelerate``: run under ``python -m accelerate.commands.launch --multi_gpu
  --num_processes 2`` with ``Accelerator(cpu=True)``; first the two patterns that would
  re-shard gpuload's batches (``accelerator.prepare(DataLoader(ds))``, with accelerate's
  default dispatching and with ``dispatch_batches=False``), then the recommended one:
  model and optimizer prepared, the dataset iterated directly, no ``set_epoch``, and
  registered for checkpointing (``accelerator.save_state`` after 5 batches of epoch 1,
  into ``<out>/checkpoint``).

Every rank writes the ``row_id`` of each training batch to ``<out>/rows.<rank>.txt``
(``<epoch> <ids>``; validation batches as ``val<run> <ids>``) and, at the end,
``<out>/done.<rank>.json`` (batches per epoch, ``len(ds)``, what a refused pattern said).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import gpuload

COLUMNS = {"row_id": "row_id", "x": ["x0", "x1"], "y": "y"}
OPTIONS = {"chunk_bytes": 8 << 10, "shuffle_window": 2}  # small chunks: several windows, an order to shuffle


def open_dataset(args, **kw) -> gpuload.ParquetDataset:
    return gpuload.ParquetDataset(args.source, COLUMNS, batch_size=args.batch_size, cache_dir=args.cache,
                                  **{**OPTIONS, "device": "cpu", **kw})


def step(model, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])


class Log:
    def __init__(self, out: Path, rank: int):
        self.out, self.rank = out, rank
        self.file = open(out / f"rows.{rank}.txt", "a")
        self.counts: dict[str, int] = {}

    def batch(self, epoch, batch) -> None:
        self.file.write(f"{epoch} {','.join(map(str, batch['row_id'].tolist()))}\n")
        self.file.flush()
        self.counts[str(epoch)] = self.counts.get(str(epoch), 0) + 1

    def done(self, **info) -> None:
        self.file.close()
        (self.out / f"done.{self.rank}.json").write_text(json.dumps({"counts": self.counts, **info}))


def _refusal(fn) -> str | None:
    """What ``fn()`` raised (a ConfigError's message), or None when it did not refuse."""
    try:
        fn()
    except gpuload.ConfigError as e:
        return str(e)
    return None


def run_torchrun(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ds = open_dataset(args)  # before init_process_group, as a script that builds its data first does
    early = _refusal(lambda: next(iter(ds)))  # torchrun said WORLD_SIZE=2, but there is no process group yet
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = Log(args.out, rank)
    model = DistributedDataParallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        for batch in ds:
            loss = step(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.batch(epoch, batch)
    log.done(len=len(ds), world=dist.get_world_size(), refused_before_init=early)
    dist.barrier()
    dist.destroy_process_group()


def run_lightning(args) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.train_set = open_dataset(args)  # no process group yet: Lightning starts it in fit()
            self.val_set = open_dataset(args, shuffle=False)
            self.net = torch.nn.Linear(2, 1)
            self.log_file = None
            self.val_runs = -1

        def _log(self) -> Log:
            if self.log_file is None:
                self.log_file = Log(args.out, self.global_rank)
            return self.log_file

        def train_dataloader(self):  # the dataset itself: Lightning saves its state_dict in checkpoints
            return self.train_set

        def on_train_epoch_start(self):  # Lightning's epoch: restored even where Lightning skips the state
            self.train_set.set_epoch(self.current_epoch)  # (a checkpoint at an epoch's end)

        def on_save_checkpoint(self, checkpoint):
            checkpoint["train_set"] = self.train_set.state_dict()

        def on_load_checkpoint(self, checkpoint):  # before Lightning counts the epoch's batches: on
            self.train_set.load_state_dict(checkpoint["train_set"])  # other ranks, len(ds) then counts right

        def val_dataloader(self):
            return self.val_set

        def training_step(self, batch, batch_idx):
            if self.global_step == args.die_at:  # preempted as this step begins
                (args.out / f"died.{self.global_rank}").write_text(str(self.global_step))
                os._exit(0)
            self._log().batch(self.current_epoch, batch)
            return step(self.net, batch)

        def on_validation_epoch_start(self):
            self.val_runs += 1  # run 0 is the sanity check

        def validation_step(self, batch, batch_idx):
            self._log().batch(f"val{self.val_runs}", batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_fit_end(self):
            self._log().done(len=len(self.train_set), world=self.trainer.world_size,
                             train_len=self.trainer.num_training_batches)

    module = Module()
    every = args.checkpoint_every
    callbacks = [] if every is None else [  # one preempted job gives both kinds of checkpoint
        ModelCheckpoint(dirpath=str(args.out / "checkpoints"), every_n_train_steps=every, save_top_k=-1),
        ModelCheckpoint(dirpath=str(args.out / "checkpoints" / "epoch-ends"), save_top_k=-1)]
    if every is None and args.resume is None:  # the uninterrupted job: SWA deep-copies the module, dataset and all
        from lightning.pytorch.callbacks import StochasticWeightAveraging
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs, logger=False,
                        enable_checkpointing=every is not None, callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(args.out), num_sanity_val_steps=2)
    trainer.fit(module, ckpt_path=args.resume)
    for child in getattr(trainer.strategy.launcher, "procs", []):  # rank 0 started rank 1: let it finish
        child.wait(timeout=120)


def run_accelerate(args) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    ds = open_dataset(args, device=accelerator.device)
    refused = {}
    for name, config in (("dispatch", DataLoaderConfiguration()),
                         ("shard", DataLoaderConfiguration(dispatch_batches=False))):
        loader = Accelerator(cpu=True, dataloader_config=config).prepare(DataLoader(ds, batch_size=None))
        try:
            rows = sum(len(b["row_id"]) for b in loader)
            refused[name] = {"refused": False, "rows": rows}
        except gpuload.ConfigError as e:
            refused[name] = {"refused": True, "message": str(e)}
        except Exception as e:  # noqa: BLE001 (what accelerate itself raised)
            refused[name] = {"refused": False, "error": f"{type(e).__name__}: {e}"}
    # the recommended pattern: prepare the model and the optimizer, iterate gpuload itself
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    accelerator.register_for_checkpointing(ds)  # save_state / load_state keep the loader's position
    log = Log(args.out, rank)
    for epoch in range(args.epochs):  # no set_epoch: every iteration begins the next epoch
        for i, batch in enumerate(ds):
            loss = step(model, batch)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            log.batch(epoch, batch)
            if (epoch, i) == (1, 4):
                accelerator.save_state(str(args.out / "checkpoint"))
    log.done(len=len(ds), world=accelerator.num_processes, prepared=refused)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["torchrun", "lightning", "accelerate"])
    p.add_argument("--source", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=None)  # lightning: a checkpoint every K steps
    p.add_argument("--die-at", type=int, default=-1)  # lightning: every rank leaves as step S begins
    p.add_argument("--resume", default=None)  # lightning: the checkpoint to go on from
    p.add_argument("--devices", type=int, default=2)  # lightning: processes
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    {"torchrun": run_torchrun, "lightning": run_lightning, "accelerate": run_accelerate}[args.framework](args)
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is written: leave without interpreter finalisation (gloo's threads can abort it, see ddp_train.py)
    os._exit(0)


if __name__ == "__main__":
    main()
