"""ParquetDataset: the public loader (batches as torch tensors, resumable mid-epoch)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterator

import torch

from . import plan, resume
from .agree import Agreement
from .config import Options, Source
from .consumers import NotCopied, check_iter_caller, check_set_epoch_caller
from .cursor import Cursor
from .epochs import EpochPlan
from .errors import ConfigError, flag
from .observe.metrics import Metrics
from .observe.ranks import gather
from .observe.stats import Stats
from .ranks import RankLayout
from .reader import open_reader
from .running import Epochs
from .dtypes import BFLOAT16
from .transforms import check_batch_transform

__all__ = ["ParquetDataset"]


class ParquetDataset(NotCopied, torch.utils.data.IterableDataset):
    """Batches of converted Parquet columns as torch tensors, from a local cache.

    The first epoch decodes each chunk of row groups once, converts it to the output
    dtypes and writes it to the cache; later epochs read the cache only. Iterate it
    directly (or through a ``DataLoader`` with ``batch_size=None, num_workers=0``:
    gpuload batches and runs its own background threads, and refuses a DataLoader that
    would batch again, or accelerate's ``prepare``, which would shard again).

    Each iteration is one epoch. ``set_epoch(e)`` selects the epoch the next iteration
    follows; a new iteration begun without ``set_epoch`` since the previous one began
    (as under Lightning, which never calls it) follows the next epoch: the first
    iteration is epoch 0 (or a restored state's epoch), then 1, 2... The epoch is part of
    :meth:`state_dict`, so a restored dataset goes on counting from it.

    Parameters
    ----------
    source : a Parquet file, a directory (``*.parquet`` below it), a glob, a URL (``s3://``,
        ``gs://``, ``az://``, ``http(s)://``, ``file://`` or any fsspec protocol: an object, a
        prefix or a glob), or a list of these. Hive-style folders (``day=1/...``) add their
        partition keys as columns. Remote objects are read once, column ranges only; later
        epochs and reopenings read the cache and make no request (see :mod:`gpuload.sources.fetch`).
    columns : None (every column of a supported type that every file has, pandas index
        columns excepted; others are skipped with one log line), a name, a list of names, or a
        dict ``{output: column}`` / ``{output: [columns]}``; a list of same-kind scalar
        columns is stacked into one ``[rows, k]`` tensor. A named column some files lack (added
        later) is null in them (``fill_nulls``).
    batch_size : rows per batch (default 65536).
    shuffle : ``True`` (default): permute the chunk order and the rows within each window of
        chunks, differently each epoch. ``"block"``: the same, but permute blocks of
        ``block_rows`` consecutive rows within a window instead of single rows (each chunk's
        rows are permuted once when it is cached, so a block is a random sample of its
        chunk, and the chunk files differ from the other modes'); far cheaper gathers, less
        randomness: docs/benchmarks.md measures both. ``"chunks"``: the chunk order alone
        permuted each epoch, rows in file order within a chunk (batches are views, as without
        shuffling: for data shuffled when it was written, or a first pass that must cost least).
        ``False``: rows in file order.
    block_rows : rows per block with ``shuffle="block"`` (default 256).
    layout : how the cache stores outputs (each layout has its own cache files; batches are the
        same): ``"rows"`` (scalar outputs of one dtype as one row-major block), ``"columns"`` (an
        array per output) or ``"auto"`` (default): ``"rows"`` where rows are gathered (``shuffle=True``
        or ``"block"``), else ``"columns"``, unless the cache holds more of the dataset as row
        blocks (:mod:`gpuload.layout`).
    seed : shuffle seed (default 0); with the epoch it fixes the order completely.
    drop_last : drop the tail that does not fill a batch on every rank (default False:
        every row once, see :mod:`gpuload.plan` for how the tail is balanced).
    cache_dir : cache folder, or a list of folders (one per drive: chunks are striped over them,
        :mod:`gpuload.cache.drives`); None: ``$GPULOAD_CACHE_DIR`` (folders separated by
        ``os.pathsep``), else ``~/.cache/gpuload``.
    device : ``"auto"`` (the GPU where the GPU path can run: torch sees a GPU and CuPy is
        installed and sees it; else the CPU, with a log line saying why), ``"cpu"``, ``"cuda"``,
        ``"cuda:N"``.
    rank, world_size : this process's shard; passed, they are fixed. By default they come from
        ``torch.distributed``, asked when each iteration begins (also by ``len()``,
        :meth:`state_dict` and the other methods that need them), so the dataset may be made
        before ``init_process_group`` (under torchrun, in a LightningModule's ``__init__``);
        without one, a task ``srun`` started takes them from Slurm (:mod:`gpuload.ranks`), any
        other process is 0 of 1. Iterating where a launcher set ``WORLD_SIZE>1`` but
        no process group exists raises :class:`~gpuload.ConfigError` (each rank would read
        every row), as does one of the two passed alone where nothing tells the other (rank 0
        of every ``world_size`` would read rank 0's rows).
    shard : how chunks are shared by ranks (default ``"global"``: each epoch permutes every
        chunk and every rank may read any of them; right for one node, or a cache shared by
        all nodes). ``"node"``: chunks are assigned to nodes once, balanced by rows, and each
        node's ranks share only its chunks in every epoch, so a node-local cache holds only
        its node's share and is warm from the second epoch; a few rows per node and epoch
        are not delivered (see :mod:`gpuload.plan`).
    local_world_size : ranks per node with ``shard="node"`` (default: torchrun's
        ``LOCAL_WORLD_SIZE``, checked against ``GROUP_RANK``, ``LOCAL_RANK`` and ``RANK``);
        global rank ``r`` is on node ``r // local_world_size``.
    fill_nulls : None (nulls are an error), a scalar for every column (but those it does not fit:
        0.5 or NaN leaves integer columns without one), or ``{column: value}``.
        Null lists become empty lists; null fixed-size lists rows of the value.
    dtypes : ``{output: dtype}`` to cast outputs, as NumPy or torch dtypes (or their
        names), ``torch.bfloat16`` included (default: the column's own dtype; a stacked
        group: NumPy's common dtype of its columns, e.g. int64 + float32 -> float64, which must
        hold the integers exactly: beyond 2**53 name the dtype to accept rounding).
        Casts happen once, when the cache is built. Casts to floats round to nearest, once
        (as NumPy; torch's float64 -> float16 rounds through float32, and may differ in the last
        bit for rare values), but not beyond their range (a finite value would become an
        infinity); casts to integers or bool must keep every value exactly; else a
        :class:`~gpuload.ConfigError` names the column and value (at open, where the
        footers' statistics show it).
    categorical : how string and binary columns (and lists of them) become int64 ids:
        ``{column: gpuload.Hash(buckets=..., seed=...)}`` (ids ``1..buckets`` from the value's
        XXH64) or ``{column: gpuload.Vocab(min_count=..., max_size=...)}`` (ids ``1..n`` from a
        vocabulary counted once and kept in the cache: :meth:`vocabulary`), or one of them for
        every such column (default: ``Hash()``, the full 64-bit hash), or for a column a
        :class:`gpuload.Vocabulary` whose ids it takes (another dataset's :meth:`vocabulary`, or
        ``Vocabulary.of(values)``: sources of a Mix, or a retraining, that must agree). A null
        (and, with a vocabulary, a value not in it) is id 0 (see :mod:`gpuload.categorical`).
    transform : a :class:`gpuload.Transform` (``fn`` and a ``key`` such as ``"features-v3"``)
        applied to each chunk's outputs once, when it is cached; the batches hold what it
        returns (default None). Its key is part of the cache key. See :mod:`gpuload.transforms`.
    chunk_bytes : upper bound of one chunk's converted size in bytes (default 64 MiB; a
        larger row group is a chunk of its own).
    pack_files : small files are read and cached several to a chunk (default True; never with
        ``shard="node"``): :mod:`gpuload.packs`. False: every chunk is one file's (what gpuload did before
        packs: a state saved then resumes only so).
    shuffle_window : chunks whose rows are shuffled together (default None: 4, or more where the
        chunks are small because the files are, as many as take half the memory of 4 chunks of
        ``chunk_bytes``: :func:`gpuload.config.window_chunks`; ``.options.shuffle_window`` says how many).
    prefetch : chunks loaded ahead of the one being batched (default 2); while an epoch's last
        batches are cut, the next epoch's first chunks are loaded (shuffled, its first window
        and ``prefetch`` chunks more; in file order ``prefetch + 2``: :mod:`gpuload.preload`).
        0: no chunk is loaded ahead, within an epoch or across.
    num_threads : threads that read and decode chunks (default 2); on the CPU, on a machine
        with cores to spare (at least ``num_threads + 3``), ``num_threads`` more threads
        (``gpuload-cut``) gather batches.
    nice : how many nice steps below the thread that starts an epoch gpuload's background
        threads run (default 0: the same priority; 0 to 19; Linux only, elsewhere ignored).
        With ``nice=10`` the training thread and its torch threads get a core first and the
        loader takes what is left: a CPU-heavy step runs faster, at the price of more waiting
        for data when the cores are short (docs/benchmarks.md, "Peers").
    max_cache_bytes : this dataset's own cache budget in bytes (default None: none; split over
        several folders). Whatever it says, the folder's quota (``gpuload cache quota``), else a
        reserve of 10% of the disk (``$GPULOAD_CACHE_RESERVE``), holds: a chunk that does not fit
        them evicts the least recently used chunks no open dataset reads
        (:mod:`gpuload.cache.evict`). What does not fit is read from Parquet every epoch, and
        opening says how much of the dataset fits.
    cache_io : ``"auto"`` (default), ``"direct"``, ``"buffered"`` or ``"off"``: cache files written
        and read around the page cache (``O_DIRECT``) or through it. ``"auto"``: direct, the reads
        turning buffered after a pass a slow disk limited where the files fit in half the memory
        (:func:`gpuload.memory.cache_io_modes`). ``"off"``: every epoch decodes Parquet and nothing
        is cached, loaded ahead or evicted (a job of one epoch over data too large to repeat; the
        cache folder still keeps footers and vocabularies).
    verify_checksums : check each cache file's xxh3 checksums the first time this process
        reads it, and again whenever it changed (its inode, size, mtime or ctime; default True),
        on every read (``"always"``), or never (False). On the
        GPU, files this process wrote count as checked, and a first check reads the
        file through pinned host memory once.
    decode : where the first epoch decodes Parquet on a GPU device: ``"auto"`` (cuDF
        when it imports, else the CPU), ``"gpu"`` (cuDF, an error without it) or
        ``"cpu"`` (pyarrow, then pinned memory and non-blocking copies on the loader's
        stream). Ignored on the CPU.
    max_device_bytes : refuse settings whose device memory bound
        (:attr:`device_bytes_bound`) exceeds this many bytes (default None: no limit).
    kvikio_threads, kvikio_compat : KvikIO's thread pool size (default 4) and compat
        mode (``"auto"``, the default: GPUDirect Storage where available, else POSIX;
        ``"on"``; ``"off"``), set for the whole process when a GPU dataset opens.
    filesystem : an fsspec filesystem or a ``pyarrow.fs.FileSystem``; ``source`` then
        names paths in it (default None: from each URL's protocol, or the local disk).
    storage_options : dict passed to the fsspec filesystem made from a URL, as in fsspec
        and pandas (credentials, ``endpoint_url``, ``anon``...; default None).
    remote : a :class:`gpuload.RemoteSettings` or a dict of its fields: requests and bytes
        in flight, read-ahead, retries, backoff and timeout (default: from the environment).
    batch_transform : ``fn(batch, generator) -> batch`` applied to every batch after the
        shuffle, on the loader's producer thread (and, on a GPU, its batch stream), never on
        the training thread (default None). ``generator`` is a ``torch.Generator`` on the
        batch's device seeded from (seed, epoch, the rank's run, the batch's position):
        resumed and uninterrupted epochs transform each batch alike. See :mod:`gpuload.transforms`.

    Yields
    ------
    dict mapping output name to a ``torch.Tensor`` (``[rows]`` or ``[rows, k]``) or a
    :class:`gpuload.Ragged` of tensors for list columns.
    """

    def __init__(self, source, columns=Source.columns, *, batch_size: int = Options.batch_size,
                 shuffle: bool | str = Options.shuffle, seed: int = Options.seed, drop_last: bool = Options.drop_last,
                 cache_dir=Options.cache_dir, device=Options.device, rank: int | None = Options.rank,
                 world_size: int | None = Options.world_size, fill_nulls=Source.fill_nulls, dtypes=Source.dtypes,
                 categorical=Source.categorical, transform=Source.transform, filters=Source.filters, chunk_bytes: int = Options.chunk_bytes,
                 pack_files: bool = Options.pack_files, shuffle_window: int | None = Options.shuffle_window,
                 prefetch: int = Options.prefetch, num_threads: int = Options.num_threads, nice: int = Options.nice,
                 max_cache_bytes: int | None = Options.max_cache_bytes, cache_io: str = Options.cache_io,
                 verify_checksums: bool | str = Options.verify_checksums, decode: str = Options.decode,
                 max_device_bytes: int | None = Options.max_device_bytes, kvikio_threads: int = Options.kvikio_threads,
                 kvikio_compat: str = Options.kvikio_compat, filesystem=Source.filesystem,
                 storage_options: dict | None = Source.storage_options, remote=Source.remote,
                 shard: str = Options.shard, local_world_size: int | None = Options.local_world_size,
                 block_rows: int = Options.block_rows, layout: str = Options.layout,
                 batch_transform: Callable | None = None):
        super().__init__()
        given = locals()
        self.options = o = Options.of(given)
        self.batch_transform = check_batch_transform(batch_transform)  #: see the parameter
        self._layout = RankLayout(o.rank, o.world_size, o.shard, o.local_world_size)
        self.metrics = Metrics()
        t0 = self.metrics.clock()
        self.reader = open_reader(Source.of(given), o, self.metrics)
        self.options = o = self.reader.opts  # the shuffle window's chunks chosen for the chunks
        self.metrics.record("list", t0, self.metrics.clock(), rows=self.reader.num_rows)
        self.device = self.reader.device.torch_device  #: the torch device batches are on
        self._plan = EpochPlan([c.rows for c in self.reader.chunks], self.reader.fingerprint, self.options)
        if self._layout.known:  # refuse now what these ranks cannot run
            self._plan.check(self._layout.resolve())
        elif not self._layout.node:  # ranks come later: what no number of ranks can run
            plan.check_balance(self.reader.num_rows, 1, batch_size, self.options.drop_last)
        self.reader.device.check_bound(
            self.device_bytes_bound, o.max_device_bytes,
            f"({'3 x shuffle_window + prefetch + 1' if self.options.shuffled else '3 x prefetch + 8'}) chunks of up "
            f"to {self.reader.max_chunk_bytes()} bytes, plus queued batches")
        self._views = {s.name: torch.bfloat16 for s in self.reader.outputs if s.dtype == BFLOAT16}
        signature = resume.signature(self.reader, self.options)
        self._given = repr((given["source"], signature["outputs"]))  # this dataset, to other ranks
        self._cursor = Cursor(self._plan, self._layout, signature, Agreement(self._given))  # the epoch, the position
        self._epochs = Epochs(self.reader, self._plan, self._cursor, self.metrics)  # what an iteration runs

    # -- public -------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in the whole dataset (all ranks)."""
        return self.reader.num_rows

    @property
    def outputs(self) -> list[str]:
        """Names of the tensors in each batch."""
        return [s.name for s in self.reader.outputs]

    @property
    def epoch(self) -> int:
        """The epoch of the latest iteration, or the one :meth:`set_epoch` or :meth:`load_state_dict`
        selected since (an iteration begun without ``set_epoch`` follows the next: see the class docstring)."""
        return self._cursor.epoch

    @property
    def rank(self) -> int:
        """This process's rank: the one passed, else ``torch.distributed``'s now (the running epoch's while
        an iteration runs)."""
        return self._cursor.ranks().rank

    @property
    def world_size(self) -> int:
        """Ranks sharing each epoch: the number passed, else ``torch.distributed``'s now (see :attr:`rank`)."""
        return self._cursor.ranks().world

    @property
    def local_world_size(self) -> int | None:
        """Ranks per node with ``shard="node"``, else None."""
        return self._layout.local

    @property
    def device_bytes_bound(self) -> int:
        """Upper bound of the device memory the loader holds at once, in bytes (GPU path):
        windows, chunks loaded ahead, queued batches and, while cuDF decodes, the converted
        chunks per loader thread (:func:`gpuload.memory.device_bound` gives the terms).
        Independent of the dataset's size; ``max_device_bytes`` refuses settings above a limit."""
        return self.reader.device_bound()

    @property
    def host_bytes_bound(self) -> int:
        """Upper bound of the host memory the loader holds at once, in bytes (CPU path): windows,
        chunks loaded ahead, queued batches, chunks being decoded and written, a remote source's
        read-ahead, the trace (terms: :func:`gpuload.memory.host_budget`; values:
        ``self.reader.host_budget()``). Independent of the dataset's size; measured peaks were 51-84%
        of it (``benchmarks/bench_memory.py``); batches the training loop keeps are not in it. Lower
        it with ``chunk_bytes``, ``shuffle_window``, ``prefetch``, ``num_threads`` and
        ``remote={"readahead_bytes": ...}``. On a GPU, windows and batches are in device memory
        (:attr:`device_bytes_bound`) and this bound is loose."""
        return self.reader.host_budget().total

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows.

        Optional: an iteration begun without ``set_epoch`` follows the epoch after the
        previous iteration's (see the class docstring). After :meth:`load_state_dict`,
        ``set_epoch`` of the restored epoch keeps its position, and of the next epoch (when
        the restored one was complete) starts it; another epoch drops the restored position,
        with a warning.
        """
        check_set_epoch_caller(sys._getframe(1))
        self._cursor.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where this dataset stands: a small JSON-serialisable dict for :meth:`load_state_dict`.

        It can be taken at any time (before the first batch, mid-epoch, between epochs,
        after an exception in the training step) and counts the batches handed out so
        far. It is the same on every rank (DDP ranks take the same number of batches),
        so saving rank 0's is enough. See :mod:`gpuload.resume` for its fields.

        A state taken after an epoch's last batch restores to the next epoch; one taken
        within an epoch (in the loop, or after it was left or failed) restores to the rest
        of that epoch.
        """
        return self._cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, here or in another process).

        The next iteration yields exactly what an uninterrupted run would have yielded
        after that point, bit for bit, when the number of ranks is the one the state was
        saved with. On another number of ranks, the rest of the epoch's rows are shared
        among the new ranks: each delivered once, the same number of batches on every
        rank (see :mod:`gpuload.resume`); later epochs follow this dataset's ranks.
        Only the chunks still needed are read. Raises :class:`~gpuload.ConfigError` if the
        state comes from a dataset with other settings (naming them), or while the latest
        iteration of this dataset is running (an earlier one still open goes on with its own epoch).
        """
        self._cursor.load_state_dict(state)

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch (the same on every rank), for the ranks of now
        (see ``rank``). After :meth:`load_state_dict` too, as a ``DataLoader``'s length stays, and as
        Lightning counts a resumed epoch's batches (those done before the checkpoint and after)
        against it; the rest a restored epoch yields is :attr:`batches_left`. In an epoch begun on
        fewer ranks (an elastic resume, restored or running), the batches each rank took before the
        restore plus those the new ranks' run has, where that is more than a whole epoch, so that
        such a count ends with the epoch's last row (an iteration may end a few batches before it)."""
        return self._cursor.batches()

    @property
    def batches_left(self) -> int:
        """Batches this rank's next iteration yields: after :meth:`load_state_dict`, the rest of the
        restored epoch (0 if it was over and is selected again; the same on every rank, on the
        ranks of now), else ``len(self)``."""
        return self._cursor.batches_next()

    @property
    def preload_next(self) -> bool:
        """Whether an epoch's end loads the next epoch's first chunks ahead (default True; see
        ``prefetch``). Set it False before a run's last epoch: its end then reads nothing for an
        epoch that will not come (``gpuload profile`` does)."""
        return self._epochs.preload_next

    @preload_next.setter
    def preload_next(self, value: bool) -> None:
        if not isinstance(value, bool) and value not in (0, 1):  # bool("no") is True: loads ahead unasked
            raise ConfigError(f"preload_next={value!r} must be True or False")
        self._epochs.preload_next = bool(value)

    @property
    def shard(self) -> str:
        """``"global"`` or ``"node"`` (see the class docstring)."""
        return self.options.shard

    def node_chunks(self) -> list[list[int]]:
        """With ``shard="node"``: the chunks (indices into ``reader.chunks``) each node owns, in
        every epoch; node ``n`` holds global ranks ``n * local_world_size`` and on."""
        return self._cursor.node_chunks()

    @property
    def rows_per_epoch(self) -> int:
        """Rows delivered per epoch over all ranks (``num_rows`` less what ``drop_last`` or
        node-affine sharding leaves out)."""
        return self._cursor.rows_per_epoch()

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 0:
            raise ConfigError("ParquetDataset runs its own loader threads: use it with DataLoader(num_workers=0, "
                              "batch_size=None), or iterate it directly")
        check_iter_caller(sys._getframe(1))
        return self._epochs.iterate(self._views, self.batch_transform, self.device)

    def stats(self, all_ranks: bool = False) -> Stats:
        """What the loader and the training loop did so far: a :class:`gpuload.Stats`
        (``all_ranks=True``: every rank's, gathered, a :class:`gpuload.observe.ranks.RankStats`;
        under torch.distributed every rank must call it then).

        Per-stage busy time, bytes and rows (list, read, decode, convert, cache_write,
        cache_read, h2d, batch; write_wait: loader threads blocked on the cache writer), queue depth, and ``starvation``: the fraction (0 to 1)
        of wall time the training thread spent waiting inside ``next()``, summed over
        the epochs iterated since the dataset was created (or :meth:`reset_stats`).
        ``gpuload.diagnose(ds.stats())`` names the stage that limits it. For a remote
        source, ``remote`` counts the requests made for Parquet bytes (a :class:`gpuload.RemoteStats`;
        listing the source when it is opened is not counted)."""
        loader, settings = self.loader_description()
        st = dataclasses.replace(self.metrics.stats(), remote=self.reader.remote_stats(), loader=loader,
                                 loader_settings=settings)
        return gather(st, self.reader.counters) if all_ranks else st

    def vocabulary(self, column: str):
        """The counted vocabulary of ``column`` (a :class:`gpuload.Vocab` column in ``categorical=``):
        a :class:`gpuload.Vocabulary` with ``values`` (a pyarrow ``large_binary`` array:
        ``values[i].as_py()`` is the bytes of id ``i + 1``), ``counts``, ``to_dict()`` (value -> id,
        str where the bytes are UTF-8, else bytes; for a serving system) and ``ids(values)``."""
        got = self.reader.vocabularies.get(column)
        if got is None:
            raise ConfigError(f"column {column!r} has no counted vocabulary in this dataset (those that do: "
                              f"{sorted(self.reader.vocabularies) or 'none'}); give it gpuload.Vocab() in "
                              f"{flag('categorical')}")
        return got

    def loader_description(self) -> tuple[str, dict]:
        """``("gpuload", settings)``: how :func:`gpuload.watch` and :meth:`stats` name this loader
        (settings: ``num_threads``, ``prefetch``, ``device`` (``"cpu"`` or ``"cuda"``),
        ``decode``, where first epochs decode: ``"cpu"`` (pyarrow) or ``"gpu"`` (cuDF), ``cache_io``,
        how chunk files are written and read: ``"direct"``, ``"buffered"``, ``"direct writes,
        buffered reads"`` (``"auto"`` after a pass its direct reads limited) or ``"off"`` (none), ``shuffle``,
        ``layout`` (the one ``"auto"`` chose), ``max_requests`` for a remote source, and where given, ``transform``
        (its key) and ``batch_transform`` (the function's name): work of the user's that
        :func:`gpuload.diagnose` names when its stage is the limit)."""
        settings = {"num_threads": self.options.num_threads, "prefetch": self.options.prefetch,
                    "device": self.device.type, "decode": getattr(self.reader.decode, "name", "cpu"),
                    "cache_io": self.reader.cache_io, "shuffle": self.options.shuffle,
                    "layout": self.reader.stored_layout}
        if self.reader.has_remote:  # requests in flight at most (what more of them can gain)
            settings["max_requests"] = self.reader.remote.max_requests
        if self.reader.source.transform is not None:
            settings["transform"] = self.reader.source.transform.key
        if self.batch_transform is not None:
            settings["batch_transform"] = getattr(self.batch_transform, "__name__", type(self.batch_transform).__name__)
        return "gpuload", settings

    def reset_stats(self) -> None:
        """Start :meth:`stats` afresh (e.g. to look at one epoch), the chunks counted as decoded
        or read from the cache (``reader.counters``, each rank's in ``stats(all_ranks=True)``) too."""
        self.metrics.reset()
        self.reader.reset_remote()
        self.reader.counters.reset()

    def close(self) -> None:
        """Stop remote fetches, release their connections, drop the next epoch's chunks loaded
        ahead (:mod:`gpuload.preload`), give the host buffers it keeps for reuse back (even while
        something still holds the dataset: a notebook's ``Out[]``, a traceback), and let other
        datasets evict this one's cached chunks (the dataset can still be iterated: a later epoch
        starts new fetches, makes new buffers and keeps its chunks again). An iteration ended by
        an error or Ctrl-C inside ``next()`` gives those buffers back too."""
        self._epochs.close()
        self.reader.close()

    def plan_epoch(self, epoch: int | None = None) -> tuple[list[list[plan.Segment]], list[int]]:
        """This rank's windows of chunk segments and batch sizes for a whole ``epoch`` (pure)."""
        return self._cursor.plan_epoch(epoch)

    def __repr__(self) -> str:
        try:
            ranks = self._layout.resolve(strict=False)
        except ConfigError:  # shown where it is used (iteration, len())
            ranks = None
        where = "rank=? (not known yet)" if ranks is None else f"rank={ranks.rank}/{ranks.world}"
        return (f"ParquetDataset({len(self.reader.files)} files, {self.num_rows} rows, "
                f"{len(self.reader.chunks)} chunks, outputs={self.outputs}, batch_size={self.options.batch_size}, "
                f"{where}, device={self.device}, cache_dir={self.options.cache_where!r})")
