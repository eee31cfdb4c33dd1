"""References in the project's venv: pq.read_table of the same columns (the first epoch's reference), the
naive pyarrow loop, and the ideal hand-written .npy cache read in order or gathered within windows
(the cached epoch's references). Variants: read_table, naive, ideal_seq, ideal_window."""

import os
import pathlib
import sys

import pyarrow.parquet as pq
import torch

from common import COLUMNS, Peer, arrow_to_torch, files, main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_cpu import ideal_sequential, ideal_shuffled, write_npy  # noqa: E402
from gpuload_runner import PER_COLUMN  # noqa: E402


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
    def __init__(self, args):
        super().__init__(args)
        self.window = args.variant == "ideal_window"
        self.name = "ideal .npy cache, " + ("windowed shuffle" if self.window else "in order")
        self.shuffle = f"rows permuted within consecutive windows of {args.window:,} rows" if self.window else "none"
        self.folder = pathlib.Path(args.work) / "npy"
        self.notes.append("one .npy per column (history: values + offsets) written by read_table + np.save "
                          "(the conversion), np.load(mmap_mode='r') each epoch, "
                          + ("rows gathered with gpuload.batch.take within windows of gpuload's default size"
                             if self.window else "consecutive batches as views"))

    def prepare(self):
        write_npy(files(self.args), PER_COLUMN, self.folder)

    def epoch(self, e):
        if self.window:
            return ideal_shuffled(self.folder, PER_COLUMN, self.args.batch_size, self.args.window, seed=e)
        return ideal_sequential(self.folder, PER_COLUMN, self.args.batch_size)


if __name__ == "__main__":
    variant = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--variant=")), None)
    if variant is None and "--variant" in sys.argv:
        variant = sys.argv[sys.argv.index("--variant") + 1]
    main({"read_table": ReadTable, "naive": Naive, "ideal_seq": Ideal, "ideal_window": Ideal}[variant], __doc__)
