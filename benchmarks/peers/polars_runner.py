"""Polars: the columns read into one DataFrame (pl.read_parquet, its own thread pool) before the first
epoch and kept in memory; each epoch a global shuffle (DataFrame.sample(fraction=1, shuffle=True)), then
slices of ``--batch-size`` rows to torch (DataFrame.to_torch for the scalars, history via Arrow)."""

import polars as pl

from common import COLUMNS, SCALARS, Peer, arrow_to_torch, files, main


class PolarsPeer(Peer):
    name = "Polars (in memory)"
    shuffle = "global row permutation"

    def __init__(self, args):
        super().__init__(args)
        self.versions = {"polars": pl.__version__}
        self.df = None
        self.notes.append("pl.read_parquet(files, columns) once (counted in the first epoch); per epoch "
                          "df.sample(fraction=1.0, shuffle=True, seed=epoch); iter_slices(batch_size); "
                          "to_torch('dict') per scalar column group, history through to_arrow()")

    def prepare(self):
        self.df = pl.read_parquet(files(self.args), columns=COLUMNS)

    def epoch(self, e):
        df = self.df.sample(fraction=1.0, shuffle=True, seed=e)
        for sl in df.iter_slices(self.args.batch_size):
            out = sl.select(SCALARS).to_torch("dict")
            out.update(arrow_to_torch(sl.select("history").to_arrow()))
            yield out


if __name__ == "__main__":
    main(PolarsPeer, __doc__)
