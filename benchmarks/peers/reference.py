"""References in the project's venv: pq.read_table of the same columns (the first epoch's reference), the
naive pyarrow loop, and the ideal hand-written .npy cache read in order or gathered within windows
(the cached epoch's references), or with blocks of rows permuted within windows (gpuload's "block" strength);
ideal_window_stacked: the windowed one over the stacked outputs of gpuload's "stacked" variant. Variants:
read_table, naive, ideal_seq, ideal_window, ideal_block, ideal_window_stacked."""

import os
import pathlib
import sys

import pyarrow.parquet as pq
import torch

from common import COLUMNS, Peer, arrow_to_torch, files, main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_cpu import CHUNK_ROWS, ideal_blocks, ideal_sequential, ideal_shuffled, write_npy  # noqa: E402
from gpuload_runner import PER_COLUMN, STACKED  # noqa: E402
from gpuload.config import Options  # noqa: E402

BLOCK_ROWS = Options.block_rows  #: gpuload's default


class ReadTable(Peer):
    name = "pq.read_table (reference, no batches)"
    shuffle = "none"

    def __init__(self, args):
        super().__init__(args)
        self.notes.append("pq.read_table(files, columns=the same 42) per epoch, pyarrow's own threads; the "
                          "consumer then gets one 'batch' holding only row_id (copied once, one step)")

    def epoch(self, e):
        t = pq.read_table(files(self.args), columns=COLUMNS)
        yield {"row_id": torch.from_numpy(t.column("row_id").to_numpy())}


class Naive(Peer):
    name = "naive pyarrow loop"
    shuffle = "none (file order)"

    def __init__(self, args):
        super().__init__(args)
        self.notes.append("ParquetFile(f).iter_batches(batch_size, columns) per file on the training thread, "
                          "to_numpy + torch.from_numpy per column (lists as values + offsets)")

    def epoch(self, e):
        for f in files(self.args):
            for rb in pq.ParquetFile(f).iter_batches(batch_size=self.args.batch_size, columns=COLUMNS):
                yield arrow_to_torch(rb)


class Ideal(Peer):
    SHUFFLES = {"ideal_seq": ("in order", "none"),
                "ideal_window": ("windowed shuffle", "rows permuted within windows of ~{w:,} rows; chunk order permuted"),
                "ideal_window_stacked": ("windowed shuffle, stacked outputs",
                                         "rows permuted within windows of ~{w:,} rows; chunk order permuted"),
                "ideal_block": ("block shuffle", f"blocks of {BLOCK_ROWS} rows permuted within windows of ~{{w:,}} "
                                                 "rows (rows permuted within each chunk once, at caching); chunk "
                                                 "order permuted")}

    def __init__(self, args):
        super().__init__(args)
        self.variant = args.variant
        what, shuffle = self.SHUFFLES[self.variant]
        self.name, self.shuffle = f"ideal .npy cache, {what}", shuffle.format(w=args.window)
        self.columns = STACKED if self.variant == "ideal_window_stacked" else PER_COLUMN
        self.permute = CHUNK_ROWS if self.variant == "ideal_block" else 0
        self.folder = pathlib.Path(args.work) / {"ideal_window_stacked": "npy-stacked",
                                                 "ideal_block": "npy-block"}.get(self.variant, "npy")
        self.notes.append(
            "one .npy per output (history: values + offsets"
            + ("; dense [N,13] and cat [N,26] stacked" if self.columns is STACKED else "")
            + (f"; rows permuted within each run of {CHUNK_ROWS:,} once" if self.permute else "")
            + ") written by read_table + np.save (the conversion), np.load(mmap_mode='r') each epoch, "
            + ("consecutive batches as views" if self.variant == "ideal_seq" else
               f"chunks of {CHUNK_ROWS:,} rows in a permuted order, "
               + (f"blocks of {BLOCK_ROWS} rows permuted within windows of gpuload's default size, each batch "
                  f"gathered by one fancy index per column of its [blocks, {BLOCK_ROWS}] view, the list's values "
                  "one slice per block" if self.permute else
                  "rows permuted within windows of gpuload's default size, each batch gathered with "
                  "gpuload.batch.take") + ", on 2 threads, 4 batches ahead of the consumer"))

    def prepare(self):
        write_npy(files(self.args), self.columns, self.folder, permute_chunks=self.permute)

    def epoch(self, e):
        if self.variant == "ideal_seq":
            return ideal_sequential(self.folder, self.columns, self.args.batch_size)
        if self.variant == "ideal_block":
            return ideal_blocks(self.folder, self.columns, self.args.batch_size, self.args.window, BLOCK_ROWS, seed=e)
        return ideal_shuffled(self.folder, self.columns, self.args.batch_size, self.args.window, seed=e)


if __name__ == "__main__":
    variant = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--variant=")), None)
    if variant is None and "--variant" in sys.argv:
        variant = sys.argv[sys.argv.index("--variant") + 1]
    main({"read_table": ReadTable, "naive": Naive, **{v: Ideal for v in Ideal.SHUFFLES}}[variant], __doc__)
