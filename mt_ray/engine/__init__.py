"""The single-device streaming engine. Imports nothing from cluster/ or tracking/."""

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import StreamingEngine
from mt_ray.engine.results import EvalResult, StepResult

__all__ = ["EngineConfig", "EvalResult", "OptimizerConfig", "StepResult", "StreamingEngine"]
