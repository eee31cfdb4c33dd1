"""A DDP training script mixing two sources, for tests/test_mix_ddp.py, run under torchrun (gloo, CPU).

A local folder and an S3 prefix (a loopback server the test runs) are mixed 2:1 with
``gpuload.Mix``; a linear model trains under ``DistributedDataParallel``. Every rank logs
each step's rows with their source (``rows.<run>.<rank>.txt``: ``epoch step source:id,...``),
checkpoints model, optimizer and the mix's state together at ``--checkpoint-at`` (a global
step), goes on slowly after it (so the test can kill it), and with ``--resume`` starts from
that checkpoint, on however many ranks it now has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gpuload

COLUMNS = {"row_id": "row_id", "x": ["x0", "x1", "x2", "x3"], "y": "y"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True, help="the local source folder")
    p.add_argument("--s3", required=True, help="s3://bucket/prefix/")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--checkpoint-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{args.name}.{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    s3 = {"key": "testing", "secret": "testing",
          "client_kwargs": {"endpoint_url": args.endpoint, "region_name": "us-east-1"},
          "config_kwargs": {"retries": {"max_attempts": 1}}}
    common = dict(batch_size=32, cache_dir=args.cache, device="cpu", chunk_bytes=16 << 10, shuffle_window=2)
    mix = gpuload.Mix({"local": gpuload.ParquetDataset(args.folder, COLUMNS, seed=1, **common),
                       "s3": gpuload.ParquetDataset(args.s3, COLUMNS, storage_options=s3, seed=2, **common)},
                      weights={"local": 2, "s3": 1}, batches_per_step=3, provenance="source")
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ckpt = out / "checkpoint.pt"
    epoch0, step = 0, 0
    if args.resume:
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        mix.load_state_dict(saved["loader"])
        epoch0, step = saved["epoch"], saved["step"]
    log = open(out / f"rows.{args.name}.{rank}.txt", "a")
    counts = {}
    for epoch in range(epoch0, args.epochs):
        mix.set_epoch(epoch)
        counts[epoch] = 0
        for batch in mix:
            loss = torch.nn.functional.mse_loss(ddp(batch["x"]).squeeze(1), batch["y"])
            opt.zero_grad()
            loss.backward()  # DDP's all-reduce: a rank with another number of steps would hang here
            opt.step()
            rows = ",".join(f"{s}:{i}" for s, i in zip(batch["source"].tolist(), batch["row_id"].tolist()))
            log.write(f"{epoch} {step} {rows}\n")
            log.flush()
            step += 1
            counts[epoch] += 1
            if step == args.checkpoint_at:
                state = mix.state_dict()
                if rank == 0:
                    tmp = ckpt.with_suffix(".tmp")
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": state,
                                "epoch": epoch, "step": step}, tmp)
                    os.replace(tmp, ckpt)
                dist.barrier()
                if rank == 0:
                    (out / "checkpointed").write_text(str(step))
            elif args.checkpoint_at >= 0 and step > args.checkpoint_at:
                time.sleep(0.2)  # work after the checkpoint, lost when the job is killed
    (out / f"done.{args.name}.{rank}").write_text(json.dumps({"counts": counts, "world": world,
                                                               "plan": list(mix.plan().counts)}))
    log.close()
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
