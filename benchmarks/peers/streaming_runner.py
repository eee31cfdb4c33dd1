"""MosaicML Streaming: the rows written once into MDS shards with MDSWriter (the first epoch's
conversion; dense and cat as fixed-size ndarrays, history as the raw bytes of its int64 ids: MDS
ndarrays cannot be empty), read with a local StreamingDataset (its default shuffle, py1e) through a
DataLoader with workers. Runs in .venv-peer-streaming."""

import os
import sys
import types

import numpy as np
import pyarrow.parquet as pq

# streaming/__init__ imports streaming.vision (image datasets, unused here), which imports torchvision; PyPI's
# torchvision wheels are CUDA builds that fail to import beside the CPU torch 2.13.0 wheel used everywhere
# here, so that one subpackage is stood in for by an empty module
sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
import streaming  # noqa: E402
import torch
from streaming import MDSWriter, StreamingDataset  # noqa: E402

from common import COLUMNS, DENSE, SPARSE, Peer, collate_rows, main, row_groups, row_samples

MDS_COLUMNS = {"row_id": "int64", "label": "int8", "dense": f"ndarray:float32:{DENSE}",
               "cat": f"ndarray:int64:{SPARSE}", "history": "bytes"}


def collate(samples: list) -> dict:
    """history comes back as the raw bytes of its int64 ids (MDS's ndarray cannot hold an empty list)."""
    for s in samples:
        s["history"] = np.frombuffer(s["history"], np.int64)
    return collate_rows(samples)



class StreamingPeer(Peer):
    name = "MosaicML Streaming"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"mosaicml-streaming": streaming.__version__}
        self.mds = os.path.join(args.work, "mds")
        self.workers = os.cpu_count()
        self.loader = None
        self.shuffle = "py1e (Streaming's default)"
        self.notes.append(f"MDSWriter(columns={MDS_COLUMNS}, compression=None) row by row in the first epoch; "
                          f"StreamingDataset(local, batch_size, shuffle=True) + DataLoader(batch_size, "
                          f"num_workers={self.workers}, persistent_workers=True), a collate stacking rows and "
                          "making history values + offsets; streaming.vision stubbed out (needs a torchvision "
                          "built for this torch)")

    def prepare(self):
        with MDSWriter(out=self.mds, columns=MDS_COLUMNS, compression=None) as w:
            items, self.rows = row_groups(self.args)
            for f, i in items:
                for s in row_samples(pq.ParquetFile(f).read_row_group(i, columns=COLUMNS)):
                    s["history"] = s["history"].tobytes()
                    w.write(s)
        streaming.base.util.clean_stale_shared_memory()
        ds = StreamingDataset(local=self.mds, batch_size=self.args.batch_size, shuffle=True, shuffle_seed=0)
        self.shuffle = (f"{ds.shuffle_algo}, shuffle_block_size={ds.shuffle_block_size} (Streaming's defaults; None: "
                        "max(4M / canonical nodes, 262,144) samples)")
        self.loader = torch.utils.data.DataLoader(ds, batch_size=self.args.batch_size, num_workers=self.workers,
                                                  collate_fn=collate, persistent_workers=True)

    def epoch(self, e):
        return iter(self.loader)


if __name__ == "__main__":
    main(StreamingPeer, __doc__)
