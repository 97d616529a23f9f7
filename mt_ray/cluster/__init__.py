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

# Each lazily imported name, by the module that defines it (Ray is imported with the driver).
_LAZY = {"DataParallelResult": "driver", "DataParallelTrainer": "driver", "FailureEvent": "driver",
         "run_data_parallel": "run", "count_loss_tokens": "split", "shard_batch": "split"}

__all__ = ["ClusterConfig", "ClusterError", "ClusterLostError", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mt_ray.cluster.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mt_ray.cluster' has no attribute {name!r}")
