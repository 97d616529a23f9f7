"""Checkpoints (local disk or S3) and MLflow run tracking; both hang off the trainer's callbacks.

Public surface: ``CheckpointConfig``, ``CheckpointManager``, ``CheckpointInfo``,
``CheckpointCorruptedError``, ``TrackingConfig``, ``MlflowTracker``. boto3 and mlflow (the
``tracking`` extra) are imported only when an S3 URI is used or a run starts.
"""

from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointInfo, CheckpointManager
from mt_ray.tracking.ckpt_format import CheckpointCorruptedError
from mt_ray.tracking.mlflow_tracker import MlflowTracker, TrackingConfig

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptedError",
    "CheckpointInfo",
    "CheckpointManager",
    "MlflowTracker",
    "TrackingConfig",
]
