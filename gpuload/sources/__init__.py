"""Sources: where Parquet comes from, and how its bytes are read.

* :mod:`~gpuload.sources.listing`: list local and remote files and fingerprint them;
* :mod:`~gpuload.sources.opening`: each listed file's footer, checked, under an identity checked after it was read;
* :mod:`~gpuload.sources.tables`: a Delta Lake or Iceberg folder read as its table;
* :mod:`~gpuload.sources.remote`: object stores reached through fsspec or a pyarrow filesystem;
* :mod:`~gpuload.sources.fetch`: a chunk's byte ranges from a remote store, many at once, retried;
* :mod:`~gpuload.sources.retry`: which failures of a store are worth another try, and the retries;
* :mod:`~gpuload.sources.settings`: :class:`~gpuload.RemoteSettings` and :class:`~gpuload.RemoteStats`;
* :mod:`~gpuload.sources.ranges`: which bytes of a Parquet file a chunk needs.
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, __path__)  # ``gpuload.sources.X`` imported on first use
