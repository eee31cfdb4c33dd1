"""litdata (Lightning): the rows written once into litdata chunks with litdata.optimize (the first
epoch's conversion, one input per row group, worker processes), read with StreamingDataset(shuffle=True)
through a StreamingDataLoader with workers. Runs in .venv-peer-litdata."""

import os

import litdata
import pyarrow.parquet as pq

from common import COLUMNS, Peer, collate_rows, main, row_groups, row_samples


def rows_of(item):
    path, i = item
    yield from row_samples(pq.ParquetFile(path).read_row_group(i, columns=COLUMNS))


class LitdataPeer(Peer):
    name = "litdata"
    shuffle = "chunk order permuted, rows shuffled within the chunks a worker holds"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"litdata": litdata.__version__}
        self.out = os.path.join(args.work, "litdata")
        self.workers = os.cpu_count()
        self.loader = None
        self.notes.append(f"litdata.optimize(rows of each row group, chunk_bytes='64MB', num_workers={self.workers}) "
                          f"in the first epoch; StreamingDataset(shuffle=True) + StreamingDataLoader(batch_size, "
                          f"num_workers={self.workers}), a collate stacking rows and making history values + offsets")

    def prepare(self):
        items, self.rows = row_groups(self.args)
        litdata.optimize(fn=rows_of, inputs=items, output_dir=self.out, chunk_bytes="64MB",
                         num_workers=self.workers)
        ds = litdata.StreamingDataset(self.out, shuffle=True, seed=0)
        self.loader = litdata.StreamingDataLoader(ds, batch_size=self.args.batch_size, num_workers=self.workers,
                                                  collate_fn=collate_rows)

    def epoch(self, e):
        return iter(self.loader)


if __name__ == "__main__":
    main(LitdataPeer, __doc__)
