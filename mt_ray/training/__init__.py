"""The training loop around the engine: data in, metrics and exports out, callbacks for tracking."""

from mt_ray.training.callbacks import Callback
from mt_ray.training.model_source import build_model_spec
from mt_ray.training.trainer import Trainer

__all__ = ["Callback", "Trainer", "build_model_spec"]
