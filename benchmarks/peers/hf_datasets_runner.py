"""Hugging Face datasets: Dataset.from_parquet converts the files into its Arrow cache (the first epoch's
conversion); each epoch ds.shuffle(seed) (a global permutation as an indices mapping) and
ds.iter(batch_size) in the Arrow format, the fastest it offers, then to torch. Runs in .venv-peer-datasets."""

import os

import datasets

from common import COLUMNS, Peer, arrow_to_torch, files, main


class HFPeer(Peer):
    name = "HF datasets"
    shuffle = "global row permutation"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"datasets": datasets.__version__}
        self.ds = None
        datasets.disable_progress_bars()
        self.notes.append("Dataset.from_parquet(files, columns, cache_dir) in the first epoch (Arrow cache); per "
                          "epoch shuffle(seed=epoch).with_format('arrow').iter(batch_size) -> torch")

    def prepare(self):
        self.ds = datasets.Dataset.from_parquet(files(self.args), columns=COLUMNS,
                                                cache_dir=os.path.join(self.args.work, "hf"))

    def epoch(self, e):
        for t in self.ds.shuffle(seed=e).with_format("arrow").iter(batch_size=self.args.batch_size):
            yield arrow_to_torch(t)


if __name__ == "__main__":
    main(HFPeer, __doc__)
