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
from bench_cpu import ideal_blocks, ideal_sequential, ideal_shuffled, write_npy  # noqa: E402
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
                "ideal_window": ("windowed shuffle", "rows permuted within consecutive windows of {w:,} rows"),
                "ideal_window_stacked": ("windowed shuffle, stacked outputs",
                                         "rows permuted within consecutive windows of {w:,} rows"),
                "ideal_block": ("block shuffle", f"blocks of {BLOCK_ROWS} rows permuted within consecutive windows "
                                                 "of {w:,} rows")}

    def __init__(self, args):
        super().__init__(args)
        self.variant = args.variant
        what, shuffle = self.SHUFFLES[self.variant]
        self.name, self.shuffle = f"ideal .npy cache, {what}", shuffle.format(w=args.window)
        self.columns = STACKED if self.variant == "ideal_window_stacked" else PER_COLUMN
        self.folder = pathlib.Path(args.work) / ("npy-stacked" if self.columns is STACKED else "npy")
        how = {"ideal_seq": "consecutive batches as views",
               "ideal_block": f"each batch's blocks of {BLOCK_ROWS} rows gathered in one index of a [blocks, "
                              f"{BLOCK_ROWS}] view per column (the list by rows)"}
        self.notes.append("one .npy per output (history: values + offsets"
                          + ("; dense [N,13] and cat [N,26] stacked" if self.columns is STACKED else "")
                          + ") written by read_table + np.save (the conversion), np.load(mmap_mode='r') each epoch, "
                          + how.get(self.variant, "rows gathered with gpuload.batch.take within windows of gpuload's "
                                                  "default size"))

    def prepare(self):
        write_npy(files(self.args), self.columns, self.folder)

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
