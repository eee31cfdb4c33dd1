"""Cache: the converted chunks on local disk, and everything that touches that folder.

* :mod:`~gpuload.cache.store`: :class:`~gpuload.cache.store.ChunkCache`, chunks got or built by key;
* :mod:`~gpuload.cache.paths`: where a cache lives, what its files are called (:class:`~gpuload.cache.paths.ChunkKey`);
* :mod:`~gpuload.cache.chunkfile`: the file format, one self-describing, checked chunk per file;
* :mod:`~gpuload.cache.fs`: every open, write, rename, lock and delete inside the cache root;
* :mod:`~gpuload.cache.footers`: Parquet footers kept in the cache, so reopening reads no Parquet;
* :mod:`~gpuload.cache.admin`: ``gpuload cache info``, ``verify`` and ``clear``.
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, __path__)  # ``gpuload.cache.X`` imported on first use
