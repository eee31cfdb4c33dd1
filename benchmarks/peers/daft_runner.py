"""Daft: daft.read_parquet of the columns, collected into memory during the first epoch (collect()
keeps the result), each epoch streamed as Arrow record batches and cut into batches of
``--batch-size``; Daft has no row shuffle of its own. Runs in .venv-peer-daft."""

import daft

from common import COLUMNS, Peer, arrow_to_torch, files, main, rebatch


class DaftPeer(Peer):
    name = "Daft"
    shuffle = "none (file order)"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"daft": daft.__version__}
        self.df = None
        self.notes.append("daft.read_parquet(files).select(columns).collect() in the first epoch; per epoch "
                          "df.to_arrow_iter() -> torch, batches cut in the training process "
                          "(to_torch_iter_dataset yields single rows)")

    def prepare(self):
        self.df = daft.read_parquet(files(self.args)).select(*COLUMNS).collect()

    def epoch(self, e):
        return rebatch((arrow_to_torch(rb) for rb in self.df.to_arrow_iter()), self.args.batch_size)


if __name__ == "__main__":
    main(DaftPeer, __doc__)
