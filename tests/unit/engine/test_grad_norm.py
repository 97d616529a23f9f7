"""The clip's norm² of a large unit's gradient on the CPU: torch's fp32 norm there sums each vector lane in turn
(2e-5 off at 2 M elements), which made one engine's clip differ from the cluster's exact one."""

import torch

from mt_ray.engine.step_grads import norm_sq_of


def test_a_large_gradient_norm_is_exact_to_fp32_rounding():
    grad = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0)) * 1e-2
    exact = grad.double().square().sum()
    got = norm_sq_of(grad)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)
