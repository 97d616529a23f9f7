"""`kernels: liger` where it cannot run fails when the config is read or the engine is built."""

import pytest
import torch
from pydantic import ValidationError

from mt_ray.config.run import validate_run_config
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


def test_liger_with_an_explicit_cpu_device_fails_at_load_time():
    with pytest.raises(ValidationError, match="CUDA only.*use kernels: torch"):
        EngineConfig(device="cpu", kernels="liger")
    with pytest.raises(ConfigError, match="engine: kernels: liger runs Triton kernels on CUDA only"):
        validate_run_config({"engine": {"device": "cpu", "kernels": "liger"}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' must resolve to the CPU")
def test_liger_on_a_machine_without_cuda_fails_at_engine_construction():
    cfg = EngineConfig(device="auto", kernels="liger")
    with pytest.raises(ConfigError, match="device is cpu; use kernels: torch"):
        StreamingEngine(discover(tiny_config("llama", num_hidden_layers=2)), cfg, OptimizerConfig(), total_steps=1)
