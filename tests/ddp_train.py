"""A small DDP training script for tests/test_ddp.py, run under torchrun (gloo, CPU).

It trains a linear model on a gpuload dataset, checkpoints the model, the optimizer and
the loader's state together at ``--checkpoint-at`` (a global step), and, with
``--resume``, starts from that checkpoint. Every rank logs the ``row_id`` of each batch
it trains on (``rows.<run>.<rank>.txt``: ``epoch step id,id,...``), so the test can
check that each row was used exactly once per epoch across an interrupted run and its
restart. After the checkpoint it goes on slowly, so that the test can kill it mid-way.
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


def _ordered_mean(world: int, bucket):
    """DDP's gradient mean, summed in rank order: gloo's all-reduce may add 3 or more ranks'
    values in another order from run to run, and float sums then differ in the last bit."""
    grads = bucket.buffer()
    parts = [torch.empty_like(grads) for _ in range(world)]
    fut = dist.all_gather(parts, grads, async_op=True).get_future()

    def mean(_):
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total / world

    return fut.then(mean)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", required=True)
    p.add_argument("--cache", required=True, help="cache root; each node uses <cache>/node<GROUP_RANK>")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True, help="name of this run in the logs")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--checkpoint-at", type=int, default=-1, help="global step after which to checkpoint")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--shard", default="global", choices=["global", "node"])
    p.add_argument("--seed-per-rank", action="store_true", help="seed=rank: a mistake gpuload must refuse")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", "0"))
    out = Path(args.out)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{args.name}.{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    ds = gpuload.ParquetDataset(args.source, {"row_id": "row_id", "x": ["x0", "x1", "x2", "x3"], "y": "y"},
                                batch_size=args.batch_size, cache_dir=Path(args.cache) / f"node{node}",
                                device="cpu", chunk_bytes=16 << 10, shuffle_window=2, shard=args.shard,
                                seed=rank if args.seed_per_rank else 0)
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(world, _ordered_mean)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    ckpt = out / "checkpoint.pt"
    epoch0, step = 0, 0
    if args.resume:
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        ds.load_state_dict(saved["loader"])  # rank 0's state, on every rank
        epoch0, step = saved["epoch"], saved["step"]

    log = open(out / f"rows.{args.name}.{rank}.txt", "a")
    counts, decoded = {}, {}
    for epoch in range(epoch0, args.epochs):
        ds.set_epoch(epoch)
        counts[epoch] = 0
        before = ds.reader.counters.decoded
        for batch in ds:
            loss = torch.nn.functional.mse_loss(ddp(batch["x"]).squeeze(1), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write(f"{epoch} {step} {','.join(map(str, batch['row_id'].tolist()))}\n")
            log.flush()
            step += 1
            counts[epoch] += 1
            if step == args.checkpoint_at:
                state = ds.state_dict()
                (out / f"loader_state.{rank}.json").write_text(json.dumps(state))
                if rank == 0:  # DDP ranks hold the same model and the same loader state: rank 0 saves
                    tmp = ckpt.with_suffix(".tmp")
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": state,
                                "epoch": epoch, "step": step}, tmp)
                    os.replace(tmp, ckpt)
                dist.barrier()
                if rank == 0:
                    (out / "checkpointed").write_text(str(step))
            elif args.checkpoint_at >= 0 and step > args.checkpoint_at:
                time.sleep(0.2)  # work after the checkpoint, lost when the job is killed
        decoded[epoch] = ds.reader.counters.decoded - before  # chunks this rank decoded (not in its cache)
    if rank == 0:
        torch.save(model.state_dict(), out / f"model.{args.name}.pt")
    (out / f"done.{args.name}.{rank}").write_text(json.dumps({"counts": counts, "world": world,
                                                               "decoded": decoded}))
    log.close()
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    # everything is written: leave without interpreter finalisation, where gloo's threads can still
    # abort the process ("terminate called without an active exception", seen with torch 2.13 on a
    # loaded 2-core machine, after the work and the files were complete)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
