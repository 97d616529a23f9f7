"""Data pipeline, in LLaMA-Factory's stages: registry -> reader -> converter -> processor -> packing -> loader.

Public surface: ``DataConfig``, ``build_dataloader``, ``build_eval_batches`` and ``plan_split`` (the
held-out split), ``count_valid_tokens``, plus the built-in assets ``demo_registry_path`` and
``load_tiny_tokenizer``.
"""

from mt_ray.data.assets import demo_registry_path, load_tiny_tokenizer
from mt_ray.data.config import DataConfig, load_data_config
from mt_ray.data.eval_set import build_eval_batches
from mt_ray.data.loader import StepLoader, build_dataloader, plan_split, split_micro_batches
from mt_ray.data.packing import count_valid_tokens

__all__ = [
    "DataConfig",
    "StepLoader",
    "build_dataloader",
    "build_eval_batches",
    "count_valid_tokens",
    "demo_registry_path",
    "load_data_config",
    "load_tiny_tokenizer",
    "plan_split",
    "split_micro_batches",
]
