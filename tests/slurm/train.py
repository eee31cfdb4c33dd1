"""One task's epoch under Slurm, for tests/test_slurm.py and the README's Slurm example.

    srun python tests/slurm/train.py SOURCE CACHE OUT [global|node]

No rank is passed: gpuload reads it from srun's variables. Each process writes
``OUT/rank<r>.json``: the rank and world size the dataset used, its batch count and the
row ids it read in order.
"""

import json
import os
import sys

import gpuload


def main() -> None:
    source, cache, out, *rest = sys.argv[1:]
    ds = gpuload.ParquetDataset(source, ["row_id"], cache_dir=cache, batch_size=64, device="cpu", seed=7,
                                shard=rest[0] if rest else "global")
    ids, batches = [], 0
    for batch in ds:
        ids += batch["row_id"].tolist()
        batches += 1
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{ds.rank}.json"), "w") as f:
        json.dump({"rank": ds.rank, "world": ds.world_size, "local": ds.local_world_size, "batches": batches,
                   "ids": ids, "procid": os.environ.get("SLURM_PROCID")}, f)


if __name__ == "__main__":
    main()
