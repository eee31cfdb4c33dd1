"""Hugging Face datasets: Dataset.from_parquet converts the files into its Arrow cache (the first epoch's
conversion). Two configurations: ``global`` (the default), each epoch ds.shuffle(seed) (a global
permutation as an indices mapping) and ds.iter(batch_size) in the Arrow format; ``iterable``, what the
datasets documentation recommends where that mapping is slow (``Dataset.shuffle``'s docstring:
"switching to an IterableDataset and leveraging its fast approximate shuffling"):
to_iterable_dataset(num_shards) once, and each epoch its shuffle(seed, buffer_size) (shard order
permuted, then a buffer of gpuload's window size in rows) and set_epoch(e), iterated in the Arrow
format. Both then to torch. Runs in .venv-peer-datasets."""

import os

import datasets

from common import COLUMNS, Peer, arrow_to_torch, files, main

#: shards of the iterable configuration: the documentation's example count (its shuffle permutes their order)
SHARDS = 64


class HFPeer(Peer):
    name = "HF datasets"
    shuffle = "global row permutation"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"datasets": datasets.__version__}
        self.iterable = args.variant == "iterable"
        self.ds = None
        datasets.disable_progress_bars()
        first = "Dataset.from_parquet(files, columns, cache_dir) in the first epoch (Arrow cache)"
        if self.iterable:
            self.name = "HF datasets (iterable)"
            self.shuffle = (f"shard order permuted ({SHARDS} shards) + a shuffle buffer of {args.window:,} rows "
                            "(half of it yielded each time it fills)")
            self.notes.append(f"{first}, then to_iterable_dataset(num_shards={SHARDS}); per epoch "
                              f"shuffle(seed=0, buffer_size={args.window}) + set_epoch(epoch), "
                              "with_format('arrow').iter(batch_size) -> torch")
        else:
            self.notes.append(f"{first}; per epoch shuffle(seed=epoch).with_format('arrow').iter(batch_size) -> torch")

    def prepare(self):
        self.ds = datasets.Dataset.from_parquet(files(self.args), columns=COLUMNS,
                                                cache_dir=os.path.join(self.args.work, "hf"))
        if self.iterable:
            self.ds = self.ds.to_iterable_dataset(num_shards=SHARDS)

    def epoch(self, e):
        if self.iterable:
            ds = self.ds.shuffle(seed=0, buffer_size=self.args.window)
            ds.set_epoch(e)
        else:
            ds = self.ds.shuffle(seed=e)
        for t in ds.with_format("arrow").iter(batch_size=self.args.batch_size):
            yield arrow_to_torch(t)


if __name__ == "__main__":
    main(HFPeer, __doc__)
