"""gpuload: Parquet to training batches without starving the GPU.

Parquet is decoded and converted once, the converted columns are cached on local
disk, and every later epoch is fed from that cache by background threads, shuffled
deterministically and sharded evenly across ranks.
"""

from .batch import Ragged
from .build import CacheSummary, build_cache
from .dataset import ParquetDataset
from .observe.diagnose import Diagnosis, diagnose
from .sources.settings import RemoteSettings, RemoteStats
from .gpu.runtime import gpu_status, share_rmm_pool
from .errors import (CacheError, ConfigError, CorruptCacheError, GpuloadError, NullValuesError, SchemaError,
                     SourceError)
from .observe.metrics import Metrics
from .observe.stats import StageStats, Stats
from .observe.watch import Watched, watch

__version__ = "0.1.0"

__all__ = [
    "ParquetDataset",
    "build_cache",
    "CacheSummary",
    "share_rmm_pool",
    "gpu_status",
    "Ragged",
    "watch",
    "Watched",
    "Metrics",
    "Stats",
    "StageStats",
    "RemoteSettings",
    "RemoteStats",
    "diagnose",
    "Diagnosis",
    "GpuloadError",
    "ConfigError",
    "SourceError",
    "SchemaError",
    "NullValuesError",
    "CacheError",
    "CorruptCacheError",
    "__version__",
]
