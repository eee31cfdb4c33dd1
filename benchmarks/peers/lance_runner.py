"""Lance: the Parquet files written once into a Lance dataset (the first epoch's conversion), then read
with random access: each epoch a global row permutation, each batch fetched with dataset.take (its
indices sorted). Variant ``scan``: to_batches in order instead. Runs in .venv-peer-lance."""

import os

import lance
import numpy as np
import pyarrow.dataset as pads

from common import COLUMNS, Peer, arrow_to_torch, files, main


class LancePeer(Peer):
    def __init__(self, args):
        super().__init__(args)
        self.scan = args.variant == "scan"
        self.name = "Lance" + (" (scan)" if self.scan else " (take)")
        self.shuffle = "none (fragment order)" if self.scan else "global row permutation"
        self.versions = {"pylance": lance.__version__}
        self.uri = os.path.join(args.work, "data.lance")
        self.ds = None
        self.notes.append("lance.write_dataset(pyarrow dataset scanner of the columns) in the first epoch; "
                          + ("to_batches(columns, batch_size)" if self.scan else
                             "per epoch a permutation of all rows, take(sorted indices of each batch, columns)"))

    def prepare(self):
        reader = pads.dataset(files(self.args)).scanner(columns=COLUMNS).to_reader()
        self.ds = lance.write_dataset(reader, self.uri)

    def epoch(self, e):
        bs = self.args.batch_size
        if self.scan:
            for rb in self.ds.to_batches(columns=COLUMNS, batch_size=bs):
                yield arrow_to_torch(rb)
            return
        perm = np.random.default_rng(e).permutation(self.ds.count_rows())
        for a in range(0, len(perm), bs):
            yield arrow_to_torch(self.ds.take(np.sort(perm[a:a + bs]), columns=COLUMNS))


if __name__ == "__main__":
    main(LancePeer, __doc__)
