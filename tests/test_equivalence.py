"""One test body on every device: every supported type gives exactly the values pyarrow
reads back, in the same order on the CPU and on the GPU (cuDF decoding, or pyarrow
decoding and copies), cold and from the cache (or, with ``cache_io="off"``, decoded every epoch), on 1 and 3
ranks, in both storage layouts and every shuffle mode.

The expected values come from the data the files were written from
(:mod:`typecases`), not from gpuload's conversion, so the CPU run is checked against
pyarrow too; a GPU run is also compared batch by batch with the CPU run's order.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import open_dataset
from typecases import COLUMNS, DTYPES, FILL, NATIVE, write_every_type

CONFIGS = {
    "rows": dict(layout="rows", shuffle=True),
    "columns": dict(layout="columns", shuffle=True),
    "block": dict(layout="rows", shuffle="block", block_rows=64),
    "ordered": dict(layout="rows", shuffle=False),
    "native": dict(layout="rows", shuffle=True, native=True),
    "off": dict(layout="rows", shuffle=True, cache_io="off"),  # every epoch decoded, nothing cached
    "chunks": dict(layout="rows", shuffle="chunks"),  # the chunk order alone permuted
    "chunks-off": dict(shuffle="chunks", cache_io="off"),  # layout 'auto': columns, batches views of decoded chunks
}


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    """3 files of 8,000 rows, row groups of 1,500: several chunks per file."""
    folder = tmp_path_factory.mktemp("every")
    return folder, write_every_type(folder)


def _open(folder, cache, device, decode, columns, rank, world, **kw):
    return open_dataset(folder, columns, cache, fill_nulls=FILL, dtypes={k: v for k, v in DTYPES.items() if k in columns},
                        batch_size=1000, chunk_bytes=1 << 18, seed=11, rank=rank, world_size=world, device=device,
                        decode=decode, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_type_is_exact_on_every_device(every, tmp_path, device_decode, config):
    folder, expected = every
    device, decode = device_decode
    kw = dict(CONFIGS[config])
    columns = NATIVE if kw.pop("native", False) else COLUMNS
    for world in (1, 3):
        cache = tmp_path / f"cache-{world}"  # a cold cache for each rank count: epoch 0 decodes
        per_epoch = {0: [], 1: []}
        counts = []
        for rank in range(world):
            ds = _open(folder, cache, device, decode, columns, rank, world, **kw)
            cpu = None if device == "cpu" else _open(folder, tmp_path / f"cpu-{world}", "cpu", "auto", columns,
                                                     rank, world, **kw)
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                ids = [expected.check(b, columns) for b in ds]
                assert len(ids) == len(ds)
                per_epoch[epoch].append(np.concatenate(ids))
                counts.append(len(ids))
                if cpu is not None:  # the same batches, in the same order, as on the CPU
                    cpu.set_epoch(epoch)
                    want = [b["row_id"].numpy() for b in cpu]
                    assert len(want) == len(ids) and all(np.array_equal(a, b) for a, b in zip(ids, want))
            if decode == "gpu":  # cuDF decoded every chunk, except float16 ones (libcudf reads them as strings)
                decoded, fallbacks = ds.reader.counters.decoded, ds.reader.decode.fallbacks
                assert fallbacks == (0 if columns is NATIVE else decoded), (decoded, fallbacks)
            ds.close()
        assert len(set(counts)) == 1, counts  # every rank, every epoch: the same number of batches
        for epoch, parts in per_epoch.items():
            assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(expected.n)), (world, epoch)
        if config == "ordered" and world == 1:
            assert np.array_equal(per_epoch[0][0], np.arange(expected.n))
