"""Sources: where Parquet comes from, and how its bytes are read.

* :mod:`~gpuload.sources.listing`: list local and remote files, fingerprint them, read their footers;
* :mod:`~gpuload.sources.remote`: object stores reached through fsspec or a pyarrow filesystem;
* :mod:`~gpuload.sources.fetch`: a chunk's byte ranges from a remote store, many at once, retried;
* :mod:`~gpuload.sources.ranges`: which bytes of a Parquet file a chunk needs.
"""
