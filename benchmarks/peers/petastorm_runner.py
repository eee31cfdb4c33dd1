"""Petastorm 0.13.1 (petastorm_baseline.py's set-up, in .venv-petastorm): make_batch_reader with its
local-disk cache, row groups in shuffled order (its default), BatchedDataLoader; history padded to 20
ids by petastorm_baseline's TransformSpec (Petastorm cannot batch variable-length lists). Each epoch
opens a new reader on the same cache: the first fills it, the second reads it."""

import contextlib
import os
import sys
import tempfile

from common import COLUMNS, Peer, main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from petastorm_baseline import pad_history_spec, parquet_urls  # noqa: E402

PAD = 20


class PetastormPeer(Peer):
    name = "Petastorm"
    shuffle = "row-group order (shuffle_row_groups=True, its default)"

    def __init__(self, args):
        super().__init__(args)
        import petastorm
        self.versions = {"petastorm": petastorm.__version__}
        self.cache = tempfile.mkdtemp(prefix="petastorm-", dir=args.work)
        self.spec = pad_history_spec(PAD)
        self.workers = os.cpu_count()
        self.reader = None
        self.notes.append(f"make_batch_reader(reader_pool_type='thread', workers_count={self.workers}, "
                          "shuffle_row_groups=True, cache_type='local-disk', num_epochs=1) per epoch + "
                          f"BatchedDataLoader(batch_size); history padded/truncated to {PAD} ids in a TransformSpec "
                          "(cached padded)")

    def epoch(self, e):
        from petastorm import make_batch_reader
        from petastorm.pytorch import BatchedDataLoader
        with contextlib.redirect_stdout(sys.stderr):
            self.reader = make_batch_reader(
                parquet_urls(self.args.data), schema_fields=COLUMNS, num_epochs=1, workers_count=self.workers,
                reader_pool_type="thread", shuffle_row_groups=True, seed=e, cache_type="local-disk",
                cache_location=self.cache, cache_size_limit=1 << 40, cache_row_size_estimate=1024,
                cache_extra_settings={"cleanup": False}, transform_spec=self.spec)
        return iter(BatchedDataLoader(self.reader, batch_size=self.args.batch_size))

    def after_epoch(self, e):
        self.reader.stop()  # not `with reader`: its __exit__ deletes the cache folder and prints to stdout
        self.reader.join()


if __name__ == "__main__":
    main(PetastormPeer, __doc__)
