"""Data-parallel training on Ray: engine workers per GPU, a coordinator holding the state.

Public surface: `run_data_parallel` (one call), `DataParallelTrainer` (the controller, for
callers that want the loop), `ClusterConfig`, `DataParallelResult`, `FailureEvent`, `ClusterError`.
"""

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.driver import (
    DataParallelResult,
    DataParallelTrainer,
    FailureEvent,
    count_loss_tokens,
    run_data_parallel,
    shard_batch,
)
from mt_ray.cluster.errors import ClusterError

__all__ = [
    "ClusterConfig", "ClusterError", "DataParallelResult", "DataParallelTrainer", "FailureEvent",
    "count_loss_tokens", "run_data_parallel", "shard_batch",
]
