"""GPU: the device adapters (CUDA runtime, cuDF decode, KvikIO cache reads).

* :mod:`~gpuload.gpu.runtime`: what the node has; the loader's device memory, streams and events;
* :mod:`~gpuload.gpu.cudf_decode`: Parquet row groups decoded and converted on the GPU with pylibcudf;
* :mod:`~gpuload.gpu.kvikio_read`: cache files read into device memory, in stream order.

Nothing here imports CuPy, cuDF, KvikIO or RMM at import time: without them gpuload runs
on the CPU.
"""
