"""Data-parallel training on Ray: engine workers per GPU, a coordinator shard per node holding the state.

Public surface: `run_data_parallel` (one call), `DataParallelTrainer` (the controller, for
callers that want the loop), `ClusterConfig`, `DataParallelResult`, `FailureEvent`, `ClusterError`, `ClusterLostError`.
The names that need Ray are imported on first use, so the run config can hold a `ClusterConfig`
without importing Ray (an optional dependency) when no cluster is used.
"""

from __future__ import annotations

from typing import Any

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.errors import ClusterError, ClusterLostError

_DRIVER_NAMES = {"DataParallelResult", "DataParallelTrainer", "FailureEvent", "run_data_parallel"}
_SPLIT_NAMES = {"count_loss_tokens", "shard_batch"}

__all__ = ["ClusterConfig", "ClusterError", "ClusterLostError", *sorted(_DRIVER_NAMES | _SPLIT_NAMES)]


def __getattr__(name: str) -> Any:
    if name in _DRIVER_NAMES:
        from mt_ray.cluster import driver

        return getattr(driver, name)
    if name in _SPLIT_NAMES:
        from mt_ray.cluster import split

        return getattr(split, name)
    raise AttributeError(f"module 'mt_ray.cluster' has no attribute {name!r}")
