"""The single-device streaming engine. Imports nothing from cluster/ or tracking/."""

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import EvalResult, StepResult, StreamingEngine

__all__ = ["EngineConfig", "EvalResult", "OptimizerConfig", "StepResult", "StreamingEngine"]
