"""Optimizer state kept on the GPU (`engine.device_optimizer_units`): the Triton AdamW is the host kernel's twin bit
for bit, and an engine that keeps units on the GPU trains to the same bits as one that updates all on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.host_adamw import AdamStep, adamw_step
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, tiny_batches, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():  # Triton comes with torch's CUDA builds only
    from mt_ray.engine.device_adamw import adamw_step as device_step

CLIP = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("beta1", "clip", "decay"), [(0.9, 0.37, 0.1), (0.3, 1.0, 0.0)])
def test_the_triton_adamw_is_the_host_kernel_bit_for_bit(grad_dtype, beta1, clip, decay):
    n = (1 << 20) + 13  # a remainder past the last full eight
    g = torch.Generator().manual_seed(0)
    state = [torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6]
    grad = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    host = [t.clone() for t in state]
    cuda = [t.cuda() for t in state]
    for step in (1, 2, 7):
        adam = AdamStep(1e-3, beta1, 0.999, 1e-8, decay, step, clip)
        adamw_step(*host, grad, adam)
        device_step(*cuda, grad.cuda(), adam)
    torch.cuda.synchronize()
    for h, c, name in zip(host, cuda, ("master", "exp_avg", "exp_avg_sq"), strict=True):
        diff = np.flatnonzero((h != c.cpu()).numpy())
        assert diff.size == 0, f"{name}: {diff.size} elements differ, first at {diff[:5]}"


def test_one_launch_over_a_part_is_the_host_s_calls_of_chunk_elements():
    n, chunk = 3 * 1000 + 5, 1000  # calls of 1000, 1000, 1000 and 5: a remainder at the end of each
    g = torch.Generator().manual_seed(1)
    state = [torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6]
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    host = [t.clone() for t in state]
    cuda = [t.cuda() for t in state]
    adam = AdamStep(1e-3, 0.9, 0.999, 1e-8, 0.1, 3, 0.5)
    for lo in range(0, n, chunk):
        adamw_step(*(t[lo : lo + chunk] for t in host), grad[lo : lo + chunk], adam)
    device_step(*cuda, grad.cuda(), adam, chunk=chunk)
    for h, c in zip(host, cuda, strict=True):
        assert torch.equal(h, c.cpu())


def _train(units: int | str, steps: int = 3):
    cfg = tiny_config("qwen3_moe")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", compute_dtype="bf16", grad_dtype="compute",
                                                         checkpoint_every=2, device_optimizer_units=units),
                             CLIP, total_steps=steps)
    try:
        engine.load_state_dict(reference_model(cfg).state_dict())
        losses = [engine.train_step(tiny_batches(seed=0)).loss.item() for _ in range(steps)]
        kept = list(engine.store.on_device.units) if engine.store.on_device else []
        tensors, _ = engine.checkpoint_state()
        return losses, {k: v.clone() for k, v in tensors.items()}, kept
    finally:
        engine.close()


def test_an_engine_keeping_units_on_the_gpu_trains_to_the_host_s_bits():
    host = _train(0)
    auto = _train("auto")  # a tiny model: every unit fits
    some = _train(2)
    assert host[2] == [] and some[2] == ["embed", "layers.0"] and len(auto[2]) == len(discover(tiny_config("qwen3_moe")).units)
    assert auto[0] == host[0] == some[0] and host[0][-1] < host[0][0]
    for name, t in host[1].items():  # master and both moments
        assert torch.equal(auto[1][name], t) and torch.equal(some[1][name], t), name
