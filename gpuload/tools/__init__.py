"""Applications on top of the dataset: the ``gpuload`` command (:mod:`~gpuload.tools.cli`),
its cache commands (:mod:`~gpuload.tools.cache_cmds`), the demo (:mod:`~gpuload.tools.demo`)
and the profiler (:mod:`~gpuload.tools.profile`). Nothing below this package imports it."""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, __path__)  # ``gpuload.tools.X`` imported on first use
