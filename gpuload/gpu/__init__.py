"""GPU: the device adapters (CUDA runtime, cuDF decode, KvikIO cache reads).

* :mod:`~gpuload.gpu.runtime`: what the node has, what ``device="cuda"`` needs, KvikIO's mode, opening a device;
* :mod:`~gpuload.gpu.streams`: the loader's read and batch streams, the events between them, its device memory;
* :mod:`~gpuload.gpu.rmm_pool`: the opt-in RMM pool shared with torch, RMM's resource per device;
* :mod:`~gpuload.gpu.cudf_decode`: Parquet row groups decoded and converted on the GPU with pylibcudf;
* :mod:`~gpuload.gpu.kvikio_read`: cache files read into device memory, in stream order.

Nothing here imports CuPy, cuDF, KvikIO or RMM at import time: without them gpuload runs
on the CPU.
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, __path__)  # ``gpuload.gpu.X`` imported on first use

#: What an error about a missing piece of the GPU stack advises.
INSTALL_HINT = "install the gpu extra (pip install 'gpuload[gpu]') or use device='cpu'"
