"""gpuload: ParquetDataset on the CPU; the first epoch builds its cache (opening and the last durable cache
write included), the second reads it. Variants: default (shuffled), noshuffle, block, stacked, nice (the default
with nice=10), buffered (the default with cache_io="buffered": cache files written and read through the page cache),
off (the default with cache_io="off": nothing cached, every epoch decodes Parquet; a job of one epoch), chunks
(shuffle="chunks": the chunk order alone permuted), chunks-off (the same with cache_io="off"), wide (the default with num_threads = the process's cores - 3, at least 2: decoding on every core)."""

import os
import sys

from common import Peer, files, main

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..")]
import bench_step  # noqa: E402
import gpuload  # noqa: E402
import gpuload.memory  # noqa: E402

# bench_step's outputs, with the row ids every epoch is checked against
PER_COLUMN = {"row_id": "row_id", **bench_step.PER_COLUMN}
STACKED = {"row_id": "row_id", **bench_step.STACKED}
VARIANTS = {"default": (PER_COLUMN, {}), "noshuffle": (PER_COLUMN, {"shuffle": False}),
            "block": (PER_COLUMN, {"shuffle": "block"}), "stacked": (STACKED, {}),
            "nice": (PER_COLUMN, {"nice": 10}),  # the default, its threads 10 nice steps below the training thread
            "buffered": (PER_COLUMN, {"cache_io": "buffered"}),  # the default, its cache through the page cache
            "off": (PER_COLUMN, {"cache_io": "off"}),  # the default, caching nothing (a job of one epoch)
            # the chunk order alone permuted, rows in file order (a DataLoader over shuffled row groups)
            "chunks": (PER_COLUMN, {"shuffle": "chunks"}),
            "chunks-off": (PER_COLUMN, {"shuffle": "chunks", "cache_io": "off"}),
            # the default with a loader thread for every core but the training thread's, the producer's and one more
            "wide": (PER_COLUMN, {"num_threads": max(2, gpuload.machine.cores() - 3)})}


class Gpuload(Peer):
    def __init__(self, args):
        super().__init__(args)
        self.variant = args.variant or "default"
        self.cols, self.kw = VARIANTS[self.variant]
        self.name = f"gpuload ({self.variant})"
        self.ds = None
        self.versions = {"gpuload": gpuload.__version__}
        self.notes.append(f"ParquetDataset(batch_size={args.batch_size}, device='cpu'"
                          + "".join(f", {k}={v!r}" for k, v in self.kw.items()) + ")"
                          + ("; outputs dense [N,13] and cat [N,26] stacked" if self.variant == "stacked" else "")
                          + ("; every epoch decoded from Parquet" if self.variant.endswith("off") else
                             "; first epoch = open + epoch 0 + cache flush (fsync)"))
        self.shuffle = {"noshuffle": "none (file order)",
                        "chunks": "chunk order permuted (rows in order within a chunk)",
                        "chunks-off": "chunk order permuted (rows in order within a chunk)",
                        "block": "blocks of 256 rows permuted within a window of ~{w:,} rows (rows permuted "
                                 "within each chunk once, at caching); chunk order permuted",
                        }.get(self.variant, "rows permuted within a window of ~{w:,} rows; chunk order permuted"
                              ).format(w=args.window)

    def prepare(self):
        self.ds = gpuload.ParquetDataset(files(self.args), self.cols, batch_size=self.args.batch_size,
                                         cache_dir=os.path.join(self.args.work, "cache"), device="cpu", **self.kw)

    def epoch(self, e):
        self.ds.set_epoch(e)
        return self.ds

    def after_epoch(self, e):
        if e == 0:
            self.ds.reader.cache.flush()  # the last background cache writes count toward the first epoch


if __name__ == "__main__":
    main(Gpuload, __doc__)
