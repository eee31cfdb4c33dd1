"""Ray Data: ray.data.read_parquet of the columns, materialized in Ray's object store during the first
epoch (Ray's advice for data read more than once), iterated with iter_batches (Arrow batches, Ray's
prefetching threads) and a local shuffle buffer of gpuload's window size; runs in .venv-peer-ray."""

import os
import time

import ray

from common import COLUMNS, Peer, arrow_to_torch, files, main


class RayPeer(Peer):
    name = "Ray Data"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"ray": ray.__version__}
        self.buffer = args.window
        self.shuffle = (f"block order permuted + a local shuffle buffer of {self.buffer:,} rows")
        self.ds = None
        self.notes.append(f"ray.init(num_cpus={os.cpu_count()}); read_parquet(files, columns).materialize() "
                          "in the first epoch; per epoch randomize_block_order() + iter_batches(batch_size, "
                          f"batch_format='pyarrow', prefetch_batches=4, local_shuffle_buffer_size={self.buffer}); "
                          "Arrow -> torch on the training thread (iter_torch_batches cannot collate the list "
                          "column)")

    def prepare(self):
        t0 = time.perf_counter()
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _temp_dir=os.path.join(self.args.work, "ray"))
        self.notes.append(f"ray.init took {time.perf_counter() - t0:.1f} s of the first epoch's conversion")
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        self.ds = ray.data.read_parquet(files(self.args), columns=COLUMNS).materialize()

    def epoch(self, e):
        ds = self.ds.randomize_block_order(seed=e)
        for b in ds.iter_batches(batch_size=self.args.batch_size, batch_format="pyarrow", prefetch_batches=4,
                                 local_shuffle_buffer_size=self.buffer, local_shuffle_seed=e):
            yield arrow_to_torch(b)

    def close(self):
        ray.shutdown()


if __name__ == "__main__":
    main(RayPeer, __doc__)
