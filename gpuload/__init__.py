"""gpuload: Parquet to training batches without starving the GPU.

Parquet is decoded and converted once, the converted columns are cached on local
disk, and every later epoch is fed from that cache by background threads, shuffled
deterministically and sharded evenly across ranks.
"""

import importlib
import pkgutil
from typing import TYPE_CHECKING

from .lazy import submodule_getattr
from .errors import (CacheError, ConfigError, CorruptCacheError, GpuloadError, NullValuesError, SchemaError,
                     SourceError)

if TYPE_CHECKING:  # imported on first use (``__getattr__`` below): ``import gpuload`` does not import torch
    from .batch import Ragged
    from .build import CacheSummary, build_cache
    from .dataset import ParquetDataset
    from .mix import Mix
    from .gpu.runtime import gpu_status, share_rmm_pool
    from .observe.diagnose import Diagnosis, diagnose
    from .observe.export import report_metrics, serve_metrics
    from .observe.metrics import Metrics
    from .observe.stats import StageStats, Stats
    from .observe.watch import Watched, watch
    from .sources.settings import RemoteSettings, RemoteStats

__version__ = "0.1.0"

__all__ = [
    "ParquetDataset", "Mix", "build_cache", "CacheSummary", "Hash", "Vocab", "Vocabulary", "Transform", "share_rmm_pool", "gpu_status",
    "Ragged",
    "watch", "Watched", "serve_metrics", "report_metrics", "Metrics", "Stats", "StageStats", "RemoteSettings", "RemoteStats", "diagnose", "Diagnosis",
    "GpuloadError", "ConfigError", "SourceError", "SchemaError", "NullValuesError", "CacheError", "CorruptCacheError",
    "__version__",
]


# where each public name lives; imported when first asked for (PEP 562), so that ``import gpuload``
# and the ``gpuload`` command start without torch, which only datasets and metrics need
_LAZY = {
    "Ragged": ".batch",
    "CacheSummary": ".build",
    "build_cache": ".build",
    "Hash": ".categorical",
    "Vocab": ".categorical",
    "Vocabulary": ".vocabulary",
    "Transform": ".transforms",
    "ParquetDataset": ".dataset",
    "Mix": ".mix",
    "gpu_status": ".gpu.runtime",
    "share_rmm_pool": ".gpu.runtime",
    "Diagnosis": ".observe.diagnose",
    "diagnose": ".observe.diagnose",
    "serve_metrics": ".observe.export",
    "report_metrics": ".observe.export",
    "Metrics": ".observe.metrics",
    "StageStats": ".observe.stats",
    "Stats": ".observe.stats",
    "Watched": ".observe.watch",
    "watch": ".observe.watch",
    "RemoteSettings": ".sources.settings",
    "RemoteStats": ".sources.settings",
}


_submodule = submodule_getattr(__name__, __path__)


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        return _submodule(name)  # ``gpuload.decode``, ``gpuload.gpu``: imported when first used
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


_HIDDEN = {"importlib", "pkgutil", "TYPE_CHECKING", "submodule_getattr", "_LAZY", "_HIDDEN", "_submodule",
           "__getattr__", "__dir__"}


def __dir__():
    """The public names (imported or not yet) and the submodules, as when ``import gpuload`` imported them."""
    return sorted((set(globals()) - _HIDDEN) | set(__all__) | {m.name for m in pkgutil.iter_modules(__path__)})
