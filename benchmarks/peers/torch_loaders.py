"""PyTorch's own loaders over Parquet row groups: a DataLoader (map-style dataset of row groups, worker
processes) and a torchdata.nodes pipeline (row groups read by a thread pool). Each row group is read
with pyarrow and converted to tensors in a worker; the training process cuts batches of exactly
``--batch-size`` rows from them (rows spanning two row groups are copied). Variants: dataloader, nodes."""

import os
import sys

import pyarrow.parquet as pq
import torch

from common import COLUMNS, Peer, arrow_to_torch, files, main, rebatch


class RowGroups(torch.utils.data.Dataset):
    """Item k: row group k of the dataset, read and converted to tensors."""

    def __init__(self, paths):
        self.items = [(p, i) for p in paths for i in range(pq.ParquetFile(p).num_row_groups)]
        self.open = {}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        path, i = self.items[k]
        if path not in self.open:
            self.open[path] = pq.ParquetFile(path)
        return arrow_to_torch(self.open[path].read_row_group(i, columns=COLUMNS))


class DataLoaderPeer(Peer):
    name = "torch DataLoader over row groups"
    shuffle = "row-group order (rows in order within a row group)"

    def __init__(self, args):
        super().__init__(args)
        self.workers = os.cpu_count()
        self.loader = None
        self.notes.append(f"DataLoader(RowGroups, batch_size=None, shuffle=True, num_workers={self.workers}, "
                          "persistent_workers=True, prefetch_factor=2); an item is one row group as tensors; "
                          "batches cut in the training process")

    def prepare(self):
        self.loader = torch.utils.data.DataLoader(RowGroups(files(self.args)), batch_size=None, shuffle=True,
                                                  num_workers=self.workers, persistent_workers=True,
                                                  prefetch_factor=2)

    def epoch(self, e):
        torch.manual_seed(e)
        return rebatch(self.loader, self.args.batch_size)

    def close(self):
        del self.loader


class NodesPeer(Peer):
    name = "torchdata.nodes pipeline over row groups"
    shuffle = "row-group order (rows in order within a row group)"

    def __init__(self, args):
        super().__init__(args)
        import torchdata
        self.versions = {"torchdata": torchdata.__version__}
        self.workers = os.cpu_count()
        self.loader = None
        self.notes.append(f"SamplerWrapper(RandomSampler) -> ParallelMapper(read row group, num_workers="
                          f"{self.workers}, method='thread', in_order=False) -> Prefetcher(2) -> Loader; "
                          "batches cut in the training process")

    def prepare(self):
        from torchdata.nodes import Loader, ParallelMapper, Prefetcher, SamplerWrapper
        ds = RowGroups(files(self.args))
        node = SamplerWrapper(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0)))
        node = ParallelMapper(node, map_fn=ds.__getitem__, num_workers=self.workers, method="thread",
                              in_order=False)
        self.loader = Loader(Prefetcher(node, prefetch_factor=2))

    def epoch(self, e):
        return rebatch(self.loader, self.args.batch_size)


if __name__ == "__main__":
    variant = sys.argv[sys.argv.index("--variant") + 1] if "--variant" in sys.argv else "dataloader"
    main({"dataloader": DataLoaderPeer, "nodes": NodesPeer}[variant], __doc__)
