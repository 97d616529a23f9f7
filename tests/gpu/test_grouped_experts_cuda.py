"""The grouped experts path on CUDA: in bf16 its forward is transformers' grouped_mm's to the bit and its gradients
no further from fp32's than transformers' own; in fp32 it equals the family's eager experts. (Every MoE family of the
sweeps also trains through it on CUDA in test_families_cuda.py, the engine's default.)"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from mt_ray.models.grouped_experts import IMPLEMENTATION, apply_grouped_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bank(dtype: torch.dtype) -> Qwen3MoeExperts:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4)
    bank = Qwen3MoeExperts(cfg)
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return bank.to("cuda", dtype)


def _run(bank: Qwen3MoeExperts, impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output and the gradients of input, routing weights and both banks, for one routing of 1000 tokens."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1000, 128, device="cuda", generator=g).to(dtype).requires_grad_()
    weights, index = torch.randn(1000, 16, device="cuda", generator=g).softmax(-1).topk(4, dim=-1)
    weights = weights.to(dtype).requires_grad_()
    bank.zero_grad()
    bank.config._experts_implementation = impl
    out = bank(x, index, weights)
    out.backward(torch.randn(out.shape, device="cuda", generator=g).to(dtype))
    return [out.detach(), x.grad, weights.grad, bank.gate_up_proj.grad, bank.down_proj.grad]


def test_bf16_forward_is_grouped_mm_s_and_gradients_as_close_to_fp32():
    bank = _bank(torch.bfloat16)
    assert apply_grouped_experts(bank) is None and bank.config._experts_implementation == IMPLEMENTATION
    ours, theirs = _run(bank, IMPLEMENTATION, torch.bfloat16), _run(bank, "grouped_mm", torch.bfloat16)
    exact = _run(_bank(torch.float32), "eager", torch.float32)
    assert torch.equal(ours[0], theirs[0])
    for name, a, b, ref in zip(["out", "x", "weights", "gate_up", "down"], ours, theirs, exact, strict=True):
        our_err, their_err = (a.float() - ref).abs().max(), (b.float() - ref).abs().max()
        assert our_err <= 1.5 * their_err + 1e-3 * ref.abs().max(), name


def test_fp32_equals_the_eager_experts():
    bank = _bank(torch.float32)
    apply_grouped_experts(bank)
    for a, b in zip(_run(bank, IMPLEMENTATION, torch.float32), _run(bank, "eager", torch.float32), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
