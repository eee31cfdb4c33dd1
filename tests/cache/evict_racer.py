"""A reader racing others for a small cache budget (tests/cache/test_evict.py): epochs of datasets
drawn at random, each checked row for row, until it is killed.

    python evict_racer.py CACHE OUT SEED NAME=SOURCE:FIRST ...
"""

import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import open_dataset  # noqa: E402


def main() -> None:
    cache, out, seed, *specs = sys.argv[1:]
    sources = {}
    for spec in specs:
        name, rest = spec.split("=", 1)
        path, first, rows = rest.rsplit(":", 2)
        sources[name] = (path, int(first), int(rows))
    rng = random.Random(int(seed))
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while True:
        name = rng.choice(sorted(sources))
        path, first, rows = sources[name]
        ds = open_dataset(path, ["x"], cache, batch_size=25_000, seed=rng.randrange(1 << 30))
        got = np.sort(np.concatenate([b["x"].numpy() for b in ds]))
        ok = np.array_equal(got, np.arange(first, first + rows))
        os.write(fd, f"{'ok' if ok else 'BAD'} {name} {os.getpid()}\n".encode())
        if not ok:
            sys.exit(1)
        ds.close()


if __name__ == "__main__":
    main()
